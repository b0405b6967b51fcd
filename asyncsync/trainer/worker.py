"""The background sync worker: the trainer pays for a snapshot copy, never for the network.

Lifecycle, as the trainer's loop drives it (on every rank of a sharded trainer, like a collective)::

    worker = SyncWorker(senders, plan, new_snapshot_buffers, streams, metrics, ranks, served, checked)
    worker.wait_snapshot()          # before the parameters change: the last published version is copied
    worker.publish(view, version)   # O(1): a marker, a latest-wins slot, a wake-up (view: WeightsReader.read)
    worker.close()                  # drain: the last version taken reaches every server

Threads, one job each:
  * the snapshotter takes the latest published version and packs it (checksum fused) into the
    snapshot as soon as the snapshot is free (no sender is reading it), then offers it to every
    sender. A version whose snapshot is still being sent when the trainer reaches its next boundary
    (``wait_snapshot``: it is about to change the weights) is skipped (``superseded``): the trainer
    never waits for the wire. ``close`` is a boundary with no change after it: the last version
    waits for the snapshot and is sent;
  * one sender per data path (one for all servers, or one per server with ``group_per_server``)
    takes the newest snapshot offered to it and sends it (``transport.send``).
Memory is the budget: one snapshot (a sharded trainer's rank: of its local shards), or senders + 1
with ``group_per_server`` so that a slow server only makes *its* versions supersede. On a device, a
snapshot is rewritten only after the ``sent`` markers of the senders that read it
(trainer/streams.py has the streams and markers).

A sharded trainer's snapshotters agree at each version (``TrainerRanks.all_agree`` on the sync's
own boundary group): the version is taken on every rank or on none, so every rank's sender sends the
same versions in the same order. ``publish`` there first waits for the previous version's decision
(the ``wait_snapshot`` the loop calls anyway), so no rank's latest-wins slot skips a version
another rank's takes. A rank that is gone (``TrainerRankLost``) stops the worker: ``publish`` and
``wait_snapshot`` then raise it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncsync.metrics import Footprint, SyncMetrics, SyncResult
from asyncsync.protocol.specs import LAYOUT_REFUSED, BucketPlan
from asyncsync.ranks import TrainerRanks, TrainerRankLost
from asyncsync.trainer.roles import Sender
from asyncsync.trainer.source import WeightsView
from asyncsync.trainer.streams import Marker, StreamSet

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Slot:
    """One snapshot's buffers and what the threads know of the version in them."""

    buffers: Any  # a Snapshot kind (trainer.buffers, one process) or ShardedBuffers (a sharded trainer's rank, a host snapshot)
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
    ready: list[Slot | None] = field(default_factory=list)    # per sender: what it takes next (all the same newest snapshot)
    sending: list[Slot | None] = field(default_factory=list)  # per sender: what it is sending
    writing: Slot | None = None
    last_published: int = 0
    last_snapshot: int = 0
    last_marker: Marker = None
    closing: bool = False
    errors: list[str] = field(default_factory=list)
    lost: str | None = None  # why another trainer rank is gone: the worker stopped
    boundary: int = 0        # the trainer is about to change the weights: versions up to this one are taken or skipped now
    draining: bool = False   # close(): the pending version waits for a free snapshot, then is taken


class SyncWorker:
    """Snapshotter and sender threads between the trainer and its data paths (see the module doc)."""

    def __init__(self, senders: list[Sender], plan: BucketPlan, new_buffers: Callable[[], Any], streams: StreamSet,
                 metrics: SyncMetrics, ranks: TrainerRanks, served: Callable[[int], int],
                 checked: Callable[[int, SyncResult], None] = lambda i, result: None,
                 reachable: Callable[[], bool] = lambda: True):
        self.senders, self.plan, self.streams, self.metrics = senders, plan, streams, metrics
        self.ranks, self.served, self.checked, self.reachable = ranks, served, checked, reachable
        self._sets = [Slot(new_buffers()) for _ in range(1 if len(senders) == 1 else len(senders) + 1)]
        self._cond = threading.Condition()
        self._s = _State(ready=[None] * len(senders), sending=[None] * len(senders))
        self._threads = [threading.Thread(target=self._guarded, args=(self._snapshot_loop,), name="asyncsync-snapshot",
                                          daemon=True)] + [
            threading.Thread(target=self._guarded, args=(self._send_loop, i), name=f"asyncsync-send-{i}", daemon=True)
            for i in range(len(senders))
        ]
        for t in self._threads:
            t.start()

    @property
    def footprint(self) -> Footprint:
        """The snapshots' buffers: async mode's memory cost (the snapshots are the delta baseline,
        each version encoded against the one before it, or a sharded rank's owned buckets are)."""
        return sum((s.buffers.footprint for s in self._sets), Footprint())

    # -- trainer side ---------------------------------------------------------------------------

    def publish(self, view: WeightsView, version: int) -> None:
        """O(1) beyond reading the view: never waits for a server, the network or the previous sync."""
        marker = self.streams.params_ready()
        with self._cond:
            if self.ranks.world > 1:  # every rank decides on every version (module doc)
                self._decided()
            self._raise_lost()
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
            self._decided()
            self._raise_lost()
            marker = self._s.last_marker
        if marker is not None:
            self.streams.compute_wait(marker)
        self.metrics.stalled(time.perf_counter() - t0)

    def wait_served(self, version: int, timeout: float | None = None) -> bool:
        """Wait until every server in a group serves ``version`` or later (evicted ones excluded):
        True then; False at ``timeout``, at close, or as soon as no server can reach it (every one
        evicted or refusing this plan's layout: ``errors`` says why)."""
        with self._cond:
            self._cond.wait_for(lambda: self.served(version) >= version or self._s.closing or not self.reachable(),
                                timeout)
            return self.served(version) >= version

    def poke(self) -> None:
        """Something ``served`` reads changed outside the senders (an adapter version was loaded)."""
        with self._cond:
            self._cond.notify_all()

    @property
    def errors(self) -> list[str]:
        with self._cond:
            return list(self._s.errors)

    def report(self, error: str) -> None:
        """Add ``error`` to ``errors`` (a check of a sent version that failed: ``trainer/verify.py``)."""
        with self._cond:
            self._s.errors.append(error)

    def _decided(self) -> None:
        """(Holding the lock.) The boundary: the last published version is taken or skipped now."""
        if self._s.last_snapshot < self._s.last_published:
            # A version number, not a flag: a boundary met while the snapshotter was already taking
            # the version must not skip the next one, published after it (close() drains that one).
            self._s.boundary = self._s.last_published
            self._cond.notify_all()
        self._cond.wait_for(lambda: self._s.last_snapshot >= self._s.last_published or self._snapshotter_dead())

    def close(self) -> None:
        """Drain: the last published version is taken once the snapshot is free (the trainer changes
        no weights after its last publish) and sent, then the threads stop."""
        with self._cond:
            self._s.draining = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._idle() or not all(t.is_alive() for t in self._threads))
            self._s.closing = True
            self._cond.notify_all()
        for t in self._threads:
            t.join()

    def _idle(self) -> bool:
        s = self._s
        return s.published is None and s.writing is None and not any(s.ready) and not any(s.sending)

    @property
    def lost(self) -> str | None:
        """Why another trainer rank is gone, when it is: the worker stopped."""
        with self._cond:
            return self._s.lost

    def _raise_lost(self) -> None:
        if self._s.lost is not None:
            raise TrainerRankLost(self._s.lost)

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
                if isinstance(e, TrainerRankLost):
                    self._s.lost = self._s.lost or str(e)
                self._cond.notify_all()

    # -- snapshotter thread ---------------------------------------------------------------------

    def _free(self) -> Slot | None:
        """(Holding the lock.) A snapshot no sender is reading or about to read."""
        busy = {id(x) for x in [*self._s.sending, *self._s.ready] if x is not None}
        return next((s for s in self._sets if id(s) not in busy), None)

    def _at_boundary(self) -> bool:
        """(Holding the lock.) The trainer waits on the pending version: take it or skip it now."""
        return self._s.published is not None and self._s.published.version <= self._s.boundary

    def _snapshot_loop(self) -> None:
        self.streams.enter_copy_thread()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._s.closing or (self._s.published is not None and (
                    self._free() is not None or (self._at_boundary() and not self._s.draining))))
                if self._s.published is None:
                    return
                item, self._s.published = self._s.published, None
                target = self._free()
                self._s.writing = target
            if not self.ranks.all_agree(target is not None):  # every rank's snapshot is free, or none takes it
                log.debug("version %d skipped: the snapshot is still being sent", item.version)
                self.metrics.count("superseded")
                with self._cond:
                    self._s.writing = None
                    self._s.last_snapshot = max(self._s.last_snapshot, item.version)
                    self._cond.notify_all()
                continue
            assert target is not None
            failure: Exception | None = None
            try:
                self._take(item, target)
            except Exception as e:  # a changed layout, an unpackable tensor: report it, keep the trainer going
                failure = e
            if not self.ranks.all_agree(failure is None):  # a version half the ranks could not copy is sent by none
                reason = f"snapshot failed: {failure}" if failure else "snapshot failed on another trainer rank"
                log.error("version %d: %s", item.version, reason)
                with self._cond:
                    self._s.errors.append(f"version {item.version}: {reason}")
                    self._s.writing = None
                    self._s.last_snapshot = max(self._s.last_snapshot, item.version)
                    self._cond.notify_all()
                self.metrics.count("failed")
                continue
            with self._cond:
                waiting = next((r for r in self._s.ready if r is not None), None)
                if waiting is not None and waiting.taken == 0:
                    self.metrics.count("superseded")  # no sender took it before the next one came
                self._s.ready = [target] * len(self.senders)
                self._s.writing = None
                self._s.last_snapshot = max(self._s.last_snapshot, item.version)
                self._s.last_marker = target.done
                self._cond.notify_all()

    def _take(self, item: _Published, target: Slot) -> None:
        """Enqueue the copy of ``item`` into ``target``; on a device it is "taken" once queued."""
        t0 = time.perf_counter()
        named = item.view.tensors()
        after = [item.ready, *target.sent]  # the step's writes, and the broadcasts that read target last
        target.done = self.streams.copy(lambda: target.buffers.pack_all(named, item.version), after=after)
        target.version, target.taken, target.sent = item.version, 0, []
        target.started = t0
        target.snapshot_s = time.perf_counter() - t0

    # -- sender threads -------------------------------------------------------------------------

    def _send_loop(self, i: int) -> None:
        self.streams.enter_sender_thread()
        send = self.senders[i]
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
                t0 = time.perf_counter()
                source = snap.buffers.packed()  # a sharded trainer's ranks encode their deltas here, together
                result.pack_s = time.perf_counter() - t0
                told = send(snap.version, source, result)
                result = told or result
                if told is not None:
                    self.checked(i, result)
                self.metrics.record(result)
                if first:  # count a version once, however many senders carry it
                    self.metrics.count("sent" if result.server_versions else "failed")
                refusal = lasting_refusal(result)
                if refusal is not None:
                    log.error("version %d: %s", snap.version, refusal)
                    with self._cond:
                        self._s.errors.append(f"version {snap.version}: {refusal}")
            except TrainerRankLost:
                raise  # the sync cannot go on (``_guarded`` stops the worker)
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


def lasting_refusal(result: SyncResult) -> str | None:
    """Why no server took ``result``'s version, when every one that answered refused it for its
    layout (``specs.LAYOUT_REFUSED``): a mistake that repeats at every version, so an error of the
    sync rather than a server's transient refusal."""
    if result.server_versions or not result.failures or not all(LAYOUT_REFUSED in f for f in result.failures.values()):
        return None
    url, reason = next(iter(result.failures.items()))
    return (f"refused by every server for its layout, as every version of this plan will be ({url}: {reason}); "
            "connect() again with the layout the servers load (layout: checkpoint, or convert=)")
