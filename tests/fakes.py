"""Stand-ins that make device timing visible on a CPU.

``LateStreams``: a ``StreamSet`` whose copies run on a separate "device" thread, each after a delay,
the way a GPU runs queued kernels after the host has moved on.

``FakeCuda``: a ``Runtime`` with CUDA's semantics over CPU tensors and gloo, for the code paths that
only run on GPUs (docs/design.md "GPU semantics" lists them):

* each thread has a current device (0 until it enters one) and a current stream per device (the
  device's default stream until it sets another); every fake operation checks that the calling
  thread's current device is the runtime's, as CUDA would otherwise silently use device 0;
* a stream runs its work in order on its own executor thread; ``record`` puts an event on a stream,
  which completes when the stream reaches it; ``wait_event`` orders a stream after an event;
* ``pool_stream`` is what ``torch.cuda.Stream()`` would give: a small round-robin pool, which the
  fake NCCL group also draws its internal stream from;
* ``FakeNcclGroup`` wraps a real gloo group: a broadcast waits on the caller's current stream, then
  runs (the gloo broadcast, plus an optional wire delay) on the group's internal stream, so it
  reads its buffer late; ``Work.wait()`` only orders the caller's stream, ``wait(timeout)`` blocks the
  host and raises at the timeout; ``shutdown`` waits for every work (it hangs on a stuck one),
  ``abort`` fails them; two threads inside an enqueue at once is an error (NCCL's rule);
* ``boundary()`` marks the calling thread as inside ``publish``/``wait_snapshot``: a host sync there
  (an event or work waited on the host, ``Tensor.item``/``cpu``/``tolist``/``numpy``) raises.

``RefuseBeforeReceive``: an SGLang scheduler (the reference server's, or SGLang's own code) that
refuses one update before its receive, as a real server does after a restart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from asyncsync.packing import PackBackend
from asyncsync.packing.delta import Delta
from asyncsync.packing.torch_backend import TorchPackBackend
from asyncsync.protocol.device import NCCL_GROUP_ENV, HostRuntime, Runtime
from asyncsync.trainer.streams import StreamSet


class LateStreams(StreamSet):
    def __init__(self, delay_s: float = 0.05):
        super().__init__(HostRuntime())
        self.delay_s = delay_s
        self._work: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._device = threading.Thread(target=self._run, name="fake-device", daemon=True)
        self._device.start()
        self.copies = 0

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            item()

    def copy(self, fn: Callable[[], None], after: Sequence[threading.Event]) -> threading.Event:
        done = threading.Event()

        def late() -> None:
            for marker in after:
                marker.wait()
            time.sleep(self.delay_s)
            fn()
            self.copies += 1
            done.set()

        self._work.put(late)
        return done

    def close(self) -> None:
        self._work.put(None)
        self._device.join(10)


class FakeCudaError(AssertionError):
    """The code under test did something a GPU would punish (a hang, a host sync, the wrong device)."""


class FakeEvent:
    def __init__(self, fake: FakeCuda):
        self.fake = fake
        self.done = threading.Event()

    def query(self) -> bool:
        return self.done.is_set()

    def synchronize(self) -> None:
        self.fake.host_sync("Event.synchronize")
        self.done.wait()


class FakeStream:
    """Work queued on a stream runs in order on the stream's own thread."""

    _ids = itertools.count()

    def __init__(self, fake: FakeCuda, name: str, pool: bool = False):
        self.fake, self.name, self.pool = fake, f"{name}#{next(self._ids)}", pool
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"fake-stream-{self.name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                item()
            except BaseException as e:  # a kernel that fails: recorded, the stream goes on
                self.fake.kernel_errors.append(f"{self.name}: {e!r}")

    def enqueue(self, fn: Callable[[], None]) -> None:
        self._queue.put(fn)

    def wait_event(self, event: FakeEvent) -> None:
        self.enqueue(event.done.wait)

    def close(self) -> None:
        self._queue.put(None)


class _NoHostSync(TorchFunctionMode):
    """Raises on host syncs of tensors made by the thread it is active in (thread-local, as modes are)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.Tensor.item, torch.Tensor.cpu, torch.Tensor.tolist, torch.Tensor.numpy):
            raise FakeCudaError(f"{func.__name__}() inside publish()/wait_snapshot(): a host sync at the step boundary")
        return func(*args, **(kwargs or {}))


class FakeCuda(Runtime):
    kind = "cuda"
    wire_backend = "gloo"  # the fake's groups really run gloo underneath
    group_env = NCCL_GROUP_ENV

    def __init__(self, index: int = 1, pool_size: int = 2):
        self.index = index
        self.device = torch.device("cpu")  # where the tensors really are
        self._local = threading.local()
        self._default = FakeStream(self, f"default:{index}")
        self._pool = [FakeStream(self, f"pool:{index}", pool=True) for _ in range(pool_size)]
        self._next_pool = itertools.count()
        self.streams: list[FakeStream] = [self._default, *self._pool]
        self.groups: list[FakeNcclGroup] = []
        self.kernel_errors: list[str] = []
        self.wire_delay_s = 0.0
        self._enqueueing = 0
        self._enqueue_count_lock = threading.Lock()
        self.enqueue_overlaps = 0

    # -- per-thread state -----------------------------------------------------------------------

    def _state(self) -> threading.local:
        if not hasattr(self._local, "device"):
            self._local.device, self._local.stream, self._local.boundary = 0, self._default, False
        return self._local

    def check_device(self, what: str) -> None:
        if self._state().device != self.index:
            raise FakeCudaError(f"{what} issued by thread {threading.current_thread().name} on device "
                                f"{self._state().device}, not cuda:{self.index}: the thread never entered its device")

    def host_sync(self, what: str) -> None:
        if self._state().boundary:
            raise FakeCudaError(f"{what} inside publish()/wait_snapshot(): the host waited at the step boundary")

    @contextlib.contextmanager
    def boundary(self) -> Iterator[None]:
        """The calling thread is inside publish()/wait_snapshot(): host syncs raise."""
        state = self._state()
        state.boundary = True
        try:
            with _NoHostSync():
                yield
        finally:
            state.boundary = False

    def default_stream(self) -> FakeStream:
        return self._default

    def pool_stream(self) -> FakeStream:
        """What ``torch.cuda.Stream()`` returns: a pool stream, shared round-robin."""
        return self._pool[next(self._next_pool) % len(self._pool)]

    def launch(self, fn: Callable[[], None]) -> None:
        """A "kernel" on the calling thread's current stream (tests model the optimizer step with it)."""
        self.check_device("a kernel")
        self.current_stream().enqueue(fn)

    # -- Runtime --------------------------------------------------------------------------------

    def enter_thread(self) -> None:
        self._state().device = self.index

    def new_stream(self) -> FakeStream:
        self.check_device("a stream")
        stream = FakeStream(self, f"dedicated:{self.index}")
        self.streams.append(stream)
        return stream

    def current_stream(self) -> FakeStream:
        return self._state().stream

    @contextlib.contextmanager
    def use_stream(self, stream: FakeStream) -> Iterator[None]:
        state = self._state()
        previous, state.stream = state.stream, stream
        try:
            yield
        finally:
            state.stream = previous

    def set_stream(self, stream: FakeStream) -> None:
        self._state().stream = stream

    def record(self, stream: FakeStream | None = None) -> FakeEvent:
        self.check_device("an event")
        event = FakeEvent(self)
        (stream or self.current_stream()).enqueue(event.done.set)
        return event

    def wait_event(self, event: FakeEvent, stream: FakeStream | None = None) -> None:
        (stream or self.current_stream()).wait_event(event)

    def host_wait(self, event: FakeEvent) -> None:
        event.synchronize()

    def process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> FakeNcclGroup:
        from torch.distributed import ProcessGroupGloo

        self.check_device("a process group")
        group = FakeNcclGroup(self, ProcessGroupGloo(store, rank, world_size, timeout), dict(os.environ))
        self.groups.append(group)
        return group

    def wait_work(self, work: FakeWork, timeout: timedelta) -> None:
        work.wait(timeout)

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return host.clone()

    def close(self) -> None:
        for stream in self.streams:
            stream.close()


class FakeWork:
    def __init__(self, fake: FakeCuda, end: FakeEvent):
        self.fake, self.end = fake, end
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def is_completed(self) -> bool:
        return self.finished.is_set()

    def wait(self, timeout: timedelta = timedelta(0)) -> None:
        """NCCL's semantics: order the caller's current stream after the work; with a timeout, also
        block the host until it completes, raising at the timeout or on its failure."""
        self.fake.current_stream().wait_event(self.end)
        if timeout.total_seconds() <= 0:
            return
        self.fake.host_sync("Work.wait(timeout)")
        if not self.finished.wait(timeout.total_seconds()):
            raise RuntimeError(f"Watchdog caught collective operation timeout: ran for {timeout.total_seconds()}s")
        if self.error is not None:
            raise RuntimeError(f"NCCL error: {self.error}")


class FakeNcclGroup:
    """ProcessGroupNCCL's semantics around a real gloo group (see the module docstring)."""

    def __init__(self, fake: FakeCuda, gloo: Any, env: dict[str, str]):
        self.fake, self.gloo, self.env = fake, gloo, env
        self.internal = fake.pool_stream()  # ProcessGroupNCCL draws its stream from the shared pool
        self.works: list[FakeWork] = []
        self.caller_streams: list[FakeStream] = []
        self.stalled = threading.Event()  # set: every broadcast hangs, as with a dead peer
        self.aborted = threading.Event()
        self.shutdown_calls = 0

    def _set_sequence_number_for_group(self) -> None:
        self.gloo._set_sequence_number_for_group()

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> FakeWork:
        return self._collective(lambda: self.gloo.broadcast(tensors, opts))

    def allgather(self, out: list[list[torch.Tensor]], tensors: list[torch.Tensor], opts: Any) -> FakeWork:
        return self._collective(lambda: self.gloo.allgather(out, tensors, opts))

    def _collective(self, op: Any) -> FakeWork:
        """``op`` (the gloo collective underneath) enqueued as NCCL enqueues one: on the group's
        internal stream, after the caller's current stream, completing late."""
        fake = self.fake
        fake.check_device("a collective")
        with fake._enqueue_count_lock:
            fake._enqueueing += 1
            overlap = fake._enqueueing > 1
        try:
            if overlap:
                fake.enqueue_overlaps += 1
            time.sleep(0.002)  # widen the window in which a second thread would overlap
            caller = fake.current_stream()
            self.caller_streams.append(caller)
            ready = FakeEvent(fake)
            caller.enqueue(ready.done.set)
            self.internal.wait_event(ready)  # syncStream: NCCL's stream waits on the caller's
            end = FakeEvent(fake)
            work = FakeWork(fake, end)

            def run() -> None:
                try:
                    if self.stalled.is_set():
                        self.aborted.wait()  # a dead peer: nothing completes until the group is aborted
                        raise RuntimeError("NCCL communicator was aborted")
                    time.sleep(fake.wire_delay_s)
                    op().wait()
                except BaseException as e:
                    work.error = e
                finally:
                    work.finished.set()
                    end.done.set()

            self.internal.enqueue(run)
            self.works.append(work)
            return work
        finally:
            with fake._enqueue_count_lock:
                fake._enqueueing -= 1

    def barrier(self) -> Any:
        return self.gloo.barrier()

    def abort(self) -> None:
        self.aborted.set()

    def shutdown(self) -> None:
        """NCCL's shutdown waits for every kernel: with a stuck one it hangs (here: 30 s, then raises)."""
        self.shutdown_calls += 1
        for work in self.works:
            if not work.finished.wait(30):
                raise FakeCudaError("shutdown() of a group with a stuck collective hung; abort() a broken group")


class FakeCudaPack(PackBackend):
    """The pack as a GPU runs it: enqueued on the calling thread's current stream, reading its inputs
    when the stream gets there; the checksum is a tensor filled in then. ``pack_delta`` runs the
    compiled CPU encoder as that kernel; its delta is read as ``CudaDelta`` reads one (a host sync
    on the reader's current stream), and a read that the pack did not precede is an error."""

    name = "fakecuda"
    device_type = "any"
    encodes_deltas = True
    fake: FakeCuda | None = None  # set by the test
    readers: list[str] = []  # the threads that read a delta (set by the test)

    def pack_delta(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], base: torch.Tensor, word: int,
                   limit: int) -> tuple[torch.Tensor, Delta]:
        from asyncsync.packing.native import load_cpu_ops

        assert self.fake is not None
        load_cpu_ops()  # torch.ops.asyncsync: the encoder this fake kernel runs
        crc = torch.zeros((), dtype=torch.int64)
        delta = FakeCudaDelta(self.fake, self.readers)

        def kernel() -> None:
            value, changed, payload = torch.ops.asyncsync.pack_delta(list(tensors), list(offsets), base, word, limit)
            crc.fill_(value)
            delta.ran(payload, changed)

        self.fake.launch(kernel)
        return crc, delta

    def pack(self, tensors: Sequence[torch.Tensor], offsets: Sequence[int], out: torch.Tensor,
             checksum: bool) -> torch.Tensor | None:
        assert self.fake is not None
        crc = torch.zeros((), dtype=torch.int64)

        def kernel() -> None:
            value = TorchPackBackend().pack(tensors, offsets, out, checksum)
            if value is not None:
                crc.fill_(value)

        self.fake.launch(kernel)
        return crc if checksum else None


class FakeCudaDelta(Delta):
    def __init__(self, fake: FakeCuda, readers: list[str]):
        super().__init__(None, -1)
        self.fake, self.readers = fake, readers
        self._ran = threading.Event()
        self._read = False

    def ran(self, payload: torch.Tensor, changed: int) -> None:
        self.encoded, self.changed = (payload if payload.numel() else None), changed
        self._ran.set()

    def payload(self) -> torch.Tensor | None:
        if not self._read:
            self.fake.host_sync("reading a delta's plans")
            self.fake.check_device("reading a delta")
            self.fake.host_wait(self.fake.record())  # the reader's stream, up to here
            if not self._ran.is_set():
                raise FakeCudaError("a delta was read on a stream not ordered after its pack: garbage on a GPU")
            self.readers.append(threading.current_thread().name)
            self._read = True
        return self.encoded


class RefuseBeforeReceive:
    """An SGLang scheduler whose next ``update_weights_from_distributed`` after ``arm()`` names a
    group the server does not have: the scheduler's own code then refuses it before receiving."""

    def __init__(self, scheduler: Any):
        self.scheduler = scheduler
        self._armed = threading.Event()

    def arm(self) -> None:
        self._armed.set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)

    def update_weights_from_distributed(self, req: Any) -> tuple[bool, str]:
        if self._armed.is_set():
            self._armed.clear()
            req = dataclasses.replace(req, group_name=f"{req.group_name}.gone")
        return self.scheduler.update_weights_from_distributed(req)
