"""The trainer ranks other than rank 0 (a sharded trainer's): they send the buckets they own, as rank 0's
plan says, in the data-plane groups rank 0 forms with the servers.

A follower talks to no server. Everything it does answers rank 0's commands
(``transport/commands.py``: the one list of them), in the same order on every rank: a ``NewEpoch`` at
any point is answered here; ``until`` returns the command the caller waits for.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from asyncsync.protocol.device import Runtime
from asyncsync.protocol.group import DataPlaneError
from asyncsync.ranks import TrainerRanks
from asyncsync.transport.commands import Command, Failed, Formed, NewEpoch, Stop
from asyncsync.transport.topology import TrainerGroups, join_groups

log = logging.getLogger(__name__)
C = TypeVar("C", bound=Command)


class Stopped(Exception):
    """Rank 0 closed the sync."""


class ConnectFailed(RuntimeError):
    """Rank 0's ``connect`` failed (its own error says why); every other rank raises this."""


class FollowingRank:
    """This rank's side of rank 0's commands (the module doc), and the data-plane groups it joined."""

    def __init__(self, ranks: TrainerRanks, runtime: Runtime):
        self.ranks, self.runtime = ranks, runtime
        self.group: TrainerGroups | None = None

    def until(self, *kinds: type[C]) -> C:
        """Answer rank 0's epochs until it sends one of ``kinds``; ``Stopped`` when it closes."""
        while True:
            command = self.ranks.from_leader(None)
            if isinstance(command, NewEpoch):
                self._epoch(command)
            elif isinstance(command, kinds):
                return command
            elif isinstance(command, Stop):
                raise Stopped()
            elif isinstance(command, Failed):
                raise ConnectFailed(f"trainer rank 0 could not connect: {command.why}")
            else:
                raise RuntimeError(f"trainer rank {self.ranks.rank} expected {[k.__name__ for k in kinds]} from rank 0, "
                                   f"got {type(command).__name__}: the ranks called connect/publish/close in different orders")

    def _epoch(self, epoch: NewEpoch) -> None:
        self.drop_group()
        group: TrainerGroups | None = None
        try:
            group = join_groups(epoch.specs_by_rank[self.ranks.rank], self.runtime)
        except DataPlaneError as e:
            log.warning("trainer rank %d: forming its data-plane groups failed: %s", self.ranks.rank, e)
        self.ranks.gather_objects(group is not None)
        formed = self.ranks.from_leader(None)
        assert isinstance(formed, Formed), f"rank 0 sent {type(formed).__name__} after an epoch"
        if formed.ok:
            self.group = group
        elif group is not None:
            group.close(broken=True)

    def drop_group(self, broken: bool = False) -> None:
        if self.group is not None:
            self.group.close(broken)
            self.group = None
