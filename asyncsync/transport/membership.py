"""Which servers are in the trainer's data-plane groups, epoch by epoch.

Lifecycle (``transport.send.send_version`` is what moves a version through it)::

    members = Membership.connect(config, control, metrics, runtime, session)  # epoch 1; unreachable servers
    for version in versions:                                                  # start evicted
        result = send_version(members, version, plan, source)        # readmits, evicts and rebuilds as needed
    members.close()                                                  # releases the servers

An epoch is one set of data-plane groups over one set of servers (group name
``<group_name>.<token>.<epoch>``, ``token`` the random part of the trainer session, so that a
restarted trainer never reuses a name a server still holds; fresh ports after the first epoch). A new
epoch starts whenever a server is evicted, a collective fails, or an evicted server answers again.
Servers that are out are probed at most every ``readmit_interval_s``; one that answers rejoins and
gets the next version whole (``Membership.baselines``: only a server that committed the last
version of this sync may get a delta).

With a relay (``fanout``), a server lost mid-version leaves the servers below it without that
version: ``transport.send`` re-sends it to them over an epoch of their own at once, while the servers
that took it sit that epoch out (``parked``); the next version's epoch takes everyone in again.

Every epoch first claims each server for the trainer session (``EngineClient.claim``), so two trainers
never race for the same servers: at ``connect`` a server another live trainer owns fails the whole
connect with ``TrainerConflict``; later (another trainer took it over) it is evicted with the owner's
answer as the reason. ``close`` releases the servers for the next trainer.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from asyncsync.config import WeightSyncConfig
from asyncsync.engines import make_engine
from asyncsync.engines.base import EngineClient, UnsupportedServer
from asyncsync.metrics import SyncMetrics
from asyncsync.protocol.device import Runtime
from asyncsync.protocol.group import DataPlaneError
from asyncsync.protocol.ownership import OWNER_SAYS
from asyncsync.protocol.shm import HostIdentity
from asyncsync.protocol.specs import TensorSpec
from asyncsync.protocol.wire import OWNED_STATUS, LayoutCheck
from asyncsync.ranks import TrainerRanks
from asyncsync.control import ControlLoop, ServerError
from asyncsync.transport.commands import Epoch, Formed
from asyncsync.transport.pace import BroadcastPace
from asyncsync.transport.relay import Relays
from asyncsync.transport.shm import SegmentPool
from asyncsync.transport.topology import GroupLayout, TrainerGroups

log = logging.getLogger(__name__)


RELEASE_S = 2.0  # close() waits at most this long for a server to acknowledge its release


class SyncError(RuntimeError):
    """No server could be reached at all; the message lists each server's failure."""


class TrainerConflict(SyncError):
    """At ``connect``, a server belongs to another trainer session that is still alive."""


def session_prefix() -> str:
    """What every session id of this process starts with: which host and process owns a server."""
    return f"{socket.gethostname()}:{os.getpid()}:"


def new_session() -> str:
    """A trainer session id (one per ``WeightSync``): the random part tells apart two syncs in one
    process, and names the session's data-plane groups."""
    return session_prefix() + secrets.token_hex(4)


def _conflict(conflicts: dict[str, str]) -> TrainerConflict:
    """What to say when another trainer session owns servers (``conflicts``: server -> the owner's answer)."""
    this_process = f"{OWNER_SAYS} '{session_prefix()}"
    who = ("another WeightSync of this process, never closed, still holds these servers: close() it first"
           if any(this_process in c for c in conflicts.values()) else
           "another trainer process already syncs these servers; run one trainer per set of servers "
           "(a multi-rank trainer: every rank calls the same WeightSync, with trainer_ranks: auto, never one each)")
    return TrainerConflict(f"{who}: " + "; ".join(conflicts.values()))


class Membership:
    """The servers of one sender (all of them, or one with ``group_per_server``) and its groups."""

    def __init__(self, config: WeightSyncConfig, control: ControlLoop, metrics: SyncMetrics, runtime: Runtime,
                 session: str | None = None, ranks: TrainerRanks | None = None, spread: bool = False, buckets: int = 1):
        self.config, self.control, self.metrics, self.runtime = config, control, metrics, runtime
        # A sharded trainer's other ranks form every epoch with rank 0 (transport.follower); with
        # ``spread`` each of them owns buckets and gets groups of its own with the servers.
        self.ranks = ranks or TrainerRanks()
        self.session = session or new_session()  # sent with every call; its random part names the groups
        self.engines: list[EngineClient] = [make_engine(s, config.deadlines.http_s, self.session) for s in config.servers]
        self.server_versions: dict[str, int] = {e.url: 0 for e in self.engines}
        self.server_ranks: dict[str, int] = {}  # data-plane ranks each server reported (at its last epoch)
        self.members: list[EngineClient] = []
        self.shared: set[str] = set()  # members that map versions from shared memory (no data-plane group)
        self.pool: SegmentPool | None = None  # the shared-memory segments (set by WeightSync once it planned)
        self.evicted: dict[str, str] = {}
        # The version each server committed from this sync, its next delta's baseline (transport.send):
        # set by a successful ``end``, dropped by any failure or eviction.
        self.baselines: dict[str, int] = {}
        # Members that refused the last version for its layout (``specs.LAYOUT_REFUSED``): they would
        # refuse every version of this plan, so no later version can reach them either.
        self.refusing: dict[str, str] = {}
        self.group: TrainerGroups | None = None
        self.relay = Relays()  # the current epoch's relay trees (``fanout``) and the servers' order in them
        self.pace = BroadcastPace(config.deadlines)  # the data plane's measured rate, across epochs
        self.epoch = 0
        self.conflicts: dict[str, str] = {}  # in the last epoch formed: servers another trainer session owns
        # ``lora: adapter``, once the base is in place: the adapter whose newest version each server serves
        # is its version (``server_versions``), not its weights' version.
        self.adapter: str | None = None
        self._next_probe = 0.0
        self._expelled: dict[str, str] = {}  # members to evict when the next version starts (``expel``)
        # Members that took a version a relay failed to bring to others: out of the repair's epoch,
        # back in the groups when the next version starts (``settle``).
        self.parked: list[EngineClient] = []
        self.buckets = buckets  # about how many buckets a version has: ``fanout: auto`` plans the tree by it
        multi = all(e.protocol.multi_group for e in self.engines)
        self.sources = self.ranks.world if spread and multi else 1  # trainer ranks that send buckets

    @classmethod
    def connect(cls, config: WeightSyncConfig, control: ControlLoop, metrics: SyncMetrics, runtime: Runtime,
                session: str | None = None, ranks: TrainerRanks | None = None, spread: bool = False,
                buckets: int = 1) -> Membership:
        """Form the first groups, claiming every server (``config.takeover``: even from a live owner);
        servers that do not answer start evicted. Raises ``SyncError`` when no server at all could
        join, ``TrainerConflict`` when another live trainer owns a server, ``UnsupportedServer`` when
        one runs a setup its client can never sync (all leave nothing open)."""
        members = cls(config, control, metrics, runtime, session, ranks, spread, buckets)
        try:
            members.form(members.engines, refuse_unsupported=True, takeover=config.takeover)
            if members.conflicts:
                raise _conflict(members.conflicts)
            if not members.members:
                raise SyncError("no server could join the data plane: " + "; ".join(members.evicted.values()))
        except BaseException:
            members.close()
            raise
        return members

    @property
    def single_dtype_buckets(self) -> bool:
        return any(e.protocol.single_dtype_buckets for e in self.engines)

    def expected_names(self) -> list[frozenset[str]]:
        """The tensor names each member server that can tell checks versions against (asked at connect).
        A server that fails to answer is counted as one that cannot tell: it still refuses a bad version."""
        answers = self.call_all(self.members, lambda e: e.expected_names(), "expected_names")
        for url, answer in answers.items():
            if isinstance(answer, BaseException):
                log.warning("%s did not say which tensors it expects: %s", url, answer)
        return [a for a in answers.values() if isinstance(a, frozenset)]

    def layout_refusals(self, specs: tuple[TensorSpec, ...]) -> dict[str, str]:
        """Asked at connect: each member that would refuse a plan sending ``specs``, and why. A server
        that fails to answer is counted as one that cannot tell: it still refuses a bad version."""
        return self.refusals(lambda e: e.check_layout(LayoutCheck(specs)), "check_layout")

    def refusals(self, call: Callable[[EngineClient], Awaitable[str | None]], what: str) -> dict[str, str]:
        """Each member's refusal (``call``'s answer: None, or why not) of what connect asks; a server
        that fails to answer is logged and counted as one that cannot tell."""
        answers = self.call_all(self.members, call, what)
        for url, answer in answers.items():
            if isinstance(answer, BaseException):
                log.warning("%s did not answer %s: %s", url, what, answer)
        return {url: answer for url, answer in answers.items() if isinstance(answer, str)}

    def takes_deltas(self) -> bool:
        """Whether a version may go to these members as deltas at all (``transport.send.delta_for``
        then asks which version each holds): one broadcast reaches every member of a group, so every
        member must rebuild deltas and receive over the data plane (none on shared memory)."""
        return not self.shared and bool(self.members) and all(e.protocol.deltas for e in self.members)

    def reachable(self) -> bool:
        """Whether a later version can still reach a server: some member does not refuse this plan."""
        return any(e.url not in self.refusing for e in self.members)

    def member_versions(self) -> dict[str, int]:
        """The versions of the servers currently in the groups (evicted ones excluded)."""
        return {e.url: self.server_versions[e.url] for e in self.members}

    def call_all(self, engines: Iterable[EngineClient], call: Callable[[EngineClient], Awaitable[Any]],
                 what: str) -> dict[str, Any]:
        """``call`` on every engine concurrently, each within http_s; results or exceptions by URL."""
        deadline = self.config.deadlines.http_s
        return self.control.run(gather(list(engines), lambda e: within(e, call(e), deadline, what)), deadline + 5)

    # -- epochs ---------------------------------------------------------------------------------

    def form(self, candidates: list[EngineClient], refuse_unsupported: bool = False, takeover: bool = False) -> None:
        """(Re)build the groups over the candidates that answer and are this session's to claim
        (``takeover``: even from a live owner), in config order; evict the others (with
        ``refuse_unsupported``, raise ``UnsupportedServer`` for a server that can never join)."""
        self.drop_group()
        self.conflicts = {}
        cfg = self.config
        alive, sizes = self._claim(candidates, refuse_unsupported, takeover)
        token = self.session.rsplit(":", 1)[-1]
        retried = False
        while alive:
            self.epoch += 1
            wired = [e for e in alive if e.url not in self.shared]
            if not wired:  # every server maps versions from shared memory: no data-plane group (a single
                # trainer process: no follower rank waits for an epoch, ``same_host``)
                self.members = alive
                log.info("epoch %d: %d server(s) on shared memory, no data-plane group", self.epoch, len(alive))
                break
            port_taken = False
            # Later epochs take fresh ports: the previous epoch's store may still hold a configured one.
            epoch_cfg = cfg.replace(group_name=f"{cfg.group_name}.{token}.{self.epoch}",
                                    master_port=cfg.master_port if self.epoch == 1 else 0)
            layout = GroupLayout.of(epoch_cfg, wired, sizes, self.runtime, self.sources, self.buckets,
                                    self.relay.seniority)
            self.ranks.from_leader(Epoch([layout.specs_for(r) for r in range(self.ranks.world)]))  # followers join theirs
            joined = self.control.submit(gather(wired, lambda e: e.init_group(*layout.membership(e))))
            try:
                group: TrainerGroups | None = layout.join()  # returns once every server's ranks joined
            except DataPlaneError as e:
                log.warning("epoch %d: forming the groups failed: %s", self.epoch, e)
                group = None
                port_taken = "EADDRINUSE" in str(e)
            answers = joined.result(cfg.deadlines.rendezvous_s + cfg.deadlines.http_s)
            still = self._drop_unreachable(wired, answers)
            formed = all(self.ranks.gather_objects(group is not None) or [])
            self.ranks.from_leader(Formed(formed and len(still) == len(wired)))
            if formed and len(still) == len(wired):
                self.group, self.members = group, alive
                log.info("epoch %d: data-plane groups of %s ranks over %d server(s), %d on shared memory%s", self.epoch,
                         [specs[0].world_size for _, specs in layout.groups], len(wired), len(alive) - len(wired),
                         "".join(f"; relay {t.describe()}" for t in layout.trees))
                self.relay.formed(layout.trees)
                break
            if group is not None:
                group.close(broken=True)
            if len(still) == len(wired):  # everyone answered yet the group did not form
                if port_taken and not retried:  # the free port was taken meanwhile: once more, on another
                    retried = True
                    continue
                for e in wired:
                    self.evict(e.url, f"could not form the data-plane group: {answers[e.url]!r}")
                still = []
            alive = [e for e in alive if e.url in self.shared or e in still]
        else:
            self.members = []
        for e in self.members:
            if self.evicted.pop(e.url, None) is not None:
                self.metrics.event("rejoined", e.url, None, f"epoch {self.epoch}")
        self.refresh_versions()

    def _claim(self, candidates: list[EngineClient], refuse_unsupported: bool,
               takeover: bool) -> tuple[list[EngineClient], dict[str, Any]]:
        """The candidates that answer (on this host with ``transport: shm``), claimed for this session,
        and each one's answer to ``world_size``; sets ``shared`` (the same-host servers)."""
        sizes = self.call_all(candidates, lambda e: e.world_size(), "world_size")
        self.server_ranks.update({u: n for u, n in sizes.items() if isinstance(n, int)})
        unsupported = [r for r in sizes.values() if isinstance(r, UnsupportedServer)]
        if refuse_unsupported and unsupported:
            raise unsupported[0]
        alive = self._drop_unreachable(candidates, sizes)
        self.shared = same_host(self, alive, refuse_unsupported)  # before any claim: it may refuse the config
        if self.config.transport == "shm":
            alive = [e for e in alive if e.url in self.shared]  # the others were evicted: not on this host
        claims = self.call_all(alive, lambda e: e.claim(takeover), "claim")
        return self._drop_unreachable(alive, claims), sizes

    def refresh_versions(self) -> None:
        """Ask every member the version it serves: its weights', or its newest of ``adapter``'s."""
        name = self.adapter
        versions = self.call_all(self.members, lambda e: e.version() if name is None else newest(e, name), "version")
        self.server_versions.update({u: v for u, v in versions.items() if not isinstance(v, BaseException)})

    def rebuild(self, lost: Iterable[str] = ()) -> None:
        """A new epoch over the members not in ``lost`` (after a failed collective or an eviction)."""
        gone = set(lost)
        self.form([e for e in self.members if e.url not in gone])

    def drop_group(self, broken: bool = False) -> None:
        """Abandon the current epoch's groups; ``broken`` after a failed collective (they are aborted)."""
        self.relay.trees = ()
        if self.group is not None:
            self.group.close(broken)
            self.group = None

    def evict(self, url: str, reason: str) -> None:
        self.baselines.pop(url, None)  # it may come back restarted: the next version it gets is whole
        self.relay.evicted(url)  # back, it is a leaf
        if self.pool is not None:
            self.pool.evicted(url)  # it loses its lease: what it maps is retired, never rewritten
        if url not in self.evicted:
            self.metrics.event("evicted", url, None, reason)
            log.warning("evicted %s: %s", url, reason)
        self.evicted[url] = reason

    def expel(self, url: str, reason: str) -> None:
        """Evict a member between versions, not during one (``verify``'s ``on_divergence: evict``): it is
        evicted, and the groups rebuilt without it, when the next version starts (``settle``)."""
        self._expelled[url] = reason

    def settle(self) -> None:
        """At the start of a version: evict the members ``expel`` named (readmitted, as any evicted
        server, once ``readmit_interval_s`` passed and it answers), and take the ``parked`` ones back."""
        if not self._expelled and not self.parked and not self.relay.replan:
            return
        self.relay.replan = False
        out, self._expelled = self._expelled, {}
        for url, reason in out.items():
            self.evict(url, reason)
        if out:
            self._next_probe = time.monotonic() + self.config.readmit_interval_s
        back, self.parked = self.parked, []
        self.form([e for e in self.engines if (e in self.members or e in back) and e.url not in out])

    def park(self, repair: list[EngineClient]) -> None:
        """A new epoch over ``repair`` only (the servers a relay failed to bring a version to); the
        other members sit it out (``parked``) until the next version starts."""
        self.parked = [e for e in self.members if e not in repair]
        self.form(repair)

    def _drop_unreachable(self, engines: list[EngineClient], answers: dict[str, Any]) -> list[EngineClient]:
        """Evict the engines whose answer is a failure; return the others."""
        kept = []
        for e in engines:
            answer = answers[e.url]
            if isinstance(answer, ServerError) and answer.status == OWNED_STATUS:
                self.conflicts[e.url] = str(answer)
            if isinstance(answer, BaseException):
                self.evict(e.url, str(answer) or type(answer).__name__)
            else:
                kept.append(e)
        return kept

    def readmit(self) -> None:
        """Probe evicted servers (rate-limited); rebuild with those that answer."""
        now = time.monotonic()
        if not self.evicted or now < self._next_probe:
            return
        self._next_probe = now + self.config.readmit_interval_s
        out = [e for e in self.engines if e.url in self.evicted]
        probes = self.call_all(out, lambda e: e.health(), "health")
        back = [e for e in out if not isinstance(probes[e.url], BaseException)]
        if back:
            self.form([e for e in self.engines if e in self.members or e in back])

    def close(self) -> None:
        """Release the servers in the groups, close every server's connections and the groups;
        bounded, never raises."""
        members = {e.url for e in [*self.members, *self.parked]}

        async def release_and_close(e: EngineClient) -> None:
            if e.url in members:
                try:
                    await asyncio.wait_for(e.release(), RELEASE_S)
                except asyncio.TimeoutError:
                    log.warning("%s did not acknowledge its release within %.0fs", e.url, RELEASE_S)
            await e.close()

        if not self.control.loop.is_closed():
            try:
                self.control.run(gather(self.engines, release_and_close), timeout=10)
            except Exception as e:  # closing is best effort: the sockets go with the process anyway
                log.warning("closing the control-plane sessions failed: %s", e)
        self.drop_group()


def same_host(members: Membership, engines: list[EngineClient], refuse: bool) -> set[str]:
    """The servers that get versions through shared memory (``transport``; docs in configs/default.yaml):
    those on this host, for a single trainer process with weights in host memory. With
    ``transport: shm`` a server known to be elsewhere raises ``UnsupportedServer`` (``refuse``, at
    connect) or is evicted."""
    cfg = members.config
    if cfg.transport == "collective" or members.runtime.kind != "host" or members.ranks.world > 1 or not engines:
        if cfg.transport == "shm" and engines:
            raise UnsupportedServer(engines[0].url, "transport: shm needs weights in host memory and one trainer "
                                                    "process; use transport: auto or collective")
        return set()
    here = HostIdentity.here()
    for e in engines if cfg.transport == "shm" else ():
        if not e.protocol.shared_memory:  # SGLang: its update_weights_from_tensor path is not done
            error = UnsupportedServer(e.url, f"a {e.kind} server cannot receive through shared memory; use "
                                             "transport: auto (it then gets the collective) or collective")
            if refuse:
                raise error
            members.evict(e.url, str(error))
    engines = [e for e in engines if e.protocol.shared_memory]
    hosts = members.call_all(engines, lambda e: e.host_identity(), "host")
    shared = set()
    for e in engines:
        host = hosts[e.url]
        if isinstance(host, BaseException):
            host = None  # it is evicted by the next call it fails
        if here is not None and host == here or (cfg.transport == "shm" and host is None):
            shared.add(e.url)
        elif cfg.transport == "shm":
            error = UnsupportedServer(e.url, f"is not on this host (it sees {host}, the trainer {here}), but the "
                                             "config says transport: shm; use transport: auto")
            if refuse:
                raise error
            members.evict(e.url, str(error))
    return shared


async def within(engine: EngineClient, call: Awaitable[Any], deadline_s: float, what: str) -> Any:
    """Await ``call``, or raise ``ServerError`` (timed out) naming the server and ``what`` at the deadline."""
    try:
        return await asyncio.wait_for(call, deadline_s)
    except asyncio.TimeoutError:
        raise ServerError(engine.url, f"{what} missed its deadline of {deadline_s:.1f}s", timed_out=True) from None


async def gather(engines: list[EngineClient], call: Callable[[EngineClient], Awaitable[Any]]) -> dict[str, Any]:
    """Call every server concurrently; each server's result or exception, keyed by URL."""
    results = await asyncio.gather(*(call(e) for e in engines), return_exceptions=True)
    return {e.url: r for e, r in zip(engines, results)}


async def newest(engine: EngineClient, adapter: str) -> int:
    """The newest version of ``adapter`` the engine serves (0: none)."""
    return max(await engine.adapter_versions(adapter), default=0)


def lowest_member_version(memberships: Iterable[Membership], default: int) -> int:
    """The oldest version served by a server in a group (evicted servers excluded), or ``default``."""
    return min((v for m in memberships for v in m.member_versions().values()), default=default)
