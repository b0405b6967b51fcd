"""Where a receiver's versions land, and which of that memory its served weights still need.

Every receiver stages a version whole before it applies it (the reference server swaps the buffers
in, asyncsync's vLLM engine loads from views of them, the reference server's SGLang API assembles
them bucket by bucket). ``StagingBuffers`` owns that memory and its bookkeeping; the ways a version
comes in (``protocol.intake``) only ask it for buffers, and the receiver tells it what it did with
a version (``mark_live`` / ``mark_committed``), which decides what may be received into next and
which version a delta is rebuilt from.

Only torch and the standard library are imported here (receivers load this package).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from asyncsync.protocol.arena import Arena, DeviceRing, HostArena
from asyncsync.protocol.device import Runtime
from asyncsync.protocol.digest import bucket_digest, digest_problems
from asyncsync.protocol.specs import Bucket, unpack
from asyncsync.protocol.wire import BucketMeta


@dataclass(frozen=True)
class StagedVersion:
    """A whole version received and verified in flat buffers, not yet applied. ``views`` are typed
    views of every tensor inside the buffers, in broadcast order (no copy), made while the buckets
    were still arriving, so that applying a version only swaps tensors in."""

    version: int
    buffers: tuple[torch.Tensor, ...]
    buckets: tuple[Bucket, ...]
    views: tuple[tuple[str, torch.Tensor], ...]
    segment: str | None = None  # the trainer's shared-memory segment the buffers map (zero-copy adoption)
    # What each bucket hashed to, where the version was announced with ``digest`` (None: it was not);
    # ``unpublished`` compares them with the trainer's before anything is applied.
    digests: tuple[str, ...] | None = None

    @classmethod
    def of(cls, version: int, buffers: tuple[torch.Tensor, ...], buckets: tuple[Bucket, ...],
           segment: str | None = None, digests: tuple[str, ...] | None = None) -> StagedVersion:
        views = tuple(v for buf, bucket in zip(buffers, buckets) for v in unpack(buf, bucket))
        return cls(version, buffers, buckets, views, segment, digests)

    def unpublished(self, expected: tuple[str, ...]) -> list[str]:
        """Why these bytes are not the version the trainer published (``expected``: its digests, from
        ``end``); empty when they are, or when neither the announcement nor ``end`` carried digests.
        A version hashed on no way in (a shared-memory one) is hashed now when ``end`` carries them."""
        if self.digests is None and not expected:
            return []
        digests = self.digests if self.digests is not None else tuple(bucket_digest(b) for b in self.buffers)
        return digest_problems(digests, expected, self.version)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor's view, in broadcast order."""
        return iter(self.views)


@dataclass(frozen=True, eq=False)
class BufferSet:
    """The buffers of one bucket layout, one per bucket; a set that backs live weights is never
    received into. Sets are told apart by identity (whose buffers), never by their bytes."""

    layout: tuple[BucketMeta, ...]
    buffers: tuple[torch.Tensor, ...]


def _within(tensor: torch.Tensor, arena: Arena) -> bool:
    start = arena.tensor.data_ptr()
    return start <= tensor.data_ptr() < start + max(arena.nbytes, 1)


class StagingBuffers:
    """The memory a receiver stages versions in, on its weights' device (``runtime``), and what of it
    the served weights still use.

    Where versions are staged (``protocol.arena``): in ``arenas``, whole-version buffers made once
    and touched (``stage_in``): with one, every version is received into it (a receiver that copies
    each version out: vLLM's worker, the reference server's ``host`` staging); with two, into the one
    the live weights do not alias (the reference server's ``device`` staging swaps them). Without,
    in buffer sets allocated per layout (a receiver serving straight from the mapping of a same-host
    trainer's segment, or assembling SGLang's buckets). An arena in host memory on a device runtime
    (NCCL) receives through ``ring``, two bucket-sized device buffers.

    The committed version (``committed``) is the baseline of a delta version: each delta bucket is
    rebuilt from its bytes. They stay intact where the live weights alias them (a set never received
    into); in an arena they last until the next version is received into it, and ``for_layout``
    forgets the baseline then.
    """

    def __init__(self, runtime: Runtime, arenas: Sequence[Arena] = ()):
        self.runtime = runtime
        self.arenas: tuple[Arena, ...] = ()
        self.ring: DeviceRing | None = None
        self._live_arena: Arena | None = None  # the arena the live weights alias (two-arena staging)
        self._sets: list[BufferSet] = []  # sets allocated per layout (no arena, or too small a one)
        self._live_set: BufferSet | None = None  # the set the live weights alias
        self._live_segment: str | None = None  # the shared-memory segment the live weights map, if any
        self._committed: StagedVersion | None = None  # the baseline of delta versions, while intact
        self.stage_in(arenas)

    def stage_in(self, arenas: Sequence[Arena], live: Arena | None = None) -> None:
        """Stage every later version in ``arenas`` (see the class); ``live``: one of them that the live
        weights alias now (never received into until another version is live)."""
        self.arenas, self._live_arena = tuple(arenas), live
        host_arena = any(isinstance(a, HostArena) for a in self.arenas)
        self.ring = DeviceRing(self.runtime.device) if host_arena and self.runtime.kind != "host" else None
        self._sets = []

    @property
    def committed(self) -> StagedVersion | None:
        """The version the receiver serves, while its bytes are intact here: a delta's baseline."""
        return self._committed

    @property
    def holds(self) -> tuple[str, ...]:
        """The trainer's shared-memory segments the live weights map, which the trainer must not
        rewrite: reported in every ``end`` answer."""
        return (self._live_segment,) if self._live_segment is not None else ()

    def for_layout(self, layout: tuple[BucketMeta, ...]) -> BufferSet:
        """A buffer set for ``layout`` that the live weights do not use; sets of stale layouts are
        dropped. A set in an arena is received into over what it held: a committed version there is
        then no baseline."""
        free = next((a for a in self.arenas if a is not self._live_arena), None)
        sizes = [m.nbytes for m in layout]
        if free is not None and sum(sizes) <= free.nbytes:
            if self._committed is not None and any(_within(b, free) for b in self._committed.buffers):
                self._committed = None
            return BufferSet(layout, free.views(sizes))
        self._sets = [s for s in self._sets if s is self._live_set or s.layout == layout]
        for s in self._sets:
            if s is not self._live_set:
                return s
        fresh = BufferSet(layout, tuple(self._new_buffer(m) for m in layout))
        self._sets.append(fresh)
        return fresh

    def spare(self, index: int, meta: BucketMeta) -> torch.Tensor:
        """A buffer for bucket ``index`` of a version assembled bucket by bucket: the one of a set
        the live weights do not use, where that set's bucket ``index`` had the same layout, else new."""
        for s in self._sets:
            if s is not self._live_set and index < len(s.layout) and s.layout[index] == meta:
                return s.buffers[index]
        return self._new_buffer(meta)

    def keep(self, assembled: BufferSet) -> None:
        """``assembled`` (buffers from ``spare``) now holds a version: keep it for reuse beside the
        live set, and drop every other set."""
        self._sets = [s for s in (self._live_set, assembled) if s is not None]

    def _new_buffer(self, meta: BucketMeta) -> torch.Tensor:
        return torch.empty(meta.nbytes, dtype=torch.uint8, device=self.runtime.device)

    def mark_live(self, staged: StagedVersion) -> None:
        """The live weights now alias ``staged``'s buffers: receive the next version elsewhere."""
        self._committed = staged
        self._live_segment = staged.segment
        self._live_set = next((s for s in self._sets if s.buffers is staged.buffers), None)
        self._live_arena = next((a for a in self.arenas if staged.buffers and _within(staged.buffers[0], a)), None)

    def mark_committed(self, staged: StagedVersion) -> None:
        """The receiver now serves ``staged`` from copies of it (vLLM's load, the reference server's
        ``host`` staging): its live weights alias nothing staged, and ``staged``'s bytes are the next
        delta's baseline while they stay intact."""
        self._committed = staged
        self._live_segment, self._live_set, self._live_arena = None, None, None
