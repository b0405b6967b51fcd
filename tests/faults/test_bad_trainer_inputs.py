"""Bad input on the trainer side never crashes the trainer: every malformed tensor or version gets a
clear error naming the tensor, every legal one (NaN, Inf, odd strides) is sent bit for bit, and the
servers keep serving their last complete version.

The cases that reach native code run in a child process (``bad_inputs.py``): a crash there fails
the test with the signal that killed it instead of killing pytest.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from asyncsync import WeightSync
from asyncsync.config import WeightSyncConfig
from asyncsync.metrics import SyncResult
from asyncsync.packing.checks import UnpackableTensor
from asyncsync.packing.cuda import CudaPackBackend, LaunchTable
from asyncsync.protocol.specs import Bucket
from asyncsync.protocol.specs import BucketPlan
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.testing import mixed_dtype_model
from asyncsync.trainer.source import ShardedWeightsUnsupported, check_layout
from asyncsync.transport.sources import BucketSource

from bad_inputs import BAD_LAYOUT, BAD_OPS, BAD_TENSORS, LEGAL, RESIZED, dtensor
from conftest import TINY
from helpers import ThreadedServer, Trainer, Wrapped, digest

SCRIPT = Path(__file__).with_name("bad_inputs.py")
REPO = Path(__file__).resolve().parents[2]


def run_child(*args: str, timeout: float) -> dict[str, int]:
    """Run bad_inputs.py; its JSON summary, or a failure that says how the child died."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode < 0:
        pytest.fail(f"the trainer process was killed by {signal.Signals(-out.returncode).name}:\n{out.stderr[-6000:]}")
    assert out.returncode == 0, out.stderr[-6000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_pack_entry_points_refuse_every_bad_tensor_and_pack_every_legal_one():
    """The C++ op, CppPackBackend, the CUDA launcher's validation and the packing layer, each handed
    every kind of malformed and legal tensor (hypothesis draws dtypes, shapes and bucket mates)."""
    summary = run_child("ops", "--examples", "8", timeout=300)
    for kind in LEGAL:
        assert summary.get(f"{kind}: packed", 0) > 0 and summary.get(f"{kind}: table", 0) > 0, summary
    for kind in BAD_OPS:
        assert any(k.startswith(f"{kind}: ") for k in summary), f"{kind} never ran: {summary}"
    assert not [k for k in summary if k.endswith(": RuntimeError")], summary


def test_weight_sync_refuses_malformed_versions_and_servers_keep_the_last_complete_one():
    with ThreadedServer(ReferenceServer(mixed_dtype_model(TINY))) as a, \
            ThreadedServer(ReferenceServer(mixed_dtype_model(TINY))) as b:
        summary = run_child("sync", a.url, b.url, "--examples", "2", timeout=600)
        for kind in LEGAL:
            assert summary[f"{kind}: synced"] > 0, summary
        for kind in BAD_TENSORS + BAD_LAYOUT:
            assert summary[f"{kind}: errors"] > 0 and any(k.startswith(f"{kind}: ") and "errors" not in k
                                                           for k in summary), (kind, summary)
        for kind in RESIZED:
            assert summary[f"{kind} after publish: errors"] > 0, summary
        assert summary["publish(the connected module, sharded afterwards): ShardedWeightsUnsupported"] == 2
        last = summary["last complete version"]
        for server in (a, b):
            version, _ = server.server.receiver.digest()
            assert version == last
            assert server.server.owners.owner is None, "the trainer's close() released the server"
        assert a.server.receiver.digest() == b.server.receiver.digest()


def sharded_linear() -> torch.nn.Module:
    layer = torch.nn.Linear(4, 4)
    layer.weight = torch.nn.Parameter(dtensor(layer.weight.detach()))  # what fully_shard leaves behind
    return layer


def meta_linear() -> torch.nn.Module:
    with torch.device("meta"):
        return torch.nn.Linear(4, 4)


@pytest.mark.parametrize(("make", "error", "message"), [
    (sharded_linear, ShardedWeightsUnsupported, r"'weight' is a DTensor .* runs in one process.* call connect\(\), publish\(\)"),
    (meta_linear, UnpackableTensor, r"tensor 'weight' is a meta tensor"),
    (lambda: {"w": torch.ones(2), "b": "0.5"}, UnpackableTensor, r"tensor 'b' is a str, not a tensor"),
], ids=["dtensor", "meta", "not-a-tensor"])
async def test_connect_refuses_weights_that_cannot_be_sent_before_any_server_is_contacted(
        recording_server, make, error, message):
    sync = WeightSync(WeightSyncConfig.from_dict({"servers": [recording_server.url]}))
    with pytest.raises(error, match=message):
        sync.connect(make())
    assert recording_server.calls == [], "weights that cannot be sent must fail connect() before any server hears of them"


def test_a_tensor_on_another_device_than_at_connect_is_refused_before_packing():
    """Only CPU and meta exist here: the layout check alone, as it sees a tensor that moved."""
    plan = BucketPlan.from_tensors([("w", torch.ones(2)), ("b", torch.ones(1))])
    check_layout(plan, {"w": torch.ones(2), "b": torch.ones(1)}, torch.device("cpu"))
    with pytest.raises(UnpackableTensor, match="tensor 'b' is on meta, but the weights were on cpu at connect"):
        check_layout(plan, {"w": torch.ones(2), "b": torch.ones(1, device="meta")}, torch.device("cpu"))


def test_cuda_launcher_validates_before_the_kernel_sees_anything():
    """No GPU here: the CUDA backend runs with its device type set to CPU and its launch mocked."""
    backend = object.__new__(CudaPackBackend)
    backend.device_type = "cpu"
    backend._launch = mock.Mock(return_value=None)
    out = torch.zeros(64, dtype=torch.uint8)
    freed = torch.ones(4)
    freed.untyped_storage().resize_(0)
    for tensors, offsets, message in [
        ([torch.ones(4), torch.empty(4, device="meta")], [0, 16], "tensor '1' is a meta tensor"),
        ([freed], [0], "tensor '0' reads 16 bytes of a storage that holds 0"),
        ([torch.ones(4)], [60], "tensor 0 needs 16 bytes at offset 60 but out has only 64"),
        ([torch.ones(4), torch.ones(4)], [0, 8], "tensor 1 at offset 8 overlaps"),
        ([out[:8]], [16], "tensor 0 shares memory with out"),
        ([torch.ones(4)], [-4], "offset -4 of tensor 0 is negative"),
        ([torch.ones(4)], [0, 4], "1 tensors but 2 offsets"),
    ]:
        with pytest.raises((ValueError, TypeError), match=message):
            backend.pack(tensors, offsets, out, True)
    with pytest.raises(ValueError, match="out must be a contiguous 1-D uint8 cpu tensor"):
        backend.pack([torch.ones(4)], [0], torch.zeros(64, dtype=torch.uint8)[::2], True)
    backend._launch.assert_not_called()

    src = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # non-contiguous: launched from a copy
    backend.pack([src, torch.ones(2, dtype=torch.int16)], [8, 0], out, True)
    (table, launched_out, checksum), _ = backend._launch.call_args
    assert isinstance(table, LaunchTable) and launched_out is out and checksum is True
    assert [(off, size, i) for off, size, _, i in table.rows] == [(0, 4, 1), (8, 48, 0)] and table.end == 56
    assert torch.equal(table.sources[0], src.contiguous()) and table.rows[1][2] == table.sources[0].data_ptr()


class FailsAtBucket(Wrapped):
    """A bucket source that cannot pack bucket ``index`` (a tensor freed by another thread meanwhile)."""

    def __init__(self, inner: BucketSource, index: int):
        super().__init__(inner)
        self.index = index

    def bucket(self, bucket: Bucket) -> torch.Tensor:
        if bucket.index == self.index:
            raise UnpackableTensor(f"tensor 'x' of bucket {bucket.index} was freed")
        return self.inner.bucket(bucket)


def test_a_version_that_cannot_be_packed_half_way_is_abandoned_and_the_next_one_syncs():
    """Buckets 0 and 1 are on the wire when bucket 2 fails: the trainer raises the packing error
    within the collective deadline (3 s here; gloo receivers with receives already posted notice a
    closed group only then), no server applies anything, none is blamed, and the next version syncs."""
    with ThreadedServer(ReferenceServer(mixed_dtype_model(TINY))) as a, \
            ThreadedServer(ReferenceServer(mixed_dtype_model(TINY))) as b:
        cfg = WeightSyncConfig.from_dict({"servers": [a.url, b.url], "bucket_bytes": "16KiB",
                                          "deadlines": {"collective_s": 3, "rendezvous_s": 20, "http_s": 20}})
        trainer = Trainer(cfg)
        try:
            named = dict(mixed_dtype_model(TINY).state_dict())
            assert trainer.publish(named, 1) == {a.url: 1, b.url: 1}
            before = a.server.receiver.digest()
            started = time.monotonic()
            with pytest.raises(UnpackableTensor, match="tensor 'x' of bucket 2 was freed"):
                trainer.send(named, 2, wrap=lambda source: FailsAtBucket(source, 2))
            assert time.monotonic() - started < 3 + 10
            assert a.server.receiver.digest() == b.server.receiver.digest() == before
            assert not trainer.metrics.events, "abandoning a version is the trainer's doing, not a server's"
            named = {n: t + 1 if t.is_floating_point() else t for n, t in named.items()}
            result: SyncResult = trainer.send(named, 3)
            assert result.server_versions == {a.url: 3, b.url: 3}
            assert a.server.receiver.digest() == b.server.receiver.digest() == (3, digest(named))
        finally:
            trainer.close()
