"""vLLM's update policies and receive modes, against a stand-in that records calls and keeps vLLM's
update session as vLLM 0.32's worker does (the real server: test_vllm_integration)."""

from __future__ import annotations

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from asyncsync.config import ConfigError, ServerConfig, WeightSyncConfig
from asyncsync.engines import make_engine
from asyncsync.engines.base import EngineClient
from asyncsync.protocol.wire import BucketMeta, UpdateRequest
from asyncsync.control import ServerError

from conftest import serve_every_path

REQUEST = UpdateRequest(3, (BucketMeta(("w",), ("float32",), ((2,),), 8),), checksum=True)
RESET = "POST /reset_prefix_cache?reset_running_requests=true"
DISCARD = {"update_info": {"discard": 3}}


class FakeVllm:
    """Answers vLLM's weight-transfer routes like vLLM 0.32 does. Its worker's update session: a start
    while one is open fails, updates and finishes need one, an update that fails ends it (vLLM resets
    it), a finish that fails does not (the trap). ``fail`` maps a path to an HTTP 500 every time,
    ``fail_once`` the first time only."""

    def __init__(self, fail: frozenset[str] = frozenset(), fail_once: frozenset[str] = frozenset(),
                 reset_ok: bool = True, open_session: bool = False):
        self.calls: list[str] = []
        self.bodies: dict[str, list[object]] = {}
        self.fail, self.fail_once, self.reset_ok = fail, set(fail_once), reset_ok
        self.version = "default"
        self.active = open_session

    async def handle(self, request: web.Request) -> web.Response:
        self.calls.append(f"{request.method} {request.path_qs}")
        body = await request.json() if request.can_read_body else None
        self.bodies.setdefault(request.path, []).append(body)
        path = request.path
        if path in self.fail or path in self.fail_once:
            self.fail_once.discard(path)
            if path == "/update_weights":
                self.active = False
            return self.error(f"{path} failed")
        if path == "/start_weight_update":
            if self.active:
                return self.error("start_weight_update called while a weight update is already active. "
                                  "Call finish_weight_update first.")
            self.active = True
        elif path in ("/update_weights", "/finish_weight_update"):
            if not self.active:
                return self.error(f"{path[1:]} called without a matching start_weight_update.")
            if path == "/finish_weight_update":
                self.active = False
                if body and body.get("weight_version"):
                    self.version = body["weight_version"]
        elif path == "/reset_prefix_cache":
            return web.json_response({"success": self.reset_ok})
        return web.json_response({"weight_version": self.version})

    @staticmethod
    def error(message: str) -> web.Response:
        return web.json_response({"error": {"message": message, "type": "InternalServerError", "code": 500}}, status=500)

    async def start(self) -> TestServer:
        return await serve_every_path(self.handle)


async def sync_once(fake: FakeVllm, server: TestServer | None = None, **policies: object) -> tuple[int, EngineClient]:
    """One version through the EngineClient contract: begin, update, end; abort after any failed."""
    own = server is None
    server = server or await fake.start()
    engine = make_engine(ServerConfig(str(server.make_url("")).rstrip("/"), kind="vllm", **policies), 10)  # type: ignore[arg-type]
    try:
        try:
            await engine.begin(3)
            await engine.update(REQUEST)
            return await engine.end(3), engine
        except ServerError:
            await engine.abort(3)
            raise
    finally:
        await engine.close()
        if own:
            await server.close()


async def test_background_receive_pauses_only_around_the_load():
    fake = FakeVllm()
    version, engine = await sync_once(fake)
    assert version == 3
    assert fake.calls == [
        "POST /start_weight_update", "POST /update_weights",
        "POST /pause?mode=wait&clear_cache=false", "POST /update_weights", "POST /finish_weight_update", RESET,
        "POST /resume", "GET /weight_info",
    ]
    assert fake.bodies["/update_weights"][0]["update_info"]["receive"] == "background"
    assert fake.bodies["/update_weights"][1] == {"update_info": {"commit": 3}}, "the load is the trainer's commit"
    assert engine.receives_in_background and engine.last_switch_s is not None and engine.last_switch_s > 0
    assert not fake.active


async def test_in_rpc_receive_pauses_from_begin_to_end():
    """The session opens before the pause: the worker's pause guard watches every pause a trainer
    makes (``receivers/vllm/guard.py``), so none is left behind by a trainer that dies."""
    fake = FakeVllm()
    version, engine = await sync_once(fake, receive="in_rpc")
    assert version == 3
    assert fake.calls == [
        "POST /start_weight_update", "POST /pause?mode=wait&clear_cache=false", "POST /update_weights",
        "POST /finish_weight_update", RESET, "POST /resume", "GET /weight_info",
    ]
    assert "receive" not in fake.bodies["/update_weights"][0]["update_info"]
    assert not engine.receives_in_background


async def test_mix_versions_freezes_requests_instead_of_draining_them():
    fake = FakeVllm()
    await sync_once(fake, mix_versions=True)
    assert "POST /pause?mode=keep&clear_cache=false" in fake.calls


async def test_policies_can_be_switched_off():
    fake = FakeVllm()
    assert (await sync_once(fake, pause=False, mix_versions=True, reset_prefix_cache=False))[0] == 3
    assert fake.calls == ["POST /start_weight_update", "POST /update_weights", "POST /update_weights",
                          "POST /finish_weight_update", "GET /weight_info"]


@pytest.mark.parametrize("receive", ["background", "in_rpc"])
@pytest.mark.parametrize("failing", ["/start_weight_update", "/update_weights", "/pause", "/finish_weight_update"])
async def test_a_failed_step_leaves_generation_running_and_no_update_session_open(failing, receive):
    """Whatever fails, generation resumes exactly once and vLLM's session is closed; a version the
    worker received in the background is discarded (never loaded), and the next version goes through."""
    fake = FakeVllm(fail_once=frozenset({failing}))
    server = await fake.start()
    try:
        with pytest.raises(ServerError, match=f"HTTP 500: {failing} failed"):
            await sync_once(fake, server, receive=receive)
        if "POST /pause?mode=wait&clear_cache=false" in fake.calls:
            assert fake.calls.count("POST /resume") == 1, fake.calls
        assert not fake.active, f"vLLM's update session was left open: {fake.calls}"
        if failing == "/finish_weight_update":  # the trap: vLLM kept the session; the client ended it
            assert fake.bodies["/update_weights"][-1] == DISCARD
            assert fake.bodies["/finish_weight_update"][-1] is None, "ended without setting a version"
        assert fake.version == "default"
        fake.calls.clear()
        assert (await sync_once(fake, server, receive=receive))[0] == 3
    finally:
        await server.close()


async def test_an_update_session_left_open_is_ended_before_the_next_version():
    """A trainer that died mid-version left vLLM's session open: the next begin discards what the
    worker may hold of it, ends the session and starts its own."""
    fake = FakeVllm(open_session=True)
    assert (await sync_once(fake))[0] == 3
    assert fake.calls[:4] == ["POST /start_weight_update", "POST /update_weights", "POST /finish_weight_update",
                              "POST /start_weight_update"]
    assert fake.bodies["/update_weights"][0] == DISCARD


async def test_a_failed_prefix_cache_reset_is_reported_after_resuming():
    fake = FakeVllm(reset_ok=False)
    with pytest.raises(ServerError, match="version 3 is live, but /reset_prefix_cache"):
        await sync_once(fake)
    assert fake.calls[-1] == "POST /resume"


def test_policies_are_validated_per_server():
    cfg = WeightSyncConfig.from_dict({"servers": [{"url": "http://127.0.0.1:1", "kind": "vllm", "pause": False,
                                                    "mix_versions": True}]})
    server = cfg.servers[0]
    assert (server.pause, server.mix_versions, server.reset_prefix_cache, server.receive) == (False, True, True, "background")
    with pytest.raises(ConfigError, match=r"servers\[0\]\.reset_prefix_cache: expected true or false"):
        WeightSyncConfig.from_dict({"servers": [{"url": "http://127.0.0.1:1", "reset_prefix_cache": "yes"}]})
    with pytest.raises(ConfigError, match=r"servers\[0\]\.receive: 'thread' is not one of \['background', 'in_rpc'\]"):
        WeightSyncConfig.from_dict({"servers": [{"url": "http://127.0.0.1:1", "kind": "vllm", "receive": "thread"}]})
    with pytest.raises(ConfigError, match=r"servers\[0\]\.pause: false lets vLLM switch versions under running "
                                          r"requests.*set mix_versions: true"):
        WeightSyncConfig.from_dict({"servers": [{"url": "http://127.0.0.1:1", "kind": "vllm", "pause": False}]})


class FakeVllm033:
    """Rollouts as vLLM 0.33 answers them: while ``paused_for`` more requests, 503 "Generation is
    paused" (``engine_paused``, never scheduled); ``/v1/completions`` reports ``weight_versions`` spans
    when asked (``return_weight_versions``). A 503 of another kind is answered for ``/fail``."""

    def __init__(self, paused_for: int):
        self.paused_for, self.completions = paused_for, 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else None
        if request.path == "/inference/v1/generate":
            return web.json_response({"detail": "Not Found"}, status=404)  # no --enable-scale-out
        if request.path == "/weight_info":
            return web.json_response({"weight_version": "7"})
        if self.paused_for > 0:
            self.paused_for -= 1
            return web.json_response({"error": {"message": "Generation is paused. Please retry after it resumes.",
                                                "type": "ServiceUnavailableError", "code": 503}}, status=503)
        self.completions += 1
        spans = [{"version": "7", "start": 0, "end": 4}] if body.get("return_weight_versions") else None
        return web.json_response({"choices": [{"index": 0, "token_ids": [1, 2, 3, 4], "weight_versions": spans}]})


async def test_a_paused_vllm_033_is_asked_again_and_its_spans_make_the_rollout_exact():
    fake = FakeVllm033(paused_for=3)
    server = await serve_every_path(fake.handle)
    engine = make_engine(ServerConfig(str(server.make_url("")).rstrip("/"), kind="vllm"), 10)
    try:
        gen = await engine.generate([5, 6], 1, 4, 0.0, 0)
        assert (gen.completions, gen.version, gen.exact) == ([[1, 2, 3, 4]], 7, True)
        assert fake.completions == 1 and fake.paused_for == 0, "sent again until vLLM took it, once"
    finally:
        await engine.close()
        await server.close()


async def test_a_server_paused_past_the_deadline_fails_the_rollout_with_vllms_answer():
    fake = FakeVllm033(paused_for=10**6)
    server = await serve_every_path(fake.handle)
    engine = make_engine(ServerConfig(str(server.make_url("")).rstrip("/"), kind="vllm"), 1.5)
    try:
        with pytest.raises(ServerError, match="Generation is paused"):
            await engine.generate([5, 6], 1, 4, 0.0, 0)
        assert fake.completions == 0
    finally:
        await engine.close()
        await server.close()


async def test_sglang_scores_a_probe_from_its_input_token_logprobs():
    """SGLang's ``/generate`` with ``return_logprob`` from ``logprob_start_len: 0`` answers, in
    ``meta_info.input_token_logprobs``, one ``(logprob, token_id, text)`` per prompt token, the first
    without a logprob (``tokenizer_manager.detokenize_logprob_tokens`` in the sglang 0.5.23 wheel)."""
    asked: list[dict] = []

    async def handle(request: web.Request) -> web.Response:
        if request.path == "/model_info":
            return web.json_response({"weight_version": "4"})
        body = await request.json()
        asked.append(body)
        ids = body["input_ids"]
        entries = [[None, ids[0], None]] + [[-0.5 * i, t, None] for i, t in enumerate(ids[1:], 1)]
        return web.json_response({"output_ids": [0], "meta_info": {"input_token_logprobs": entries,
                                                                   "weight_version": "4"}})

    server = await serve_every_path(handle)
    engine = make_engine(ServerConfig(str(server.make_url("")).rstrip("/"), kind="sglang"), 10)
    try:
        scored = await engine.score([7, 8, 9])
        assert scored.logprobs == (-0.5, -1.0) and scored.version == 4
        assert asked == [{"input_ids": [7, 8, 9], "return_logprob": True, "logprob_start_len": 0,
                          "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}]
    finally:
        await engine.close()
        await server.close()
