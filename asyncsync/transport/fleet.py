"""One sender's servers: their clients, the book of what each one holds, and the epochs over them.

Lifecycle (``transport.send.send_version`` is what moves a version through it)::

    fleet = Fleet.connect(config, control, metrics, runtime, session)  # epoch 1; unreachable servers
    for version in versions:                                           # start evicted
        result = send_version(fleet, version, plan, source)   # readmits, evicts and rebuilds as needed
    fleet.close()                                             # releases the servers

``fleet.book`` (``transport.book``) is each server's state, changed only by its transitions;
``fleet.epochs`` (``transport.epochs``) forms the data-plane groups over the servers the book has in
(``fleet.epochs.current``); ``fleet.kind`` (``transport.kinds``) is what a version is to them (the
weights, or with ``lora: adapter`` once the base is in place, the adapter).

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
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from asyncsync.config import WeightSyncConfig
from asyncsync.control import ControlLoop, gather
from asyncsync.engines import make_engine
from asyncsync.engines.base import EngineClient
from asyncsync.engines.protocols import ConnectChecks
from asyncsync.metrics import SyncMetrics
from asyncsync.protocol.device import Runtime
from asyncsync.protocol.ownership import OWNER_SAYS
from asyncsync.protocol.specs import TensorSpec
from asyncsync.protocol.wire import LayoutCheck
from asyncsync.ranks import TrainerRanks
from asyncsync.transport.book import ServerBook
from asyncsync.transport.epochs import Epochs
from asyncsync.transport.kinds import WEIGHTS, VersionKind
from asyncsync.transport.pace import BroadcastPace
from asyncsync.transport.shm import SegmentPool

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
    process (no group is named after it: a 423 answer shows it)."""
    return session_prefix() + secrets.token_hex(4)


def _conflict(conflicts: dict[str, str]) -> TrainerConflict:
    """What to say when another trainer session owns servers (``conflicts``: server -> the owner's answer)."""
    this_process = f"{OWNER_SAYS} '{session_prefix()}"
    who = ("another WeightSync of this process, never closed, still holds these servers: close() it first"
           if any(this_process in c for c in conflicts.values()) else
           "another trainer process already syncs these servers; run one trainer per set of servers "
           "(a multi-rank trainer: every rank calls the same WeightSync, with trainer_ranks: auto, never one each)")
    return TrainerConflict(f"{who}: " + "; ".join(conflicts.values()))


class Fleet:
    """The servers of one sender (all of them, or one with ``group_per_server``): the module doc."""

    def __init__(self, config: WeightSyncConfig, control: ControlLoop, metrics: SyncMetrics, runtime: Runtime,
                 session: str | None = None, ranks: TrainerRanks | None = None, spread: bool = False, buckets: int = 1):
        self.config, self.control, self.metrics = config, control, metrics
        # A sharded trainer's other ranks form every epoch with rank 0 (transport.follower); with
        # ``spread`` each of them owns buckets and gets groups of its own with the servers.
        self.ranks = ranks or TrainerRanks()
        self.session = session or new_session()  # sent with every call
        self.engines: tuple[EngineClient, ...] = tuple(make_engine(s, config.deadlines.http_s, self.session)
                                                       for s in config.servers)
        multi = all(e.protocol.multi_group for e in self.engines)
        self.sources = self.ranks.world if spread and multi else 1  # trainer ranks that send buckets
        self.book = ServerBook([e.url for e in self.engines], metrics)
        self.pool: SegmentPool | None = None  # the shared-memory segments same-host servers map (``lease``)
        self.pace = BroadcastPace(config.deadlines)  # the data plane's measured rate, across epochs
        self.epochs = Epochs(config, control, self.engines, self.book, runtime, self.ranks, WEIGHTS,
                             self.sources, buckets)

    @classmethod
    def connect(cls, config: WeightSyncConfig, control: ControlLoop, metrics: SyncMetrics, runtime: Runtime,
                session: str | None = None, ranks: TrainerRanks | None = None, spread: bool = False,
                buckets: int = 1) -> Fleet:
        """Form the first groups, claiming every server (``config.takeover``: even from a live owner);
        servers that do not answer start evicted. Raises ``SyncError`` when no server at all could
        join, ``TrainerConflict`` when another live trainer owns a server, ``UnsupportedServer`` when
        one runs a setup its client can never sync (all leave nothing open)."""
        fleet = cls(config, control, metrics, runtime, session, ranks, spread, buckets)
        try:
            fleet.epochs.form(fleet.engines, refuse_unsupported=True, takeover=config.takeover)
            if fleet.epochs.conflicts:
                raise _conflict(fleet.epochs.conflicts)
            if not fleet.epochs.current.members:
                raise SyncError("no server could join the data plane: " + "; ".join(fleet.book.evicted().values()))
        except BaseException:
            fleet.close()
            raise
        return fleet

    def lease(self, pool: SegmentPool) -> None:
        """Versions are packed into ``pool``'s segments for the servers on shared memory."""
        self.pool = pool
        self.book.lease_from(pool)

    @property
    def kind(self) -> VersionKind:
        return self.epochs.kind

    def serve(self, kind: VersionKind) -> None:
        """Send versions of ``kind`` from now on (``lora: adapter``, once the base is in place)."""
        self.epochs.serve(kind)

    # -- what connect asks --------------------------------------------------------------------------

    @property
    def single_dtype_buckets(self) -> bool:
        return any(e.protocol.single_dtype_buckets for e in self.engines)

    def expected_names(self) -> list[frozenset[str]]:
        """The tensor names each member server that can tell checks versions against (asked at connect).
        A server that fails to answer is counted as one that cannot tell: it still refuses a bad version."""
        answers = self.call_members(lambda e: e.expected_names(), "expected_names")
        for url, answer in answers.items():
            if isinstance(answer, BaseException):
                log.warning("%s did not say which tensors it expects: %s", url, answer)
        return [a for a in answers.values() if isinstance(a, frozenset)]

    def layout_refusals(self, specs: tuple[TensorSpec, ...]) -> dict[str, str]:
        """Asked at connect: each member that would refuse a plan sending ``specs``, and why."""
        return self.refusals(lambda e: e.check_layout(LayoutCheck(specs)), "check_layout")

    def refusals(self, call: Callable[[ConnectChecks], Awaitable[str | None]], what: str) -> dict[str, str]:
        """Each member's refusal (``call``'s answer: None, or why not) of what connect asks; a server
        that fails to answer is logged and counted as one that cannot tell (it still refuses a bad version)."""
        answers = self.call_members(call, what)
        for url, answer in answers.items():
            if isinstance(answer, BaseException):
                log.warning("%s did not answer %s: %s", url, what, answer)
        return {url: answer for url, answer in answers.items() if isinstance(answer, str)}

    def call_members(self, call: Callable[[EngineClient], Awaitable[Any]], what: str) -> dict[str, Any]:
        """``call`` on every member of the current epoch, each within ``http_s``; results or exceptions by URL."""
        return self.epochs.call_all(self.epochs.current.members, call, what)

    # -- what the trainer reads ---------------------------------------------------------------------

    def takes_deltas(self) -> bool:
        """Whether a version may go to these members as deltas at all (``transport.send.delta_for``
        then asks which version each holds): one broadcast reaches every member of a group, so every
        member must rebuild deltas and receive over the data plane (none on shared memory)."""
        epoch = self.epochs.current
        return not epoch.shared and bool(epoch.members) and all(e.protocol.deltas for e in epoch.members)

    def reachable(self) -> bool:
        """Whether a later version can still reach a server: some member does not refuse this plan."""
        refusing = self.book.refusing()
        return any(url not in refusing for url in self.epochs.current.urls)

    def member_versions(self) -> dict[str, int]:
        """The versions of the servers currently in the groups (evicted ones excluded)."""
        return self.book.versions(self.epochs.current.urls)

    def close(self) -> None:
        """Release the servers in the groups, close every server's connections and the groups;
        bounded, never raises."""
        members = {e.url for e in [*self.epochs.current.members, *self.epochs.parked]}

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
        self.epochs.close()


def lowest_member_version(fleets: Iterable[Fleet], default: int) -> int:
    """The oldest version served by a server in a group (evicted servers excluded), or ``default``."""
    return min((v for f in fleets for v in f.member_versions().values()), default=default)
