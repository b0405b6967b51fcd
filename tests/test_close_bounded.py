"""Leaving a group never waits for it: ``close(broken=True)`` with a receive still pending returns at
once (a vLLM cancel runs in an RPC that holds the engine, and once held it up to the receive's
deadline: 5.8 s of a 6 s one, measured before). A gloo group is torn down on a thread of its own once
its pending receive ended; a stream edge ends the receive at once. Real gloo groups and real sockets,
both ranks in this process."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from asyncsync.protocol.device import HostRuntime
from asyncsync.protocol.group import DataPlaneError, DataPlaneGroup, serve_store
from asyncsync.protocol.keys import new_key
from asyncsync.protocol.stream import StreamEdge
from asyncsync.protocol.wire import GroupSpec

CLOSE_S = 0.5  # what a close may take, with a receive pending
DEADLINE_S = 6.0  # the pending receive's: the close took 5.8 s of it before


def pair(backend: str) -> tuple[object, object, object]:
    """Both ranks of a two-rank group (or stream edge) in a store of the test's own."""
    store = serve_store("127.0.0.1", 0, 10.0)
    spec = GroupSpec("127.0.0.1", store.port, 2, f"close.{backend}", backend, 10.0, key=new_key())
    join = StreamEdge.join if backend == "stream" else DataPlaneGroup.join
    with ThreadPoolExecutor(2) as pool:
        upper = pool.submit(lambda: join(spec, 0, HostRuntime(), store=store) if backend == "gloo" else
                            join(spec, 0, HostRuntime()))
        lower = pool.submit(join, spec, 1, HostRuntime())
        return store, upper.result(30), lower.result(30)


def release_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "asyncsync-group-release"]


@pytest.mark.parametrize("backend", ["gloo", "stream"])
def test_a_broken_close_with_a_receive_pending_returns_at_once(backend):
    store, upper, lower = pair(backend)
    pending = lower.broadcast_async(torch.zeros(1 << 20, dtype=torch.uint8), DEADLINE_S)  # the sender sends nothing
    time.sleep(0.2)
    start = time.monotonic()
    lower.close(broken=True)
    took = time.monotonic() - start
    print(f"{backend}: close with a receive pending returned in {took * 1e3:.2f} ms")
    assert took < CLOSE_S
    if backend == "stream":  # the receive itself ends at once
        with pytest.raises(DataPlaneError, match="closed"):
            lower.wait(pending)
        assert time.monotonic() - start < CLOSE_S
    else:  # gloo cannot end a posted receive early: it ends at its deadline, and the group goes then
        give_up = time.monotonic() + DEADLINE_S + 5
        while release_threads() and time.monotonic() < give_up:
            time.sleep(0.1)
        assert not release_threads(), "the closed group was never torn down"
    upper.close(broken=True)
