"""The reference pack backend: one ``copy_`` per tensor into a typed view, then CRC32C of the bytes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncsync.packing import PackBackend
from asyncsync.protocol.checksum import bucket_crc
from asyncsync.protocol.specs import byte_view


class TorchPackBackend(PackBackend):
    """Works on any device. On a GPU both the copies and the checksum run on the current stream and
    the checksum stays a device tensor: nothing is copied to the host and nothing waits."""

    name = "torch"
    device_type = "any"

    def pack(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor,
             checksum: bool) -> int | torch.Tensor | None:
        end = 0
        with torch.no_grad():
            for t, off in zip(tensors, offsets, strict=True):
                view = byte_view(out, off, t.dtype, tuple(t.shape))
                view.copy_(t.detach())
                end = max(end, off + view.numel() * view.element_size())
        if not checksum:
            return None
        return bucket_crc(out[:end])
