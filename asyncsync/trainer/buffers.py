"""The flat buffers a single trainer process packs versions into, one class per kind:

    ring = Ring(plan, device, packer, checksum)          # blocking mode: a few buckets' worth
    send_version(members, v, plan, ring.packing(named))  # each bucket packed just before its broadcast
    snapshot = Snapshot(plan, device, packer, checksum)  # async mode: a whole version, packed ahead
    snapshot.pack_all(named, v); send_version(members, v, plan, snapshot.packed())
    shared = SharedSnapshot(plan, device, packer, checksum, pool)  # same-host servers map the segment
    baseline = Baseline(plan, device, packer, checksum)  # each version packed over the last one, its
                                                         # changes encoded on the way (packing/delta.py)

All pack through ``Packed.pack`` (the same backend, checksum and layout check); they differ in when
the packing happens and so in how many buffers they hold. A sharded trainer's rank has its own
(``trainer.shards.ShardedBuffers``), with a ``Baseline`` over the buckets it owns.

Sending from the live weights (``Ring``), a bucket of a single tensor is not packed at all: it is
broadcast from the tensor itself and its CRC32C is taken while it is on the wire. Such buckets are
the largest (a tensor bigger than ``bucket_bytes`` gets a bucket of its own), so the first broadcast
starts without waiting for a big copy. Safe because a blocking ``publish`` holds the caller until the
version is sent: the weights cannot change under the broadcast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from asyncsync.metrics import Footprint
from asyncsync.packing import PackBackend
from asyncsync.packing.checks import UnpackableTensor, memory_problem
from asyncsync.packing.delta import Delta, limit
from asyncsync.protocol.checksum import bucket_crc
from asyncsync.protocol.delta import delta_word
from asyncsync.protocol.specs import Bucket, BucketPlan
from asyncsync.trainer.source import check_layout
from asyncsync.transport.shm import Segment, SegmentPool
from asyncsync.transport.sources import BucketSource

Crc = int | torch.Tensor | None

# Buffers in blocking mode's ring: memory is a budget (blocking mode holds at most 2 buckets), and on
# the emulated links of benchmarks/broadcast.py 2, 3 and 4 buffers measured within noise of each other
# once single-tensor buckets were sent from the weights in place.
RING_SLOTS = 2


class Packed:
    """What every kind shares: flat uint8 buffers (zeroed when made: no version pays for their pages),
    each bucket's slot among them, and the CRC32C (and, for a baseline, the delta) last packed into each."""

    def __init__(self, plan: BucketPlan, device: torch.device, packer: PackBackend, checksum: bool,
                 slots: dict[int, int], sizes: Sequence[int]):
        self.plan, self.device, self.packer, self.checksum = plan, device, packer, checksum
        self._slot = slots  # bucket index -> buffer index
        self.buffers = [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]
        self.crcs: list[Crc] = [None] * len(self.buffers)
        self.deltas: list[Delta | None] = [None] * len(self.buffers)

    @property
    def footprint(self) -> Footprint:
        """What these buffers hold: the sync's memory cost, all on the weights' device."""
        return Footprint(device=sum(b.numel() for b in self.buffers))

    def pack(self, bucket: Bucket, named: Mapping[str, torch.Tensor], encode: bool = False) -> None:
        """Pack one bucket of ``named``, already checked by ``check_layout`` (``encode``: over the
        bytes there, encoding what changed). A backend that still refuses a tensor (another thread
        freed or resized it since) raises ``UnpackableTensor`` naming it."""
        slot = self._slot[bucket.index]
        out = self.buffers[slot][: bucket.nbytes]
        tensors = [named[s.name] for s in bucket.specs]
        self.deltas[slot] = None
        try:
            if encode:
                self.crcs[slot], self.deltas[slot] = self.packer.pack_delta(
                    tensors, bucket.offsets, out, delta_word(bucket), limit(bucket.nbytes))
            else:
                self.crcs[slot] = self.packer.pack(tensors, bucket.offsets, out, self.checksum)
        except (ValueError, TypeError) as e:
            self.crcs[slot] = None
            culprit = next((f"tensor '{s.name}' {p}" for s, t in zip(bucket.specs, tensors)
                            if (p := memory_problem(t)) is not None), None)
            raise UnpackableTensor(f"packing bucket {bucket.index} failed: {culprit or e}") from e

    def get(self, bucket: Bucket) -> tuple[torch.Tensor, Crc]:
        slot = self._slot[bucket.index]
        return self.buffers[slot][: bucket.nbytes], self.crcs[slot]


class Ring(Packed):
    """Blocking mode: ``slots`` buffers of the largest multi-tensor bucket's size, reused in turn by the
    multi-tensor buckets; a bucket of one tensor is sent from the tensor itself (``direct``)."""

    def __init__(self, plan: BucketPlan, device: torch.device, packer: PackBackend, checksum: bool,
                 slots: int = RING_SLOTS):
        if slots < 1:
            raise ValueError(f"a ring needs at least one buffer, got slots={slots}")
        packed = [b for b in plan.buckets if len(b.specs) > 1]
        self._reuses = {b.index: packed[n - slots].index for n, b in enumerate(packed) if n >= slots}
        super().__init__(plan, device, packer, checksum, {b.index: n % slots for n, b in enumerate(packed)},
                         [max((b.nbytes for b in packed), default=0)] * min(slots, len(packed)))

    @staticmethod
    def direct(bucket: Bucket) -> bool:
        """True when ``bucket`` is sent from its one tensor instead of packed."""
        return len(bucket.specs) == 1

    def reuses(self, bucket: Bucket) -> int | None:
        """The index of the bucket whose buffer ``bucket`` is packed into next, if any."""
        return self._reuses.get(bucket.index)

    def packing(self, named: Mapping[str, torch.Tensor]) -> PackOnDemand:
        """A source that packs each bucket from ``named`` when it is asked for; raises
        ``LayoutChanged`` (or ``UnpackableTensor``) now, before anything is sent."""
        check_layout(self.plan, named, self.device)
        return PackOnDemand(self, named)


class Snapshot(Packed):
    """A whole version packed ahead, one buffer per bucket (``buckets``: only these of ``plan``, a
    sharded rank's own; each packed on its own with ``pack``)."""

    def __init__(self, plan: BucketPlan, device: torch.device, packer: PackBackend, checksum: bool,
                 buckets: Sequence[Bucket] | None = None):
        self.buckets = tuple(plan.buckets if buckets is None else buckets)
        super().__init__(plan, device, packer, checksum, {b.index: n for n, b in enumerate(self.buckets)},
                         self._sizes())

    def _sizes(self) -> list[int]:
        return [b.nbytes for b in self.buckets]

    def pack_all(self, named: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Pack ``version`` whole; raises ``LayoutChanged`` (or ``UnpackableTensor`` for a tensor on
        another device) before writing anything."""
        check_layout(self.plan, named, self.device)
        for bucket in self.buckets:
            self.pack(bucket, named)

    def packed(self) -> Prepacked:
        """A source for ``send_version`` over what ``pack_all`` wrote."""
        return Prepacked(self)


class SharedSnapshot(Snapshot):
    """A snapshot in shared memory: each ``pack_all`` packs into a fresh lease of ``pool``
    (``SegmentPool.acquire``: a segment no server still maps), which same-host servers then map
    instead of receiving the broadcast; nothing is copied for them. Its segments are host memory,
    counted by the pool."""

    def __init__(self, plan: BucketPlan, device: torch.device, packer: PackBackend, checksum: bool, pool: SegmentPool):
        if device.type != "cpu":
            raise ValueError("shared-memory buffers hold a whole version in host memory: weights on the CPU only")
        self.pool = pool
        self.segment: Segment | None = None
        super().__init__(plan, device, packer, checksum)

    def _sizes(self) -> list[int]:
        return []  # the buffers are the segment leased at each pack_all

    def pack_all(self, named: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        check_layout(self.plan, named, self.device)
        self.segment = self.pool.acquire(self.segment)
        self.buffers = list(self.segment.views)
        self.crcs = [None] * len(self.buffers)
        self.deltas = [None] * len(self.buffers)
        for bucket in self.buckets:
            self.pack(bucket, named)


class Baseline(Snapshot):
    """A snapshot that is the baseline of delta versions: each ``pack_all`` packs the version over the
    last one and encodes what changed on the way (``packing.delta``). ``version`` is the version whose
    bytes the buffers hold (None while torn), ``delta_base`` the one the last ``pack_all``'s deltas are
    against (None: none was encoded)."""

    def __init__(self, plan: BucketPlan, device: torch.device, packer: PackBackend, checksum: bool = True,
                 buckets: Sequence[Bucket] | None = None):
        if not checksum or not packer.encodes_deltas:
            raise ValueError("a delta baseline is checksummed and packed by a backend that encodes deltas")
        super().__init__(plan, device, packer, checksum, buckets)
        self.version: int | None = None
        self.delta_base: int | None = None

    @property
    def footprint(self) -> Footprint:
        """Every byte of it is the delta baseline."""
        device = super().footprint.device
        return Footprint(device=device, baseline=device)

    def pack_all(self, named: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Pack ``version`` over the version the buffers hold, encoding it against that one; until every
        bucket is packed they hold none."""
        check_layout(self.plan, named, self.device)
        base, self.version, self.delta_base = self.version, None, None
        for bucket in self.buckets:
            self.pack(bucket, named, encode=base is not None)
        self.version, self.delta_base = version, base

    def delta_of(self, bucket: Bucket) -> Delta | None:
        """What the last ``pack_all`` encoded of ``bucket`` (None: not encoded)."""
        return self.deltas[self._slot[bucket.index]]

    def delta_size(self, bucket: Bucket) -> int:
        """The size of ``bucket``'s last delta (0: not encoded, or it goes whole)."""
        d = self.delta_of(bucket)
        return 0 if d is None or (p := d.payload()) is None else p.numel()

    def delta_nbytes(self) -> tuple[int, ...]:
        """The size of each bucket's delta from the last ``pack_all`` (0: it goes whole)."""
        return tuple(self.delta_size(b) for b in self.buckets)


class Prepacked(BucketSource):
    """Buckets packed ahead: every one is ready, nothing is rewritten while sending; a baseline's
    carry their deltas, a shared snapshot's the segment they lie in."""

    def __init__(self, buffers: Snapshot):
        self.buffers = buffers
        self.segment = buffers.segment if isinstance(buffers, SharedSnapshot) else None
        self.delta_base = buffers.delta_base if isinstance(buffers, Baseline) else None

    def bucket(self, bucket: Bucket) -> torch.Tensor:
        return self.buffers.get(bucket)[0]

    def checksum(self, bucket: Bucket) -> Crc:
        return self.buffers.get(bucket)[1]

    def delta(self, bucket: Bucket) -> Delta | None:
        """``bucket`` encoded against ``delta_base`` (its ``payload()`` is None: send it whole)."""
        return self.buffers.delta_of(bucket) if isinstance(self.buffers, Baseline) else None

    def delta_nbytes(self) -> tuple[int, ...] | None:
        """Every bucket's delta size (0: whole); None when the version was not encoded."""
        return self.buffers.delta_nbytes() if isinstance(self.buffers, Baseline) and self.delta_base is not None else None


class PackOnDemand(BucketSource):
    """Buckets packed from the live weights into a ring, each just before its broadcast; a bucket of
    one tensor is that tensor's bytes, checksummed once its broadcast is under way."""

    def __init__(self, buffers: Ring, named: Mapping[str, torch.Tensor]):
        self.buffers, self.named = buffers, named
        self._direct: dict[int, torch.Tensor] = {}  # bytes sent in place, until their checksum is taken

    def reuses(self, bucket: Bucket) -> int | None:
        return self.buffers.reuses(bucket)

    def bucket(self, bucket: Bucket) -> torch.Tensor:
        """The bytes of ``bucket``; ``UnpackableTensor`` names a tensor another thread freed or
        resized since the version was read (checked again here: the broadcast reads its memory)."""
        if self.buffers.direct(bucket):
            name = bucket.specs[0].name
            tensor = self.named[name]
            problem = memory_problem(tensor)
            if problem is not None:
                raise UnpackableTensor(f"sending bucket {bucket.index} failed: tensor '{name}' {problem}")
            # A non-contiguous tensor (rare for a parameter) is copied here, as packing would.
            flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            if self.buffers.checksum:
                self._direct[bucket.index] = flat
            return flat
        self.buffers.pack(bucket, self.named)
        return self.buffers.get(bucket)[0]

    def checksum(self, bucket: Bucket) -> Crc:
        if self.buffers.direct(bucket):
            flat = self._direct.pop(bucket.index, None)
            return None if flat is None else bucket_crc(flat)
        return self.buffers.get(bucket)[1]
