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
    server serves the bytes of the same model unsharded (checked on rank 0 against ``full_tensor()``).
    The first two also run ``verify: logprobs``: every rank scores the probe with its own forward (FSDP2
    needs them all), rank 0 compares, and every server computes what the trainer holds."""
    urls = [s.url for s in moe_servers]
    scenarios = [
        ("train", dict(label="blocking", first=1, versions=3, async_weight_update=False, verify="logprobs",
                       verify_every=1)),
        ("train", dict(label="async_device", first=4, versions=3, async_weight_update=True, verify="logprobs",
                       verify_every=2)),
        ("train", dict(label="async_host", first=7, versions=2, async_weight_update=True, snapshot="host")),
        ("train", dict(label="funnel", first=9, versions=2, async_weight_update=False, funnel=True)),
        ("mesh_2d", dict(version=11)),
    ]
    outcomes = reports(run_ranks(urls, scenarios))
    for label in ("blocking", "async_device"):  # verify: logprobs on the ranks' own forward, silent (no errors)
        checks = outcomes[0][label]["checks"]
        assert set(checks) == set(urls) and max(checks.values()) < 1e-4, checks
        assert outcomes[1][label]["checks"] == {}, "only rank 0 asks the servers"
    for rank, report in enumerate(outcomes):
        for label in ("blocking", "async_device", "async_host", "funnel"):
            m = report[label]
            bucket, local = m["bucket_bytes"], m["local_bytes"]
            assert local < m["model_bytes"] * 0.75, f"rank {rank} holds most of the model: {local} of {m['model_bytes']}"
            assert m["metrics_bytes"] == m["buffer_bytes"], "the metrics report what was allocated"
            assert m["converted"], "the fused experts are sent in the checkpoint layout"
            buckets = 3 * bucket  # the owner's scratch and slot, and the bucket converted from the slot
            # delta: auto keeps the buckets a rank owns as the baseline; not with a host snapshot (it
            # would be on the device), nor where every bucket goes through rank 0 (the whole model there)
            baseline = m["baseline_bytes"]
            assert (baseline == 0) == (label in ("async_host", "funnel")), (rank, label, m)
            assert baseline <= m["model_bytes"] * 0.75, f"rank {rank}'s baseline is most of the model: {m}"
            if label == "async_device":
                assert m["buffer_bytes"] <= local + buckets + baseline, (rank, label, m)
            else:
                assert m["buffer_bytes"] <= buckets + baseline, (rank, label, m)
            if label == "async_host":
                assert 0 < m["host_buffer_bytes"] <= local, (rank, label, m)
            else:
                assert m["host_buffer_bytes"] == 0, (rank, label, m)


@pytest.mark.slow
def test_each_owner_sends_deltas_of_its_buckets_and_servers_get_the_unsharded_model_bit_exactly(moe_servers):
    """Sparse updates with ``delta: auto``: every rank encodes the buckets it owns against the last
    version it sent, so after the first version each goes out as deltas, a small fraction of its
    bytes, and the servers still serve exactly the model unsharded (checked at every blocking
    version and after async mode's drain); each rank's baseline is its share of the model."""
    urls = [s.url for s in moe_servers]
    scenarios = [("sparse", dict(label="blocking", first=20, versions=3, async_weight_update=False)),
                 ("sparse", dict(label="async", first=30, versions=4, async_weight_update=True))]
    ranks = reports(run_ranks(urls, scenarios))
    for label in ("blocking", "async"):
        results = ranks[0][label]["results"]
        assert len(results) >= 3, results
        version, base, wire, nbytes = results[0]
        assert base is None and wire == nbytes, "the first version after connect goes whole"
        for (before, *_), (version, base, wire, nbytes) in zip(results, results[1:]):
            assert base == before, f"version {version} was encoded against the version sent before it"
            assert 0 < wire < 0.2 * nbytes, f"version {version} sent {wire} of {nbytes} bytes"
        model = ranks[0][label]["model_bytes"]
        baselines = [r[label]["baseline_bytes"] for r in ranks]
        assert all(0 < b < 0.75 * model for b in baselines) and sum(baselines) == model, baselines


@pytest.mark.slow
def test_an_owner_whose_encode_fails_abandons_the_version_on_every_rank_and_the_next_goes_whole(moe_servers):
    """A rank's delta encode fails after the pieces were exchanged (out of device memory): every
    rank's publish raises, naming it, no server applies any of that version, and the next version
    is sent whole (the failed rank has no baseline) and served bit for bit (``encode_fails``)."""
    urls = [s.url for s in moe_servers]
    first = 40
    ranks = reports(run_ranks(urls, [("encode_fails", dict(first=first))]))
    for rank, report in enumerate(ranks):
        [(version, error)] = report["encode_fails"]["raised"]
        assert version == first + 1 and "CUDA out of memory (injected)" in error, (rank, error)
    assert ranks[0]["encode_fails"]["sent"] == [(first, None), (first + 2, None)]


@pytest.mark.slow
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
