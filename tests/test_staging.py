"""The reference server's staging choices (``asyncsync serve --staging device|host``).

``device`` keeps two whole versions (the live one, moved into an arena when the server first joins
a group, and the one being received) and swaps them; ``host`` keeps one version in host shared
memory and copies each verified version into the live weights while generation is held. Both are
made and touched at the first join, so versions 1 and 2 are not slowed by page faults. Memory is
read from the operating system (``asyncsync.procmem``): the server's private bytes, and the staging
segment it maps. Device staging's faults are the rest of the suite's (every other test's server
stages on its device); host staging runs them here (``staging_faults``).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import pytest

from asyncsync import WeightSync
from asyncsync.models import build_model
from asyncsync.procmem import process_memory
from asyncsync.testing import ServerProcess

from conftest import TINY
from helpers import digest
from staging_faults import dense_step, run_fault_sequence

# About 40 MB in float32: large enough that the staging stands out of the process's own noise.
MEDIUM = dataclasses.replace(TINY, vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=4,
                             num_heads=8, num_kv_heads=4)
MiB = 2**20


def config(url: str, **extra: object) -> dict[str, object]:
    return {"servers": [url], "bucket_bytes": "1MiB", "transport": "collective", **extra}


def staging_segments(server: ServerProcess) -> dict[str, int]:
    return {k: v for k, v in process_memory(server.process.pid).segments.items() if "asyncsync-staging" in k}


@pytest.mark.parametrize("staging", ["device", pytest.param("host", marks=pytest.mark.slow)])
def test_each_staging_serves_every_version_bit_exact_within_its_memory(staging):
    trainer = build_model(MEDIUM)
    nbytes = sum(t.nbytes for t in trainer.state_dict().values())
    with ServerProcess(build_model, (MEDIUM,), staging=staging) as server:
        before = process_memory(server.process.pid).private
        with WeightSync.from_config(config(server.url)) as sync:
            sync.connect(trainer)
            for version in (1, 2, 3):
                dense_step(trainer, version, scale=0.01)
                result = sync.publish(trainer, version)
                assert result.server_versions == {server.url: version}, result.failures
            switch_s = result.switch_s[server.url]
        grown = process_memory(server.process.pid).private - before  # before /weights/digest's own copies
        segments = staging_segments(server)
        assert server.get("/weights/digest") == {"version": 3, "digest": digest(trainer)}
        assert server.get("/version")["applied"][-3:] == [1, 2, 3]
    if staging == "device":
        # The arena received into, beside the live weights (moved into the other at the join).
        assert segments == {}
        assert 0.9 * nbytes < grown < 1.25 * nbytes + 16 * MiB, f"grew {grown / MiB:.1f} MiB for {nbytes / MiB:.1f}"
    else:
        # One version in the shared segment; the live weights are the model's own, copied into.
        assert list(segments.values()) and abs(list(segments.values())[0] - nbytes) < 64 * 1024, segments
        assert grown < 0.25 * nbytes + 16 * MiB, f"grew {grown / MiB:.1f} MiB privately for {nbytes / MiB:.1f}"
        assert switch_s > 0, "the copy into the live weights is timed as the switch"


@pytest.fixture(scope="module")
def host_staged() -> Iterator[ServerProcess]:
    with ServerProcess(build_model, (TINY,), staging="host") as server:
        yield server


def test_host_staging_serves_the_old_version_or_the_new_one_after_each_fault(host_staged, monkeypatch):
    trainer = build_model(TINY)

    def serves(what: str, version: int) -> None:
        assert host_staged.get("/weights/digest") == {"version": version, "digest": digest(trainer)}, what
        assert host_staged.post("/generate", {"prompt": [5, 6, 7], "max_new_tokens": 4})["weight_version"] == version

    cfg = config(host_staged.url, bucket_bytes="16KiB", readmit_interval_s=0.1)
    run_fault_sequence(cfg, trainer, host_staged.get("/version")["version"], json.dumps(TINY.to_dict()), serves,
                       monkeypatch)
