"""The compiled pack path: C++ ops built at first import, registered as the preferred pack backend.

Importing this package compiles ``pack_cpu.cpp`` with ``torch.utils.cpp_extension.load`` (the build is
cached, so only the first import in a fresh environment pays for it) and registers ``CppPackBackend``
under the name ``"cpp"``. Nothing is compiled at install time, so pip never needs torch or a compiler
in an isolated build and never downloads a CUDA build of torch. When the build fails, or when
``ASYNCSYNC_NO_EXT=1``, one warning is logged and nothing is registered: ``get_backend("auto")`` then
uses the pure-torch backend, which writes the same bytes and the same checksum.

On a machine with CUDA, ``CudaPackBackend`` is registered as well; it compiles ``pack_cuda.cu`` with
nvcc when first selected. See docs/csrc.md.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncsync.packing import PackBackend, TorchPackBackend, register_backend

log = logging.getLogger(__name__)

NO_EXT_ENV = "ASYNCSYNC_NO_EXT"
CPU_EXTENSION_NAME = "asyncsync_pack_cpu"
_HERE = Path(__file__).resolve().parent
CPU_SOURCE = _HERE / "pack_cpu.cpp"
CUDA_SOURCE = _HERE / "pack_cuda.cu"


@dataclass
class _State:
    cpu_loaded: bool = False
    cpu_error: str | None = None
    cuda_error: str | None = None


_state = _State()


def cpu_build_flags() -> list[str]:
    """Compiler flags for pack_cpu.cpp: SSE4.2 for the crc32 instruction on x86, OpenMP when torch uses it.

    Without ``-fopenmp`` ATen's ``parallel_for`` would silently run on one thread.
    """
    flags = ["-O3"]
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append("-msse4.2")
    if torch._C.has_openmp:
        flags.append("-fopenmp")
    return flags


def build_cpu_ops(name: str = CPU_EXTENSION_NAME, defines: Sequence[str] = ()) -> None:
    """Compile (or reuse the cached build of) pack_cpu.cpp and load its ops into this process.

    ``defines`` are preprocessor switches (``NAME=VALUE``) for variant builds; a variant needs its
    own ``name`` and an ``ASYNCSYNC_OP_NAMESPACE`` so that its ops do not clash with the default ones.
    """
    from torch.utils.cpp_extension import load

    flags = cpu_build_flags()
    load(
        name=name,
        sources=[str(CPU_SOURCE)],
        extra_cflags=[*flags, *(f"-D{d}" for d in defines)],
        extra_ldflags=["-fopenmp"] if "-fopenmp" in flags else [],
        is_python_module=False,
        verbose=False,
    )


class CppPackBackend(PackBackend):
    """One C++ call per bucket: threads split the bucket by bytes and CRC32C is fused into the copy.

    Bytes and checksum are identical to ``TorchPackBackend``'s (the tests check it), so receivers
    never need to know which backend packed a bucket.
    """

    name = "cpp"
    device_type = "cpu"

    def pack(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor, checksum: bool) -> int | None:
        with torch.no_grad():
            crc = torch.ops.asyncsync.pack(list(tensors), list(offsets), out, checksum)
        return crc if checksum else None


def unpack_into(buf: torch.Tensor, offsets: Sequence[int], dsts: Sequence[torch.Tensor]) -> None:
    """Copy each tensor's bytes out of ``buf`` into contiguous CPU ``dsts``: the inverse of ``pack``."""
    if not _state.cpu_loaded:
        raise RuntimeError(f"the asyncsync C++ extension is not loaded ({_state.cpu_error}); see asyncsync.csrc.status()")
    torch.ops.asyncsync.unpack(buf, list(offsets), list(dsts))


class CudaPackBackend(PackBackend):
    """One kernel launch per bucket through pack_cuda.cu's C ABI (ctypes; no torch CUDA headers needed).

    Unexercised: it has never run on a GPU. The kernel is compiled with nvcc and its block logic is
    emulated on the CPU by scripts/check_cuda.sh, but no GPU test or figure exists for it.
    """

    name = "cuda"
    device_type = "cuda"

    def pack(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor, checksum: bool) -> int | None:
        if out.device.type != "cuda" or out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous 1-D uint8 CUDA tensor, got {out.dtype} {tuple(out.shape)} on {out.device}")
        if len(tensors) != len(offsets):
            raise ValueError(f"got {len(tensors)} tensors but {len(offsets)} offsets; pass one byte offset per tensor")
        srcs = [t.detach().contiguous() for t in tensors]
        rows = sorted((off, t.numel() * t.element_size(), t.data_ptr(), i) for i, (t, off) in enumerate(zip(srcs, offsets)))
        end = 0
        for off, size, _, i in rows:
            if srcs[i].device != out.device:
                raise ValueError(f"tensor {i} is on {srcs[i].device}, out on {out.device}; move it first")
            if off < end and size > 0:
                raise ValueError(f"tensor {i} at offset {off} overlaps the previous range ending at {end}")
            end = max(end, off + size)
        if end > out.numel():
            raise ValueError(f"the tensors need {end} bytes but out has {out.numel()}")
        lib = _cuda_library()
        table = torch.tensor([[r[2] for r in rows], [r[1] for r in rows], [r[0] for r in rows]], dtype=torch.int64)
        table = table.pin_memory().to(out.device, non_blocking=True)
        crc_out = torch.empty(1, dtype=torch.int32, device=out.device) if checksum else None
        workspace = torch.empty(lib.asyncsync_pack_cuda_workspace_bytes(end), dtype=torch.uint8, device=out.device)
        stream = torch.cuda.current_stream(out.device).cuda_stream
        with torch.cuda.device(out.device):  # the launcher sizes its grid for the current device
            err = lib.asyncsync_pack_cuda(
                table[0].data_ptr(), table[1].data_ptr(), table[2].data_ptr(), len(rows), out.data_ptr(), end,
                stream, crc_out.data_ptr() if crc_out is not None else None, workspace.data_ptr(),
            )
        if err:
            raise RuntimeError(f"asyncsync_pack_cuda failed: {lib.asyncsync_cuda_error_string(err).decode()}")
        return int(crc_out.item()) & 0xFFFFFFFF if crc_out is not None else None


def _nvcc() -> str | None:
    from torch.utils.cpp_extension import CUDA_HOME

    if CUDA_HOME and (Path(CUDA_HOME) / "bin" / "nvcc").exists():
        return str(Path(CUDA_HOME) / "bin" / "nvcc")
    return shutil.which("nvcc")


@functools.cache
def _cuda_library() -> ctypes.CDLL:
    """Build pack_cuda.cu into a shared library (cached by source hash) and bind its C ABI."""
    from torch.utils.cpp_extension import get_default_build_root

    nvcc = _nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found; install the CUDA toolkit or set CUDA_HOME to build the CUDA pack kernel")
    digest = hashlib.sha256(CUDA_SOURCE.read_bytes()).hexdigest()[:16]
    lib_path = Path(get_default_build_root()) / f"asyncsync_pack_cuda_{digest}" / "libasyncsync_pack_cuda.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib_path.with_name(f"{lib_path.name}.{os.getpid()}.tmp")
        cmd = [nvcc, "-O3", "-std=c++17", "-arch=native", "-shared", "-Xcompiler", "-fPIC", str(CUDA_SOURCE), "-o", str(tmp)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"nvcc failed to build {CUDA_SOURCE.name}:\n{result.stderr[-4000:]}")
        os.replace(tmp, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.asyncsync_pack_cuda.argtypes = [vp, vp, vp, i64, vp, i64, vp, vp, vp]
    lib.asyncsync_pack_cuda.restype = ctypes.c_int
    lib.asyncsync_pack_cuda_workspace_bytes.argtypes = [i64]
    lib.asyncsync_pack_cuda_workspace_bytes.restype = i64
    lib.asyncsync_cuda_error_string.argtypes = [ctypes.c_int]
    lib.asyncsync_cuda_error_string.restype = ctypes.c_char_p
    return lib


def _cuda_backend() -> PackBackend:
    """The CUDA backend when its kernel builds; otherwise the torch backend (one warning, then silent)."""
    try:
        _cuda_library()
    except Exception as exc:  # any build or load failure must leave the torch path working
        if _state.cuda_error is None:
            log.warning("asyncsync CUDA pack kernel unavailable (%s); packing GPU tensors uses the pure-torch path", exc)
        _state.cuda_error = str(exc)
        return TorchPackBackend()
    return CudaPackBackend()


def status() -> dict[str, object]:
    """What ``asyncsync doctor`` reports: the active pack and checksum paths and why others are off."""
    from asyncsync.packing import get_backend

    if _state.cpu_loaded:
        checksum = f"CRC32C fused into the C++ pack ({torch.ops.asyncsync.crc_impl()})"
    else:
        checksum = "CRC32C by the crc32c package after the torch pack"
    if not torch.cuda.is_available():
        cuda = "not available (no CUDA device)"
    elif _state.cuda_error is not None:
        cuda = f"build failed: {_state.cuda_error}"
    else:
        cuda = "registered; built with nvcc when first selected (never run on a GPU in this project's tests)"
    return {
        "pack_backend": get_backend("auto", "cpu").name,
        "checksum": checksum,
        "pack_threads": torch.get_num_threads(),
        "cpu_extension_error": _state.cpu_error,
        "cuda_kernel": cuda,
        "nvcc": _nvcc(),
    }


def _load() -> None:
    if os.environ.get(NO_EXT_ENV, "") not in ("", "0"):
        _state.cpu_error = f"disabled by {NO_EXT_ENV}={os.environ[NO_EXT_ENV]}"
        log.warning("asyncsync C++ pack extension %s; packing uses the pure-torch path", _state.cpu_error)
        return
    if torch.cuda.is_available():
        register_backend("cuda", _cuda_backend, preferred=True)
    try:
        build_cpu_ops()
    except Exception as exc:  # no compiler, no ninja, a compile error: all mean "use the torch path"
        _state.cpu_error = f"{type(exc).__name__}: {exc}"
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        log.warning("asyncsync C++ pack extension could not be built (%s); packing uses the pure-torch path. "
                    "asyncsync.csrc.status() has the full error", first_line)
        return
    _state.cpu_loaded = True
    register_backend("cpp", CppPackBackend, preferred=True)


_load()
