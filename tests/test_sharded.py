"""Sharded trainers: every rank of a 2-rank FSDP2 trainer (gloo, CPU, spawned) publishes; the servers
get byte for byte the tensors of the same model unsharded; each rank's memory stays within its bound;
a rank that dies mid-sync ends in a clear error on the other, with the servers on their last version.

The ranks run tests/sharded_ranks.py; every check against the servers runs on rank 0 there."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
from collections.abc import Iterator
from typing import Any

import pytest

from asyncsync.protocol.group import free_port
from asyncsync.testing import ServerProcess, running

import sharded_ranks
from sharded_ranks import moe_config

WORLD = 2


@pytest.fixture(scope="module")
def moe_servers() -> Iterator[list[ServerProcess]]:
    from asyncsync.models import build_model

    with running([ServerProcess(build_model, (moe_config(),)) for _ in range(2)]) as servers:
        yield servers


def run_ranks(urls: list[str], scenarios: list[tuple[str, dict[str, Any]]], timeout_s: float = 300) -> list[dict[str, Any]]:
    """Every rank's report (rank order); fails with a rank's traceback. Every rank is joined or killed."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=sharded_ranks.run_rank, args=(r, WORLD, port, urls, scenarios, results), daemon=True)
             for r in range(WORLD)]
    reports: dict[int, dict[str, Any]] = {}
    errors: dict[int, str] = {}
    try:
        for p in procs:
            p.start()
        for _ in procs:
            try:
                rank, out, error = results.get(timeout=timeout_s)
            except queue_module.Empty:
                break
            reports[rank] = out
            if error:
                errors[rank] = error
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert not errors, "\n".join(f"rank {r}:\n{e}" for r, e in errors.items())
    return [reports.get(r, {}) for r in range(WORLD)]


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
    reports = run_ranks(urls, scenarios)
    for rank, report in enumerate(reports):
        for label in ("blocking", "async_device", "async_host", "funnel"):
            m = report[label]
            bucket, local = m["bucket_bytes"], m["local_bytes"]
            assert local < m["model_bytes"] * 0.75, f"rank {rank} holds most of the model: {local} of {m['model_bytes']}"
            assert m["metrics_bytes"] == m["buffer_bytes"], "the metrics report what was allocated"
            if label == "async_device":
                assert m["buffer_bytes"] <= local + 2 * bucket, (rank, label, m)
            else:
                assert m["buffer_bytes"] <= 2 * bucket, (rank, label, m)
            if label == "async_host":
                assert 0 < m["host_buffer_bytes"] <= local, (rank, label, m)
            else:
                assert m["host_buffer_bytes"] == 0, (rank, label, m)


@pytest.mark.parametrize("async_mode", [False, True], ids=["blocking", "async"])
def test_a_rank_that_dies_mid_sync_ends_in_a_clear_error_and_servers_keep_the_last_version(async_mode):
    from asyncsync.models import build_model

    with running([ServerProcess(build_model, (moe_config(),)) for _ in range(2)]) as servers:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        port = free_port()
        urls = [s.url for s in servers]
        scenarios = [("rank_exits", dict(version=1, async_mode=async_mode))]
        procs = [ctx.Process(target=sharded_ranks.run_rank, args=(r, WORLD, port, urls, scenarios, results), daemon=True)
                 for r in range(WORLD)]
        try:
            for p in procs:
                p.start()
            rank, out, error = results.get(timeout=300)
            assert rank == 0 and error is None, error
            procs[1].join(30)
            assert procs[1].exitcode == 3, "rank 1 exited half-way through the version"
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()
        report = out["rank_exits"]
        assert "trainer rank 0" in report["error"] and "a rank died or hung" in report["error"], report
        assert report["took_s"] < 60, report
        for server in servers:
            assert server.get("/health") is not None, "the server still serves"
