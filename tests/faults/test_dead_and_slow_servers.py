"""Dead and slow servers: the trainer's loop never stops, the others keep up, the dead one rejoins."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.testing import Faults, ServerProcess, mixed_dtype_model

from conftest import TINY
from helpers import digest



def step(model: torch.nn.Module, version: int) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.full_like(p, 1e-3 * (1 + version % 5)))


def config(servers: list[ServerProcess], **extra) -> WeightSyncConfig:
    return WeightSyncConfig.from_dict({
        "async_weight_update": True, "servers": [s.url for s in servers], "bucket_bytes": "16KiB",
        "transport": "collective",  # the data plane's faults (tests/test_shm.py has shared memory's)
        "readmit_interval_s": 0.5, "deadlines": {"rendezvous_s": 10, "collective_s": 5, "http_s": 10}, **extra,
    })


@pytest.mark.slow
def test_kill_9_mid_sync_then_restart_rejoins():
    servers = [ServerProcess(mixed_dtype_model, (TINY,), faults=Faults(apply_delay_s=0.02)) for _ in range(3)]
    restarted: ServerProcess | None = None
    try:
        for s in servers:
            s.start()
        model = mixed_dtype_model(TINY)
        sync = WeightSync(config(servers))
        sync.connect(model)
        victim = servers[1]
        published: dict[int, dict[str, str]] = {}
        version = 0

        def publish_one() -> None:
            nonlocal version
            version += 1
            time.sleep(0.02)
            sync.wait_snapshot()
            step(model, version)
            published[version] = digest(model)
            sync.publish(model, version)  # never raises and never waits for a server

        for _ in range(12):
            publish_one()
        victim.process.kill()  # SIGKILL while syncs are streaming
        # The trainer keeps stepping. The sync under way notices when a call to the dead server fails
        # or, when gloo is left waiting on it, at the collective deadline (5 s here).
        for _ in range(1500):  # bounded: about 30 s of steps
            publish_one()
            if victim.url in {e.server for e in sync.events if e.kind == "evicted"}:
                break
        assert victim.url in {e.server for e in sync.events if e.kind == "evicted"}
        assert {e.server for e in sync.events if e.kind == "evicted"} == {victim.url}, "only the dead server goes"

        restarted = ServerProcess(mixed_dtype_model, (TINY,), port=victim.port).start()
        for _ in range(400):  # bounded: until the restarted server serves the newest version
            publish_one()
            if restarted.get("/version")["version"] == version - 1:
                break
        sync.close()
        assert ("rejoined", victim.url) in {(e.kind, e.server) for e in sync.events}
        for s in (servers[0], servers[2], restarted):
            got = s.get("/weights/digest")
            assert got["version"] == version, f"{s.url} is at {got['version']}, not {version}"
            assert got["digest"] == published[version]
            applied = s.get("/version")["applied"]
            assert applied == sorted(applied), "versions only go forward"
    finally:
        for s in servers + ([restarted] if restarted else []):
            s.stop()


@pytest.mark.slow
def test_slow_server_never_applies_an_older_version_after_a_newer_one():
    servers = [ServerProcess(mixed_dtype_model, (TINY,), faults=Faults(apply_delay_s=d)) for d in (0.0, 0.3)]
    try:
        for s in servers:
            s.start()
        model = mixed_dtype_model(TINY)
        seen: dict[str, list[int]] = {s.url: [] for s in servers}
        stop = threading.Event()

        def watch() -> None:
            for _ in range(3000):  # bounded
                if stop.is_set():
                    return
                for s in servers:
                    seen[s.url].append(s.get("/version")["version"])
                stop.wait(0.01)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        with WeightSync(config(servers)) as sync:
            sync.connect(model)
            for version in range(1, 21):
                time.sleep(0.03)
                sync.wait_snapshot()
                step(model, version)
                sync.publish(model, version)
        stop.set()
        watcher.join(30)
        assert sync.metrics.superseded > 0, "a slow server makes versions supersede instead of queueing"
        for s in servers:
            assert seen[s.url] == sorted(seen[s.url]), f"{s.url} went backwards"
            assert s.get("/version")["version"] == 20
            applied = s.get("/version")["applied"]
            assert applied == sorted(applied) and len(set(applied)) == len(applied)
    finally:
        for s in servers:
            s.stop()


@pytest.mark.slow
def test_group_per_server_lets_a_slow_server_lag_without_slowing_the_other():
    fast, slow = (ServerProcess(mixed_dtype_model, (TINY,), faults=Faults(apply_delay_s=d)) for d in (0.0, 0.6))
    try:
        for s in (fast, slow):
            s.start()
        model = mixed_dtype_model(TINY)
        published = {}
        with WeightSync(config([fast, slow], group_per_server=True)) as sync:
            sync.connect(model)
            for version in range(1, 31):
                time.sleep(0.05)
                sync.wait_snapshot()
                step(model, version)
                published[version] = digest(model)
                sync.publish(model, version)
        fast_applied = [v for v in fast.get("/version")["applied"] if v in published]
        slow_applied = [v for v in slow.get("/version")["applied"] if v in published]
        assert len(fast_applied) > len(slow_applied), (fast_applied, slow_applied)
        for applied in (fast_applied, slow_applied):
            assert applied == sorted(applied) and applied[-1] == 30, "each drains to the last version, in order"
        for s in (fast, slow):
            assert s.get("/weights/digest")["digest"] == published[30]
    finally:
        for s in (fast, slow):
            s.stop()
