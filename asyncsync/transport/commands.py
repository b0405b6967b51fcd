"""What rank 0 of a sharded trainer tells its other ranks, in order (``TrainerRanks.from_leader``).

Every rank calls the sync like a collective; rank 0 alone talks to the servers and decides, and the
other ranks (``transport.follower.Follower``) act on these commands, matched by type. This module is
the one list of them. A follower that gets another command than it waits for raises (the ranks
called ``connect`` / ``publish`` / ``close`` in different orders).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class Command:
    """A command from rank 0 (every one is a frozen dataclass below)."""


@dataclass(frozen=True)
class NewEpoch(Command):
    """A new epoch (``transport.epochs``): drop the old groups and join this rank's
    (``specs_by_rank[rank]``, rank 0 forms them with the servers meanwhile); every rank then reports
    whether its groups formed."""

    specs_by_rank: list[Any]


@dataclass(frozen=True)
class Formed(Command):
    """Whether every rank's groups of the epoch formed: keep them, or drop them for rank 0's next try."""

    ok: bool


@dataclass(frozen=True)
class Version(Command):
    """Run one version's data path (``transport.datapath.follow_version``) as ``plan`` says (a
    ``VersionPlan``); None: no server is in a group, nothing to send."""

    plan: Any


@dataclass(frozen=True)
class Done(Command):
    """The version is over: rank 0's ``SyncResult`` (the servers' answers), or None when it was abandoned."""

    result: Any


@dataclass(frozen=True)
class Loading(Command):
    """Blocking ``lora: adapter``: after each short round of waiting for the engines' loads, whether they are over."""

    over: bool


@dataclass(frozen=True)
class PackAhead(Command):
    """Blocking mode with a delta baseline: whether this version is packed (and encoded) ahead."""

    ahead: bool


@dataclass(frozen=True)
class Names(Command):
    """``connect``: the names sent (``TiedNames``), decided with the servers."""

    ties: Any


@dataclass(frozen=True)
class BaseVersion(Command):
    """``connect`` with ``lora: adapter``: the base's (version, plan, owners), sent like a version, or
    None when every server serves it."""

    setup: Any


@dataclass(frozen=True)
class Ready(Command):
    """``connect`` is over: the bucket plan, each bucket's owner rank, whether the ranks keep a delta baseline."""

    plan: Any
    owners: list[int]
    delta: bool


@dataclass(frozen=True)
class Failed(Command):
    """``connect`` failed on rank 0 (no server, a conflict): every rank raises, saying ``why``."""

    why: str


@dataclass(frozen=True)
class Stop(Command):
    """``close``."""
