"""The three ways a version comes into a receiver, each judged whole before anything is applied.

* ``WireIntake``: a whole version per request off the data plane (asyncsync's protocol), received
  frame by frame by ``protocol.receive.FramedReceive``;
* ``SharedMemoryIntake``: a whole version per request mapped from a same-host trainer's shared
  memory (``protocol.shm``), judged as one from the wire;
* ``BucketAssembly``: a version sent one bucket per request (SGLang's protocol), closed by ``seal``.

Each checks what a version holds with the receiver's ``Admission``, takes its buffers from the
receiver's ``StagingBuffers`` and returns a ``StagedVersion``; what is then done with the verified
bytes stays with each receiver.

Nothing is allocated for a version before its announcement was validated against the served model:
a version that names a tensor the model does not have, or that would need more than the receiver's
staging budget (``max_version_bytes``: by default the served model's own size, which is exactly what
a valid version holds), is refused before any receive is posted, and the receiver leaves its groups
(``JoinedGroups.leave``) so that the trainer's broadcasts fail at once instead of waiting for it.
Any other version the receiver takes part in to the end before it judges what arrived (a wrong
shape, a stale version, a bad checksum), so such a rejection never leaves the trainer or the other
receivers waiting in a collective. On the data plane every payload's size is first agreed through a
frame header (``protocol.frames``): a member that would send more than was announced is refused,
not aborted on.

Only torch and the standard library are imported here (receivers load this package).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from asyncsync.protocol.admission import Admission, BucketRefused, VersionRejected, reject_if
from asyncsync.protocol.arena import RING_SLOTS
from asyncsync.protocol.checksum import bucket_crc
from asyncsync.protocol.frames import VersionFrames
from asyncsync.protocol.group import DataPlaneError, DataPlaneGroup
from asyncsync.protocol.joined import JoinedGroups
from asyncsync.protocol.receive import FramedReceive, Unframed
from asyncsync.protocol.shm import HostIdentity, MappedSegments, ShmUnavailable
from asyncsync.protocol.specs import Bucket, TensorSpec
from asyncsync.protocol.staging import BufferSet, StagedVersion, StagingBuffers
from asyncsync.protocol.wire import BucketMeta, UpdateRequest

log = logging.getLogger(__name__)


def buckets_of(req: UpdateRequest) -> tuple[Bucket, ...]:
    """The buckets ``req`` announces, in broadcast order."""
    return tuple(meta.to_bucket(i) for i, meta in enumerate(req.buckets))


class WireIntake:
    """A whole version per request, received off the trainer's groups (``joined``) into ``buffers``.

    Contract of ``receive``: it returns a version whose every bucket arrived, was checked against
    ``admission`` and (with ``req.checksum``) against the trainer's manifest; or it raises
    ``VersionRejected`` after the last broadcast if anything is wrong, or before the first one
    (having left the groups) when the version cannot be received at all, or ``DataPlaneError``
    (having left the groups) when the data plane failed under it."""

    def __init__(self, admission: Admission, buffers: StagingBuffers, joined: JoinedGroups):
        self.admission, self.buffers, self.joined = admission, buffers, joined

    def receive(self, req: UpdateRequest, served_version: int,
                carrying: Mapping[str, TensorSpec] | None = None) -> StagedVersion:
        """Receive every bucket of ``req`` (and the checksum manifest when ``req.checksum``), each
        payload forwarded to the servers below where this one relays. ``carrying``: the tensors this
        version must carry, when not the receiver's own (an adapter's).

        A delta version's buckets are rebuilt from the committed version (``buffers.committed``) into
        the staging and checked against the full bucket's CRC32C. Each wait returns only once its
        data has arrived (the group's waits block the host), so nothing is verified, and no answer
        given, before the data is really in the buffers."""
        self.joined.require()
        self.joined.relay.wait_forwards()  # the last version's forwards read the buffers this one may be received into
        buckets = buckets_of(req)
        self._refuse_unreceivable(req, buckets, carrying)
        problems = self.admission.check_complete(list(buckets), req.version, served_version, carrying)
        base = self.buffers.committed
        unusable = _check_base(req, base) if req.delta is not None else []
        problems += unusable
        target = self.buffers.for_layout(req.buckets)
        ring = self.buffers.ring
        receive = FramedReceive(req, self.joined.groups, self.buffers.runtime, ring, target.buffers, buckets,
                                None if unusable or base is None else base.buffers, problems,
                                self.joined.relay.forward(VersionFrames.of(req), self.buffers.runtime,
                                                          RING_SLOTS - 1 if ring else None))
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
            self.joined.leave(broken=True)
            problem, data_plane = failed
            if data_plane:
                raise DataPlaneError(problem)
            raise VersionRejected(f"version {req.version} rejected before its payload: {problem}; left the "
                                  f"data-plane group (call {self.joined.join_route} again)")
        reject_if(problems, req.version)
        return StagedVersion.of(req.version, target.buffers, buckets,
                                digests=tuple(receive.digests) if req.digest else None)

    def _refuse_unreceivable(self, req: UpdateRequest, buckets: tuple[Bucket, ...],
                             carrying: Mapping[str, TensorSpec] | None = None) -> None:
        """Refuse, before any receive is posted or any buffer allocated, a version that names a tensor
        it must not carry, needs more than the staging budget, or arrives on a group not joined;
        the groups are left so that the trainer's broadcasts fail at once instead of waiting."""
        why = self.admission.unstageable(buckets, req.nbytes, whole=True, carrying=carrying)
        if req.sources and max(req.sources) >= len(self.joined.groups):
            why.append(f"it names group {max(req.sources)}, but {len(self.joined.groups)} were joined")
        if why:
            self.joined.leave(broken=True)
            reject_if([*why, f"nothing was received; call {self.joined.join_route} again"], req.version)


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


class SharedMemoryIntake:
    """A whole version per request from a same-host trainer's shared memory (``req.shm``,
    ``protocol/shm.py``), judged as ``WireIntake`` judges one from the wire. No group is needed.

    Without an arena the staged buffers are views of the mapping itself (zero copy: once committed
    and ``buffers.mark_live``, ``buffers.holds`` names the segment until a later version replaces
    it); with one, each bucket is copied into the arena, and the copy is what is checksummed."""

    def __init__(self, admission: Admission, buffers: StagingBuffers):
        self.admission, self.buffers = admission, buffers
        self.mappings = MappedSegments()

    def adopt(self, req: UpdateRequest, served_version: int,
              carrying: Mapping[str, TensorSpec] | None = None) -> StagedVersion:
        """The version ``req.shm`` names, verified; raises ``VersionRejected`` if anything is wrong
        (weights not on the host, another host's memory, a wrong layout, a stale version, a segment
        that cannot be mapped, a bad checksum). ``carrying``: as ``WireIntake.receive``."""
        shm = req.shm
        assert shm is not None, "adopt() is for requests that name a shared version"
        runtime = self.buffers.runtime
        if runtime.kind != "host":
            raise VersionRejected(f"version {req.version} rejected: this server's weights are on {runtime.device}; "
                                  "a shared-memory version is for host weights (use transport: collective)")
        if shm.host != HostIdentity.here():
            raise VersionRejected(f"version {req.version} rejected: the trainer's shared memory is on another host "
                                  f"({shm.host}, here {HostIdentity.here()}): use transport: collective for this server")
        buckets = buckets_of(req)
        problems = self.admission.check_complete(list(buckets), req.version, served_version, carrying)
        reject_if(problems, req.version)
        try:
            mapped = self.mappings.map(shm.segment, max(o + b.nbytes for o, b in zip(shm.offsets, buckets)),
                                       keep=self.buffers.holds)
        except ShmUnavailable as e:
            raise VersionRejected(f"version {req.version} rejected: {e}") from None
        views = tuple(mapped[o : o + b.nbytes] for o, b in zip(shm.offsets, buckets))
        segment: str | None = shm.segment
        if self.buffers.arenas:  # copied once, and the copy is what is verified (and later loaded)
            views, segment = self.buffers.for_layout(req.buckets).buffers, None
            for dst, (o, b) in zip(views, zip(shm.offsets, buckets)):
                dst.copy_(mapped[o : o + b.nbytes])
        if req.checksum:
            bad = [i for i, (view, want) in enumerate(zip(views, shm.crcs)) if bucket_crc(view) != want]
            reject_if([f"checksum mismatch in bucket(s) {bad}"] if bad else [], req.version)
        return StagedVersion.of(req.version, views, buckets, segment)


class BucketAssembly:
    """A version sent one bucket per request (SGLang's protocol), assembled into ``buffers``:
    ``receive_bucket`` for each, then ``seal`` with the version (or ``discard``). No checksum
    travels with it; names, dtypes and shapes are checked as each bucket lands."""

    def __init__(self, admission: Admission, buffers: StagingBuffers, joined: JoinedGroups):
        self.admission, self.buffers, self.joined = admission, buffers, joined
        self._parts: list[tuple[BucketMeta, torch.Tensor, Bucket]] = []  # the buckets received so far
        self._problems: list[str] = []  # what was wrong with them (the version is refused at seal)

    def receive_bucket(self, meta: BucketMeta, group: DataPlaneGroup | None = None) -> None:
        """Receive the next bucket of the version being assembled (one broadcast) on ``group``
        (default: the first one joined); raise ``VersionRejected`` after it if it cannot belong to a
        valid version, or ``BucketRefused`` before it (nothing received or allocated) when it names a
        tensor the model does not have or would take the version past the staging budget.

        Names are unique within a version, so a bucket repeating a name already received starts a
        new version: the one being assembled was abandoned (a trainer that stopped half-way).
        """
        group = group or self.joined.require()
        received = {s.name for _, _, b in self._parts for s in b.specs}
        if received.intersection(meta.names):
            log.warning("discarding an unfinished version of %d bucket(s): a new one started", len(self._parts))
            self.discard()
            received = set()
        index = len(self._parts)
        bucket = meta.to_bucket(index)
        why = self.admission.unstageable((bucket,), sum(m.nbytes for m, _, _ in self._parts) + meta.nbytes, whole=False)
        if why:
            self.discard()
            raise BucketRefused("bucket refused before its broadcast: " + "; ".join(why))
        buf = self.buffers.spare(index, meta)
        group.broadcast(buf)
        self._parts.append((meta, buf, bucket))
        problems = self.admission.check_specs(bucket.specs, received)
        if problems:
            self._problems.extend(problems)
            reject_if(problems, None)

    def seal(self, version: int, served_version: int) -> StagedVersion:
        """Close the version assembled by ``receive_bucket``: it must hold every expected tensor."""
        parts, earlier = self._parts, self._problems
        self.discard()
        buckets = [b for _, _, b in parts]
        reject_if(earlier or self.admission.check_complete(buckets, version, served_version), version)
        assembled = BufferSet(tuple(m for m, _, _ in parts), tuple(buf for _, buf, _ in parts))
        self.buffers.keep(assembled)
        return StagedVersion.of(version, assembled.buffers, tuple(buckets))

    def discard(self) -> None:
        """Forget a version being assembled bucket by bucket (its buffers stay for reuse)."""
        self._parts, self._problems = [], []
