"""Delta versions under faults: a corrupted delta, a delta against the wrong base (by version or by bytes),
a server killed and restarted between two deltas, versions superseded in async mode. Each ends with
every server bit-exact with the trainer's weights, and no server ever serves a version partially:
a delta that cannot be rebuilt into the exact bytes is refused whole, and the server gets the next
version whole."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.protocol.specs import distinct_tensors
from asyncsync.receivers.reference.app import Faults, ReferenceServer
from asyncsync.testing import ServerProcess, mixed_dtype_model, running

from conftest import TINY
from helpers import ThreadedServer, Watcher, digest
from staging_faults import CorruptNextDelta


def nudge(model: torch.nn.Module, step: int) -> None:
    """A sparse update: one element in 61 of every parameter."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in model.parameters():
            flat = p.view(-1)
            flat[step % 61 :: 61] += (torch.randn(flat[step % 61 :: 61].shape, generator=g) * 0.1).to(p.dtype)


def config(urls: list[str], **extra: object) -> WeightSyncConfig:
    return WeightSyncConfig.from_dict({"servers": urls, "bucket_bytes": "16KiB", "transport": "collective",
                                       "readmit_interval_s": 0.1, "deadlines": {"collective_s": 10, "http_s": 10},
                                       **extra})


@pytest.fixture(scope="module")
def two_servers() -> Iterator[list[ServerProcess]]:
    with running([ServerProcess(mixed_dtype_model, (TINY,)) for _ in range(2)]) as servers:
        yield servers


def next_version(servers: list[ServerProcess]) -> int:
    """The first version newer than any the servers serve (tests share them, one after another)."""
    return max(s.get("/version")["version"] for s in servers) + 1


def served(urls_or_servers: list) -> list[tuple[int, dict[str, str]]]:
    return [(d["version"], d["digest"]) for d in (s.get("/weights/digest") for s in urls_or_servers)]


def test_a_corrupted_delta_is_refused_whole_and_the_next_version_goes_whole(two_servers, monkeypatch):
    corrupt = CorruptNextDelta(monkeypatch)
    model = mixed_dtype_model(TINY)
    v = next_version(two_servers)
    with WeightSync(config([s.url for s in two_servers])) as sync:
        sync.connect(model)
        for version in (v, v + 1):
            nudge(model, version)
            assert sync.publish(model, version).delta_base == (None if version == v else v)
        good = digest(model)
        corrupt.armed = True
        nudge(model, v + 2)
        bad = sync.publish(model, v + 2)
        assert bad.delta_base == v + 1 and bad.server_versions == {}
        assert all("checksum mismatch" in f or "does not decode" in f for f in bad.failures.values()), bad.failures
        assert [e.kind for e in sync.events] == ["refused", "refused"]
        assert served(two_servers) == [(v + 1, good)] * 2, "the old version keeps serving, untouched"
        nudge(model, v + 3)
        whole = sync.publish(model, v + 3)
        assert whole.delta_base is None and whole.server_versions == {s.url: v + 3 for s in two_servers}
        assert served(two_servers) == [(v + 3, digest(model))] * 2
        nudge(model, v + 4)
        assert sync.publish(model, v + 4).delta_base == v + 3, "deltas again once every server committed the baseline"
        assert served(two_servers) == [(v + 4, digest(model))] * 2


def test_a_delta_against_a_version_the_server_does_not_hold_is_refused(two_servers, monkeypatch):
    """The trainer is made to believe a server committed a version it refused: the server's own
    check (the committed version it holds) refuses the delta, and the next version goes whole."""
    corrupt = CorruptNextDelta(monkeypatch)
    model = mixed_dtype_model(TINY)
    urls = [s.url for s in two_servers]
    v = next_version(two_servers)
    with WeightSync(config(urls)) as sync:
        sync.connect(model)
        for version in (v, v + 1):
            nudge(model, version)
            sync.publish(model, version)
        corrupt.armed = True
        nudge(model, v + 2)
        assert sync.publish(model, v + 2).server_versions == {}
        for u in urls:  # the lie, told to the book: both servers still hold v + 1
            sync.connection.role.fleets[0].book.took(u, v + 2)
        nudge(model, v + 3)
        wrong = sync.publish(model, v + 3)
        assert wrong.delta_base == v + 2 and wrong.server_versions == {}
        assert all(f"delta against version {v + 2}, but this receiver committed version {v + 1}" in f
                   for f in wrong.failures.values()), wrong.failures
        nudge(model, v + 4)
        assert sync.publish(model, v + 4).delta_base is None
        assert served(two_servers) == [(v + 4, digest(model))] * 2


def test_a_delta_against_other_bytes_of_the_same_version_is_caught_by_the_checksum():
    """A server whose committed bytes changed under it (the same version number, other bytes) rebuilds
    a bucket that does not match the full bucket's CRC32C: refused whole, the next version whole."""
    model, trainer_model = mixed_dtype_model(TINY), mixed_dtype_model(TINY)
    server = ReferenceServer(model)
    with ThreadedServer(server) as threaded, WeightSync(config([threaded.url])) as sync:
        sync.connect(trainer_model)
        for version in (1, 2):
            nudge(trainer_model, version)
            assert sync.publish(trainer_model, version).server_versions == {threaded.url: version}
        assert digest(model) == digest(trainer_model)
        with server.serve_lock, torch.no_grad():  # flip a byte of the committed bytes the live weights alias
            live = distinct_tensors(model.state_dict(keep_vars=True))
            next(t for t in live.values() if t.dtype == torch.float32 and t.numel() > 1000).view(-1)[7] += 1.0
        nudge(trainer_model, 3)
        wrong = sync.publish(trainer_model, 3)
        assert wrong.delta_base == 2 and wrong.server_versions == {}
        assert "checksum mismatch" in wrong.failures[threaded.url]
        nudge(trainer_model, 4)
        assert sync.publish(trainer_model, 4).delta_base is None
        assert server.receiver.version == 4 and digest(model) == digest(trainer_model)


@pytest.mark.slow
def test_a_server_killed_and_restarted_between_two_deltas_gets_the_next_version_whole():
    model = mixed_dtype_model(TINY)
    first = ServerProcess(mixed_dtype_model, (TINY,)).start()
    second = ServerProcess(mixed_dtype_model, (TINY,)).start()
    restarted = None
    try:
        with WeightSync(config([first.url, second.url])) as sync:
            sync.connect(model)
            for version in (1, 2):
                nudge(model, version)
                sync.publish(model, version)
            assert sync.metrics.last.delta_base == 1
            second.stop()
            restarted = ServerProcess(mixed_dtype_model, (TINY,), port=second.port).start()  # fresh weights, version 0
            outcomes = []
            for version in range(3, 9):
                nudge(model, version)
                result = sync.publish(model, version)
                outcomes.append((result.delta_base, sorted(result.server_versions.values())))
                if result.server_versions == {first.url: version, second.url: version} and result.delta_base:
                    break
                time.sleep(0.2)  # past readmit_interval_s
            assert served([first, restarted]) == [(version, digest(model))] * 2, outcomes
            # the restarted server took a whole version before the group got deltas again
            both = [i for i, (_, got) in enumerate(outcomes) if len(got) == 2]
            assert outcomes[both[0]][0] is None and outcomes[-1][0] == version - 1, outcomes
    finally:
        for s in (first, second, restarted):
            if s is not None:
                s.stop()


@pytest.mark.slow
def test_superseded_async_versions_leave_every_server_bit_exact_and_never_torn():
    """Servers slow to switch: versions pile up and are superseded; each delta is against the
    version the servers committed last, and every sampled (version, weights) pair is whole."""
    model = mixed_dtype_model(TINY)
    published: dict[int, dict[str, str]] = {}
    slow = Faults(apply_delay_s=0.15)
    with running([ServerProcess(mixed_dtype_model, (TINY,), faults=slow) for _ in range(2)]) as servers:
        with Watcher(servers) as watcher, WeightSync(config([s.url for s in servers], async_weight_update=True)) as sync:
            sync.connect(model)
            for version in range(1, 17):
                sync.wait_snapshot()
                nudge(model, version)
                published[version] = digest(model)
                sync.publish(model, version)
                time.sleep(0.02)
            sync.close()
        final = served(servers)
    history = list(sync.metrics.history)
    assert sync.metrics.superseded > 0 and sync.errors == []
    assert final == [(16, published[16])] * 2
    torn = {v for samples in watcher.samples.values() for v, d in samples if v in published and d != published[v]}
    assert torn == set()
    sent = [r.version for r in history]
    deltas = [r for r in history if r.delta_base is not None]
    assert deltas, "some versions went out as deltas"
    assert all(r.delta_base == sent[sent.index(r.version) - 1] for r in deltas), \
        "a delta is always against the version sent (and committed) just before it"
