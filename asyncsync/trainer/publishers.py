"""What ``publish`` does in each mode, chosen once at ``connect``: ``Blocking`` sends the version on the
caller's thread and returns its ``SyncResult``; ``Background`` hands it to the ``SyncWorker`` in O(1).
Both read the weights through the same ``WeightsReader`` and send through the rank's ``Role``; what
differs is where the bytes are packed from (the live weights into a ring, or a snapshot).

    publisher = Blocking(role, plan, reader, metrics, ring, shared, baseline, adapter)   # or Background(...)
    publisher.publish(model, version)    # blocking: SyncResult; background: None
    publisher.wait_snapshot()            # background: until the last version's snapshot copy is done
    publisher.close() -> errors          # background: drains the last version first
"""

from __future__ import annotations

import logging
import time
from typing import Any

from asyncsync.metrics import Footprint, SyncMetrics, SyncResult
from asyncsync.protocol.specs import BucketPlan
from asyncsync.ranks import TrainerRankLost
from asyncsync.trainer.buffers import Baseline, Prepacked, Ring, SharedSnapshot
from asyncsync.trainer.delta import EncodeAhead
from asyncsync.trainer.roles import Role
from asyncsync.trainer.shards import Encoded, ShardedBuffers
from asyncsync.trainer.source import Weights, WeightsReader
from asyncsync.trainer.worker import SyncWorker
from asyncsync.transport.fleet import Fleet
from asyncsync.transport.sources import BucketSource

log = logging.getLogger(__name__)


class Blocking:
    """``publish`` sends the version and returns once every server applied it or failed to.

    Its buckets: with a server on shared memory, the whole version packed into a leased segment
    (``shared``) before any server is told (they map it); with a delta baseline (``baseline``, or a
    sharded rank's own), packed and encoded ahead while deltas pay (``EncodeAhead``); otherwise the
    ring, each bucket packed from the live weights just before its broadcast. Once a version is
    sent, the role's check where due, and with ``adapter`` (``lora: adapter``) the engines' loads."""

    def __init__(self, role: Role, plan: BucketPlan, reader: WeightsReader, metrics: SyncMetrics,
                 ring: Ring | ShardedBuffers, shared: tuple[SharedSnapshot, Fleet] | None = None,
                 baseline: Baseline | None = None, adapter: bool = False):
        self.role, self.plan, self.reader, self.metrics, self.adapter = role, plan, reader, metrics, adapter
        (self.send,) = role.senders()  # a blocking sync sends every version to one fleet
        self.ring, self.baseline = ring, baseline
        self.shared = shared  # the segment versions are packed into, and the fleet of the servers that map it
        self.ahead = EncodeAhead()
        self.errors: list[str] = []  # a failed check (``trainer.verify``)
        self.lost: str | None = None  # why another trainer rank is gone
        self._last_version = 0

    @property
    def footprint(self) -> Footprint:
        """Its buffers (a shared segment's are the pool's)."""
        return self.ring.footprint + (self.baseline.footprint if self.baseline is not None else Footprint())

    def publish(self, model: Weights, version: int) -> SyncResult:
        if self.lost is not None:
            raise TrainerRankLost(self.lost)
        if version <= self._last_version:
            raise ValueError(f"version {version} is not newer than the last published {self._last_version}")
        named = self.reader.read(model).tensors()
        result = SyncResult(version, self.plan.total_bytes, len(self.plan.buckets))
        try:
            source, packed_s = self._source(named, result)  # raises before anything is sent
            self._last_version = version
            self.metrics.count("published")
            told = self.send(version, source, result)
            if told is not None:  # (None: rank 0 abandoned it, and raised)
                result = told
                self.role.checked(0, result)
                if self.adapter:
                    self.role.await_loads(result)
        except TrainerRankLost as e:  # a sharded trainer's ranks encode and send together
            self.lost = str(e)
            raise
        result.pack_s += packed_s
        self.metrics.record(result)
        self.metrics.count("sent" if result.server_versions else "failed")
        return result

    def _source(self, named: dict[str, Any], result: SyncResult) -> tuple[BucketSource, float]:
        """This version's buckets (the class doc) and the seconds packed ahead."""
        if self.shared is not None:
            segment, fleet = self.shared
            fleet.epochs.readmit()  # before choosing the buffers: a readmitted server may be on shared memory
            if fleet.epochs.current.shared:
                result.started = t0 = time.perf_counter()
                segment.pack_all(named)
                return segment.packed(), time.perf_counter() - t0
        encodes = self.baseline is not None or (isinstance(self.ring, ShardedBuffers) and self.ring.delta)
        if encodes and self.role.pack_ahead(self.ahead):
            result.started = t0 = time.perf_counter()
            source: Prepacked | Encoded
            if self.baseline is not None:
                self.baseline.pack_all(named, result.version)  # encoded against the last version packed into it
                source = self.baseline.packed()
            else:
                assert isinstance(self.ring, ShardedBuffers)
                source = self.ring.encoding(named, result.version)  # a sharded trainer's owners encode theirs
            self.ahead.encoded(self.plan, source.delta_nbytes())
            return source, time.perf_counter() - t0
        return self.ring.packing(named), 0.0

    def wait_snapshot(self) -> None:
        """Nothing to wait for: ``publish`` returned after the version was sent."""

    def report(self, error: str) -> None:
        self.errors.append(error)

    def lowest_served(self, needed: int, timeout: float | None) -> bool:
        return self.role.lowest(needed) >= needed

    def close(self) -> tuple[list[str], str | None]:
        """The errors, and why a rank is gone (None: the ranks may part together)."""
        return list(self.errors), self.lost


class Background:
    """``publish`` is O(1): the ``SyncWorker`` snapshots the version and sends it in the background."""

    def __init__(self, worker: SyncWorker, reader: WeightsReader):
        self.worker, self.reader = worker, reader

    @property
    def footprint(self) -> Footprint:
        return self.worker.footprint

    def publish(self, model: Weights, version: int) -> None:
        self.worker.publish(self.reader.read(model), version)  # the view is read here, on the trainer's thread
        return None

    @property
    def errors(self) -> list[str]:
        return self.worker.errors

    def wait_snapshot(self) -> None:
        self.worker.wait_snapshot()

    def report(self, error: str) -> None:
        self.worker.report(error)

    def lowest_served(self, needed: int, timeout: float | None) -> bool:
        return self.worker.wait_served(needed, timeout)

    def close(self) -> tuple[list[str], str | None]:
        """Drain: the last published version reaches every server first."""
        self.worker.close()
        errors = self.worker.errors
        if errors:
            log.error("%d version(s) could not be sent (sync.errors): the last: %s", len(errors), errors[-1])
        return errors, self.worker.lost
