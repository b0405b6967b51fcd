"""Sending one version to every member: the HTTP phases around the data-plane broadcasts.

    result = send_version(members, version, plan, source)

For each server, concurrently, in the control loop: ``begin``, then ``update`` (posted before the
first broadcast, answered by the server once every bucket arrived), then, after the trainer's
broadcasts, ``end``. Each phase has its own deadline, ``engine.calls(phase) x deadlines.http_s``,
enforced inside the control loop; a phase that fails or misses it is followed by ``abort`` (resume
generation, close an update session), so no server is left paused. The trainer's own waits on the
control loop are derived from those deadlines. Nothing raises for a server's failure: it is in
``result.failures`` and in the metrics' events (``evicted`` for a server that gave no answer,
``refused`` for one that answered no). No collective ever waits on an HTTP answer.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from asyncsync.engines.base import EngineClient
from asyncsync.metrics import SyncResult
from asyncsync.packing.checks import UnpackableTensor
from asyncsync.protocol.frames import VersionFrames
from asyncsync.protocol.group import DataPlaneError
from asyncsync.protocol.lora import AdapterUpdate
from asyncsync.protocol.specs import LAYOUT_REFUSED, BucketPlan
from asyncsync.protocol.wire import BucketMeta, DeltaVersion, SharedVersion, UpdateRequest
from asyncsync.ranks import TrainerRankLost, TrainerRanks
from asyncsync.transport.adapters import AdapterLoads
from asyncsync.control import ServerError
from asyncsync.transport.commands import Done, Version
from asyncsync.transport.follower import Follower
from asyncsync.transport.membership import Membership, within
from asyncsync.transport.sources import BucketSource
from asyncsync.transport.topology import TrainerGroups

log = logging.getLogger(__name__)

SLACK_S = 5.0  # added to a wait on the control loop derived from the deadlines inside it


def send_version(members: Membership, version: int, plan: BucketPlan, source: BucketSource,
                 result: SyncResult | None = None, adapter: AdapterLoads | None = None) -> SyncResult:
    """Broadcast every bucket of ``plan`` from ``source`` and have every member apply ``version``.

    With ``adapter`` (``lora: adapter``) the version is an adapter's: each member verifies it and
    writes its directory (``result.server_versions``: the members that wrote it), and once the other
    trainer ranks were told the version is done, ``adapter`` loads it into each engine (their
    ``members.server_versions`` move then), off every trainer collective.

    The time ``source.bucket`` and ``source.checksum`` take is counted as ``pack_s``. Never raises for
    a server's failure: see ``result.failures`` and the metrics' events. Raises what ``source.bucket``
    raised when a bucket cannot be packed half-way (the trainer's fault): the group is dropped at once
    so no server waits out a deadline, no server applies the version, and a new epoch is formed
    before raising."""
    cfg = members.config
    ranks = members.ranks
    members.settle()
    members.readmit()
    result = result or SyncResult(version, plan.total_bytes, len(plan.buckets))
    start = time.perf_counter()
    result.send_started = start
    result.started = result.started or start
    if members.group is None and not members.shared:
        ranks.from_leader(Version(None))  # no server to send to: the other ranks skip it too
        result.failures = dict(members.evicted)
        result.finished = time.perf_counter()
        ranks.from_leader(Done(result))
        return result
    engines = list(members.members)
    delta = delta_for(members, plan, source)
    sizes = [n or b.nbytes for n, b in zip(delta.nbytes, plan.buckets)] if delta else [b.nbytes for b in plan.buckets]
    deadlines = tuple(members.pace.deadline_s(n) for n in sizes)
    sources = tuple(source.owner(b) for b in plan.buckets) if members.sources > 1 else ()
    request = UpdateRequest(version, tuple(BucketMeta.of(b) for b in plan.buckets), cfg.checksum, deadlines, sources,
                            delta=delta)
    requests = shared_requests(members, request, plan, source, result)  # same-host servers: where the version is
    skipped = [e.url for e in engines if e.url in members.shared and e.url not in requests]
    if skipped:
        log.warning("version %d is not in shared memory: %s keep their version until the next one", version, skipped)
        engines = [e for e in engines if e.url not in skipped]
    frames = VersionFrames.of(request)  # every bucket's frame header to asyncsync's receivers carries it
    ranks.from_leader(Version(VersionPlan(version, deadlines, frames, delta)))
    n = len(plan.buckets)
    http_s = cfg.deadlines.http_s

    def deadline(e: EngineClient, phase: str) -> float:
        return e.calls(phase, n) * http_s  # type: ignore[arg-type]

    async def abort(e: EngineClient) -> None:
        """Undo the server's open policies; its own failure is logged, never raised over the first."""
        try:
            await within(e, e.abort(version), deadline(e, "abort"), "abort")
        except ServerError as err:
            log.warning("%s", err)

    async def begin_and_update(e: EngineClient) -> None:
        try:
            if adapter is None:
                await within(e, e.begin(version), deadline(e, "begin"), "begin")
                await within(e, e.update(requests.get(e.url, request)), deadline(e, "update"), "update")
            else:
                await within(e, e.begin_adapter(version), deadline(e, "begin"), "begin")
                update = AdapterUpdate(requests.get(e.url, request), adapter.target(e.url, version))
                await within(e, e.update_adapter(update), deadline(e, "update"), "update")
        except Exception:
            await abort(e)
            raise

    async def end(e: EngineClient) -> int:
        try:
            if adapter is None:
                return await within(e, e.end(version), deadline(e, "end"), "end")
            await within(e, e.end_adapter(version), deadline(e, "end"), "end")
            return version  # written; served once loaded
        except Exception:
            await abort(e)
            raise

    # One future per server, so the broadcast can watch them: a server whose update is answered
    # before its data was sent is not receiving (unless it receives in the background and said yes),
    # and the rest of the version is not broadcast (a sharded trainer's ranks go through every bucket
    # together: there, deadlines end it).
    posted = {e.url: members.control.submit(begin_and_update(e)) for e in engines}
    background = frozenset(e.url for e in engines if e.receives_in_background)
    broken: str | PackFailed | None = None
    if members.group is not None:  # servers on shared memory already know where the version is
        wired = {u: f for u, f in posted.items() if u not in members.shared}
        try:
            broken, crcs = _data_path(members.group, ranks, plan, source, result, deadlines, frames,
                                      wired if ranks.world == 1 else None, background, delta)
            broken = _finish_data_path(members, plan, broken, crcs, deadlines, frames)
        except TrainerRankLost:
            # Another trainer rank is gone: its buckets will never come. The dropped group fails every
            # server's update at once (each is aborted: it keeps serving its last complete version).
            members.drop_group(broken=True)
            _collect(posted, max(deadline(e, "begin") + deadline(e, "update") + deadline(e, "abort") for e in engines))
            raise
    result.wire_s = time.perf_counter() - start - result.pack_s
    if members.group is not None:
        result.wire_bytes = sum(sizes)
        result.delta_base = delta.base if delta else None
        result.delta_buckets = sum(1 for n in delta.nbytes if n) if delta else 0
    if broken is None:
        if members.group is not None:
            members.pace.observe(result.wire_bytes, result.wire_s)
    else:
        members.drop_group(broken=True)
    t0 = time.perf_counter()
    updated = _collect(posted, max((deadline(e, "begin") + deadline(e, "update") + deadline(e, "abort") for e in engines),
                                   default=0.0))
    if isinstance(broken, PackFailed):
        # The trainer abandoned the version: every server's update failed with the dropped group (and
        # was aborted), none is sent ``end``, so each keeps serving its last complete version. No
        # server is to blame: a new epoch over the same servers, then the caller hears why. A server
        # receiving in the background said yes before the group was dropped: it is told to discard.
        answered = [e for e in engines if not isinstance(updated[e.url], BaseException)]
        _collect({e.url: members.control.submit(abort(e)) for e in answered},
                 max((deadline(e, "abort") for e in answered), default=0.0))
        members.form(engines)
        ranks.from_leader(Done(None))
        cause, broken = broken.cause, None
        try:
            raise cause
        finally:
            del cause  # no cycle through this frame: the group it held goes with the caller's exception
    took = [e for e in engines if not isinstance(updated[e.url], BaseException)]
    ended = _collect({e.url: members.control.submit(end(e)) for e in took},
                     max((deadline(e, "end") + deadline(e, "abort") for e in took), default=0.0))
    result.server_versions = {u: v for u, v in ended.items() if not isinstance(v, BaseException)}
    for e in engines:  # the baseline of each server's next delta: what it committed of this sync, and only that
        if adapter is None and result.server_versions.get(e.url) == version:
            members.baselines[e.url] = version
        else:
            members.baselines.pop(e.url, None)
    if adapter is None:
        result.switch_s = {e.url: e.last_switch_s for e in took
                           if e.url in result.server_versions and e.last_switch_s is not None}
        members.server_versions.update(result.server_versions)
    for url in result.server_versions:
        members.refusing.pop(url, None)
    if members.pool is not None:
        for e in took:
            if e.url in members.shared and e.url in result.server_versions:
                members.pool.settle(e.url, e.holds)  # what it still maps: never rewritten until released
    failures = {u: r for u, r in (updated | ended).items() if isinstance(r, BaseException)}
    result.failures = {u: str(r) for u, r in failures.items()}
    unreachable = [u for u, r in failures.items() if not (isinstance(r, ServerError) and r.status is not None)]
    for url, err in failures.items():
        if url not in unreachable:
            members.metrics.event("refused", url, version, str(err))
            if LAYOUT_REFUSED in str(err):  # every later version of this plan would be refused too
                members.refusing[url] = str(err)
    for url in unreachable:
        members.evict(url, result.failures[url])
        if members.pool is not None and url in requests:
            members.pool.evicted(url, requests[url].shm.segment)  # it may still be reading: never rewrite it
    if broken is not None or unreachable:
        members.form([e for e in engines if e.url not in unreachable])
    result.apply_s = time.perf_counter() - t0
    result.finished = time.perf_counter()
    result.total_s = result.finished - result.started
    ranks.from_leader(Done(result))
    if adapter is not None:  # the trainer ranks are released: no collective waits on a load
        adapter.offer([e for e in took if e.url in result.server_versions], version, members.server_versions)
    return result


def delta_for(members: Membership, plan: BucketPlan, source: BucketSource) -> DeltaVersion | None:
    """The version as deltas, when every server it goes to can take them: each committed, from this
    sync, exactly the version ``source``'s buckets were encoded against (``Membership.baselines``),
    its receivers rebuild deltas, and it gets the data-plane broadcast (one broadcast reaches every
    member of a group, so a group gets deltas only when all its members can take them; with
    ``group_per_server`` each server is decided alone). None otherwise, and when every bucket goes
    whole anyway: a new, restarted or readmitted server, one that missed or refused a version, a
    version packed without a baseline, servers on shared memory (nothing crosses a wire)."""
    base = source.delta_base
    if base is None or members.group is None or not members.takes_deltas():
        return None
    if not all(members.baselines.get(e.url) == base for e in members.members):
        return None
    nbytes = source.delta_nbytes()
    return DeltaVersion(base, nbytes) if nbytes is not None and any(nbytes) else None


def shared_requests(members: Membership, request: UpdateRequest, plan: BucketPlan, source: BucketSource,
                    result: SyncResult) -> dict[str, UpdateRequest]:
    """The update request of each member on shared memory: ``request`` plus where the version lies
    (``source.segment``, packed before ``send_version``) and each bucket's CRC32C, which travel with
    it instead of after the broadcast. A source that is not in shared memory (a same-host server
    readmitted after the version was packed) sends these members nothing new: they keep serving
    their version and get the next one."""
    segment, pool = source.segment, members.pool
    if not members.shared or segment is None or pool is None:
        return {}
    t0 = time.perf_counter()
    crcs = tuple(int(c) for c in (source.checksum(b) for b in plan.buckets) if c is not None) if request.checksum else ()
    result.pack_s += time.perf_counter() - t0
    assert pool.host is not None, "a pool exists only where there is shared memory"
    shm = dataclasses.replace(request, shm=SharedVersion(segment.name, pool.offsets, crcs, pool.host))
    return {url: shm for url in members.shared}


def _collect(futures: dict[str, concurrent.futures.Future[Any]], within_s: float) -> dict[str, Any]:
    """Each server's result (or exception) of one phase run in the control loop. The phase carries its
    own deadline, so this wait only guards against a bug: past it, a server still pending has failed."""
    out: dict[str, Any] = {}
    give_up = time.monotonic() + within_s + SLACK_S
    for url, future in futures.items():
        try:
            out[url] = future.result(max(0.0, give_up - time.monotonic()))
        except concurrent.futures.TimeoutError:
            future.cancel()
            out[url] = ServerError(url, f"no answer within {within_s:.1f}s", timed_out=True)
        except Exception as e:  # the phase's own failure
            out[url] = e
    return out


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


def follow_version(follower: Follower, plan: BucketPlan, source: BucketSource, checksum: bool) -> SyncResult | None:
    """A sharded trainer's rank other than 0: its part of the version rank 0 announces next, and rank
    0's result of it (None when rank 0 abandoned it); raises ``Stopped`` when rank 0 closes instead,
    ``TrainerRankLost`` when a rank is gone, and what ``source`` raised when this rank could not pack
    its pieces. Never raises for a server's failure."""
    ranks = follower.ranks
    announced = follower.until(Version).plan
    failed: PackFailed | None = None
    if announced is not None and follower.group is not None:
        broken, crcs = _data_path(follower.group, ranks, plan, source, None, announced.deadlines, announced.frames, None,
                                  delta=announced.delta)
        ranks.gather_objects((_outcome_text(broken), _crc_ints(crcs) if checksum else {}))
        failed = broken if isinstance(broken, PackFailed) else None
        if broken is not None and failed is None:
            follower.drop_group(broken=True)  # rank 0 forms a new epoch (and tells this rank) before "done"
    result = follower.until(Done).result
    if failed is not None:
        raise failed.cause
    return result


def _finish_data_path(members: Membership, plan: BucketPlan, broken: str | PackFailed | None,
                      crcs: dict[int, Any], deadlines: tuple[float, ...], frames: VersionFrames) -> str | PackFailed | None:
    """Rank 0, after every rank's data path: each rank's outcome, then the checksum manifest."""
    ranks = members.ranks
    if ranks.world > 1:
        outcomes = ranks.gather_objects((_outcome_text(broken), _crc_ints(crcs) if members.config.checksum else {})) or []
        for rank, (text, theirs) in enumerate(outcomes):
            if rank and text is not None and broken is None:
                broken = PackFailed(RuntimeError(text[len(_PACK):])) if text.startswith(_PACK) else f"trainer rank {rank}: {text}"
            crcs.update(theirs)
    if broken is None and members.config.checksum:
        try:
            members.group.broadcast_checksums([crcs[b.index] for b in plan.buckets], max(deadlines), frames)
        except DataPlaneError as e:
            broken = str(e)
    if broken is not None and not isinstance(broken, PackFailed):
        log.warning("data plane failed in epoch %d: %s", members.epoch, broken)
    return broken


_PACK = "could not pack: "


def _outcome_text(broken: str | PackFailed | None) -> str | None:
    return _PACK + str(broken.cause) if isinstance(broken, PackFailed) else broken


def _crc_ints(crcs: dict[int, Any]) -> dict[int, int]:
    """Checksums as ints, to travel to rank 0 (a device checksum is read here, on the sender's thread)."""
    return {i: int(c) for i, c in crcs.items()}


def _data_path(group: TrainerGroups, ranks: TrainerRanks, plan: BucketPlan, source: BucketSource,
               result: SyncResult | None, deadlines: tuple[float, ...], frames: VersionFrames,
               posted: dict[str, concurrent.futures.Future[Any]] | None,
               background: frozenset[str] = frozenset(),
               delta: DeltaVersion | None = None) -> tuple[str | PackFailed | None, dict[int, Any]]:
    """Every bucket, each with its deadline: a sharded trainer's ranks send each bucket's pieces to
    its owner, which broadcasts it; a single process broadcasts every bucket (its delta, where
    ``delta`` says so; the checksum is still the whole bucket's). Returns what broke the
    data plane, as text (an exception kept here would hold the group's sockets through its traceback)
    or the packing failure that abandoned the version, and the checksums of the buckets this rank sent.

    A sharded trainer's ranks go through every bucket's exchange whatever happens to their
    broadcasts, so sends and receives stay paired on every rank; after a failure a rank only stops
    broadcasting. A rank that is gone raises ``TrainerRankLost`` (the sync cannot go on)."""
    works: dict[int, Any] = {}
    crcs: dict[int, Any] = {}
    sent: list[torch.Tensor] = []  # every buffer stays referenced until its broadcast finished
    stopped: str | PackFailed | None = None
    sharded = ranks.world > 1

    def wait(i: int) -> None:
        nonlocal stopped
        work = works.pop(i)
        if isinstance(stopped, str):
            return  # the group broke: it is aborted after this version, and no other wait would succeed
        try:
            group.wait(work)  # returns by the broadcast's own deadline
        except DataPlaneError as e:
            stopped = stopped or str(e)

    for i, bucket in enumerate(plan.buckets):
        mine = source.owner(bucket) == ranks.rank
        before = source.reuses(bucket) if mine else None
        if before is not None and before in works:
            wait(before)  # that buffer is rewritten only once its broadcast finished
        if posted is not None and stopped is None:
            stopped = _answered_early(posted, background)
        if stopped is not None and not sharded:
            break
        t0 = time.perf_counter()
        buf = None
        try:
            if not mine:
                source.contribute(bucket)
            elif delta is not None and delta.nbytes[i]:
                encoded = source.delta(bucket)
                assert encoded is not None, "a bucket announced as a delta was encoded"
                buf = encoded.payload()
            else:
                buf = source.bucket(bucket)  # a sharded trainer's owner receives the other ranks' pieces here
        except UnpackableTensor as e:
            log.error("version abandoned: bucket %d could not be packed: %s", i, e)
            if not sharded:
                return PackFailed(e), crcs
            # ``contribute`` sent stale bytes anyway, so the other ranks' sends and receives stay
            # paired; no server applies them (rank 0 hears of the failure before the manifest).
            stopped = stopped if isinstance(stopped, PackFailed) else PackFailed(e)
            continue
        if result is not None:
            result.pack_s += time.perf_counter() - t0
        if buf is None or stopped is not None:
            continue
        try:
            works[i] = group.broadcast_async(buf, deadlines[i], frames.header(i, buf))
        except DataPlaneError as e:
            stopped = str(e)
            continue
        sent.append(buf)
        t0 = time.perf_counter()
        crc = source.checksum(bucket)
        if result is not None:
            result.pack_s += time.perf_counter() - t0
        if crc is not None:
            crcs[i] = crc
    for i in list(works):
        wait(i)
    return stopped, crcs
