"""A Ring as blocking mode uses it: single-tensor buckets go out in place, the rest through a ring."""

from __future__ import annotations

import torch

from asyncsync.packing.torch_backend import TorchPackBackend
from asyncsync.protocol.checksum import crc32c_of
from asyncsync.protocol.specs import BucketPlan, unpack
from asyncsync.trainer.buffers import Ring

CPU = torch.device("cpu")


def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    out = {"embed": torch.randn(64, 32, generator=g)}  # 8 KiB: a bucket of its own
    for i in range(12):
        out[f"layer{i}.w"] = torch.randn(8, 8, generator=g).to(torch.bfloat16)
        out[f"layer{i}.b"] = torch.randn(8, generator=g)
    out["head"] = torch.randn(40, 30, generator=g).t()  # 4.8 KiB, not contiguous: a bucket of its own
    return out


def test_the_ring_sends_single_tensor_buckets_in_place_and_packs_the_others_in_turn():
    named = weights()
    plan = BucketPlan.from_tensors(named.items(), bucket_bytes=256)
    ring = Ring(plan, CPU, TorchPackBackend(), checksum=True, slots=3)
    single = [b for b in plan.buckets if len(b.specs) == 1]
    packed = [b for b in plan.buckets if len(b.specs) > 1]
    assert {b.specs[0].name for b in single} == {"embed", "head"} and len(packed) > 3 * 2
    assert ring.footprint.device == 3 * max(b.nbytes for b in packed)  # the big tensors take no ring memory

    source = ring.packing(named)
    for bucket in plan.buckets:
        buf = source.bucket(bucket)
        for name, view in unpack(buf, bucket):
            assert torch.equal(view, named[name]), name
        assert source.checksum(bucket) == crc32c_of(buf)
        if bucket.specs[0].name == "embed":
            assert buf.data_ptr() == named["embed"].data_ptr(), "a contiguous tensor is sent in place"

    later = packed[3:]
    assert [ring.reuses(b) for b in later] == [b.index for b in packed[: len(later)]]
    assert all(ring.reuses(b) is None for b in [*single, *packed[:3]])


def test_without_checksums_nothing_is_checksummed():
    named = weights()
    plan = BucketPlan.from_tensors(named.items(), bucket_bytes=256)
    source = Ring(plan, CPU, TorchPackBackend(), checksum=False, slots=2).packing(named)
    for bucket in plan.buckets:
        source.bucket(bucket)
        assert source.checksum(bucket) is None
