"""A server that receives a bad version rejects all of it and keeps serving the old weights."""

from __future__ import annotations

import urllib.error
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from asyncsync.dataplane import DataPlaneGroup, GroupSpec, free_port
from asyncsync.packing import TorchPackBackend
from asyncsync.plan import BucketPlan
from asyncsync.testing import ServerProcess, mixed_dtype_model
from asyncsync.wire import BucketMeta, InitGroupRequest, UpdateRequest, VersionRequest

from conftest import TINY


class ManualTrainer:
    """Rank 0 driven by hand, so a test can corrupt exactly one thing on the wire."""

    def __init__(self, server: ServerProcess):
        self.server = server
        self.pool = ThreadPoolExecutor(2)
        spec = GroupSpec("127.0.0.1", free_port(), 2, "rejects", "gloo", 30.0)
        joined = self.pool.submit(server.post, "/init_group", InitGroupRequest(spec, 1).to_json())
        self.group = DataPlaneGroup.join(spec, 0)
        joined.result(60)

    def send(self, named: dict[str, torch.Tensor], version: int, *, flip_byte: bool = False,
             edit_meta=None) -> None:
        plan = BucketPlan.from_tensors(named.items(), bucket_bytes=16 * 1024)
        metas = [BucketMeta.of(b) for b in plan.buckets]
        if edit_meta is not None:
            metas = edit_meta(metas)
        request = UpdateRequest(version, tuple(metas), checksum=True)
        self.server.post("/begin", VersionRequest(version).to_json())
        answer = self.pool.submit(self.server.post, "/update", request.to_json())
        crcs = []
        for bucket in plan.buckets:
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
            crcs.append(TorchPackBackend().pack([named[s.name] for s in bucket.specs], bucket.offsets, buf, True))
            if flip_byte and bucket.index == len(plan.buckets) - 1:
                buf[bucket.nbytes // 2] ^= 0xFF  # corrupted after the checksum was taken
            self.group.broadcast(buf)
        self.group.broadcast(torch.tensor(crcs, dtype=torch.int64))
        answer.result(60)
        self.server.post("/end", VersionRequest(version).to_json())

    def close(self) -> None:
        self.group.close()
        self.pool.shutdown()


@pytest.fixture(scope="module")
def trainer() -> Iterator[ManualTrainer]:
    with ServerProcess(mixed_dtype_model, (TINY,)) as server:
        t = ManualTrainer(server)
        try:
            yield t
        finally:
            t.close()


def fresh_weights(seed: int) -> dict[str, torch.Tensor]:
    model = mixed_dtype_model(TINY)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
    return model.state_dict()


def transpose_a_matrix(metas: list[BucketMeta]) -> list[BucketMeta]:
    for b, meta in enumerate(metas):
        for i, shape in enumerate(meta.shapes):
            if len(shape) == 2 and shape[0] != shape[1]:
                shapes = list(meta.shapes)
                shapes[i] = shape[::-1]  # same byte count, wrong shape
                return metas[:b] + [replace(meta, shapes=tuple(shapes))] + metas[b + 1 :]
    raise AssertionError("the test model has no non-square matrix")


def rename_first(metas: list[BucketMeta]) -> list[BucketMeta]:
    return [replace(metas[0], names=("no.such.tensor",) + metas[0].names[1:])] + metas[1:]


@pytest.mark.parametrize(
    "bad, reason",
    [
        ({"flip_byte": True}, "checksum mismatch"),
        ({"edit_meta": transpose_a_matrix}, "expected"),
        ({"edit_meta": rename_first}, "unknown tensor 'no.such.tensor'"),
    ],
    ids=["corrupt-bytes", "wrong-shape", "unknown-name"],
)
def test_bad_version_is_rejected_and_old_weights_keep_serving(trainer, bad, reason):
    server = trainer.server
    version = server.get("/version")["version"] + 1
    trainer.send(fresh_weights(version), version)  # a good version first
    good = server.get("/weights/digest")
    tokens = server.post("/generate", {"prompt": [5, 6, 7], "max_new_tokens": 6})
    assert good["version"] == tokens["weight_version"] == version

    with pytest.raises(urllib.error.HTTPError) as err:
        trainer.send(fresh_weights(version + 1), version + 1, **bad)
    assert err.value.code == 409
    assert reason in err.value.read().decode()

    assert server.get("/weights/digest") == good, "a rejected version must leave the old weights intact"
    again = server.post("/generate", {"prompt": [5, 6, 7], "max_new_tokens": 6})
    assert again == tokens, "the server still serves the old version"


def test_stale_version_is_rejected(trainer):
    server = trainer.server
    version = server.get("/version")["version"] + 1
    trainer.send(fresh_weights(version), version)
    before = server.get("/weights/digest")
    with pytest.raises(urllib.error.HTTPError) as err:
        trainer.send(fresh_weights(99), version)  # same version again: not newer
    assert err.value.code == 409 and "not newer" in err.value.read().decode()
    assert server.get("/weights/digest") == before
