"""Epochs: the data-plane groups over the servers of a book, formed again whenever the servers change.

An epoch (``Epoch``, a value) is one set of data-plane groups over one set of servers (group names
``<group_name>.<epoch>.<random>``: no answer shows them and a restarted trainer never reuses one a
server still holds; each group's key is drawn with it: ``transport.topology.GroupLayout``). Every
epoch meets in the session's one rendezvous store (``RendezvousStore``, made at the first form,
closed by ``close``), each group in its own namespace.
``Epochs.form`` makes one in four steps::

    claim    ask each candidate its data-plane ranks and whose shared memory it sees, and claim it
             for this trainer session (a server another live trainer owns is a conflict)
    layout   the groups (``transport.topology.GroupLayout``): per receiver protocol, with a relay its trees
    join     the servers join concurrently while the trainer joins as rank 0 (a sharded trainer's
             other ranks join theirs: ``transport.follower``)
    agree    every rank formed its groups and every server answered: the epoch is current; else the
             servers that failed are evicted and the rest try again

Between versions (``start_version``): the servers ``expelled`` are evicted, servers ``park``ed by a
repair come back, a re-planned relay takes effect, and evicted servers are probed at most every
``readmit_interval_s`` (``readmit``): one that answers rejoins and gets the next version whole.
A new epoch also starts whenever a server is evicted or a collective fails (``transport.send``).
What happens to each server is written in the book (``transport.book``), never here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from asyncsync.config import WeightSyncConfig
from asyncsync.control import ControlLoop, ServerError, gather
from asyncsync.engines.base import EngineClient, UnsupportedServer
from asyncsync.engines.protocols import DataPlaneMember
from asyncsync.protocol.device import Runtime
from asyncsync.protocol.group import DataPlaneError, resolve_backend
from asyncsync.protocol.shm import HostIdentity
from asyncsync.protocol.wire import OWNED_STATUS
from asyncsync.ranks import TrainerRanks
from asyncsync.transport.book import ServerBook
from asyncsync.transport.commands import Formed, NewEpoch
from asyncsync.transport.kinds import VersionKind
from asyncsync.transport.relay import Relays, RelayTree, failed_edges
from asyncsync.transport.topology import GroupLayout, RendezvousStore, TrainerGroups

log = logging.getLogger(__name__)

RETRIES = 2  # a formation that failed only by relay edges, or a store that could not listen, is tried again this often
PROBE_S = 5.0  # a readmission probe's deadline: a health check answers in milliseconds; a host that has not
# answered by then is not back (a black-holed one would otherwise hold the version's start for http_s)


@dataclass(frozen=True)
class Epoch:
    """One epoch's servers and groups: ``members`` in config order, of which ``shared`` map versions
    from shared memory (no group); ``group``, the trainer's rank 0 in the others' groups (None: none
    formed, or dropped after a failure); ``trees``, the relay trees (``fanout``)."""

    number: int = 0
    members: tuple[EngineClient, ...] = ()
    shared: frozenset[str] = frozenset()
    group: TrainerGroups | None = None
    trees: tuple[RelayTree, ...] = ()

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.members]

    def in_trees(self) -> set[str]:
        """Every server of a relay tree, its root included (not the trainer's other direct children)."""
        return {u for tree in self.trees for u in tree.order}

    def relayed(self) -> set[str]:
        """The servers that get versions from another server, not from the trainer."""
        return self.in_trees() - {tree.root for tree in self.trees}


class Epochs:
    """The epochs of one sender's servers (the module doc); ``current`` is the one versions go to."""

    def __init__(self, config: WeightSyncConfig, control: ControlLoop, engines: Sequence[EngineClient],
                 book: ServerBook, runtime: Runtime, ranks: TrainerRanks, kind: VersionKind,
                 sources: int = 1, buckets: int = 1):
        self.config, self.control, self.engines, self.book = config, control, tuple(engines), book
        self.runtime, self.ranks, self.kind, self.sources, self.buckets = runtime, ranks, kind, sources, buckets
        self.store: RendezvousStore | None = None  # the session's rendezvous store, from the first form on
        self.current = Epoch()
        self.relays = Relays()  # the servers' order in every relay tree, across epochs
        self.conflicts: dict[str, str] = {}  # of the last form: servers another trainer session owns
        self.parked: tuple[EngineClient, ...] = ()  # members sitting out a repair's epoch (``park``)

    def serve(self, kind: VersionKind) -> None:
        """From now on a server's version is ``kind``'s (``lora: adapter``: its newest adapter version)."""
        self.kind = kind
        self.refresh()

    # -- form: claim, layout, join, agree --------------------------------------------------------

    def form(self, candidates: Sequence[EngineClient], refuse_unsupported: bool = False, takeover: bool = False) -> None:
        """(Re)build the groups over the candidates that answer and are this session's to claim
        (``takeover``: even from a live owner), in config order; evict the others (with
        ``refuse_unsupported``, raise ``UnsupportedServer`` for a server that can never join). A relay
        edge that fails to form evicts neither of its servers: they are kept apart (``blame``) and
        the groups formed again, as after a store that could not listen (at most ``RETRIES`` times)."""
        self.drop()
        self.conflicts = {}
        alive = self._claim(list(candidates), refuse_unsupported, takeover)
        shared = self.book.shared()
        retries = RETRIES
        formed = Epoch(self.current.number)
        while alive:
            number = formed.number + 1
            wired = [e for e in alive if e.url not in shared]
            if not wired:  # every server maps versions from shared memory: no data-plane group (a single
                # trainer process: no follower rank waits for an epoch)
                formed = Epoch(number, tuple(alive), frozenset(e.url for e in alive))
                log.info("epoch %d: %d server(s) on shared memory, no data-plane group", number, len(alive))
                break
            layout, group, answers, failed_here = self._join(number, wired)
            edges = self._failed_edges(layout, answers) if retries else []
            still = wired if edges or layout is None else self._drop_unreachable(wired, answers)
            if layout is not None and self._agree(group is not None, len(still) == len(wired) and not edges):
                assert group is not None
                formed = self._formed(number, alive, shared, group, layout)
                break
            formed = Epoch(number)
            if group is not None:
                group.close(broken=True)
            if len(still) == len(wired):  # everyone answered, or no one was asked, yet the groups did not form
                if retries and (edges or layout is None):
                    retries -= 1  # around the edges that failed, or a store that could not listen
                    continue
                for e in wired:
                    self.book.unreachable(e.url, f"could not form the data-plane group: {failed_here or answers[e.url]!r}")
                still = []
            alive = [e for e in alive if e.url in shared or e in still]
        self.current = formed
        for e in formed.members:
            self.book.rejoined(e.url, formed.number)
        self.refresh()

    def _formed(self, number: int, alive: list[EngineClient], shared: frozenset[str], group: TrainerGroups,
                layout: GroupLayout) -> Epoch:
        """Epoch ``number`` formed over ``alive`` (its groups ``group``, its trees ``layout``'s): logged,
        and its trees' order kept for the next epochs (``Relays.formed``)."""
        wired = [e for e in alive if e.url not in shared]
        log.info("epoch %d: data-plane groups of %s ranks over %d server(s), %d on shared memory%s", number,
                 [specs[0].world_size for _, specs in layout.groups], len(wired), len(alive) - len(wired),
                 "".join(f"; relay {t.describe()}" for t in layout.trees))
        self.relays.formed(layout.trees)
        return Epoch(number, tuple(alive), frozenset(e.url for e in alive if e.url in shared), group, layout.trees)

    def _failed_edges(self, layout: GroupLayout | None, answers: dict[str, Any]) -> list[tuple[str, str]]:
        """The relay edges that failed to form (``relay.failed_edges``: a server whose edge's upper
        joined), each blamed (``blame``); none when no server was asked."""
        if layout is None or not layout.trees:
            return []
        failed = {u for u, a in answers.items() if isinstance(a, BaseException)}
        edges = failed_edges(layout.trees, failed, set(answers) - failed)
        if edges:
            self.blame(edges, None, "the rendezvous of its relay edge failed", {lower: answers[lower] for _, lower in edges})
        return edges

    def blame(self, edges: Sequence[tuple[str, str]], version: int | None, what: str,
              why: Mapping[str, Any]) -> None:
        """Relay edges (upper, lower) that failed (``what`` happened, ``why`` per lower server): the
        two servers are never an edge again, and a server whose failures follow it is moved
        (``Relays.blame``); each step is an event (``apart`` on the lower server; ``demoted``,
        ``direct``) and a warning."""
        for upper, lower in edges:
            detail = f"{what} (from {upper}): {why.get(lower)}; the two are never an edge again"
            self.book.metrics.event("apart", lower, version, detail)
            log.warning("%s: %s", lower, detail)
        for url, (kind, detail) in self.relays.blame(edges).items():
            self.book.metrics.event(kind, url, version, detail)
            log.warning("%s: %s", url, detail)

    def _claim(self, candidates: list[EngineClient], refuse_unsupported: bool, takeover: bool) -> list[EngineClient]:
        """The candidates that answer (on this host with ``transport: shm``), claimed for this session;
        each one's ranks and whether it maps shared memory go into the book."""
        sizes = self.call_all(candidates, lambda e: e.world_size(), "world_size")
        unsupported = [r for r in sizes.values() if isinstance(r, UnsupportedServer)]
        if refuse_unsupported and unsupported:
            raise unsupported[0]
        alive = self._drop_unreachable(candidates, sizes)
        shared = self._same_host(alive, refuse_unsupported)  # before any claim: it may refuse the config
        for e in alive:
            self.book.claimed(e.url, sizes[e.url], e.url in shared)
        if self.config.transport == "shm":
            alive = [e for e in alive if e.url in shared]  # the others were evicted: not on this host
        claims = self.call_all(alive, lambda e: e.claim(takeover), "claim")
        return self._drop_unreachable(alive, claims)

    def _layout(self, number: int, wired: list[EngineClient]) -> GroupLayout:
        """Epoch ``number``'s groups over ``wired``, in the session's store (made now if it is not yet:
        ``DataPlaneError`` when it cannot listen)."""
        cfg = self.config
        if self.store is None:  # its waits: as long as a group's rendezvous may take (each group's own timeout)
            self.store = RendezvousStore(cfg.master_addr, cfg.master_port, cfg.deadlines.collective_s)
        self.relays.forget(self.book.evicted())  # an evicted server comes back as a leaf
        relays = self.relays
        return GroupLayout.of(cfg.replace(group_name=f"{cfg.group_name}.{number}"), wired, self.book.ranks(),
                              self.runtime, self.sources, self.buckets, relays.seniority, relays.apart, relays.direct,
                              port=self.store.port)

    def _join(self, number: int, wired: list[EngineClient]
              ) -> tuple[GroupLayout | None, TrainerGroups | None, dict[str, Any], str]:
        """Plan epoch ``number``'s groups (in the session's store, made now if it is not yet); then
        every server joins concurrently while this rank joins as rank 0 (the other trainer ranks join
        theirs). Returns the layout (None: the trainer could not plan it or its store cannot listen,
        and no server or rank was asked), the trainer's groups (None: they did not form), every
        server's answer, and what failed on the trainer's side ('' when nothing did)."""
        cfg = self.config
        resolve_backend(cfg.backend, self.runtime)  # a backend the weights cannot take is the caller's error: raised
        try:
            layout = self._layout(number, wired)
        except DataPlaneError as e:  # the store cannot listen (its port taken, out of file descriptors)
            log.warning("epoch %d could not be planned: %s", number, e)
            return None, None, {}, str(e)
        self.ranks.from_leader(NewEpoch([layout.specs_for(r) for r in range(self.ranks.world)]))
        joined = self.control.submit(gather(wired, lambda e: e.init_group(*layout.membership(e))))
        group: TrainerGroups | None = None
        failed = ""
        try:
            group = layout.join(store=self.store)  # returns once every server's ranks joined
        except DataPlaneError as e:
            log.warning("epoch forming failed: %s", e)
            failed = str(e)
        return layout, group, joined.result(cfg.deadlines.rendezvous_s + cfg.deadlines.http_s), failed

    def _agree(self, formed_here: bool, every_server: bool) -> bool:
        """Whether every trainer rank formed its groups and every server joined; every rank is told."""
        formed = all(self.ranks.gather_objects(formed_here) or [])
        self.ranks.from_leader(Formed(formed and every_server))
        return formed and every_server

    def _same_host(self, engines: list[DataPlaneMember], refuse: bool) -> set[str]:
        """The servers that get versions through shared memory (``transport``; docs in configs/default.yaml):
        those on this host, for a single trainer process with weights in host memory. With
        ``transport: shm`` a server known to be elsewhere raises ``UnsupportedServer`` (``refuse``, at
        connect) or is evicted."""
        cfg = self.config
        if cfg.transport == "collective" or self.runtime.kind != "host" or self.ranks.world > 1 or not engines:
            if cfg.transport == "shm" and engines:
                raise UnsupportedServer(engines[0].url, "transport: shm needs weights in host memory and one trainer "
                                                        "process; use transport: auto or collective")
            return set()
        here = HostIdentity.here()
        refusals: dict[str, UnsupportedServer] = {}
        for e in engines if cfg.transport == "shm" else ():
            if not e.protocol.shared_memory:  # SGLang: its update_weights_from_tensor path is not done
                refusals[e.url] = UnsupportedServer(e.url, f"a {e.kind} server cannot receive through shared memory; "
                                                           "use transport: auto (it then gets the collective) or collective")
        engines = [e for e in engines if e.protocol.shared_memory]
        hosts = self.call_all(engines, lambda e: e.host_identity(), "host")
        shared = set()
        for e in engines:
            host = hosts[e.url]
            if isinstance(host, BaseException):
                host = None  # it is evicted by the next call it fails
            if here is not None and host == here or (cfg.transport == "shm" and host is None):
                shared.add(e.url)
            elif cfg.transport == "shm":
                refusals[e.url] = UnsupportedServer(e.url, f"is not on this host (it sees {host}, the trainer {here}), "
                                                           "but the config says transport: shm; use transport: auto")
        for url, error in refusals.items():
            if refuse:
                raise error
            self.book.unreachable(url, str(error))
        return shared

    def refresh(self) -> None:
        """Ask every member the version it serves (the kind's: its weights', or its newest adapter's)."""
        versions = self.call_all(self.current.members, self.kind.served, "version")
        for url, version in versions.items():
            if not isinstance(version, BaseException):
                self.book.reported(url, version)

    def call_all(self, engines: Sequence[EngineClient], call: Any, what: str) -> dict[str, Any]:
        """``call`` on every engine concurrently, each within ``http_s``; results or exceptions by URL."""
        return self.control.call_all(engines, call, what, self.config.deadlines.http_s)

    def _drop_unreachable(self, engines: list[EngineClient], answers: dict[str, Any]) -> list[EngineClient]:
        """Evict the engines whose answer is a failure (another owner's claim is a conflict); the others."""
        kept = []
        for e in engines:
            answer = answers[e.url]
            if isinstance(answer, ServerError) and answer.status == OWNED_STATUS:
                self.conflicts[e.url] = str(answer)
            if isinstance(answer, BaseException):
                self.book.unreachable(e.url, str(answer) or type(answer).__name__)
            else:
                kept.append(e)
        return kept

    # -- between and after versions --------------------------------------------------------------

    def start_version(self) -> None:
        """Before a version: evict the members ``expelled`` (readmitted, as any evicted server, once
        ``readmit_interval_s`` passed and it answers), take the ``parked`` ones back, re-plan a relay
        that must be; then probe the evicted servers that are due (``readmit``)."""
        out = self.book.take_expelled()
        if out or self.parked or self.relays.replan:
            self.relays.replan = False
            back, self.parked = set(self.parked), ()
            self.form([e for e in self.engines if (e in self.current.members or e in back) and e.url not in out])
        self.readmit()

    def park(self, repair: Sequence[EngineClient]) -> None:
        """A new epoch over ``repair`` only (the servers a relay failed to bring a version to); the
        other members sit it out (``parked``) until the next version starts. A member evicted in this
        version is not parked: it comes back only through ``readmit``, not before
        ``readmit_interval_s``."""
        evicted = self.book.evicted()
        self.parked = tuple(e for e in self.current.members if e not in repair and e.url not in evicted)
        self.form(repair)

    def readmit(self) -> None:
        """Probe each evicted server whose eviction (or last failed probe) is ``readmit_interval_s``
        old, each within ``PROBE_S`` (a black-holed host holds the version's start that long, not
        ``http_s``); a new epoch with those that answer. One that does not stays evicted, from now."""
        now, interval = time.monotonic(), self.config.readmit_interval_s
        due = {u for u, since in self.book.evicted_since().items() if now - since >= interval}
        out = [e for e in self.engines if e.url in due]
        if not out:
            return
        probes = self.control.call_all(out, lambda e: e.health(), "health", min(PROBE_S, self.config.deadlines.http_s))
        back = [e for e in out if not isinstance(probes[e.url], BaseException)]
        for e in out:
            if e not in back:
                self.book.probed(e.url)
        if back:
            self.form([e for e in self.engines if e in self.current.members or e in back])

    def rebuild(self, lost: Sequence[str] = ()) -> None:
        """A new epoch over the members not in ``lost`` (after a failed collective or an eviction)."""
        self.form([e for e in self.current.members if e.url not in set(lost)])

    def drop(self, broken: bool = False) -> None:
        """Abandon the current epoch's groups; ``broken`` after a failed collective (they are aborted)."""
        if self.current.group is not None:
            self.current.group.close(broken)
        self.current = replace(self.current, group=None, trees=())

    def close(self) -> None:
        """Abandon the current epoch and stop the session's rendezvous store."""
        self.drop()
        if self.store is not None:
            self.store.close()
            self.store = None
