"""Receiving a version on a worker thread while the receiver's own thread keeps serving.

A vLLM worker runs its forward passes on the thread that also runs the weight-transfer RPCs, so a
version received inside an RPC stops generation for the whole transfer. ``BackgroundReceive`` moves
the receive and its verification to a thread of its own and leaves the serving thread only the
switch::

    background = BackgroundReceive(stager, verify)
    background.join(spec, rank)                # the trainer's group, joined from the worker thread
    background.start(request, served_version)  # returns at once; receives and verifies on the worker
    ...                                        # the serving thread keeps generating meanwhile
    staged = background.take(finish_window_s(request, base_s))  # waits for it; raises VersionRejected,
                                               # DataPlaneError
    apply(staged)                              # the receiver's business: reads the staging buffers
    background.released()                      # the buffers may be received into again
    background.cancel()                        # or: drop a version that will not be applied

At most one version is in flight, into the stager's one set of buffers (its arena): the receiver
copies each version out before the next one starts, so no second set is needed.

Where cores are scarce the receive competes with generation for CPU time and memory bandwidth. The
worker runs on the cores the serving thread is not bound to, if it is bound (vLLM on CPU binds each
worker to its own cores), and at a lower CPU priority than the serving threads; so do the data
plane's threads of the group it joined (threads inherit both from their creator): a contended core
goes to generation, and the receive takes longer instead.

Device semantics (docs/design.md, "GPU semantics"). The worker thread enters the stager's device
and makes a dedicated stream its current stream, so its collectives, checksums and waits never queue
behind, or hold up, the forward passes on the serving thread's stream. ``take`` makes the caller's
current stream wait on an event recorded on the worker's stream once the version was verified (the
apply is ordered after every byte landed); ``released`` records an event on the caller's stream
after the apply was issued, and the next receive's stream waits on it before its first collective
writes into the same buffers. Neither blocks a host thread. On the host (``HostRuntime``) work is
synchronous and both are no-ops. The CUDA path is written to these semantics and checked against
``tests/fakes.FakeCuda``; it has not run on a GPU.

A receive still running may not be interruptible (on gloo neither the receiver leaving its group nor
the trainer dropping its own releases a receive already matched to a send: docs/faults.md); it then
ends at its own deadline. ``cancel`` leaves the group and returns at once (it runs in an RPC that
holds the engine); until the dropped receive ended, ``start`` refuses, so two receives never write
the same buffers.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from asyncsync.protocol.device import Runtime
from asyncsync.protocol.group import DataPlaneError
from asyncsync.protocol.specs import TensorSpec
from asyncsync.protocol.admission import VersionRejected
from asyncsync.protocol.stager import BucketStager
from asyncsync.protocol.staging import StagedVersion
from asyncsync.protocol.wire import GroupSpec, UpdateRequest

log = logging.getLogger(__name__)

BACKGROUND_NICE = 10  # added to a receiving thread's nice value: serving threads win a contended core


def finish_window_s(request: UpdateRequest, base_s: float) -> float:
    """How long the call that ends a background update (``take``, after the trainer's own broadcasts
    are over) may wait for ``request``'s version: ``base_s`` (the last bucket's verification), plus
    what the trainer added to the first bucket's deadline over the others' for the relay hops above
    this server (``transport.send.relayed_requests``). A relayed server's last frame arrives as many
    hops after the trainer's last broadcast as its first did after the trainer's first, so its
    window grows with its depth; a direct server's stays ``base_s`` (a first bucket larger than the
    others adds its own excess; a version of one bucket, its deadline)."""
    deadlines = request.deadlines_s
    if not deadlines:
        return base_s
    return base_s + max(0.0, deadlines[0] - max(deadlines[1:], default=0.0))


def lower_thread_priority(by: int = BACKGROUND_NICE) -> None:
    """Lower the calling thread's CPU priority (Linux schedules threads by their own nice value, and
    threads it creates inherit it). Where it cannot be lowered the thread runs as it is: a matter of
    speed, not of correctness."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (AttributeError, OSError) as e:  # not Linux, or not allowed
        log.debug("thread keeps its priority: %s", e)


def leave_serving_cores() -> None:
    """Run the calling thread on the machine's cores its creator was not bound to, if there are any.
    An engine that binds its compute threads to cores (vLLM on CPU binds each worker to its own and
    leaves the rest to the front end) would otherwise have the receive compete on exactly those."""
    try:
        bound = os.sched_getaffinity(0)  # on Linux, the calling thread's: inherited from its creator
        spare = set(range(os.cpu_count() or 0)) - bound
        if spare:
            os.sched_setaffinity(0, spare)
    except (AttributeError, OSError) as e:  # not Linux, or those cores are not this process's to use
        log.debug("thread keeps its cores: %s", e)


def enter_background_thread(runtime: Runtime) -> None:
    """The first call of a thread that receives versions while other threads of the process serve
    requests: it enters the runtime's device, moves off the cores the serving threads are bound to
    (where they are bound) and lowers its CPU priority, so that where cores are scarce the receive,
    and the data plane's threads of a group this thread creates (which inherit both), yield to
    generation instead of slowing it down."""
    runtime.enter_thread()
    leave_serving_cores()
    lower_thread_priority()


class BackgroundReceive:
    """One version at a time received and verified into ``stager``'s buffers on a worker thread.

    ``verify(staged)`` runs on the worker after the stager's own checks and may raise
    ``VersionRejected`` (the receiver's extra rules). Every method is called from the serving thread
    and none waits for data except ``take``. ``join`` runs on a worker too, so the group's own
    threads inherit its cores and priority.
    """

    def __init__(self, stager: BucketStager, verify: Callable[[StagedVersion], None] | None = None):
        self.stager = stager
        self.runtime = stager.runtime
        self._verify = verify
        self._stream: Any = None    # the workers' dedicated stream, made by the first worker
        self._released: Any = None  # event after the last apply, on the applying stream
        self._pending: Future[tuple[StagedVersion, Any]] | None = None
        self._last: Future[tuple[StagedVersion, Any]] | None = None  # the last receive started
        self.version: int | None = None  # the version in flight

    @property
    def pending(self) -> bool:
        """A version was started and has been neither taken nor cancelled."""
        return self._pending is not None

    def join(self, specs: GroupSpec | Sequence[GroupSpec], rank: int, relay: Sequence[GroupSpec] = ()) -> None:
        """Join the trainer's groups and the relay edges below (``JoinedGroups.join``; from a worker,
        returns once joined). A version in flight in the previous groups can never complete: it is
        dropped first."""
        self.cancel()
        self._spawn(self.stager.joined.join, specs, rank, True, relay).result()

    def start(self, request: UpdateRequest, served_version: int,
              carrying: Mapping[str, TensorSpec] | None = None) -> None:
        """Start receiving ``request``'s buckets (checked against ``carrying``, default the stager's tensors);
        returns at once. Raises ``VersionRejected`` when a version is already in flight or an
        earlier, dropped receive is still running."""
        if self._pending is not None:
            raise VersionRejected(f"version {request.version} rejected: version {self.version} is still being "
                                  "received in the background; finish or discard it first")
        if self._last is not None and not self._last.done():
            raise VersionRejected(f"version {request.version} rejected: a discarded receive is still waiting for "
                                  "its data (until its deadline); send the version again after it")
        self._pending = self._last = self._spawn(self._receive, request, served_version, self._released, carrying)
        self.version = request.version

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()

        def run() -> None:
            try:
                enter_background_thread(self.runtime)
                if self._stream is None:
                    self._stream = self.runtime.new_stream()
                self.runtime.set_stream(self._stream)
                future.set_result(fn(*args))
            except BaseException as e:  # reported to whoever waits on the future
                future.set_exception(e)

        threading.Thread(target=run, name="asyncsync-receive", daemon=True).start()
        return future

    def _receive(self, request: UpdateRequest, served_version: int, released: Any,
                 carrying: Mapping[str, TensorSpec] | None) -> tuple[StagedVersion, Any]:
        if released is not None:
            self.runtime.wait_event(released)  # the last apply has read the buffers by then
        staged = self.stager.receive(request, served_version, carrying)
        if self._verify is not None:
            self._verify(staged)
        return staged, self.runtime.record()

    def take(self, timeout_s: float | None = None) -> StagedVersion:
        """The version received and verified; the caller's current stream is ordered after it. Nothing
        is pending afterwards, whatever happens (a failed version is not taken twice). Raises what the
        receive raised, or ``DataPlaneError`` when it did not end within ``timeout_s`` (it is then
        dropped: the caller calls this once the trainer's broadcasts are over, so only the
        verification of the last bucket should be left)."""
        future, self._pending = self._pending, None
        if future is None:
            raise VersionRejected("no version is being received in the background: nothing to finish")
        try:
            staged, ready = future.result(timeout_s)
        except FutureTimeout:
            self._drop(future)
            raise DataPlaneError(f"version {self.version} was not received within {timeout_s:.1f}s of the "
                                 "trainer's last broadcast; discarded") from None
        self.runtime.wait_event(ready)
        return staged

    def released(self) -> None:
        """The apply of the version taken last has been issued on the caller's current stream."""
        self._released = self.runtime.record()

    def cancel(self) -> None:
        """Drop the version in flight, if any, without applying it (never waits for it). A receive
        still running leaves the group (the trainer forms a new one) and blocks the next ``start``
        until it ended."""
        future, self._pending = self._pending, None
        if future is not None:
            self._drop(future)

    def _drop(self, future: Future[tuple[StagedVersion, Any]]) -> None:
        if not future.done():
            self.stager.joined.leave(broken=True)
            log.info("dropped version %s while it was being received", self.version)

    def close(self) -> None:
        """Drop the version in flight and leave the group (``join`` may follow)."""
        self.cancel()
        self.stager.joined.leave()
