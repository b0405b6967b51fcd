"""Sharded trainers: every rank of a 2-rank FSDP2 trainer (gloo, CPU, spawned) publishes; the servers
get byte for byte the tensors of the same model unsharded; each rank's memory stays within its bound;
a rank that dies mid-sync ends in a clear error on the other, with the servers on their last version.

The ranks run tests/sharded_ranks.py; every check against the servers runs on rank 0 there."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from asyncsync.testing import ServerProcess, running
from asyncsync.trainer.local_ranks import RankOutcome, run_local_ranks

import sharded_ranks
from sharded_ranks import moe_config

WORLD = 2


@pytest.fixture(scope="module")
def moe_servers() -> Iterator[list[ServerProcess]]:
    from asyncsync.models import build_model

    with running([ServerProcess(build_model, (moe_config(),)) for _ in range(2)]) as servers:
        yield servers


def run_ranks(urls: list[str], scenarios: list[tuple[str, dict[str, Any]]]) -> list[RankOutcome]:
    """Every rank's outcome, in rank order (every rank joined or killed by ``run_local_ranks``)."""
    return run_local_ranks(sharded_ranks.run_scenarios, WORLD, (urls, scenarios), timeout_s=600)


def reports(outcomes: list[RankOutcome]) -> list[dict[str, Any]]:
    """What each rank measured; fails with any rank's traceback."""
    assert all(o.error is None and o.exitcode == 0 for o in outcomes), "\n".join(
        f"rank {o.rank} (exit code {o.exitcode}):\n{o.error}" for o in outcomes)
    return [o.value for o in outcomes]


def test_every_rank_publishes_and_servers_get_the_unsharded_model_bit_exactly(moe_servers):
    """Blocking, async with the snapshot on the device and in host memory, the funnel mode, and a
    mapping of DTensors on a 2-D mesh: over several versions with optimizer steps between, every
    server serves the bytes of the same model unsharded (checked on rank 0 against ``full_tensor()``)."""
    urls = [s.url for s in moe_servers]
    scenarios = [
        ("train", dict(label="blocking", first=1, versions=3, async_weight_update=False)),
        ("train", dict(label="async_device", first=4, versions=3, async_weight_update=True)),
        ("train", dict(label="async_host", first=7, versions=2, async_weight_update=True, snapshot="host")),
        ("train", dict(label="funnel", first=9, versions=2, async_weight_update=False, funnel=True)),
        ("mesh_2d", dict(version=11)),
    ]
    for rank, report in enumerate(reports(run_ranks(urls, scenarios))):
        for label in ("blocking", "async_device", "async_host", "funnel"):
            m = report[label]
            bucket, local = m["bucket_bytes"], m["local_bytes"]
            assert local < m["model_bytes"] * 0.75, f"rank {rank} holds most of the model: {local} of {m['model_bytes']}"
            assert m["metrics_bytes"] == m["buffer_bytes"], "the metrics report what was allocated"
            assert m["converted"], "the fused experts are sent in the checkpoint layout"
            buckets = 3 * bucket  # the owner's scratch and slot, and the bucket converted from the slot
            if label == "async_device":
                assert m["buffer_bytes"] <= local + buckets, (rank, label, m)
            else:
                assert m["buffer_bytes"] <= buckets, (rank, label, m)
            if label == "async_host":
                assert 0 < m["host_buffer_bytes"] <= local, (rank, label, m)
            else:
                assert m["host_buffer_bytes"] == 0, (rank, label, m)


@pytest.mark.parametrize("async_mode", [False, True], ids=["blocking", "async"])
def test_a_rank_that_dies_mid_sync_ends_in_a_clear_error_and_servers_keep_the_last_version(async_mode):
    from asyncsync.models import build_model

    with running([ServerProcess(build_model, (moe_config(),)) for _ in range(2)]) as servers:
        first, second = run_ranks([s.url for s in servers], [("rank_exits", dict(version=1, async_mode=async_mode))])
        assert first.error is None and first.exitcode == 0, first.error
        assert second.exitcode == 3 and second.value is None, "rank 1 exited half-way through the version"
        report = first.value["rank_exits"]
        assert "trainer rank 0" in report["error"] and "a rank died or hung" in report["error"], report
        assert report["took_s"] < 60, report
        for server in servers:
            assert server.get("/health") is not None, "the server still serves"
