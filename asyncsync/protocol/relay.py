"""A relaying receiver's part: every payload of a version it receives, on to the servers below it.

With ``fanout`` other than ``direct`` the trainer plans a tree over its servers (``transport.relay``).
Each tree edge is a two-rank data-plane group, the upper server its rank 0. A server with servers
below it forwards each payload (a bucket, its delta, then the checksum manifest) into every edge as
soon as the payload has landed, frame header first, exactly as the trainer sent it, while the next
payload is still arriving: a version crosses each link once, pipelined per bucket.

Nothing is forwarded before it arrived whole (a wait returns only once the bytes are in the buffer),
and nothing is judged on the way: each server below verifies every bucket itself against the
trainer's manifest, which travels the same way, so a hop that corrupts a bucket is refused by every
server below it. An edge that fails (the server below died, or missed a deadline) is dropped and
never fails the version of the server above: the trainer hears of the loss from the servers below
(no answer, or a failed update) and sends them the version again (``transport.send``).

    forward = Forward(edges, frames, runtime)
    for each payload i, once it landed:
        forward.send(i, payload, deadline_s)
    forward.finish()          # every forward done or failed (a failed edge is closed and dropped)
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from asyncsync.protocol.device import Runtime
from asyncsync.protocol.frames import VersionFrames
from asyncsync.protocol.group import DataPlaneError, DataPlaneGroup, Work

log = logging.getLogger(__name__)


class Forward:
    """Forwards one version's payloads into ``edges`` (this server is rank 0 of each).

    ``in_flight``: how many payloads may still be on their way down when the next one is sent (1: a
    payload goes down while the next arrives; 0 where the payload's buffer is reused at once, a
    device ring's slot). The payloads' buffers must stay untouched until ``finish`` returns."""

    def __init__(self, edges: Sequence[DataPlaneGroup], frames: VersionFrames, runtime: Runtime, in_flight: int = 1):
        self.edges = list(edges)
        self.frames, self.runtime, self.in_flight = frames, runtime, in_flight
        self._pending: list[list[tuple[DataPlaneGroup, Work, Work, torch.Tensor]]] = []
        self.dropped: list[str] = []  # the edges that failed, as text

    def send(self, index: int, payload: torch.Tensor, deadline_s: float | None) -> None:
        """Forward payload ``index`` (landed whole) into every edge still up, after its frame header."""
        if not self.edges:
            return
        header = self.runtime.upload(self.frames.header(index, payload).tensor())
        sent = []
        for edge in list(self.edges):
            try:
                sent.append((edge, edge.broadcast_async(header, deadline_s), edge.broadcast_async(payload, deadline_s),
                             header))
            except DataPlaneError as e:
                self._drop(edge, e)
        self._pending.append(sent)
        while len(self._pending) > self.in_flight:
            self._settle(self._pending.pop(0))

    def finish(self) -> None:
        """Until every forward is done or its edge dropped."""
        while self._pending:
            self._settle(self._pending.pop(0))

    def abandon(self) -> None:
        """This server's own receive failed: every edge is closed and every forward in flight let go.
        gloo closes a group's connections only once nothing references it (an abort leaves them
        open), and only then does the receive of a server below fail, at once instead of at its
        deadline: so nothing of the edges may outlive this call."""
        for edge in self.edges:
            edge.close(broken=True)
        self.edges, self._pending = [], []

    def _settle(self, sent: list[tuple[DataPlaneGroup, Work, Work, torch.Tensor]]) -> None:
        for edge, header, payload, _ in sent:
            if edge not in self.edges:
                continue
            try:
                edge.wait(payload)
                edge.wait(header)
            except DataPlaneError as e:
                self._drop(edge, e)

    def _drop(self, edge: DataPlaneGroup, error: Exception) -> None:
        """The server below is lost for this epoch; this server's own version goes on."""
        self.edges.remove(edge)
        edge.close(broken=True)
        self._pending = [[s for s in sent if s[0] is not edge] for sent in self._pending]  # its works let go
        self.dropped.append(f"{edge.spec.group_name}: {error}")
        log.warning("relay edge %s dropped: %s (the trainer sends the servers below it the version again)",
                    edge.spec.group_name, error)
