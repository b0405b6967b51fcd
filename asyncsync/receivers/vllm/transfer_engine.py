"""The worker side of asyncsync's vLLM backend: receive a version, verify it, load it whole.

vLLM calls, per version: ``start_weight_update``, ``update_weights`` (with asyncsync's
``UpdateRequest``), ``finish_weight_update``, each as an RPC on the worker's main thread, the thread
that also runs the forward passes: while an RPC runs, vLLM generates nothing. Per version:

1. receive every bucket into the staging arena and verify it (CRC32C manifest, and names, dtypes
   and shapes against the checkpoint the server loaded, every tensor exactly once; a post-load fix
   that cannot repair this model refuses every version: ``receivers/vllm/fixes.py``); a bad
   version is refused before the model is touched;
2. only then open vLLM's layerwise reload, ``model.load_weights`` the whole version (HF checkpoint
   names), and close the reload, even when loading raises;
3. repair what vLLM's weight-update path leaves stale after a load: every fix of
   ``receivers/vllm/fixes.py``'s one list that the model needs.

Where step 1 runs is the request's ``receive`` mode:

* ``background``: ``update_weights`` starts step 1 on a worker thread (``protocol.background``; on
  CUDA on a dedicated stream, ordered against the load by events) and returns at once, so the engine
  keeps stepping during the whole transfer. A ``CommitRequest`` in ``update_weights`` waits for the
  verified version (normally already there: the trainer sends it after its last broadcast) and does
  steps 2-3. The engine is held only for the load.
* ``in_rpc``: ``update_weights`` does steps 1-3 itself; the engine is held for the whole transfer,
  but nothing of the receive (checksum temporaries, the data plane's buffers) overlaps generation.

Either way the reload opens and closes inside one RPC, during which vLLM runs no forward pass, so no
request ever meets a half-loaded model, whatever the trainer's pause policy and whatever happens to
the trainer mid-update.

vLLM's worker marks an update active from ``start_weight_update`` until ``finish_weight_update``
returns; if ``finish`` raises the mark stays, and the next ``start`` fails. So ``finish`` leaves
nothing pending whatever happens and never raises for a version, a second ``finish`` is a no-op that
ends vLLM's session, and a ``DiscardRequest`` in ``update_weights`` drops a version received in the
background that will not be loaded (the trainer aborted it). ``engines/vllm.py`` sends both when it
aborts.

Credentials: vLLM's ``--api-key`` guards ``/v1/*`` only, not these routes. Every payload that
reaches this engine (``init_info``, ``update_info``) must carry the credential of the token the
server was started with (``ASYNCSYNC_TOKEN``, or ``VLLM_API_KEY``, which vLLM's own guard reads;
``protocol.keys.PayloadGuard``), or it is refused before it is decoded. ``/finish_weight_update``
reaches the worker with nothing to authenticate, so it loads nothing: a version received in the
background is applied only by an authenticated ``CommitRequest``, and ``finish`` drops one that none
committed. What stays open is vLLM's own (docs/engines/vllm.md, "Trust").

Contract: a version this engine reports loaded is served by every module of every worker, each with
the processing derived from that version's weights; a version that cannot be is refused before the
model is touched, on every worker. A load that fails on any worker after it began (``load_weights``
or a post-load fix raising) is refused naming the mixed state, and the engine answers every request
with an error until a whole version loads on every worker (``agreement.py``, ``hold.py``). The
engine's first worker also resumes a pause whose trainer died or hangs (``guard.py``).

``lora: adapter`` (``receivers/vllm/adapters.py``): an ``AdapterUpdate`` is received and verified
the same way (in the RPC or in the background), then written as a PEFT directory instead of loaded:
the trainer loads it through vLLM's ``/v1/load_lora_adapter``. ``AdapterCheck`` and ``BaseCheck``
are judged at the trainer's connect, like a ``LayoutCheck``.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from asyncsync.protocol.arena import Arena, HostArena, Staging, vllm_staging
from asyncsync.protocol.background import BackgroundReceive, finish_window_s
from asyncsync.protocol.device import runtime_for
from asyncsync.protocol.keys import PayloadGuard
from asyncsync.protocol.lora import AdapterCheck, AdapterUpdate, BaseCheck
from asyncsync.protocol.specs import TensorSpec, dtype_from_safetensors
from asyncsync.protocol.admission import VersionRejected, reject_if
from asyncsync.protocol.stager import BucketStager
from asyncsync.protocol.staging import StagedVersion
from asyncsync.protocol.tags import UPDATE_INFO
from asyncsync.protocol.wire import CommitRequest, DiscardRequest, InitGroupRequest, LayoutCheck, UpdateRequest
from asyncsync.receivers.vllm.adapters import WorkerAdapters
from asyncsync.receivers.vllm.agreement import EngineAgreement
from asyncsync.receivers.vllm.faults import WorkerFaults
from asyncsync.receivers.vllm.fixes import PostLoadFixes
from asyncsync.receivers.vllm.guard import PauseGuard
from asyncsync.receivers.vllm.node import NodeStaging, engine_group

log = logging.getLogger(__name__)

# How long finish_weight_update waits for a version received in the background, beyond the relay hops
# above this server (``protocol.background.finish_window_s``). The trainer calls it after its last
# broadcast, so only the verification of the last bucket is normally left (and for a relayed server
# the hops the last bucket still makes); the engine generates nothing meanwhile.
FINISH_WAIT_S = 10.0


class AsyncsyncWeightTransferEngine(WeightTransferEngine):  # type: ignore[type-arg]
    """Receives asyncsync's buckets over a gloo (CPU) or NCCL (GPU) group and loads them whole.

    Where a version is staged is the backend's name (``receivers/vllm/__init__.py``): ``host`` (one
    copy per node, received by the engine's first worker: ``receivers/vllm/node.py``) or ``device``
    (a copy on every worker's device, each receiving it)."""

    init_info_cls = InitGroupRequest  # type: ignore[assignment]
    update_info_cls = UpdateRequest  # type: ignore[assignment]
    supports_draft_weight_update = False  # the expected tensors are the main checkpoint's
    defers_processing = True  # with ``receive: background`` update_weights returns before the load

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self.staging: Staging = vllm_staging(config.backend)
        self.checkpoint = CheckpointTensors(vllm_config)
        runtime = runtime_for(torch.device(device))
        # ``host``: the engine's workers share one copy; only the stager receives (``node``).
        self.node = NodeStaging(self.parallel_config) if self.staging == "host" else None
        self.receives = self.node is None or self.node.stager
        # Every worker of the engine loads a version or none does (``agreement.py``); the engine's first
        # worker resumes a pause whose trainer died or hangs (``guard.py``).
        group = self.node.group if self.node is not None else engine_group(self.parallel_config)
        self.agreement = EngineAgreement(group)
        self.rank_in_engine = group.rank_in_group if group is not None else 0
        self.guard = PauseGuard()
        self.faults = WorkerFaults.from_env(self.rank_in_engine)
        # The staging arena is made here, when vLLM creates the engine, before vLLM sizes its KV cache
        # (docs/engines/vllm.md, "Memory"), and touched, so no version pays for its pages.
        nbytes = sum(spec.nbytes for spec in self.checkpoint.specs.values())
        self.arena: Arena | None = None
        if self.receives:
            self.arena = HostArena(nbytes) if self.staging == "host" else Arena.on_device(nbytes, runtime.device)
            if isinstance(self.arena, HostArena) and runtime.kind != "host":
                self.arena.pin()
        self.stager = BucketStager(self.checkpoint.specs, "/init_weight_transfer_engine", runtime,
                                   arenas=(self.arena,) if self.arena is not None else ())
        self.version = 0  # the last version this worker loaded; a version must be newer to be loaded
        # A version started in the background, on every worker (also those that do not receive it): what
        # finish_weight_update completes.
        self.pending: UpdateRequest | AdapterUpdate | None = None
        self.fixes = PostLoadFixes.of(model)  # what vLLM's reload leaves stale, repaired after each load
        self.background = BackgroundReceive(self.stager, self._verify)
        self.credentials = PayloadGuard.from_environment(os.environ)  # the trainer's, checked in every payload
        if not self.credentials.guarding:
            log.warning("asyncsync: weight-transfer calls are not authenticated (vLLM's --api-key does not cover "
                        "them): start the server with ASYNCSYNC_TOKEN or VLLM_API_KEY set to the trainer's token")
        pc = self.parallel_config
        self.adapters = WorkerAdapters(vllm_config, model, self.checkpoint.specs,
                                       writer=pc.rank == 0 and pc.data_parallel_index == 0)
        self._handlers: dict[type, Callable[[Any], None]] = {
            LayoutCheck: self._check_layout, AdapterCheck: self.adapters.check, BaseCheck: self._check_base,
            AdapterUpdate: self._receive_adapter, DiscardRequest: self._discard, UpdateRequest: self._receive,
            CommitRequest: self._commit,
        }
        where = f"{nbytes / 1e6:.1f} MB staging arena on {'host shared memory' if self.staging == 'host' else device}"
        log.info("asyncsync: staging %s: %s", self.staging, where if self.arena is not None else
                 "this worker loads from its engine's stager's arena (it receives nothing)")

    def parse_init_info(self, init_dict: dict[str, Any]) -> InitGroupRequest:  # type: ignore[override]
        self.credentials.check(init_dict, "/init_weight_transfer_engine")
        return InitGroupRequest.from_json(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:  # type: ignore[override]
        """An ``UpdateRequest``, or what else the trainer's client carries in ``update_info``
        (``protocol.tags.UPDATE_INFO``, the table the client encodes with)."""
        return UPDATE_INFO.decode(update_dict)

    def init_transfer_engine(self, init_info: InitGroupRequest) -> None:  # type: ignore[override]
        """Join the trainer's groups: every worker as its own rank (``device``), or the engine's stager as
        the engine's one rank (``host``: ``rank_offset + data-parallel index``); a relay's edges are
        for an engine of one data-plane rank (the trainer plans no relay through any other). The
        engine's first worker also tells its pause guard which trainer to watch (``guard.py``)."""
        with self.guard.rpc():
            if self.rank_in_engine == 0:
                self.guard.joined(init_info.group, init_info.server_url)
            if self.receives:
                self._join(init_info)

    def _join(self, init_info: InitGroupRequest) -> None:
        pc = self.parallel_config
        if self.node is None:
            rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        else:
            rank = init_info.rank_offset + pc.data_parallel_index
        self.background.join(init_info.groups, rank, init_info.relay)  # drops a version of the old groups, which cannot complete

    def start_weight_update(self) -> None:
        """Nothing to prepare (the reload is opened only once a version is verified); a trainer's version
        begins, so the pause guard watches for a pause that trainer might leave behind."""
        with self.guard.rpc(start=True):
            pass

    def update_weights(self, update_info: dict[str, Any]) -> None:  # type: ignore[override]
        """One handler per message the trainer's client carries in ``update_info``: a version (``in_rpc``:
        received, verified and loaded here; ``background``: started on the worker thread), an
        adapter version, a ``DiscardRequest`` (drop a background version), and the checks made at the
        trainer's connect (``LayoutCheck``, ``AdapterCheck``, ``BaseCheck``), which raise to refuse; a
        ``CommitRequest`` applies the version received in the background. Each carries the trainer's
        credential (``Unauthorized`` before anything is decoded, if not)."""
        self.credentials.check(update_info, "/update_weights")
        request = self.parse_update_info(update_info)
        with self.guard.rpc():
            self._handlers[type(request)](request)

    def _check_layout(self, check: LayoutCheck) -> None:
        self.stager.admission.check_layout(check)
        self.fixes.check_plan()

    def _check_base(self, check: BaseCheck) -> None:
        self.adapters.check_base(check, self.version, self.checkpoint)

    def _discard(self, request: DiscardRequest) -> None:
        self.background.cancel()
        self.pending, self.adapters.pending = None, None
        log.info("discarded version %d", request.version)

    def _refuse_while_pending(self, what: str) -> None:
        busy = self._pending_version()
        if busy is not None:
            raise VersionRejected(f"{what} rejected: version {busy} is being received in the background; commit "
                                  "or discard it first")

    def _receive(self, request: UpdateRequest) -> None:
        self._refuse_while_pending(f"version {request.version}")
        self._refuse_digests_in_rpc(request)
        if request.receive == "background":
            self._led(lambda: self.background.start(request, self.version))  # raises VersionRejected if one is in flight
            self.pending = request
            return
        self._load_whole(request.version, lambda: self._staged(request, lambda: self.receive_weights(request)))
        torch.accelerator.synchronize()  # as vLLM's base class: the next step uses the new weights

    @staticmethod
    def _refuse_digests_in_rpc(request: UpdateRequest) -> None:
        """The digests come with the commit, after the transfer: a version checked against them is
        received in the background, never applied inside the RPC that receives it."""
        if request.digest and request.receive != "background":
            raise VersionRejected(f"version {request.version} rejected: it is checked against the trainer's digests, "
                                  "which come after the transfer: receive it in the background (receive: background)")

    def receive_weights(self, update_info: UpdateRequest) -> StagedVersion:  # type: ignore[override]
        """Receive and verify a version here (the data plane, or a same-host trainer's shared memory
        copied once into the arena); raises ``VersionRejected`` before the model is touched."""
        staged = self.stager.receive(update_info, self.version)
        self.fixes.check(staged.version)
        return staged

    def _led(self, step: Callable[[], Any]) -> Any:
        """``step`` on a worker that receives; with host staging, its outcome on every worker."""
        return step() if self.node is None else self.node.led(step, None)

    def _staged(self, request: UpdateRequest, step: Callable[[], StagedVersion]) -> StagedVersion:
        """The verified version every worker loads: received here by ``step``, or (host staging, a peer)
        mapped from the stager's arena once it shared that it verified ``request``."""
        if self.node is None:
            return step()
        if self.node.stager:
            return self.node.led(step, self.arena if isinstance(self.arena, HostArena) else None)
        return self.node.staged(request)

    def _verify(self, staged: StagedVersion) -> None:
        """The worker's own rules for a version received in the background (an adapter's, or weights')."""
        pending = self.adapters.pending
        if pending is not None:
            self.adapters.verify(pending, staged)
        else:
            self.fixes.check(staged.version)

    def _receive_adapter(self, update: AdapterUpdate) -> None:
        """An adapter version: received and verified like any (``background``: on the worker thread,
        written at the commit), then written as a PEFT directory by the writer, never loaded here. With
        host staging only the stager receives it (it is the writer); its peers share its outcome."""
        self._refuse_while_pending(f"adapter version {update.update.version}")
        self._refuse_digests_in_rpc(update.update)
        if update.update.receive == "background":
            self._led(lambda: self._start_adapter(update))
            self.pending = update
            return
        self._led(lambda: self._adapter_now(update))

    def _start_adapter(self, update: AdapterUpdate) -> None:
        self.adapters.pending = update
        try:
            self.background.start(update.update, self.adapters.served(update), self.adapters.expected(update))
        except BaseException:
            self.adapters.pending = None
            raise

    def _adapter_now(self, update: AdapterUpdate) -> None:
        staged = self.stager.receive(update.update, self.adapters.served(update), self.adapters.expected(update))
        self.adapters.verify(update, staged)
        self.adapters.write(update, staged)

    def _commit(self, request: CommitRequest) -> None:
        """Load the version received in the background (an adapter version: write it as a PEFT
        directory), if its buckets hash to the commit's digests where it was announced with them.
        Raises what the receive raised (a refused version), or ``VersionRejected`` when another
        version (or none) is pending; nothing is pending afterwards either way."""
        busy = self._pending_version()
        if busy != request.version:
            if busy is not None:
                self._discard(DiscardRequest(busy))
            raise VersionRejected(f"version {request.version} rejected: "
                                  f"{'nothing' if busy is None else f'version {busy} (dropped)'} was received in "
                                  "the background")
        pending, self.pending = self.pending, None
        assert pending is not None
        try:
            if isinstance(pending, AdapterUpdate):
                self.adapters.pending = None
                window = finish_window_s(pending.update, FINISH_WAIT_S)
                self._led(lambda: self.adapters.write(pending, published(self.background.take(window),
                                                                         request.digests)))
            else:
                window = finish_window_s(pending, FINISH_WAIT_S)
                self._load_whole(pending.version, lambda: self._staged(
                    pending, lambda: published(self.background.take(window), request.digests)))
        finally:
            self.background.released()  # the arena may be received into once the load has read it

    def finish_weight_update(self) -> None:
        """Ends vLLM's update session and loads nothing (vLLM passes the worker nothing that could be
        authenticated): the version was loaded in ``update_weights``, by its ``CommitRequest``, or is
        dropped here, none having committed it. Never raises."""
        with self.guard.rpc(finish=True):
            busy = self._pending_version()
            if busy is not None:
                log.warning("update session finished without the trainer's commit: version %d, received in the "
                            "background, is dropped, not loaded", busy)
                self._discard(DiscardRequest(busy))

    def _pending_version(self) -> int | None:
        pending = self.pending
        if pending is None:
            return None
        return pending.update.version if isinstance(pending, AdapterUpdate) else pending.version

    def drain_pending(self) -> None:
        """vLLM's hook for callers that run the update's tail themselves: nothing to do. A version
        received in the background is applied only by the trainer's authenticated ``CommitRequest``,
        which loads it before its ``update_weights`` returns; this hook (reachable without the
        trainer's credential) never loads one."""

    def _load_whole(self, version: int, stage: Callable[[], StagedVersion]) -> None:
        """Stage ``version`` and load it on every worker of the engine, or on none: each step's outcome
        is agreed with the other workers before any reports success (``agreement.py``). A load that
        failed on any worker leaves the engine mixed: refused naming it, the engine core serving
        nothing (``hold.py``) until a whole version loads on every worker."""
        start = time.perf_counter()
        staged = self.agreement.ready(version, stage)
        self.agreement.loaded(version, lambda: self._load(staged))
        self.version = staged.version
        self.stager.buffers.mark_committed(staged)  # the arena holds this version's bytes: the next delta's baseline
        log.info("loaded version %d (%d buckets) in %.3fs", staged.version, len(staged.buckets),
                 time.perf_counter() - start)

    def _load(self, staged: StagedVersion) -> None:
        initialize_layerwise_reload(self.model)
        try:
            loaded = self.model.load_weights(self.faults.loading(staged.version, staged.tensors()))
        finally:
            finalize_layerwise_reload(self.model, self.model_config)
        self.fixes.repair(loaded)
        self.stager.runtime.return_freed()  # the reload's per-layer temporaries, not kept by the heap

    def shutdown(self) -> None:
        self.guard.close()
        self.background.close()
        self.adapters.close()


def published(staged: StagedVersion, digests: tuple[str, ...]) -> StagedVersion:
    """``staged``, if it is what the trainer published (``digests``, the commit's, where the version was
    announced with them); else ``VersionRejected``, before anything is loaded."""
    reject_if(staged.unpublished(digests), staged.version)
    return staged


class CheckpointTensors(Mapping[str, torch.Tensor]):
    """The served checkpoint's tensors by name, read from its safetensors files one at a time when
    looked up; ``specs``: every tensor's name, dtype and shape (headers only, read here): the HF
    names, dtypes and shapes an update must carry."""

    def __init__(self, vllm_config: Any):
        from safetensors import safe_open

        self.specs: dict[str, TensorSpec] = {}
        self._files: dict[str, str] = {}
        for path in _safetensors_files(vllm_config):
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    entry = f.get_slice(name)
                    self.specs[name] = TensorSpec(name, dtype_from_safetensors(entry.get_dtype()), tuple(entry.get_shape()))
                    self._files[name] = path

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._files[name], framework="pt") as f:
            return f.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.specs)

    def __len__(self) -> int:
        return len(self.specs)


def _safetensors_files(vllm_config: Any) -> list[str]:
    model = vllm_config.model_config.model
    folder = model if os.path.isdir(model) else _cached_snapshot(model, vllm_config)
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise RuntimeError(
            f"asyncsync: no *.safetensors in {folder}: the asyncsync backend verifies updates against the "
            "checkpoint's tensor names and shapes, so serve a safetensors checkpoint"
        )
    return files


def _cached_snapshot(repo_id: str, vllm_config: Any) -> str:
    """The local copy vLLM downloaded at start-up (never downloads anything itself)."""
    from huggingface_hub import snapshot_download

    return snapshot_download(
        repo_id, revision=vllm_config.model_config.revision, cache_dir=vllm_config.load_config.download_dir,
        allow_patterns=["*.safetensors"], local_files_only=True,
    )
