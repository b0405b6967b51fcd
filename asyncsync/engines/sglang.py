"""Client of SGLang's HTTP weight-update API (``python -m sglang.launch_server``).

One version, as SGLang expects it::

    POST /pause_generation {"mode": "retract"}       policy ``pause``: running requests go back to
                                                     the queue and are recomputed after the update
    POST /begin_weight_update {}                     SGLang >= 0.5.21; older servers answer 404 and
                                                     are updated without a session
    POST /update_weights_from_distributed  x buckets  one flattened bucket each, posted in order while
                                                     the trainer broadcasts; the last one carries
                                                     weight_version and flush_cache (policy
                                                     ``reset_prefix_cache``)
    POST /end_weight_update {}
    POST /continue_generation {}
    GET  /get_weight_version                         the live version

SGLang joins the trainer's group without a warm-up broadcast and knows nothing of asyncsync's
checksum manifest, so its servers get a group of their own (``SGLANG_PROTOCOL``). It also applies
every bucket as it arrives: a failure half-way leaves a mix of versions, which the client reports
without advancing the version (send a full version again).
"""

from __future__ import annotations

import logging

from asyncsync.config import ServerConfig
from asyncsync.transport.control import UVICORN_KEEPALIVE_S, ServerError
from asyncsync.protocol.wire import GroupSpec
from asyncsync.engines.base import DataPlaneProtocol, EngineClient, Generation, Phase, parse_weight_version
from asyncsync.protocol.sglang import InitWeightsUpdateGroup, UpdateWeightsFromDistributed
from asyncsync.protocol.wire import UpdateRequest

log = logging.getLogger(__name__)

SGLANG_PROTOCOL = DataPlaneProtocol("sglang", warmup=False, checksum_manifest=False, single_dtype_buckets=True)
PAUSE_MODE = "retract"  # unlike "in_place", lets SGLang flush its cache while requests are paused


class SglangEngine(EngineClient):
    kind = "sglang"
    protocol = SGLANG_PROTOCOL
    keepalive_s = UVICORN_KEEPALIVE_S - 1.0

    def __init__(self, server: ServerConfig, timeout_s: float):
        super().__init__(server, timeout_s)
        self._group_name: str | None = None
        self._sessions: bool | None = None  # does the server have begin/end_weight_update? Learnt once.
        self._paused = False
        self._in_session = False

    async def world_size(self) -> int:
        info = await self.http.get("/get_server_info")
        if info.get("dp_size", 1) > 1 and not info.get("enable_dp_attention", False):
            raise ServerError(self.url, f"runs {info['dp_size']} data-parallel replicas, whose ranks would clash "
                                        "in the weight-update group: run one SGLang server per replica")
        return int(info["tp_size"])

    async def init_group(self, spec: GroupSpec, rank_offset: int) -> None:
        await self._post_checked("/init_weights_update_group", InitWeightsUpdateGroup.of(spec, rank_offset).to_json())
        self._group_name = spec.group_name

    async def begin(self, version: int) -> None:
        if self.server.pause:
            self._paused = True  # set first: a pause whose answer was lost may still have happened
            await self._post_checked("/pause_generation", {"mode": PAUSE_MODE}, idempotent=True)
        if self._sessions is not False:
            await self._begin_session()

    async def _begin_session(self) -> None:
        self._in_session = True  # set first: a session whose answer was lost may still be open
        try:
            await self._post_checked("/begin_weight_update", {})
        except ServerError as e:
            if e.status != 404:
                raise
            self._in_session = False
            log.info("%s has no /begin_weight_update (SGLang < 0.5.21): updating without a session", self.url)
            self._sessions = False
            return
        self._sessions = True

    async def update(self, request: UpdateRequest) -> None:
        """Post every bucket in order. A bucket SGLang refuses (HTTP 400) was still received, so the
        rest are posted too, keeping the trainer's broadcasts matched; the version then stays put."""
        if self._group_name is None:
            raise ServerError(self.url, "update before init_group: the weight-update group is not set up")
        refused: list[str] = []
        last = len(request.buckets) - 1
        for i, meta in enumerate(request.buckets):
            final = i == last and not refused
            body = UpdateWeightsFromDistributed(
                meta, self._group_name, flush_cache=final and self.server.reset_prefix_cache,
                weight_version=str(request.version) if final else None,
            )
            try:
                await self._post_checked("/update_weights_from_distributed", body.to_json())
            except ServerError as e:
                if e.status != 400:
                    raise
                refused.append(f"bucket {i}: {e}")
        if refused:
            raise ServerError(self.url, f"version {request.version} not applied, {len(refused)} of "
                                        f"{len(request.buckets)} bucket(s) refused; first: {refused[0]}", status=400)

    async def end(self, version: int) -> int:
        await self._release()
        return await self.version()

    async def abort(self, version: int) -> None:
        await self.best_effort(self._release(), "close the update session or resume generation")

    def calls(self, phase: Phase, buckets: int) -> int:
        pause = int(self.server.pause)
        return {"begin": 1 + pause, "update": buckets, "end": 2 + pause, "abort": 1 + pause}[phase]

    async def _release(self) -> None:
        """Close the update session and resume generation, whichever of them ``begin`` opened."""
        try:
            if self._in_session:
                self._in_session = False
                await self._post_checked("/end_weight_update", {})
        finally:
            if self._paused:
                self._paused = False
                await self._post_checked("/continue_generation", {}, idempotent=True)

    async def version(self) -> int:
        return parse_weight_version(self.url, (await self.http.get("/get_weight_version"))["weight_version"])

    async def generate(self, prompt: list[int], n: int, max_new_tokens: int, temperature: float, seed: int) -> Generation:
        """SGLang's native ``/generate`` with token ids, ``n`` copies of the prompt in one batch. The
        version is each output's ``meta_info.weight_version`` where SGLang reports it, else the one
        served when the request was sent. ``seed`` is not forwarded: SGLang's sampling-seed parameter
        is not the same across versions."""
        before = await self.version()
        body = {
            "input_ids": [prompt] * n,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": True},
        }
        outputs = await self.http.post("/generate", body)
        versions = [parse_weight_version(self.url, o.get("meta_info", {}).get("weight_version", before)) for o in outputs]
        return Generation([o["output_ids"] for o in outputs], min(versions))

    async def _post_checked(self, path: str, body: dict[str, object], idempotent: bool = False) -> object:
        """POST, treating SGLang's ``{"success": false}`` as the failure it is, whatever the status."""
        answer = await self.http.post(path, body, idempotent=idempotent)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise ServerError(self.url, f"POST {path} -> {answer.get('message', answer)}", 400)
        return answer
