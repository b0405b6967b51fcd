"""The C++ pack extension writes the reference backend's bytes and checksum, round-trips, and refuses bad input.

Two builds are checked against ``TorchPackBackend``: the default one (SSE4.2 crc32 on x86, 256 KiB
minimum per-thread range) and a portable variant (table CRC, 1-byte minimum range) so that the
software CRC and chunk boundaries falling anywhere inside tensors are covered with small inputs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import crc32c
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsync.packing import PackBackendUnavailable, get_backend
from asyncsync.packing.torch_backend import TorchPackBackend
from asyncsync.protocol.specs import BucketPlan

REPO = Path(__file__).resolve().parents[1]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.int32, torch.int64, torch.bool]
PORTABLE_DEFINES = ("ASYNCSYNC_SOFTWARE_CRC", "ASYNCSYNC_MIN_CHUNK_BYTES=1", "ASYNCSYNC_OP_NAMESPACE=asyncsync_portable")

# The autouse thread fixture in conftest is function-scoped; examples set their own thread count.
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@dataclass(frozen=True)
class Ops:
    name: str
    pack: Callable[[list[torch.Tensor], list[int], torch.Tensor, bool], int]
    unpack: Callable[[torch.Tensor, list[int], list[torch.Tensor]], None]


@pytest.fixture(scope="session")
def csrc() -> ModuleType:
    import asyncsync.packing.native as csrc

    error = csrc.status()["cpu_extension_error"]
    if error is not None:
        pytest.skip(f"C++ extension not built here: {error}")
    return csrc


@pytest.fixture(scope="session", params=["default", "portable"])
def ops(request: pytest.FixtureRequest, csrc: ModuleType) -> Ops:
    if request.param == "default":
        return Ops("default", torch.ops.asyncsync.pack, torch.ops.asyncsync.unpack)
    csrc.build_cpu_ops("asyncsync_pack_cpu_portable", PORTABLE_DEFINES)
    return Ops("portable", torch.ops.asyncsync_portable.pack, torch.ops.asyncsync_portable.unpack)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """C-order bytes; a copy with standard strides, since a size-1 dim may carry any stride."""
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t).reshape(-1).view(torch.uint8)


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of any supported dtype: 0-dim, empty, odd-sized, and sometimes a non-contiguous view."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 7), max_size=3))
    view = draw(st.sampled_from(["contiguous", "transposed", "strided", "offset"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def make(s: Sequence[int]) -> torch.Tensor:
        if dtype == torch.bool:
            return torch.randint(0, 2, tuple(s), generator=g).bool()
        if dtype.is_floating_point:
            return torch.randn(tuple(s), generator=g).to(dtype)
        return torch.randint(-100, 100, tuple(s), generator=g).to(dtype)

    if view == "transposed" and len(shape) >= 2:
        return make(shape[::-1]).transpose(0, -1)
    if view == "strided" and shape:
        return make([*shape[:-1], 2 * shape[-1] + 1])[..., ::2]
    if view == "offset":  # contiguous, but starting at an odd element of its storage
        n = 1
        for s in shape:
            n *= s
        return make([n + 3])[3:].view(tuple(shape))
    return make(shape)


def lay_out(ts: Sequence[torch.Tensor], gaps: Sequence[int]) -> tuple[list[torch.Tensor], list[int], int]:
    """Sources in a BucketPlan bucket's order, its offsets shifted by gaps (multiples of 8), and the end."""
    if not ts:
        return [], [], 0
    plan = BucketPlan.from_tensors([(f"t{i}", t) for i, t in enumerate(ts)], bucket_bytes=1 << 40)
    (bucket,) = plan.buckets
    by_name = {f"t{i}": t for i, t in enumerate(ts)}
    srcs, offsets, shift = [], [], 0
    for spec, off, gap in zip(bucket.specs, bucket.offsets, gaps, strict=True):
        shift += gap
        srcs.append(by_name[spec.name])
        offsets.append(off + shift)
    return srcs, offsets, bucket.nbytes + shift


def check_against_reference(ops: Ops, srcs: list[torch.Tensor], offsets: list[int], end: int, tail: int, seed: int) -> None:
    before = torch.randint(0, 256, (end + tail,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    expected = before.clone()
    expected_crc = TorchPackBackend().pack(srcs, offsets, expected, checksum=True)

    out = before.clone()
    assert ops.pack(srcs, offsets, out, True) == expected_crc
    assert torch.equal(out, expected)  # ranges hold the tensors; gaps and tail are untouched
    assert expected_crc == crc32c.crc32c(memoryview(expected[:end].numpy()))

    out = before.clone()
    assert ops.pack(srcs, offsets, out, False) == -1
    assert torch.equal(out, expected)

    dsts = [torch.empty(t.shape, dtype=t.dtype) for t in srcs]
    ops.unpack(out, offsets, dsts)
    for src, dst in zip(srcs, dsts, strict=True):
        assert torch.equal(as_bytes(dst), as_bytes(src))


@PROPERTY
@given(
    ts=st.lists(tensors(), max_size=12),
    gaps=st.lists(st.sampled_from([0, 0, 0, 8, 16, 64]), min_size=12, max_size=12),
    tail=st.integers(0, 16),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_matches_torch_backend(ops: Ops, ts: list[torch.Tensor], gaps: list[int], tail: int, threads: int, seed: int) -> None:
    torch.set_num_threads(threads)
    srcs, offsets, end = lay_out(ts, gaps[: len(ts)])
    check_against_reference(ops, srcs, offsets, end, tail, seed)


@pytest.mark.parametrize("threads", [1, 2])
def test_large_bucket_splits_across_threads(ops: Ops, threads: int) -> None:
    """Several MB so that the default build's per-thread ranges (>= 256 KiB) cut through tensors."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(threads)
    ts = [
        torch.randn(333_333, generator=g),
        torch.randn(1001, 517, generator=g).to(torch.bfloat16).t(),
        torch.randint(-128, 127, (777_777,), dtype=torch.int8, generator=g),
        torch.randn(3, generator=g).double(),
        torch.randint(0, 2, (123_457,), generator=g).bool(),
    ]
    srcs, offsets, end = lay_out(ts, [0, 8, 0, 24, 8])
    check_against_reference(ops, srcs, offsets, end, tail=5, seed=threads)


def test_checksum_is_crc32c_of_the_bytes(csrc: ModuleType) -> None:
    data = torch.frombuffer(bytearray(b"123456789"), dtype=torch.uint8)
    out = torch.zeros(9, dtype=torch.uint8)
    assert torch.ops.asyncsync.pack([data], [0], out, True) == 0xE3069283  # the CRC32C check value
    assert csrc.CppPackBackend().pack([data], [0], out, checksum=True) == 0xE3069283
    assert csrc.CppPackBackend().pack([data], [0], out, checksum=False) is None


def test_parameters_that_require_grad_pack(csrc: ModuleType) -> None:
    layer = torch.nn.Linear(7, 3)
    params = [layer.weight, layer.bias, layer.weight.t()]
    srcs, offsets, end = lay_out(params, [0, 0, 0])
    out, ref = torch.zeros(end, dtype=torch.uint8), torch.zeros(end, dtype=torch.uint8)
    assert csrc.CppPackBackend().pack(srcs, offsets, out, True) == TorchPackBackend().pack(srcs, offsets, ref, True)
    assert torch.equal(out, ref)


def _bad_inputs() -> list[tuple[str, Callable[[], tuple[list, list, torch.Tensor]], type[Exception], str]]:
    t = torch.arange(10, dtype=torch.int32)  # 40 bytes
    buf = torch.zeros(64, dtype=torch.uint8)
    return [
        ("float out", lambda: ([t], [0], torch.zeros(64)), TypeError, "expected a flat uint8 buffer"),
        ("2-D out", lambda: ([t], [0], buf.view(8, 8)), ValueError, "1-D"),
        ("strided out", lambda: ([t], [0], torch.zeros(128, dtype=torch.uint8)[::2]), ValueError, "not contiguous"),
        ("out too small", lambda: ([t], [30], buf), ValueError, "has only 64 bytes"),
        ("offset count", lambda: ([t, t], [0], buf), ValueError, "2 tensors but 1 offsets"),
        ("negative offset", lambda: ([t], [-4], buf), ValueError, "negative"),
        ("overlap", lambda: ([t, t[:2]], [0, 36], buf), ValueError, "overlap"),
        ("aliases out", lambda: ([buf[:8]], [16], buf), ValueError, "shares memory"),
        ("meta tensor", lambda: ([torch.empty(4, device="meta")], [0], buf), ValueError, "is on meta"),
        ("sparse tensor", lambda: ([t.to_sparse()], [0], buf), ValueError, "only dense tensors"),
    ]


@pytest.mark.parametrize(("case", "args", "error", "message"), _bad_inputs(), ids=[c[0] for c in _bad_inputs()])
def test_pack_rejects_bad_input_and_writes_nothing(
    csrc: ModuleType, case: str, args: Callable[[], tuple[list, list, torch.Tensor]], error: type[Exception], message: str
) -> None:
    srcs, offsets, out = args()
    before = out.clone()
    with pytest.raises(error, match=message):
        torch.ops.asyncsync.pack(srcs, offsets, out, True)
    assert torch.equal(out, before)


def test_unpack_rejects_bad_destinations(csrc: ModuleType) -> None:
    buf = torch.arange(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="not a plain contiguous tensor"):
        csrc.unpack_into(buf, [0], [torch.zeros(4, 4, dtype=torch.int8).t()])
    with pytest.raises(ValueError, match="has only 64 bytes"):
        csrc.unpack_into(buf, [60], [torch.zeros(2, dtype=torch.int32)])
    with pytest.raises(ValueError, match="shares memory"):
        csrc.unpack_into(buf, [0], [buf[32:40]])


def test_auto_backend_is_the_extension(csrc: ModuleType) -> None:
    assert isinstance(get_backend("auto"), csrc.CppPackBackend)
    assert get_backend("cpp").name == "cpp"
    report = csrc.status()
    assert report["pack_backend (cpu weights)"] == "cpp"
    assert report["cpu_extension"].startswith(("installed build", "JIT build from csrc/"))
    assert report["checksum"].startswith("CRC32C fused into the C++ pack")
    if not torch.cuda.is_available():
        assert report["cuda_kernel"] == "not available (no CUDA device)"
        with pytest.raises(PackBackendUnavailable, match="needs a CUDA device"):
            get_backend("cuda")
        with pytest.raises(PackBackendUnavailable, match="unknown pack backend 'tpu'"):
            get_backend("tpu")


def _backend_in_subprocess(env: dict[str, str], hide_installed_build: bool = False) -> subprocess.CompletedProcess[str]:
    code = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.WARNING, stream=sys.stderr)\n"
        + ("sys.modules['asyncsync._pack_cpu'] = None  # as if the install had built no extension\n"
           if hide_installed_build else "")
        + "from asyncsync.packing import get_backend\n"
        "print(get_backend('auto').name)\n"
        "print(get_backend('auto').name)\n"
    )
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_no_ext_env_falls_back_to_torch_with_one_warning() -> None:
    result = _backend_in_subprocess({"ASYNCSYNC_NO_EXT": "1"})
    assert result.stdout.split() == ["torch", "torch"], result.stderr
    warnings = [line for line in result.stderr.splitlines() if "pure-torch backend" in line]
    assert len(warnings) == 1, result.stderr
    assert "ASYNCSYNC_NO_EXT=1" in warnings[0]


def test_failed_build_falls_back_to_torch_with_one_warning(tmp_path: Path) -> None:
    result = _backend_in_subprocess({"CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}, hide_installed_build=True)
    assert result.stdout.split() == ["torch", "torch"], result.stderr
    warnings = [line for line in result.stderr.splitlines() if "pure-torch backend" in line]
    assert len(warnings) == 1, result.stderr
    assert "no installed build; JIT build failed" in warnings[0]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_kernel_compiles_and_its_emulation_passes() -> None:
    result = subprocess.run([str(REPO / "scripts" / "check_cuda.sh")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "compiles for sm_90" in result.stdout
    assert "cases passed" in result.stdout
