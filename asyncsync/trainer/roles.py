"""How one trainer rank takes part in each version, chosen once at ``connect``.

``Leader`` is rank 0, or the only process: it talks to every server (its ``Fleet``s, one per server
with ``group_per_server``), sends each version (``transport.send``), checks it where due
(``trainer.verify``), and decides for the other ranks. ``Follower`` is a sharded trainer's other
rank: it sends the buckets it owns as rank 0 says (``transport.datapath.follow_version``) and hears
every decision from rank 0 (``transport.commands``). Both answer the same questions, so nothing
above them asks which rank it is:

    role.senders()              one per fleet: ``send(version, source, result)``, the transport's own
                                call (``send_version`` bound to a fleet, or ``follow_version``)
    role.checked(i, result)     after sender ``i`` sent a version: the served check, where due (rank 0)
    role.await_loads(result)    blocking ``lora: adapter``: until the engines loaded the version
    role.pack_ahead(policy)     blocking mode: whether this version is packed (and encoded) ahead
    role.server_versions()      the version each server serves; role.lowest(needed); role.reachable()
    role.close(lost)            the ranks part together (unless one is gone), the last loads end, the servers
                                are released; returns their versions as they were then
"""

from __future__ import annotations

import functools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

from asyncsync.config import WeightSyncConfig
from asyncsync.control import ControlLoop
from asyncsync.metrics import SyncResult
from asyncsync.protocol.lora import version_name
from asyncsync.protocol.specs import BucketPlan
from asyncsync.ranks import TrainerRankLost, TrainerRanks
from asyncsync.trainer.delta import EncodeAhead
from asyncsync.trainer.verify import ServedCheck
from asyncsync.transport.adapters import AdapterLoads
from asyncsync.transport.commands import Command, Loading, PackAhead, Stop
from asyncsync.transport.datapath import follow_version
from asyncsync.transport.fleet import Fleet, lowest_member_version
from asyncsync.transport.follower import FollowingRank, Stopped
from asyncsync.transport.phases import SLACK_S
from asyncsync.transport.send import send_version
from asyncsync.transport.sources import BucketSource

log = logging.getLogger(__name__)

LOAD_ROUND_S = 0.5  # a blocking publish waits for adapter loads in rounds this long, every rank told after each

# Sends one version from a source: the version's result (a sharded trainer's ranks other than 0 get
# rank 0's, None when rank 0 abandoned it). Never raises for a server's failure.
Sender = Callable[[int, BucketSource, SyncResult], "SyncResult | None"]


class Role(ABC):
    """This rank's part in every version (the module doc)."""

    def __init__(self, ranks: TrainerRanks, config: WeightSyncConfig, plan: BucketPlan):
        self.ranks, self.config, self.plan = ranks, config, plan

    @abstractmethod
    def senders(self) -> list[Sender]: ...

    def checked(self, index: int, result: SyncResult) -> None:
        """After sender ``index`` sent ``result``'s version: nothing, unless rank 0's check is due."""

    @abstractmethod
    def pack_ahead(self, policy: EncodeAhead) -> bool: ...

    @abstractmethod
    def await_loads(self, result: SyncResult) -> None: ...

    @abstractmethod
    def server_versions(self) -> dict[str, int]: ...

    @abstractmethod
    def lowest(self, needed: int) -> int:
        """The oldest version a server serves (``needed`` when none can be told)."""

    def reachable(self) -> bool:
        return True

    @abstractmethod
    def close(self, lost: str | None) -> dict[str, int]:
        """Part from the other ranks (unless ``lost`` names one gone) and release the servers; the
        version each server serves once the last version's adapter loads ended."""


class Leader(Role):
    """Rank 0, or the only process: the servers are its (``fleets``, over ``control``)."""

    def __init__(self, ranks: TrainerRanks, config: WeightSyncConfig, plan: BucketPlan, fleets: list[Fleet],
                 control: ControlLoop, check: ServedCheck | None = None, loads: AdapterLoads | None = None):
        super().__init__(ranks, config, plan)
        self.fleets, self.control, self.check, self.loads = fleets, control, check, loads

    def senders(self) -> list[Sender]:
        return [functools.partial(send_version, f, self.plan) for f in self.fleets]

    def checked(self, index: int, result: SyncResult) -> None:
        """Once ``result``'s version is live: the check, where it is due (``trainer/verify.py``)."""
        if self.check is not None:
            self.check.run(self.fleets[index], result.version,
                           {u: v for u, v in result.server_versions.items() if v == result.version})

    def pack_ahead(self, policy: EncodeAhead) -> bool:
        return self.ranks.from_leader(PackAhead(policy.ahead())).ahead

    def await_loads(self, result: SyncResult) -> None:
        """Until every server that wrote ``result``'s version loaded it or failed to (``result`` then
        says which): in rounds of ``LOAD_ROUND_S``, the other ranks told after each, so every
        collective is answered within a round however long an engine takes."""
        assert self.loads is not None
        urls = list(result.server_versions)
        give_up = time.monotonic() + self.config.deadlines.load_s * 2 + SLACK_S  # the loads' own deadlines end them first
        t0 = time.perf_counter()
        while True:
            outcome = self.loads.wait(result.version, urls, LOAD_ROUND_S)
            over = outcome is not None or time.monotonic() > give_up
            self.ranks.from_leader(Loading(over))
            if over:
                break
        name = version_name(self.config.lora_name, result.version)
        outcome = outcome or {u: f"{name}: no load ended in time" for u in urls}
        result.server_versions = {u: v for u, v in outcome.items() if isinstance(v, int)}
        result.failures.update({u: v for u, v in outcome.items() if isinstance(v, str)})
        result.apply_s += time.perf_counter() - t0
        result.finished = time.perf_counter()
        result.total_s = result.finished - result.started

    def server_versions(self) -> dict[str, int]:
        return {u: v for f in self.fleets for u, v in f.book.versions().items()}

    def staging_bytes(self) -> dict[str, int]:
        """What each server that says so stages a version in (``Arena``s; ``asyncsync_receiver_staging_bytes``)."""
        staged = {}
        for f in self.fleets:
            ranks = f.book.ranks()
            staged.update({e.url: e.staging_bytes(self.plan.total_bytes, ranks[e.url]) for e in f.engines
                           if e.url in ranks})
        return {u: n for u, n in staged.items() if n is not None}

    def lowest(self, needed: int) -> int:
        return lowest_member_version(self.fleets, needed)

    def reachable(self) -> bool:
        return any(f.reachable() for f in self.fleets)

    def close(self, lost: str | None) -> dict[str, int]:
        if self.ranks.world > 1 and lost is None:  # the ranks part together
            tell_ranks(self.ranks, Stop())
        if self.loads is not None:  # after the other ranks were let go: the last version's loads end
            self.loads.drain(self.config.deadlines.load_s + SLACK_S)
        versions = self.server_versions()
        for f in self.fleets:
            f.close()
        self.control.close()
        return versions


class Follower(Role):
    """A sharded trainer's rank other than 0: rank 0 decides, this rank follows (``following``)."""

    def __init__(self, ranks: TrainerRanks, config: WeightSyncConfig, plan: BucketPlan, following: FollowingRank,
                 last: Callable[[], SyncResult | None]):
        super().__init__(ranks, config, plan)
        self.following = following
        self._last = last  # the metrics' last result: rank 0's answers, as told

    def senders(self) -> list[Sender]:
        return [self.follow]

    def follow(self, version: int, source: BucketSource, result: SyncResult) -> SyncResult | None:
        """This rank's part of ``version`` (rank 0's result is returned: ``result`` stays as it was)."""
        return follow_version(self.following, self.plan, self.config.checksum, version, source)

    def pack_ahead(self, policy: EncodeAhead) -> bool:
        return self.following.until(PackAhead).ahead

    def await_loads(self, result: SyncResult) -> None:
        while not self.following.until(Loading).over:
            pass

    def server_versions(self) -> dict[str, int]:
        last = self._last()
        return dict(last.server_versions) if last is not None else {}

    def lowest(self, needed: int) -> int:
        return min(self.server_versions().values(), default=needed)

    def close(self, lost: str | None) -> dict[str, int]:
        if self.ranks.world > 1 and lost is None:
            try:
                self.following.until(Stop)
            except Stopped:
                pass
            except TrainerRankLost as e:
                log.warning("%s", e)
        self.following.drop_group()
        return self.server_versions()


def tell_ranks(ranks: TrainerRanks, command: Command) -> None:
    """Rank 0's last word to the other ranks (connect failed, close); a lost rank is only logged."""
    try:
        ranks.from_leader(command)
    except TrainerRankLost as e:
        log.warning("%s", e)
