"""Client of vLLM's weight-transfer routes, for a server started with asyncsync's backend.

The server side is ``asyncsync.receivers.vllm``: a ``WeightTransferEngine`` registered under the backend
name ``asyncsync`` (``--weight-transfer-config '{"backend": "asyncsync"}'``, with
``VLLM_SERVER_DEV_MODE=1`` for the routes). One version, as vLLM expects it::

    POST /pause?mode=keep                          policy ``pause``: in-flight requests freeze
    POST /start_weight_update
    POST /update_weights {"update_info": UpdateRequest}   answered once every bucket is received,
                                                          verified and loaded
    POST /finish_weight_update {"weight_version": "7"}    vLLM adopts the version
    POST /reset_prefix_cache?reset_running_requests=true  policy ``reset_prefix_cache``
    POST /resume
    GET  /weight_info                              {"weight_version": "7"}: the live version

vLLM 0.32's routes cannot tell the trainer which tensor names the engine expects (the checkpoint's):
``/init_weight_transfer_engine`` answers a fixed message, ``/weight_info`` only the version, and
``/collective_rpc`` calls only methods of vLLM's worker. So ``expected_names`` stays None: the
trainer sends a tied weight once, as the checkpoint saved from a tied model stores it.
"""

from __future__ import annotations

from asyncsync.config import ServerConfig
from asyncsync.transport.control import UVICORN_KEEPALIVE_S, ServerError
from asyncsync.protocol.wire import GroupSpec
from asyncsync.engines.base import EngineClient, Generation, Phase, parse_weight_version
from asyncsync.protocol.wire import InitGroupRequest, UpdateRequest


class VllmEngine(EngineClient):
    kind = "vllm"
    keepalive_s = UVICORN_KEEPALIVE_S - 1.0

    def __init__(self, server: ServerConfig, timeout_s: float, session: str | None = None):
        super().__init__(server, timeout_s, session)
        self._paused = False

    async def world_size(self) -> int:
        return int((await self.http.get("/get_world_size"))["world_size"])

    async def init_group(self, specs: tuple[GroupSpec, ...], rank_offset: int) -> None:
        await self.http.post("/init_weight_transfer_engine",
                             {"init_info": InitGroupRequest(specs[0], rank_offset, specs[1:]).to_json()})

    async def begin(self, version: int) -> None:
        if self.server.pause:
            self._paused = True  # set first: a pause whose answer was lost may still have happened
            await self.http.post("/pause", params={"mode": "keep"}, idempotent=True)
        await self.http.post("/start_weight_update")

    async def update(self, request: UpdateRequest) -> None:
        """A refused or failed update leaves vLLM serving the previous weights and its worker out of
        the update (vLLM ends the update itself when the engine raises); ``abort`` resumes generation."""
        await self.http.post("/update_weights", {"update_info": request.to_json()})

    async def end(self, version: int) -> int:
        try:
            await self.http.post("/finish_weight_update", {"weight_version": str(version)})
            if self.server.reset_prefix_cache:
                answer = await self.http.post("/reset_prefix_cache", params={"reset_running_requests": "true"},
                                              idempotent=True)
                if not (isinstance(answer, dict) and answer.get("success")):
                    raise ServerError(self.url, f"version {version} is live, but /reset_prefix_cache answered "
                                                f"{answer!r}: KV computed with older weights may be reused")
        finally:
            await self._resume()
        return await self.version()

    async def abort(self, version: int) -> None:
        await self.best_effort(self._resume(), "resume generation after a failed update")

    def calls(self, phase: Phase, buckets: int) -> int:
        pause = int(self.server.pause)
        return {"begin": 1 + pause, "update": 1, "end": 2 + pause + int(self.server.reset_prefix_cache)}.get(phase, 1)

    async def _resume(self) -> None:
        if self._paused:
            self._paused = False
            await self.http.post("/resume", idempotent=True)

    async def version(self) -> int:
        return parse_weight_version(self.url, (await self.http.get("/weight_info"))["weight_version"])

    async def generate(self, prompt: list[int], n: int, max_new_tokens: int, temperature: float, seed: int) -> Generation:
        """``/v1/completions`` with token ids. It does not report the weight version, so the rollout is
        tagged with the version served when the request was sent: never newer than the truth."""
        version = await self.version()
        body = {
            "prompt": prompt, "n": n, "max_tokens": max_new_tokens, "temperature": temperature, "seed": seed,
            "ignore_eos": True, "return_token_ids": True,
        }
        out = await self.http.post("/v1/completions", body)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        return Generation([c["token_ids"] for c in choices], version)
