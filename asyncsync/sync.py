"""``WeightSync``: the trainer's handle on every inference server.

Lifecycle, as the trainer's loop sees it::

    sync = WeightSync.from_config(cfg)          # async_weight_update: false -> blocking publish
    sync.connect(model)                         # plan buckets, build the group eagerly, warm it up
    for step in range(steps):
        ...                                     # rollouts, loss, backward
        sync.wait_snapshot()                    # params may change only after the last snapshot
        optimizer.step()
        sync.publish(model, version=step + 1)   # blocking mode: returns once every server applied it
    sync.close()
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncsync.config import WeightSyncConfig
from asyncsync.control import ControlLoop, ServerError
from asyncsync.dataplane import DataPlaneGroup, GroupSpec, free_port, resolve_backend
from asyncsync.engines import EngineClient, make_engine
from asyncsync.packing import PackBackend, get_backend
from asyncsync.plan import BucketPlan, distinct_tensors
from asyncsync.wire import BucketMeta, UpdateRequest

log = logging.getLogger(__name__)

Weights = torch.nn.Module | Mapping[str, torch.Tensor]


class SyncError(RuntimeError):
    """A sync could not reach every server; the message lists each server's failure."""


@dataclass
class SyncResult:
    """What one ``publish`` did: the version, its size, and where the time went."""

    version: int
    nbytes: int
    buckets: int
    pack_s: float = 0.0
    wire_s: float = 0.0
    apply_s: float = 0.0
    total_s: float = 0.0
    server_versions: dict[str, int] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.total_s / 1e9 if self.total_s else 0.0


def named_tensors(weights: Weights) -> dict[str, torch.Tensor]:
    """Fresh name -> tensor map (parameters and persistent buffers, tied ones once), fetched at every sync."""
    return distinct_tensors(weights.state_dict() if isinstance(weights, torch.nn.Module) else weights)


class WeightSync:
    """Plans, packs and broadcasts versions of a model's weights to the configured servers."""

    def __init__(self, config: WeightSyncConfig):
        if config.async_weight_update:
            raise NotImplementedError(
                "async_weight_update: true is not implemented yet; set it to false for the blocking sync"
            )
        if not config.servers:
            raise ValueError("weight_sync.servers is empty: list at least one server URL to sync to")
        self.config = config
        self.plan: BucketPlan | None = None
        self.group: DataPlaneGroup | None = None
        self.engines: list[EngineClient] = []
        self._control: ControlLoop | None = None
        self._ring: list[torch.Tensor] = []
        self._packer: PackBackend | None = None

    @classmethod
    def from_config(cls, config: WeightSyncConfig | Mapping[str, Any] | str | Path) -> WeightSync:
        if isinstance(config, WeightSyncConfig):
            return cls(config)
        if isinstance(config, Mapping):
            return cls(WeightSyncConfig.from_dict(dict(config)))
        return cls(WeightSyncConfig.from_yaml(config))

    # -- set-up ---------------------------------------------------------------------------------

    def connect(self, model: Weights) -> None:
        """Plan the buckets and build the data-plane group with every server, warmed up."""
        cfg = self.config
        self._control = ControlLoop()
        self.engines = [make_engine(s, cfg.deadlines.http_s) for s in cfg.servers]
        sizes = self._fanout(lambda e: e.world_size(), "world_size")
        backend = resolve_backend(cfg.backend)
        spec = GroupSpec(
            host=cfg.master_addr, port=cfg.master_port or free_port(cfg.master_addr),
            world_size=1 + sum(sizes.values()), group_name=cfg.group_name, backend=backend,
            timeout_s=cfg.deadlines.collective_s,
        )
        offsets, rank = {}, 1
        for e in self.engines:
            offsets[e.url], rank = rank, rank + sizes[e.url]
        joined = self._control.submit(self._gather(lambda e: e.init_group(spec, offsets[e.url])))
        self.group = DataPlaneGroup.join(spec, rank=0)  # returns once every server's ranks joined
        self._check(joined.result(cfg.deadlines.rendezvous_s), "init_group")
        self._packer = get_backend(cfg.pack_backend, self.group.device)
        self._replan(named_tensors(model))
        log.info("connected to %d server(s), world size %d, pack backend %s", len(self.engines), spec.world_size, self._packer.name)

    def _replan(self, named: Mapping[str, torch.Tensor]) -> None:
        """(Re)build the bucket index and the two ring buffers when names, dtypes or shapes change."""
        self.plan = BucketPlan.from_tensors(named.items(), self.config.bucket_bytes)
        size = self.plan.max_bucket_bytes
        if not self._ring or self._ring[0].numel() < size:
            assert self.group is not None
            self._ring = [torch.empty(size, dtype=torch.uint8, device=self.group.device) for _ in range(2)]

    # -- the step boundary ----------------------------------------------------------------------

    def wait_snapshot(self) -> None:
        """Blocking mode: ``publish`` already copied everything before returning; nothing to wait for."""

    def publish(self, model: Weights, version: int) -> SyncResult:
        """Send ``version`` of ``model``'s weights to every server; returns once all of them serve it."""
        if self.group is None or self._control is None:
            raise RuntimeError("call WeightSync.connect(model) before publish()")
        named = named_tensors(model)
        if self.plan is None or not self.plan.matches(named):
            self._replan(named)
        return self._transfer(named, version)

    def _transfer(self, named: Mapping[str, torch.Tensor], version: int) -> SyncResult:
        assert self.plan is not None and self.group is not None and self._packer is not None and self._control is not None
        cfg, plan, group = self.config, self.plan, self.group
        request = UpdateRequest(version, tuple(BucketMeta.of(b) for b in plan.buckets), cfg.checksum)
        result = SyncResult(version, plan.total_bytes, len(plan.buckets))
        start = time.perf_counter()

        async def begin_and_update(e: EngineClient) -> None:
            await e.begin(version)
            await e.update(request)

        received = self._control.submit(self._gather(begin_and_update))
        in_flight: list[Any] = [None, None]  # the broadcast each ring buffer is on, if any
        crcs: list[int] = []
        for i, bucket in enumerate(plan.buckets):
            slot = i % 2
            if in_flight[slot] is not None:
                group.wait(in_flight[slot])  # the buffer is reusable once its broadcast finished
            buf = self._ring[slot][: bucket.nbytes]
            t0 = time.perf_counter()
            crc = self._packer.pack([named[s.name] for s in bucket.specs], bucket.offsets, buf, cfg.checksum)
            result.pack_s += time.perf_counter() - t0
            if crc is not None:
                crcs.append(crc)
            in_flight[slot] = group.broadcast_async(buf)
        for work in in_flight:
            if work is not None:
                group.wait(work)
        if cfg.checksum:
            group.broadcast(torch.tensor(crcs, dtype=torch.int64, device=group.device))
        result.wire_s = time.perf_counter() - start - result.pack_s
        t0 = time.perf_counter()
        self._check(received.result(cfg.deadlines.http_s), "update")
        result.server_versions = self._fanout(lambda e: e.end(version), "end")
        result.apply_s = time.perf_counter() - t0
        result.total_s = time.perf_counter() - start
        return result

    # -- fan-out helpers ------------------------------------------------------------------------

    async def _gather(self, call: Callable[[EngineClient], Awaitable[Any]]) -> dict[str, Any]:
        """Call every server concurrently; each server's result or exception, keyed by URL."""
        results = await asyncio.gather(*(call(e) for e in self.engines), return_exceptions=True)
        return {e.url: r for e, r in zip(self.engines, results)}

    def _fanout(self, call: Callable[[EngineClient], Awaitable[Any]], what: str) -> dict[str, Any]:
        assert self._control is not None
        return self._check(self._control.run(self._gather(call), self.config.deadlines.http_s), what)

    @staticmethod
    def _check(results: dict[str, Any], what: str) -> dict[str, Any]:
        failed = {url: r for url, r in results.items() if isinstance(r, BaseException)}
        if failed:
            detail = "; ".join(str(r) if isinstance(r, ServerError) else f"{url}: {r!r}" for url, r in failed.items())
            raise SyncError(f"{what} failed on {len(failed)} of {len(results)} server(s): {detail}")
        return results

    # -- tear-down ------------------------------------------------------------------------------

    def close(self) -> None:
        """Release the group and the HTTP pools. Blocking mode has nothing in flight to drain."""
        if self._control is not None:
            self._control.run(self._gather(lambda e: e.close()), timeout=10)
            self._control.close()
            self._control = None
        if self.group is not None:
            self.group.close()
            self.group = None

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
