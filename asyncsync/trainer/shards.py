"""Which bytes of each bucket every trainer rank holds, and how a bucket's owner assembles it.

A sharded trainer's weights are DTensors: on its mesh each rank holds a slice of every global tensor
(``Shard(d)``) or a whole copy (``Replicate``); a plain tensor is the same on every rank. All of it is
computed from metadata (global shape and dtype, mesh, placements), with no communication, the same
way on every rank::

    layout = ShardLayout.of(plan, named, world, owners)  # owners: the rank that sends each bucket
    # every rank: its contribution to bucket b is its slices of b's tensors, packed in plan order,
    #             padded to the largest rank's contribution (a gather moves equal sizes)
    pack_contribution(layout.buckets[b], rank, named, out)      # from the live shards or a snapshot
    # the owner, after gathering every rank's contribution:
    assemble(layout.buckets[b], contributions, bucket_buffer)   # each slice into its place

Only the rank whose mesh coordinate is 0 along every ``Replicate`` dim sends a replicated slice,
and a plain tensor is taken from the owner's own copy, so no byte crosses the trainer twice.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any
from dataclasses import dataclass

import torch

from asyncsync.protocol.specs import Bucket, BucketPlan, byte_view


@dataclass(frozen=True)
class Piece:
    """One rank's slice of one tensor of a bucket: where it sits in the tensor and in the contribution."""

    spec: int                       # index into the bucket's specs
    shape: tuple[int, ...]          # the slice's shape
    offset: tuple[int, ...]         # its offset in the global tensor, per dim
    at: int                         # byte offset in the rank's contribution
    nbytes: int


@dataclass(frozen=True)
class BucketShards:
    """For one bucket: its owner, every rank's pieces, and the (padded) size of a contribution."""

    bucket: Bucket
    owner: int
    pieces: tuple[tuple[Piece, ...], ...]  # per rank
    size: int                              # bytes of each rank's contribution buffer (the largest)

    def contribution_bytes(self, rank: int) -> int:
        return sum(p.nbytes for p in self.pieces[rank])


@dataclass(frozen=True)
class ShardLayout:
    buckets: tuple[BucketShards, ...]
    world: int

    @classmethod
    def of(cls, plan: BucketPlan, named: Mapping[str, torch.Tensor], world: int, owners: Sequence[int]) -> ShardLayout:
        """``named`` holds this rank's view (DTensors, or plain tensors that every rank holds whole)."""
        out = []
        for bucket, owner in zip(plan.buckets, owners, strict=True):
            per_rank: list[list[Piece]] = [[] for _ in range(world)]
            sizes = [0] * world
            for i, spec in enumerate(bucket.specs):
                for rank, shape, offset in _slices(named[spec.name], world, owner):
                    nbytes = math.prod(shape) * spec.dtype.itemsize
                    per_rank[rank].append(Piece(i, shape, offset, sizes[rank], nbytes))
                    sizes[rank] += nbytes
            out.append(BucketShards(bucket, owner, tuple(tuple(p) for p in per_rank), max(sizes)))
        return cls(tuple(out), world)

    def snapshot_bytes(self, rank: int) -> int:
        """What a snapshot of this rank's contributions holds (padded, so it can be gathered in place)."""
        return sum(b.size for b in self.buckets)


def balanced_owners(plan: BucketPlan, world: int) -> list[int]:
    """An owner per bucket, balancing bytes: the largest buckets first, each to the least-loaded rank."""
    load = [0] * world
    owners = [0] * len(plan.buckets)
    for bucket in sorted(plan.buckets, key=lambda b: -b.nbytes):
        rank = min(range(world), key=lambda r: (load[r], r))
        owners[bucket.index] = rank
        load[rank] += bucket.nbytes
    return owners


def _slices(t: torch.Tensor, world: int, owner: int) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """(rank, local shape, global offset) of every rank that sends a part of ``t``."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    if not isinstance(t, DTensor):
        return [(owner, tuple(t.shape), (0,) * t.dim())]  # every rank holds it whole: the owner's copy
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, tuple(t.placements)
    for p in placements:
        if isinstance(p, Partial) or not isinstance(p, (Shard, Replicate)) or (isinstance(p, Shard) and type(p) is not Shard):
            raise ValueError(f"a DTensor placed as {p} cannot be sent: asyncsync gathers Shard(d) and Replicate "
                             "placements (a Partial one needs a reduction first)")
    coords = mesh.mesh
    out = []
    for rank in coords.flatten().tolist():
        if rank >= world:
            raise ValueError(f"the DTensor's mesh has rank {rank}, but the trainer group has {world} ranks: asyncsync's "
                             "sharded path needs meshes over the ranks that call connect()")
        coord = [int(c) for c in (coords == rank).nonzero()[0]]
        if any(coord[d] != 0 for d, p in enumerate(placements) if isinstance(p, Replicate)):
            continue  # a replica of a slice another rank sends
        shape, offset = _compute_local_shape_and_global_offset(tuple(t.shape), tuple(mesh.shape), coord, placements)
        out.append((rank, tuple(shape), tuple(offset)))
    return out


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's local data of a tensor of the view (a DTensor's local shard, or the tensor itself)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def pack_contribution(shards: BucketShards, rank: int, named: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """This rank's pieces of a bucket, in order, into ``out`` (at least ``shards.size`` bytes)."""
    specs = shards.bucket.specs
    with torch.no_grad():
        for piece in shards.pieces[rank]:
            if piece.nbytes:
                spec = specs[piece.spec]
                local = local_part(named[spec.name]).detach()
                byte_view(out, piece.at, spec.dtype, piece.shape).copy_(local.reshape(piece.shape))


def assemble(shards: BucketShards, contributions: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """The owner's step: every rank's pieces (``contributions[rank]``) into their places in the bucket."""
    bucket = shards.bucket
    with torch.no_grad():
        for rank, pieces in enumerate(shards.pieces):
            for piece in pieces:
                if not piece.nbytes:
                    continue
                spec, at = bucket.specs[piece.spec], bucket.offsets[piece.spec]
                whole = byte_view(out, at, spec.dtype, spec.shape)
                region = whole[tuple(slice(o, o + s) for o, s in zip(piece.offset, piece.shape))]
                region.copy_(byte_view(contributions[rank], piece.at, spec.dtype, piece.shape))


class ShardedBuffers:
    """One rank's buffers for sending a sharded trainer's versions.

    * contributions: this rank's pieces of the buckets. Async mode: a snapshot, one area per bucket,
      packed once per version by the snapshotter (``pack_all``). Blocking mode: one area, packed from
      the live shards just before each bucket's gather.
    * staging: ``world`` contributions of the largest bucket this rank owns (the gather's output).
    * slot: one bucket-sized buffer, where the owner assembles the bucket it sends next.

    So a rank holds one snapshot of its shards (async) and, as an owner, two buckets: never the
    model. ``nbytes`` is what lives on the weights' device, ``host_nbytes`` a host snapshot's.
    """

    def __init__(self, layout: ShardLayout, rank: int, runtime: Any, checksum: bool, snapshot: str | None):
        self.layout, self.rank, self.runtime, self.checksum = layout, rank, runtime, checksum
        device = runtime.device
        owned = [b for b in layout.buckets if b.owner == rank]
        self._areas: dict[int, tuple[int, int]] = {}
        if snapshot is None:
            size = max((b.size for b in layout.buckets), default=0)
            self.contributions = torch.empty(size, dtype=torch.uint8, device=device)
        else:
            offset = 0
            for b in layout.buckets:
                self._areas[b.bucket.index] = (offset, b.size)
                offset += b.size
            on_host = snapshot == "host"
            self.contributions = torch.empty(offset, dtype=torch.uint8, device="cpu" if on_host else device,
                                             pin_memory=on_host and runtime.kind == "cuda")
        self.host_snapshot = snapshot == "host"
        self._upload = (torch.empty(max((b.size for b in layout.buckets), default=0), dtype=torch.uint8, device=device)
                        if self.host_snapshot and runtime.kind == "cuda" else None)
        self.staging = torch.empty(layout.world * max((b.size for b in owned), default=0), dtype=torch.uint8, device=device)
        self.slot = torch.empty(max((b.bucket.nbytes for b in owned), default=0), dtype=torch.uint8, device=device)
        self._last_owned: dict[int, int] = {}  # bucket -> the previous bucket this rank owns (they share the slot)
        for before, after in zip(owned, owned[1:]):
            self._last_owned[after.bucket.index] = before.bucket.index

    @property
    def nbytes(self) -> int:
        device = self.slot.numel() + self.staging.numel() + (self._upload.numel() if self._upload is not None else 0)
        return device + (0 if self.host_snapshot else self.contributions.numel())

    @property
    def host_nbytes(self) -> int:
        return self.contributions.numel() if self.host_snapshot else 0

    def _area(self, index: int) -> torch.Tensor:
        if not self._areas:
            return self.contributions[: self.layout.buckets[index].size]
        start, size = self._areas[index]
        return self.contributions[start : start + size]

    def pack_all(self, named: Mapping[str, torch.Tensor]) -> None:
        """The snapshot: this rank's pieces of every bucket (the caller checked the layout)."""
        for shards in self.layout.buckets:
            pack_contribution(shards, self.rank, named, self._area(shards.bucket.index))

    def source(self, named: Mapping[str, torch.Tensor] | None = None) -> ShardedSource:
        """A source for ``send_version``: from the snapshot, or (``named``) from the live shards."""
        return ShardedSource(self, named)


class ShardedSource:
    """Per bucket: this rank's contribution (every rank), then, at the bucket's owner, the gathered
    contributions assembled into the slot and sent from there (``transport.send`` drives it)."""

    def __init__(self, buffers: ShardedBuffers, named: Mapping[str, torch.Tensor] | None):
        self.buffers, self.named = buffers, named
        self._crc: dict[int, int | torch.Tensor | None] = {}

    def owner(self, bucket: Bucket) -> int:
        return self.buffers.layout.buckets[bucket.index].owner

    def contribution(self, bucket: Bucket) -> torch.Tensor:
        b = self.buffers
        shards = b.layout.buckets[bucket.index]
        area = b._area(bucket.index)
        if self.named is not None:
            pack_contribution(shards, b.rank, self.named, area)
        if b._upload is not None:  # a host snapshot: up to the device just before the gather
            return b._upload[: area.numel()].copy_(area, non_blocking=True)
        return area

    def staging(self, bucket: Bucket) -> list[torch.Tensor]:
        """The owner's gather outputs for ``bucket``: one contribution-sized view per rank."""
        b = self.buffers
        size = b.layout.buckets[bucket.index].size
        return [b.staging[r * size : (r + 1) * size] for r in range(b.layout.world)]

    def assemble(self, bucket: Bucket, gathered: Sequence[torch.Tensor]) -> None:
        b = self.buffers
        out = b.slot[: bucket.nbytes]
        assemble(b.layout.buckets[bucket.index], gathered, out)
        if b.checksum:
            from asyncsync.protocol.checksum import bucket_crc

            self._crc[bucket.index] = bucket_crc(out)

    def reuses(self, bucket: Bucket) -> int | None:
        return self.buffers._last_owned.get(bucket.index)

    def bucket(self, bucket: Bucket) -> torch.Tensor:
        return self.buffers.slot[: bucket.nbytes]

    def checksum(self, bucket: Bucket) -> int | torch.Tensor | None:
        return self._crc.pop(bucket.index, None)
