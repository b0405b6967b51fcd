"""The CUDA pack kernel (csrc/pack_cuda.cu) behind a pack backend, bound with ctypes.

Unexercised: no machine of this project has a GPU. The kernel is compiled by scripts/check_cuda.sh
with nvcc and its block logic is emulated on the CPU there; nothing here has run on a GPU.

The kernel is written against the plain CUDA runtime with a C ABI (the CPU torch wheel lacks the
headers ``ATen/cuda`` needs), built with nvcc into a shared library at first use (cached by source
hash) and called on the caller's current stream. Nothing in ``pack`` waits for the device: the table
of ranges goes up from pinned memory without blocking, and the checksum comes back as a 0-dim device
tensor that the caller reads when it needs it.

``pack_delta`` launches the same kernel with a change mask, and a plan of every block of the delta
format behind it: still nothing waits. The delta itself is sized and written when the sender asks
for it (``CudaDelta.payload``, on the sender's thread and stream, after the snapshot's ``done``):
that reads the plans to the host, the one wait of the delta path, never at the step boundary.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncsync.packing import PackBackend, PackBackendUnavailable
from asyncsync.packing.checks import UnpackableTensor, check_tensor, memory_problem
from asyncsync.packing.csrc import CSRC, CUDA_SOURCE, HEADERS, nvcc_path
from asyncsync.packing.delta import Delta
from asyncsync.protocol.delta import BLOCK_WORDS


@functools.cache
def cuda_library() -> ctypes.CDLL:
    """Build pack_cuda.cu into a shared library (cached by source hash) and bind its C ABI."""
    from torch.utils.cpp_extension import get_default_build_root

    nvcc = nvcc_path()
    if nvcc is None:
        raise PackBackendUnavailable("nvcc not found; install the CUDA toolkit or set CUDA_HOME to build the CUDA pack kernel")
    if not CUDA_SOURCE.exists():
        raise PackBackendUnavailable(f"no {CUDA_SOURCE.name} to build: this is not a source checkout")
    digest = hashlib.sha256(CUDA_SOURCE.read_bytes() + b"".join(h.read_bytes() for h in HEADERS)).hexdigest()[:16]
    lib_path = Path(get_default_build_root()) / f"asyncsync_pack_cuda_{digest}" / "libasyncsync_pack_cuda.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = lib_path.with_name(f"{lib_path.name}.{os.getpid()}.tmp")
        cmd = [nvcc, "-O3", "-std=c++17", "-arch=native", "-shared", "-Xcompiler", "-fPIC", f"-I{CSRC}",
               str(CUDA_SOURCE), "-o", str(tmp)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise PackBackendUnavailable(f"nvcc failed to build {CUDA_SOURCE.name}:\n{result.stderr[-4000:]}")
        os.replace(tmp, lib_path)
    lib = ctypes.CDLL(str(lib_path))
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.asyncsync_pack_cuda.argtypes = [vp, vp, vp, i64, vp, i64, vp, vp, vp]
    lib.asyncsync_pack_cuda.restype = ctypes.c_int
    lib.asyncsync_pack_cuda_workspace_bytes.argtypes = [i64]
    lib.asyncsync_pack_cuda_workspace_bytes.restype = i64
    lib.asyncsync_cuda_error_string.argtypes = [ctypes.c_int]
    lib.asyncsync_cuda_error_string.restype = ctypes.c_char_p
    lib.asyncsync_pack_delta_cuda.argtypes = [vp, vp, vp, i64, vp, i64, vp, vp, vp, vp, i64, vp]
    lib.asyncsync_pack_delta_cuda.restype = ctypes.c_int
    lib.asyncsync_delta_plan_bytes.argtypes = []
    lib.asyncsync_delta_plan_bytes.restype = i64
    lib.asyncsync_delta_layout.argtypes = [vp, i64, vp]
    lib.asyncsync_delta_layout.restype = i64
    lib.asyncsync_delta_write_cuda.argtypes = [vp, vp, vp, vp, i64, i64, vp, vp]
    lib.asyncsync_delta_write_cuda.restype = ctypes.c_int
    return lib


class CudaPackBackend(PackBackend):
    """One kernel launch per bucket, on the caller's current stream; CRC32C computed in the kernel."""

    name = "cuda"
    device_type = "cuda"
    encodes_deltas = True

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise PackBackendUnavailable("the CUDA pack backend needs a CUDA device")
        self.lib = cuda_library()

    def pack(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor,
             checksum: bool) -> torch.Tensor | None:
        table = launch_table(tensors, offsets, out, self.device_type)  # raises before the kernel sees anything
        return self._launch(table, out, checksum)

    def pack_delta(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], base: torch.Tensor, word: int,
                   limit: int) -> tuple[torch.Tensor, Delta]:
        table = launch_table(tensors, offsets, base, self.device_type)
        if table.end % word or table.end == 0:
            raise ValueError(f"a bucket of {table.end} bytes is not whole words of {word} bytes")
        nwords = table.end // word
        nblocks = -(-nwords // BLOCK_WORDS)
        mask = torch.empty(-(-nwords // 32), dtype=torch.int32, device=base.device)
        plans = torch.empty(nblocks * self.lib.asyncsync_delta_plan_bytes(), dtype=torch.uint8, device=base.device)
        ptrs = _upload(table, base.device)
        crc_out = torch.empty(1, dtype=torch.int32, device=base.device)
        workspace = torch.empty(self.lib.asyncsync_pack_cuda_workspace_bytes(table.end), dtype=torch.uint8,
                                device=base.device)
        stream = torch.cuda.current_stream(base.device).cuda_stream
        with torch.cuda.device(base.device):
            err = self.lib.asyncsync_pack_delta_cuda(
                ptrs[0].data_ptr(), ptrs[1].data_ptr(), ptrs[2].data_ptr(), len(table.rows), base.data_ptr(), table.end,
                stream, crc_out.data_ptr(), workspace.data_ptr(), mask.data_ptr(), word, plans.data_ptr())
        if err:
            raise RuntimeError(f"asyncsync_pack_delta_cuda failed: {self.lib.asyncsync_cuda_error_string(err).decode()}")
        crc = crc_out[0].to(torch.int64) & 0xFFFFFFFF
        return crc, CudaDelta(self.lib, mask, plans, base[: table.end], word, limit)

    def _launch(self, table: LaunchTable, out: torch.Tensor, checksum: bool) -> torch.Tensor | None:
        """One kernel launch over ``table``'s validated ranges, on the current stream of ``out``'s device."""
        rows, end = table.rows, table.end
        ptrs = _upload(table, out.device)
        crc_out = torch.empty(1, dtype=torch.int32, device=out.device) if checksum else None
        workspace = torch.empty(self.lib.asyncsync_pack_cuda_workspace_bytes(end), dtype=torch.uint8, device=out.device)
        stream = torch.cuda.current_stream(out.device).cuda_stream
        with torch.cuda.device(out.device):  # the launcher sizes its grid for the current device
            err = self.lib.asyncsync_pack_cuda(
                ptrs[0].data_ptr(), ptrs[1].data_ptr(), ptrs[2].data_ptr(), len(rows), out.data_ptr(), end,
                stream, crc_out.data_ptr() if crc_out is not None else None, workspace.data_ptr(),
            )
        if err:
            raise RuntimeError(f"asyncsync_pack_cuda failed: {self.lib.asyncsync_cuda_error_string(err).decode()}")
        return (crc_out[0].to(torch.int64) & 0xFFFFFFFF) if crc_out is not None else None


class CudaDelta(Delta):
    """A bucket's delta on the device: planned by ``pack_delta``'s kernels, sized and written at the
    first ``payload()`` (on the calling thread's current stream, which must be ordered after the
    pack: a sender's, after the snapshot's ``done``). That call waits for the plans (a host sync).
    Several senders may read one snapshot (``group_per_server``): the first writes the delta under
    the lock and records an event; a later one's stream waits for that event before it reads."""

    def __init__(self, lib: ctypes.CDLL, mask: torch.Tensor, plans: torch.Tensor, base: torch.Tensor, word: int,
                 limit: int):
        super().__init__(None, -1)
        self._lib, self._mask, self._plans, self._base, self._word, self._limit = lib, mask, plans, base, word, limit
        self._done = False
        self._lock = threading.Lock()
        self._written: torch.cuda.Event | None = None  # after the write kernel, on the first reader's stream

    def payload(self) -> torch.Tensor | None:
        with self._lock:
            if not self._done:
                self.encoded = self._write()
                self._done = True
            elif self.encoded is not None:
                assert self._written is not None
                stream = torch.cuda.current_stream(self._base.device)
                stream.wait_event(self._written)  # written on another sender's stream
                self.encoded.record_stream(stream)
            return self.encoded

    def _write(self) -> torch.Tensor | None:
        """Size and write the delta on this thread's current stream; None where it does not pay."""
        device = self._base.device
        stream = torch.cuda.current_stream(device)
        for t in (self._mask, self._plans, self._base):
            t.record_stream(stream)  # used here, on another stream than the pack's
        plans = self._plans.cpu()  # the wait: the plans of every block
        nblocks = plans.numel() // self._lib.asyncsync_delta_plan_bytes()
        offsets = torch.empty(2 * nblocks, dtype=torch.int64).pin_memory()
        total = self._lib.asyncsync_delta_layout(plans.data_ptr(), nblocks, offsets.data_ptr())
        if total > self._limit:
            return None  # it does not pay: the bucket goes whole
        out = torch.zeros(total, dtype=torch.uint8, device=device)
        offsets = offsets.to(device, non_blocking=True)
        with torch.cuda.device(device):
            err = self._lib.asyncsync_delta_write_cuda(self._mask.data_ptr(), self._plans.data_ptr(), offsets.data_ptr(),
                                                       self._base.data_ptr(), self._base.numel() // self._word,
                                                       self._word, out.data_ptr(), stream.cuda_stream)
        if err:
            raise RuntimeError(f"asyncsync_delta_write_cuda failed: {self._lib.asyncsync_cuda_error_string(err).decode()}")
        self._written = torch.cuda.Event()
        self._written.record(stream)
        return out


def _upload(table: LaunchTable, device: torch.device) -> torch.Tensor:
    """The kernel's table of (source address, bytes, destination offset), on ``device``. Pinned, so
    the upload does not block the host; the caching host allocator keeps the block until the copy
    has run on this stream."""
    rows = table.rows
    ptrs = torch.tensor([[r[2] for r in rows], [r[1] for r in rows], [r[0] for r in rows]], dtype=torch.int64)
    return ptrs.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class LaunchTable:
    """What the kernel reads: (offset, nbytes, source address, index) sorted by offset, the end of the
    last range, and the sources those addresses point into (kept alive until the launch is enqueued)."""

    rows: list[tuple[int, int, int, int]]
    end: int
    sources: list[torch.Tensor]


def launch_table(tensors: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor,
                 device_type: str) -> LaunchTable:
    """Validate every argument of a pack on ``device_type`` and lay out the kernel's table.

    The kernel gets raw addresses through a C ABI and checks nothing, so everything that would make
    it read or write the wrong memory is refused here, each with an ``UnpackableTensor`` or
    ``ValueError`` naming the tensor: a tensor subclass, a meta tensor or a freed or shrunk storage
    (``memory_problem``), another device than ``out``, a negative offset, overlapping ranges, a range
    past the end of ``out``, a source that shares memory with ``out``. Runs without a GPU (the tests
    call it with ``device_type="cpu"``)."""
    problem = memory_problem(out)
    if (problem is not None or out.device.type != device_type or out.dtype != torch.uint8 or out.dim() != 1
            or not out.is_contiguous()):
        raise ValueError(f"out must be a contiguous 1-D uint8 {device_type} tensor with data, got {out.dtype} "
                         f"{tuple(out.shape)} on {out.device}" + (f" that {problem}" if problem else ""))
    if len(tensors) != len(offsets):
        raise ValueError(f"got {len(tensors)} tensors but {len(offsets)} offsets; pass one byte offset per tensor")
    srcs = []
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        check_tensor(str(i), t)
        if t.device != out.device:
            raise UnpackableTensor(f"tensor '{i}' is on {t.device}, out on {out.device}; move it to out's device first")
        if off < 0:
            raise ValueError(f"offset {off} of tensor {i} is negative")
        srcs.append(t.detach().contiguous())
    rows = sorted((off, t.numel() * t.element_size(), t.data_ptr(), i) for i, (t, off) in enumerate(zip(srcs, offsets)))
    end, out_lo, out_hi = 0, out.data_ptr(), out.data_ptr() + out.numel()
    for off, size, ptr, i in rows:
        if off + size > out.numel():
            raise ValueError(f"tensor {i} needs {size} bytes at offset {off} but out has only {out.numel()} bytes; "
                             "allocate the buffer with at least the bucket's nbytes")
        if size > 0 and off < end:
            raise ValueError(f"tensor {i} at offset {off} overlaps the previous range ending at {end}")
        if size > 0 and ptr < out_hi and out_lo < ptr + size:
            raise ValueError(f"tensor {i} shares memory with out; pass tensors that do not alias the flat buffer")
        end = max(end, off + size)
    return LaunchTable(rows, end, srcs)
