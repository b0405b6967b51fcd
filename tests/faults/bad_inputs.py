"""Malformed trainer-side inputs, fuzzed with hypothesis in a child process of
``test_bad_trainer_inputs.py``: a crash here (SIGSEGV in a compiled pack) fails that test with this
process's exit status instead of killing pytest.

    python tests/faults/bad_inputs.py ops [--examples N]            # the pack ops, no server
    python tests/faults/bad_inputs.py sync URL [URL ...] [--examples N]

``ops`` hands every malformation (``BAD``) and every legal oddity (``LEGAL``) to each entry point that
reaches native code: the C++ op, ``CppPackBackend``, the CUDA launcher's validation
(``launch_table``, on CPU), and the packing layer (``named_tensors`` + ``Snapshot``). A legal
input must pack to the torch backend's bytes and checksum; a bad one must raise a ``ValueError``,
``TypeError`` or ``NotImplementedError`` naming the tensor, with not one byte of the buffer written.

``sync`` publishes versions through ``WeightSync`` (blocking, then async) to reference servers the
parent started; each version has one tensor malformed, resized or replaced (a published tensor's
storage also after ``publish``, before the snapshot reads it; ``publish`` reads which tensors make
the version, so replacing one afterwards does not change it). A legal version must reach every server bit for bit (NaN and Inf
included); a bad one must raise (blocking, or at ``publish`` for what ``publish`` checks) or land in
``sync.errors`` (async) naming the tensor, and every server must keep serving its last complete version.

Prints one JSON line: how many examples of each kind ran and how each ended.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers, conftest

from asyncsync.packing.cuda import launch_table  # noqa: E402
from asyncsync.packing.native import CppPackBackend  # noqa: E402
from asyncsync.packing.torch_backend import TorchPackBackend  # noqa: E402
from asyncsync.protocol.specs import BucketPlan  # noqa: E402
from asyncsync.trainer.buffers import Ring, Snapshot  # noqa: E402
from asyncsync.trainer.source import named_tensors  # noqa: E402

EXPECTED_ERRORS = (ValueError, TypeError, NotImplementedError)
LEGAL = ("plain", "noncontiguous", "expanded", "nan_inf", "parameter")
BAD_TENSORS = ("dtensor", "wrapper", "fake", "meta", "freed", "shrunk", "sparse", "not_a_tensor")
BAD_OPS = BAD_TENSORS + ("negative_offset", "huge_offset", "out_too_small", "out_aliases")
BAD_LAYOUT = ("dtype", "reshaped", "missing", "extra")
RESIZED = ("freed", "shrunk")  # what can still change after publish(): a published tensor's storage, in place
CPU = torch.device("cpu")
outcomes: Counter[str] = Counter()


# -- malformed tensors ------------------------------------------------------------------------------

class Wrapper(torch.Tensor):
    """A wrapper subclass (as torchao's quantized tensors are): metadata here, data elsewhere, data_ptr 0."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Wrapper:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        unwrap = lambda x: x.inner if isinstance(x, Wrapper) else x  # noqa: E731
        return func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))


def dtensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor over a one-rank mesh, built without a process group (FSDP2's parameters are these)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = DeviceMesh("cpu", [0], _init_backend=False, _rank=0)
    return DTensor.from_local(t, mesh, [Shard(0) if t.dim() else Replicate()], run_check=False)


def fake(t: torch.Tensor) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty(t.shape, dtype=t.dtype)


def freed(t: torch.Tensor, keep_bytes: int) -> torch.Tensor:
    """``t``'s values in a view whose storage then shrinks to ``keep_bytes`` (0: freed, as FSDP frees)."""
    view = torch.empty(t.numel() + 2, dtype=t.dtype)[2:].view(t.shape).copy_(t)
    view.untyped_storage().resize_(keep_bytes)
    return view


def malformed(kind: str, t: torch.Tensor, g: torch.Generator) -> object:
    """``t`` turned into ``kind``: legal oddities keep its values (what must be sent), bad ones do not."""
    if kind == "plain":
        return t
    if kind == "noncontiguous":  # same values, transposed strides
        return t.clone() if t.dim() < 2 else t.transpose(0, 1).contiguous().transpose(0, 1)
    if kind == "expanded":  # one value seen through stride-0 (overlapping) views
        return t.reshape(-1)[:1].reshape([1] * t.dim()).expand(t.shape) if t.numel() else t
    if kind == "nan_inf":  # legal values: sent bit for bit, never cleaned
        out = t.clone()
        if out.is_floating_point() and out.numel():
            flat = out.view(-1)
            specials = torch.tensor([math.nan, math.inf, -math.inf, -0.0, -math.nan]).to(out.dtype)
            idx = torch.randint(0, flat.numel(), (min(5, flat.numel()),), generator=g)
            flat[idx] = specials[: idx.numel()]
        return out
    if kind == "parameter":
        return torch.nn.Parameter(t.clone(), requires_grad=t.is_floating_point())
    if kind == "dtensor":
        return dtensor(t)
    if kind == "wrapper":
        return Wrapper(t)
    if kind == "fake":
        return fake(t)
    if kind == "meta":
        return t.to("meta")
    if kind == "freed":
        return freed(t, 0)
    if kind == "shrunk":
        return freed(t, max(0, t.nbytes // 2 - 1))
    if kind == "sparse":
        return t.to_sparse() if t.dim() else t.reshape(1).to_sparse()
    if kind == "not_a_tensor":
        return t.tolist()
    if kind == "dtype":
        return t.to(torch.float64 if t.dtype != torch.float64 else torch.float32)
    if kind == "reshaped":
        return t.reshape(-1, 1) if t.dim() != 2 else t.reshape(-1)
    raise AssertionError(kind)


def usable(kind: str, t: torch.Tensor) -> bool:
    """Kinds that would not be malformed for this tensor: a freed 0-byte tensor has nothing to read."""
    if kind in ("freed", "shrunk"):
        return t.numel() > 0
    if kind == "reshaped":
        return t.numel() > 0
    return True


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads and -0.0 included), whatever the strides."""
    def raw(t: torch.Tensor) -> torch.Tensor:
        return t.detach().contiguous().reshape(-1).view(torch.uint8)
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(raw(a), raw(b))


def expect_error(call: Callable[[], object], names: list[str], kind: str) -> None:
    """``call`` must raise one of EXPECTED_ERRORS naming one of ``names``."""
    try:
        call()
    except EXPECTED_ERRORS as e:
        message = str(e)
        assert any(n in message for n in names), f"{kind}: the error does not name the tensor ({names}): {message}"
        outcomes[f"{kind}: {type(e).__name__}"] += 1
        return
    raise AssertionError(f"{kind}: no error was raised")


# -- ops: every entry point that reaches native code -----------------------------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8, torch.bool]


@st.composite
def base_tensors(draw: st.DrawFn) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=0, max_size=3)))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


ENTRIES = ("op", "cpp", "cuda_table", "packing")


def run_ops(examples: int) -> None:
    """Every (kind, entry point) pair, ``examples`` hypothesis examples each (the tensors vary)."""
    cpp, ref = CppPackBackend(), TorchPackBackend()

    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(victim=base_tensors(), others=st.lists(base_tensors(), max_size=3), seed=st.integers(0, 2**31 - 1))
    def case(victim: torch.Tensor, others: list[torch.Tensor], seed: int, kind: str, entry: str) -> None:
        if not usable(kind, victim):
            return
        g = torch.Generator().manual_seed(seed)
        names = [f"t{i}" for i in range(len(others) + 1)]
        plain = dict(zip(names, [victim, *others]))
        plan = BucketPlan.from_tensors(plain.items(), bucket_bytes=1 << 40)
        (bucket,) = plan.buckets
        order = [s.name for s in bucket.specs]
        index = order.index("t0")
        offsets = list(bucket.offsets)
        tail = 16
        before = torch.randint(0, 256, (bucket.nbytes + tail,), dtype=torch.uint8, generator=g)
        args = dict(plain, t0=malformed(kind if kind in LEGAL + BAD_TENSORS else "plain", victim, g))
        srcs = [args[n] for n in order]
        out = before.clone()
        if kind == "negative_offset":
            offsets[index] = -8
        elif kind == "huge_offset":
            offsets[index] = 2**62
        elif kind == "out_too_small":
            out = out[: max(0, offsets[index] + victim.nbytes - 1)]
        elif kind == "out_aliases":
            srcs[index] = out[: victim.nbytes].view(victim.dtype).view(victim.shape) if victim.nbytes else out[:0]
            if not victim.nbytes:
                return
        snapshot = out.clone()

        if entry == "packing":
            buffers = Snapshot(plan, CPU, cpp, checksum=True)
            if kind in LEGAL:
                buffers.pack_all(named_tensors(args))
                want = torch.zeros(bucket.nbytes, dtype=torch.uint8)
                want_crc = ref.pack([args[n] for n in order], offsets, want, True)
                assert torch.equal(buffers.buffers[0], want) and buffers.crcs[0] == want_crc, kind
                outcomes[f"{kind}: packed"] += 1
            else:
                expect_error(lambda: buffers.pack_all(named_tensors(args)), ["'t0'"], kind)
            return

        call = {
            "op": lambda: torch.ops.asyncsync.pack(srcs, offsets, out, True),
            "cpp": lambda: cpp.pack(srcs, offsets, out, True),
            "cuda_table": lambda: launch_table(srcs, offsets, out, "cpu"),
        }[entry]
        if kind in LEGAL:
            got = call()
            if entry == "cuda_table":  # the kernel's table: each source's bytes, in C order, at its offset
                for off, size, ptr, i in got.rows:
                    assert (off, size) == (offsets[i], srcs[i].nbytes) and got.sources[i].is_contiguous()
                    assert same_bytes(got.sources[i], srcs[i])
                    assert ptr == got.sources[i].data_ptr() or size == 0
                outcomes[f"{kind}: table"] += 1
                return
            want = before.clone()
            want_crc = ref.pack(srcs, offsets, want, True)
            assert got == want_crc and torch.equal(out, want), f"{kind} via {entry}: other bytes than the torch backend"
            outcomes[f"{kind}: packed"] += 1
        else:
            expect_error(call, [f"tensor {index}", f"tensor '{index}'"], kind)
            assert torch.equal(out, snapshot), f"{kind} via {entry}: bytes were written before the error"

    for kind in LEGAL + BAD_OPS:
        for entry in ENTRIES:
            if entry == "packing" and kind in BAD_OPS[len(BAD_TENSORS):]:
                continue  # offsets and buffers are the packing layer's own: nothing for a trainer to get wrong
            if kind == "not_a_tensor" and entry in ("op", "cpp"):
                continue  # the op's binding refuses it (TypeError "must be tuple of Tensors"): torch's check
            case(kind=kind, entry=entry)
    cpp_direct_checks()


def cpp_direct_checks() -> None:
    """Unpack refuses destinations that overlap each other (parallel writes would race), and a tensor
    freed after the packing layer checked it is refused by the op and named by the packing layer."""
    from asyncsync.packing.native import unpack_into

    buf = torch.arange(64, dtype=torch.uint8)
    dst = torch.zeros(16, dtype=torch.uint8)
    expect_error(lambda: unpack_into(buf, [0, 16], [dst[:12], dst[4:]]), ["destinations 0 and 1"], "overlapping destinations")

    named = {"w": torch.ones(8), "b": torch.ones(2)}
    plan = BucketPlan.from_tensors(named.items())
    buffers = Ring(plan, CPU, CppPackBackend(), checksum=True)
    source = buffers.packing(named)  # checked here; then freed, as another thread could
    named["w"].untyped_storage().resize_(0)
    expect_error(lambda: source.bucket(plan.buckets[0]), ["packing bucket 0 failed: tensor 'w' reads 32 bytes"],
                 "freed after the check")


# -- sync: WeightSync against reference servers -----------------------------------------------------

def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return json.loads(resp.read())


def served(urls: list[str]) -> set[tuple[int, str]]:
    """Each server's (version, digest), as one comparable value per server."""
    return {(d["version"], json.dumps(d["digest"], sort_keys=True)) for d in (get(u + "/weights/digest") for u in urls)}


def run_sync(urls: list[str], examples: int) -> None:
    from asyncsync import WeightSync, WeightSyncConfig
    from asyncsync.testing import mixed_dtype_model
    from conftest import TINY
    from helpers import digest

    model = mixed_dtype_model(TINY)
    base = {n: t.detach().clone() for n, t in model.state_dict().items()}
    names = sorted(base)
    version = [max(v for v, _ in served(urls))]
    last_good = [served(urls)]

    def step_weights(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {n: (t + torch.randn(t.shape, generator=g).to(t.dtype)) if t.is_floating_point() else t + seed % 7
                for n, t in base.items()}

    def check_served(named: dict[str, torch.Tensor] | None, v: int) -> None:
        if named is not None:
            want = {(v, json.dumps(digest(named), sort_keys=True))}
            assert served(urls) == want, "a legal version did not reach every server bit for bit"
            last_good[0] = want
        assert served(urls) == last_good[0], "a server does not serve its last complete version"

    def one(sync: WeightSync, kind: str, victim: str, seed: int, after_publish: bool) -> None:
        version[0] += 1
        v = version[0]
        weights = step_weights(seed)
        g = torch.Generator().manual_seed(seed)
        named: dict[str, object] = dict(weights)
        if kind == "missing":
            del named[victim]
        elif kind == "extra":
            named["extra.weight"] = torch.zeros(3)
        elif not after_publish:
            named[victim] = malformed(kind, weights[victim], g)
        published = dict(named)
        legal = kind in LEGAL
        expect = [f"'{victim}'"] if kind != "extra" else ["'extra.weight'"]
        if kind == "dtensor":
            expect.append("DTensor")
        if not sync.is_async:
            if legal:
                result = sync.publish(named, v)
                assert set(result.server_versions.values()) == {v}, result.failures
                check_served(published, v)
                outcomes[f"{kind}: synced"] += 1
            else:
                expect_error(lambda: sync.publish(named, v), expect, kind)
                check_served(None, v)
            return
        errors = len(sync.errors)
        worker = sync.connection.publisher.worker
        gate = threading.Event()
        take = worker._take
        if after_publish:  # the snapshot reads the weights only once they were freed or resized
            worker._take = lambda item, target: (gate.wait(30), take(item, target))[1]
        try:
            sync.publish(named, v)
            if after_publish:  # the very tensor published, in place: publish() read the mapping already
                named[victim].untyped_storage().resize_(0 if kind == "freed" else 1)
            gate.set()
            sync.wait_snapshot()
        finally:
            worker._take = take
        if legal:
            assert sync.wait_for_fresh_servers(v, timeout=60), "a legal version was not applied"
            check_served(published, v)
            outcomes[f"{kind}: synced"] += 1
        else:
            assert len(sync.errors) == errors + 1, f"{kind}: no error recorded ({sync.errors[errors:]})"
            message = sync.errors[-1]
            assert any(n in message for n in expect), f"{kind}: the error does not name the tensor: {message}"
            outcomes[f"{kind}{' after publish' if after_publish else ''}: errors"] += 1
            check_served(None, v)

    for mode in ("blocking", "async"):
        cfg = WeightSyncConfig.from_dict({"servers": urls, "bucket_bytes": "16KiB", "async_weight_update": mode == "async",
                                          "max_staleness": 0, "pack_backend": "cpp"})
        with WeightSync(cfg) as sync:
            sync.connect(model)
            boundary_checks(sync, model, version)

            @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(victim=st.sampled_from(names), seed=st.integers(0, 2**20))
            def case(victim: str, seed: int, kind: str, after_publish: bool) -> None:
                if usable(kind, base[victim]):
                    one(sync, kind, victim, seed, after_publish)

            for kind in LEGAL + BAD_TENSORS + BAD_LAYOUT:
                case(kind=kind, after_publish=False)
                if sync.is_async and kind in RESIZED:  # after publish, before the snapshot read it
                    case(kind=kind, after_publish=True)
    outcomes["last complete version"] = max(v for v, _ in served(urls))


def boundary_checks(sync, model: torch.nn.Module, version: list[int]) -> None:  # type: ignore[no-untyped-def]
    """What publish() itself refuses, in both modes, before anything is read or sent."""
    v = version[0] + 1
    for bad in (None, 3, [torch.zeros(1)], torch.zeros(2)):
        expect_error(lambda: sync.publish(bad, v), ["Module or a mapping"], "publish(not weights)")
    expect_error(lambda: sync.publish(dtensor(torch.zeros(2)), v), ["DTensor"], "publish(a DTensor)")
    sharded = torch.nn.Linear(2, 2)
    sharded.weight = torch.nn.Parameter(dtensor(sharded.weight.detach()))
    expect_sharded(lambda: sync.publish(sharded, v), "'weight' is a DTensor", "a module with DTensor parameters")
    # The module given to connect(), its parameter swapped for a DTensor afterwards (as fully_shard does).
    layer = model.model.layers[0].mlp.down_proj
    plain = layer.weight
    layer.weight = torch.nn.Parameter(dtensor(plain.detach()))
    try:
        expect_sharded(lambda: sync.publish(model, v), "'model.layers.0.mlp.down_proj.weight' is a DTensor",
                       "the connected module, sharded afterwards")
    finally:
        layer.weight = plain


def expect_sharded(call: Callable[[], object], fragment: str, what: str) -> None:
    from asyncsync.trainer.source import ShardedWeightsUnsupported

    try:
        call()
    except ShardedWeightsUnsupported as e:
        assert fragment in str(e) and "on every rank, as a collective" in str(e), e
        outcomes[f"publish({what}): ShardedWeightsUnsupported"] += 1
        return
    raise AssertionError(f"{what} was published")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("part", choices=["ops", "sync"])
    parser.add_argument("urls", nargs="*")
    parser.add_argument("--examples", type=int, default=100)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.part == "ops":
        run_ops(args.examples)
    else:
        run_sync(args.urls, args.examples)
    print(json.dumps(dict(sorted(outcomes.items()))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
