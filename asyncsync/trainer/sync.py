"""``WeightSync``: the trainer's handle on every inference server (the loop it serves is in README.md).

With ``async_weight_update: false`` ``publish`` sends the version on the caller's thread and returns
once every server applied it (the baseline); with ``true`` a ``SyncWorker`` does the same in the
background and ``publish`` returns at once. Both modes run the same pipeline: the same pack path
(``PackedBuffers``), the same layout policy (``check_layout``) and the same ``send_version``; they
differ in where the bytes are packed from (the live weights into a ring of a few buckets, or a snapshot).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from asyncsync.config import WeightSyncConfig
from asyncsync.packing import PackBackend, get_backend
from asyncsync.protocol.specs import BucketPlan
from asyncsync.trainer.buffers import RING_SLOTS, PackedBuffers
from asyncsync.trainer.metrics import SyncEvent, SyncMetrics, SyncResult
from asyncsync.protocol.device import Runtime, runtime_for
from asyncsync.trainer.source import TiedNames, Weights, WeightsReader, all_tensors, check_tensors, weights_device
from asyncsync.trainer.streams import StreamSet
from asyncsync.trainer.worker import SyncWorker
from asyncsync.transport.control import ControlLoop
from asyncsync.transport.membership import Membership, lowest_member_version, new_session
from asyncsync.transport.send import BucketSource, send_version
from asyncsync.transport.shm import SegmentPool

log = logging.getLogger(__name__)

R = TypeVar("R")


class WeightSync:
    """Plans, packs and broadcasts versions of a model's weights to the configured servers.

    Contract: ``connect`` once, then ``wait_snapshot`` before changing parameters and ``publish``
    after; ``close`` drains. A server's failure never raises out of these calls: it is reported in
    the ``SyncResult`` (blocking), ``events`` and the metrics. What raises is a mistake of the caller:
    publishing before ``connect``, a version that is not newer, weights that are not a module or a
    mapping of tensors, sharded weights (``ShardedWeightsUnsupported``), and, where the version is
    read (``connect``, a blocking ``publish``; async mode records it in ``errors``), a tensor that
    cannot be packed (``UnpackableTensor``) or a layout that changed since ``connect`` (``LayoutChanged``).
    Every such error names the tensor and says what to do; none reaches a compiled pack."""

    def __init__(self, config: WeightSyncConfig):
        if not config.servers:
            raise ValueError("weight_sync.servers is empty: list at least one server URL to sync to")
        self.config = config
        self.metrics = SyncMetrics()
        self.plan: BucketPlan | None = None
        self._control: ControlLoop | None = None
        self._members: list[Membership] = []  # one for all servers, or one per server (group_per_server)
        self._packer: PackBackend | None = None
        self._worker: SyncWorker | None = None
        self._ring: PackedBuffers | None = None
        self._pool: SegmentPool | None = None      # shared memory for same-host servers (transport/shm.py)
        self._shared: PackedBuffers | None = None  # blocking mode's buffers in it
        self._reader = WeightsReader()
        self.runtime: Runtime | None = None
        self._last_version = 0
        self._versions_at_close: dict[str, int] = {}
        self._errors_at_close: list[str] = []
        self.session = new_session()  # the trainer session that owns the servers from connect() to close()

    @classmethod
    def from_config(cls, config: WeightSyncConfig | Mapping[str, Any] | str | Path) -> WeightSync:
        if isinstance(config, WeightSyncConfig):
            return cls(config)
        if isinstance(config, Mapping):
            return cls(WeightSyncConfig.from_dict(dict(config)))
        return cls(WeightSyncConfig.from_yaml(config))

    @property
    def is_async(self) -> bool:
        return self.config.async_weight_update

    @property
    def pack_backend(self) -> str:
        return self._packer.name if self._packer else "unconnected"

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the sync's own buffers on the weights' device (a ring of buckets blocking, snapshots
        async, and the shared-memory segments same-host servers map)."""
        shared = self._pool.allocated if self._pool is not None else 0
        if self._worker is not None:
            return self._worker.nbytes + shared
        return (self._ring.nbytes if self._ring is not None else 0) + shared

    def connect(self, model: Weights) -> None:
        """Pick the pack backend, build the data-plane groups with every server (warmed up), decide
        which names are sent (a tied weight once, unless a server expects it twice: ``TiedNames``),
        plan the buckets and allocate the buffers; in async mode start the worker. On failure nothing
        is left open. Pass the module, not a copy of its state dict, so that its ties are known: later
        versions may then be published either way."""
        cfg = self.config
        every = all_tensors(model)
        check_tensors(every)  # no server hears of weights that cannot be sent
        self.runtime = runtime = runtime_for(weights_device(every))
        device = runtime.device
        try:
            self._packer = get_backend(cfg.pack_backend, device)  # before any group: a bad backend fails first
            self._control = ControlLoop()
            groups = [cfg.replace(servers=(s,)) for s in cfg.servers] if cfg.group_per_server else [cfg]
            for group_cfg in groups:
                self._members.append(Membership.connect(group_cfg, self._control, self.metrics, runtime, self.session))
            told = [names for m in self._members for names in m.expected_names()]
            self._reader.close()
            self._reader = WeightsReader(TiedNames.decide(model, frozenset().union(*told) if told else None))
            named = self._reader.read(model).tensors()
            single_dtype = any(m.single_dtype_buckets for m in self._members)
            self.plan = BucketPlan.from_tensors(named.items(), cfg.bucket_bytes, single_dtype)

            self._pool = shared_pool(self._members, self.plan)  # same-host servers: shared memory

            def buffers(slots: int | None = None) -> PackedBuffers:
                assert self.plan is not None and self._packer is not None
                pool = self._pool if slots is None else None
                return PackedBuffers(self.plan, device, self._packer, cfg.checksum, slots, pool)

            if self._pool is not None and not self.is_async:
                self._shared = buffers()  # blocking mode: every version packed into a leased segment
            if self.is_async:
                self._worker = SyncWorker(self._members, self.plan, buffers, StreamSet(runtime), self.metrics)
            else:
                self._ring = buffers(slots=RING_SLOTS)
        except BaseException:
            self.close()
            raise
        self.metrics.allocated(self.buffer_bytes)
        log.info("connected: %s mode, pack backend %s, %d bucket(s), %.1f MB of sync buffers",
                 "async" if self.is_async else "blocking", self._packer.name, len(self.plan.buckets), self.buffer_bytes / 1e6)

    # -- the step boundary ----------------------------------------------------------------------

    def wait_snapshot(self) -> None:
        """Return once parameters may be changed: async mode waits for the snapshot copy of the last
        published version (a stream-side wait on CUDA); blocking mode has nothing to wait for."""
        if self._worker is not None:
            self._worker.wait_snapshot()

    def publish(self, model: Weights, version: int) -> SyncResult | None:
        """Hand ``version`` of ``model``'s weights to the servers.

        Async mode: O(1), returns None; the sync happens in the background. Blocking mode: returns
        the ``SyncResult`` once every server applied ``version`` or failed to; ``result.failures`` and
        ``events`` say which server missed it and why."""
        if not self._members:
            raise RuntimeError("call WeightSync.connect(model) before publish()")
        if self._worker is not None:
            self._worker.publish(self._reader.read(model), version)  # the view is read here, on the trainer's thread
            return None
        if version <= self._last_version:
            raise ValueError(f"version {version} is not newer than the last published {self._last_version}")
        assert self._ring is not None and self.plan is not None
        members = self._members[0]  # blocking mode has one membership
        members.readmit()  # before choosing the buffers: a readmitted server may be on shared memory
        named = self._reader.read(model).tensors()
        result = SyncResult(version, self.plan.total_bytes, len(self.plan.buckets))
        packed_s = 0.0
        if self._shared is not None and members.shared:
            result.started = t0 = time.perf_counter()
            self._shared.pack_all(named)  # the whole version, before the servers are told; raises before anything is sent
            packed_s = time.perf_counter() - t0
            source: BucketSource = self._shared.packed()
        else:
            source = self._ring.packing(named)  # raises before anything is sent
        self._last_version = version
        self.metrics.count("published")
        result = send_version(members, version, self.plan, source, result)
        result.pack_s += packed_s
        self.metrics.record(result)
        self.metrics.count("sent" if result.server_versions else "failed")
        return result

    # -- versions and staleness -----------------------------------------------------------------

    @property
    def server_versions(self) -> dict[str, int]:
        """The version each server serves, as last reported by the server (kept after close())."""
        versions = dict(self._versions_at_close)
        for m in self._members:
            versions.update(m.server_versions)
        return versions

    def is_fresh(self, rollout_version: int, trainer_version: int) -> bool:
        """True when a rollout generated with ``rollout_version`` is within ``max_staleness``."""
        return trainer_version - rollout_version <= self.config.max_staleness

    def filter_fresh(self, rollouts: Iterable[R], version_of: Callable[[R], int], trainer_version: int) -> tuple[list[R], int]:
        """Keep the rollouts within ``max_staleness``; returns (kept, number dropped)."""
        every = list(rollouts)
        kept = [r for r in every if self.is_fresh(version_of(r), trainer_version)]
        return kept, len(every) - len(kept)

    def wait_for_fresh_servers(self, trainer_version: int, timeout: float | None = None) -> bool:
        """Wait until every server is within ``max_staleness`` of ``trainer_version`` (async mode);
        rollouts generated afterwards are fresh enough. False on timeout."""
        needed = trainer_version - self.config.max_staleness
        if self._worker is None:
            return lowest_member_version(self._members, needed) >= needed
        return self._worker.wait_served(needed, timeout)

    @property
    def events(self) -> list[SyncEvent]:
        """Evictions, rejoins and refused versions, oldest first."""
        return list(self.metrics.events)

    @property
    def errors(self) -> list[str]:
        """Versions the background worker could not send for a reason on the trainer's side (a layout
        that changed, an exception in a sender), oldest first. Servers' failures are in ``events``;
        blocking mode raises trainer-side problems from ``publish`` instead. Kept after ``close``."""
        return self._worker.errors if self._worker else list(self._errors_at_close)

    def prometheus_text(self) -> str:
        return self.metrics.prometheus_text()

    # -- tear-down ------------------------------------------------------------------------------

    def close(self) -> None:
        """Drain (async: the last published version reaches every server), then release everything."""
        if self._worker is not None:
            self._worker.close()
            self._errors_at_close = self._worker.errors
            self._worker = None
        for m in self._members:
            self._versions_at_close.update(m.server_versions)
            m.close()
        self._members = []
        if self._control is not None:
            self._control.close()
            self._control = None
        self._ring = self._shared = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._reader.close()

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shared_pool(memberships: list[Membership], plan: BucketPlan) -> SegmentPool | None:
    """The shared-memory segments versions are packed into when a server maps them (``transport``),
    known to every membership so it can track what its servers hold; None when no server is on
    shared memory."""
    if not any(m.shared for m in memberships):
        return None
    pool = SegmentPool([b.nbytes for b in plan.buckets])
    for m in memberships:
        m.pool = pool
    return pool
