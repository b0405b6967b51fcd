"""The trainer ranks other than rank 0 (a sharded trainer's): they send the buckets they own, as rank 0's
plan says, in the data-plane groups rank 0 forms with the servers.

A follower talks to no server. Everything it does answers rank 0, through ``TrainerRanks.from_leader``,
in the same order on every rank:

    ("epoch", specs)       a new epoch: drop the old groups, join this rank's (rank 0 is forming them
                           with the servers), report whether they formed; then ("formed", ok) says
                           whether every rank's did: keep them, or drop them for rank 0's next attempt
    ("version", plan)      run one version's data path (``transport.send.follow_version``); None: no
                           server is in a group, nothing to send
    ("done", result)       the version is over: rank 0's ``SyncResult`` (the servers' answers), or
                           None when the version was abandoned
    ("loading", over)      blocking ``lora: adapter``: after each short round of waiting for the
                           engines' loads of the version, whether they are over
    ("names", ties)        connect(): the names sent (``TiedNames``), decided with the servers
    ("base", setup)        connect() with ``lora: adapter``: the base's (version, plan, owners), sent
                           like a version, or None when every server serves it
    ("ready", setup)       connect() is over: the bucket plan and each bucket's owner
    ("failed", why)        connect() failed on rank 0 (no server, a conflict): every rank raises
    ("stop",)              close()
"""

from __future__ import annotations

import logging
from typing import Any

from asyncsync.protocol.device import Runtime
from asyncsync.protocol.group import DataPlaneError
from asyncsync.ranks import TrainerRanks
from asyncsync.transport.topology import TrainerGroups, join_groups

log = logging.getLogger(__name__)


class Stopped(Exception):
    """Rank 0 closed the sync."""


class ConnectFailed(RuntimeError):
    """Rank 0's ``connect`` failed (its own error says why); every other rank raises this."""


class Follower:
    def __init__(self, ranks: TrainerRanks, runtime: Runtime):
        self.ranks, self.runtime = ranks, runtime
        self.group: TrainerGroups | None = None

    def until(self, *kinds: str) -> tuple[Any, ...]:
        """Answer rank 0's epochs until it sends one of ``kinds``; ``Stopped`` when it closes."""
        while True:
            command = self.ranks.from_leader(None)
            if command[0] == "epoch":
                self._epoch(command[1])
            elif command[0] in kinds:
                return command
            elif command[0] == "stop":
                raise Stopped()
            elif command[0] == "failed":
                raise ConnectFailed(f"trainer rank 0 could not connect: {command[1]}")
            else:
                raise RuntimeError(f"trainer rank {self.ranks.rank} expected {kinds} from rank 0, got {command[0]!r}: "
                                   "the ranks called connect/publish/close in different orders")

    def _epoch(self, specs_by_rank: list[Any]) -> None:
        self.drop_group()
        group: TrainerGroups | None = None
        try:
            group = join_groups(specs_by_rank[self.ranks.rank], self.runtime)
        except DataPlaneError as e:
            log.warning("trainer rank %d: forming its data-plane groups failed: %s", self.ranks.rank, e)
        self.ranks.gather_objects(group is not None)
        (_, formed) = self.ranks.from_leader(None)
        if formed:
            self.group = group
        elif group is not None:
            group.close(broken=True)

    def drop_group(self, broken: bool = False) -> None:
        if self.group is not None:
            self.group.close(broken)
            self.group = None
