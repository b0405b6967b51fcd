"""Sending one version to every server, as a pipeline of values.

    result = send_version(fleet, plan, version, source)

runs, on rank 0 (a sharded trainer's other ranks follow with ``transport.datapath.follow_version``)::

    fleet.epochs.start_version()                             # expelled out, parked back, evicted probed
    announcement = announce(fleet, version, plan, source, result)   # frozen: the request of each server,
                                                             # frames, sizes, deadlines, deltas, who ends early
    delivery = deliver(fleet, announcement, source, result)  # begin + update posted, every server begun, the
                                                             # other ranks told, the data path, every answer
                                                             # collected, ``end`` to those that took it
    reform = record(fleet, announcement, delivery, result)   # the book's transitions: took, refused, unreachable
    repair = announcement.whole(missed)                      # with a relay: the servers a failed hop left
    deliver(fleet, repair, source, result)                   # without it get it again, whole, once
    done(fleet, result, took)                                # the other ranks hear the result; the kind's after

Each HTTP phase has its own deadline (``transport.phases``); nothing raises for a server's failure: it
is in ``result.failures`` and in the metrics' events (``evicted`` for a server that gave no answer,
``refused`` for one that answered no). The first broadcast waits for every server's ``begin`` (a
pausing server lets its requests in flight finish: ``Phases.until_begun``); no collective waits on
an ``update`` answer: it is posted before the first broadcast and collected after the last.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from asyncsync.control import ServerError
from asyncsync.engines.base import EngineClient
from asyncsync.metrics import SyncResult
from asyncsync.protocol.digest import NOT_PUBLISHED
from asyncsync.protocol.frames import VersionFrames
from asyncsync.protocol.specs import BucketPlan
from asyncsync.protocol.wire import MAX_DEADLINE_S, BucketMeta, DeltaVersion, SharedVersion, UpdateRequest
from asyncsync.ranks import TrainerRankLost
from asyncsync.transport.commands import Done, Version
from asyncsync.transport.datapath import DataPath, PackFailed, VersionPlan, finish_data_path
from asyncsync.transport.epochs import Epoch
from asyncsync.transport.fleet import Fleet
from asyncsync.transport.phases import Phases, collect
from asyncsync.transport.relay import RelayTree, ends_early, failed_edges, forgers, reach_s, to_repair
from asyncsync.transport.sources import BucketSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Announcement:
    """What one version is, before any of it moves: ``requests`` per server it goes to (``to``, in
    the epoch's order; a same-host server's names where the version lies; a relayed server's first
    deadline grows with its depth, by ``reach`` seconds: ``relayed_requests``), the relay ``trees``
    it goes down, the bucket ``sizes`` on the wire and their ``deadlines`` (a bucket sent as a delta
    is its delta's size), the ``frames`` every payload's header carries, and the servers that end
    as soon as they received it."""

    version: int
    plan: BucketPlan
    request: UpdateRequest
    requests: Mapping[str, UpdateRequest]
    to: tuple[EngineClient, ...]
    frames: VersionFrames
    sizes: tuple[int, ...]
    whole_deadlines: tuple[float, ...]  # the deadlines of the buckets sent whole (a repair's)
    ends_early: frozenset[str] = frozenset()
    trees: tuple[RelayTree, ...] = ()
    reach: Mapping[str, float] = dataclasses.field(default_factory=dict)  # per relayed server (``relay.reach_s``)
    most_reach_s: float = math.inf  # the most ``reach`` may be (``collective_s``)

    @property
    def delta(self) -> DeltaVersion | None:
        return self.request.delta

    @property
    def deadlines(self) -> tuple[float, ...]:
        return self.request.deadlines_s

    def whole(self, to: tuple[EngineClient, ...], ends_early: frozenset[str],
              trees: tuple[RelayTree, ...]) -> Announcement:
        """The same version to ``to`` only, every bucket whole (a repair: its deltas went with the first
        try); ``ends_early`` and ``trees`` in the repair's own epoch, whose depths its servers'
        deadlines follow."""
        request = dataclasses.replace(self.request, delta=None, deadlines_s=self.whole_deadlines)
        requests, reach = relayed_requests(request, to, trees, self.most_reach_s)
        return dataclasses.replace(self, request=request, requests=requests, to=to, trees=trees, reach=reach,
                                   sizes=tuple(b.nbytes for b in self.plan.buckets), ends_early=ends_early)

    def for_ranks(self) -> VersionPlan:
        """What a sharded trainer's other ranks need of it to send the buckets they own."""
        return VersionPlan(self.version, self.deadlines, self.frames, self.delta, self.request.digest)

    @property
    def digested(self) -> frozenset[str]:
        """The servers sent the trainer's digests with ``end`` (their request announced them)."""
        return frozenset(u for u, r in self.requests.items() if r.digest)


def relayed_requests(request: UpdateRequest, to: Iterable[EngineClient], trees: tuple[RelayTree, ...],
                     most_s: float = math.inf) -> tuple[dict[str, UpdateRequest], dict[str, float]]:
    """Each server's request, and how much later than its tree's root each relayed one may get the
    version's first frame (``relay.reach_s``: one hop per server above it, each within the first
    payload's own deadline, all within ``most_s``). A relayed server's request is ``request`` with
    that added to its first deadline (capped at the wire's ceiling), which its header-0 wait
    (``protocol.receive``) and its background receive's window
    (``protocol.background.finish_window_s``) take; its HTTP phases add it too (``Phases``). Only
    deadlines differ, which the plan hash leaves out: the frames are the same for every server."""
    first = request.deadline_s(0)
    reach = reach_s(trees, first, most_s) if first is not None else {}
    return {e.url: deepened(request, reach.get(e.url, 0.0)) for e in to}, reach


def deepened(request: UpdateRequest, reach_s: float) -> UpdateRequest:
    """``request`` whose first bucket's deadline is ``reach_s`` longer (at most ``MAX_DEADLINE_S``)."""
    if not reach_s or not request.deadlines_s:
        return request
    first, *rest = request.deadlines_s
    return dataclasses.replace(request, deadlines_s=(min(MAX_DEADLINE_S, first + reach_s), *rest))


@dataclass(frozen=True)
class Delivery:
    """What came back of delivering an announcement to its servers (``to``): each server's ``update``
    answer (or failure), the ``end`` answers of those that took it, what broke the data plane (None:
    nothing), when each server's update answered (a relay's hops) and when the trainer started
    waiting for the answers."""

    to: tuple[EngineClient, ...]
    updated: Mapping[str, Any]
    ended: Mapping[str, Any]
    broken: str | None
    received: Mapping[str, float]
    collected_at: float

    def took(self) -> list[EngineClient]:
        """The servers whose ``update`` succeeded (each was sent ``end``)."""
        return [e for e in self.to if not isinstance(self.updated[e.url], BaseException)]


def send_version(fleet: Fleet, plan: BucketPlan, version: int, source: BucketSource,
                 result: SyncResult | None = None) -> SyncResult:
    """Broadcast every bucket of ``plan`` from ``source`` and have every server apply ``version``
    (the fleet's kind of version: the weights, or an adapter's, which the engines then load, off
    every trainer collective).

    The time ``source.bucket`` and ``source.checksum`` take is counted as ``pack_s``. Never raises for
    a server's failure: see ``result.failures`` and the metrics' events. Raises what ``source.bucket``
    raised when a bucket cannot be packed half-way (the trainer's fault): the group is dropped at once
    so no server waits out a deadline, no server applies the version, and a new epoch is formed
    before raising."""
    fleet.epochs.start_version()
    result = result or SyncResult(version, plan.total_bytes, len(plan.buckets))
    result.send_started = time.perf_counter()
    result.started = result.started or result.send_started
    announcement = announce(fleet, version, plan, source, result)
    if announcement is None:
        fleet.ranks.from_leader(Version(None))  # no server to send to: the other ranks skip it too
        result.failures.update(fleet.book.evicted())
        return done(fleet, result, [], None)
    delivery = deliver(fleet, announcement, source, result)
    reform = record(fleet, announcement, delivery, result)
    repair = to_send_again(fleet, announcement, reform, result)
    if repair:
        fleet.epochs.park(repair)
        epoch = fleet.epochs.current
        if epoch.group is not None:
            again = announcement.whole(epoch.members, ends_early(epoch.in_trees(), epoch.members, True), epoch.trees)
            delivery = deliver(fleet, again, source, result)
            reform = record(fleet, again, delivery, result)
            result.repaired = sorted(e.url for e in repair if e.url in result.server_versions)
    if reform is not None:
        fleet.epochs.form(reform)
    return done(fleet, result, [e for e in delivery.took() if e.url in result.server_versions], delivery.collected_at)


def announce(fleet: Fleet, version: int, plan: BucketPlan, source: BucketSource,
             result: SyncResult) -> Announcement | None:
    """The version's announcement to the current epoch's servers; None when no server is there."""
    epoch, pace = fleet.epochs.current, fleet.pace
    if epoch.group is None and not epoch.shared:
        return None
    delta = delta_for(fleet, epoch, plan, source)
    sizes = tuple(n or b.nbytes for n, b in zip(delta.nbytes, plan.buckets)) if delta else \
        tuple(b.nbytes for b in plan.buckets)
    owners = tuple(source.owner(b) for b in plan.buckets) if fleet.sources > 1 else ()
    request = UpdateRequest(version, tuple(BucketMeta.of(b) for b in plan.buckets), fleet.config.checksum,
                            tuple(pace.deadline_s(n) for n in sizes), owners, delta=delta, digest=fleet.config.digests)
    shared = shared_request(fleet, epoch, request, plan, source, result)  # same-host servers map it instead
    to = tuple(e for e in epoch.members if e.url not in epoch.shared or shared is not None)
    skipped = [e.url for e in epoch.members if e not in to]
    if skipped:
        log.warning("version %d is not in shared memory: %s keep their version until the next one", version, skipped)
    most = fleet.config.deadlines.collective_s
    requests, reach = relayed_requests(request, to, epoch.trees, most)
    requests.update({e.url: shared for e in to if shared is not None and e.url in epoch.shared})
    return Announcement(version, plan, request, requests, to, VersionFrames.of(request), sizes,
                        tuple(pace.deadline_s(b.nbytes) for b in plan.buckets),
                        ends_early(epoch.in_trees(), to, fleet.kind.relayed), epoch.trees, reach, most)


def deliver(fleet: Fleet, announcement: Announcement, source: BucketSource, result: SyncResult) -> Delivery:
    """``begin`` and ``update`` posted to every server of the announcement; once every server has
    begun, the other trainer ranks hear the version's plan and the data path runs (every bucket,
    then the checksum manifest); every ``update`` answer collected, then ``end`` to each
    server that took the version. A version the trainer abandoned half-way (``PackFailed``) raises
    its cause here (``abandon``)."""
    control, to = fleet.control, announcement.to
    phases = Phases(fleet.kind, fleet.config.deadlines.http_s, len(announcement.plan.buckets), announcement.ends_early,
                    announcement.reach, announcement.digested)
    posted = {e.url: control.submit(phases.begin_and_update(e, announcement.requests[e.url])) for e in to}
    begun_from = time.perf_counter()
    phases.until_begun(posted, to)
    result.begin_s += time.perf_counter() - begun_from
    try:
        # The other ranks broadcast the buckets they own from now on (a repair, only ever a single
        # process's, tells no one).
        fleet.ranks.from_leader(Version(announcement.for_ranks()))
        broken, digests = data_path(fleet, announcement, source, result, posted)
    except TrainerRankLost:  # every server's update fails with the dropped group
        fleet.epochs.drop(broken=True)
        phases.digested_as(())
        collect(posted, phases.update_s(to))
        raise
    phases.digested_as(digests)
    collected_at = time.perf_counter()
    updated = collect(posted, phases.update_s(to))
    if isinstance(broken, PackFailed):
        abandon(fleet, announcement, phases, updated, broken)
    later = [e for e in to if not isinstance(updated[e.url], BaseException) and e.url not in phases.ended]
    ended = collect({e.url: control.submit(phases.end(e, announcement.version)) for e in later}, phases.end_s(later))
    ended.update(phases.ended)
    return Delivery(to, updated, ended, broken, dict(phases.received), collected_at)


def data_path(fleet: Fleet, announcement: Announcement, source: BucketSource, result: SyncResult,
              posted: dict[str, Any]) -> tuple[str | PackFailed | None, tuple[str, ...]]:
    """Every bucket and the manifest (not for servers on shared memory: they know where the version
    is); what broke (None: nothing) and, with ``digest``, every bucket's digest. Another trainer
    rank gone: ``TrainerRankLost`` (``deliver`` drops the group)."""
    epoch, ranks = fleet.epochs.current, fleet.ranks
    broken: str | PackFailed | None = None
    digests: tuple[str, ...] = ()
    if epoch.group is not None:
        relayed = epoch.relayed()  # their answers say nothing of the trainer's own broadcasts
        wired = {u: f for u, f in posted.items() if u not in epoch.shared and u not in relayed}
        background = frozenset(e.url for e in announcement.to if e.receives_in_background)
        broken, crcs, hashed = DataPath(epoch.group, ranks, announcement.plan, source, result,
                                        announcement.deadlines, announcement.frames,
                                        wired if ranks.world == 1 else None, background, announcement.delta,
                                        announcement.request.digest).run()
        broken, digests = finish_data_path(ranks, epoch.group, announcement.plan, broken, crcs, hashed,
                                           announcement.deadlines, announcement.frames, fleet.config.checksum,
                                           epoch.number)
        result.wire_bytes += sum(announcement.sizes)
        result.delta_base = announcement.delta.base if announcement.delta else None
        result.delta_buckets = sum(1 for n in announcement.delta.nbytes if n) if announcement.delta else 0
    result.wire_s = time.perf_counter() - result.send_started - result.pack_s - result.begin_s  # a repair's included
    if broken is not None:
        fleet.epochs.drop(broken=True)
    elif epoch.group is not None:
        fleet.pace.observe(result.wire_bytes, result.wire_s)
    return broken, digests


def abandon(fleet: Fleet, announcement: Announcement, phases: Phases, updated: dict[str, Any],
            broken: PackFailed) -> None:
    """A version the trainer abandoned (a bucket it could not pack) raises its cause: every server's
    update failed with the dropped group (and was aborted), none is sent ``end``, so each keeps serving
    its last complete version; no server is to blame, so a new epoch forms over the same servers; a
    server receiving in the background said yes before the group was dropped, so it is told to discard."""
    answered = [e for e in announcement.to if not isinstance(updated[e.url], BaseException)]
    collect({e.url: fleet.control.submit(phases.abort(e, announcement.version)) for e in answered},
            phases.abort_s(answered))
    fleet.epochs.form(announcement.to)
    fleet.ranks.from_leader(Done(None))
    cause = broken.cause
    del broken
    try:
        raise cause
    finally:
        del cause  # no cycle through this frame: the group it held goes with the caller's exception


def record(fleet: Fleet, announcement: Announcement, delivery: Delivery, result: SyncResult) -> list[EngineClient] | None:
    """The book's transitions for every server of the announcement: ``took`` (through the kind) for
    those whose ``end`` answered, ``refused`` for those that answered no (a layout refusal is kept:
    every later version of this plan would be refused too), ``unreachable`` for those that gave no
    answer (what they may still read of shared memory is never rewritten). Returns the servers a
    new epoch must form over after an eviction or a broken data plane, else None."""
    book, kind, version = fleet.book, fleet.kind, announcement.version
    answers = {**delivery.updated, **delivery.ended}
    served = {u: v for u, v in delivery.ended.items() if not isinstance(v, BaseException)}
    result.server_versions.update(served)
    for e in announcement.to:
        if e.url in served:
            kind.confirm(book, e, version, served[e.url], result)
        else:
            book.missed(e.url)
    failures = {u: r for u, r in answers.items() if isinstance(r, BaseException)}
    result.failures.update({u: str(r) for u, r in failures.items()})
    unreachable = [u for u, r in failures.items() if not (isinstance(r, ServerError) and r.status is not None)]
    for url, err in failures.items():
        if url in unreachable:
            shm = announcement.requests[url].shm
            book.unreachable(url, str(err), shm.segment if shm is not None else None)
        else:
            book.refused(url, version, str(err))
    unpublished = {u for u, r in failures.items() if u not in unreachable and NOT_PUBLISHED in str(r)}
    for url, below in forgers(announcement.trees, served, unpublished).items():
        book.distrusted(url, version, f"{below}, below it, received bytes of version {version} that are {NOT_PUBLISHED}")
        unreachable.append(url)
    judge_relays(fleet, announcement, delivery, set(served) - set(unreachable),
                 set(failures) - set(unreachable) - unpublished)
    if delivery.broken is not None or unreachable:
        return [e for e in announcement.to if e.url not in unreachable]
    return None


def judge_relays(fleet: Fleet, announcement: Announcement, delivery: Delivery, took: set[str], refused: set[str]) -> None:
    """What a relayed version says of its relaying servers: one whose hop held the servers below it
    moves to a leaf (``Relays.demote_slow``), and so does one that refuses the plan's layout (it
    would refuse every version, and the servers below it would miss every one); an edge whose upper
    server ``took`` the version while its lower one answered that it did not (``refused``, for a
    reason other than its layout: a hop failed, lost or corrupted it) is blamed (``Epochs.blame``):
    its two servers are never an edge again. A server that gave no answer is evicted, and blames no
    one."""
    version, relays, refusing = announcement.version, fleet.epochs.relays, set(fleet.book.refusing())
    demoted = {url: f"its hop of version {version} took {ratio:.1f}x the median of the others"
               for url, ratio in relays.demote_slow(announcement.trees, delivery.received).items()}
    interior = {u for tree in announcement.trees for u in tree.order if tree.below(u)}
    demoted.update({url: "it refuses every version of this plan (its layout): the servers below it would miss each one"
                    for url in sorted(refusing & interior) if relays.demote(url)})
    for url, why in demoted.items():
        fleet.metrics.event("demoted", url, version, why)
        log.warning("%s moves to a leaf of the relay: %s", url, why)
    edges = failed_edges(announcement.trees, refused - refusing, took)
    if edges:
        answers = {**delivery.updated, **delivery.ended}
        fleet.epochs.blame(edges, version, f"version {version} did not cross its relay edge",
                           {lower: answers.get(lower) for _, lower in edges})


def to_send_again(fleet: Fleet, announcement: Announcement, reform: list[EngineClient] | None,
                  result: SyncResult) -> tuple[EngineClient, ...]:
    """With a relay, the servers still here that did not take the version for a reason other than its
    layout (``relay.to_repair``), to be sent it again at once; their failures become ``repair``
    events. None without a relay, for a sharded trainer (its other ranks follow one send per
    version) and for a kind a relay does not carry; they get the next version."""
    epoch = fleet.epochs.current
    if not epoch.trees or fleet.ranks.world > 1 or not fleet.kind.relayed:
        return ()
    here = {e.url for e in (reform if reform is not None else announcement.to)}
    urls = to_repair(epoch.in_trees(), here, result.failures, {*epoch.shared, *fleet.book.refusing()})
    for url in urls:
        fleet.metrics.event("repair", url, announcement.version, f"a relay did not bring it: {result.failures.pop(url)}")
    return tuple(e for e in announcement.to if e.url in urls)


def done(fleet: Fleet, result: SyncResult, took: list[EngineClient], collected_at: float | None) -> SyncResult:
    """Time the version (``apply_s``: from when the trainer started waiting for the answers), tell
    the other ranks; then the kind's ``after`` (adapter loads) for the servers that took it, off
    every trainer collective."""
    result.finished = time.perf_counter()
    result.apply_s = result.finished - collected_at if collected_at is not None else 0.0
    result.total_s = result.finished - result.started
    fleet.ranks.from_leader(Done(result))
    if took:
        fleet.kind.after(took, result.version, fleet.book)
    return result


def delta_for(fleet: Fleet, epoch: Epoch, plan: BucketPlan, source: BucketSource) -> DeltaVersion | None:
    """The version as deltas, when every server it goes to can take them: each committed, from this
    sync, exactly the version ``source``'s buckets were encoded against (its ``baseline`` in the
    book), its receivers rebuild deltas, and it gets the data-plane broadcast (one broadcast reaches
    every member of a group, so a group gets deltas only when all its members can take them; with
    ``group_per_server`` each server is decided alone). None otherwise, and when every bucket goes
    whole anyway: a new, restarted or readmitted server, one that missed or refused a version, a
    version packed without a baseline, servers on shared memory (nothing crosses a wire)."""
    base = source.delta_base
    if base is None or epoch.group is None or not fleet.takes_deltas():
        return None
    baselines = fleet.book.baselines()
    if not all(baselines.get(url) == base for url in epoch.urls):
        return None
    nbytes = source.delta_nbytes()
    return DeltaVersion(base, nbytes) if nbytes is not None and any(nbytes) else None


def shared_request(fleet: Fleet, epoch: Epoch, request: UpdateRequest, plan: BucketPlan, source: BucketSource,
                   result: SyncResult) -> UpdateRequest | None:
    """The update request of the epoch's servers on shared memory: ``request`` plus where the version
    lies (``source.segment``, packed before ``send_version``) and each bucket's CRC32C, which travel
    with it instead of after the broadcast. None when no server maps shared memory, or when the source
    is not in it (a same-host server readmitted after the version was packed): those servers keep
    serving their version and get the next one."""
    segment, pool = source.segment, fleet.pool
    if not epoch.shared or segment is None or pool is None:
        return None
    t0 = time.perf_counter()
    crcs = tuple(int(c) for c in (source.checksum(b) for b in plan.buckets) if c is not None) if request.checksum else ()
    result.pack_s += time.perf_counter() - t0
    assert pool.host is not None, "a pool exists only where there is shared memory"
    # The trainer's own memory, mapped by the server: nothing forwarded it, nothing to hash.
    return dataclasses.replace(request, shm=SharedVersion(segment.name, pool.offsets, crcs, pool.host), digest=False)
