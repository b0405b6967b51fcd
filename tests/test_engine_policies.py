"""vLLM's update policies, against a stand-in that records calls (the real server: test_vllm_integration)."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from asyncsync.config import ConfigError, ServerConfig, WeightSyncConfig
from asyncsync.transport.control import ServerError
from asyncsync.engines import make_engine
from asyncsync.protocol.wire import BucketMeta, UpdateRequest

from conftest import serve_every_path

REQUEST = UpdateRequest(3, (BucketMeta(("w",), ("float32",), ((2,),), 8),), checksum=True)


class FakeVllm:
    """Answers vLLM's weight-transfer routes like vLLM does; ``fail`` maps a path to an HTTP 500."""

    def __init__(self, fail: frozenset[str] = frozenset(), reset_ok: bool = True):
        self.calls: list[str] = []
        self.fail, self.reset_ok = fail, reset_ok
        self.version = "default"

    async def handle(self, request: web.Request) -> web.Response:
        call = f"{request.method} {request.path_qs}"
        self.calls.append(call)
        if request.path in self.fail:
            return web.json_response({"error": {"message": f"{request.path} failed"}}, status=500)
        if request.path == "/finish_weight_update":
            self.version = (await request.json())["weight_version"]
        if request.path == "/reset_prefix_cache":
            return web.json_response({"success": self.reset_ok})
        return web.json_response({"weight_version": self.version})

    async def start(self) -> TestServer:
        return await serve_every_path(self.handle)


async def sync_once(fake: FakeVllm, **policies: bool) -> int:
    server = await fake.start()
    engine = make_engine(ServerConfig(str(server.make_url("")).rstrip("/"), kind="vllm", **policies), 10)
    try:  # EngineClient's contract: begin, update, end; abort after any of them failed
        try:
            await engine.begin(3)
            await engine.update(REQUEST)
            return await engine.end(3)
        except ServerError:
            await engine.abort(3)
            raise
    finally:
        await engine.close()
        await server.close()


async def test_pause_update_finish_reset_resume_in_order():
    fake = FakeVllm()
    assert await sync_once(fake) == 3
    assert fake.calls == [
        "POST /pause?mode=keep", "POST /start_weight_update", "POST /update_weights",
        "POST /finish_weight_update", "POST /reset_prefix_cache?reset_running_requests=true",
        "POST /resume", "GET /weight_info",
    ]


async def test_policies_can_be_switched_off():
    fake = FakeVllm()
    assert await sync_once(fake, pause=False, reset_prefix_cache=False) == 3
    assert fake.calls == ["POST /start_weight_update", "POST /update_weights", "POST /finish_weight_update", "GET /weight_info"]


@pytest.mark.parametrize("failing", ["/start_weight_update", "/update_weights", "/finish_weight_update"])
async def test_generation_resumes_whatever_step_fails(failing):
    fake = FakeVllm(fail=frozenset({failing}))
    with pytest.raises(ServerError, match=f"HTTP 500: {failing} failed"):
        await sync_once(fake)
    assert fake.calls[-1] == "POST /resume"
    assert fake.calls.count("POST /resume") == 1


async def test_a_failed_prefix_cache_reset_is_reported_after_resuming():
    fake = FakeVllm(reset_ok=False)
    with pytest.raises(ServerError, match="version 3 is live, but /reset_prefix_cache"):
        await sync_once(fake)
    assert fake.calls[-1] == "POST /resume"


def test_policies_are_validated_per_server():
    cfg = WeightSyncConfig.from_dict({"servers": [{"url": "http://127.0.0.1:1", "kind": "vllm", "pause": False}]})
    assert cfg.servers[0].pause is False and cfg.servers[0].reset_prefix_cache is True
    with pytest.raises(ConfigError, match=r"servers\[0\]\.reset_prefix_cache: expected true or false"):
        WeightSyncConfig.from_dict({"servers": [{"url": "http://127.0.0.1:1", "reset_prefix_cache": "yes"}]})
