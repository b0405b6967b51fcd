"""Packing a bucket's tensors into one flat uint8 buffer, unpacking views, and the bucket checksum.

Every backend produces the same bytes and the same checksum (CRC32C of the packed bytes), so a
receiver never needs to know which one the trainer used. The pure-torch backend is the reference;
the ``asyncsync/csrc`` extension registers faster ones when it can be built.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import crc32c
import torch

from asyncsync.plan import Bucket

log = logging.getLogger(__name__)


def byte_view(buf: torch.Tensor, offset: int, spec_dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A typed view of ``shape`` at ``offset`` bytes into a flat uint8 buffer (no copy)."""
    itemsize = torch.empty((), dtype=spec_dtype).element_size()
    numel = 1
    for s in shape:
        numel *= s
    return buf[offset : offset + numel * itemsize].view(spec_dtype).view(shape)


def unpack(buf: torch.Tensor, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
    """Views of every tensor of ``bucket`` inside ``buf``; valid until the buffer is reused."""
    return [(s.name, byte_view(buf, off, s.dtype, s.shape)) for s, off in zip(bucket.specs, bucket.offsets)]


def crc32c_of(buf: torch.Tensor) -> int:
    """CRC32C of a flat uint8 tensor's bytes (hardware-accelerated on x86 through the crc32c package)."""
    data = buf.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    return crc32c.crc32c(memoryview(data.contiguous().numpy()))


class PackBackend(ABC):
    """Packs a list of tensors into a preallocated uint8 buffer at given byte offsets, in one call.

    Contract: after ``pack``, ``out[offsets[i] : offsets[i] + nbytes(tensors[i])]`` holds the
    tensor's bytes in C order (non-contiguous inputs are packed by value, never by storage); bytes
    outside those ranges are untouched. With ``checksum=True`` the return value is the CRC32C of
    ``out[:total]`` where ``total`` is the end of the last range; otherwise None.
    """

    name: str

    @abstractmethod
    def pack(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor, checksum: bool) -> int | None: ...

    def checksum(self, buf: torch.Tensor) -> int:
        return crc32c_of(buf)


class TorchPackBackend(PackBackend):
    """Reference implementation: one ``copy_`` per tensor into a typed view of the buffer."""

    name = "torch"

    def pack(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor, checksum: bool) -> int | None:
        end = 0
        with torch.no_grad():
            for t, off in zip(tensors, offsets, strict=True):
                view = byte_view(out, off, t.dtype, tuple(t.shape))
                view.copy_(t.detach())
                end = max(end, off + view.numel() * view.element_size())
        return self.checksum(out[:end]) if checksum else None


_BACKENDS: dict[str, Callable[[], PackBackend]] = {"torch": TorchPackBackend}
_preferred: list[str] = []


def register_backend(name: str, factory: Callable[[], PackBackend], preferred: bool = False) -> None:
    """Make a backend selectable by name; ``preferred`` ones are chosen by ``get_backend("auto")``."""
    _BACKENDS[name] = factory
    if preferred and name not in _preferred:
        _preferred.insert(0, name)


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> PackBackend:
    """The named backend, or for ``auto`` the first preferred one that loads on ``device``, else torch."""
    if name != "auto":
        try:
            return _BACKENDS[name]()
        except KeyError:
            raise ValueError(f"unknown pack backend {name!r}; available: {sorted(_BACKENDS)}") from None
    _load_extension_backends()
    dev = torch.device(device).type
    for candidate in _preferred:
        backend = _BACKENDS[candidate]()
        if getattr(backend, "device_type", "cpu") == dev:
            return backend
    return TorchPackBackend()


def _load_extension_backends() -> None:
    """Import the csrc extension's backends once; a missing compiler leaves only the torch backend."""
    try:
        import asyncsync.csrc  # noqa: F401  (registers its backends on import)
    except ImportError:
        pass
