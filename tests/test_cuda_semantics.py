"""The CUDA path as a GPU would run it, on CPU: the sync runs on ``FakeCuda`` (tests/fakes.py), a
runtime with CUDA's stream, event, per-thread-device and NCCL semantics over CPU tensors and gloo.

Each test states the GPU behaviour it protects (docs/design.md "GPU semantics"); where it can, a
second test takes the fix away and checks that the harness sees the damage, so the first cannot pass
by accident. Checksums are off here: the fake's manifest would be read by the host before the fake
pack kernels wrote it (on a GPU it is a kernel ordered after them), and the digests check the bytes.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from asyncsync import WeightSync, WeightSyncConfig
from asyncsync import packing
from asyncsync.models import build_model
from asyncsync.protocol import group as group_module
from asyncsync.protocol.device import HostRuntime, NCCL_GROUP_ENV, runtime_for
from asyncsync.protocol.group import DataPlaneGroup, free_port
from asyncsync.protocol.stager import BucketStager
from asyncsync.protocol.specs import BucketPlan, TensorSpec
from asyncsync.protocol.wire import BucketMeta, GroupSpec, UpdateRequest
from asyncsync.packing import PackBackend, PackBackendUnavailable, check_against_torch, get_backend
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.testing import ServerProcess, running
from asyncsync.trainer import connect as connect_module
from asyncsync.trainer.streams import StreamSet

from conftest import TINY
from fakes import FakeCuda, FakeCudaError, FakeCudaPack
from helpers import ThreadedServer, Watcher, digest, send_frames


@pytest.fixture(scope="module")
def servers() -> Iterator[list[ServerProcess]]:
    with running([ServerProcess(build_model, (TINY,)) for _ in range(2)]) as started:
        yield started


@pytest.fixture
def own_servers() -> Iterator[list[ServerProcess]]:
    """For tests that leave their servers inside a collective until its deadline."""
    with running([ServerProcess(build_model, (TINY,)) for _ in range(2)]) as started:
        yield started


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    cuda = FakeCuda(index=1)
    monkeypatch.setattr(connect_module, "runtime_for", lambda device: cuda)
    monkeypatch.setitem(packing.BACKENDS.targets, "fakecuda", "fakes:FakeCudaPack")
    monkeypatch.setattr(FakeCudaPack, "fake", cuda)
    cuda.enter_thread()  # the trainer computes on cuda:1
    yield cuda
    cuda.close()


def config(servers: list[ServerProcess], **extra: object) -> WeightSyncConfig:
    return WeightSyncConfig.from_dict({
        "async_weight_update": True, "servers": [s.url for s in servers], "pack_backend": "fakecuda",
        "checksum": False, "bucket_bytes": "16KiB", "deadlines": {"collective_s": 10, "http_s": 10}, **extra})


def train(fake: FakeCuda, sync: WeightSync, servers: list[ServerProcess], steps: int = 8,
          pause_s: float = 0.0, every: int = 1,
          step_s: float = 0.0) -> tuple[dict[int, dict[str, str]], dict[str, list[tuple[int, dict[str, str]]]]]:
    """The README loop with the optimizer step as a kernel on the trainer's stream; a host-side shadow
    model applies the same steps at once, so ``published[v]`` is what version v must be. The step
    changes one element in ``every`` of each parameter and takes ``step_s`` on its stream."""
    model, shadow = build_model(TINY), build_model(TINY)
    start = max(s.get("/version")["version"] for s in servers)
    published = {}
    with Watcher(servers) as watcher:
        try:
            sync.connect(model)  # not the step boundary: it may wait
            for version in range(start + 1, start + 1 + steps):
                with fake.boundary():
                    sync.wait_snapshot()
                delta = 1e-2 * version

                def step(m: torch.nn.Module = model, d: float = delta) -> None:
                    time.sleep(step_s if m is model else 0.0)
                    with torch.no_grad():
                        for p in m.parameters():
                            p.view(-1)[::every].add_(d)

                fake.launch(step)  # runs on the trainer's stream, after whatever wait_snapshot ordered
                step(shadow)
                published[version] = digest(shadow)
                with fake.boundary():
                    sync.publish(model, version)
                time.sleep(pause_s)
        finally:
            sync.close()  # also when the harness raised: an open sync would keep owning the servers
    finals = {s.url: s.get("/weights/digest") for s in servers}
    samples = {u: [*watcher.samples[u], (f["version"], f["digest"])] for u, f in finals.items()}
    return published, samples


def torn(published: dict[int, dict[str, str]], samples: dict[str, list[tuple[int, dict[str, str]]]]) -> list[int]:
    return sorted({v for s in samples.values() for v, d in s if v in published and d != published[v]})


# -- 1, 3, 6: the boundary is wait-free, senders own their streams, threads enter the device -------

def test_async_on_cuda_is_bit_exact_and_the_boundary_never_waits_on_the_host(fake, servers):
    """publish() and wait_snapshot() are wrapped in ``fake.boundary()``: an ``.item()``, ``.cpu()``
    or a host wait on an event or work there raises. Every version the servers end up with is the
    trainer's, and a sync thread that had not entered cuda:1 would have raised too."""
    fake.wire_delay_s = 0.02
    sync = WeightSync(config(servers))
    published, samples = train(fake, sync, servers)
    assert sync.errors == [] and fake.kernel_errors == []
    assert torn(published, samples) == []
    assert all(s[-1] == (max(published), published[max(published)]) for s in samples.values())


def test_async_deltas_on_cuda_are_read_by_senders_after_their_pack_and_bit_exact(fake, servers):
    """``pack_delta`` is a kernel on the copy stream; its delta is read (a host sync: sizes before the
    update request) only by a sender, on its stream ordered after the snapshot's ``done``: never at
    the boundary (``fake.boundary`` raises on a host sync there), never before the pack ran."""
    fake.wire_delay_s = 0.02
    FakeCudaPack.readers = readers = []
    sync = WeightSync(config(servers, checksum=True, transport="collective"))
    published, samples = train(fake, sync, servers, every=37)
    assert sync.errors == [] and fake.kernel_errors == [], (sync.errors, fake.kernel_errors)
    assert torn(published, samples) == []
    assert all(s[-1] == (max(published), published[max(published)]) for s in samples.values())
    assert [r for r in sync.metrics.history if r.delta_base is not None], "versions went out as deltas"
    assert readers and {r.split("-")[1] for r in readers} == {"send"}


def test_the_harness_sees_a_delta_read_before_its_pack(fake, own_servers, monkeypatch):
    waits = []
    real = StreamSet.comm_wait

    def comm_wait(self: StreamSet, marker: object) -> None:  # after the first version, no wait for done
        waits.append(marker)
        if len(waits) == 1:
            real(self, marker)

    monkeypatch.setattr(StreamSet, "comm_wait", comm_wait)
    fake.wire_delay_s = 0.02
    sync = WeightSync(config(own_servers, checksum=True, transport="collective"))
    with contextlib.suppress(AssertionError):
        train(fake, sync, own_servers, steps=6, every=37, step_s=0.3)  # each pack runs 0.3 s late
    assert any("not ordered after its pack" in e for e in sync.errors), sync.errors


def test_senders_broadcast_from_their_own_streams_never_the_trainers(fake, servers):
    """A collective waits on the caller's current stream, and ``work.wait`` makes it wait: a sender on
    the trainer's stream would hold every later training kernel until its bucket crossed the wire."""
    fake.wire_delay_s = 0.3
    ran: dict[str, float] = {}
    with WeightSync(config(servers, bucket_bytes="64MiB")) as sync:
        sync.connect(build_model(TINY))
        version = max(s.get("/version")["version"] for s in servers) + 1
        with fake.boundary():
            sync.publish(build_model(TINY), version)
            sync.wait_snapshot()
        time.sleep(0.05)  # the sender has enqueued its broadcast by now
        fake.launch(lambda: ran.setdefault("trainer_kernel", time.monotonic()))
        assert sync.wait_for_fresh_servers(version + sync.config.max_staleness, timeout=30)
        sent_at = time.monotonic()
    assert "trainer_kernel" in ran and ran["trainer_kernel"] < sent_at - 0.2, \
        "the trainer's next kernel waited for the broadcast: a sender used the trainer's stream"
    # [:2]: the proof of the key at connect (a nonce broadcast, an all-gather), on the connecting thread
    sender_streams = {id(s) for g in fake.groups for s in g.caller_streams[2:]}
    assert id(fake.default_stream()) not in sender_streams and not any(s.pool for g in fake.groups for s in g.caller_streams)


def test_the_harness_sees_a_sender_on_the_trainers_stream(fake, servers, monkeypatch):
    monkeypatch.setattr(StreamSet, "enter_sender_thread", lambda self: self.runtime.enter_thread())  # no stream of its own
    with pytest.raises(AssertionError, match="a sender used the trainer's stream"):
        test_senders_broadcast_from_their_own_streams_never_the_trainers(fake, servers)


def test_the_harness_sees_a_host_wait_at_the_boundary(fake, servers, monkeypatch):
    monkeypatch.setattr(StreamSet, "compute_wait", lambda self, marker: self.runtime.host_wait(marker))
    with pytest.raises(FakeCudaError, match="the host waited at the step boundary"):
        train(fake, WeightSync(config(servers)), servers, steps=2)


def test_the_harness_sees_a_thread_that_never_entered_the_device(fake, own_servers, monkeypatch):
    servers = own_servers
    monkeypatch.setattr(StreamSet, "enter_sender_thread", lambda self: self.runtime.set_stream(self.runtime.new_stream()))
    sync = WeightSync(config(servers))
    train(fake, sync, servers, steps=2)
    assert any("never entered its device" in e for e in sync.errors), sync.errors


# -- 2: a snapshot is rewritten only after the broadcasts that read it ---------------------------

class LateReadingSend:
    """Stands in for ``send_version`` on a GPU whose waits order streams only: the host part returns at
    once, while the "broadcast" reads the snapshot later, on the sender's stream."""

    def __init__(self, fake: FakeCuda):
        self.fake, self.read = fake, {}

    def __call__(self, plan, version, source, result):  # type: ignore[no-untyped-def]
        buffers = [source.bucket(b) for b in plan.buckets]

        def read() -> None:
            time.sleep(0.03)  # the wire
            self.read[version] = b"".join(bytes(b.numpy()) for b in buffers)

        self.fake.launch(read)
        result.server_versions = {"stand-in": version}
        return result


def run_worker(fake: FakeCuda, versions: int = 12) -> tuple[dict[int, bytes], dict[int, bytes]]:
    """The async worker alone over FakeCuda; returns the bytes each version should have and those read."""
    from asyncsync.trainer import worker as worker_module
    from asyncsync.trainer.buffers import Snapshot
    from asyncsync.metrics import SyncMetrics
    from asyncsync.ranks import TrainerRanks
    from asyncsync.trainer.source import WeightsReader

    send = LateReadingSend(fake)
    model, shadow = build_model(TINY), build_model(TINY)
    reader = WeightsReader()
    plan = BucketPlan.from_tensors(reader.read(model).tensors().items(), 16 * 1024)
    worker = worker_module.SyncWorker([lambda v, source, result: send(plan, v, source, result)], plan,
                                      lambda: Snapshot(plan, fake.device, FakeCudaPack(), False),
                                      StreamSet(fake), SyncMetrics(), TrainerRanks(), served=lambda v: v)
    want = {}
    for version in range(1, versions + 1):
        worker.wait_snapshot()

        def step(m: torch.nn.Module = model, d: float = 1e-2 * version) -> None:
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(d)

        fake.launch(step)
        step(shadow)
        ref = Snapshot(plan, fake.device, packing.torch_backend.TorchPackBackend(), False)
        ref.pack_all(reader.read(shadow).tensors())
        want[version] = b"".join(bytes(b.numpy()) for b in ref.buffers)
        worker.publish(reader.read(model), version)
        time.sleep(0.02)  # a step: shorter than a send, so versions are sent and skipped in turn
    worker.close()
    done = threading.Event()
    fake.launch(done.set)
    for stream in fake.streams:  # let every queued read finish
        flushed = threading.Event()
        stream.enqueue(flushed.set)
        flushed.wait(10)
    reader.close()
    return want, send.read


def test_a_snapshot_is_not_repacked_while_a_broadcast_still_reads_it(fake, monkeypatch):
    """The host is done with a snapshot once its sends returned; on a GPU the wire may still be reading
    it. The copy of a later version into it waits for the ``sent`` marker each sender recorded."""
    import asyncsync.packing.torch_backend  # noqa: F401  (the reference packing below)

    want, read = run_worker(fake)
    assert len(read) >= 3, "several versions were sent"
    assert [v for v in read if read[v] != want[v]] == []


def test_the_harness_sees_a_snapshot_repacked_before_its_broadcast_finished(fake, monkeypatch):
    import asyncsync.packing.torch_backend  # noqa: F401

    def already_done(self: StreamSet) -> object:
        from fakes import FakeEvent

        marker = FakeEvent(fake)
        marker.done.set()
        return marker

    monkeypatch.setattr(StreamSet, "sent", already_done)
    want, read = run_worker(fake)
    assert [v for v in read if read[v] != want[v]], "a snapshot rewritten under its broadcast must show"


def test_a_receiver_answers_only_once_its_data_arrived(fake):
    """A receiver on a GPU must not verify or answer before the broadcast's data is in its buffers:
    its waits block the host (with the group's deadline), not only its stream."""
    fake.wire_delay_s = 0.3
    data = torch.arange(4096, dtype=torch.int32)
    meta = BucketMeta.of(BucketPlan.from_tensors([("w", data)]).buckets[0])
    spec = GroupSpec("127.0.0.1", free_port(), 2, "recv", "gloo", 20.0)
    trainer: list[DataPlaneGroup] = []
    sender = threading.Thread(target=lambda: trainer.append(DataPlaneGroup.join(spec, 0, HostRuntime())))
    sender.start()
    stager = BucketStager({"w": TensorSpec.of("w", data)}, "/init", fake)
    stager.joined.join(spec, 1)
    sender.join(30)
    try:
        request = UpdateRequest(1, (meta,), checksum=False)
        sending = threading.Thread(target=lambda: send_frames(trainer[0], request, [data.view(torch.uint8)]))
        sending.start()
        staged = stager.receive(request, served_version=0)
        assert torch.equal(dict(staged.tensors())["w"], data), "the receiver returned before its data arrived"
        sending.join(30)
    finally:
        stager.joined.leave()
        trainer[0].close()


# -- 4: the backend follows the weights, not the machine -----------------------------------------

def test_cpu_weights_use_gloo_even_where_cuda_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runtime_for(torch.device("cpu")).wire_backend == "gloo"
    with ThreadedServer(ReferenceServer(build_model(TINY))) as server:
        body = GroupSpec("127.0.0.1", free_port(), 2, "g", "nccl", 5.0)
        answer = server.server.receiver.stager.joined
        with pytest.raises(Exception, match="uses nccl, but this server's weights are on cpu"):
            answer.join(body, 1)
        assert answer.group is None, "nothing was joined"


# -- 5: NCCL failures raise in the sync's threads, by a deadline, and broken groups are aborted ----

def test_sync_groups_are_built_with_the_error_policy_and_a_stalled_one_is_aborted(fake, own_servers):
    servers = own_servers
    with WeightSync(config(servers, async_weight_update=False, deadlines={"collective_s": 4, "http_s": 10})) as sync:
        sync.connect(build_model(TINY))
        group = fake.groups[-1]
        assert {k: group.env.get(k) for k in NCCL_GROUP_ENV} == NCCL_GROUP_ENV, "the group's error policy"
        assert not any(os.environ.get(k) == v for k, v in NCCL_GROUP_ENV.items()), "the policy is scoped to the group"
        group.stalled.set()  # a peer died: nothing this group runs completes
        start = time.monotonic()
        result = sync.publish(build_model(TINY), max(s.get("/version")["version"] for s in servers) + 1)
        took = time.monotonic() - start
    assert took < 4 + 10, f"a stalled collective held the trainer {took:.1f}s, past collective_s"
    assert result.server_versions == {}
    assert group.aborted.is_set() and group.shutdown_calls == 0, "a broken NCCL group must be aborted, not shut down"


# -- 7: one thread at a time in NCCL, dedicated streams, cold groups ------------------------------

def test_senders_never_enqueue_at_once_and_use_dedicated_streams(fake, servers):
    published, samples = train(fake, WeightSync(config(servers, group_per_server=True)), servers, steps=6)
    assert fake.enqueue_overlaps == 0
    assert torn(published, samples) == []
    sync_streams = [s for s in fake.streams if s.name.startswith("dedicated")]
    assert len(sync_streams) == 3 and not any(s.pool for s in sync_streams)  # a copy stream, two senders
    assert all(g.internal.pool for g in fake.groups), "the fake's NCCL groups take pool streams, as torch's do"


def test_the_harness_sees_senders_enqueueing_at_once(fake, servers, monkeypatch):
    monkeypatch.setattr(group_module, "ENQUEUE_LOCK", contextlib.nullcontext())
    train(fake, WeightSync(config(servers, group_per_server=True)), servers, steps=6)
    assert fake.enqueue_overlaps > 0


def test_a_cold_group_is_first_used_with_nothing_else_in_flight():
    from asyncsync.engines.base import ASYNCSYNC_PROTOCOL
    from asyncsync.engines.sglang import SGLANG_PROTOCOL
    from asyncsync.protocol.frames import UNSEALED, FrameHeader
    from asyncsync.transport.topology import TrainerGroups

    events: list[str] = []

    class Recorder:
        seal = UNSEALED

        def __init__(self, name: str):
            self.name = name

        def broadcast_async(self, tensor: torch.Tensor, timeout_s: float | None = None) -> str:
            events.append(f"start {self.name}")
            return self.name

        def wait(self, work: str) -> None:
            events.append(f"wait {work}")

    runtime = FakeCuda()
    groups = TrainerGroups([(ASYNCSYNC_PROTOCOL, Recorder("warm")), (SGLANG_PROTOCOL, Recorder("cold"))], runtime)
    header = FrameHeader(plan=1, version=1, index=0, nbytes=4)  # asyncsync's receivers get a frame header first
    groups.wait(groups.broadcast_async(torch.zeros(1), None, header))
    groups.broadcast_async(torch.zeros(1), None, header)
    assert events == ["start warm", "start warm", "wait warm", "wait warm", "start cold",
                      "wait warm", "wait warm", "wait cold", "start warm", "start warm", "start cold"]
    runtime.close()


# -- 9: a compiled backend is checked against the torch one before it is used --------------------

class WrongBytes(PackBackend):
    """Stands for a kernel that builds but misbehaves at run time (a driver older than nvcc, a fault)."""

    name = "wrong"
    device_type = "cpu"

    def pack(self, tensors, offsets, out, checksum):  # type: ignore[no-untyped-def]
        out.zero_()
        return 0 if checksum else None


def test_a_compiled_backend_that_misbehaves_is_replaced_by_torch(monkeypatch, caplog):
    with pytest.raises(PackBackendUnavailable, match="other bytes or another checksum"):
        check_against_torch(WrongBytes(), torch.device("cpu"))
    monkeypatch.setitem(packing.BACKENDS.targets, "cpp", f"{__name__}:WrongBytes")
    monkeypatch.setattr(packing, "_fallback_reported", set())
    assert get_backend("auto", "cpu").name == "torch"
    assert "packing uses the pure-torch backend" in caplog.text
