"""One version's broadcasts on one trainer rank: every bucket into the data-plane groups, each with
its deadline, then (rank 0) the checksum manifest.

    broken, crcs, digests = DataPath(group, ranks, plan, source, ...).run()       # every rank
    broken, digests = finish_data_path(ranks, group, plan, broken, crcs, digests, ...)   # rank 0
    result = follow_version(following, plan, checksum, version, source)   # a sharded trainer's other ranks

A sharded trainer's ranks send each bucket's pieces to its owner, which broadcasts it; a single
process broadcasts every bucket (its delta, where the version's ``DeltaVersion`` says so; the
checksum is still the whole bucket's). With ``digest`` each bucket's cryptographic digest
(``protocol/digest.py``: of the whole bucket, a delta's too) is taken on a thread of its own right
after its broadcast started, while the bytes are on the wire; rank 0 sends them to each server with
``end``. What broke the data plane is kept as text (an exception kept
here would hold the group's sockets through its traceback), or as ``PackFailed`` when a bucket could
not be packed (the trainer's fault: the version is abandoned).
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from asyncsync.metrics import SyncResult
from asyncsync.packing.checks import UnpackableTensor
from asyncsync.protocol.digest import bucket_digest
from asyncsync.protocol.frames import VersionFrames
from asyncsync.protocol.group import DataPlaneError
from asyncsync.protocol.specs import Bucket, BucketPlan
from asyncsync.protocol.wire import DeltaVersion
from asyncsync.ranks import TrainerRanks
from asyncsync.transport.commands import Done, Version
from asyncsync.transport.follower import FollowingRank
from asyncsync.transport.sources import BucketSource
from asyncsync.transport.topology import TrainerGroups

log = logging.getLogger(__name__)

_PACK = "could not pack: "
HASHERS = 2  # threads hashing buckets (``digest``) while the next ones are packed and sent; blake3 frees the GIL


@dataclass(frozen=True)
class PackFailed:
    """``source.bucket`` raised half-way through a version (a tensor freed or resized by another
    thread since the version was checked): the version cannot be completed."""

    cause: Exception


@dataclass(frozen=True)
class VersionPlan:
    """What rank 0 tells a sharded trainer's other ranks before a version's data path runs."""

    version: int
    deadlines: tuple[float, ...]  # per bucket, as sent to the servers
    frames: VersionFrames         # what each bucket's frame header carries
    delta: DeltaVersion | None    # which buckets go as deltas (their owners broadcast those)
    digest: bool = False          # each owner hashes the buckets it sends (``protocol/digest.py``)


class DataPath:
    """Every bucket of ``plan`` from ``source`` on this rank. ``posted``: a single process's servers'
    ``update`` answers, watched while broadcasting (a server that answered before its data was sent
    is not receiving it, unless it receives in the background, ``background``, and said yes).

    A sharded trainer's ranks go through every bucket's exchange whatever happens to their
    broadcasts, so sends and receives stay paired on every rank; after a failure a rank only stops
    broadcasting. A rank that is gone raises ``TrainerRankLost`` (the sync cannot go on)."""

    def __init__(self, group: TrainerGroups, ranks: TrainerRanks, plan: BucketPlan, source: BucketSource,
                 result: SyncResult | None, deadlines: tuple[float, ...], frames: VersionFrames,
                 posted: dict[str, concurrent.futures.Future[Any]] | None = None,
                 background: frozenset[str] = frozenset(), delta: DeltaVersion | None = None, digest: bool = False):
        self.group, self.ranks, self.plan, self.source, self.result = group, ranks, plan, source, result
        self.deadlines, self.frames, self.posted, self.background, self.delta = deadlines, frames, posted, background, delta
        self.digest = digest
        self.works: dict[int, Any] = {}
        self.crcs: dict[int, Any] = {}
        self.digests: dict[int, concurrent.futures.Future[str]] = {}
        self.sent: list[torch.Tensor] = []  # every buffer stays referenced until its broadcast finished
        self.stopped: str | PackFailed | None = None

    def run(self) -> tuple[str | PackFailed | None, dict[int, Any], dict[int, str]]:
        """What broke (None: nothing), the checksums and (``digest``) the digests of the buckets this rank sent."""
        with concurrent.futures.ThreadPoolExecutor(HASHERS, "asyncsync-digest") as self.hashers:
            stopped, crcs = self._run()
        return stopped, crcs, {i: d.result() for i, d in self.digests.items() if stopped is None}

    def _run(self) -> tuple[str | PackFailed | None, dict[int, Any]]:
        sharded = self.ranks.world > 1
        for i, bucket in enumerate(self.plan.buckets):
            mine = self.source.owner(bucket) == self.ranks.rank
            before = self.source.reuses(bucket) if mine else None
            if before is not None and before in self.works:
                self._wait(before)  # that buffer is rewritten only once its broadcast finished
            if self.posted is not None and self.stopped is None:
                self.stopped = _answered_early(self.posted, self.background)
            if self.stopped is not None and not sharded:
                break
            try:
                buf = self._timed(lambda: self._bytes(i, bucket, mine))
            except UnpackableTensor as e:
                log.error("version abandoned: bucket %d could not be packed: %s", i, e)
                if not sharded:
                    return PackFailed(e), self.crcs
                # ``contribute`` sent stale bytes anyway, so the other ranks' sends and receives stay
                # paired; no server applies them (rank 0 hears of the failure before the manifest).
                self.stopped = self.stopped if isinstance(self.stopped, PackFailed) else PackFailed(e)
                continue
            if buf is not None and self.stopped is None:
                self._broadcast(i, bucket, buf)
        for i in list(self.works):
            self._wait(i)
        return self.stopped, self.crcs

    def _bytes(self, i: int, bucket: Bucket, mine: bool) -> torch.Tensor | None:
        """Bucket ``i``'s bytes to broadcast (its delta's, where it goes as one), or None on a rank that
        only contributes its pieces to the bucket's owner."""
        if not mine:
            self.source.contribute(bucket)
            return None
        if self.delta is not None and self.delta.nbytes[i]:
            encoded = self.source.delta(bucket)
            assert encoded is not None, "a bucket announced as a delta was encoded"
            return encoded.payload()
        return self.source.bucket(bucket)  # a sharded trainer's owner receives the other ranks' pieces here

    def _broadcast(self, i: int, bucket: Bucket, buf: torch.Tensor) -> None:
        try:
            self.works[i] = self.group.broadcast_async(buf, self.deadlines[i], self.frames.header(i, buf))
        except DataPlaneError as e:
            self.stopped = str(e)
            return
        self.sent.append(buf)
        crc = self._timed(lambda: self.source.checksum(bucket))
        if crc is not None:
            self.crcs[i] = crc
        if self.digest:  # of the whole bucket: a delta's receiver hashes the bucket it rebuilt
            whole = self.source.bucket(bucket) if self.delta is not None and self.delta.nbytes[i] else buf
            self.digests[i] = self.hashers.submit(bucket_digest, whole)

    def _timed(self, fn: Any) -> Any:
        """``fn()``, its time counted as packing (``result.pack_s``)."""
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            if self.result is not None:
                self.result.pack_s += time.perf_counter() - t0

    def _wait(self, i: int) -> None:
        if i in self.digests:
            self.digests[i].result()  # its buffer is rewritten next: hashed first
        work = self.works.pop(i)
        if isinstance(self.stopped, str):
            return  # the group broke: it is aborted after this version, and no other wait would succeed
        try:
            self.group.wait(work)  # returns by the broadcast's own deadline
        except DataPlaneError as e:
            self.stopped = self.stopped or str(e)


def finish_data_path(ranks: TrainerRanks, group: TrainerGroups, plan: BucketPlan, broken: str | PackFailed | None,
                     crcs: dict[int, Any], digests: dict[int, str], deadlines: tuple[float, ...], frames: VersionFrames,
                     checksum: bool, epoch: int) -> tuple[str | PackFailed | None, tuple[str, ...]]:
    """Rank 0, after every rank's data path: each rank's outcome, then the checksum manifest; what
    broke (None: nothing) and every bucket's digest in plan order (empty without, or when it broke)."""
    if ranks.world > 1:
        outcomes = ranks.gather_objects((_outcome_text(broken), _crc_ints(crcs) if checksum else {}, digests)) or []
        for rank, (text, theirs, hashed) in enumerate(outcomes):
            if rank and text is not None and broken is None:
                broken = PackFailed(RuntimeError(text[len(_PACK):])) if text.startswith(_PACK) else f"trainer rank {rank}: {text}"
            crcs.update(theirs)
            digests.update(hashed)
    if broken is None and checksum:
        try:
            group.broadcast_checksums([crcs[b.index] for b in plan.buckets], max(deadlines), frames)
        except DataPlaneError as e:
            broken = str(e)
    if broken is not None and not isinstance(broken, PackFailed):
        log.warning("data plane failed in epoch %d: %s", epoch, broken)
    whole = broken is None and len(digests) == len(plan.buckets)
    return broken, tuple(digests[b.index] for b in plan.buckets) if whole else ()


def follow_version(following: FollowingRank, plan: BucketPlan, checksum: bool, version: int,
                   source: BucketSource) -> SyncResult | None:
    """A sharded trainer's rank other than 0: its part of the version rank 0 announces next (every
    rank publishes the same ``version``, like a collective; rank 0's plan says what is sent), and
    rank 0's result of it (None when rank 0 abandoned it); raises ``Stopped`` when rank 0 closes
    instead, ``TrainerRankLost`` when a rank is gone, and what ``source`` raised when this rank could
    not pack its pieces. Never raises for a server's failure."""
    ranks = following.ranks
    announced = following.until(Version).plan
    if announced is not None and announced.version != version:
        raise RuntimeError(f"trainer rank {ranks.rank} published version {version}, rank 0 version {announced.version}: "
                           "every rank publishes the same versions, in the same order")
    failed: PackFailed | None = None
    if announced is not None and following.group is not None:
        broken, crcs, digests = DataPath(following.group, ranks, plan, source, None, announced.deadlines,
                                         announced.frames, delta=announced.delta, digest=announced.digest).run()
        ranks.gather_objects((_outcome_text(broken), _crc_ints(crcs) if checksum else {}, digests))
        failed = broken if isinstance(broken, PackFailed) else None
        if broken is not None and failed is None:
            following.drop_group(broken=True)  # rank 0 forms a new epoch (and tells this rank) before "done"
    told = following.until(Done).result
    if failed is not None:
        raise failed.cause
    return told


def _outcome_text(broken: str | PackFailed | None) -> str | None:
    return _PACK + str(broken.cause) if isinstance(broken, PackFailed) else broken


def _crc_ints(crcs: dict[int, Any]) -> dict[int, int]:
    """Checksums as ints, to travel to rank 0 (a device checksum is read here, on the sender's thread)."""
    return {i: int(c) for i, c in crcs.items()}


def _answered_early(posted: dict[str, concurrent.futures.Future[Any]], background: frozenset[str]) -> str | None:
    """A server that answered its update before the broadcast ended is not receiving it (it failed or
    refused before any data), unless it receives in the background and answered yes: what it said,
    or None when every server is still receiving."""
    for url, future in posted.items():
        if future.done():
            error = future.exception()
            if error is None and url in background:
                continue
            return f"{url} answered before its data was sent ({error or 'no error'}): the version cannot complete"
    return None
