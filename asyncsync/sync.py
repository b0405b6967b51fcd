"""``WeightSync``: the trainer's handle on every inference server.

Lifecycle, as the trainer's loop sees it::

    sync = WeightSync.from_config(cfg)          # cfg.async_weight_update: true | false
    sync.connect(model)                         # plan buckets, build the group eagerly, warm it up
    for step in range(steps):
        rollouts = ...                          # each rollout carries the weight version it used
        loss.backward()
        sync.wait_snapshot()                    # params may change only after the last snapshot copy
        optimizer.step()
        sync.publish(model, version=step + 1)   # async: O(1). blocking: returns once every server has it
    sync.close()                                # drain: the last version reaches every server

With ``async_weight_update: false`` publish packs into two ring buffers (bucket k+1 packs while
bucket k is on the wire) and returns when every server applied the version: the baseline.
With ``true`` a ``SyncWorker`` does the same work in the background.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from asyncsync.config import WeightSyncConfig
from asyncsync.metrics import SyncEvent, SyncMetrics, SyncResult
from asyncsync.packing import PackBackend, get_backend
from asyncsync.plan import Bucket, BucketPlan, named_tensors
from asyncsync.streams import StreamSet
from asyncsync.transfer import Transfer, lowest_member_version
from asyncsync.worker import SyncWorker

log = logging.getLogger(__name__)

Weights = torch.nn.Module | Mapping[str, torch.Tensor]
R = TypeVar("R")


class WeightSync:
    """Plans, packs and broadcasts versions of a model's weights to the configured servers."""

    def __init__(self, config: WeightSyncConfig):
        if not config.servers:
            raise ValueError("weight_sync.servers is empty: list at least one server URL to sync to")
        self.config = config
        self.metrics = SyncMetrics()
        self.plan: BucketPlan | None = None
        self._transfers: list[Transfer] = []  # one for all servers, or one per server (group_per_server)
        self._packer: PackBackend | None = None
        self._worker: SyncWorker | None = None
        self._ring: list[torch.Tensor] = []
        self._last_version = 0
        self._versions_at_close: dict[str, int] = {}

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

    def connect(self, model: Weights) -> None:
        """Plan the buckets, build the data-plane group with every server (warmed up) and, in async
        mode, start the worker with its two snapshot buffer sets."""
        cfg = self.config
        groups = [cfg.replace(servers=(s,)) for s in cfg.servers] if cfg.group_per_server else [cfg]
        try:
            for group_cfg in groups:
                self._transfers.append(Transfer.connect(group_cfg, self.metrics))
        except BaseException:
            self.close()
            raise
        device = self._transfers[0].device
        self._packer = get_backend(self.config.pack_backend, device)
        self._replan(named_tensors(model))
        if self.is_async:
            assert self.plan is not None
            self._worker = SyncWorker(self._transfers, self.plan, self._packer, StreamSet.for_device(device), self.metrics)
        log.info("connected: %s mode, pack backend %s", "async" if self.is_async else "blocking", self._packer.name)

    def _replan(self, named: Mapping[str, torch.Tensor]) -> None:
        """(Re)build the bucket index and, for blocking mode, the two ring buffers."""
        single_dtype = any(t.single_dtype_buckets for t in self._transfers)
        self.plan = BucketPlan.from_tensors(named.items(), self.config.bucket_bytes, single_dtype)
        size = self.plan.max_bucket_bytes
        if not self.is_async and (not self._ring or self._ring[0].numel() < size):
            self._ring = [torch.empty(size, dtype=torch.uint8, device=self._transfers[0].device) for _ in range(2)]

    # -- the step boundary ----------------------------------------------------------------------

    def wait_snapshot(self) -> None:
        """Return once parameters may be changed: async mode waits for the snapshot copy of the last
        published version (a stream-side wait on CUDA); blocking mode has nothing to wait for."""
        if self._worker is not None:
            self._worker.wait_snapshot()

    def publish(self, model: Weights, version: int) -> SyncResult | None:
        """Hand ``version`` of ``model``'s weights to the servers.

        Async mode: O(1), returns None; the sync happens in the background. Blocking mode: returns
        the ``SyncResult`` once every server serves ``version``. Neither raises for a server's
        failure: ``result.failures`` and ``events`` say which server missed which version and why.
        """
        if not self._transfers:
            raise RuntimeError("call WeightSync.connect(model) before publish()")
        if self._worker is not None:
            self._worker.publish(model, version)
            return None
        if version <= self._last_version:
            raise ValueError(f"version {version} is not newer than the last published {self._last_version}")
        self._last_version = version
        self.metrics.count("published")
        named = named_tensors(model)
        if self.plan is None or not self.plan.matches(named):
            self._replan(named)
        assert self.plan is not None and self._packer is not None
        packer, checksum = self._packer, self.config.checksum

        def pack(bucket: Bucket) -> tuple[torch.Tensor, int | None]:
            buf = self._ring[bucket.index % 2][: bucket.nbytes]
            return buf, packer.pack([named[s.name] for s in bucket.specs], bucket.offsets, buf, checksum)

        result = self._transfers[0].send(version, self.plan, pack, ring=2)  # blocking mode has one group
        self.metrics.record(result)
        self.metrics.count("sent" if result.server_versions else "failed")
        return result

    # -- versions and staleness -----------------------------------------------------------------

    @property
    def server_versions(self) -> dict[str, int]:
        """The version each server serves, as last reported by the server (kept after close())."""
        versions = dict(self._versions_at_close)
        for t in self._transfers:
            versions.update(t.server_versions)
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
            return lowest_member_version(self._transfers, needed) >= needed
        return self._worker.wait_served(needed, timeout)

    @property
    def events(self) -> list[SyncEvent]:
        """Evictions, rejoins and refused versions, oldest first."""
        return list(self.metrics.events)

    @property
    def errors(self) -> list[str]:
        """Failed background syncs, oldest first (async mode; blocking mode raises instead)."""
        return self._worker.errors if self._worker else []

    def prometheus_text(self) -> str:
        return self.metrics.prometheus_text()

    # -- tear-down ------------------------------------------------------------------------------

    def close(self) -> None:
        """Drain (async: the last published version reaches every server), then release everything."""
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        for t in self._transfers:
            self._versions_at_close.update(t.server_versions)
            t.close()
        self._transfers = []

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
