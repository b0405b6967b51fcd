"""The reference server keeps generating while a version arrives: only the swap holds generation.

The trainer's transfer is held between two buckets (the server has received part of the version and
waits for the rest); requests sent meanwhile must be answered, by the old version, as fast as
without a sync. Once the rest arrives the version is swapped in, the server reports how long the swap
held generation, and the next request is served by the new version. (The stall measured under a
steady load, against the switch time: ``python -m benchmarks.stall``.)"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from asyncsync.config import WeightSyncConfig
from asyncsync.metrics import SyncResult
from asyncsync.models import build_model
from asyncsync.testing import ServerProcess
from asyncsync.transport.sources import BucketSource

from conftest import TINY
from helpers import HoldAt, Trainer, call, weights

HOLD_S = 1.5
PROMPT = [3, 14, 15, 92, 65]


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    with ServerProcess(build_model, (TINY,)) as started:
        yield started


def generate(url: str) -> tuple[int, float]:
    """(the version that served one greedy request, its latency)."""
    start = time.monotonic()
    status, body = call(url, "POST", "/generate", {"prompt": PROMPT, "max_new_tokens": 8})
    assert status == 200, body
    return body["weight_version"], time.monotonic() - start


def test_requests_are_served_by_the_old_version_while_the_new_one_arrives(server: ServerProcess):
    trainer = Trainer(WeightSyncConfig.from_dict({"servers": [server.url], "bucket_bytes": "16KiB"}))
    try:
        named = weights(build_model(TINY), seed=1)
        baseline = max(generate(server.url)[1] for _ in range(5))
        holder: dict[str, HoldAt] = {}
        outcome: dict[str, SyncResult] = {}

        def wrap(source: BucketSource) -> BucketSource:
            holder["hold"] = HoldAt(source, index=2)
            return holder["hold"]

        sender = threading.Thread(target=lambda: outcome.setdefault("r", trainer.send(named, 1, wrap=wrap)), daemon=True)
        sender.start()
        try:
            deadline = time.monotonic() + 30
            while "hold" not in holder and time.monotonic() < deadline:
                time.sleep(0.01)
            assert holder["hold"].reached.wait(30), "the transfer never reached the held bucket"
            during: list[tuple[int, float]] = []
            end = time.monotonic() + HOLD_S
            while time.monotonic() < end:
                during.append(generate(server.url))
        finally:
            if "hold" in holder:
                holder["hold"].release.set()
            sender.join(60)
        result = outcome["r"]

        assert len(during) >= 5, f"only {len(during)} request(s) answered in {HOLD_S}s of a held transfer"
        assert {v for v, _ in during} == {0}, "a request answered mid-transfer was served by the arriving version"
        slowest = max(t for _, t in during)
        assert slowest < max(0.5, 10 * baseline), \
            f"a request took {slowest:.3f}s while the version arrived ({baseline:.3f}s without): the receive held generation"
        assert result.server_versions == {server.url: 1}, result.failures
        assert 0 < result.switch_s[server.url] < HOLD_S, f"the swap is timed on its own: {result.switch_s}"
        assert generate(server.url)[0] == 1
    finally:
        trainer.close()
