import pytest
import torch

from asyncsync.packing.torch_backend import TorchPackBackend
from asyncsync.protocol.checksum import crc32c_of
from asyncsync.protocol.specs import unpack
from asyncsync.protocol.specs import BucketPlan, TensorSpec


def specs(*items):
    return [TensorSpec(n, d, s) for n, d, s in items]


MIXED = specs(
    ("a.int8", torch.int8, (3,)),
    ("b.fp32", torch.float32, (5, 7)),
    ("c.bf16", torch.bfloat16, (9,)),
    ("d.fp64", torch.float64, ()),
    ("e.bool", torch.bool, (11,)),
    ("f.i64", torch.int64, (2, 3)),
)


def test_offsets_aligned_without_padding_and_sorted_by_itemsize():
    plan = BucketPlan(MIXED, bucket_bytes=1 << 20)
    assert len(plan.buckets) == 1
    bucket = plan.buckets[0]
    sizes = [s.itemsize for s in bucket.specs]
    assert sizes == sorted(sizes, reverse=True)
    end = 0
    for spec, off in zip(bucket.specs, bucket.offsets):
        assert off == end, "no padding between tensors"
        assert off % spec.itemsize == 0
        end += spec.nbytes
    assert bucket.nbytes == end == sum(s.nbytes for s in MIXED)


def test_buckets_respect_limit_and_oversize_gets_own_bucket():
    items = specs(
        ("small0", torch.float32, (10,)),        # 40 B
        ("small1", torch.float32, (10,)),        # 40 B
        ("huge", torch.float32, (1000,)),        # 4000 B > limit
        ("small2", torch.float16, (20,)),        # 40 B
    )
    plan = BucketPlan(items, bucket_bytes=100)
    assert [b.names for b in plan.buckets] == [["small0", "small1"], ["huge"], ["small2"]]
    assert all(b.nbytes <= 100 for b in plan.buckets if b.names != ["huge"])
    assert plan.total_bytes == sum(s.nbytes for s in items)
    assert sorted(n for b in plan.buckets for n in b.names) == sorted(s.name for s in items)


def test_plan_rejects_duplicates_and_bad_limit():
    with pytest.raises(ValueError, match="unique"):
        BucketPlan(specs(("x", torch.float32, (1,)), ("x", torch.float32, (1,))))
    with pytest.raises(ValueError, match="positive"):
        BucketPlan(MIXED, bucket_bytes=0)


def test_matches_detects_changed_shape_or_dtype():
    named = {"w": torch.zeros(4), "b": torch.zeros(2, dtype=torch.int32)}
    plan = BucketPlan.from_tensors(named.items())
    assert plan.matches(named)
    assert not plan.matches({**named, "w": torch.zeros(5)})
    assert not plan.matches({**named, "b": torch.zeros(2, dtype=torch.int64)})
    assert not plan.matches({"w": named["w"]})


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.int8": torch.randint(-100, 100, (3,), dtype=torch.int8, generator=g),
        "b.fp32": torch.randn(7, 5, generator=g).t(),  # non-contiguous
        "c.bf16": torch.randn(9, generator=g).to(torch.bfloat16),
        "d.fp64": torch.tensor(3.25, dtype=torch.float64),
        "e.bool": torch.rand(11, generator=g) > 0.5,
        "f.i64": torch.randint(0, 1 << 40, (2, 3), generator=g),
    }


def test_torch_pack_unpack_round_trip_and_checksum():
    named = _tensors()
    plan = BucketPlan.from_tensors(named.items())
    bucket = plan.buckets[0]
    buf = torch.full((bucket.nbytes + 16,), 0xAB, dtype=torch.uint8)
    crc = TorchPackBackend().pack([named[s.name] for s in bucket.specs], bucket.offsets, buf, checksum=True)
    assert crc == crc32c_of(buf[: bucket.nbytes])
    assert torch.all(buf[bucket.nbytes :] == 0xAB), "bytes past the bucket are untouched"
    for name, view in unpack(buf, bucket):
        assert view.dtype == named[name].dtype and view.shape == named[name].shape
        assert torch.equal(view, named[name])


def test_fresh_tensors_are_fetched_each_time():
    """The plan caches only the index: a parameter object replaced between syncs is what gets packed."""
    model = torch.nn.Linear(4, 3)
    plan = BucketPlan.from_tensors(model.state_dict().items())
    bucket = plan.buckets[0]
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
    packer = TorchPackBackend()
    first = packer.pack([model.state_dict()[s.name] for s in bucket.specs], bucket.offsets, buf, True)
    model.weight = torch.nn.Parameter(torch.full((3, 4), 7.0))  # a new object, same name and shape
    assert plan.matches(model.state_dict())
    second = packer.pack([model.state_dict()[s.name] for s in bucket.specs], bucket.offsets, buf, True)
    assert first != second
    assert torch.equal(dict(unpack(buf, bucket))["weight"], torch.full((3, 4), 7.0))


def test_single_dtype_buckets_group_by_dtype_and_never_mix():
    plan = BucketPlan(MIXED + specs(("g.fp32", torch.float32, (3,)), ("h.bf16", torch.bfloat16, (2,))),
                      bucket_bytes=1 << 20, single_dtype=True)
    assert [[s.name for s in b.specs] for b in plan.buckets] == [
        ["d.fp64"], ["f.i64"], ["b.fp32", "g.fp32"], ["c.bf16", "h.bf16"], ["e.bool"], ["a.int8"],
    ]
    assert plan.total_bytes == sum(s.nbytes for b in plan.buckets for s in b.specs)
