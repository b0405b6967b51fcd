"""Which bytes of each bucket every trainer rank holds, and how a bucket's owner assembles it.

A sharded trainer's weights are DTensors: on its mesh each rank holds a slice of every global tensor
(``Shard(d)``) or a whole copy (``Replicate``); a plain tensor is the same on every rank. All of it is
computed from metadata (global shape and dtype, mesh, placements), with no communication, the same
way on every rank::

    layout = ShardLayout.of(plan, named, world, owners)  # owners: the rank that sends each bucket
    # every rank but the owner: its pieces of bucket b, packed in plan order, sent to b's owner
    pack_contribution(layout.buckets[b], rank, named, out)      # from the live shards or a snapshot
    # the owner, having received the others' pieces (its own are read where they are):
    assemble(layout.buckets[b], contributions, bucket_buffer)   # each slice into its place

Only the rank whose mesh coordinate is 0 along every ``Replicate`` dim sends a replicated slice,
and a plain tensor is taken from the owner's own copy, so no byte crosses the trainer twice and a
bucket's contributions add up to exactly its bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncsync.metrics import Footprint
from asyncsync.packing import PackBackend
from asyncsync.packing.checks import UnpackableTensor, memory_problem
from asyncsync.packing.delta import Delta
from asyncsync.protocol.checksum import bucket_crc
from asyncsync.checkpoint import Conversion
from asyncsync.protocol.specs import Bucket, BucketPlan, byte_view, unpack
from asyncsync.trainer.buffers import Baseline
from asyncsync.trainer.layout import LayoutView
from asyncsync.transport.sources import BucketSource
from asyncsync.trainer.source import check_layout, local_part


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
    """For one bucket: its owner, and every rank's pieces (in plan order, packed back to back)."""

    bucket: Bucket
    owner: int
    pieces: tuple[tuple[Piece, ...], ...]  # per rank

    def contribution_bytes(self, rank: int) -> int:
        return sum(p.nbytes for p in self.pieces[rank])

    def incoming_bytes(self) -> int:
        """What the owner receives: every other rank's contribution."""
        return sum(self.contribution_bytes(r) for r in range(len(self.pieces)) if r != self.owner)


@dataclass(frozen=True)
class SourcePlan:
    """The buckets a sharded trainer's owners assemble when versions are sent in the engines' layout:
    each planned bucket's sources (``WeightLayout.source_bucket``), converted once assembled."""

    buckets: tuple[Bucket, ...]


@dataclass(frozen=True)
class ShardLayout:
    buckets: tuple[BucketShards, ...]
    world: int

    @classmethod
    def of(cls, plan: BucketPlan | SourcePlan, named: Mapping[str, torch.Tensor], world: int,
           owners: Sequence[int]) -> ShardLayout:
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
            out.append(BucketShards(bucket, owner, tuple(tuple(p) for p in per_rank)))
        return cls(tuple(out), world)


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


def _readable(name: str, local: torch.Tensor) -> torch.Tensor:
    """``local``, detached, or ``UnpackableTensor`` when its memory was freed or resized since the
    version was checked (another thread): the copy would read memory that is not the tensor's."""
    problem = memory_problem(local)
    if problem is not None:
        raise UnpackableTensor(f"tensor '{name}' {problem}")
    return local.detach()


def pack_contribution(shards: BucketShards, rank: int, named: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
    """This rank's pieces of a bucket, in order, into ``out`` (at least ``contribution_bytes(rank)`` bytes)."""
    specs = shards.bucket.specs
    with torch.no_grad():
        for piece in shards.pieces[rank]:
            if piece.nbytes:
                spec = specs[piece.spec]
                local = _readable(spec.name, local_part(named[spec.name]))
                byte_view(out, piece.at, spec.dtype, piece.shape).copy_(local.reshape(piece.shape))


def assemble(shards: BucketShards, parts: Mapping[int, torch.Tensor], out: torch.Tensor,
             live: tuple[int, Mapping[str, torch.Tensor]] | None = None) -> None:
    """The owner's step: every rank's pieces (``parts[rank]``, packed) into their places in the
    bucket; with ``live`` = (rank, its view), that rank's pieces are read from its tensors instead."""
    bucket = shards.bucket
    with torch.no_grad():
        for rank, pieces in enumerate(shards.pieces):
            for piece in pieces:
                if not piece.nbytes:
                    continue
                spec, at = bucket.specs[piece.spec], bucket.offsets[piece.spec]
                whole = byte_view(out, at, spec.dtype, spec.shape)
                region = whole[tuple(slice(o, o + s) for o, s in zip(piece.offset, piece.shape))]
                if live is not None and live[0] == rank:
                    region.copy_(_readable(spec.name, local_part(live[1][spec.name])).reshape(piece.shape))
                else:
                    region.copy_(byte_view(parts[rank], piece.at, spec.dtype, piece.shape))


class ShardedBuffers:
    """One rank's buffers for sending a sharded trainer's versions (or, with a world of one, a
    snapshot kept in host memory). Memory, on the weights' device, is the budget:

    * ``snapshot`` (async mode): this rank's pieces of every bucket, packed once per version by the
      snapshotter (``pack_all``): the size of its local shards, on the device (``"device"``) or in
      host memory (``"host"``: pinned on CUDA; each piece goes up to the device just before it is
      sent). None in blocking mode, where pieces are packed from the live shards as they are sent.
    * ``scratch``: one buffer for whatever a bucket needs on the device besides the bucket itself:
      as its owner, the pieces the other ranks send; otherwise this rank's pieces, when they are
      packed from the live shards or come up from a host snapshot. Its uses never overlap: a send
      returns once the bytes are handed over, and received pieces are assembled at once.
    * ``slot``: the bucket this rank assembles and broadcasts, reused by the buckets it owns (a
      bucket waits for the previous one's broadcast: ``reuses``).

    * ``baseline`` (``delta: auto``, a ``packer`` that encodes deltas): the buckets this rank owns,
      as the last version sent held them (``Baseline`` over those buckets): the
      baseline each next version's owned buckets are encoded against, about the model's bytes over
      the number of ranks.

    So a rank holds its own shards once (async) and two buckets at most on the device, plus its owned
    buckets with deltas: never the model (``footprint``).
    """

    def __init__(self, plan: BucketPlan, layout: ShardLayout, ranks: Any, runtime: Any, checksum: bool,
                 snapshot: str | None, conversion: Conversion | None = None, packer: PackBackend | None = None):
        self.plan, self.layout, self.ranks, self.runtime, self.checksum = plan, layout, ranks, runtime, checksum
        self.conversion = conversion
        rank = self.rank = ranks.rank
        device = self.device = runtime.device
        owned = [b for b in layout.buckets if b.owner == rank]
        self._areas: dict[int, tuple[int, int]] = {}
        self.host_snapshot = snapshot == "host"
        self.snapshot: torch.Tensor | None = None
        if snapshot is not None:
            offset = 0
            for b in layout.buckets:
                size = b.contribution_bytes(rank)
                self._areas[b.bucket.index] = (offset, size)
                offset += size
            self.snapshot = torch.empty(offset, dtype=torch.uint8, device="cpu" if self.host_snapshot else device,
                                        pin_memory=self.host_snapshot and runtime.kind == "cuda")
        staged = snapshot is None or (self.host_snapshot and runtime.kind != "cpu")  # own pieces need a device copy
        need = [b.incoming_bytes() for b in owned]
        need += [b.contribution_bytes(rank) for b in layout.buckets if b.owner != rank and staged]
        self.scratch = torch.empty(max(need, default=0), dtype=torch.uint8, device=device)
        self.slot = torch.empty(max((b.bucket.nbytes for b in owned), default=0), dtype=torch.uint8, device=device)
        # Converting to the engines' layout: the owner assembles the bucket's sources in ``slot``,
        # then packs their conversion into ``converted`` (the bucket sent).
        self.converted = torch.empty(max((plan.buckets[b.bucket.index].nbytes for b in owned), default=0) if conversion
                                     else 0, dtype=torch.uint8, device=device)
        self._last_owned = {after.bucket.index: before.bucket.index for before, after in zip(owned, owned[1:])}
        self.baseline = (Baseline(plan, device, packer, True, [plan.buckets[b.bucket.index] for b in owned])
                         if packer else None)
        self.version: int | None = None  # the version ``pack_all`` last packed

    @property
    def footprint(self) -> Footprint:
        """On the weights' device: the scratch, the slot (and its converted bucket), a device snapshot
        and the delta baseline; in host memory, a host snapshot."""
        baseline = self.baseline.footprint if self.baseline is not None else Footprint()
        snapshot = self.snapshot.numel() if self.snapshot is not None else 0
        device = self.scratch.numel() + self.slot.numel() + self.converted.numel() + baseline.device
        return Footprint(device=device + (0 if self.host_snapshot else snapshot),
                         host=snapshot if self.host_snapshot else 0, baseline=baseline.baseline)

    @property
    def delta(self) -> bool:
        """These buffers keep a delta baseline (blocking mode then encodes ahead: ``encoding``)."""
        return self.baseline is not None

    def area(self, index: int) -> torch.Tensor:
        """This rank's pieces of bucket ``index`` in the snapshot."""
        assert self.snapshot is not None
        start, size = self._areas[index]
        return self.snapshot[start : start + size]

    def pack_all(self, named: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """The snapshot: this rank's pieces of every bucket; raises ``LayoutChanged`` (or
        ``UnpackableTensor``) before writing anything."""
        check_layout(self.plan, named, self.device)
        for shards in self.layout.buckets:
            pack_contribution(shards, self.rank, sources(named), self.area(shards.bucket.index))
        self.version = version

    def packed(self) -> ShardedSource | Encoded:
        """A source for ``send_version`` over what ``pack_all`` wrote; with a baseline, the version
        encoded ahead (``encode``: a collective, on the sender's thread of every rank)."""
        if self.baseline is not None:
            return self.encode(ShardedSource(self, None, checksums=False), self.version)
        return ShardedSource(self, None)

    def packing(self, named: Mapping[str, torch.Tensor]) -> ShardedSource:
        """A source that packs this rank's pieces from the live shards as each bucket is sent; raises
        ``LayoutChanged`` (or ``UnpackableTensor``) now, before anything is sent."""
        check_layout(self.plan, named, self.device)
        return ShardedSource(self, sources(named))

    def encoding(self, named: Mapping[str, torch.Tensor], version: int) -> Encoded:
        """Blocking mode's version encoded ahead from the live shards (``packing``, then ``encode``)."""
        check_layout(self.plan, named, self.device)
        return self.encode(ShardedSource(self, sources(named), checksums=False), version)

    def encode(self, live: ShardedSource, version: int | None) -> Encoded:
        """Every rank, together, before the version's update request: each bucket's pieces go to its
        owner as ``send_version`` would send them, and the owner packs the assembled bucket over its
        baseline, encoding what changed (``Packed.pack``); then rank 0 gathers every bucket's delta
        size, which the request must name. A bucket a rank could not pack keeps the exchange paired
        and is raised again when the version is sent (it is abandoned). Sends nothing to a server."""
        assert self.baseline is not None
        baseline = self.baseline
        base, baseline.version = baseline.version, None  # until every owned bucket is packed, it holds none
        failed: dict[int, UnpackableTensor] = {}
        sizes: dict[int, int] = {}
        for shards in self.layout.buckets:
            bucket = self.plan.buckets[shards.bucket.index]
            try:
                if shards.owner == self.rank:
                    assembled = live.bucket(bucket)  # the pieces are exchanged: what fails next is this rank's alone
                    try:
                        baseline.pack(bucket, dict(unpack(assembled, bucket)), encode=base is not None)
                    except (RuntimeError, MemoryError) as e:  # out of device memory, a kernel error
                        raise UnpackableTensor(f"encoding bucket {bucket.index} failed: {type(e).__name__}: {e}") from e
                    sizes[bucket.index] = baseline.delta_size(bucket)
                else:
                    live.contribute(bucket)
            except UnpackableTensor as e:
                failed[bucket.index] = e
        baseline.version = version if not failed else None
        gathered = self.ranks.gather_objects(sizes)
        nbytes = None
        if gathered is not None:
            every = {i: n for part in gathered for i, n in part.items()}
            nbytes = tuple(every.get(b.index, 0) for b in self.plan.buckets)
        return Encoded(self, base, nbytes, failed)


def sources(named: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
    """The tensors a rank holds pieces of: a version's sources when it is sent in the engines' layout
    (``trainer/layout.py``), which the bucket's owner converts once it assembled them."""
    return named.sources if isinstance(named, LayoutView) else named


class ShardedSource(BucketSource):
    """A ``transport.send.BucketSource`` for a sharded trainer's rank: per bucket, ``owner``; a rank
    that does not own it ``contribute``s its pieces; the owner's ``bucket`` receives the others'
    pieces and assembles the whole bucket in the slot, which it then broadcasts."""

    def __init__(self, buffers: ShardedBuffers, named: Mapping[str, torch.Tensor] | None, checksums: bool = True):
        self.buffers, self.named = buffers, named
        self.checksums = checksums and buffers.checksum  # off where the baseline's packing takes them
        self._crc: dict[int, int | torch.Tensor | None] = {}

    def owner(self, bucket: Bucket) -> int:
        return self.buffers.layout.buckets[bucket.index].owner

    def _pieces(self, shards: BucketShards, out: torch.Tensor) -> torch.Tensor:
        """This rank's pieces of a bucket, packed where a send can read them."""
        b = self.buffers
        size = shards.contribution_bytes(b.rank)
        if self.named is not None:
            pack_contribution(shards, b.rank, self.named, out[:size])
            return out[:size]
        area = b.area(shards.bucket.index)
        if area.device != b.device:  # a host snapshot: up to the device just before it is sent
            return out[:size].copy_(area, non_blocking=True)
        return area

    def contribute(self, bucket: Bucket) -> None:
        """A rank that does not own ``bucket``: its pieces to the owner (nothing when it has none)."""
        b = self.buffers
        shards = b.layout.buckets[bucket.index]
        size = shards.contribution_bytes(b.rank)
        if not size:
            return
        try:
            pieces = self._pieces(shards, b.scratch)
        except UnpackableTensor:
            b.ranks.send(b.scratch[:size], shards.owner)  # stale bytes keep the ranks paired; the version is abandoned
            raise
        b.ranks.send(pieces, shards.owner)

    def bucket(self, bucket: Bucket) -> torch.Tensor:
        """The owner: the bucket, assembled in the slot from its own pieces and the others'."""
        b = self.buffers
        shards = b.layout.buckets[bucket.index]
        parts: dict[int, torch.Tensor] = {}
        at = 0
        for rank in range(b.layout.world):
            size = shards.contribution_bytes(rank)
            if rank != b.rank and size:
                parts[rank] = b.scratch[at : at + size]
                at += size
        if parts:
            b.ranks.receive(parts)
        out = b.slot[: shards.bucket.nbytes]
        if self.named is not None:
            assemble(shards, parts, out, live=(b.rank, self.named))
        else:
            parts[b.rank] = b.area(bucket.index)
            assemble(shards, parts, out)
        if b.conversion is not None:  # the whole sources are here: their conversion is the bucket sent
            out = convert_bucket(b.conversion, shards.bucket, out, bucket, b.converted[: bucket.nbytes])
        if self.checksums:
            self._crc[bucket.index] = bucket_crc(out)
        return out

    def reuses(self, bucket: Bucket) -> int | None:
        return self.buffers._last_owned.get(bucket.index)

    def checksum(self, bucket: Bucket) -> int | torch.Tensor | None:
        return self._crc.pop(bucket.index, None)


def convert_bucket(conversion: Conversion, assembled: Bucket, buf: torch.Tensor, bucket: Bucket, out: torch.Tensor) -> torch.Tensor:
    """``bucket`` (targets in the engines' layout) into ``out``, converted from the ``assembled``
    bucket of their sources in ``buf``: the conversion runs where a bucket's full tensors are."""
    made = conversion.apply(dict(unpack(buf, assembled)))
    with torch.no_grad():
        for spec, at in zip(bucket.specs, bucket.offsets):
            byte_view(out, at, spec.dtype, spec.shape).copy_(made[spec.name])
    return out


class Encoded(BucketSource):
    """A ``transport.send.BucketSource`` over a version ``ShardedBuffers.encode`` packed ahead: each
    owner's buckets are whole in its baseline (``delta_base``: the version they were encoded
    against; None: not encoded), their deltas and checksums ready; the pieces already reached their
    owners, so ``contribute`` sends nothing. ``delta_nbytes`` (rank 0 only) is every bucket's."""

    def __init__(self, buffers: ShardedBuffers, base: int | None, nbytes: tuple[int, ...] | None,
                 failed: dict[int, UnpackableTensor]):
        assert buffers.baseline is not None
        self.buffers, self.baseline, self.failed = buffers, buffers.baseline, failed
        self.delta_base = base if not failed else None
        self._nbytes = nbytes

    def owner(self, bucket: Bucket) -> int:
        return self.buffers.layout.buckets[bucket.index].owner

    def reuses(self, bucket: Bucket) -> int | None:
        return None

    def _check(self, bucket: Bucket) -> None:
        if bucket.index in self.failed:
            raise self.failed[bucket.index]

    def contribute(self, bucket: Bucket) -> None:
        self._check(bucket)

    def bucket(self, bucket: Bucket) -> torch.Tensor:
        self._check(bucket)
        return self.baseline.get(bucket)[0]

    def checksum(self, bucket: Bucket) -> int | torch.Tensor | None:
        return self.baseline.get(bucket)[1]

    def delta(self, bucket: Bucket) -> Delta | None:
        self._check(bucket)
        return self.baseline.delta_of(bucket)

    def delta_nbytes(self) -> tuple[int, ...] | None:
        return self._nbytes if self.delta_base is not None else None
