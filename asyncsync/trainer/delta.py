"""When the trainer keeps a delta baseline, and when blocking mode encodes a version ahead.

The baseline is the whole-version buffers a version is packed into (``trainer.buffers.Baseline``):
async mode's snapshot itself, or in blocking mode one more set beside the ring. A sharded trainer's
rank keeps the buckets it owns (``ShardedBuffers.baseline``), encoded when the version is sent.
Which server gets a delta of a version is decided when it is sent (``transport.send``): only one
that committed exactly the version those buffers held before.
"""

from __future__ import annotations

from asyncsync.config import WeightSyncConfig
from asyncsync.packing import PackBackend
from asyncsync.protocol.specs import BucketPlan
from asyncsync.transport.fleet import Fleet

# Blocking mode: after a version whose deltas still sent more than PAYS_BELOW of its bytes (dense
# updates: packing ahead, not hidden behind the wire, costs more than the bytes saved), this many
# versions go through the ring before one is encoded ahead again.
PAYS_BELOW = 0.5
PROBE_EVERY = 8


def keeps_baseline(config: WeightSyncConfig, packer: PackBackend, fleets: list[Fleet]) -> bool:
    """``delta: auto`` with checksums, a backend that encodes deltas, and a fleet that can take
    deltas (``Fleet.takes_deltas``: every member rebuilds them and is reached over the data
    plane; servers on shared memory map every version: no wire to save). A sharded trainer's
    buckets must be spread over its ranks: one whose every bucket goes through rank 0 would hold
    the whole model there. Rank 0 decides (it holds the fleets) and tells the other ranks."""
    spread = all(f.ranks.world == 1 or f.sources > 1 for f in fleets)
    return (config.delta == "auto" and config.checksum and packer.encodes_deltas and spread
            and any(f.takes_deltas() for f in fleets))


class EncodeAhead:
    """Blocking mode's choice per version: pack it whole into the baseline ahead of its broadcasts
    and encode it (a delta goes out only if it was encoded), or pack each bucket into the ring just
    before its broadcast (a whole version, packing hidden behind the wire). Ahead while deltas pay;
    after a version whose deltas would still have sent more than ``PAYS_BELOW`` of its bytes (dense
    updates), the ring, with one version ahead every ``PROBE_EVERY`` to see whether they pay again.
    A version encoded ahead against no baseline (the first) says nothing: the next one is ahead too.
    The probe after the ring is encoded against the last version packed ahead, older than what the
    servers hold, so it goes whole; its deltas measure the change since then, which errs towards
    the ring."""

    def __init__(self) -> None:
        self._ring_left = 0

    def ahead(self) -> bool:
        if self._ring_left:
            self._ring_left -= 1
            return False
        return True

    def encoded(self, plan: BucketPlan, nbytes: tuple[int, ...] | None) -> None:
        """A version of ``plan`` was just packed ahead, its buckets' deltas ``nbytes`` (0: whole;
        None: not encoded, or not known on this rank): did they pay?"""
        if nbytes is None:
            return
        sent = sum(n or b.nbytes for n, b in zip(nbytes, plan.buckets))
        if sent > PAYS_BELOW * plan.total_bytes:
            self._ring_left = PROBE_EVERY - 1
