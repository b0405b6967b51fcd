"""What ``connect`` built, for one mode, until ``close``: the rank's ``Role`` (leader or follower), the
``Publisher`` (blocking or background), the weights' view, the plan, the check, and what they hold.
``WeightSync`` calls the publisher and the role directly; nothing here tests the mode again."""

from __future__ import annotations

from dataclasses import dataclass

from asyncsync.metrics import Footprint
from asyncsync.packing import PackBackend
from asyncsync.protocol.device import Runtime
from asyncsync.protocol.specs import BucketPlan
from asyncsync.ranks import TrainerRanks
from asyncsync.trainer.adapter_connect import BaseSend
from asyncsync.trainer.layout import WeightLayout
from asyncsync.trainer.publishers import Background, Blocking
from asyncsync.trainer.roles import Role
from asyncsync.trainer.source import WeightsReader
from asyncsync.trainer.verify import ServedCheck
from asyncsync.transport.shm import SegmentPool


@dataclass
class Connection:
    """One connected sync (the module doc). ``close`` returns the servers' versions and the errors."""

    ranks: TrainerRanks
    runtime: Runtime
    packer: PackBackend
    reader: WeightsReader
    layout: WeightLayout | None  # the engines' layout of the weights (None: convert= gives it)
    plan: BucketPlan
    role: Role
    publisher: Blocking | Background
    check: ServedCheck | None = None
    pool: SegmentPool | None = None  # shared memory for same-host servers (transport/shm.py)
    base: BaseSend | None = None     # lora: adapter: the segments the base is served from

    def report(self, error: str) -> None:
        """An error of the sync (a failed check) for ``errors``."""
        self.publisher.report(error)

    @property
    def footprint(self) -> Footprint:
        """The sync's own buffers: the publisher's, the shared-memory segments same-host servers map,
        and the most a version's conversion to the engines' layout allocates at once."""
        pool = self.pool.allocated if self.pool is not None else 0
        conversion = self.layout.scratch_bytes(self.plan) if self.layout is not None else 0
        return self.publisher.footprint + Footprint(device=pool, conversion=conversion)

    def close(self) -> tuple[dict[str, int], list[str]]:
        """Drain (a background publisher: the last version reaches every server), part with the other
        ranks, release the servers and every buffer; the servers' last versions and the errors."""
        errors, lost = self.publisher.close()
        versions = self.role.close(lost)
        if self.pool is not None:
            self.pool.close()
        if self.base is not None:
            self.base.close()
        self.reader.close()
        self.ranks.close()
        return versions, errors
