"""A failed epoch and close() leave nothing behind, without help from the garbage collector.

With automatic collection disabled, anything kept alive by a reference cycle (an exception whose
traceback holds the failed group, say) stays alive, so counting what the process holds shows it:
sockets (/proc/self/fd), OS threads (/proc/self/task: gloo's workers and stores) and asyncsync's
data-plane groups still holding a process group (gc.get_objects lists uncollected cycles too).
The baseline is taken after one connect/close cycle: torch's TCPStore starts a process-wide libuv
thread pool on first use and keeps it, which is not a leak of any sync.
"""

from __future__ import annotations

import gc
import os
import time
from dataclasses import dataclass

import pytest

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync.models import build_model
from asyncsync.protocol.group import DataPlaneGroup
from asyncsync.testing import ServerProcess

from conftest import TINY


@dataclass(frozen=True)
class Held:
    sockets: int
    threads: int
    groups: int


def _is_socket(fd: str) -> bool:
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except FileNotFoundError:  # closed since the listing
        return False


def held() -> Held:
    sockets = sum(_is_socket(fd) for fd in os.listdir("/proc/self/fd"))
    groups = sum(1 for o in gc.get_objects() if type(o) is DataPlaneGroup and o._pg is not None)
    return Held(sockets, len(os.listdir("/proc/self/task")), groups)


def settled(condition, timeout_s: float = 10.0) -> Held:  # type: ignore[no-untyped-def]
    """Threads and sockets wind down asynchronously (a store's thread, a closing socket): poll briefly."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = held()
        if condition(now) or time.monotonic() > deadline:
            return now
        time.sleep(0.1)


@pytest.mark.slow
def test_a_failed_epoch_and_close_release_every_socket_thread_and_group():
    servers = [ServerProcess(build_model, (TINY,)).start() for _ in range(2)]
    cfg = WeightSyncConfig.from_dict({
        "servers": [s.url for s in servers], "bucket_bytes": "16KiB", "readmit_interval_s": 60,
        "transport": "collective",  # counts the data plane's sockets, threads and groups
        "deadlines": {"collective_s": 10, "http_s": 10, "rendezvous_s": 10},
    })
    model = build_model(TINY)
    with WeightSync(cfg) as warm_up:  # starts the process-wide pools torch keeps
        warm_up.connect(model)
    gc.collect()
    gc.disable()
    try:
        baseline = settled(lambda h: False, timeout_s=1.0)
        sync = WeightSync(cfg)
        sync.connect(model)
        assert sync.publish(model, 1).server_versions == {s.url: 1 for s in servers}
        connected = held()
        assert connected.groups == 1

        servers[1].process.kill()
        servers[1].process.join(10)
        result = sync.publish(model, 2)  # the broadcast breaks: the version fails for every member
        assert servers[1].url in result.failures
        assert [e.server for e in sync.events if e.kind == "evicted"] == [servers[1].url]
        assert sync.publish(model, 3).server_versions == {servers[0].url: 3}, "the survivor takes the next one"
        after = settled(lambda h: h.threads <= connected.threads and h.sockets <= connected.sockets)
        assert after.groups == 1, "the failed epoch's group is gone; only the new epoch's remains"
        assert after.threads <= connected.threads, f"threads: {after.threads} after the failed epoch, {connected.threads} before"
        assert after.sockets <= connected.sockets, f"sockets: {after.sockets} after the failed epoch, {connected.sockets} before"

        sync.close()
        closed = settled(lambda h: h == baseline)
        assert closed == baseline, f"after close(): {closed}, before connect(): {baseline}"
    finally:
        gc.enable()
        for s in servers:
            s.stop()
