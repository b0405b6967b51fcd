"""``WeightSync``: the trainer's handle on every inference server (the loop it serves is in README.md).

With ``async_weight_update: false`` ``publish`` sends the version on the caller's thread and returns
once every server applied it (the baseline); with ``true`` a ``SyncWorker`` does the same in the
background and ``publish`` returns at once. Both modes run the same pipeline: the same pack path
(``trainer.buffers``), the same layout policy and the same ``send_version``; they differ in where the
bytes are packed from (the live weights into a ring of a few buckets, or a snapshot).

This class is the facade: ``connect`` (``trainer/connect.py``) builds a ``Connection``
(``trainer/connection.py``) of this rank's ``Role`` (``trainer/roles.py``: rank 0 talks to the servers,
a sharded trainer's other ranks follow it) and its ``Publisher`` (``trainer/publishers.py``: blocking
or background), and every later call is handed to them. A blocking ``publish`` is three calls from
its first byte: this one, ``Blocking.publish`` and the transport's ``send_version``.

With ``lora: adapter`` a PEFT model's versions are its adapter's tensors only (``trainer/adapter.py``):
``connect`` also has every server judge the adapter and sends the base once where it is not served,
and each version is loaded into every engine under ``<name>-v<N>`` by the control loop
(``transport/adapters.py``), never inside a trainer collective.

A sharded trainer (FSDP2, DTensors on a DeviceMesh) calls every method on every rank, like a
collective (``trainer_ranks: auto``). Rank 0 talks to the servers and plans; every rank sends the
buckets it owns (``trainer.shards``: the owner gathers that bucket's pieces from the other ranks),
so no rank holds the whole model; with ``funnel: true`` rank 0 owns every bucket, for comparison.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from asyncsync.config import WeightSyncConfig
from asyncsync.metrics import Footprint, SyncEvent, SyncMetrics, SyncResult
from asyncsync.protocol.device import Runtime
from asyncsync.protocol.lora import version_name
from asyncsync.protocol.specs import BucketPlan
from asyncsync.ranks import TrainerRanks
from asyncsync.trainer.connect import connect
from asyncsync.trainer.connection import Connection
from asyncsync.trainer.layout import WeightLayout
from asyncsync.trainer.roles import Leader
from asyncsync.trainer.source import Convert, Weights
from asyncsync.transport.fleet import new_session

log = logging.getLogger(__name__)

R = TypeVar("R")


class WeightSync:
    """Plans, packs and broadcasts versions of a model's weights to the configured servers.

    Contract: ``connect`` once, then ``wait_snapshot`` before changing parameters and ``publish``
    after; ``close`` drains. A server's failure never raises out of these calls: it is reported in
    the ``SyncResult`` (blocking), ``events`` and the metrics. What raises is a mistake of the caller:
    publishing before ``connect``, a version that is not newer, weights that are not a module or a
    mapping of tensors, sharded weights in a single process (``ShardedWeightsUnsupported``), another
    trainer rank gone (``TrainerRankLost``: close the sync), and, where the version is
    read (``connect``, a blocking ``publish``; async mode records it in ``errors``), a tensor that
    cannot be packed (``UnpackableTensor``) or a layout that changed since ``connect`` (``LayoutChanged``).
    Every such error names the tensor and says what to do; none reaches a compiled pack."""

    def __init__(self, config: WeightSyncConfig):
        if not config.servers:
            raise ValueError("weight_sync.servers is empty: list at least one server URL to sync to")
        self.config = config
        self.metrics = SyncMetrics()
        self.session = new_session()  # the trainer session that owns the servers from connect() to close()
        self.connection: Connection | None = None  # from connect() to close()
        # what connect() decided, kept after close()
        self.plan: BucketPlan | None = None
        self.layout: WeightLayout | None = None  # the engines' layout of the weights (None: convert= gives it)
        self.ranks = TrainerRanks()  # this process's place among a sharded trainer's ranks (a world of one)
        self.runtime: Runtime | None = None
        self._packer = "unconnected"
        self._versions_at_close: dict[str, int] = {}
        self._errors_at_close: list[str] = []

    @classmethod
    def from_config(cls, config: WeightSyncConfig | Mapping[str, Any] | str | Path) -> WeightSync:
        if isinstance(config, WeightSyncConfig):
            return cls(config)
        if isinstance(config, Mapping):
            return cls(WeightSyncConfig.from_dict(dict(config)))
        return cls(WeightSyncConfig.from_yaml(config))

    # -- what connect built ---------------------------------------------------------------------

    @property
    def is_async(self) -> bool:
        return self.config.async_weight_update

    @property
    def pack_backend(self) -> str:
        return self._packer

    @property
    def footprint(self) -> Footprint:
        """Bytes of the sync's own buffers (``metrics.Footprint``): on the weights' device (a ring of
        buckets blocking, and the delta baseline; snapshots async; the shared-memory segments
        same-host servers map), in host memory (a snapshot with ``snapshot: host``), and the most a
        version's conversion to the engines' layout allocates at once. Zero before ``connect``."""
        return self.connection.footprint if self.connection is not None else Footprint()

    def connect(self, model: Weights, convert: Convert | None = None) -> None:
        """Pick the pack backend, build the data-plane groups with every server (warmed up), decide
        which names are sent (a tied weight once, unless a server expects it twice: ``TiedNames``),
        plan the buckets and allocate the buffers; in async mode start the worker. On failure nothing
        is left open. Pass the module, not a copy of its state dict, so that its ties are known: later
        versions may then be published either way.

        ``convert``, when given, maps the trainer's (name, tensor) view to the names and layouts the
        servers load (fused qkv to q/k/v, ``_orig_mod.`` prefixes): it runs at connect and at every
        publish, on the caller's thread, and nothing it builds is kept (docs/sharded.md).

        A sharded trainer calls this on every rank (``trainer_ranks: auto``): the sync's own gloo
        groups among the ranks are created here, then rank 0 connects the servers and sends every
        rank the plan and each bucket's owner."""
        if self.connection is not None:
            raise RuntimeError("WeightSync.connect() was already called: close() it first, or use a new WeightSync")
        self.connection = c = connect(self.config, model, convert, self.metrics, self.session)
        self.plan, self.layout, self.ranks, self.runtime, self._packer = c.plan, c.layout, c.ranks, c.runtime, c.packer.name
        footprint = c.footprint
        self.metrics.allocated(footprint)
        if isinstance(c.role, Leader):
            self.metrics.staging(c.role.staging_bytes())
        log.info("connected: %s mode, rank %d of %d, pack backend %s, %d bucket(s), %.1f MB of sync buffers on the "
                 "weights' device, %.1f MB in host memory", "async" if self.is_async else "blocking", c.ranks.rank,
                 c.ranks.world, c.packer.name, len(c.plan.buckets), footprint.device / 1e6, footprint.host / 1e6)

    # -- the step boundary ----------------------------------------------------------------------

    def wait_snapshot(self) -> None:
        """Return once parameters may be changed: async mode waits for the snapshot copy of the last
        published version (a stream-side wait on CUDA); blocking mode has nothing to wait for."""
        if self.connection is not None:
            self.connection.publisher.wait_snapshot()

    def publish(self, model: Weights, version: int) -> SyncResult | None:
        """Hand ``version`` of ``model``'s weights to the servers.

        Async mode: O(1), returns None; the sync happens in the background. Blocking mode: returns
        the ``SyncResult`` once every server applied ``version`` or failed to; ``result.failures`` and
        ``events`` say which server missed it and why."""
        c = self.connection
        if c is None:
            raise RuntimeError("call WeightSync.connect(model) before publish()")
        if c.check is not None:
            c.check.expect(model, version)  # a forward of the probe, when the check is due
        return c.publisher.publish(model, version)

    def adapter_name(self, version: int) -> str:
        """The name version ``version`` of the adapter is served under (``lora: adapter``): pass it to
        a generation request (``EngineClient.generate(..., adapter=)``) to be served that version."""
        return version_name(self.config.lora_name, version)

    # -- versions and staleness -----------------------------------------------------------------

    @property
    def server_versions(self) -> dict[str, int]:
        """The version each server serves, as last reported by the server (kept after close()); on a
        sharded trainer's other ranks, as rank 0 last told them."""
        live = self.connection.role.server_versions() if self.connection is not None else {}
        return {**self._versions_at_close, **live}

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
        rollouts generated afterwards are fresh enough. False on timeout, and as soon as no server
        can get there (every one evicted, or refusing this plan's layout: ``errors`` says why)."""
        if self.connection is None:
            return True  # no server to wait for
        return self.connection.publisher.lowest_served(trainer_version - self.config.max_staleness, timeout)

    @property
    def events(self) -> list[SyncEvent]:
        """Evictions, rejoins and refused versions, oldest first."""
        return list(self.metrics.events)

    @property
    def errors(self) -> list[str]:
        """Versions the sync could not send or check for a reason on the trainer's side (a layout that
        changed, an exception in a sender, a served version that diverged), oldest first. Servers'
        failures are in ``events``; blocking mode raises trainer-side problems from ``publish``
        instead. Kept after ``close``."""
        return list(self.connection.publisher.errors) if self.connection is not None else list(self._errors_at_close)

    def prometheus_text(self) -> str:
        return self.metrics.prometheus_text()

    # -- tear-down ------------------------------------------------------------------------------

    def close(self) -> None:
        """Drain (async: the last published version reaches every server), then release everything."""
        if self.connection is None:
            return
        versions, self._errors_at_close = self.connection.close()
        self._versions_at_close.update(versions)
        self.connection = None

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
