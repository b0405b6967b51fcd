"""What ``connect`` built, for one mode, until ``close``: the rank's ``Role`` (leader or follower), the
``Publisher`` (blocking or background), the weights' view, the plan, the check, and what they hold.
``WeightSync`` hands every call to it; nothing here tests the mode again."""

from __future__ import annotations

from dataclasses import dataclass

from asyncsync.metrics import SyncResult
from asyncsync.packing import PackBackend
from asyncsync.protocol.device import Runtime
from asyncsync.protocol.specs import BucketPlan
from asyncsync.ranks import TrainerRanks
from asyncsync.trainer.adapter_connect import BaseSend
from asyncsync.trainer.layout import WeightLayout
from asyncsync.trainer.publishers import Background, Blocking
from asyncsync.trainer.roles import Role
from asyncsync.trainer.source import Weights, WeightsReader
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

    def publish(self, model: Weights, version: int) -> SyncResult | None:
        if self.check is not None:
            self.check.expect(model, version)  # a forward of the probe, when the check is due
        return self.publisher.publish(model, version)

    def report(self, error: str) -> None:
        """An error of the sync (a failed check) for ``errors``."""
        self.publisher.report(error)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the sync's own buffers on the weights' device (a ring and the delta baseline
        blocking; snapshots async; the shared-memory segments same-host servers map)."""
        return self.publisher.nbytes + (self.pool.allocated if self.pool is not None else 0)

    @property
    def host_buffer_bytes(self) -> int:
        """Bytes of the sync's own buffers in host memory (a snapshot with ``snapshot: host``)."""
        return self.publisher.host_nbytes

    @property
    def baseline_bytes(self) -> int:
        """Of ``buffer_bytes``, those that hold the delta baseline."""
        return self.publisher.baseline_nbytes

    @property
    def conversion_bytes(self) -> int:
        return self.layout.scratch_bytes(self.plan) if self.layout is not None else 0

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
