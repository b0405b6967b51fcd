"""Delta versions end to end: a trainer (this process) and two reference servers over the data plane.
Every version each server ends up serving is bit for bit the trainer's, deltas go out only where a
server committed their baseline, and far fewer bytes cross the wire than with ``delta: off``."""

from __future__ import annotations

import pytest
import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.models import generate
from asyncsync.testing import mixed_dtype_model
from asyncsync.trainer.allocate import sync_memory

from conftest import TINY
from helpers import digest

PROMPT = [3, 14, 15, 92, 65]


def nudge(model: torch.nn.Module, step: int, every: int = 97) -> None:
    """An RL-like update: a few elements of every tensor change (one in ``every``), the rest not."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            start = int(torch.randint(0, every, (1,), generator=g))
            flat[start::every] += (torch.randn(flat[start::every].shape, generator=g) * 0.1).to(p.dtype)
        model.token_counts[step % TINY.vocab_size] += 1


def config(servers, **extra: object) -> WeightSyncConfig:
    return WeightSyncConfig.from_dict({"servers": [s.url for s in servers], "bucket_bytes": "16KiB",
                                       "transport": "collective", **extra})


def served(servers) -> list[tuple[int, dict[str, str]]]:
    return [(d["version"], d["digest"]) for d in (s.get("/weights/digest") for s in servers)]


def test_blocking_deltas_are_bit_exact_and_move_a_fraction_of_the_bytes(two_servers):
    model = mixed_dtype_model(TINY)
    start = max(s.get("/version")["version"] for s in two_servers)
    with WeightSync(config(two_servers)) as sync:
        sync.connect(model)
        assert sync.metrics.footprint.baseline == sync.plan.total_bytes  # blocking: one version beside the ring
        results = []
        for version in range(start + 1, start + 6):
            nudge(model, version)
            results.append(sync.publish(model, version))
            assert served(two_servers) == [(version, digest(model))] * 2
            assert all(s.post("/generate", {"prompt": PROMPT, "max_new_tokens": 8})["completions"] ==
                       generate(model, PROMPT, 8) for s in two_servers)
    first, *rest = results
    assert first.delta_base is None and first.wire_bytes == first.nbytes, "nothing to diff against: whole"
    for before, result in zip(results, rest):
        assert result.delta_base == before.version
        assert result.delta_buckets > len(sync.plan.buckets) // 2  # the smallest buckets may go whole
        assert result.wire_bytes < 0.15 * result.nbytes
    assert "asyncsync_delta_baseline_bytes" in sync.prometheus_text()


def test_async_deltas_are_bit_exact_and_off_sends_every_version_whole(two_servers):
    model = mixed_dtype_model(TINY)
    start = max(s.get("/version")["version"] for s in two_servers)
    for mode in ("auto", "off"):
        with WeightSync(config(two_servers, async_weight_update=True, delta=mode)) as sync:
            sync.connect(model)
            assert sync.metrics.footprint.baseline == (sync.footprint.device if mode == "auto" else 0)  # the snapshot itself
            for version in range(start + 1, start + 5):
                sync.wait_snapshot()
                nudge(model, version)
                sync.publish(model, version)
                sync.wait_for_fresh_servers(version + sync.config.max_staleness, timeout=30)
            sync.close()
            assert served(two_servers) == [(start + 4, digest(model))] * 2
            history = list(sync.metrics.history)
        assert [r.version for r in history] == list(range(start + 1, start + 5)), "waited for each version"
        wire = sum(r.wire_bytes for r in history[1:])
        whole = sum(r.nbytes for r in history[1:])
        if mode == "auto":
            assert all(r.delta_base == r.version - 1 for r in history[1:]) and wire < 0.15 * whole
        else:
            assert all(r.delta_base is None for r in history) and wire == whole
        start += 4


def test_a_dense_update_goes_whole_and_blocking_mode_stops_encoding_ahead(two_servers):
    """Every element changes: the encoder gives up on each bucket, the version goes whole, and the
    next versions are packed into the ring just before their broadcasts (one probe every 8)."""
    model = mixed_dtype_model(TINY)
    start = max(s.get("/version")["version"] for s in two_servers)
    with WeightSync(config(two_servers)) as sync:
        sync.connect(model)
        baseline = sync.connection.publisher.baseline
        packed = []
        for version in range(start + 1, start + 12):
            with torch.no_grad():
                for t in model.state_dict().values():
                    t.add_(1 if t.dtype == torch.int64 else 0.25)
            before = baseline.version
            result = sync.publish(model, version)
            packed.append(baseline.version != before)
            assert result.delta_buckets == 0 and result.wire_bytes == result.nbytes
            assert served(two_servers) == [(version, digest(model))] * 2
    # ahead (no baseline yet), ahead (dense: deltas do not pay), the ring for 7, a probe, the ring
    assert packed == [True, True] + [False] * 7 + [True, False]


def test_shared_memory_servers_get_every_version_whole_and_no_baseline_is_kept(two_servers):
    model = mixed_dtype_model(TINY)
    start = max(s.get("/version")["version"] for s in two_servers)
    with WeightSync(config(two_servers, transport="shm")) as sync:
        sync.connect(model)
        assert sync.metrics.footprint.baseline == 0
        for version in range(start + 1, start + 3):
            nudge(model, version)
            result = sync.publish(model, version)
            assert result.delta_base is None and result.wire_bytes == 0
        assert served(two_servers) == [(start + 2, digest(model))] * 2


@pytest.mark.parametrize("delta", ["auto", "off"])
def test_doctor_reports_the_baseline_memory(delta):
    model = mixed_dtype_model(TINY)
    cfg = WeightSyncConfig.from_dict({"servers": ["http://127.0.0.1:1"], "delta": delta})
    memory = sync_memory(cfg, model)
    if delta == "auto":  # async mode's snapshot is a whole version: blocking mode keeps one more for deltas
        assert memory["blocking_delta"]["device"] == memory["blocking"]["device"] + memory["async_device"]["device"]
    else:
        assert "blocking_delta" not in memory


def test_a_delta_request_is_validated_as_it_is_parsed():
    from asyncsync.protocol.specs import BucketPlan
    from asyncsync.protocol.wire import BucketMeta, DeltaVersion, UpdateRequest, WireError

    plan = BucketPlan.from_tensors([("a", torch.zeros(100)), ("b", torch.zeros(10, dtype=torch.bfloat16))], 256)
    buckets = tuple(BucketMeta.of(b) for b in plan.buckets)
    good = UpdateRequest(5, buckets, True, delta=DeltaVersion(4, (100,) + (0,) * (len(buckets) - 1)))
    assert UpdateRequest.from_json(good.to_json()) == good
    bad = [
        ({"checksum": False}, "needs checksum true"),
        ({"delta": {"base": 5, "nbytes": [0] * len(buckets)}}, "not older than the version 5"),
        ({"delta": {"base": 4, "nbytes": [buckets[0].nbytes] + [0] * (len(buckets) - 1)}}, "no smaller as a delta"),
        ({"delta": {"base": 4, "nbytes": [1]}}, r"1 size\(s\) for"),
        ({"delta": {"base": 0, "nbytes": [0] * len(buckets)}}, r"update.delta.base: expected an integer in \[1, "),
        ({"delta": {"base": 4, "nbytes": [-1] + [0] * (len(buckets) - 1)}}, r"update.delta.nbytes: expected an integer in \[0, "),
    ]
    for change, message in bad:
        with pytest.raises(WireError, match=message):
            UpdateRequest.from_json({**good.to_json(), **change})
