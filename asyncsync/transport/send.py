"""Sending one version to every member: the HTTP phases around the data-plane broadcasts.

    result = send_version(members, version, plan, source)

``send_version`` runs ``VersionSend``'s phases in the order they happen:

    announce   the update request (deltas, deadlines, owners, where a shared version lies), and the
               version's plan to a sharded trainer's other ranks
    post       ``begin`` then ``update`` to every server, concurrently in the control loop (each
               server answers ``update`` once every bucket arrived)
    data path  every bucket broadcast, then the checksum manifest (``transport.datapath``)
    confirm    ``end`` to every server that took the version: it swaps it in and says what it serves
    evict      refusals recorded, servers that gave no answer evicted, a new epoch where needed
    repair     with a relay (``fanout``): the servers a failed hop left without the version get it
               again, whole, once, over an epoch of their own (``Membership.park``), post to evict
    done       the other ranks hear the result; adapter versions are loaded, off every collective

Each HTTP phase has its own deadline, ``engine.calls(phase) x deadlines.http_s``, enforced inside the
control loop; a phase that fails or misses it is followed by ``abort`` (resume generation, close an
update session), so no server is left paused. Nothing raises for a server's failure: it is in
``result.failures`` and in the metrics' events (``evicted`` for a server that gave no answer,
``refused`` for one that answered no). No collective ever waits on an HTTP answer.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from typing import Any

from asyncsync.control import ServerError
from asyncsync.engines.base import EngineClient, Phase
from asyncsync.metrics import SyncResult
from asyncsync.protocol.frames import VersionFrames
from asyncsync.protocol.lora import AdapterUpdate
from asyncsync.protocol.specs import LAYOUT_REFUSED, BucketPlan
from asyncsync.protocol.wire import BucketMeta, DeltaVersion, SharedVersion, UpdateRequest
from asyncsync.ranks import TrainerRankLost
from asyncsync.transport.adapters import AdapterLoads
from asyncsync.transport.commands import Done, Version
from asyncsync.transport.datapath import DataPath, PackFailed, VersionPlan, finish_data_path
from asyncsync.transport.membership import Membership, within
from asyncsync.transport.relay import RelayTree
from asyncsync.transport.sources import BucketSource

log = logging.getLogger(__name__)

SLACK_S = 5.0  # added to a wait on the control loop derived from the deadlines inside it
SLOW_HOP = 4.0  # a relayed server whose hop took this many times the others' median is moved to a leaf
SLOW_HOP_MIN_S = 0.2  # ... and only when its hop took at least this long (noise on fast versions)


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
    send = VersionSend(members, version, plan, source, result, adapter)
    if not send.announce():
        return send.done()
    survivors = send.deliver()
    missed = send.missed(survivors)
    if missed:
        members.park(missed)
        if send.announce(whole=True):
            survivors = send.deliver()
            again = {e.url for e in missed}
            send.result.repaired = sorted(u for u in send.result.server_versions if u in again)
    if survivors is not None:
        members.form(survivors)
    return send.done()


class VersionSend:
    """One version's phases (the module doc), in that order; its state is the version's."""

    def __init__(self, members: Membership, version: int, plan: BucketPlan, source: BucketSource,
                 result: SyncResult | None, adapter: AdapterLoads | None):
        members.settle()
        members.readmit()
        self.members, self.version, self.plan, self.source, self.adapter = members, version, plan, source, adapter
        self.result = result or SyncResult(version, plan.total_bytes, len(plan.buckets))
        self.start = time.perf_counter()
        self.result.send_started = self.start
        self.result.started = self.result.started or self.start
        self.engines: list[EngineClient] = []
        self.requests: dict[str, UpdateRequest] = {}
        self.posted: dict[str, concurrent.futures.Future[Any]] = {}
        self.took: list[EngineClient] = []  # the servers whose update succeeded: sent ``end``
        self.repairing = False  # the version is being sent again to the servers a relay failed
        self.ends_early: frozenset[str] = frozenset()  # servers sent ``end`` as soon as they received it
        self.received: dict[str, float] = {}  # when each server's update answered yes
        self.ended: dict[str, Any] = {}  # ``end``'s answer (or failure) of the servers that ended early
        self.t_apply = self.start  # when the trainer started waiting for the servers' answers

    # -- announce --------------------------------------------------------------------------------

    def announce(self, whole: bool = False) -> bool:
        """The update request and the other ranks' plan; False when no server is there to send to.
        ``whole``: no bucket as a delta (a repair, whose encoding went with the first try)."""
        members, plan, ranks = self.members, self.plan, self.members.ranks
        if members.group is None and not members.shared:
            ranks.from_leader(Version(None))  # no server to send to: the other ranks skip it too
            self.result.failures.update(members.evicted)
            return False
        self.delta = None if whole else delta_for(members, plan, self.source)
        self.sizes = [n or b.nbytes for n, b in zip(self.delta.nbytes, plan.buckets)] if self.delta else \
            [b.nbytes for b in plan.buckets]
        self.deadlines = tuple(members.pace.deadline_s(n) for n in self.sizes)
        owners = tuple(self.source.owner(b) for b in plan.buckets) if members.sources > 1 else ()
        self.request = UpdateRequest(self.version, tuple(BucketMeta.of(b) for b in plan.buckets), members.config.checksum,
                                     self.deadlines, owners, delta=self.delta)
        self.requests = shared_requests(members, self.request, plan, self.source, self.result)  # same-host servers
        self.engines = list(members.members)
        skipped = [e.url for e in self.engines if e.url in members.shared and e.url not in self.requests]
        if skipped:
            log.warning("version %d is not in shared memory: %s keep their version until the next one",
                        self.version, skipped)
            self.engines = [e for e in self.engines if e.url not in skipped]
        self.frames = VersionFrames.of(self.request)  # every bucket's frame header to asyncsync's receivers carries it
        # With a relay a server's update answers once it verified the whole version (none receives in
        # the background here), so it is sent ``end`` at once: a slow server below never holds it.
        in_trees = members.relay.in_trees()
        self.ends_early = frozenset(e.url for e in self.engines if e.url in in_trees and self.adapter is None
                                    and not e.receives_in_background)
        ranks.from_leader(Version(VersionPlan(self.version, self.deadlines, self.frames, self.delta)))
        return True

    def deliver(self) -> list[EngineClient] | None:
        """post, data path, collect, confirm, evict: the servers a new epoch forms over, or None."""
        self.post()
        broken = self.data_path()
        updated = self.collect_updates(broken)
        ended = self.confirm(updated)
        survivors = self.evict(updated | ended, broken)
        for url, ratio in slow_hops(self.members.relay.trees, self.received).items():
            if self.members.relay.demote(url):  # a leaf from the next version's epoch on
                why = f"its hop of version {self.version} took {ratio:.1f}x the median of the others"
                self.members.metrics.event("demoted", url, self.version, why)
                log.warning("%s moves to a leaf of the relay: %s", url, why)
        return survivors

    # -- post: begin and update ------------------------------------------------------------------

    def post(self) -> None:
        """``begin`` then ``update`` to every server, one future each, so the broadcast can watch them."""
        self.received, self.ended = {}, {}
        self.posted = {e.url: self.members.control.submit(self._begin_and_update(e)) for e in self.engines}

    async def _begin_and_update(self, e: EngineClient) -> None:
        request = self.requests.get(e.url, self.request)
        try:
            if self.adapter is None:
                await within(e, e.begin(self.version), self._deadline(e, "begin"), "begin")
                await within(e, e.update(request), self._deadline(e, "update"), "update")
                if not e.receives_in_background:  # its answer says when the version reached it
                    self.received[e.url] = time.perf_counter()
                if e.url in self.ends_early:  # it serves the version now, not once the slowest received it
                    try:
                        self.ended[e.url] = await self._end(e)
                    except Exception as error:  # ``_end`` aborted it; the version's failure, not the update's
                        self.ended[e.url] = error
            else:
                await within(e, e.begin_adapter(self.version), self._deadline(e, "begin"), "begin")
                update = AdapterUpdate(request, self.adapter.target(e.url, self.version))
                await within(e, e.update_adapter(update), self._deadline(e, "update"), "update")
        except Exception:
            await self._abort(e)
            raise

    async def _abort(self, e: EngineClient) -> None:
        """Undo the server's open policies; its own failure is logged, never raised over the first."""
        try:
            await within(e, e.abort(self.version), self._deadline(e, "abort"), "abort")
        except ServerError as err:
            log.warning("%s", err)

    def _deadline(self, e: EngineClient, phase: Phase) -> float:
        return e.calls(phase, len(self.plan.buckets)) * self.members.config.deadlines.http_s

    def _update_s(self, engines: list[EngineClient]) -> float:
        return max((self._deadline(e, "begin") + self._deadline(e, "update") + self._deadline(e, "abort")
                    + (self._deadline(e, "end") if e.url in self.ends_early else 0.0) for e in engines), default=0.0)

    # -- data path -------------------------------------------------------------------------------

    def data_path(self) -> str | PackFailed | None:
        """Every bucket and the manifest (not for servers on shared memory: they know where the version
        is); what broke, or None. Another trainer rank gone: ``TrainerRankLost`` once every server's
        update failed with the dropped group (each keeps serving its last complete version)."""
        members, result, ranks = self.members, self.result, self.members.ranks
        broken: str | PackFailed | None = None
        if members.group is not None:
            relayed = members.relay.relayed()  # their answers say nothing of the trainer's own broadcasts
            wired = {u: f for u, f in self.posted.items() if u not in members.shared and u not in relayed}
            background = frozenset(e.url for e in self.engines if e.receives_in_background)
            try:
                broken, crcs = DataPath(members.group, ranks, self.plan, self.source, result, self.deadlines,
                                        self.frames, wired if ranks.world == 1 else None, background, self.delta).run()
                broken = finish_data_path(members, self.plan, broken, crcs, self.deadlines, self.frames)
            except TrainerRankLost:
                members.drop_group(broken=True)
                _collect(self.posted, self._update_s(self.engines))
                raise
            result.wire_bytes += sum(self.sizes)
            result.delta_base = self.delta.base if self.delta else None
            result.delta_buckets = sum(1 for n in self.delta.nbytes if n) if self.delta else 0
        result.wire_s = time.perf_counter() - self.start - result.pack_s  # a repair's included
        if broken is not None:
            members.drop_group(broken=True)
        elif members.group is not None:
            members.pace.observe(result.wire_bytes, result.wire_s)
        return broken

    def collect_updates(self, broken: str | PackFailed | None) -> dict[str, Any]:
        """Every server's ``update`` answer. A version the trainer abandoned (``PackFailed``) raises its
        cause here: every server's update failed with the dropped group (and was aborted), none is sent
        ``end``, so each keeps serving its last complete version; no server is to blame, so a new epoch
        forms over the same servers; a server receiving in the background said yes before the group
        was dropped, so it is told to discard."""
        self.t_apply = time.perf_counter()
        updated = _collect(self.posted, self._update_s(self.engines))
        if not isinstance(broken, PackFailed):
            return updated
        answered = [e for e in self.engines if not isinstance(updated[e.url], BaseException)]
        _collect({e.url: self.members.control.submit(self._abort(e)) for e in answered},
                 max((self._deadline(e, "abort") for e in answered), default=0.0))
        self.members.form(self.engines)
        self.members.ranks.from_leader(Done(None))
        cause = broken.cause
        del broken
        try:
            raise cause
        finally:
            del cause  # no cycle through this frame: the group it held goes with the caller's exception

    # -- confirm: end ----------------------------------------------------------------------------

    def confirm(self, updated: dict[str, Any]) -> dict[str, Any]:
        """``end`` to every server that took the version; what each now serves, each server's baseline
        of its next delta (what it committed of this sync, and only that), its switch time, and what
        a same-host server still maps."""
        members, result, version = self.members, self.result, self.version
        self.took = [e for e in self.engines if not isinstance(updated[e.url], BaseException)]
        later = [e for e in self.took if e.url not in self.ended]
        ended = _collect({e.url: members.control.submit(self._end(e)) for e in later},
                         max((self._deadline(e, "end") + self._deadline(e, "abort") for e in later), default=0.0))
        ended.update({e.url: self.ended[e.url] for e in self.took if e.url in self.ended})
        result.server_versions.update({u: v for u, v in ended.items() if not isinstance(v, BaseException)})
        for e in self.engines:
            if self.adapter is None and result.server_versions.get(e.url) == version:
                members.baselines[e.url] = version
            else:
                members.baselines.pop(e.url, None)
        if self.adapter is None:
            result.switch_s = {e.url: e.last_switch_s for e in self.took
                               if e.url in result.server_versions and e.last_switch_s is not None}
            members.server_versions.update(result.server_versions)
        for url in result.server_versions:
            members.refusing.pop(url, None)
        if members.pool is not None:
            for e in self.took:
                if e.url in members.shared and e.url in result.server_versions:
                    members.pool.settle(e.url, e.holds)  # what it still maps: never rewritten until released
        return ended

    async def _end(self, e: EngineClient) -> int:
        try:
            if self.adapter is None:
                return await within(e, e.end(self.version), self._deadline(e, "end"), "end")
            await within(e, e.end_adapter(self.version), self._deadline(e, "end"), "end")
            return self.version  # written; served once loaded
        except Exception:
            await self._abort(e)
            raise

    # -- evict -----------------------------------------------------------------------------------

    def evict(self, answers: dict[str, Any], broken: str | PackFailed | None) -> list[EngineClient] | None:
        """A server that answered no is a refusal (it keeps its version and stays; a layout refusal is
        kept: every later version of this plan would be refused too); one that gave no answer is
        evicted (what it may still be reading of shared memory is never rewritten). Returns the
        servers a new epoch must form over after either an eviction or a broken data plane, else None."""
        members, result = self.members, self.result
        failures = {u: r for u, r in answers.items() if isinstance(r, BaseException)}
        result.failures.update({u: str(r) for u, r in failures.items()})
        unreachable = [u for u, r in failures.items() if not (isinstance(r, ServerError) and r.status is not None)]
        for url, err in failures.items():
            if url not in unreachable:
                members.metrics.event("refused", url, self.version, str(err))
                if LAYOUT_REFUSED in str(err):
                    members.refusing[url] = str(err)
        for url in unreachable:
            members.evict(url, result.failures[url])
            if members.pool is not None and url in self.requests:
                shm = self.requests[url].shm
                assert shm is not None
                members.pool.evicted(url, shm.segment)
        if broken is not None or unreachable:
            return [e for e in self.engines if e.url not in unreachable]
        return None

    # -- repair ----------------------------------------------------------------------------------

    def missed(self, survivors: list[EngineClient] | None) -> list[EngineClient]:
        """With a relay, the servers still here that did not take the version for a reason other than
        its layout: a hop above them died, failed or corrupted it (each verifies every bucket), so
        they are sent it again, once. None without a relay, for a sharded trainer (its other ranks
        follow one send per version) and for adapter versions; they get the next version."""
        members, result = self.members, self.result
        if not members.relay.trees or members.ranks.world > 1 or self.adapter is not None or self.repairing:
            return []
        here = {e.url for e in survivors} if survivors is not None else {e.url for e in self.engines}
        here &= members.relay.in_trees()  # the trainer's other direct children missed it for reasons of their own
        missed = [e for e in self.engines if e.url in here and e.url in result.failures
                  and e.url not in members.shared and e.url not in members.refusing]
        for e in missed:
            members.metrics.event("repair", e.url, self.version, f"a relay did not bring it: {result.failures.pop(e.url)}")
        self.repairing = bool(missed)
        return missed

    # -- done ------------------------------------------------------------------------------------

    def done(self) -> SyncResult:
        """Time the version, tell the other ranks; adapter versions are loaded once they are released."""
        result = self.result
        result.finished = time.perf_counter()
        result.apply_s = result.finished - self.t_apply if self.took or self.posted else 0.0
        result.total_s = result.finished - result.started
        self.members.ranks.from_leader(Done(result))
        if self.adapter is not None and self.posted:  # the ranks are released: no collective waits on a load
            took = [e for e in self.took if e.url in result.server_versions]
            self.adapter.offer(took, self.version, self.members.server_versions)
        return result


def slow_hops(trees: tuple[RelayTree, ...], received: dict[str, float]) -> dict[str, float]:
    """The relayed servers that held the servers below them: each server's hop (when its update answered,
    less when its parent's did) over ``SLOW_HOP`` times the median of the other hops, and longer than
    ``SLOW_HOP_MIN_S``; each with its hop over that median. A slow root cannot be told from a slow
    trainer link, and is left where it is."""
    slow = {}
    for tree in trees:
        hops = {u: received[u] - received[p] for u in tree.order
                if (p := tree.parent(u)) is not None and u in received and p in received}
        for url, hop in hops.items():
            others = sorted(h for u, h in hops.items() if u != url)
            median = others[len(others) // 2] if others else 0.0
            if others and tree.below(url) and hop > max(SLOW_HOP * median, SLOW_HOP_MIN_S):
                slow[url] = hop / max(median, 1e-6)
    return slow


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
