"""The flat buffers versions are packed into: one provider for both modes.

    buffers = PackedBuffers(plan, device, packer, checksum, slots=RING_SLOTS)  # blocking: a ring
    result = send_version(members, v, plan, buffers.packing(named))   # each bucket packed just before
                                                                      # its broadcast, from the live weights
    snapshot = PackedBuffers(plan, device, packer, checksum)          # async: one buffer per bucket
    snapshot.pack_all(named)                                          # the whole version, ahead of sending
    result = send_version(members, v, plan, snapshot.packed())
    shared = PackedBuffers(plan, device, packer, checksum, pool=pool) # same-host servers: each version packed
                                                                      # into a shared-memory segment (transport/shm.py)
    baseline = PackedBuffers(plan, device, packer, True, delta=True)  # each version packed over the last one,
    baseline.pack_all(named, version)                                 # its changes encoded on the way
                                                                      # (packing/delta.py)

Both pack through ``pack`` with the same backend, checksum and layout check; what differs is when
the packing happens (just in time, on the sending thread, or ahead, on the snapshot thread) and so
how many buffers it needs: blocking mode holds a few buckets, an async snapshot a whole version.

Sending from the live weights (blocking mode), a bucket that holds a single tensor is not packed at
all: it is broadcast from the tensor itself and its CRC32C is taken while it is on the wire. Such
buckets are the largest ones (a tensor bigger than ``bucket_bytes`` gets a bucket of its own: an
embedding, an LM head), so the first broadcast starts without waiting for a big copy, and the ring's
buffers are sized for the packed buckets only. This is safe because a blocking ``publish`` holds
the caller until the version is sent, so the weights cannot change under the broadcast.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from asyncsync.packing import PackBackend
from asyncsync.packing.checks import UnpackableTensor, memory_problem
from asyncsync.packing.delta import Delta, limit
from asyncsync.protocol.checksum import bucket_crc
from asyncsync.protocol.delta import delta_word
from asyncsync.protocol.specs import Bucket, BucketPlan
from asyncsync.trainer.source import check_layout
from asyncsync.transport.shm import Segment, SegmentPool

Crc = int | torch.Tensor | None

# Buffers in blocking mode's ring: memory is a budget (blocking mode holds at most 2 buckets), and
# on the emulated links of benchmarks/broadcast.py 2, 3 and 4 buffers measured within noise of each
# other once single-tensor buckets were sent from the weights in place (bucket k+1 is packed while
# bucket k is on the wire).
RING_SLOTS = 2


class PackedBuffers:
    """Flat uint8 buffers for ``plan``'s buckets and the CRC32C of what was last packed into each.

    ``slots=None``: one buffer per bucket (a snapshot; every bucket is packed, also by ``packing``,
    so the bytes sent are a copy). ``slots=k``: a ring for sending from the live
    weights (``packing``): k buffers of the largest multi-tensor bucket's size, reused in turn by the
    multi-tensor buckets; a bucket of one tensor is sent from the tensor itself. ``reuses`` names the
    earlier bucket whose broadcast must finish before a bucket is packed (``send_version`` waits).

    ``pool`` (``slots=None`` only): the buffers are a shared-memory segment, a fresh lease taken at
    each ``pack_all`` (``SegmentPool.acquire``: one no server still maps), so same-host servers map
    the packed version itself and nothing is copied for them.

    ``delta`` (``slots=None``, no pool): the buffers are the baseline of delta versions. ``pack_all``
    packs each version over the last one and encodes what changed on the way (``packing.delta``);
    ``version`` is the version whose bytes they hold, ``delta_base`` the one the deltas of the last
    ``pack_all`` are against (None: none was encoded).

    ``buckets`` (``slots=None``): only these buckets of ``plan`` have buffers, each packed on its own
    with ``pack`` (a sharded trainer's rank: the buckets it owns, ``trainer.shards``)."""

    def __init__(self, plan: BucketPlan, device: torch.device, packer: PackBackend, checksum: bool,
                 slots: int | None = None, pool: SegmentPool | None = None, delta: bool = False,
                 buckets: Sequence[Bucket] | None = None):
        if slots is not None and slots < 1:
            raise ValueError(f"a ring needs at least one buffer, got slots={slots}")
        if pool is not None and (slots is not None or device.type != "cpu"):
            raise ValueError("shared-memory buffers hold a whole version in host memory (slots=None, a CPU device)")
        if delta and (slots is not None or pool is not None or not checksum or not packer.encodes_deltas):
            raise ValueError("a delta baseline is a whole version in buffers of its own, checksummed, packed by a "
                             "backend that encodes deltas")
        self.delta = delta
        self.version: int | None = None
        self.delta_base: int | None = None
        self.pool = pool
        self.segment: Segment | None = None
        self.plan, self.packer, self.checksum, self.slots, self.device = plan, packer, checksum, slots, device
        self._slot: dict[int, int] = {}      # bucket index -> buffer index
        self._reuses: dict[int, int] = {}    # bucket index -> the bucket that used its buffer last
        if buckets is not None and slots is not None:
            raise ValueError("a ring's buffers are shared by every bucket of the plan")
        self.buckets = tuple(plan.buckets if buckets is None else buckets)
        if slots is None:
            self._slot = {b.index: n for n, b in enumerate(self.buckets)}
            sizes = [b.nbytes for b in self.buckets]
        else:
            packed = [b for b in plan.buckets if not self.direct(b)]
            for n, b in enumerate(packed):
                self._slot[b.index] = n % slots
                if n >= slots:
                    self._reuses[b.index] = packed[n - slots].index
            sizes = [max((b.nbytes for b in packed), default=0)] * min(slots, len(packed))
        # Zeroed (every page written now), so the first versions are not slowed by page faults.
        self.buffers = [] if pool is not None else [torch.zeros(n, dtype=torch.uint8, device=device) for n in sizes]
        self.crcs: list[Crc] = [None] * len(self.buffers)
        self.deltas: list[Delta | None] = [None] * len(self.buffers)

    @property
    def nbytes(self) -> int:
        """Bytes these buffers hold: the sync's memory cost (a shared pool's segments are counted by the pool)."""
        return sum(b.numel() for b in self.buffers) if self.pool is None else 0

    @property
    def baseline_nbytes(self) -> int:
        """Of ``nbytes``, those that are a delta baseline: all of them, or none."""
        return self.nbytes if self.delta else 0

    @property
    def host_nbytes(self) -> int:
        """Bytes in host memory apart from the weights' device: none here (a ``ShardedBuffers`` host
        snapshot has some; a shared pool's segments are counted by the pool)."""
        return 0

    def direct(self, bucket: Bucket) -> bool:
        """True when a ring sends ``bucket`` from its one tensor instead of packing it."""
        return self.slots is not None and len(bucket.specs) == 1

    def reuses(self, bucket: Bucket) -> int | None:
        """The index of the bucket whose buffer ``bucket`` is packed into next, if any."""
        return self._reuses.get(bucket.index)

    def pack(self, bucket: Bucket, named: Mapping[str, torch.Tensor], encode: bool = False) -> None:
        """Pack one bucket of ``named``, already checked by ``check_layout`` (``encode``: over the
        baseline, encoding what changed). A backend that still refuses a tensor (its own checks:
        another thread freed or resized it since) raises ``UnpackableTensor`` naming it."""
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

    def pack_all(self, named: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Pack ``version`` whole (``slots=None`` only); raises ``LayoutChanged`` (or ``UnpackableTensor``
        for a tensor on another device) before writing anything. A delta baseline encodes it against
        the version the buffers held; until every bucket is packed they hold none."""
        assert self.slots is None, "a ring holds only a few buckets at a time"
        check_layout(self.plan, named, self.device)
        if self.pool is not None:
            self.segment = self.pool.acquire(self.segment)
            self.buffers = list(self.segment.views)
            self.crcs = [None] * len(self.buffers)
            self.deltas = [None] * len(self.buffers)
        base = self.version if self.delta else None
        self.version = self.delta_base = None
        for bucket in self.buckets:
            self.pack(bucket, named, encode=base is not None)
        self.version, self.delta_base = version, base

    def get(self, bucket: Bucket) -> tuple[torch.Tensor, Crc]:
        slot = self._slot[bucket.index]
        return self.buffers[slot][: bucket.nbytes], self.crcs[slot]

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

    def packed(self) -> Prepacked:
        """A source for ``send_version`` over what ``pack_all`` wrote."""
        return Prepacked(self)

    def packing(self, named: Mapping[str, torch.Tensor]) -> PackOnDemand:
        """A source for ``send_version`` that packs each bucket from ``named`` when it is asked for;
        raises ``LayoutChanged`` (or ``UnpackableTensor``) now, before anything is sent."""
        check_layout(self.plan, named, self.device)
        return PackOnDemand(self, named)


class Prepacked:
    """Buckets packed ahead: every one is ready, nothing is rewritten while sending."""

    def __init__(self, buffers: PackedBuffers):
        self.buffers = buffers
        # Same-host servers map this segment instead of receiving the buckets (None: not in shared memory).
        self.segment = buffers.segment
        # The version the buckets' deltas are against (None: no deltas): a server that committed it may get them.
        self.delta_base = buffers.delta_base

    def reuses(self, bucket: Bucket) -> int | None:
        return None

    def bucket(self, bucket: Bucket) -> torch.Tensor:
        return self.buffers.get(bucket)[0]

    def checksum(self, bucket: Bucket) -> Crc:
        return self.buffers.get(bucket)[1]

    def delta(self, bucket: Bucket) -> Delta | None:
        """``bucket`` encoded against ``delta_base`` (its ``payload()`` is None: send it whole)."""
        return self.buffers.delta_of(bucket)

    def delta_nbytes(self) -> tuple[int, ...] | None:
        """Every bucket's delta size (0: whole); None when the version was not encoded."""
        return self.buffers.delta_nbytes() if self.delta_base is not None else None


class PackOnDemand:
    """Buckets packed from the live weights into a ring, each just before its broadcast; a bucket of
    one tensor is that tensor's bytes, checksummed once its broadcast is under way."""

    def __init__(self, buffers: PackedBuffers, named: Mapping[str, torch.Tensor]):
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
