"""Packing a bucket's tensors into one flat uint8 buffer, with the bucket's CRC32C in the same pass.

Backends are named in a lazy registry of module paths, as vLLM's weight-transfer factory does: nothing
is imported or compiled until a backend is asked for, and a name that is not registered is refused when
the configuration loads (``WeightSyncConfig`` checks ``pack_backend`` against ``backend_names()``).

    torch   the reference, on any device: one ``copy_`` per tensor, then CRC32C of the bytes
    cpp     the compiled CPU op (csrc/pack_cpu.cpp): threads split the bucket, CRC32C fused in
    cuda    one kernel launch per bucket (csrc/pack_cuda.cu), CRC32C computed on the device

``get_backend("auto", device)`` takes the compiled backend for the weights' device when it loads and
its check pack (a small mixed layout) gives the torch backend's bytes and checksum; otherwise the
torch backend, with one warning saying why. Every backend writes the same bytes and checksum, so a
receiver never needs to know which one packed a bucket.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from asyncsync.packing.delta import Delta
from asyncsync.registry import LazyRegistry

log = logging.getLogger(__name__)


class PackBackendUnavailable(RuntimeError):
    """A named pack backend cannot be used here; the message says why and what to do."""


class PackBackend(ABC):
    """Packs a list of tensors into a preallocated uint8 buffer at given byte offsets, in one call.

    Contract: after ``pack``, ``out[offsets[i] : offsets[i] + nbytes(tensors[i])]`` holds the
    tensor's bytes in C order (non-contiguous inputs are packed by value, never by storage); bytes
    outside those ranges are untouched. With ``checksum=True`` the return value is the CRC32C of
    ``out[:total]`` where ``total`` is the end of the last range, as an int or, for device backends,
    as a 0-dim int64 tensor on ``out``'s device that is valid once the pack's stream has run (the
    caller reads it when it needs it, so packing never waits for the device); otherwise None.
    """

    name: str
    device_type: str  # the device whose buffers this backend packs: "cpu", "cuda", or "any"
    encodes_deltas = False  # implements ``pack_delta``

    @abstractmethod
    def pack(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor,
             checksum: bool) -> int | torch.Tensor | None: ...

    def pack_delta(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], base: torch.Tensor, word: int,
                   limit: int) -> tuple[int | torch.Tensor, Delta]:
        """``pack`` with the checksum into ``base``, which holds the previous version's bytes (the
        baseline), and encode what changed, in ``word``-byte words, as ``asyncsync.protocol.delta``
        specifies: the delta, or none where it would exceed ``limit`` bytes (``packing.delta``).
        Backends that cannot (``encodes_deltas`` false) send every version whole."""
        raise PackBackendUnavailable(f"pack backend {self.name!r} does not encode deltas")


# name -> "module:Class"; importing the module is what may compile code, so it happens on demand.
BACKENDS = LazyRegistry("pack backend", {
    "torch": "asyncsync.packing.torch_backend:TorchPackBackend",
    "cpp": "asyncsync.packing.native:CppPackBackend",
    "cuda": "asyncsync.packing.cuda:CudaPackBackend",
})
# What ``auto`` tries first for each device type, before falling back to torch.
_PREFERRED = {"cpu": "cpp", "cuda": "cuda"}
_fallback_reported: set[str] = set()


def register_backend(name: str, target: str) -> None:
    """Register a backend as ``"package.module:ClassName"``; it is imported when first asked for."""
    BACKENDS.register(name, target)


def backend_names() -> list[str]:
    """Every name ``pack_backend`` accepts, ``auto`` included."""
    return ["auto", *BACKENDS.names()]


def load_backend(name: str) -> PackBackend:
    """Instantiate the named backend; ``PackBackendUnavailable`` says why it cannot be used here."""
    if name not in BACKENDS.targets:
        raise PackBackendUnavailable(f"unknown pack backend {name!r}; available: {backend_names()}")
    try:
        backend = BACKENDS.load(name)()
    except PackBackendUnavailable:
        raise
    except Exception as e:  # a failed import or build: name the backend and the cause
        raise PackBackendUnavailable(f"pack backend {name!r} could not be loaded: {type(e).__name__}: {e}") from e
    return backend


def get_backend(name: str = "auto", device: torch.device | str = "cpu") -> PackBackend:
    """The named backend, or for ``auto`` the checked compiled backend for ``device``, else torch."""
    dev = torch.device(device).type
    if name != "auto":
        backend = load_backend(name)
        if backend.device_type not in ("any", dev):
            raise PackBackendUnavailable(f"pack backend {name!r} packs {backend.device_type} buffers, but the weights are "
                                         f"on {dev}; use pack_backend: auto or torch")
        if name in _PREFERRED.values():  # a compiled backend named explicitly is checked too, and refused if wrong
            check_against_torch(backend, torch.device(device))
        return backend
    preferred = _PREFERRED.get(dev)
    if preferred is not None:
        try:
            backend = load_backend(preferred)
            check_against_torch(backend, torch.device(device))
            return backend
        except PackBackendUnavailable as e:
            if preferred not in _fallback_reported:
                _fallback_reported.add(preferred)
                log.warning("%s; packing uses the pure-torch backend (same bytes, slower)", e)
    return load_backend("torch")


def check_against_torch(backend: PackBackend, device: torch.device) -> None:
    """Pack a small mixed layout with ``backend`` and with the torch backend; raise
    ``PackBackendUnavailable`` unless bytes and checksum agree. A compiled backend that was built but
    cannot run here (a driver older than the compiler, a fault in the kernel) is caught before use."""
    g = torch.Generator().manual_seed(0)
    # Item sizes descending, as in a bucket; a transposed view; enough bytes for several pack threads.
    tensors = [torch.randn(37, generator=g).to(torch.float64), torch.randn(5, 3, generator=g).t(),
               torch.tensor(7, dtype=torch.int16), torch.randint(0, 255, (600_001,), dtype=torch.uint8, generator=g)]
    tensors = [t.to(device) for t in tensors]
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += t.numel() * t.element_size()
    got, want = (torch.full((end + 8,), 0xA5, dtype=torch.uint8, device=device) for _ in range(2))
    try:
        crc = backend.pack(tensors, offsets, got, True)
        crc = int(crc) if crc is not None else None
    except Exception as e:
        raise PackBackendUnavailable(f"pack backend {backend.name!r} failed its check pack on {device}: {e}") from e
    want_crc = load_backend("torch").pack(tensors, offsets, want, True)
    if crc != int(want_crc) or not torch.equal(got, want):
        raise PackBackendUnavailable(f"pack backend {backend.name!r} wrote other bytes or another checksum than the "
                                     f"torch backend in its check pack on {device}; it is not used")
