"""The control plane: pooled connections, deadlines, retries only where safe, bearer tokens."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from asyncsync.config import ServerConfig
from asyncsync.control import AIOHTTP_SERVER_KEEPALIVE_S, UVICORN_KEEPALIVE_S, ControlLoop, HttpClient, RetryPolicy, ServerError
from asyncsync.engines import make_engine
from asyncsync.launch.http import wait_healthy
from asyncsync.models import build_model
from asyncsync.receivers.reference.app import ReferenceServer

from conftest import TINY, serve_every_path


class Recorder:
    """An aiohttp app that counts calls per route and remembers each caller's port (one per connection)."""

    def __init__(self, fail_first: int = 0, failure: str = "503"):
        self.calls: Counter[str] = Counter()
        self.peer_ports: set[int] = set()
        self.fail_first, self.failure = fail_first, failure

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.calls[request.method + " " + request.path] += 1
        self.peer_ports.add(request.transport.get_extra_info("peername")[1])
        if request.path == "/slow":
            await asyncio.sleep(30)
        if self.calls[request.method + " " + request.path] <= self.fail_first:
            if self.failure == "disconnect":
                request.transport.close()  # the connection dies before any answer
                return web.Response()
            return web.json_response({"error": "warming up"}, status=503)
        return web.json_response({"ok": True})

    async def start(self) -> TestServer:
        return await serve_every_path(self.handle)


async def test_one_connection_is_reused_for_every_call():
    recorder = Recorder()
    server = await recorder.start()
    client = HttpClient(str(server.make_url("")), keepalive_s=30)
    try:
        for _ in range(20):
            assert await client.get("/version") == {"ok": True}
            assert await client.post("/update", {"version": 1}) == {"ok": True}
        assert sum(recorder.calls.values()) == 40
        assert len(recorder.peer_ports) == 1, f"expected one pooled connection, saw ports {recorder.peer_ports}"
    finally:
        await client.close()
        await server.close()


async def test_a_slow_call_fails_at_its_deadline():
    recorder = Recorder()
    server = await recorder.start()
    client = HttpClient(str(server.make_url("")))
    try:
        start = time.monotonic()
        with pytest.raises(ServerError, match=r"POST /slow got no answer within 0\.3s") as err:
            await client.post("/slow", {}, timeout_s=0.3)
        assert time.monotonic() - start < 2.0
        assert err.value.timed_out and not err.value.transient
    finally:
        await client.close()
        await server.close()


@pytest.mark.parametrize("failure", ["503", "disconnect"])
async def test_reads_are_retried_after_transient_failures_and_updates_never(failure):
    recorder = Recorder(fail_first=2, failure=failure)
    server = await recorder.start()
    client = HttpClient(str(server.make_url("")), retry=RetryPolicy(attempts=4, first_delay_s=0.01))
    try:
        assert await client.get("/version") == {"ok": True}
        assert recorder.calls["GET /version"] == 3, "two transient failures, then the answer"
        with pytest.raises(ServerError) as err:
            await client.post("/update", {"version": 1})
        assert err.value.transient
        assert recorder.calls["POST /update"] == 1, "an update must never be sent twice"
    finally:
        await client.close()
        await server.close()


async def test_resuming_after_a_server_error_survives_the_dropped_connection():
    """Like uvicorn after an unhandled error: a 500 without ``Connection: close``, then a reset for
    whatever comes next on that socket (vLLM did this to the /resume sent after a refused update).
    Resuming is harmless to repeat, so it is retried on a fresh connection."""
    connections = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        request = await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(int(request.split(b"Content-Length: ")[1].split(b"\r\n")[0]))
        status, body = (b"500 Internal Server Error", b'{"error": "boom"}') if b"/crash" in request else (b"200 OK", b"{}")
        writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        if await reader.read(1):
            writer.transport.abort()  # a second request on this connection: reset it

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    client = HttpClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
    try:
        with pytest.raises(ServerError, match="HTTP 500: boom"):
            await client.post("/crash", {})
        assert await client.post("/resume", {}, idempotent=True) == {}
        assert connections == 2
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def test_retries_stop_at_the_attempt_limit():
    recorder = Recorder(fail_first=100)
    server = await recorder.start()
    client = HttpClient(str(server.make_url("")), retry=RetryPolicy(attempts=3, first_delay_s=0.01))
    try:
        with pytest.raises(ServerError, match="HTTP 503: warming up"):
            await client.get("/health")
        assert recorder.calls["GET /health"] == 3
    finally:
        await client.close()
        await server.close()


async def test_engine_calls_need_the_bearer_token():
    server = TestServer(ReferenceServer(build_model(TINY), token="s3cret").app(), host="127.0.0.1")
    await server.start_server()
    url = str(server.make_url("")).rstrip("/")
    anonymous = make_engine(ServerConfig(url), 10)
    trusted = make_engine(ServerConfig(url, token="s3cret"), 10)
    try:
        with pytest.raises(ServerError, match="HTTP 401: missing or wrong bearer token") as err:
            await anonymous.version()
        assert err.value.status == 401
        assert await trusted.version() == 0
        await trusted.health()
        # the launchers' blocking wait: healthy with the token; without it refused at once, not after 60 s
        assert await asyncio.to_thread(wait_healthy, url, 10, "server", token="s3cret") < 10
        start = time.monotonic()
        with pytest.raises(PermissionError, match="server answered 401 to .*/health: it wants a bearer token"):
            await asyncio.to_thread(wait_healthy, url, 60, "server")
        assert time.monotonic() - start < 10
    finally:
        await anonymous.close()
        await trusted.close()
        await server.close()


@pytest.mark.parametrize("kind, server_keepalive_s", [
    ("reference", AIOHTTP_SERVER_KEEPALIVE_S), ("sglang", UVICORN_KEEPALIVE_S),
])
async def test_each_kind_keeps_connections_alive_for_less_than_its_server(kind, server_keepalive_s):
    engine = make_engine(ServerConfig("http://127.0.0.1:9", kind=kind), 10)
    try:
        assert 0 < engine.keepalive_s < server_keepalive_s
        assert engine.http._get_session().connector._keepalive_timeout == engine.keepalive_s
    finally:
        await engine.close()


async def test_vllm_reuses_no_connection():
    engine = make_engine(ServerConfig("http://127.0.0.1:9", kind="vllm"), 10)
    try:
        assert engine.keepalive_s is None and engine.http._get_session().connector.force_close
    finally:
        await engine.close()


def test_control_loop_runs_on_uvloop_when_installed():
    uvloop = pytest.importorskip("uvloop")
    control = ControlLoop()
    try:
        assert isinstance(control.loop, uvloop.Loop)
    finally:
        control.close()


async def test_vllm_calls_never_go_out_on_a_connection_the_server_closed_after_a_failure():
    """uvicorn (vLLM) closes the connection right after answering 500 for an RPC that raised; the next
    call, the abort's discard (not idempotent, never retried), must not go out on it. The stand-in
    drops any request that arrives on a connection it answered 500 on."""
    failed: set[int] = set()

    async def handle(request: web.Request) -> web.StreamResponse:
        port = request.transport.get_extra_info("peername")[1]
        if port in failed:
            request.transport.close()  # the connection is gone: the request is never read
            return web.Response()
        if request.path == "/fail":
            failed.add(port)
            return web.json_response({"error": "RPC failed"}, status=500)
        return web.json_response({"ok": True})

    server = await serve_every_path(handle)
    engine = make_engine(ServerConfig(str(server.make_url("")).rstrip("/"), kind="vllm"), 10)
    try:
        for _ in range(3):
            with pytest.raises(ServerError, match="HTTP 500: RPC failed"):
                await engine.http.post("/fail")
            assert await engine.http.post("/update_weights", {"update_info": {"discard": 1}}) == {"ok": True}
    finally:
        await engine.close()
        await server.close()
