"""The compiled CPU pack op (csrc/pack_cpu.cpp) and the backend that calls it.

Where the op comes from, in this order:

1. the build made at install time (``setup.py`` compiles ``asyncsync._pack_cpu`` with
   torch.utils.cpp_extension when torch is importable during the build, i.e. with
   ``pip install --no-build-isolation``, which is what scripts/setup.sh does);
2. a JIT build from the source checkout's ``csrc/`` at first use (cached by torch under
   ``~/.cache/torch_extensions``), when there is no installed build or the checkout's sources are
   newer than it (an edited editable install);
3. nothing: ``CppPackBackend()`` raises ``PackBackendUnavailable`` with the reason, and ``auto``
   packs with the pure-torch backend, which writes the same bytes and checksum.

``ASYNCSYNC_NO_EXT=1`` skips 1 and 2. ``status()`` (shown by ``asyncsync doctor``) says which path is
active and why the others are not.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from asyncsync.packing import PackBackend, PackBackendUnavailable
from asyncsync.packing.csrc import CPU_SOURCE, CSRC, HEADERS, build_helpers, nvcc_path
from asyncsync.packing.delta import Delta, encoded

NO_EXT_ENV = "ASYNCSYNC_NO_EXT"
INSTALLED_MODULE = "asyncsync._pack_cpu"
JIT_NAME = "asyncsync_pack_cpu"


def build_cpu_ops(name: str = JIT_NAME, defines: Sequence[str] = ()) -> None:
    """JIT-compile (or reuse torch's cached build of) csrc/pack_cpu.cpp and load its ops.

    ``defines`` are preprocessor switches (``NAME=VALUE``) for variant builds; a variant needs its own
    ``name`` and an ``ASYNCSYNC_OP_NAMESPACE`` so that its ops do not clash with the default ones.
    """
    from torch.utils.cpp_extension import load

    if not CPU_SOURCE.exists():
        raise PackBackendUnavailable(f"no {CPU_SOURCE.name} to build: this is not a source checkout")
    cflags, ldflags = build_helpers().cpu_flags(torch)
    # torch's JIT cache hashes the sources and flags, not included headers: hash the headers in.
    header = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:12]
    load(name=name, sources=[str(CPU_SOURCE)], extra_include_paths=[str(CSRC)],
         extra_cflags=[*cflags, f"-DASYNCSYNC_HEADER_HASH={header}", *(f"-D{d}" for d in defines)],
         extra_ldflags=ldflags, is_python_module=False, verbose=False)


_loaded: list[str | PackBackendUnavailable] = []  # the outcome of the one load attempt per process


def load_cpu_ops() -> str:
    """Load ``torch.ops.asyncsync`` once per process; returns where the ops came from. Raises
    ``PackBackendUnavailable`` when they cannot load (the outcome is kept: no second build attempt)."""
    if not _loaded:
        try:
            _loaded.append(_load_cpu_ops())
        except PackBackendUnavailable as e:
            _loaded.append(e)
    if isinstance(_loaded[0], PackBackendUnavailable):
        raise _loaded[0]
    return _loaded[0]


def _load_cpu_ops() -> str:
    if os.environ.get(NO_EXT_ENV, "") not in ("", "0"):
        raise PackBackendUnavailable(f"the compiled pack op is disabled by {NO_EXT_ENV}={os.environ[NO_EXT_ENV]}")
    installed = importlib.util.find_spec(INSTALLED_MODULE)
    stale = installed is not None and CPU_SOURCE.exists() and max(
        p.stat().st_mtime for p in (CPU_SOURCE, *HEADERS)) > Path(installed.origin).stat().st_mtime
    if installed is not None and not stale:
        importlib.import_module(INSTALLED_MODULE)  # registers the ops (TORCH_LIBRARY) as it loads
        return f"installed build ({Path(installed.origin).name})"
    why = "the installed build is older than csrc/" if stale else "no installed build"
    try:
        build_cpu_ops()
    except Exception as e:  # no compiler, no ninja, a compile error: all mean "use the torch path"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise PackBackendUnavailable(f"the C++ pack op could not be built ({why}; JIT build failed: {first})") from e
    return f"JIT build from csrc/ ({why})"


class CppPackBackend(PackBackend):
    """One C++ call per bucket: threads split the bucket by bytes and CRC32C is fused into the copy."""

    name = "cpp"
    device_type = "cpu"
    encodes_deltas = True

    def __init__(self) -> None:
        self.source = load_cpu_ops()

    def pack(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor, checksum: bool) -> int | None:
        with torch.no_grad():
            crc = torch.ops.asyncsync.pack(list(tensors), list(offsets), out, checksum)
        return crc if checksum else None

    def pack_delta(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], base: torch.Tensor, word: int,
                   limit: int) -> tuple[int, Delta]:
        """One pass per block (csrc/pack_cpu.cpp ``pack_delta``): the baseline's block is read, the
        new bytes packed over it with the CRC32C, the changed words found and encoded in cache."""
        with torch.no_grad():
            crc, changed, payload = torch.ops.asyncsync.pack_delta(list(tensors), list(offsets), base, word, limit)
        return crc, encoded(payload, changed)


def unpack_into(buf: torch.Tensor, offsets: Sequence[int], dsts: Sequence[torch.Tensor]) -> None:
    """Copy each tensor's bytes out of ``buf`` into contiguous CPU ``dsts``: the inverse of ``pack``."""
    load_cpu_ops()
    torch.ops.asyncsync.unpack(buf, list(offsets), list(dsts))


def status() -> dict[str, object]:
    """What ``asyncsync doctor`` reports about the compiled pack paths."""
    from asyncsync.packing import get_backend

    try:
        cpu, cpu_error = load_cpu_ops(), None
        checksum = f"CRC32C fused into the C++ pack ({torch.ops.asyncsync.crc_impl()})"
    except PackBackendUnavailable as e:
        cpu, cpu_error = None, str(e)
        checksum = "CRC32C by the crc32c package after the torch pack"
    if not torch.cuda.is_available():
        cuda = "not available (no CUDA device)"
    else:
        try:
            cuda = f"built with nvcc from csrc/ ({get_backend('auto', 'cuda').name} selected for CUDA weights)"
        except Exception as e:
            cuda = f"unavailable: {e}"
    return {
        "pack_backend (cpu weights)": get_backend("auto", "cpu").name,
        "cpu_extension": cpu, "cpu_extension_error": cpu_error, "checksum": checksum,
        "pack_threads": torch.get_num_threads(), "cuda_kernel": cuda, "nvcc": nvcc_path(),
    }
