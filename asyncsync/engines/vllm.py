"""Client of vLLM's weight-transfer routes, for a server started with asyncsync's backend.

The server side is ``asyncsync.receivers.vllm``: a ``WeightTransferEngine`` registered under the backend
name ``asyncsync`` (``--weight-transfer-config '{"backend": "asyncsync"}'``, with
``VLLM_SERVER_DEV_MODE=1`` for the routes). One version, as vLLM expects it, with the server's
``receive: background`` (the default)::

    POST /start_weight_update
    POST /update_weights {"update_info": UpdateRequest}   answered at once: the worker receives and
                                                          verifies in the background, vLLM keeps generating
    POST /pause?mode=wait&clear_cache=false        policy ``pause``: in-flight requests finish first
                                                   (``mode=keep`` with ``mix_versions``: they freeze)
    POST /update_weights {"update_info": {"commit": 7}}   the worker loads the verified version, or
                                                          refuses it
    POST /finish_weight_update {"weight_version": "7"}    vLLM ends the session, adopts the number
    POST /reset_prefix_cache?reset_running_requests=true  policy ``reset_prefix_cache``
    POST /resume
    GET  /weight_info                              {"weight_version": "7"}: the live version

With ``receive: in_rpc`` the pause comes right after ``/start_weight_update`` and
``/update_weights`` is answered once the version is received, verified and loaded: vLLM generates
nothing for the whole transfer. Whatever the mode, a trainer that dies or hangs with the engine
paused does not keep it paused: the worker's pause guard (``receivers/vllm/guard.py``) resumes it
within seconds, and a version whose load failed on some workers is refused naming the mixed state
(``receivers/vllm/agreement.py``) while vLLM answers every request with an error until the next
version loads whole (``receivers/vllm/hold.py``). Every ``init_info`` and ``update_info`` carries the
credential of the server's ``token`` (``protocol.keys.credential``): vLLM's ``--api-key`` does not
guard these routes, asyncsync's backend does, and ``/finish_weight_update`` (which reaches the worker
with nothing to check) loads nothing, hence the commit. A failed version is undone by ``abort``: a ``DiscardRequest`` in
``/update_weights`` (a version received in the background is dropped, never loaded), then
``/finish_weight_update`` without a version, which ends vLLM's update session even after a
``finish`` that raised (vLLM's worker then keeps the session open), then ``/resume``.

``lora: adapter`` (the engine started with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``):
an adapter version is ``/start_weight_update``, ``/update_weights`` with an ``AdapterUpdate`` (nothing
paused: no weights change) and ``/finish_weight_update`` without a version (the worker writes the
verified adapter as a PEFT directory); the loads are then ``POST /v1/load_lora_adapter`` under a new
name per version (never ``load_inplace``: prefix-cache blocks of the old weights would be reused) and
``/v1/unload_lora_adapter``; ``GET /v1/models`` lists the versions served, and a completion names
its version as ``model``.

vLLM 0.32's routes cannot tell the trainer which tensor names the engine expects (the checkpoint's):
``/init_weight_transfer_engine`` answers a fixed message, ``/weight_info`` only the version, and
``/collective_rpc`` calls only methods of vLLM's worker. So ``expected_names`` stays None: the
trainer sends a tied weight once, as the checkpoint saved from a tied model stores it. What the
worker can do is judge: at ``connect``, ``check_layout`` sends the plan's tensors as a
``LayoutCheck`` in ``/update_weights`` (inside a start/finish pair) and the worker refuses it,
naming the differences, when the checkpoint it loaded has other tensors.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import time
from collections.abc import Awaitable
from typing import Any

from asyncsync.config import ServerConfig
from asyncsync.engines.base import EngineClient, Generation, Phase, Scored, UnsupportedServer, parse_weight_version
from asyncsync.protocol.arena import vllm_staging
from asyncsync.protocol.keys import CREDENTIAL_FIELD, credential
from asyncsync.protocol.lora import AdapterCheck, AdapterUpdate, BaseCheck, parse_version_name
from asyncsync.protocol.tags import UPDATE_INFO
from asyncsync.protocol.schema import Message
from asyncsync.protocol.wire import CommitRequest, DiscardRequest, GroupSpec, InitGroupRequest, LayoutCheck, UpdateRequest
from asyncsync.control import ServerError

log = logging.getLogger(__name__)

SCALE_OUT_GENERATE = "/inference/v1/generate"  # served with --enable-scale-out; reports weight versions


class VllmEngine(EngineClient):
    kind = "vllm"
    # No connection is reused: uvicorn closes one right after answering 500 for an RPC that raised,
    # and the call after a failure is the abort's discard, which is not idempotent and never retried.
    keepalive_s = None

    def __init__(self, server: ServerConfig, timeout_s: float, session: str | None = None):
        super().__init__(server, timeout_s, session)
        self._paused = False
        self._paused_at = 0.0
        self._held_s = 0.0  # of the version in progress: time vLLM's engine was held for it
        self._open = False  # vLLM's worker has an update session open (started, not yet finished)
        self._scale_out: bool | None = None  # whether SCALE_OUT_GENERATE is served (None: not asked yet)
        self._credential = {CREDENTIAL_FIELD: credential(server.token)} if server.token else {}
        self._weight_versions: bool | None = None  # whether completions report weight_versions (vLLM 0.33)

    @property
    def receives_in_background(self) -> bool:
        return self.server.receive == "background"

    def staging_bytes(self, version_bytes: int, ranks: int) -> int:
        """Every data-plane rank holds a staging arena of one whole version, from start-up: each worker's
        device (``asyncsync-device``), or each engine's host shared memory (``asyncsync``: one rank
        per engine, its stager)."""
        return version_bytes * ranks

    async def world_size(self) -> int:
        """The data-plane ranks of the server: every worker with device staging, one per engine (data-
        parallel rank) with host staging, whose engines receive on their first worker only. The
        staging is the backend's name, read from ``/server_info`` (a development route, served with
        ``VLLM_SERVER_DEV_MODE=1`` like the weight-transfer routes)."""
        try:
            info = await self.http.get("/server_info", params={"config_format": "json"})
            backend = info["vllm_config"]["weight_transfer_config"]["backend"]
            staging = vllm_staging(backend)
        except (KeyError, TypeError, ValueError) as e:
            raise UnsupportedServer(self.url, f"cannot tell this vLLM's weight-transfer backend from /server_info "
                                              f"({e}): start it with --weight-transfer-config "
                                              '\'{"backend": "asyncsync"}\' and VLLM_SERVER_DEV_MODE=1') from None
        workers = int((await self.http.get("/get_world_size"))["world_size"])
        if staging == "device":
            return workers
        per_engine = int((await self.http.get("/get_world_size", params={"include_dp": "false"}))["world_size"])
        return workers // per_engine

    async def init_group(self, specs: tuple[GroupSpec, ...], rank_offset: int, relay: tuple[GroupSpec, ...] = ()) -> None:
        """The worker joins the groups; the URL this client uses goes with them, for the worker's pause
        guard (``receivers/vllm/guard.py``: it resumes a pause this trainer leaves behind if it dies)."""
        init = InitGroupRequest(specs[0], rank_offset, specs[1:], relay=relay, server_url=self.url)
        await self.http.post("/init_weight_transfer_engine", {"init_info": {**init.to_json(), **self._credential}})

    def _info(self, message: Message) -> dict[str, Any]:
        """``/update_weights``'s body: ``message`` in the slot's table, with the trainer's credential."""
        return {"update_info": {**UPDATE_INFO.encode(message), **self._credential}}

    async def begin(self, version: int) -> None:
        """Open the update session, then (``in_rpc``) pause: the worker sees the session before any
        pause, so a pause this trainer leaves behind is always one its guard watches."""
        self.last_switch_s, self._held_s = None, 0.0
        await self._start(version)
        if self.server.pause and not self.receives_in_background:
            await self._pause()  # the update RPC holds the engine for the whole transfer anyway

    async def begin_adapter(self, version: int) -> None:
        await self._start(version)

    async def _start(self, version: int) -> None:
        """Open vLLM's update session (ending one left open first)."""
        try:
            await self.http.post("/start_weight_update")
        except ServerError as e:
            if "already active" not in str(e.detail):
                raise
            # A session left open (a trainer that died mid-version, or a finish that raised while
            # nobody aborted): drop what it received and end it, then start this one.
            log.warning("%s: vLLM still had a weight update open; ending it before version %d", self.url, version)
            await self._discard(version)
            await self.http.post("/start_weight_update")
        self._open = True

    async def check_layout(self, check: LayoutCheck) -> str | None:
        """The worker refuses the check when the checkpoint it loaded has other tensors."""
        return await self._worker_check(check)

    async def check_adapter(self, check: AdapterCheck) -> str | None:
        """The API's load routes (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), then the worker's judgement
        (``receivers/vllm/adapters.py``: --enable-lora, ranks, targets, --max-loras, MoE on CPU)."""
        try:
            await self.http.post("/v1/unload_lora_adapter", {"lora_name": f"{check.name}-v0"})  # never loaded
        except ServerError as e:
            if e.status != 404 or "cannot be found" not in str(e.detail):
                return (f"vLLM serves no /v1/unload_lora_adapter ({e}): start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                        "and --enable-lora")
        return await self._worker_check(check)

    async def serves_base(self, check: BaseCheck) -> bool:
        return await self._worker_check(check) is None

    async def _worker_check(self, check: LayoutCheck | AdapterCheck | BaseCheck) -> str | None:
        """Inside an update session (vLLM's routes carry nothing else to the worker): the worker's
        refusal of ``check`` (carried as ``update_info``), or None; vLLM ends the session."""
        await self._start(0)  # no version follows: nothing is paused
        try:
            await self.http.post("/update_weights", self._info(check))
        except ServerError as e:
            if e.status is None:
                raise
            self._open = False
            return worker_error(str(e.detail))
        finally:
            if self._open:
                self._open = False
                await self.http.post("/finish_weight_update")
            await self._resume()
        return None

    async def update(self, request: UpdateRequest) -> None:
        """In the background mode answered at once; otherwise once the version is loaded. A refused or
        failed update leaves vLLM serving the previous weights and its worker out of the update
        (vLLM ends the session itself when the engine raises in ``update_weights``)."""
        await self._post_update(dataclasses.replace(request, receive=self.server.receive))

    async def _post_update(self, update: UpdateRequest | AdapterUpdate) -> None:
        try:
            await self._holding(self.http.post("/update_weights", self._info(update)))
        except ServerError as e:
            if e.status is not None:  # the engine raised: vLLM closed the session
                self._open = False
            raise

    async def update_adapter(self, update: AdapterUpdate) -> None:
        request = dataclasses.replace(update.update, receive=self.server.receive)
        await self._post_update(AdapterUpdate(request, update.adapter))

    async def end_adapter(self, version: int, digests: tuple[str, ...] = ()) -> None:
        """The worker writes the verified adapter (no version: vLLM's weights keep theirs)."""
        await self._commit(version, digests)
        await self.http.post("/finish_weight_update")
        self._open = False

    async def _commit(self, version: int, digests: tuple[str, ...]) -> None:
        """Apply a version received in the background (its load, or its adapter's write), checked against
        ``digests`` where it was announced with them: an authenticated call (``/finish_weight_update``
        carries nothing the worker could check)."""
        if self.receives_in_background:
            await self._holding(self.http.post("/update_weights", self._info(CommitRequest(version, digests))))

    async def end(self, version: int, digests: tuple[str, ...] = ()) -> int:
        try:
            if self.server.pause and self.receives_in_background:
                await self._pause()  # only around the load: the transfer is done by now
            await self._commit(version, digests)
            await self._holding(self.http.post("/finish_weight_update", {"weight_version": str(version)}))
            self._open = False
            if self.server.reset_prefix_cache:
                answer = await self._holding(self.http.post(
                    "/reset_prefix_cache", params={"reset_running_requests": "true"}, idempotent=True))
                if not (isinstance(answer, dict) and answer.get("success")):
                    raise ServerError(self.url, f"version {version} is live, but /reset_prefix_cache answered "
                                                f"{answer!r}: KV computed with older weights may be reused")
        finally:
            await self._resume()
        self.last_switch_s = self._held_s
        return await self.version()

    async def abort(self, version: int) -> None:
        if self._open:
            self._open = False
            await self.best_effort(self._discard(version), "end the open weight update")
        await self.best_effort(self._resume(), "resume generation after a failed update")

    async def _discard(self, version: int) -> None:
        """Drop what the worker received of ``version`` without loading it, then end vLLM's session
        with a finish that has nothing to load (no version: the served version's number stays)."""
        await self.http.post("/update_weights", self._info(DiscardRequest(version)))
        await self.http.post("/finish_weight_update")

    def calls(self, phase: Phase, buckets: int) -> int:
        pause, reset = int(self.server.pause), int(self.server.reset_prefix_cache)
        background = int(self.receives_in_background)
        return {
            "begin": 4 + pause * (1 - background),  # start; discard, finish and start again for a session left open
            "update": 1,
            # [pause], [commit: received in the background], finish, [reset], [resume], weight_info
            "end": 2 + pause * (1 + background) + reset + background,
            "abort": 3,  # discard, finish, resume
        }.get(phase, 1)

    async def _pause(self) -> None:
        mode = "keep" if self.server.mix_versions else "wait"
        self._paused = True  # set first: a pause whose answer was lost may still have happened
        # clear_cache=false: the cache is reset after the load (policy reset_prefix_cache), when it matters.
        await self.http.post("/pause", params={"mode": mode, "clear_cache": "false"}, idempotent=True)
        self._paused_at = time.perf_counter()

    async def _resume(self) -> None:
        if self._paused:
            self._paused = False
            await self.http.post("/resume", idempotent=True)
            self._held_s = time.perf_counter() - self._paused_at

    async def _holding(self, call: Awaitable[Any]) -> Any:
        """An RPC during which vLLM's engine steps nothing; counted as held time unless paused anyway."""
        start = time.perf_counter()
        try:
            return await call
        finally:
            if not self._paused:
                self._held_s += time.perf_counter() - start

    async def version(self) -> int:
        return parse_weight_version(self.url, (await self.http.get("/weight_info"))["weight_version"])

    async def generate(self, prompt: list[int], n: int, max_new_tokens: int, temperature: float, seed: int,
                       adapter: str | None = None) -> Generation:
        """``/inference/v1/generate`` where the server has it (``--enable-scale-out``), or
        ``/v1/completions`` with ``return_weight_versions`` where it reports them (vLLM 0.33): vLLM
        says which weight version sampled each token, so the rollout's version is exact (with
        ``pause``, which switches the label together with the weights). Otherwise (vLLM 0.32's
        completions) the rollout is tagged with the version served before the request; exact when it
        is also served after it (versions only increase, and with ``pause`` the label changes only with
        the weights). With ``adapter`` (``<name>-v<N>``), a completion of that adapter version: exactly
        version N. A request vLLM answers "Generation is paused" (0.33, while a version is switched
        in) was never scheduled: it is sent again until the call's deadline (``paused``)."""
        sampling = {"n": n, "max_tokens": max_new_tokens, "temperature": temperature, "seed": seed, "ignore_eos": True}
        if adapter is not None:
            out = await self.http.post("/v1/completions", {"model": adapter, "prompt": prompt, **sampling,
                                                           "return_token_ids": True}, retry_while=paused)
            choices = sorted(out["choices"], key=lambda c: c["index"])
            return Generation([c["token_ids"] for c in choices], parse_version_name(adapter) or 0)
        if self._scale_out is not False:
            try:
                out = await self.http.post(SCALE_OUT_GENERATE, {"token_ids": prompt, "sampling_params": sampling},
                                           retry_while=paused)
                self._scale_out = True
                return self._spans(out)
            except ServerError as e:
                if self._scale_out or e.status not in (403, 404):
                    raise
                self._scale_out = False
                log.info("%s serves no %s (start vLLM with --enable-scale-out): rollout versions come from "
                         "/v1/completions", self.url, SCALE_OUT_GENERATE)
        spans = self._weight_versions is not False
        before = None if self._weight_versions else await self.version()
        body = {"prompt": prompt, **sampling, "return_token_ids": True}
        out = await self.http.post("/v1/completions", {**body, "return_weight_versions": True} if spans else body,
                                   retry_while=paused)
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if spans and self._weight_versions is None:  # asked once: vLLM 0.32 ignores the field (and logs it)
            self._weight_versions = all(c.get("weight_versions") for c in choices)
        if self._weight_versions:
            return self._spans(out)
        after = await self.version()
        assert before is not None
        return Generation([c["token_ids"] for c in choices], before, exact=before == after and self.server.pause)

    async def score(self, tokens: list[int]) -> Scored:
        """``/v1/completions`` with the tokens as the prompt and ``prompt_logprobs: 0`` (vLLM's own
        log-probability of each prompt token, as its sampler would see it), between two ``/weight_info``."""
        before = await self.version()
        out = await self.http.post("/v1/completions", {"prompt": tokens, "max_tokens": 1, "temperature": 0.0,
                                                        "prompt_logprobs": 0}, retry_while=paused)
        after = await self.version()
        entries = out["choices"][0]["prompt_logprobs"]
        logprobs = tuple(float(entries[i][str(t)]["logprob"]) for i, t in enumerate(tokens) if i)
        return Scored(logprobs, before if before == after else None)

    def _spans(self, out: dict[str, Any]) -> Generation:
        choices = sorted(out["choices"], key=lambda c: c["index"])
        versions = {parse_weight_version(self.url, span["version"]) for c in choices for span in c.get("weight_versions") or ()}
        if not versions:
            raise ServerError(self.url, f"{SCALE_OUT_GENERATE} reported no weight versions for the completions")
        return Generation([c["token_ids"] for c in choices], min(versions),
                          exact=len(versions) == 1 and self.server.pause)


def paused(error: ServerError) -> bool:
    """vLLM 0.33's answer to a request that arrives while generation is paused (HTTP 503, error code
    ``engine_paused``): it was never scheduled, so sending it again is safe. vLLM 0.32 queued it."""
    return error.status == 503 and "Generation is paused" in str(error.detail)


def worker_error(detail: str) -> str:
    """The worker's own message inside vLLM's wrapping of an RPC that raised."""
    found = re.search(r"Worker failed with error '(.*)', please check", detail, re.DOTALL)
    return found.group(1) if found else detail
