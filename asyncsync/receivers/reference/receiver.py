"""The reference server's receiving side: stage a version in flat buffers, swap it in whole."""

from __future__ import annotations

import hashlib
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence

import torch

from asyncsync.checkpoint import CheckpointStage, Conversion, is_transformers_model, meta_tensors, to_memory
from asyncsync.protocol.arena import STAGINGS, Arena, HostArena, Staging
from asyncsync.protocol.device import runtime_for
from asyncsync.protocol.group import Abandoner, DataPlaneGroup
from asyncsync.protocol.specs import LAYOUTS, BucketPlan, TensorSpec, unpack
from asyncsync.protocol.admission import VersionRejected, reject_if
from asyncsync.protocol.stager import BucketStager
from asyncsync.protocol.staging import StagedVersion
from asyncsync.protocol.wire import BucketMeta, GroupSpec, UpdateRequest

__all__ = ["VersionRejected", "WeightReceiver", "tensor_bytes"]


class WeightReceiver:
    """Receives a version into flat staging buffers and swaps it in only when all of it arrived intact.

    Lifecycle::

        receiver.join(spec, rank)
        for version in updates:
            receiver.receive(request)      # takes part in every broadcast, even of a bad version (but one
                                           # naming unknown tensors or past the budget: none, it leaves the group)
            receiver.commit(version)       # live tensors become views of the received buffers

    SGLang's protocol sends a version one bucket per request instead: ``receive_bucket`` for each,
    then ``seal`` with the version, then ``commit``. Either way bytes land directly in the buffers the
    model will use (no unpack copy), and the buffers backing the live weights are never received into.

    Versions carry the checkpoint layout, as for every engine (``asyncsync.checkpoint``); tensors the
    model holds in another layout (a transformers-5 MoE's fused experts) are built from their
    checkpoint tensors at ``commit`` by transformers' own load conversion, before generation is
    held: a copy of those groups, the only bytes that are not swapped in from the buffers themselves.
    With ``layout="trainer"`` versions carry the model's own in-memory names and layouts instead (a
    trainer of the same transformers class with ``layout: trainer``): nothing is converted.

    ``staging`` (``protocol.arena``), allocated and touched when the server first joins a group (a
    same-host server fed through shared memory serves from the trainer's segment and needs none):

    * ``device`` (the default): two whole-version arenas on the weights' device; the live weights
      alias one (moved there at the join), the next version is received into the other and swapped
      in: generation is held only for pointer moves, and the old version serves during the whole
      receive. Costs one extra version beside the live weights.
    * ``host``: one arena in host shared memory; a verified version is copied into the live weights
      under the serving lock (generation held for that copy). Costs one version of host memory; on a
      CPU server the same bytes as ``device``, on a CUDA one none of the device's.
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], serve_lock: threading.Lock, version: int = 0,
                 model: torch.nn.Module | None = None, max_version_bytes: int | None = None,
                 abandoner: Abandoner | None = None, layout: str = "checkpoint", staging: Staging = "device"):
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: expected one of {list(LAYOUTS)}")
        if staging not in STAGINGS:
            raise ValueError(f"staging {staging!r}: expected one of {list(STAGINGS)}")
        self.staging = staging
        self._live = dict(weights)
        self.runtime = runtime_for(next(iter(self._live.values())).device)
        self.serve_lock = serve_lock
        self.version = version
        self.applied: deque[int] = deque(maxlen=256)  # recent versions swapped in, for operators and tests
        # Versions arrive in the checkpoint layout every engine loads (``asyncsync.checkpoint``): for a
        # transformers model, which of its tensors each checkpoint tensor comes from.
        self.model = model
        converts = layout == "checkpoint" and model is not None and is_transformers_model(model)
        stages = [CheckpointStage(model)] if converts else []
        self.groups = Conversion(stages).plan(meta_tensors(self._live))
        specs = {t.name: t for g in self.groups for t in g.targets}
        self.stager = BucketStager(specs, "/init_group", self.runtime, max_version_bytes=max_version_bytes,
                                   abandoner=abandoner)
        self._staged: StagedVersion | None = None
        self.last_switch_s = 0.0  # how long the last commit held generation (``serve_lock``)

    @property
    def expected_names(self) -> list[str]:
        """The tensor names every version must carry (the model's, a tied weight once)."""
        return list(self.stager.admission.expected)

    def join(self, specs: GroupSpec | Sequence[GroupSpec], rank: int, warmup: bool = True,
             relay: Sequence[GroupSpec] = ()) -> None:
        """Join the trainer's group(s) as ``rank`` (a sharded trainer's: one per owning rank) and the
        ``relay`` edges below this server; the first join makes the staging arenas, so no version of
        the session pays for their pages."""
        self.stager.joined.join(specs, rank, warmup, relay)
        if not self.stager.buffers.arenas:
            self._make_arenas()

    def _make_arenas(self) -> None:
        nbytes = self.stager.admission.model_bytes
        if self.staging == "host":
            arena = HostArena(nbytes)
            if self.runtime.kind != "host":
                arena.pin()
            self.stager.buffers.stage_in((arena,))
            return
        live = self._move_live(Arena.on_device(nbytes, self.runtime.device))
        self.stager.buffers.stage_in((Arena.on_device(nbytes, self.runtime.device), live), live=live)

    def _move_live(self, arena: Arena) -> Arena:
        """Re-point the live tensors that versions replace whole (not the converted groups, which are
        rebuilt per version) into ``arena``: the weights they held at start-up are freed, so the
        server holds two versions, not three. Runs on the data-plane thread, the only one that
        changes weights; generation is held only for the pointer moves."""
        renamed = [g for g in self.groups if g.renamed]
        with torch.no_grad():
            specs = [TensorSpec.of(g.sources[0], self._live[g.sources[0]]) for g in renamed]
            bucket = BucketPlan(specs, bucket_bytes=max(nbytes_of(specs), 1)).buckets[0] if specs else None
            views = dict(unpack(arena.views([bucket.nbytes])[0], bucket)) if bucket is not None else {}
            for name, view in views.items():
                view.copy_(self._live[name])
            with self.serve_lock:
                for name, view in views.items():
                    self._live[name].set_(view)
        return arena

    def receive(self, req: UpdateRequest) -> None:
        """Receive every bucket of ``req`` (from the data plane, or mapped from the trainer's shared
        memory when ``req.shm``: the live tensors will then be views of the mapping, no copy); raise
        ``VersionRejected`` after the last one if anything was wrong (unknown name, shape or dtype,
        missing tensor, bad checksum, stale version)."""
        self._staged = None
        self._staged = self.stager.receive(req, self.version)

    @property
    def holds(self) -> tuple[str, ...]:
        """The trainer's shared-memory segments the live weights map (the trainer keeps them intact)."""
        return self.stager.buffers.holds

    def receive_bucket(self, meta: BucketMeta, group: DataPlaneGroup | None = None) -> None:
        """Receive one bucket of a version sent bucket by bucket (SGLang's protocol), on ``group``
        (SGLang's groups are named per request) or the one joined."""
        self._staged = None
        self.stager.assembly.receive_bucket(meta, group)

    def discard(self) -> None:
        """Forget the buckets received since the last version (a version abandoned half-way)."""
        self.stager.assembly.discard()

    def seal(self, version: int) -> None:
        """The buckets received since the last version form ``version``: check it is whole, stage it."""
        self._staged = self.stager.assembly.seal(version, self.version)

    def commit(self, version: int, digests: tuple[str, ...] = ()) -> int:
        """Point every live tensor at its bytes in the received buffers, under ``serve_lock`` so
        generation never sees a torn state. A version announced with digests is committed only when
        every bucket hashed to the trainer's ``digests`` (else it is dropped, refused whole)."""
        staged = self._staged
        if staged is None or staged.version != version:
            have = staged.version if staged else None
            raise VersionRejected(f"version {version} is not staged (staged: {have}); send /update for it first")
        unpublished = staged.unpublished(digests)
        if unpublished:
            self._staged = None
            reject_if(unpublished, version)
        views = dict(staged.tensors())
        made: dict[str, torch.Tensor] = {}
        with torch.no_grad():  # converted groups are built while generation goes on (copies: no aliasing)
            for group in self.groups:
                if group.renamed:  # the live tensor will alias its bytes in the buffer
                    made[group.sources[0]] = views[group.targets[0].name]
                    continue
                assert self.model is not None
                built = to_memory(self.model, {n: views[n] for n in group.target_names})  # transformers' load
                made.update((name, built[name]) for name in group.sources)
        # With host staging the arena is received into again: what would alias it is copied out (a
        # zero-copy version mapped from the trainer's segment is served from there, as ever; live
        # weights that still map one, read-only, get storage of their own).
        host_copy = self.staging == "host" and staged.segment is None
        copied = {g.sources[0] for g in self.groups if g.renamed} if host_copy else set()
        with self.serve_lock, torch.no_grad():
            start = time.perf_counter()
            for name, tensor in made.items():
                if name not in copied:
                    self._live[name].set_(tensor)
                elif self.stager.buffers.holds:
                    self._live[name].set_(tensor.clone())
                else:
                    self._live[name].copy_(tensor)
            self.version = version
            self.applied.append(version)
            if host_copy:
                self.stager.buffers.mark_committed(staged)
            else:
                self.stager.buffers.mark_live(staged)
            self.last_switch_s = time.perf_counter() - start
        self._staged = None
        self.runtime.return_freed()  # what the swap and the conversions freed goes back to the OS
        return version

    def digest(self) -> tuple[int, dict[str, str]]:
        """The served version and the SHA-256 of every live tensor's bytes, taken together: compares
        weights bit for bit without shipping them."""
        with self.serve_lock:
            return self.version, {n: hashlib.sha256(tensor_bytes(t)).hexdigest() for n, t in self.served().items()}

    def served(self) -> dict[str, torch.Tensor]:
        """The live weights in the checkpoint layout versions arrive in (converted groups as copies)."""
        out: dict[str, torch.Tensor] = {}
        for group in self.groups:
            if group.renamed:
                out[group.targets[0].name] = self._live[group.sources[0]]
            else:
                out.update(Conversion([CheckpointStage(self.model)]).apply({n: self._live[n] for n in group.sources}))
        return out

    def close(self) -> None:
        self.stager.joined.leave()


def nbytes_of(specs: Sequence[TensorSpec]) -> int:
    return sum(s.nbytes for s in specs)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes in C order, whatever its dtype (bfloat16 has no numpy dtype)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
