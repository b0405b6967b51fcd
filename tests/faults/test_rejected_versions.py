"""A server that receives a bad version rejects all of it and keeps serving the old weights."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from asyncsync.config import WeightSyncConfig
from asyncsync.metrics import SyncResult
from asyncsync.protocol.specs import Bucket, BucketPlan
from asyncsync.testing import ServerProcess, mixed_dtype_model
from asyncsync.transport.sources import BucketSource

from conftest import TINY
from helpers import Trainer, Wrapped


class FlipAByte(Wrapped):
    """Wraps the trainer's bucket source: one byte of the last bucket is flipped on its way to the
    wire (in a copy: a bucket of one tensor is sent from the weights themselves), while its checksum
    is that of the original bytes, as a bit flip on the wire would leave it."""

    def __init__(self, inner: BucketSource, last: int):
        super().__init__(inner)
        self.last = last

    def bucket(self, bucket: Bucket) -> torch.Tensor:
        buf = self.inner.bucket(bucket)
        if bucket.index == self.last:
            buf = buf.clone()
            buf[bucket.nbytes // 2] ^= 0xFF
        return buf


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(mixed_dtype_model, (TINY,)) as started:
        yield started


@pytest.fixture
def trainer(server: ServerProcess) -> Iterator[Trainer]:
    t = Trainer(WeightSyncConfig.from_dict({"servers": [server.url], "bucket_bytes": "16KiB"}))
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


def transpose_a_matrix(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same bytes announced with a wrong (transposed) shape."""
    name = next(n for n, t in named.items() if t.dim() == 2 and t.shape[0] != t.shape[1])
    return {**named, name: named[name].reshape(named[name].shape[::-1])}


def rename_first(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    first = next(iter(named))
    return {("no.such.tensor" if n == first else n): t for n, t in named.items()}


def refused(result: SyncResult, url: str, reason: str) -> bool:
    failure = result.failures.get(url, "")
    return "HTTP 409" in failure and reason in failure and url not in result.server_versions


@pytest.mark.parametrize(
    "bad, reason",
    [
        ({"flip_a_byte": True}, "checksum mismatch"),
        ({"edit": transpose_a_matrix}, "1 tensor(s) with another dtype or shape, e.g. "),
        ({"edit": rename_first}, "1 tensor(s) sent that it does not load, e.g. 'no.such.tensor'"),  # before its broadcast
    ],
    ids=["corrupt-bytes", "wrong-shape", "unknown-name"],
)
def test_bad_version_is_rejected_and_old_weights_keep_serving(server, trainer, bad, reason):
    version = server.get("/version")["version"] + 1
    assert trainer.send(fresh_weights(version), version).server_versions == {server.url: version}  # a good version first
    good = server.get("/weights/digest")
    tokens = server.post("/generate", {"prompt": [5, 6, 7], "max_new_tokens": 6})
    assert good["version"] == tokens["weight_version"] == version

    named = bad.get("edit", dict)(fresh_weights(version + 1))
    last = len(BucketPlan.from_tensors(named.items(), trainer.fleet.config.bucket_bytes).buckets) - 1
    wrap = (lambda source: FlipAByte(source, last)) if bad.get("flip_a_byte") else None
    result = trainer.send(named, version + 1, wrap=wrap)
    assert refused(result, server.url, reason), result.failures
    assert [(e.kind, e.server, e.version) for e in trainer.metrics.events] == [("refused", server.url, version + 1)]

    assert server.get("/weights/digest") == good, "a rejected version must leave the old weights intact"
    again = server.post("/generate", {"prompt": [5, 6, 7], "max_new_tokens": 6})
    assert again == tokens, "the server still serves the old version"
    assert trainer.send(fresh_weights(version + 2), version + 2).server_versions == {server.url: version + 2}, \
        "the server stays in the group and takes the next version"


def test_stale_version_is_rejected(server, trainer):
    version = server.get("/version")["version"] + 1
    trainer.send(fresh_weights(version), version)
    before = server.get("/weights/digest")
    result = trainer.send(fresh_weights(99), version)  # same version again: not newer
    assert refused(result, server.url, "not newer"), result.failures
    assert server.get("/weights/digest") == before
