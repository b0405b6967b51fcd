"""``protocol.background.BackgroundReceive``: a version received and verified on a worker thread while
the serving thread goes on (what asyncsync's vLLM engine does with ``receive: background``), against
a real gloo group with the trainer as rank 0; on ``FakeCuda`` for the stream and event order a GPU
needs (tests/fakes.py)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncsync.protocol.arena import Arena
from asyncsync.protocol.background import BACKGROUND_NICE, BackgroundReceive, finish_window_s
from asyncsync.protocol.checksum import crc32c_of
from asyncsync.protocol.device import HostRuntime, Runtime
from asyncsync.protocol.group import DataPlaneGroup, free_port
from asyncsync.protocol.specs import BucketPlan, TensorSpec
from asyncsync.protocol.admission import VersionRejected
from asyncsync.protocol.stager import BucketStager
from asyncsync.protocol.wire import BucketMeta, GroupSpec, UpdateRequest

from fakes import FakeCuda
from helpers import send_frames

SHAPE = (64, 1024)  # 256 KiB: one bucket


def weights(version: int) -> torch.Tensor:
    return torch.full(SHAPE, float(version))


META = BucketMeta.of(BucketPlan.from_tensors([("w", weights(0))]).buckets[0])


@dataclass
class Link:
    """The trainer's end of a group and the receiver's ``BackgroundReceive`` at the other."""

    trainer: DataPlaneGroup
    background: BackgroundReceive

    def send(self, version: int, checksum: bool = True, corrupt: bool = False) -> threading.Thread:
        """Broadcast ``weights(version)`` (and its manifest) from a thread, as the trainer does."""
        data = weights(version).view(torch.uint8).reshape(-1)

        def run() -> None:
            send_frames(self.trainer, request(version, checksum), [data],
                        [crc32c_of(data) ^ int(corrupt)] if checksum else None)

        thread = threading.Thread(target=run)
        thread.start()
        return thread


def join(background: BackgroundReceive) -> DataPlaneGroup:
    spec = GroupSpec("127.0.0.1", free_port(), 2, f"bg{free_port()}", "gloo", 20.0)
    trainer: list[DataPlaneGroup] = []
    rank0 = threading.Thread(target=lambda: trainer.append(DataPlaneGroup.join(spec, 0, HostRuntime())))
    rank0.start()
    background.join(spec, 1)
    rank0.join(30)
    return trainer[0]


@contextlib.contextmanager
def connected(runtime: Runtime, verify: Callable[[Any], None] | None = None) -> Iterator[Link]:
    spec = TensorSpec.of("w", weights(0))
    stager = BucketStager({"w": spec}, "/init", runtime, arenas=(Arena.on_device(spec.nbytes, runtime.device),))
    background = BackgroundReceive(stager, verify)
    link = Link(join(background), background)
    try:
        yield link
    finally:
        background.close()
        link.trainer.close()


@pytest.fixture
def link() -> Iterator[Link]:
    with connected(HostRuntime()) as link:
        yield link


def request(version: int, checksum: bool = True) -> UpdateRequest:
    return UpdateRequest(version, (META,), checksum, receive="background")


def test_start_returns_before_the_data_and_take_gives_the_whole_verified_version(link):
    link.background.start(request(1), served_version=0)
    assert link.background.pending, "nothing was sent yet: the receive waits on its thread, not in start()"
    sender = link.send(1)
    staged = link.background.take()
    sender.join(30)
    assert torch.equal(dict(staged.tensors())["w"], weights(1))
    assert not link.background.pending


def test_a_refused_version_is_reported_once_and_leaves_nothing_pending(link):
    link.background.start(request(1), served_version=0)
    link.send(1, corrupt=True).join(30)
    with pytest.raises(VersionRejected, match=r"version 1 rejected: checksum mismatch in bucket\(s\) \[0\]"):
        link.background.take()
    assert not link.background.pending
    with pytest.raises(VersionRejected, match="nothing to finish"):
        link.background.take()  # vLLM's second finish_weight_update: the engine skips it when nothing is pending
    link.background.start(request(2), served_version=0)
    link.send(2).join(30)
    assert torch.equal(dict(link.background.take().tensors())["w"], weights(2))
    with pytest.raises(VersionRejected, match="version 2 is not newer than the served version 2"):
        link.background.start(request(2), served_version=2)
        link.send(2).join(30)
        link.background.take()


def test_a_second_version_is_refused_while_one_is_in_flight(link):
    link.background.start(request(1), served_version=0)
    with pytest.raises(VersionRejected, match="version 1 is still being received in the background"):
        link.background.start(request(2), served_version=0)
    link.send(1).join(30)
    assert torch.equal(dict(link.background.take().tensors())["w"], weights(1))


def test_a_cancelled_receive_blocks_the_next_until_it_ended():
    """A receive may not end when its group is left (a gloo receive matched to a send is released
    only at its deadline); here the worker is held in ``verify``. ``cancel`` does not wait for it, and
    no other receive may start until it ended: it would write the same buffers."""
    held, release = threading.Event(), threading.Event()

    def verify(staged: object) -> None:
        held.set()
        release.wait(30)

    with connected(HostRuntime(), verify) as link:
        link.background.start(request(1), served_version=0)
        link.send(1).join(30)
        assert held.wait(30)
        start = time.monotonic()
        link.background.cancel()
        assert time.monotonic() - start < 1.0, "cancel runs inside an RPC that holds the engine: it never waits"
        assert not link.background.pending and link.background.stager.joined.group is None, "it left the group"
        with pytest.raises(VersionRejected, match="a discarded receive is still waiting for its data"):
            link.background.start(request(2), served_version=0)
        release.set()
        link.trainer.close()
        link.trainer = join(link.background)  # the trainer's next epoch; the worker ran the old receive out first
        link.background.start(request(2), served_version=0)
        link.send(2).join(30)
        assert torch.equal(dict(link.background.take().tensors())["w"], weights(2))


def test_a_relayed_receiver_waits_for_a_first_frame_as_many_hops_late_as_servers_above_it(link):
    """A relayed server's first frame arrives one hop per server above it after the trainer's (review
    M3a: vLLM's finish window was a fixed 10 s from the root's last byte). The trainer's request for
    the last server of a chain of four waits 4x the first bucket's 0.5 s deadline for it, and so
    does the finish window: frames 1.2 s late (three hops) are taken, verified."""
    from asyncsync.transport.relay import RelayTree
    from asyncsync.transport.send import relayed_requests

    chain = RelayTree.plan(["a", "b", "c", "d"], 1)
    below = type("Engine", (), {"url": "d"})()
    base = UpdateRequest(1, (META,), True, (0.5,), receive="background")
    deep = relayed_requests(base, [below], (chain,))[0]["d"]
    assert deep.deadline_s(0) == 2.0 and finish_window_s(deep, 0.3) == pytest.approx(2.3)
    link.background.start(deep, served_version=0)
    late = threading.Timer(1.2, lambda: link.send(1).join(30))
    late.start()
    try:
        staged = link.background.take(finish_window_s(deep, 0.3))  # finish, called as the trainer's broadcasts end
    finally:
        late.join(30)
    assert torch.equal(dict(staged.tensors())["w"], weights(1))


def test_a_cancel_with_a_receive_pending_in_the_group_returns_at_once(link):
    """The receive is posted in the gloo group and the trainer sends nothing (the issue's M1: closing
    the group waited for that receive's deadline, 5.8 s of 6, inside the RPC that holds vLLM's engine)."""
    link.background.start(UpdateRequest(1, (META,), True, (6.0,), receive="background"), served_version=0)
    time.sleep(0.3)  # the worker posted the header's receive
    start = time.monotonic()
    link.background.cancel()
    took = time.monotonic() - start
    print(f"cancel with a receive pending: {took * 1e3:.1f} ms")
    assert took < 0.5 and link.background.stager.joined.group is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_the_receive_and_its_data_plane_threads_run_below_the_serving_threads():
    """The worker lowers its priority, and the threads of the group it joined (gloo's) inherit it."""
    tasks = Path("/proc/self/task")
    worker: list[int] = []

    def nice(tid: int | str) -> int | None:
        try:
            return int((tasks / str(tid) / "stat").read_text().rsplit(")", 1)[1].split()[16])
        except FileNotFoundError:  # a thread that ended meanwhile
            return None

    with connected(HostRuntime(), lambda staged: worker.append(nice(threading.get_native_id()))) as link:
        link.background.start(request(1), served_version=0)
        link.send(1).join(30)
        link.background.take()
        mine = nice(threading.get_native_id())
        assert worker == [min(19, mine + BACKGROUND_NICE)] and worker[0] > mine
        inherited = [t.name for t in tasks.iterdir() if nice(t.name) == worker[0]]
        assert inherited, "the threads of the group the worker joined run at its priority"


# -- CUDA semantics, on FakeCuda --------------------------------------------------------------------

@pytest.fixture
def fake() -> Iterator[FakeCuda]:
    cuda = FakeCuda(index=1)
    cuda.enter_thread()  # the serving thread runs on cuda:1, on the default stream
    yield cuda
    cuda.close()


def slow_apply(fake: FakeCuda, link: Link, staged: object) -> torch.Tensor:
    """The engine's load as a kernel on the serving thread's stream that reads the staging buffer
    late, then ``released()``."""
    out = torch.empty(SHAPE)
    view = dict(staged.tensors())["w"]  # type: ignore[attr-defined]
    fake.launch(lambda: (time.sleep(0.3), out.copy_(view)))
    link.background.released()
    return out


def apply_then_receive_next(fake: FakeCuda, link: Link, skip_wait: bool) -> torch.Tensor:
    link.background.start(request(1, checksum=False), served_version=0)
    link.send(1, checksum=False).join(30)
    out = slow_apply(fake, link, link.background.take())
    if skip_wait:
        link.background._released = None  # the negative control: the next receive does not wait for the apply
    link.background.start(request(2, checksum=False), served_version=1)
    link.send(2, checksum=False).join(30)
    link.background.take()
    fake.host_wait(fake.record())
    return out


def test_on_cuda_the_receive_runs_on_its_own_stream_and_waits_for_the_last_apply(fake):
    with connected(fake) as link:
        out = apply_then_receive_next(fake, link, skip_wait=False)
        assert torch.equal(out, weights(1)), "the next version overwrote the buffers while the load still read them"
        group = fake.groups[-1]
        assert group.caller_streams and all(s.name.startswith("dedicated") for s in group.caller_streams), \
            "the receive's collectives queued on a stream the forward passes use"
    assert fake.kernel_errors == []


def test_on_cuda_without_the_wait_the_next_receive_tears_the_load(fake):
    """The negative control: the harness sees the damage the wait on ``released`` prevents."""
    with connected(fake) as link:
        out = apply_then_receive_next(fake, link, skip_wait=True)
        assert torch.equal(out, weights(2)), "the harness must show the load reading the next version's bytes"
