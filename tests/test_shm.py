"""Same-host servers receive through shared memory: bit-exact versions, zero-copy adoption, leases,
servers that die or hang while reading, a corrupted segment, a crashed trainer, and the config."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from asyncsync import ConfigError, WeightSync, WeightSyncConfig
from asyncsync.engines.base import UnsupportedServer
from asyncsync.models import generate
from asyncsync.packing.torch_backend import TorchPackBackend
from asyncsync.protocol.admission import VersionRejected
from asyncsync.protocol.shm import SEGMENT_PREFIX, SHM_DIR, HostIdentity
from asyncsync.protocol.specs import BucketPlan
from asyncsync.protocol.wire import BucketMeta, SharedVersion, UpdateRequest
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.receivers.reference.receiver import WeightReceiver
from asyncsync.testing import Faults, ServerProcess, mixed_dtype_model, running
from asyncsync.trainer.buffers import SharedSnapshot
from asyncsync.transport.shm import SegmentPool, sweep_stale
from aiohttp import web

from conftest import TINY
from helpers import ThreadedServer, digest, weights

CPU = torch.device("cpu")


def segments(pid: int | None = None) -> list[str]:
    """asyncsync's segments in /dev/shm (of trainer ``pid`` only, when given)."""
    prefix = SEGMENT_PREFIX + (f"{pid}-" if pid is not None else "")
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def config(urls: list[str], **options: object) -> WeightSyncConfig:
    return WeightSyncConfig.from_dict({"servers": urls, "bucket_bytes": "16KiB", **options})


def test_blocking_and_async_versions_arrive_bit_exact_and_serve_the_trainers_outputs(two_servers):
    model = mixed_dtype_model(TINY)
    urls = [s.url for s in two_servers]
    prompt = [1, 2, 3, 4]
    for mode, first in ((False, 100), (True, 200)):
        with WeightSync(config(urls, async_weight_update=mode)) as sync:
            sync.connect(model)
            (fleet,) = sync.connection.role.fleets
            assert fleet.epochs.current.group is None and fleet.epochs.current.shared == set(urls), "same-host servers form no data-plane group"
            for v in range(first, first + 4):
                sync.wait_snapshot()
                weights(model, v)
                result = sync.publish(model, v)
                if result is not None:
                    assert result.server_versions == {u: v for u in urls}, result.failures
            pool = sync.connection.pool
            sync.close()
            assert sync.server_versions == {u: first + 3 for u in urls}
            assert pool._segments == [], "close() unlinks the segments"
        for s in two_servers:
            got = s.get("/weights/digest")
            assert got["version"] == first + 3 and got["digest"] == digest(model)
            served = s.post("/generate", {"prompt": prompt, "max_new_tokens": 6})["completions"][0]
            assert served == generate(model, prompt, 6)[0], "the server computes what the trainer's own weights compute"
    assert segments(os.getpid()) == []


def test_the_reference_server_serves_from_the_mapping_and_segments_are_reused_under_its_lease():
    model = mixed_dtype_model(TINY)
    server = ReferenceServer(mixed_dtype_model(TINY))
    with ThreadedServer(server) as ts, WeightSync(config([ts.url])) as sync:
        sync.connect(model)
        names = []
        for v in range(1, 5):
            weights(model, v)
            assert sync.publish(model, v).server_versions == {ts.url: v}
            (held,) = server.receiver.holds
            names.append(held)
            assert sync.connection.role.fleets[0].book.record(ts.url).lease == {held}, "the trainer knows what the server maps"
            assert digest(server.model) == digest(model)
        # Zero copy: the live weights are views of the segment the server holds.
        live = server.model.lm_head.weight
        assert live.untyped_storage().nbytes() >= sync.connection.pool.nbytes
        # The segment a server maps is never the one the next version is packed into; freed ones are reused.
        assert all(a != b for a, b in zip(names, names[1:]))
        assert names[0] == names[2] and names[1] == names[3] and len(sync.connection.pool._segments) == 2


class ElsewhereServer(ReferenceServer):
    """A reference server that says it sees another host's shared memory (a remote server)."""

    async def host(self, _r: web.Request) -> web.Response:
        return web.json_response({"host": {"boot_id": "another-host", "shm_dev": 1}})


def test_local_and_remote_servers_mix_in_one_version():
    model = mixed_dtype_model(TINY)
    local, remote = ReferenceServer(mixed_dtype_model(TINY)), ElsewhereServer(mixed_dtype_model(TINY))
    with ThreadedServer(local) as a, ThreadedServer(remote) as b:
        with WeightSync(config([a.url, b.url])) as sync:
            sync.connect(model)
            (fleet,) = sync.connection.role.fleets
            epoch = fleet.epochs.current
            assert epoch.shared == {a.url} and epoch.group is not None and epoch.group.layout == [("asyncsync", 2)]
            for v in (1, 2):
                weights(model, v)
                assert sync.publish(model, v).server_versions == {a.url: v, b.url: v}
                assert digest(local.model) == digest(remote.model) == digest(model)
            assert local.receiver.holds and not remote.receiver.holds
        with pytest.raises(UnsupportedServer, match="not on this host.*transport: shm"):
            WeightSync(config([a.url, b.url], transport="shm")).connect(model)
        with WeightSync(config([a.url, b.url], transport="collective")) as sync:
            sync.connect(model)
            epoch = sync.connection.role.fleets[0].epochs.current
            assert epoch.shared == set() and epoch.group is not None and epoch.group.layout == [("asyncsync", 3)]
            weights(model, 3)
            assert sync.publish(model, 3).server_versions == {a.url: 3, b.url: 3}


def test_a_same_host_sglang_server_gets_the_collective_and_shm_refuses_it():
    """SGLang's same-host path (``update_weights_from_tensor``) is not done: under ``auto`` a
    same-host server addressed as ``kind: sglang`` (the reference server's SGLang API) gets the
    data-plane broadcast, and ``transport: shm`` refuses it at connect, before claiming it."""
    model = mixed_dtype_model(TINY)
    server = ReferenceServer(mixed_dtype_model(TINY))
    with ThreadedServer(server) as ts:
        servers = [{"url": ts.url, "kind": "sglang"}]
        with pytest.raises(UnsupportedServer, match="sglang server cannot receive through shared memory"):
            WeightSync(config(servers, transport="shm")).connect(model)
        with WeightSync(config(servers)) as sync:
            sync.connect(model)
            epoch = sync.connection.role.fleets[0].epochs.current
            assert epoch.shared == set() and epoch.group is not None
            weights(model, 1)
            assert sync.publish(model, 1).server_versions == {ts.url: 1}
            assert digest(server.model) == digest(model)


def test_transport_is_validated():
    with pytest.raises(ConfigError, match="transport: 'tcp' is not one of"):
        config(["http://127.0.0.1:1"], transport="tcp")
    assert config(["http://127.0.0.1:1"]).transport == "auto"


def _pack_shared(model: torch.nn.Module, pool: SegmentPool | None = None) -> tuple[UpdateRequest, SharedSnapshot, SegmentPool]:
    named = dict(model.state_dict())
    plan = BucketPlan.from_tensors(named.items(), 16 << 10)
    pool = pool or SegmentPool([b.nbytes for b in plan.buckets])
    buffers = SharedSnapshot(plan, CPU, TorchPackBackend(), True, pool)
    buffers.pack_all(named)
    assert buffers.segment is not None and pool.host is not None
    crcs = tuple(int(c) for c in buffers.crcs)
    req = UpdateRequest(7, tuple(BucketMeta.of(b) for b in plan.buckets), True,
                        shm=SharedVersion(buffers.segment.name, pool.offsets, crcs, pool.host))
    return UpdateRequest.from_json(req.to_json()), buffers, pool


def test_a_corrupted_segment_another_host_or_a_wrong_layout_is_refused_whole():
    trainer, served = mixed_dtype_model(TINY), mixed_dtype_model(TINY)
    weights(trainer, 1)
    before = digest(served)
    receiver = WeightReceiver(dict(served.state_dict(keep_vars=True)), threading.Lock())
    req, buffers, pool = _pack_shared(trainer)
    try:
        buffers.buffers[-1][3] ^= 0xFF  # one byte of the last bucket flipped after packing
        with pytest.raises(VersionRejected, match=rf"checksum mismatch in bucket\(s\) \[{len(req.buckets) - 1}\]"):
            receiver.receive(req)
        buffers.buffers[-1][3] ^= 0xFF
        elsewhere = UpdateRequest(7, req.buckets, True, shm=SharedVersion(req.shm.segment, req.shm.offsets, req.shm.crcs,
                                                                         HostIdentity("other", 0)))
        with pytest.raises(VersionRejected, match="on another host"):
            receiver.receive(elsewhere)
        gone = UpdateRequest(7, req.buckets, True, shm=SharedVersion(SEGMENT_PREFIX + "1-ab-1", req.shm.offsets,
                                                                     req.shm.crcs, req.shm.host))
        with pytest.raises(VersionRejected, match="cannot be opened here"):
            receiver.receive(gone)
        assert receiver.version == 0 and digest(served) == before, "nothing was applied"
        receiver.receive(req)
        receiver.commit(7)
        assert digest(served) == digest(trainer) and receiver.holds == (req.shm.segment,)
    finally:
        pool.close()


def _hold_then_die(url: str, published) -> None:  # type: ignore[no-untyped-def]
    """A trainer process: connect, publish one version, then die without closing anything."""
    torch.set_num_threads(1)
    model = mixed_dtype_model(TINY)
    sync = WeightSync(config([url]))
    sync.connect(model)
    sync.publish(model, 1)
    published.set()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_a_killed_trainer_leaves_no_segment_and_its_servers_are_free_at_once():
    ctx = mp.get_context("spawn")
    with ServerProcess(mixed_dtype_model, (TINY,)) as server:
        published = ctx.Event()
        trainer = ctx.Process(target=_hold_then_die, args=(server.url, published), daemon=True)
        trainer.start()
        try:
            assert published.wait(120)
            pid = trainer.pid
            trainer.join(60)
            assert trainer.exitcode == -signal.SIGKILL
            deadline = time.monotonic() + 20
            while segments(pid) and time.monotonic() < deadline:  # its resource tracker unlinks them
                time.sleep(0.1)
            assert segments(pid) == []
            assert server.get("/version")["version"] == 1, "the server keeps serving from its mapping"
            model = mixed_dtype_model(TINY)
            with WeightSync(config([server.url])) as sync:  # its process is gone: the server is free at once
                sync.connect(model)
                weights(model, 2)
                assert sync.publish(model, 2).server_versions == {server.url: 2}
        finally:
            if trainer.is_alive():
                trainer.kill()
                trainer.join(10)


def test_segments_of_dead_trainers_are_swept():
    stale = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}999999999-ab12-1")  # no such pid
    open(stale, "wb").close()
    mine = os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}{os.getpid()}-ab12-1")
    open(mine, "wb").close()
    try:
        assert os.path.basename(stale) in sweep_stale()
        assert not os.path.exists(stale) and os.path.exists(mine)
    finally:
        for p in (stale, mine):
            if os.path.exists(p):
                os.unlink(p)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_server_that_dies_or_hangs_while_reading_blocks_no_one_and_its_segment_is_retired(how):
    """One server holds its ``/update`` answer for 10 s (it has mapped the segment) and is killed, or
    just hangs, meanwhile; the other applies the version, the trainer returns at the deadline, and the
    segment the lost server may still read is unlinked and never written again."""
    slow = Faults(call_delay_s=(("/update", 10.0),))
    with running([ServerProcess(mixed_dtype_model, (TINY,)), ServerProcess(mixed_dtype_model, (TINY,), faults=slow)]) as (good, bad):
        model = mixed_dtype_model(TINY)
        cfg = config([good.url, bad.url], deadlines={"http_s": 4.0}, readmit_interval_s=600)
        with WeightSync(cfg) as sync:
            sync.connect(model)
            if how == "killed":
                threading.Timer(1.0, lambda: os.kill(bad.process.pid, signal.SIGKILL)).start()
            t0 = time.monotonic()
            weights(model, 1)
            result = sync.publish(model, 1)
            took = time.monotonic() - t0
            assert result.server_versions == {good.url: 1} and bad.url in result.failures
            assert took < 4.0 + 3.0, f"the trainer waited {took:.1f}s, past the update deadline"
            assert [e.server for e in sync.events if e.kind == "evicted"] == [bad.url]
            read = sync.connection.publisher.shared[0].segment.name
            assert not os.path.exists(os.path.join(SHM_DIR, read)), "the segment it was reading is retired"
            for v in (2, 3):
                weights(model, v)
                assert sync.publish(model, v).server_versions == {good.url: v}
                assert sync.connection.publisher.shared[0].segment.name != read
            assert good.get("/weights/digest")["digest"] == digest(model)
        assert segments(os.getpid()) == []
