"""Receiving a version into flat buffers and verifying it, before anything is applied.

Every receiver shares this half of the job: the reference server (which then swaps the buffers in),
asyncsync's vLLM engine (which then calls ``model.load_weights`` on views of them) and the reference
server's SGLang API (which receives one bucket per request). What differs is only how the verified
bytes are applied, and that stays with each receiver.

A receiver always takes part in every broadcast it was told about before it judges what arrived,
so a rejected version never leaves the trainer or the other receivers waiting in a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from asyncsync.protocol.checksum import bucket_crc
from asyncsync.protocol.delta import DeltaError, delta_word, rebuild
from asyncsync.protocol.device import HostRuntime, Runtime
from asyncsync.protocol.group import DataPlaneGroup
from asyncsync.protocol.shm import HostIdentity, ShmUnavailable, map_segment
from asyncsync.protocol.specs import Bucket, TensorSpec, unpack
from asyncsync.protocol.wire import BucketMeta, GroupSpec, UpdateRequest, WireError

log = logging.getLogger(__name__)

MAX_REPORTED_PROBLEMS = 5


class VersionRejected(Exception):
    """A version was received but not applied; the old weights keep serving. The message says why."""


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

    The committed version's bytes are the baseline of a delta version (``UpdateRequest.delta``):
    each delta bucket is rebuilt from them into the staging and checked against the full bucket's
    CRC32C. They stay intact where the live weights alias them (a set never received into); in an
    arena they last until the next version is received into it.
    """

    def __init__(self, expected: Mapping[str, TensorSpec], join_route: str, runtime: Runtime | None = None,
                 arena: bool = False):
        self.expected = dict(expected)
        self.join_route = join_route  # named in the error when an update arrives before the group
        # Buffers are staged on the receiver's weights' device; its runtime also decides the group's
        # backend (an NCCL group is refused for weights that are not on CUDA).
        self.runtime = runtime or HostRuntime()
        # With ``arena``, one flat buffer of a whole version is allocated now, at start-up, and every
        # version is received into views of it (a receiver that copies a version out, like vLLM's,
        # needs no second set): its memory is taken before an engine sizes its caches, not mid-run,
        # and written once, so that an engine sizing them from resident memory (vLLM on CPU) sees it.
        total = sum(spec.nbytes for spec in self.expected.values())
        self.arena = torch.zeros(total, dtype=torch.uint8, device=self.runtime.device) if arena else None
        self.groups: list[DataPlaneGroup] = []  # group i is trainer rank i's (a sharded trainer's owners)
        self._sets: list[_FlatSet] = []
        self._live: _FlatSet | None = None
        self._live_segment: str | None = None  # the shared-memory segment the live weights map, if any
        self._mappings: dict[str, torch.Tensor] = {}  # segment -> its mapping (the live one and the last adopted)
        self._partial: list[tuple[BucketMeta, torch.Tensor, Bucket]] = []
        self._partial_problems: list[str] = []
        self._committed: StagedVersion | None = None  # the baseline of delta versions, while intact

    def join(self, specs: GroupSpec | Sequence[GroupSpec], rank: int, warmup: bool = True) -> None:
        """Join the trainer's group (a sharded trainer's: one per owning trainer rank, in order) as
        ``rank``; ``WireError`` (before any rendezvous) when a group's backend is not the one this
        receiver's weights take."""
        specs = (specs,) if isinstance(specs, GroupSpec) else tuple(specs)
        for spec in specs:
            if spec.backend != self.runtime.wire_backend:
                raise WireError(f"the trainer's group uses {spec.backend}, but this server's weights are on "
                                f"{self.runtime.device}, which take {self.runtime.wire_backend}: use backend: auto on "
                                "the trainer, or serve the model on the trainer's kind of device")
        self.close()
        try:
            for spec in specs:
                self.groups.append(DataPlaneGroup.join(spec, rank, self.runtime, warmup))
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

    def receive(self, req: UpdateRequest, served_version: int) -> StagedVersion:
        """Receive every bucket of ``req`` (and the checksum manifest when ``req.checksum``); raise
        ``VersionRejected`` after the last broadcast if anything is wrong. With ``req.shm`` the
        version is mapped from the trainer's shared memory instead (``adopt``): no group is needed."""
        if req.shm is not None:
            return self.adopt(req, served_version)
        group = self._require_group()
        self.discard()
        if req.sources and max(req.sources) >= len(self.groups):
            raise VersionRejected(f"version {req.version} rejected: it names group {max(req.sources)}, but "
                                  f"{len(self.groups)} were joined; call {self.join_route} again")
        base = self._committed
        target = self._set_for(req.buckets)
        # Deltas land in buffers of their own and are rebuilt into the target once they arrived.
        payloads = [torch.empty(n, dtype=torch.uint8, device=group.device) if n else None
                    for n in (req.delta.nbytes if req.delta is not None else [0] * len(req.buckets))]
        # Every receive is posted first, the manifest's too (it then lands while the last bucket is
        # checksummed), and what needs no bytes (checks, views) is done while they arrive; gloo runs
        # the receives in order while earlier buckets are checksummed. Each wait returns only once its
        # bucket has arrived (the group's waits block the host), so nothing is verified, and no answer
        # given, before the data is really in the buffers.
        n = len(req.buckets)
        landing = [p if p is not None else buf for p, buf in zip(payloads, target.buffers)]
        works = [(self.groups[req.source(i)], self.groups[req.source(i)].broadcast_async(buf, req.deadline_s(i)))
                 for i, buf in enumerate(landing)]
        expected = torch.zeros(n, dtype=torch.int64, device=group.device)
        manifest = group.broadcast_async(expected, req.deadline_s(n)) if req.checksum else None
        buckets = tuple(meta.to_bucket(i) for i, meta in enumerate(req.buckets))
        specs = [s for b in buckets for s in b.specs]
        problems = self._check_specs(specs, set()) + self._check_complete(list(buckets), req.version, served_version)
        unusable = _check_base(req, base) if req.delta is not None else []
        problems += unusable
        base = None if unusable else base
        staged = StagedVersion.of(req.version, target.buffers, buckets)
        crcs: list[int | torch.Tensor | None] = []
        for i, (buf, payload, (source, work)) in enumerate(zip(target.buffers, payloads, works)):
            source.wait(work)
            if payload is not None:
                crcs.append(self._rebuild(i, payload, base, buf, buckets[i], problems))
            elif req.checksum:
                crcs.append(bucket_crc(buf))  # on a device: computed there, read once at the end
        if manifest is not None:
            group.wait(manifest)
            bad = [i for i, (got, want) in enumerate(zip(crcs, expected.tolist())) if got is not None and int(got) != want]
            if bad:
                problems.append(f"checksum mismatch in bucket(s) {bad}")
        _reject_if(problems, req.version)
        return staged

    def _rebuild(self, index: int, payload: torch.Tensor, base: StagedVersion | None, out: torch.Tensor,
                 bucket: Bucket, problems: list[str]) -> int | torch.Tensor | None:
        """Bucket ``index`` rebuilt into ``out`` from the committed version and its delta; its CRC32C,
        or None (and a problem) when there is no usable baseline or the delta does not decode."""
        if base is None:
            return None
        try:
            return rebuild(payload, base.buffers[index], out, delta_word(bucket))
        except DeltaError as e:
            problems.append(f"bucket {index}'s delta does not decode: {e}")
            return None

    def adopt(self, req: UpdateRequest, served_version: int) -> StagedVersion:
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
        problems = self._check_specs([s for b in buckets for s in b.specs], set())
        problems += self._check_complete(list(buckets), req.version, served_version)
        _reject_if(problems, req.version)
        try:
            mapped = self._mapping(shm.segment, max(o + b.nbytes for o, b in zip(shm.offsets, buckets)))
        except ShmUnavailable as e:
            raise VersionRejected(f"version {req.version} rejected: {e}") from None
        views = tuple(mapped[o : o + b.nbytes] for o, b in zip(shm.offsets, buckets))
        segment: str | None = shm.segment
        if self.arena is not None:  # copied once, and the copy is what is verified (and later loaded)
            views, segment = self._set_for(req.buckets).buffers, None
            for dst, (o, b) in zip(views, zip(shm.offsets, buckets)):
                dst.copy_(mapped[o : o + b.nbytes])
        if req.checksum:
            bad = [i for i, (view, want) in enumerate(zip(views, shm.crcs)) if bucket_crc(view) != want]
            _reject_if([f"checksum mismatch in bucket(s) {bad}"] if bad else [], req.version)
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
        A set in the arena is received into over the committed version, which is then no baseline."""
        if self.arena is not None:
            self._committed = None
        if self.arena is not None and sum(m.nbytes for m in layout) <= self.arena.numel():
            views, offset = [], 0
            for m in layout:
                views.append(self.arena[offset : offset + m.nbytes])
                offset += m.nbytes
            return _FlatSet(layout, tuple(views))
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
        to a valid version.

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
        buf = self._spare_buffer(index, meta)
        group.broadcast(buf)
        self._partial.append((meta, buf, bucket))
        problems = self._check_specs(bucket.specs, received)
        if problems:
            self._partial_problems.extend(problems)
            _reject_if(problems, None)

    def seal(self, version: int, served_version: int) -> StagedVersion:
        """Close the version assembled by ``receive_bucket``: it must hold every expected tensor."""
        parts, earlier = self._partial, self._partial_problems
        self.discard()
        buckets = [b for _, _, b in parts]
        _reject_if(earlier or self._check_complete(buckets, version, served_version), version)
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

    def _check_specs(self, specs: Iterable[TensorSpec], seen: set[str]) -> list[str]:
        """Problems with ``specs`` given the names ``seen`` earlier in the version (updated in place)."""
        problems = []
        for spec in specs:
            want = self.expected.get(spec.name)
            if spec.name in seen:
                problems.append(f"tensor '{spec.name}' sent twice")
            elif want is None:
                problems.append(f"unknown tensor '{spec.name}'")
            elif (want.dtype, want.shape) != (spec.dtype, spec.shape):
                problems.append(f"'{spec.name}': got {spec.dtype} {spec.shape}, expected {want.dtype} {want.shape}")
            seen.add(spec.name)
        return problems

    def _check_complete(self, buckets: list[Bucket], version: int, served_version: int) -> list[str]:
        problems = []
        if version <= served_version:
            problems.append(f"version {version} is not newer than the served version {served_version}")
        missing = sorted(set(self.expected) - {s.name for b in buckets for s in b.specs})
        if missing:
            problems.append(f"{len(missing)} tensor(s) missing from the version, e.g. '{missing[0]}'")
        return problems

    def mark_live(self, staged: StagedVersion) -> None:
        """The live weights now alias ``staged``'s buffers: receive the next version elsewhere."""
        self._live_segment = staged.segment
        self._live = next((s for s in self._sets if s.buffers is staged.buffers), None)
        self.mark_committed(staged)

    def mark_committed(self, staged: StagedVersion) -> None:
        """``staged`` is the version the receiver now serves: its bytes are the next delta's baseline."""
        self._committed = staged

    def close(self, broken: bool = False) -> None:
        """Leave the groups (aborting them when ``broken``: a receive of them may still be pending)."""
        groups, self.groups = self.groups, []
        for group in groups:
            group.close(broken)


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


def _reject_if(problems: list[str], version: int | None) -> None:
    if problems:
        what = f"version {version}" if version is not None else "bucket"
        log.warning("rejected %s: %s", what, "; ".join(problems))
        raise VersionRejected(f"{what} rejected: " + "; ".join(problems[:MAX_REPORTED_PROBLEMS]))
