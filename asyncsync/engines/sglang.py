"""Client of SGLang's HTTP weight-update API (``python -m sglang.launch_server``), SGLang 0.5.20-0.5.23.

Written to SGLang's own source (the 0.5.20-0.5.23 wheels). Per epoch it makes SGLang's named group
(``/init_weights_update_group``, a name unique per trainer session); per version it pauses, posts one
flattened bucket per ``/update_weights_from_distributed`` while the trainer broadcasts, resumes and
reads the live version from ``/model_info``. SGLang servers get a data-plane group of their own
(``SGLANG_PROTOCOL``: no warm-up, no checksum manifest) and always whole versions.
``SglangAdapterEngine`` serves ``lora: adapter`` through an asyncsync receiver on SGLang's host.

What a caller must know: SGLang applies each bucket as it arrives and verifies no checksum. A bucket
refused before its broadcast stops the version and ``abort`` destroys the server's group, so the
trainer's broadcast fails at once; one refused after it leaves a mix of versions until the next full
version. docs/engines/sglang.md has every call, every refusal and what is verified.
"""

from __future__ import annotations

import logging
from typing import Any

from asyncsync.config import ServerConfig
from asyncsync.engines.adapters import served_versions
from asyncsync.engines.base import (
    DataPlaneProtocol, EngineClient, Generation, Phase, Scored, UnsupportedServer, parse_weight_version,
)
from asyncsync.engines.reference import ReferenceEngine
from asyncsync.protocol.lora import AdapterCheck, BaseCheck, adapter_targets, parse_version_name
from asyncsync.protocol.sglang import (
    SESSION_OPEN, BeginWeightUpdate, ContinueGeneration, DestroyWeightsUpdateGroup, EndWeightUpdate,
    InitWeightsUpdateGroup, LoadLoraAdapter, PauseGeneration, UnloadLoraAdapter, UpdateWeightsFromDistributed,
    consumed,
)
from asyncsync.protocol.wire import GroupSpec, UpdateRequest
from asyncsync.control import UVICORN_KEEPALIVE_S, HttpClient, ServerError

log = logging.getLogger(__name__)

SGLANG_PROTOCOL = DataPlaneProtocol("sglang", warmup=False, checksum_manifest=False, single_dtype_buckets=True)
PAUSE_MODE = "retract"  # unlike "in_place", lets SGLang flush its cache while requests are paused
CLOSE_TIMEOUT_S = 5.0   # destroying the group on close is a courtesy: a server that does not answer is left be


def data_plane_ranks(url: str, info: dict[str, Any]) -> int:
    """The ranks an SGLang server adds to the group, from ``/server_info``; ``UnsupportedServer`` for
    setups whose ranks SGLang cannot place in it.

    Every TP rank joins as ``rank_offset + tp_rank`` (attention data parallelism included: its
    groups split the same ``tp_size`` ranks). SGLang asserts ``dp_size == 1`` for every weight-group
    route (an HTTP 500): from 0.5.22 ``dp_size`` counts only replicas (attention DP is
    ``attn_dp_size``); in 0.5.20-0.5.21 it also counts attention-DP groups, which pass the assertion
    when ``enable_dp_attention`` is set. Pipeline stages would reuse the same ranks."""
    dp, pp = int(info.get("dp_size", 1)), int(info.get("pp_size", 1))
    attention_dp = "attn_dp_size" not in info and bool(info.get("enable_dp_attention", False))  # SGLang < 0.5.22
    if dp != 1 and not attention_dp:
        raise UnsupportedServer(url, f"runs dp_size={dp} data-parallel replicas; SGLang refuses weight updates from "
                                     "distributed unless dp_size == 1 (attention data parallelism is fine): run one "
                                     "SGLang server per replica and list each under servers")
    if pp != 1:
        raise UnsupportedServer(url, f"runs pp_size={pp} pipeline stages, whose ranks SGLang would all number "
                                     "rank_offset + tp_rank in the weight-update group: use pp_size 1")
    return int(info["tp_size"])


class SglangEngine(EngineClient):
    kind = "sglang"
    protocol = SGLANG_PROTOCOL
    keepalive_s = UVICORN_KEEPALIVE_S - 1.0

    @classmethod
    def for_server(cls, server: ServerConfig, timeout_s: float, session: str | None = None) -> EngineClient:
        """With a ``lora_receiver`` (``lora: adapter``) the adapter client; else this one."""
        if server.lora_receiver is not None:
            return SglangAdapterEngine(server, timeout_s, session)
        return cls(server, timeout_s, session)

    def __init__(self, server: ServerConfig, timeout_s: float, session: str | None = None):
        super().__init__(server, timeout_s, session)
        self._group_name: str | None = None  # the server's group this client made and has not destroyed
        self._sessions: bool | None = None   # does the server have begin/end_weight_update? Learnt once.
        self._paused = False
        self._in_session = False
        self._owes_receives = False          # the trainer may still broadcast this version to the server

    async def world_size(self) -> int:
        return data_plane_ranks(self.url, await self.http.get("/server_info"))

    async def init_group(self, specs: tuple[GroupSpec, ...], rank_offset: int, relay: tuple[GroupSpec, ...] = ()) -> None:
        (spec,) = specs  # SGLang joins one group (its protocol is not multi_group): trainer rank 0's
        assert not relay, "SGLang runs no asyncsync code: it relays nothing (its protocol says relay=False)"
        if self._group_name is not None:
            await self._destroy_group()  # the previous epoch's group would otherwise live on in the server
        await self._post_checked("/init_weights_update_group", InitWeightsUpdateGroup.of(spec, rank_offset).to_json())
        self._group_name = spec.group_name

    async def begin(self, version: int) -> None:
        self._owes_receives = True
        if self.server.pause:
            self._paused = True  # set first: a pause whose answer was lost may still have happened
            await self._post_checked("/pause_generation", PauseGeneration(PAUSE_MODE).to_json(), idempotent=True)
        if self._sessions is not False:
            await self._begin_session()

    async def _begin_session(self) -> None:
        self._in_session = True  # set first: a session whose answer was lost may still be open
        try:
            await self._post_checked("/begin_weight_update", BeginWeightUpdate().to_json())
        except ServerError as e:
            if e.status == 404:
                self._in_session = False
                log.info("%s has no /begin_weight_update (SGLang < 0.5.21): updating without a session", self.url)
                self._sessions = False
                return
            if e.status != 400 or SESSION_OPEN not in str(e.detail):
                raise
            # A session nobody closed: a trainer killed mid-version, or an end whose answer was lost.
            log.warning("%s: closing an update session left open, then opening this version's", self.url)
            await self._post_checked("/end_weight_update", EndWeightUpdate().to_json())
            await self._post_checked("/begin_weight_update", BeginWeightUpdate().to_json())
        self._sessions = True

    async def update(self, request: UpdateRequest) -> None:
        """Post every bucket in order. A bucket refused after its broadcast leaves the rest to post
        (the version then stays put); one refused before it stops the version for this server, and
        ``abort`` takes the server out of the group (see the module docstring)."""
        if self._group_name is None:
            raise ServerError(self.url, "has no weight-update group of this trainer (it left it after a refusal, or "
                                        "init_group failed); the next epoch makes one", status=400)
        refused: list[str] = []
        last = len(request.buckets) - 1
        for i, meta in enumerate(request.buckets):
            final = i == last and not refused
            body = UpdateWeightsFromDistributed.of(
                meta, self._group_name, flush_cache=final and self.server.reset_prefix_cache,
                weight_version=str(request.version) if final else None,
            )
            try:
                await self._post_checked("/update_weights_from_distributed", body.to_json())
            except ServerError as e:
                if e.status is None or not (self._sessions and consumed(str(e.detail))):
                    raise  # this and the later broadcasts have no receiver here: abort leaves the group
                refused.append(f"bucket {i}: {e}")
        self._owes_receives = False
        if refused:
            raise ServerError(self.url, f"version {request.version} not applied, {len(refused)} of "
                                        f"{len(request.buckets)} bucket(s) refused; first: {refused[0]}", status=400)

    async def end(self, version: int, digests: tuple[str, ...] = ()) -> int:
        """SGLang loads each bucket as it arrives (no digests: it is never relayed, and is sent none)."""
        await self._release()
        return await self.version()

    async def abort(self, version: int) -> None:
        if self._owes_receives:  # first: the trainer may be waiting in a broadcast for this server
            self._owes_receives = False
            await self._destroy_group()
        await self.best_effort(self._release(), "close the update session or resume generation")

    def calls(self, phase: Phase, buckets: int) -> int:
        pause = int(self.server.pause)
        # begin: pause, begin (+ end and begin again for a session left open); end: end, continue,
        # model_info; abort: destroy_weights_update_group, end, continue
        return {"begin": 3 + pause, "update": buckets, "end": 2 + pause, "abort": 2 + pause}[phase]

    async def _release(self) -> None:
        """Close the update session and resume generation, whichever of them ``begin`` opened."""
        try:
            if self._in_session:
                self._in_session = False
                await self._post_checked("/end_weight_update", EndWeightUpdate().to_json())
        finally:
            if self._paused:
                self._paused = False
                await self._post_checked("/continue_generation", ContinueGeneration().to_json(), idempotent=True)

    async def _destroy_group(self, timeout_s: float | None = None) -> None:
        """Destroy the server's side of this client's group (local to the server). Never raises: a
        server that restarted no longer has it, and one that does not answer is being evicted."""
        name, self._group_name = self._group_name, None
        if name is None:
            return
        try:
            await self._post_checked("/destroy_weights_update_group", DestroyWeightsUpdateGroup(name).to_json(),
                                     timeout_s=timeout_s)
        except ServerError as e:
            log.info("%s: group %s not destroyed: %s", self.url, name, e)

    async def version(self) -> int:
        """The live version: ``/model_info``'s ``weight_version`` (``/server_info`` has the start-up
        one; ``/get_weight_version`` is gone from SGLang 0.5.21 and deprecated in 0.5.20)."""
        return parse_weight_version(self.url, (await self.http.get("/model_info"))["weight_version"])

    async def generate(self, prompt: list[int], n: int, max_new_tokens: int, temperature: float, seed: int,
                       adapter: str | None = None) -> Generation:
        """SGLang's native ``/generate`` with token ids, ``n`` copies of the prompt in one batch. The
        version is each output's ``meta_info.weight_version`` where SGLang reports it, else the one
        served when the request was sent. Not ``exact``: a request running at a switch is retracted
        and continues on the new version, and one version per output cannot say so. ``seed`` is not
        forwarded: SGLang's sampling-seed parameter is not the same across versions."""
        return await sglang_generate(self.http, self.url, prompt, n, max_new_tokens, temperature, adapter)

    async def score(self, tokens: list[int]) -> Scored:
        return await sglang_score(self.http, self.url, tokens)

    async def close(self) -> None:
        try:
            await self._destroy_group(timeout_s=CLOSE_TIMEOUT_S)
        finally:
            await super().close()

    async def _post_checked(self, path: str, body: dict[str, object], idempotent: bool = False,
                            timeout_s: float | None = None) -> object:
        """POST, treating SGLang's ``{"success": false}`` as the failure it is, whatever the status."""
        answer = await self.http.post(path, body, timeout_s, idempotent=idempotent)
        if isinstance(answer, dict) and answer.get("success") is False:
            detail = answer.get("message", answer)
            raise ServerError(self.url, f"POST {path} -> {detail}", 400, detail=detail)
        return answer


async def sglang_generate(http: HttpClient, url: str, prompt: list[int], n: int, max_new_tokens: int,
                          temperature: float, adapter: str | None) -> Generation:
    """``n`` completions from SGLang's ``/generate`` (see ``SglangEngine.generate``); with ``adapter``
    (``<name>-v<N>``, SGLang's ``lora_path``: the name of a loaded adapter) exactly version N."""
    body: dict[str, object] = {
        "input_ids": [prompt] * n,
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": temperature, "ignore_eos": True},
    }
    if adapter is not None:
        outputs = await http.post("/generate", {**body, "lora_path": [adapter] * n})
        return Generation([o["output_ids"] for o in outputs], parse_version_name(adapter) or 0)
    before = parse_weight_version(url, (await http.get("/model_info"))["weight_version"])
    outputs = await http.post("/generate", body)
    versions = [parse_weight_version(url, o.get("meta_info", {}).get("weight_version", before)) for o in outputs]
    return Generation([o["output_ids"] for o in outputs], min(versions), exact=False)


async def sglang_score(http: HttpClient, url: str, tokens: list[int]) -> Scored:
    """SGLang's ``/generate`` with ``return_logprob`` from ``logprob_start_len: 0``: its
    ``meta_info.input_token_logprobs`` is one ``[logprob, token_id, text]`` per prompt token, the first
    without a logprob; the version is ``meta_info.weight_version`` where reported, checked against
    ``/model_info`` before the request."""
    before = parse_weight_version(url, (await http.get("/model_info"))["weight_version"])
    out = await http.post("/generate", {"input_ids": tokens, "return_logprob": True, "logprob_start_len": 0,
                                        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}})
    meta = (out[0] if isinstance(out, list) else out)["meta_info"]
    entries = meta["input_token_logprobs"][-(len(tokens) - 1):]
    if [int(e[1]) for e in entries] != tokens[1:]:
        raise ServerError(url, "/generate scored other tokens than the probe's")
    version = parse_weight_version(url, meta.get("weight_version", before))
    return Scored(tuple(float(e[0]) for e in entries), version if version == before else None)


class SglangAdapterEngine(ReferenceEngine):
    """An SGLang server with ``lora: adapter``: every data-plane call goes to the asyncsync receiver
    on its host (``server.lora_receiver``, a reference server: it receives the base, if sent, and
    each adapter version, and writes the adapter there); the adapters are loaded into SGLang, listed
    and named in its generation requests through SGLang's own API. Known by SGLang's URL."""

    kind = "sglang"

    def __init__(self, server: ServerConfig, timeout_s: float, session: str | None = None):
        super().__init__(server, timeout_s, session)
        assert server.lora_receiver is not None
        self.http = HttpClient(server.lora_receiver, server.token, timeout_s, self.keepalive_s, session=session)
        self.sglang = HttpClient(server.base_url, server.token, timeout_s, UVICORN_KEEPALIVE_S - 1.0, session=session)

    async def check_adapter(self, check: AdapterCheck) -> str | None:
        """SGLang's LoRA settings (``/server_info``: its start-up arguments), then the receiver's judgement."""
        info = await self.sglang.get("/server_info")
        targets = adapter_targets(check.specs)
        allowed = info.get("lora_target_modules")
        if not info.get("enable_lora"):
            return "this SGLang serves no LoRA adapters: start it with --enable-lora and --lora-target-modules"
        if isinstance(info.get("max_lora_rank"), int) and info["max_lora_rank"] < check.rank:
            return f"adapter rank {check.rank} is above SGLang's --max-lora-rank {info['max_lora_rank']}: start it with --max-lora-rank {check.rank}"
        if isinstance(allowed, list) and "all" not in allowed and targets - set(allowed):
            return f"SGLang prepared LoRA for {sorted(allowed)} only: start it with --lora-target-modules {' '.join(sorted(targets | set(allowed)))}"
        if isinstance(info.get("max_loaded_loras"), int) and info["max_loaded_loras"] < check.loaded:
            return f"--max-loaded-loras {info['max_loaded_loras']} is below the {check.loaded} versions served at once: start SGLang with --max-loaded-loras {check.loaded}"
        return await super().check_adapter(check)

    async def serves_base(self, check: BaseCheck) -> None:
        """SGLang cannot tell which weights it serves (start it on the trainer's base)."""
        return None

    async def load_adapter(self, name: str, path: str, timeout_s: float) -> None:
        await self._lora_call("/load_lora_adapter", LoadLoraAdapter(name, path).to_json(), timeout_s)

    async def unload_adapter(self, name: str) -> None:
        await self._lora_call("/unload_lora_adapter", UnloadLoraAdapter(name).to_json(), None)

    async def _lora_call(self, path: str, body: dict[str, object], timeout_s: float | None) -> None:
        """SGLang answers ``LoRAUpdateOutput``: 400 with ``success: false`` and ``error_message``."""
        try:
            await self.sglang.post(path, body, timeout_s)
        except ServerError as e:
            answer = e.detail if isinstance(e.detail, dict) else {}
            raise ServerError(self.url, f"POST {path} -> {answer.get('error_message') or e.detail}", e.status,
                              detail=e.detail) from None

    async def adapter_versions(self, name: str) -> list[int]:
        return served_versions(await self.sglang.get("/v1/models"), name)

    async def generate(self, prompt: list[int], n: int, max_new_tokens: int, temperature: float, seed: int,
                       adapter: str | None = None) -> Generation:
        return await sglang_generate(self.sglang, self.url, prompt, n, max_new_tokens, temperature, adapter)

    async def close(self) -> None:
        try:
            await self.sglang.close()
        finally:
            await super().close()
