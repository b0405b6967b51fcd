"""Receiving a version into flat buffers and verifying it, before anything is applied.

Every receiver shares this half of the job: the reference server (which then swaps the buffers in),
asyncsync's vLLM engine (which then calls ``model.load_weights`` on views of them) and the reference
server's SGLang API (which receives one bucket per request). What differs is only how the verified
bytes are applied, and that stays with each receiver.

Nothing is allocated for a version before its announcement was validated against the served model:
a version that names a tensor the model does not have, or that would need more than the receiver's
staging budget (``max_version_bytes``: by default the served model's own size, which is exactly what
a valid version holds), is refused before any receive is posted, and the receiver leaves its groups
so that the trainer's broadcasts fail at once instead of waiting for it. Any other version the
receiver takes part in to the end before it judges what arrived (a wrong shape, a stale version, a
bad checksum), so such a rejection never leaves the trainer or the other receivers waiting in a
collective. On the data plane every payload's size is first agreed through a frame header
(``protocol.frames``): a member that would send more than was announced is refused, not aborted on.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from asyncsync.protocol.admission import Admission, BucketRefused, VersionRejected, reject_if
from asyncsync.protocol.arena import Arena, DeviceRing, HostArena
from asyncsync.protocol.checksum import bucket_crc
from asyncsync.protocol.device import HostRuntime, Runtime
from asyncsync.protocol.group import Abandoner, DataPlaneError, DataPlaneGroup
from asyncsync.protocol.frames import VersionFrames
from asyncsync.protocol.relay import Edges
from asyncsync.protocol.receive import FramedReceive, Unframed
from asyncsync.protocol.shm import HostIdentity, ShmUnavailable, map_segment
from asyncsync.protocol.specs import Bucket, TensorSpec, unpack
from asyncsync.protocol.wire import BucketMeta, GroupSpec, UpdateRequest, WireError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StagedVersion:
    """A whole version received and verified in flat buffers, not yet applied. ``views`` are typed
    views of every tensor inside the buffers, in broadcast order (no copy), made while the buckets
    were still arriving, so that applying a version only swaps tensors in."""

    version: int
    buffers: tuple[torch.Tensor, ...]
    buckets: tuple[Bucket, ...]
    views: tuple[tuple[str, torch.Tensor], ...]
    segment: str | None = None  # the trainer's shared-memory segment the buffers map (zero-copy adoption)

    @classmethod
    def of(cls, version: int, buffers: tuple[torch.Tensor, ...], buckets: tuple[Bucket, ...],
           segment: str | None = None) -> StagedVersion:
        views = tuple(v for buf, bucket in zip(buffers, buckets) for v in unpack(buf, bucket))
        return cls(version, buffers, buckets, views, segment)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor's view, in broadcast order."""
        return iter(self.views)


@dataclass(frozen=True)
class _FlatSet:
    """The buffers of one bucket layout; a set that backs live weights is never received into."""

    layout: tuple[BucketMeta, ...]
    buffers: tuple[torch.Tensor, ...]


def _within(tensor: torch.Tensor, arena: Arena) -> bool:
    start = arena.tensor.data_ptr()
    return start <= tensor.data_ptr() < start + max(arena.nbytes, 1)


class BucketStager:
    """Receives buckets from a data-plane group into reusable flat buffers and checks them against
    the tensors the receiver expects (names, dtypes, shapes, every one exactly once).

    Two ways in, one way out::

        staged = stager.receive(request, served)    # a whole version (asyncsync's protocol; from the
                                                     # trainer's shared memory when request.shm: adopt)
        # or, one bucket per call (SGLang's protocol):
        stager.receive_bucket(meta); ...; staged = stager.seal(version, served)
        apply(staged.tensors())                      # the receiver's business
        stager.mark_live(staged)                     # the live weights now alias the buffers, or:
        stager.mark_committed(staged)                # the receiver copied the version out (vLLM)

    Where versions are staged (``protocol.arena``): in ``arenas``, whole-version buffers made once
    and touched (``stage_in``): with one, every version is received into it (a receiver that copies
    each version out: vLLM's worker, the reference server's ``host`` staging); with two, into the one
    the live weights do not alias (the reference server's ``device`` staging swaps them). Without,
    in buffer sets allocated per layout (a receiver serving straight from the mapping of a same-host
    trainer's segment). An arena in host memory on a device runtime (NCCL) receives through a
    ``DeviceRing`` of two bucket-sized device buffers.

    The committed version's bytes are the baseline of a delta version (``UpdateRequest.delta``):
    each delta bucket is rebuilt from them into the staging and checked against the full bucket's
    CRC32C. They stay intact where the live weights alias them (a set never received into); in an
    arena they last until the next version is received into it.
    """

    def __init__(self, expected: Mapping[str, TensorSpec], join_route: str, runtime: Runtime | None = None,
                 arenas: Sequence[Arena] = (), max_version_bytes: int | None = None,
                 abandoner: Abandoner | None = None):
        self.admission = Admission(expected, max_version_bytes)  # what a version may hold, and its bytes
        self.join_route = join_route  # named in the error when an update arrives before the group
        self.abandoner = abandoner  # lets another thread give up a join that hangs on a silent peer
        # Buffers are staged on the receiver's weights' device; its runtime also decides the group's
        # backend (an NCCL group is refused for weights that are not on CUDA).
        self.runtime = runtime or HostRuntime()
        self.arenas: tuple[Arena, ...] = ()
        self._ring: DeviceRing | None = None
        self._live_arena: Arena | None = None  # the arena the live weights alias (two-arena staging)
        self.stage_in(arenas)
        self.groups: list[DataPlaneGroup] = []  # group i is trainer rank i's (a sharded trainer's owners)
        self.relay = Edges()  # the edges to the servers below this one (fanout)
        self._sets: list[_FlatSet] = []
        self._live: _FlatSet | None = None
        self._live_segment: str | None = None  # the shared-memory segment the live weights map, if any
        self._mappings: dict[str, torch.Tensor] = {}  # segment -> its mapping (the live one and the last adopted)
        self._partial: list[tuple[BucketMeta, torch.Tensor, Bucket]] = []
        self._partial_problems: list[str] = []
        self._committed: StagedVersion | None = None  # the baseline of delta versions, while intact

    def stage_in(self, arenas: Sequence[Arena], live: Arena | None = None) -> None:
        """Stage every later version in ``arenas`` (see the class); ``live``: one of them that the live
        weights alias now (never received into until another version is live)."""
        self.arenas, self._live_arena = tuple(arenas), live
        host_arena = any(isinstance(a, HostArena) for a in self.arenas)
        self._ring = DeviceRing(self.runtime.device) if host_arena and self.runtime.kind != "host" else None
        self._sets = []

    @property
    def device_bytes(self) -> int:
        """The staging's bytes on the weights' device: device arenas, and a ring's buffers."""
        arenas = sum(a.nbytes for a in self.arenas if not isinstance(a, HostArena) and self.runtime.kind != "host")
        return arenas + (self._ring.nbytes if self._ring is not None else 0)

    def join(self, specs: GroupSpec | Sequence[GroupSpec], rank: int, warmup: bool = True,
             relay: Sequence[GroupSpec] = ()) -> None:
        """Join the trainer's group (a sharded trainer's: one per owning trainer rank, in order) as
        ``rank``, then the ``relay`` edges below (``protocol.relay``); ``WireError`` (before any
        rendezvous) when a group's backend is not the one this receiver's weights take."""
        specs = (specs,) if isinstance(specs, GroupSpec) else tuple(specs)
        _check_backends((*specs, *relay), self.runtime)
        self.close()
        try:
            for spec in specs:
                self.groups.append(DataPlaneGroup.join(spec, rank, self.runtime, warmup, self.abandoner))
            self.relay.join(relay, self.runtime, warmup, self.abandoner)
        except BaseException:
            self.close()
            raise

    @property
    def group(self) -> DataPlaneGroup | None:
        """The first group (trainer rank 0's): the only one of an unsharded trainer."""
        return self.groups[0] if self.groups else None

    def _require_group(self) -> DataPlaneGroup:
        if not self.groups:
            raise VersionRejected(f"no data-plane group: call {self.join_route} before sending updates")
        return self.groups[0]

    # -- a whole version per request ------------------------------------------------------------

    def receive(self, req: UpdateRequest, served_version: int,
                carrying: Mapping[str, TensorSpec] | None = None) -> StagedVersion:
        """Receive every bucket of ``req`` (and the checksum manifest when ``req.checksum``); raise
        ``VersionRejected`` after the last broadcast if anything is wrong, or before the first one
        (leaving the groups) when the version cannot be received at all. With ``req.shm`` the
        version is mapped from the trainer's shared memory instead (``adopt``): no group is needed.
        ``carrying``: the tensors this version must carry, when not the receiver's own (an adapter's).

        Each frame's header is received and checked before its payload's receive is posted, and the
        bucket before it is checksummed while the payload arrives (on the receiver's side gloo runs
        the receives in order): what is left after the last byte is one bucket's checksum. Each wait
        returns only once its data has arrived (the group's waits block the host), so nothing is
        verified, and no answer given, before the data is really in the buffers."""
        if req.shm is not None:
            return self.adopt(req, served_version, carrying)
        self._require_group()
        self.relay.wait_forwards()  # the last version's forwards read the buffers this one may be received into
        self.discard()
        buckets = tuple(meta.to_bucket(i) for i, meta in enumerate(req.buckets))
        self._refuse_unreceivable(req, buckets, carrying)
        problems = self.admission.check_complete(list(buckets), req.version, served_version, carrying)
        base = self._committed
        unusable = _check_base(req, base) if req.delta is not None else []
        problems += unusable
        target = self._set_for(req.buckets)
        receive = FramedReceive(req, self.groups, self.runtime, self._ring, target.buffers, buckets,
                                None if unusable or base is None else base.buffers, problems,
                                self.relay.forward(VersionFrames.of(req), self.runtime, 0 if self._ring else None))
        try:
            receive.run()
        except (Unframed, DataPlaneError) as e:
            failed: tuple[str, bool] | None = (str(e), isinstance(e, DataPlaneError))
        else:
            failed = None
        if failed is not None:
            # Leave the group: a refused frame's payload was never posted, so the sender's broadcast
            # fails at once; after a failed one the group's collectives are out of step. Raised as text,
            # out of the handler: an exception chained to the failure would keep its works, and with
            # them the group's sockets, alive.
            del receive
            self.close(broken=True)
            problem, data_plane = failed
            if data_plane:
                raise DataPlaneError(problem)
            raise VersionRejected(f"version {req.version} rejected before its payload: {problem}; left the "
                                  f"data-plane group (call {self.join_route} again)")
        reject_if(problems, req.version)
        return StagedVersion.of(req.version, target.buffers, buckets)

    def _refuse_unreceivable(self, req: UpdateRequest, buckets: tuple[Bucket, ...],
                             carrying: Mapping[str, TensorSpec] | None = None) -> None:
        """Refuse, before any receive is posted or any buffer allocated, a version that names a tensor
        it must not carry, needs more than the staging budget, or arrives on a group not joined;
        the groups are left so that the trainer's broadcasts fail at once instead of waiting."""
        why = self.admission.unstageable(buckets, req.nbytes, whole=True, carrying=carrying)
        if req.sources and max(req.sources) >= len(self.groups):
            why.append(f"it names group {max(req.sources)}, but {len(self.groups)} were joined")
        if why:
            self.close(broken=True)
            reject_if([*why, f"nothing was received; call {self.join_route} again"], req.version)

    def adopt(self, req: UpdateRequest, served_version: int,
              carrying: Mapping[str, TensorSpec] | None = None) -> StagedVersion:
        """A whole version from the trainer's shared memory (``req.shm``, ``protocol/shm.py``), judged
        as ``receive`` judges one from the wire; raises ``VersionRejected`` if anything is wrong.

        Without an arena the staged buffers are views of the mapping itself (zero copy: once
        committed and ``mark_live``, ``holds`` names the segment until a later version replaces it);
        with one, each bucket is copied into the arena, and the copy is what is checksummed."""
        shm = req.shm
        assert shm is not None, "adopt() is for requests that name a shared version"
        if self.runtime.kind != "host":
            raise VersionRejected(f"version {req.version} rejected: this server's weights are on {self.runtime.device}; "
                                  "a shared-memory version is for host weights (use transport: collective)")
        if shm.host != HostIdentity.here():
            raise VersionRejected(f"version {req.version} rejected: the trainer's shared memory is on another host "
                                  f"({shm.host}, here {HostIdentity.here()}): use transport: collective for this server")
        buckets = tuple(meta.to_bucket(i) for i, meta in enumerate(req.buckets))
        problems = self.admission.check_complete(list(buckets), req.version, served_version, carrying)
        reject_if(problems, req.version)
        try:
            mapped = self._mapping(shm.segment, max(o + b.nbytes for o, b in zip(shm.offsets, buckets)))
        except ShmUnavailable as e:
            raise VersionRejected(f"version {req.version} rejected: {e}") from None
        views = tuple(mapped[o : o + b.nbytes] for o, b in zip(shm.offsets, buckets))
        segment: str | None = shm.segment
        if self.arenas:  # copied once, and the copy is what is verified (and later loaded)
            views, segment = self._set_for(req.buckets).buffers, None
            for dst, (o, b) in zip(views, zip(shm.offsets, buckets)):
                dst.copy_(mapped[o : o + b.nbytes])
        if req.checksum:
            bad = [i for i, (view, want) in enumerate(zip(views, shm.crcs)) if bucket_crc(view) != want]
            reject_if([f"checksum mismatch in bucket(s) {bad}"] if bad else [], req.version)
        return StagedVersion.of(req.version, views, buckets, segment)

    def _mapping(self, segment: str, nbytes: int) -> torch.Tensor:
        """``segment`` mapped (at least ``nbytes``), each segment once: the trainer packs versions into
        the same few segments in turn, and mapping 300 MB again costs as much as checksumming it.
        Kept: the live weights' segment and this one; the others' mappings are dropped (a segment the
        trainer retired is never written again under a new version, so a kept mapping is never stale)."""
        mapped = self._mappings.get(segment)
        if mapped is None or mapped.numel() < nbytes:
            mapped = map_segment(segment, nbytes)
        self._mappings = {n: m for n, m in self._mappings.items() if n == self._live_segment} | {segment: mapped}
        return mapped

    @property
    def holds(self) -> tuple[str, ...]:
        """The trainer's shared-memory segments this receiver still maps (its live weights'), which the
        trainer must not rewrite: reported in every ``end`` answer."""
        return (self._live_segment,) if self._live_segment is not None else ()

    def _set_for(self, layout: tuple[BucketMeta, ...]) -> _FlatSet:
        """A buffer set for ``layout`` that the live weights do not use; sets of stale layouts are dropped.
        A set in an arena is received into over what it held: a committed version there is then no baseline."""
        free = next((a for a in self.arenas if a is not self._live_arena), None)
        sizes = [m.nbytes for m in layout]
        if free is not None and sum(sizes) <= free.nbytes:
            if self._committed is not None and any(_within(b, free) for b in self._committed.buffers):
                self._committed = None
            return _FlatSet(layout, free.views(sizes))
        self._sets = [s for s in self._sets if s is self._live or s.layout == layout]
        for s in self._sets:
            if s is not self._live:
                return s
        fresh = _FlatSet(layout, tuple(self._new_buffer(m) for m in layout))
        self._sets.append(fresh)
        return fresh

    # -- one bucket per request -----------------------------------------------------------------

    def receive_bucket(self, meta: BucketMeta, group: DataPlaneGroup | None = None) -> None:
        """Receive the next bucket of the version being assembled (one broadcast, no checksum) on
        ``group`` (default: the one joined); raise ``VersionRejected`` after it if it cannot belong
        to a valid version, or ``BucketRefused`` before it (nothing received or allocated) when it
        names a tensor the model does not have or would take the version past the staging budget.

        Names are unique within a version, so a bucket repeating a name already received starts a
        new version: the one being assembled was abandoned (a trainer that stopped half-way).
        """
        group = group or self._require_group()
        received = {s.name for _, _, b in self._partial for s in b.specs}
        if received.intersection(meta.names):
            log.warning("discarding an unfinished version of %d bucket(s): a new one started", len(self._partial))
            self.discard()
            received = set()
        index = len(self._partial)
        bucket = meta.to_bucket(index)
        why = self.admission.unstageable((bucket,), sum(m.nbytes for m, _, _ in self._partial) + meta.nbytes, whole=False)
        if why:
            self.discard()
            raise BucketRefused("bucket refused before its broadcast: " + "; ".join(why))
        buf = self._spare_buffer(index, meta)
        group.broadcast(buf)
        self._partial.append((meta, buf, bucket))
        problems = self.admission.check_specs(bucket.specs, received)
        if problems:
            self._partial_problems.extend(problems)
            reject_if(problems, None)

    def seal(self, version: int, served_version: int) -> StagedVersion:
        """Close the version assembled by ``receive_bucket``: it must hold every expected tensor."""
        parts, earlier = self._partial, self._partial_problems
        self.discard()
        buckets = [b for _, _, b in parts]
        reject_if(earlier or self.admission.check_complete(buckets, version, served_version), version)
        fresh = _FlatSet(tuple(m for m, _, _ in parts), tuple(buf for _, buf, _ in parts))
        self._sets = [s for s in (self._live, fresh) if s is not None]
        return StagedVersion.of(version, fresh.buffers, tuple(buckets))

    def discard(self) -> None:
        """Forget a version being assembled bucket by bucket (its buffers stay for reuse)."""
        self._partial, self._partial_problems = [], []

    def _spare_buffer(self, index: int, meta: BucketMeta) -> torch.Tensor:
        for s in self._sets:
            if s is not self._live and index < len(s.layout) and s.layout[index] == meta:
                return s.buffers[index]
        return self._new_buffer(meta)

    # -- shared ---------------------------------------------------------------------------------

    def _new_buffer(self, meta: BucketMeta) -> torch.Tensor:
        return torch.empty(meta.nbytes, dtype=torch.uint8, device=self.runtime.device)

    def mark_live(self, staged: StagedVersion) -> None:
        """The live weights now alias ``staged``'s buffers: receive the next version elsewhere."""
        self._committed = staged
        self._live_segment = staged.segment
        self._live = next((s for s in self._sets if s.buffers is staged.buffers), None)
        self._live_arena = next((a for a in self.arenas if staged.buffers and _within(staged.buffers[0], a)), None)

    def mark_committed(self, staged: StagedVersion) -> None:
        """The receiver now serves ``staged`` from copies of it (vLLM's load, the reference server's
        ``host`` staging): its live weights alias nothing staged, and ``staged``'s bytes are the next
        delta's baseline while they stay intact."""
        self._committed = staged
        self._live_segment, self._live, self._live_arena = None, None, None

    def close(self, broken: bool = False) -> None:
        """Leave the groups and the relay edges (aborting them when ``broken``: a receive of them may
        still be pending; the servers below then fail theirs at once)."""
        self.relay.close(broken)  # after a failure the servers below are told the version is lost
        groups, self.groups = self.groups, []
        for group in groups:
            group.close(broken)


def _check_backends(specs: Sequence[GroupSpec], runtime: Runtime) -> None:
    """``WireError`` when a group's backend is not the one weights on ``runtime``'s device take."""
    for spec in specs:
        if spec.backend != runtime.wire_backend:
            raise WireError(f"the trainer's group uses {spec.backend}, but this server's weights are on "
                            f"{runtime.device}, which take {runtime.wire_backend}: use backend: auto on "
                            "the trainer, or serve the model on the trainer's kind of device")


def _check_base(req: UpdateRequest, base: StagedVersion | None) -> list[str]:
    """Why ``req``'s deltas cannot be rebuilt here: no committed version held intact, or another one."""
    assert req.delta is not None
    if base is None:
        return [f"delta against version {req.delta.base}, but this receiver holds no committed version intact "
                "(restarted, or its last version was refused): send it whole"]
    if base.version != req.delta.base or tuple(BucketMeta.of(b) for b in base.buckets) != req.buckets:
        return [f"delta against version {req.delta.base}, but this receiver committed version {base.version}"
                + ("" if base.version != req.delta.base else " in another bucket layout") + ": send it whole"]
    return []
