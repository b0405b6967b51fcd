"""Receiving a version on a worker thread while the receiver's own thread keeps serving.

A vLLM worker runs its forward passes on the thread that also runs the weight-transfer RPCs, so a
version received inside an RPC stops generation for the whole transfer. ``BackgroundReceive`` moves
the receive and its verification to a thread of its own and leaves the serving thread only the
switch::

    background = BackgroundReceive(stager, verify)
    background.join(spec, rank)                # the trainer's group, joined from the worker thread
    background.start(request, served_version)  # returns at once; receives and verifies on the worker
    ...                                        # the serving thread keeps generating meanwhile
    staged = background.take()                 # waits for it; raises VersionRejected, DataPlaneError
    apply(staged)                              # the receiver's business: reads the staging buffers
    background.released()                      # the buffers may be received into again
    background.cancel()                        # or: drop a version that will not be applied

At most one version is in flight, into the stager's one set of buffers (its arena): the receiver
copies each version out before the next one starts, so no second set is needed.

Where cores are scarce (vLLM on CPU keeps every core busy stepping) the receive competes with
generation for CPU time and memory bandwidth. The worker runs at a lower CPU priority than the
serving threads, and so do the data plane's threads of the group it joined (threads inherit their
creator's priority): a contended core goes to generation, and the receive takes longer instead.

Device semantics (docs/design.md, "GPU semantics"). The worker thread enters the stager's device
and makes a dedicated stream its current stream, so its collectives, checksums and waits never queue
behind, or hold up, the forward passes on the serving thread's stream. ``take`` makes the caller's
current stream wait on an event recorded on the worker's stream once the version was verified (the
apply is ordered after every byte landed); ``released`` records an event on the caller's stream
after the apply was issued, and the next receive's stream waits on it before its first collective
writes into the same buffers. Neither blocks a host thread. On the host (``HostRuntime``) work is
synchronous and both are no-ops. The CUDA path is written to these semantics and checked against
``tests/fakes.FakeCuda``; it has not run on a GPU.

A receive still running cannot be interrupted on gloo (aborting the receiver's own group does not
release a pending receive); it ends when the trainer's side closes, which a trainer that abandons a
version does at once, or at its deadline. ``cancel`` leaves the group and waits for that; a receive
that outlives the wait makes the next ``start`` refuse until it ended (the one worker thread runs one
receive at a time anyway), so two never write the same buffers.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from asyncsync.protocol.device import Runtime
from asyncsync.protocol.group import DataPlaneError
from asyncsync.protocol.staging import BucketStager, StagedVersion, VersionRejected
from asyncsync.protocol.wire import GroupSpec, UpdateRequest

log = logging.getLogger(__name__)

CANCEL_WAIT_S = 10.0  # how long ``cancel`` waits for a receive to end once the group was left
BACKGROUND_NICE = 10  # added to a receiving thread's nice value: serving threads win a contended core


def lower_thread_priority(by: int = BACKGROUND_NICE) -> None:
    """Lower the calling thread's CPU priority (Linux schedules threads by their own nice value, and
    threads it creates inherit it). Where it cannot be lowered the thread runs as it is: a matter of
    speed, not of correctness."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (AttributeError, OSError) as e:  # not Linux, or not allowed
        log.debug("thread keeps its priority: %s", e)


def enter_background_thread(runtime: Runtime) -> None:
    """The first call of a thread that receives versions while other threads of the process serve
    requests: it enters the runtime's device and lowers its CPU priority, so that where cores are
    scarce the receive, and the data plane's threads of a group this thread creates, yield to
    generation instead of slowing it down."""
    runtime.enter_thread()
    lower_thread_priority()


class BackgroundReceive:
    """One version at a time received and verified into ``stager``'s buffers on a worker thread.

    ``verify(staged)`` runs on the worker after the stager's own checks and may raise
    ``VersionRejected`` (the receiver's extra rules). Every method is called from the serving thread.
    ``join`` also runs on the worker, so the group's own threads inherit its lower priority.
    """

    def __init__(self, stager: BucketStager, verify: Callable[[StagedVersion], None] | None = None):
        self.stager = stager
        self.runtime = stager.runtime
        self._verify = verify
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="asyncsync-receive", initializer=self._enter)
        self._released: Any = None  # event after the last apply, on the applying stream
        self._pending: Future[tuple[StagedVersion, Any]] | None = None
        self._last: Future[tuple[StagedVersion, Any]] | None = None  # the last receive started
        self.version: int | None = None  # the version in flight

    def _enter(self) -> None:
        enter_background_thread(self.runtime)
        self.runtime.set_stream(self.runtime.new_stream())  # the worker's own stream, for its whole life

    @property
    def pending(self) -> bool:
        """A version was started and has been neither taken nor cancelled."""
        return self._pending is not None

    def join(self, specs: GroupSpec | Sequence[GroupSpec], rank: int) -> None:
        """Join the trainer's groups (``BucketStager.join``; on the worker, blocks until joined). A
        version in flight in the previous groups can never complete: it is dropped first."""
        self.cancel()
        self._worker.submit(self.stager.join, specs, rank).result()

    def start(self, request: UpdateRequest, served_version: int) -> None:
        """Start receiving ``request``'s buckets; returns at once. Raises ``VersionRejected`` when a
        version is already in flight or an earlier, discarded receive is still running."""
        if self._pending is not None:
            raise VersionRejected(f"version {request.version} rejected: version {self.version} is still being "
                                  "received in the background; finish or discard it first")
        if self._last is not None and not self._last.done():
            raise VersionRejected(f"version {request.version} rejected: a discarded receive is still waiting for "
                                  "its data (until its deadline); send the version again after it")
        self._pending = self._last = self._worker.submit(self._receive, request, served_version, self._released)
        self.version = request.version
        self._deadline_s = request.deadline_s(len(request.buckets))

    def _receive(self, request: UpdateRequest, served_version: int, released: Any) -> tuple[StagedVersion, Any]:
        if released is not None:
            self.runtime.wait_event(released)  # the last apply has read the buffers by then
        staged = self.stager.receive(request, served_version)
        if self._verify is not None:
            self._verify(staged)
        return staged, self.runtime.record()

    def take(self) -> StagedVersion:
        """The version received and verified; the caller's current stream is ordered after it. Nothing
        is pending afterwards, whatever happens (a failed version is not taken twice). Raises what the
        receive raised, or ``DataPlaneError`` when it did not end within the request's largest
        deadline (the caller calls this once the trainer's broadcasts are over); it is then dropped."""
        future, self._pending = self._pending, None
        if future is None:
            raise VersionRejected("no version is being received in the background: nothing to finish")
        try:
            staged, ready = future.result(self._deadline_s)
        except FutureTimeout:
            self._stop(future)
            raise DataPlaneError(f"version {self.version} was not received within {self._deadline_s:.1f}s of the "
                                 "trainer's last broadcast; discarded") from None
        self.runtime.wait_event(ready)
        return staged

    def released(self) -> None:
        """The apply of the version taken last has been issued on the caller's current stream."""
        self._released = self.runtime.record()

    def cancel(self) -> None:
        """Drop the version in flight, if any, without applying it; a receive still running is stopped
        by leaving the group (the trainer forms a new one)."""
        future, self._pending = self._pending, None
        if future is not None:
            self._stop(future)

    def _stop(self, future: Future[tuple[StagedVersion, Any]]) -> None:
        if not future.done():
            self.stager.close(broken=True)
        try:
            future.result(CANCEL_WAIT_S)
        except FutureTimeout:
            log.warning("a discarded background receive of version %s is still waiting for its data", self.version)
        except BaseException as e:  # it was dropped: its outcome matters to no one
            log.info("discarded version %s: %s", self.version, e)

    def close(self) -> None:
        """Drop the version in flight and leave the group (``join`` may follow)."""
        self.cancel()
        self.stager.close()
