"""The flat buffers versions are packed into: one provider for both modes.

    buffers = PackedBuffers(plan, device, packer, checksum, slots=2)   # blocking: a ring of 2 buckets
    result = send_version(members, v, plan, buffers.packing(named))   # each bucket packed just before
                                                                      # its broadcast, from the live weights
    snapshot = PackedBuffers(plan, device, packer, checksum)          # async: one buffer per bucket
    snapshot.pack_all(named)                                          # the whole version, ahead of sending
    result = send_version(members, v, plan, snapshot.packed())

Both pack through ``pack`` with the same backend, checksum and layout check; what differs is only
when the packing happens (just in time, on the sending thread, or ahead, on the snapshot thread) and
so how many buffers it needs: blocking mode holds 2 buckets, an async snapshot a whole version.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from asyncsync.packing import PackBackend
from asyncsync.packing.checks import UnpackableTensor, memory_problem
from asyncsync.protocol.specs import Bucket, BucketPlan
from asyncsync.trainer.source import check_layout

Crc = int | torch.Tensor | None


class PackedBuffers:
    """Flat uint8 buffers for ``plan``'s buckets and the CRC32C of what was last packed into each.

    ``slots=None``: one buffer per bucket (a snapshot). ``slots=k``: k buffers of the largest bucket's
    size reused in turn (bucket i goes to slot i % k); the sender asks for bucket i only after the
    broadcast of bucket i - k finished (``send_version`` honours ``depth``)."""

    def __init__(self, plan: BucketPlan, device: torch.device, packer: PackBackend, checksum: bool,
                 slots: int | None = None):
        self.plan, self.packer, self.checksum, self.slots, self.device = plan, packer, checksum, slots, device
        sizes = [b.nbytes for b in plan.buckets] if slots is None else [plan.max_bucket_bytes] * slots
        self.buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        self.crcs: list[Crc] = [None] * len(self.buffers)

    @property
    def nbytes(self) -> int:
        """Bytes these buffers hold: the sync's memory cost."""
        return sum(b.numel() for b in self.buffers)

    def _slot(self, bucket: Bucket) -> int:
        return bucket.index if self.slots is None else bucket.index % self.slots

    def pack(self, bucket: Bucket, named: Mapping[str, torch.Tensor]) -> None:
        """Pack one bucket of ``named``, already checked by ``check_layout``. A backend that still
        refuses a tensor (its own checks: another thread freed or resized it since) raises
        ``UnpackableTensor`` naming it."""
        slot = self._slot(bucket)
        out = self.buffers[slot][: bucket.nbytes]
        tensors = [named[s.name] for s in bucket.specs]
        try:
            self.crcs[slot] = self.packer.pack(tensors, bucket.offsets, out, self.checksum)
        except (ValueError, TypeError) as e:
            self.crcs[slot] = None
            culprit = next((f"tensor '{s.name}' {p}" for s, t in zip(bucket.specs, tensors)
                            if (p := memory_problem(t)) is not None), None)
            raise UnpackableTensor(f"packing bucket {bucket.index} failed: {culprit or e}") from e

    def pack_all(self, named: Mapping[str, torch.Tensor]) -> None:
        """Pack a whole version (``slots=None`` only); raises ``LayoutChanged`` (or ``UnpackableTensor``
        for a tensor on another device) before writing anything."""
        assert self.slots is None, "a ring holds only a few buckets at a time"
        check_layout(self.plan, named, self.device)
        for bucket in self.plan.buckets:
            self.pack(bucket, named)

    def get(self, bucket: Bucket) -> tuple[torch.Tensor, Crc]:
        slot = self._slot(bucket)
        return self.buffers[slot][: bucket.nbytes], self.crcs[slot]

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

    depth = None

    def __init__(self, buffers: PackedBuffers):
        self.buffers = buffers

    def bucket(self, bucket: Bucket) -> tuple[torch.Tensor, Crc]:
        return self.buffers.get(bucket)


class PackOnDemand:
    """Buckets packed from the live weights into a ring, each just before its broadcast."""

    def __init__(self, buffers: PackedBuffers, named: Mapping[str, torch.Tensor]):
        self.buffers, self.named = buffers, named
        self.depth = buffers.slots

    def bucket(self, bucket: Bucket) -> tuple[torch.Tensor, Crc]:
        self.buffers.pack(bucket, self.named)
        return self.buffers.get(bucket)
