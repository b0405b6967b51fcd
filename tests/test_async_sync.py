"""The asynchronous runtime: wait-free publish, no torn versions, supersession, monotonic versions, drain."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator

import pytest
import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.metrics import Footprint
from asyncsync.testing import Faults, ServerProcess, mixed_dtype_model, running

from conftest import TINY
from helpers import Watcher, digest



def train_step(model: torch.nn.Module, g: torch.Generator) -> None:
    """Stands in for optimizer.step(): changes every parameter and buffer in place."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_((torch.randn(p.shape, generator=g) * 0.01).to(p.dtype))
        model.token_counts += 1


@pytest.fixture(scope="module")
def slow_servers() -> Iterator[list[ServerProcess]]:
    """Two servers that sleep up to 50 ms before each swap-in, so versions pile up and supersede."""
    with running([ServerProcess(mixed_dtype_model, (TINY,), faults=Faults(apply_delay_s=0.05)) for _ in range(2)]) as servers:
        yield servers


def async_config(servers: list[ServerProcess]) -> WeightSyncConfig:
    return WeightSyncConfig.from_dict(
        {"async_weight_update": True, "servers": [s.url for s in servers], "bucket_bytes": "16KiB"}
    )


def run_training(sync: WeightSync, model: torch.nn.Module, steps: int, seed: int, pause_s: float) -> dict[int, dict[str, str]]:
    """The DESIGN.md loop; returns the digest of the weights at every publish."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    published = {}
    for version in range(1, steps + 1):
        sync.wait_snapshot()
        train_step(model, g)
        published[version] = digest(model)
        sync.publish(model, version)
        # Right after publish the trainer goes on: the next step changes the weights again.
        threading.Event().wait(rng.uniform(0, pause_s))
    return published


def check_run(sync: WeightSync, servers: list[ServerProcess], published: dict[int, dict[str, str]],
              watcher: Watcher) -> None:
    last = max(published)
    metrics = sync.metrics.as_dict()
    sent = [r.version for r in sync.metrics.history]
    assert metrics["failed"] == 0 and sync.errors == []
    assert metrics["published"] == len(published)
    assert metrics["published"] == metrics["sent"] + metrics["superseded"]
    assert sent == sorted(sent) and len(set(sent)) == len(sent), "versions are sent in order, once"
    assert sent[-1] == last, "close() drained the last version"
    for server in servers:
        applied = [v for v in server.get("/version")["applied"] if v in published]  # this run's versions
        assert applied == sent, "a server applies exactly the versions sent, in order"
        assert server.get("/weights/digest") == {"version": last, "digest": published[last]}
        seen = [v for v, _ in watcher.samples[server.url]]
        assert seen == sorted(seen), "a server's version never goes backwards"
        for version, weights in watcher.samples[server.url]:
            if version in published:  # not a version left by an earlier test
                assert version in sent, f"superseded version {version} was applied"
                assert weights == published[version], f"version {version} is torn or differs from the publish"


def test_async_versions_are_whole_monotonic_and_drained(slow_servers):
    model = mixed_dtype_model(TINY)
    sync = WeightSync(async_config(slow_servers))
    try:
        sync.connect(model)
        with Watcher(slow_servers) as watcher:
            published = run_training(sync, model, steps=25, seed=1, pause_s=0.01)
            sync.close()
        check_run(sync, slow_servers, published, watcher)
        assert sync.metrics.superseded > 0, "servers slower than the trainer must make versions supersede"
    finally:
        sync.close()


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_stress_random_delays(slow_servers, seed):
    """Random pauses in the trainer and random sleeps in the servers' apply, repeated."""
    model = mixed_dtype_model(TINY)
    with torch.no_grad():
        model.token_counts.fill_(seed * 1000)
    start = max(s.get("/version")["version"] for s in slow_servers)
    sync = WeightSync(async_config(slow_servers))
    try:
        sync.connect(model)
        with Watcher(slow_servers) as watcher:
            # Versions keep increasing across runs against the same servers.
            rng = random.Random(seed)
            g = torch.Generator().manual_seed(seed)
            published = {}
            for version in range(start + 1, start + 16):
                sync.wait_snapshot()
                train_step(model, g)
                published[version] = digest(model)
                sync.publish(model, version)
                threading.Event().wait(rng.uniform(0, 0.08))
            sync.close()
        check_run(sync, slow_servers, published, watcher)
    finally:
        sync.close()


def test_publish_returns_before_servers_apply(slow_servers):
    model = mixed_dtype_model(TINY)
    start = max(s.get("/version")["version"] for s in slow_servers)
    with WeightSync(async_config(slow_servers)) as sync:
        sync.connect(model)
        sync.publish(model, start + 1)
        # publish is O(1): the worker has at most begun; nothing can have been applied yet
        # because every server sleeps before its swap-in.
        assert sync.metrics.sent == 0
        with pytest.raises(ValueError, match="not newer"):
            sync.publish(model, start + 1)
        assert sync.wait_for_fresh_servers(start + 1 + sync.config.max_staleness, timeout=60)
        assert all(v >= start + 1 for v in sync.server_versions.values())
    assert sync.metrics.sent == 1


def test_staleness_helpers():
    cfg = WeightSyncConfig.from_dict({"servers": ["http://127.0.0.1:1"], "max_staleness": 2})
    sync = WeightSync(cfg)
    rollouts = [{"v": v} for v in (3, 5, 6, 8)]
    kept, dropped = sync.filter_fresh(rollouts, lambda r: r["v"], trainer_version=8)
    assert [r["v"] for r in kept] == [6, 8] and dropped == 2
    assert sync.is_fresh(6, 8) and not sync.is_fresh(5, 8)


def test_metrics_dict_and_prometheus(two_servers):
    model = mixed_dtype_model(TINY)
    start = max(s.get("/version")["version"] for s in two_servers)
    cfg = WeightSyncConfig.from_dict({"async_weight_update": True, "servers": [s.url for s in two_servers]})
    with WeightSync(cfg) as sync:
        sync.connect(model)
        sync.publish(model, start + 1)
    m = sync.metrics.as_dict()
    assert m["sent"] == 1 and m["last"]["version"] == start + 1
    assert m["last"]["nbytes"] == sum(t.nbytes for t in model.state_dict().values())
    for phase in ("snapshot_s", "wire_s", "apply_s", "total_s", "gbps"):
        assert m["last"][phase] > 0
    text = sync.prometheus_text()
    assert 'asyncsync_versions_total{outcome="sent"} 1.0' in text
    assert "asyncsync_sync_phase_seconds_bucket" in text


def test_a_layout_every_server_refuses_is_an_error_and_nobody_waits_for_it(slow_servers, monkeypatch):
    """Servers that cannot judge the plan at connect (as SGLang cannot) refuse each version for its
    layout: that repeats at every version, so it lands in ``errors`` (not only in events), and
    ``wait_for_fresh_servers`` without a timeout returns False at once instead of waiting forever."""
    import time

    from asyncsync.engines.base import EngineClient
    from asyncsync.engines.reference import ReferenceEngine

    monkeypatch.setattr(ReferenceEngine, "check_layout", EngineClient.check_layout)  # cannot tell
    model = mixed_dtype_model(TINY)
    extra = {**model.state_dict(), "no.such.weight": torch.zeros(4)}
    start = max(s.get("/version")["version"] for s in slow_servers)
    sync = WeightSync(async_config(slow_servers))
    try:
        sync.connect(extra)
        for version in (start + 1, start + 2):
            sync.wait_snapshot()
            sync.publish(extra, version)
        t0 = time.monotonic()
        assert sync.wait_for_fresh_servers(start + 2, timeout=None) is False
        assert time.monotonic() - t0 < 30
    finally:
        sync.close()
    assert sync.errors and all("refused by every server for its layout" in e for e in sync.errors), sync.errors
    assert "1 tensor(s) sent that it does not load, e.g. 'no.such.weight'" in sync.errors[-1]
    assert {s.get("/version")["version"] for s in slow_servers} == {start}, "nothing was applied"


class GatedBuffers:
    """A snapshot whose packing waits for ``packing``: the test decides when a copy ends."""

    footprint = Footprint()

    def __init__(self, packing: threading.Event):
        self.packing, self.entered = packing, threading.Event()

    def pack_all(self, named: object, version: int) -> None:
        self.entered.set()
        assert self.packing.wait(10)

    def packed(self) -> None:
        return None


def test_a_boundary_met_while_a_version_is_being_taken_does_not_skip_the_next_one():
    """The trainer reaches its boundary while the snapshotter is already copying version 1: that
    boundary decides version 1 only. Version 2, published after it, is drained by close() and sent;
    it used to be skipped as soon as it was published (the boundary was a flag left set)."""
    from asyncsync.metrics import SyncMetrics, SyncResult
    from asyncsync.protocol.device import HostRuntime
    from asyncsync.protocol.specs import BucketPlan
    from asyncsync.ranks import TrainerRanks
    from asyncsync.trainer.source import WeightsReader
    from asyncsync.trainer.streams import StreamSet
    from asyncsync.trainer.worker import SyncWorker

    packing, sending, sender_in = threading.Event(), threading.Event(), threading.Event()
    sent: list[int] = []

    def send(version: int, source: object, result: SyncResult) -> SyncResult:
        sender_in.set()
        assert sending.wait(10)
        sent.append(version)
        result.server_versions = {"stand-in": version}
        return result

    model = torch.nn.Linear(2, 2)
    reader = WeightsReader()
    plan = BucketPlan.from_tensors(reader.read(model).tensors().items(), 1024)
    buffers = GatedBuffers(packing)
    metrics = SyncMetrics()
    worker = SyncWorker([send], plan, lambda: buffers, StreamSet(HostRuntime()), metrics, TrainerRanks(),
                        served=lambda v: v)
    try:
        worker.publish(reader.read(model), 1)
        assert buffers.entered.wait(10), "the snapshotter takes version 1"
        boundary = threading.Thread(target=worker.wait_snapshot)  # the trainer's next step begins
        boundary.start()
        boundary.join(0.2)
        assert boundary.is_alive(), "the boundary waits for version 1's copy"
        packing.set()
        boundary.join(10)
        assert sender_in.wait(10), "version 1 is being sent: the only snapshot is busy"
        worker.publish(reader.read(model), 2)
        threading.Event().wait(0.2)  # time for a wrongly woken snapshotter to skip version 2
        assert metrics.as_dict()["superseded"] == 0
        sending.set()
    finally:
        packing.set()
        sending.set()
        worker.close()
        reader.close()
    assert sent == [1, 2], "close() drained the last version"
