"""The async pipeline waits for every copy it depends on: proven with copies that complete late.

With ``LateStreams`` a snapshot's copy runs 50 ms after the worker queued it. The trainer changes
its parameters right after ``wait_snapshot`` and the sender broadcasts right after ``comm_wait``, so
the versions the servers end up with equal what was published only if both waits are real. Checksums
are off: the waits are the only thing standing between the trainer and torn versions here. The last
two tests take a wait away and check that the harness sees the damage.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.trainer import connect as connect_module
from asyncsync.testing import ServerProcess, mixed_dtype_model

from conftest import TINY
from fakes import LateStreams
from helpers import Watcher, digest


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(mixed_dtype_model, (TINY,)) as started:
        yield started


@pytest.fixture
def late(monkeypatch: pytest.MonkeyPatch) -> Iterator[LateStreams]:
    fake = LateStreams(delay_s=0.05)
    monkeypatch.setattr(connect_module, "StreamSet", lambda runtime: fake)
    yield fake
    fake.close()


def train(server: ServerProcess, steps: int = 12) -> tuple[dict[int, dict[str, str]], list[tuple[int, dict[str, str]]]]:
    """The README loop against ``server``, stepping without pause while a watcher samples what the
    server serves; returns what was published per version and the samples (the last after close)."""
    model = mixed_dtype_model(TINY)
    start = server.get("/version")["version"]
    cfg = WeightSyncConfig.from_dict({"async_weight_update": True, "servers": [server.url], "checksum": False,
                                      "bucket_bytes": "16KiB"})
    published: dict[int, dict[str, str]] = {}
    g = torch.Generator().manual_seed(start)
    with Watcher([server]) as watcher, WeightSync(cfg) as sync:
        sync.connect(model)
        for version in range(start + 1, start + 1 + steps):
            sync.wait_snapshot()
            with torch.no_grad():  # the optimizer step: writes every parameter right away
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g).to(p.dtype))
            published[version] = digest(model)
            sync.publish(model, version)
        sync.close()  # drains: the last version reaches the server
    final = server.get("/weights/digest")
    return published, [*watcher.samples[server.url], (final["version"], final["digest"])]


def torn(published: dict[int, dict[str, str]], samples: list[tuple[int, dict[str, str]]]) -> list[int]:
    """Versions of this run that the server served with other bytes than were published."""
    return sorted({v for v, d in samples if v in published and d != published[v]})


def test_late_copies_are_waited_for(server, late):
    published, served = train(server)
    assert late.copies >= 2, "versions went through the late copy"
    assert torn(published, served) == []
    assert served[-1][0] == max(published)
    assert len({v for v, _ in served if v in published}) >= 2, "the watcher saw several versions of this run"


def test_the_harness_sees_a_sender_that_skips_comm_wait(server, late, monkeypatch):
    monkeypatch.setattr(late, "comm_wait", lambda marker: None)  # HostRuntime.wait_event is the real wait
    published, served = train(server)
    assert torn(published, served), "broadcasting before the copy finished must send the wrong bytes"


def test_the_harness_sees_a_trainer_that_skips_compute_wait(server, late, monkeypatch):
    monkeypatch.setattr(late, "compute_wait", lambda marker: None)
    published, served = train(server)
    assert torn(published, served), "writing parameters before the copy ran must tear the snapshot"
