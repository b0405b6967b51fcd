"""When the trainer keeps a delta baseline, and when blocking mode encodes a version ahead.

The baseline is the whole-version buffers a version is packed into (``PackedBuffers(delta=True)``):
async mode's snapshot itself, or in blocking mode one more set beside the ring. Which server gets a
delta of a version is decided when it is sent (``transport.send``): only one that committed exactly
the version those buffers held before.
"""

from __future__ import annotations

from collections.abc import Iterable

from asyncsync.config import WeightSyncConfig
from asyncsync.packing import PackBackend
from asyncsync.trainer.buffers import PackedBuffers
from asyncsync.transport.membership import Membership

# Blocking mode: after a version whose deltas still sent more than PAYS_BELOW of its bytes (dense
# updates: packing ahead, not hidden behind the wire, costs more than the bytes saved), this many
# versions go through the ring before one is encoded ahead again.
PAYS_BELOW = 0.5
PROBE_EVERY = 8


def keeps_baseline(config: WeightSyncConfig, packer: PackBackend, trainer_ranks: int,
                   memberships: Iterable[Membership]) -> bool:
    """``delta: auto`` with checksums, a backend that encodes deltas, one trainer process (a sharded
    trainer's owners assemble buckets as they are sent: not done), and a membership that can take
    deltas (``Membership.takes_deltas``: every member rebuilds them and is reached over the data
    plane; servers on shared memory map every version: no wire to save)."""
    return (config.delta == "auto" and config.checksum and packer.encodes_deltas and trainer_ranks == 1
            and any(m.takes_deltas() for m in memberships))


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

    def encoded(self, baseline: PackedBuffers) -> None:
        """``baseline`` was just packed ahead: did its deltas pay?"""
        if baseline.delta_base is None:
            return
        buckets = baseline.plan.buckets
        sent = sum(b.nbytes if d is None or (p := d.payload()) is None else p.numel()
                   for b, d in zip(buckets, (baseline.delta_of(b) for b in buckets)))
        if sent > PAYS_BELOW * baseline.plan.total_bytes:
            self._ring_left = PROBE_EVERY - 1
