"""How long one broadcast may take: the measured rate of the data plane, and deadlines derived from it.

A server that dies mid-broadcast is noticed by the trainer only when a collective fails or misses its
deadline; on gloo nothing else can release the other ranks (``abort`` and ``shutdown`` are no-ops, and
a peer stuck in a matched receive wakes only at its own timeout). So the deadline of each broadcast,
on the trainer and on asyncsync's receivers (``UpdateRequest.deadlines_s``), follows the rate measured
on the versions already sent::

    deadline(n bytes) = min(collective_s, max(broadcast_floor_s, broadcast_factor * n / rate))

Until a version has been sent the rate is unknown and every broadcast gets ``collective_s``. The rate
is an exponential average of whole versions (bytes over wire time), so one slow version moves it
only part of the way. A healthy broadcast that misses its deadline (the machine stalled for longer
than ``broadcast_factor`` times the usual) costs that version, never an eviction: servers that answer
are kept.
"""

from __future__ import annotations

from asyncsync.config import Deadlines

SMOOTHING = 0.3  # weight of the newest version in the rate's average


class BroadcastPace:
    def __init__(self, deadlines: Deadlines):
        self.deadlines = deadlines
        self.bytes_per_s: float | None = None

    def deadline_s(self, nbytes: int) -> float:
        d = self.deadlines
        if self.bytes_per_s is None:
            return d.collective_s
        return min(d.collective_s, max(d.broadcast_floor_s, d.broadcast_factor * nbytes / self.bytes_per_s))

    def observe(self, nbytes: int, seconds: float) -> None:
        """A version of ``nbytes`` crossed the wire in ``seconds`` (all of its broadcasts succeeded)."""
        if seconds <= 0 or nbytes <= 0:
            return
        rate = nbytes / seconds
        self.bytes_per_s = rate if self.bytes_per_s is None else (1 - SMOOTHING) * self.bytes_per_s + SMOOTHING * rate
