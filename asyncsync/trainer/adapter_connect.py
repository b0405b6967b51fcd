"""``lora: adapter`` at ``connect``: every server judges the adapter, the base is sent once (as one
version) where a server does not serve it, and the loads of each adapter version begin.

    adapter, base = adapter_of(config, model, held, convert)   # (None, None) without lora: adapter
    check_adapter(config, fleets, adapter, plan)               # rank 0; ConfigError if a server cannot
    BaseSend(config, ranks, runtime, packer).run(model, base, ties, fleets, following)   # every rank
    loads = start_loads(config, fleets, adapter, ...)          # rank 0: AdapterLoads; the fleets serve adapters
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from asyncsync.checkpoint import LayoutError
from asyncsync.config import ConfigError, WeightSyncConfig
from asyncsync.control import ControlLoop
from asyncsync.metrics import SyncMetrics
from asyncsync.packing import PackBackend
from asyncsync.protocol.device import Runtime
from asyncsync.protocol.lora import AdapterCheck, BaseCheck, tensor_crc
from asyncsync.protocol.specs import BucketPlan
from asyncsync.ranks import TrainerRanks
from asyncsync.trainer.adapter import Adapter
from asyncsync.trainer.allocate import BufferKinds, shared_pool
from asyncsync.trainer.buffers import SharedSnapshot
from asyncsync.trainer.layout import WeightLayout
from asyncsync.trainer.shards import balanced_owners
from asyncsync.trainer.source import TiedNames, Weights, WeightsReader
from asyncsync.transport.adapters import AdapterLoads
from asyncsync.transport.commands import BaseVersion
from asyncsync.transport.datapath import follow_version
from asyncsync.transport.fleet import Fleet
from asyncsync.transport.follower import FollowingRank
from asyncsync.transport.kinds import AdapterVersions
from asyncsync.transport.send import send_version
from asyncsync.transport.shm import SegmentPool
from asyncsync.transport.sources import BucketSource

log = logging.getLogger(__name__)


def adapter_of(config: WeightSyncConfig, model: Weights, held: dict[str, Any], convert: Any
               ) -> tuple[Adapter | None, WeightLayout | None]:
    """The model's active adapter and the layout of its base; (None, None) without ``lora: adapter``."""
    if config.lora != "adapter":
        return None, None
    if convert is not None or not isinstance(model, torch.nn.Module):
        raise ConfigError("lora: adapter sends a peft.PeftModel's adapter: pass the PEFT model itself to connect(), "
                          "without convert=")
    try:
        return Adapter.of(model, held), WeightLayout.of(model, held, True, base_only=True)
    except LayoutError as e:
        raise ConfigError(str(e)) from None


def check_adapter(config: WeightSyncConfig, fleets: list[Fleet], adapter: Adapter, plan: BucketPlan) -> None:
    """Rank 0: ``ConfigError`` unless every server can serve the adapter (its LoRA settings, rank,
    targets, the versions held at once), before anything is sent."""
    check = AdapterCheck(config.lora_name, adapter.config, plan.specs, config.max_staleness + 2)
    refused = {url: why for f in fleets for url, why in f.refusals(lambda e: e.check_adapter(check),
                                                                  "check_adapter").items()}
    if refused:
        url, why = next(iter(refused.items()))
        raise ConfigError(f"{len(refused)} server(s) cannot serve the adapter (lora: adapter): {url}: {why}")


class BaseSend:
    """Every rank: the base, as one version, to each group holding a server that does not serve it (a
    sharded trainer cannot fingerprint its shards: its servers always get it); ``ConfigError`` when a
    server refuses it. Segments a same-host server then serves from are kept in ``pools``."""

    def __init__(self, config: WeightSyncConfig, ranks: TrainerRanks, runtime: Runtime, packer: PackBackend):
        self.config, self.ranks, self.runtime, self.packer = config, ranks, runtime, packer
        self.pools: list[SegmentPool] = []

    def run(self, model: Weights, base: WeightLayout, ties: TiedNames, fleets: list[Fleet],
            following: FollowingRank | None) -> None:
        cfg, ranks = self.config, self.ranks
        reader = WeightsReader(ties, ranks.world > 1, None, base)
        try:
            named = reader.read(model).tensors()
        finally:
            reader.close()
        if ranks.leader:
            plan = BucketPlan.from_groups(base.target_groups(), cfg.bucket_bytes,
                                          any(f.single_dtype_buckets for f in fleets), ranks.world > 1)
            owners = balanced_owners(plan, fleets[0].sources)
            todo = self._without_base(named, fleets)
            version = 1 + max((v for f in todo for v in f.member_versions().values()), default=0)
            setup = (version, plan, owners) if todo else None
            ranks.from_leader(BaseVersion(setup))
        else:
            assert following is not None
            setup = following.until(BaseVersion).setup
        if setup is None:
            return
        version, plan, owners = setup
        kinds = BufferKinds.of(cfg, ranks, self.runtime, self.packer, plan, named, owners, base, snapshot="device")
        if not ranks.leader:
            assert following is not None
            follow_version(following, plan, cfg.checksum, version, kinds.ring().packing(named))
            return
        for f in todo:
            log.info("sending the base (%.1f MB) as version %d to %s", plan.total_bytes / 1e6, version,
                     f.epochs.current.urls)
            result = send_version(f, plan, version, self._source(f, plan, named, kinds))
            if result.failures:
                url, why = next(iter(result.failures.items()))
                raise ConfigError(f"the base (lora: adapter) could not be sent to {url}: {why}")

    def _without_base(self, named: Any, fleets: list[Fleet]) -> list[Fleet]:
        """The fleets with a server that does not serve the base ``named`` (each server compares
        CRC32Cs; a sharded trainer's servers are all sent it)."""
        if self.ranks.world > 1:
            return list(fleets)
        check = BaseCheck(tuple((n, tensor_crc(t)) for n, t in named.items()))
        todo = []
        for f in fleets:
            answers = f.call_members(lambda e: e.serves_base(check), "serves_base")
            unknown = [u for u, a in answers.items() if a is None]
            if unknown:
                log.warning("%s cannot tell which base they serve: the adapter is applied to what they serve", unknown)
            if any(a is False or isinstance(a, BaseException) for a in answers.values()):
                todo.append(f)
        return todo

    def _source(self, fleet: Fleet, plan: BucketPlan, named: Any, kinds: BufferKinds) -> BucketSource:
        """A ring packed from the live weights, or, with a server on shared memory, a segment it then
        serves from (kept until ``close``)."""
        pool = shared_pool([fleet], plan)
        if pool is None:
            return kinds.ring().packing(named)
        self.pools.append(pool)
        buffers = SharedSnapshot(plan, self.runtime.device, self.packer, self.config.checksum, pool)
        buffers.pack_all(named)
        return buffers.packed()

    def close(self) -> None:
        for pool in self.pools:
            pool.close()
        self.pools = []


def start_loads(config: WeightSyncConfig, fleets: list[Fleet], adapter: Adapter, session: str,
                control: ControlLoop, metrics: SyncMetrics) -> AdapterLoads:
    """Rank 0: the fleets send adapter versions from now on, and a server's version is the newest
    adapter version it serves (those it already serves are adopted, and unloaded like this
    session's once they fall behind)."""
    loads = AdapterLoads(config.lora_name, adapter.config, session, config.max_staleness, control, metrics,
                         config.deadlines.load_s)
    for f in fleets:
        served = f.call_members(lambda e: e.adapter_versions(config.lora_name), "adapter_versions")
        for url, versions in served.items():
            loads.adopt(url, versions if isinstance(versions, list) else [])
        f.serve(AdapterVersions(loads))
    return loads
