"""The background sync worker: the trainer pays for a snapshot copy, never for the network.

Lifecycle, as the trainer's loop drives it::

    worker = SyncWorker(memberships, plan, new_snapshot_buffers, streams, metrics)
    worker.wait_snapshot()          # before the parameters change: the last published version is copied
    worker.publish(view, version)   # O(1): a marker, a latest-wins slot, a wake-up (view: WeightsReader.read)
    worker.close()                  # drain: the last version reaches every server

Threads, one job each:
  * the snapshotter takes the latest published version and packs it (checksum fused) into a
    version-sized ``Snapshot`` that no sender is using, then offers it to every sender;
  * one sender per ``Membership`` (one for all servers, or one per server with ``group_per_server``)
    takes the newest snapshot offered to it and runs ``send_version`` from its buffers.
So the snapshot of version v is taken while v-1 is still on the wire, and the trainer never waits
for the wire. With a sender per server, a slow server only makes *its* versions supersede. A version
overtaken before it is snapshotted, or before any sender took it, is superseded: counted, never sent.
There are (senders + 2) snapshots, so one is always free: one per sender in flight, the newest
offered one, and the one being written. On a device, a snapshot is rewritten only after the
``sent`` markers of the senders that read it (trainer/streams.py has the streams and markers).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncsync.protocol.specs import BucketPlan
from asyncsync.trainer.buffers import PackedBuffers
from asyncsync.trainer.metrics import SyncMetrics, SyncResult
from asyncsync.trainer.source import WeightsView, check_layout
from asyncsync.trainer.streams import Marker, StreamSet
from asyncsync.transport.membership import Membership, lowest_member_version
from asyncsync.transport.send import send_version

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Snapshot:
    """One version in packed form: a flat buffer per bucket and each bucket's checksum."""

    buffers: PackedBuffers
    version: int = 0
    done: Marker = None  # the stream marker recorded after the copy
    sent: list[Marker] = field(default_factory=list)  # senders' markers after their broadcasts read it
    started: float = 0.0
    snapshot_s: float = 0.0
    taken: int = 0    # senders that took this version


@dataclass
class _Published:
    version: int
    view: WeightsView  # the tensors, as read on the trainer's thread at publish()
    ready: Marker     # the stream marker recorded by publish()


@dataclass
class _State:
    """Everything the trainer and the threads share, guarded by one condition variable."""

    published: _Published | None = None          # the latest-wins slot publish() fills
    ready: list[Snapshot | None] = field(default_factory=list)    # per sender: what it takes next (all the same newest snapshot)
    sending: list[Snapshot | None] = field(default_factory=list)  # per sender: what it is sending
    writing: Snapshot | None = None
    last_published: int = 0
    last_snapshot: int = 0
    last_marker: Marker = None
    closing: bool = False
    errors: list[str] = field(default_factory=list)


class SyncWorker:
    """Snapshotter and sender threads between the trainer and its ``Membership``s (see the module doc)."""

    def __init__(self, memberships: list[Membership], plan: BucketPlan, new_buffers: Callable[[], PackedBuffers],
                 streams: StreamSet, metrics: SyncMetrics):
        self.memberships, self.plan, self.streams, self.metrics = memberships, plan, streams, metrics
        self._sets = [Snapshot(new_buffers()) for _ in range(len(memberships) + 2)]
        self._cond = threading.Condition()
        self._s = _State(ready=[None] * len(memberships), sending=[None] * len(memberships))
        self._threads = [threading.Thread(target=self._guarded, args=(self._snapshot_loop,), name="asyncsync-snapshot",
                                          daemon=True)] + [
            threading.Thread(target=self._guarded, args=(self._send_loop, i), name=f"asyncsync-send-{i}", daemon=True)
            for i in range(len(memberships))
        ]
        for t in self._threads:
            t.start()

    @property
    def nbytes(self) -> int:
        """Bytes of the snapshots: async mode's memory cost on the trainer's device."""
        return sum(s.buffers.nbytes for s in self._sets)

    # -- trainer side ---------------------------------------------------------------------------

    def publish(self, view: WeightsView, version: int) -> None:
        """O(1) beyond reading the view: never waits for a server, the network or the previous sync."""
        marker = self.streams.params_ready()
        with self._cond:
            if version <= self._s.last_published:
                raise ValueError(f"version {version} is not newer than the last published {self._s.last_published}")
            if self._s.closing:
                raise RuntimeError("publish() after close()")
            overtaken = self._s.published
            self._s.published = _Published(version, view, marker)
            self._s.last_published = version
            self._cond.notify_all()
        self.metrics.count("published")
        if overtaken is not None:
            self.metrics.count("superseded")

    def wait_snapshot(self) -> None:
        """Hold the trainer until the last published version has been copied out (the only wait)."""
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: self._s.last_snapshot >= self._s.last_published or self._snapshotter_dead())
            marker = self._s.last_marker
        if marker is not None:
            self.streams.compute_wait(marker)
        self.metrics.stalled(time.perf_counter() - t0)

    def wait_served(self, version: int, timeout: float | None = None) -> bool:
        """Wait until every server in a group serves ``version`` or later (evicted ones excluded)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: lowest_member_version(self.memberships, version) >= version or self._s.closing, timeout)

    @property
    def errors(self) -> list[str]:
        with self._cond:
            return list(self._s.errors)

    def close(self) -> None:
        """Drain: every published version is sent or superseded, then the threads stop."""
        with self._cond:
            self._cond.wait_for(lambda: self._idle() or not all(t.is_alive() for t in self._threads))
            self._s.closing = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def _idle(self) -> bool:
        s = self._s
        return s.published is None and s.writing is None and not any(s.ready) and not any(s.sending)

    def _snapshotter_dead(self) -> bool:
        return not self._threads[0].is_alive()

    def _guarded(self, loop: Callable[..., None], *args: object) -> None:
        """Run a thread's loop; if it dies (a device error setting up its stream, say), say so in
        ``errors`` and wake everyone: publish, wait_snapshot and close never wait for a dead thread."""
        try:
            loop(*args)
        except BaseException as e:
            log.exception("%s stopped", threading.current_thread().name)
            with self._cond:
                self._s.errors.append(f"{threading.current_thread().name} stopped: {type(e).__name__}: {e}")
                self._cond.notify_all()

    # -- snapshotter thread ---------------------------------------------------------------------

    def _snapshot_loop(self) -> None:
        self.streams.enter_copy_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._s.published is not None or self._s.closing)
                if self._s.published is None:
                    return
                item, self._s.published = self._s.published, None
                busy = {id(x) for x in [*self._s.sending, *self._s.ready] if x is not None}
                target = next(s for s in self._sets if id(s) not in busy)
                self._s.writing = target
            try:
                self._take(item, target)
            except Exception as e:  # a changed layout, an unpackable tensor: report it, keep the trainer going
                log.error("snapshot of version %d failed: %s", item.version, e)
                with self._cond:
                    self._s.errors.append(f"version {item.version}: snapshot failed: {e}")
                    self._s.writing = None
                    self._s.last_snapshot = max(self._s.last_snapshot, item.version)
                    self._cond.notify_all()
                self.metrics.count("failed")
                continue
            with self._cond:
                waiting = next((r for r in self._s.ready if r is not None), None)
                if waiting is not None and waiting.taken == 0:
                    self.metrics.count("superseded")  # no sender took it before the next one came
                self._s.ready = [target] * len(self.memberships)
                self._s.writing = None
                self._s.last_snapshot = max(self._s.last_snapshot, item.version)
                self._s.last_marker = target.done
                self._cond.notify_all()

    def _take(self, item: _Published, target: Snapshot) -> None:
        """Enqueue the copy of ``item`` into ``target``; on a device it is "taken" once queued."""
        t0 = time.perf_counter()
        named = item.view.tensors()
        check_layout(self.plan, named, target.buffers.device)
        after = [item.ready, *target.sent]  # the step's writes, and the broadcasts that read target last
        target.done = self.streams.copy(lambda: target.buffers.pack_all(named), after=after)
        target.version, target.taken, target.sent = item.version, 0, []
        target.started = t0
        target.snapshot_s = time.perf_counter() - t0

    # -- sender threads -------------------------------------------------------------------------

    def _send_loop(self, i: int) -> None:
        self.streams.enter_sender_thread()
        members = self.memberships[i]
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._s.ready[i] is not None or (self._s.closing and self._idle()))
                snap = self._s.ready[i]
                if snap is None:
                    return
                self._s.ready[i] = None
                self._s.sending[i] = snap
                snap.taken += 1
                first = snap.taken == 1
            try:
                self.streams.comm_wait(snap.done)
                result = SyncResult(
                    snap.version, self.plan.total_bytes, len(self.plan.buckets), snapshot_s=snap.snapshot_s, started=snap.started
                )
                send_version(members, snap.version, self.plan, snap.buffers.packed(), result)
                self.metrics.record(result)
                if first:  # count a version once, however many senders carry it
                    self.metrics.count("sent" if result.server_versions else "failed")
            except Exception as e:
                log.exception("sync of version %d failed", snap.version)
                self.metrics.count("failed")
                with self._cond:
                    self._s.errors.append(f"version {snap.version}: {e}")
            sent = self.streams.sent()  # also after a failure: broadcasts may have been enqueued
            with self._cond:
                snap.sent.append(sent)
                self._s.sending[i] = None
                self._cond.notify_all()
