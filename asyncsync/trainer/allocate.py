"""Which buffers a rank packs its versions into, chosen once at ``connect`` (and measured by ``sync_memory``).

    kinds = BufferKinds.of(config, ranks, runtime, packer, plan, named, owners, layout, pool, delta)
    ring = kinds.ring()          # blocking mode: a Ring, or a sharded rank's ShardedBuffers
    snapshot = kinds.snapshot()  # async mode, one per snapshot the worker keeps

A single process: ``trainer.buffers``' kinds (a ``Baseline`` snapshot with deltas, a
``SharedSnapshot`` when a server maps shared memory). A sharded trainer's rank, or a host snapshot
(``snapshot: host``): ``trainer.shards.ShardedBuffers``, whose delta baseline is the buckets the rank
owns, on the weights' device (none with a host snapshot: it is there to keep device memory free).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncsync.config import WeightSyncConfig
from asyncsync.packing import PackBackend, get_backend
from asyncsync.protocol.device import Runtime, runtime_for
from asyncsync.protocol.specs import BucketPlan
from asyncsync.ranks import TrainerRanks
from asyncsync.trainer.buffers import Baseline, Ring, SharedSnapshot, Snapshot
from asyncsync.trainer.layout import WeightLayout
from asyncsync.trainer.shards import ShardedBuffers, ShardLayout, SourcePlan, sources
from asyncsync.trainer.source import TiedNames, WeightsReader, all_tensors, weights_device
from asyncsync.transport.fleet import Fleet
from asyncsync.transport.shm import SegmentPool


@dataclass(frozen=True)
class BufferKinds:
    """Factories of this rank's blocking ring and of one async snapshot."""

    ring: Callable[[], Ring | ShardedBuffers]
    snapshot: Callable[[], Any]

    @classmethod
    def of(cls, config: WeightSyncConfig, ranks: TrainerRanks, runtime: Runtime, packer: PackBackend, plan: BucketPlan,
           named: dict[str, Any], owners: list[int], layout: WeightLayout | None, pool: SegmentPool | None = None,
           delta: bool = False, snapshot: str | None = None) -> BufferKinds:
        """Of ``plan`` in ``layout`` (None: the plan's names are the weights'); ``snapshot``: device or
        host (default: the config's); with a ``pool``, a version-sized snapshot in its shared memory;
        with ``delta``, the snapshot is the delta baseline (a single process keeps blocking mode's
        baseline beside its ring: ``Baseline``), and so does a sharded rank's ring."""
        where = snapshot or config.snapshot
        checksum, device = config.checksum, runtime.device
        if ranks.world > 1 or (where == "host" and pool is None):
            converts = layout is not None and not layout.identity
            assembled = SourcePlan(tuple(layout.source_bucket(b) for b in plan.buckets)) if converts else plan
            shards = ShardLayout.of(assembled, sources(named), ranks.world, owners)
            conversion = layout.conversion if converts else None
            encoder = packer if delta and ranks.world > 1 else None
            return cls(lambda: ShardedBuffers(plan, shards, ranks, runtime, checksum, None, conversion, encoder),
                       lambda: ShardedBuffers(plan, shards, ranks, runtime, checksum, where, conversion,
                                              encoder if where == "device" else None))
        if pool is not None:
            return cls(lambda: Ring(plan, device, packer, checksum),
                       lambda: SharedSnapshot(plan, device, packer, checksum, pool))
        kind = Baseline if delta else Snapshot
        return cls(lambda: Ring(plan, device, packer, checksum), lambda: kind(plan, device, packer, checksum))


def shared_pool(fleets: list[Fleet], plan: BucketPlan) -> SegmentPool | None:
    """The shared-memory segments versions are packed into when a server maps them (``transport``),
    leased to every fleet so that what its servers hold is never rewritten; None when no server is
    on shared memory."""
    if not any(f.epochs.current.shared for f in fleets):
        return None
    pool = SegmentPool([b.nbytes for b in plan.buckets])
    for f in fleets:
        f.lease(pool)
    return pool


def sync_memory(config: WeightSyncConfig, model: Any) -> dict[str, dict[str, int]]:
    """The bytes a single trainer process's sync allocates for ``model`` in each mode (blocking,
    async with the snapshot on the device, async with it in host memory), on the weights' device
    and in host memory, as ``connect`` would allocate them (tied weights once), without any server;
    ``conversion``: the most a version's conversion to the engines' layout allocates at once.
    The buffers are allocated to be measured, then released (``asyncsync doctor`` prints this)."""
    held, ties = all_tensors(model), TiedNames.decide(model, None)
    layout = WeightLayout.of(model, held, config.layout == "checkpoint").keeping(ties.drop(held))
    named = WeightsReader(ties, layout=layout).read(model).tensors()
    runtime = runtime_for(weights_device(held))
    packer = get_backend(config.pack_backend, runtime.device)
    plan = BucketPlan.from_groups(layout.target_groups(), config.bucket_bytes)
    owners = [0] * len(plan.buckets)
    out = {}
    for mode, snapshot in (("blocking", None), ("async_device", "device"), ("async_host", "host")):
        kinds = BufferKinds.of(config, TrainerRanks(), runtime, packer, plan, named, owners, layout,
                               snapshot=snapshot or "device")
        buffers = kinds.ring() if snapshot is None else kinds.snapshot()
        footprint = buffers.footprint
        out[mode] = {"device": footprint.device, "host": footprint.host, "conversion": layout.scratch_bytes(plan)}
        del buffers
    if config.delta == "auto" and config.checksum and packer.encodes_deltas:
        # async mode's baseline is its snapshot; blocking mode keeps a whole version beside its ring
        out["blocking_delta"] = {**out["blocking"], "device": out["blocking"]["device"] + plan.total_bytes}
    return out
