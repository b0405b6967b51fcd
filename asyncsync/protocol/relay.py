"""A relaying receiver's part: every payload of a version it receives, on to the servers below it.

With ``fanout`` other than ``direct`` the trainer plans a tree over its servers (``transport.relay``).
Each tree edge has two ranks, the upper server its rank 0: for host weights an authenticated TCP
stream the server below reads with bounded, checked reads (``protocol.stream``: no upper end can
make it abort), for CUDA weights a two-rank NCCL group (written, never run here: no GPU). A server
with servers below it forwards each payload (a bucket, its delta, then the checksum manifest) into
every edge as soon as the payload has landed, frame header first (sealed for that edge, as the
trainer sealed it for its group), while the next payload is still arriving: a version crosses each
link once, pipelined per bucket.

Nothing is forwarded before it arrived whole (a wait returns only once the bytes are in the buffer),
and nothing is judged on the way: each server below verifies every bucket itself, against the
CRC32C manifest that travels the same way (what a faulty link or buffer changes) and, with
``digest``, against the trainer's digests, which reach each server over its own control channel (what
a relay that forges a bucket and its manifest changes: ``protocol.digest``), so a hop that corrupts
a bucket is refused by every server below it. An edge that fails (the server below died, or missed a deadline) is dropped and
never fails the version of the server above: the trainer hears of the loss from the servers below
(no answer, or a failed update) and sends them the version again (``transport.send``). Likewise an
edge that cannot form at ``init_group`` (the server below unreachable from this one) is left out
and never fails this server's join: the server below fails its own, and the trainer plans it below
another parent (``transport.relay.Relays.blame``).

    edges = Edges(); edges.join(specs, runtime)      # at init_group, as rank 0 of each edge (best effort)
    forward = edges.forward(frames, runtime)        # per version, once the last one's are done
    for each payload i, once it landed:
        forward.send(i, payload, deadline_s)
    ...                       # the server verifies and answers for its own copy meanwhile
    edges.wait_forwards()     # before the buffers are received into again: every forward done or
                              # failed (a failed edge is closed and dropped)
    edges.close(broken)       # leaving the epoch; after a failure the servers below hear it is lost
                              # (a stream's end is the news itself; an NCCL edge gets a LOST header)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from asyncsync.protocol.device import Runtime
from asyncsync.protocol.frames import VersionFrames
from asyncsync.protocol.group import Abandoner, DataPlaneError, DataPlaneGroup
from asyncsync.protocol.stream import StreamEdge, join_member
from asyncsync.protocol.wire import GroupSpec

Edge = DataPlaneGroup | StreamEdge

log = logging.getLogger(__name__)

LOST_S = 5.0  # how long a failing server waits for the servers below to take the news (and what was before it)


class Forward:
    """Forwards one version's payloads into ``edges`` (this server is rank 0 of each).

    ``in_flight``: how many payloads may still be on their way down when the next one is sent (None:
    all of them, so a slow server below never holds this one's receive; 0 where the payload's buffer
    is reused at once, a device ring's slot). The payloads' buffers must stay untouched until
    ``finish`` returns.

    ``send`` (the receiving thread) and ``abandon`` (maybe another: a cancel on vLLM's serving
    thread) take one lock around what they enqueue, so a LOST header never lands between a header
    and its payload: the server below would take the payload for a header, which gloo answers by
    aborting it; and the edges are never changed while the other goes through them."""

    def __init__(self, edges: Sequence[Edge], frames: VersionFrames, runtime: Runtime,
                 in_flight: int | None = None):
        self.edges = list(edges)
        self.frames, self.runtime, self.in_flight = frames, runtime, in_flight
        self._pending: list[list[tuple[Edge, Any, Any, torch.Tensor]]] = []
        self._lock = threading.RLock()

    def send(self, index: int, payload: torch.Tensor, deadline_s: float | None) -> None:
        """Forward payload ``index`` (landed whole) into every edge still up, after its frame header
        (sealed for each edge)."""
        if not self.edges:
            return
        header = self.frames.header(index, payload)
        sent = []
        with self._lock:
            for edge in list(self.edges):
                sealed = self.runtime.upload(edge.seal.tensor(header))
                try:
                    sent.append((edge, edge.broadcast_async(sealed, deadline_s),
                                 edge.broadcast_async(payload, deadline_s), sealed))
                except DataPlaneError as e:
                    self._drop(edge, e)
            self._pending.append(sent)
        if self.in_flight is not None:
            self._settle(self.in_flight)

    def finish(self) -> None:
        """Until every forward is done or its edge dropped."""
        self._settle(0)

    def _settle(self, in_flight: int) -> None:
        """Wait for the oldest forwards until at most ``in_flight`` are pending (never with the lock
        held: ``abandon`` may run meanwhile, and empties them)."""
        while True:
            with self._lock:
                if len(self._pending) <= in_flight:
                    return
                sent = self._pending.pop(0)
            self._wait_for(sent)

    def abandon(self, lost: bool) -> None:
        """Close every edge and let go of every forward in flight. ``lost``: this server's receive
        failed, so each server below must hear the version is lost at once and do the same below it.
        A stream's end is that news (the read below fails the moment it is shut). An NCCL edge is
        first sent a frame header that says so (``VersionFrames.lost``), after the forwards already
        in flight, on every edge at once and waited for together, at most ``LOST_S``: a group's
        receive does not fail when its peer only aborts the group, whose connections stay open
        while anything holds it, and the servers below would wait out their deadlines. The edges are
        taken first, under the lock: a send failing meanwhile on another thread drops none."""
        header = self.frames.lost() if lost else None
        with self._lock:
            edges, self.edges, self._pending = self.edges, [], []
            told = []
            for edge in edges:
                if header is not None and isinstance(edge, DataPlaneGroup):
                    try:
                        told.append((edge, edge.broadcast_async(self.runtime.upload(edge.seal.tensor(header)),
                                                                LOST_S)))
                    except DataPlaneError as e:  # that server is gone already
                        log.debug("relay edge %s: %s", edge.spec.group_name, e)
            for edge, work in told:
                try:
                    edge.wait(work)
                except DataPlaneError as e:
                    log.debug("relay edge %s: %s", edge.spec.group_name, e)
            for edge in edges:
                edge.close(broken=True)

    def _wait_for(self, sent: list[tuple[Edge, Any, Any, torch.Tensor]]) -> None:
        for edge, header, payload, _ in sent:
            if edge not in self.edges:
                continue
            try:
                edge.wait(payload)
                edge.wait(header)
            except DataPlaneError as e:
                with self._lock:
                    self._drop(edge, e)

    def _drop(self, edge: Edge, error: Exception) -> None:
        """The server below is lost for this epoch; this server's own version goes on (called with
        the lock held)."""
        if edge not in self.edges:  # abandoned meanwhile (a cancel on another thread)
            return
        self.edges.remove(edge)
        edge.close(broken=True)
        self._pending = [[s for s in sent if s[0] is not edge] for sent in self._pending]  # its works let go
        log.warning("relay edge %s dropped: %s (the trainer sends the servers below it the version again)",
                    edge.spec.group_name, error)


class Edges:
    """A relaying receiver's edges to the servers below it, across the versions of one epoch: each
    version's ``Forward`` goes over the edges still up, and is waited for before the next one."""

    def __init__(self) -> None:
        self.groups: list[Edge] = []
        self._last: Forward | None = None  # kept once done: a failure before the next version's frames uses it

    def join(self, specs: Sequence[GroupSpec], runtime: Runtime, warmup: bool = True,
             abandoner: Abandoner | None = None) -> list[str]:
        """Join each edge as its rank 0 (their rendezvous is in the trainer's store), best effort: an
        edge that cannot form (the server below dead, or unreachable from here) is left out and
        logged, never this server's failure, which would evict a healthy server with its child; the
        server below fails its own join, and the trainer plans it below another parent. A join
        ``abandoner`` gave up (a newer ``init_group``) still raises. Returns why each edge left out
        failed."""
        abandoned = abandoner.watch() if abandoner is not None else (lambda: False)
        # Streams are joined at once, each on a thread: one dead child must not outlast a sibling's
        # listener. Process groups (NCCL) one after another: c10d's group registry is not thread-safe.
        at_once = len(specs) if all(spec.backend == "stream" for spec in specs) else 1
        with ThreadPoolExecutor(max(1, at_once), thread_name_prefix="asyncsync-edge-join") as pool:
            joins = [pool.submit(join_member, spec, 0, runtime, warmup, abandoner, hosts_store=False) for spec in specs]
        failed, gave_up = [], None
        for spec, join in zip(specs, joins):
            try:
                self.groups.append(join.result())
            except DataPlaneError as e:
                if abandoned():
                    gave_up = gave_up or e
                    continue
                failed.append(f"{spec.group_name}: {e}")
                log.warning("relay edge %s left out: %s (the server below is planned below another)",
                            spec.group_name, e)
        if gave_up is not None:
            raise gave_up  # the edges that did form are in self.groups: the caller's leave closes them
        return failed

    def forward(self, frames: VersionFrames, runtime: Runtime, in_flight: int | None = None) -> Forward:
        """The next version's forwarding (call ``wait_forwards`` first)."""
        self._last = Forward(self.groups, frames, runtime, in_flight)
        return self._last

    def wait_forwards(self) -> None:
        """Until the last version's forwards are done; an edge that failed is left out from now on
        (the trainer re-forms the epoch)."""
        if self._last is not None:
            self._last.finish()
            self.groups = self._last.edges

    def close(self, broken: bool = False) -> None:
        """Leave every edge; ``broken``: this server lost a version, which the servers below are told."""
        if self._last is not None:
            self._last.abandon(lost=broken)
            self._last = None
        groups, self.groups = self.groups, []
        for group in groups:
            group.close(broken)
