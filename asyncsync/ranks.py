"""The trainer processes one ``WeightSync`` spans, and the sync's own groups among them.

A single process is a world of one and everything here is a no-op. A sharded trainer (every rank of
torch.distributed's default group calls ``connect`` / ``publish`` / ``wait_snapshot`` / ``close``,
like a collective) gets two gloo groups of its own, created in ``connect`` in the same order on every
rank. They are never the trainer's default group (FSDP's all-gathers run there, and a collective from
another thread would interleave with them), and each is used by one thread only, so their
collectives pair up in the same order on every rank:

    boundary   the snapshotter threads agree, version by version, whether it is taken
    send       the sender threads: rank 0's plan of each version, each bucket's pieces sent to its
               owner (point to point, exact sizes), the checksums for the manifest, each rank's outcome

Every collective has the groups' deadline (``TrainerRanks.of``): a rank that left (its process
died) makes the others fail with ``TrainerRankLost``, never hang.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import torch

log = logging.getLogger(__name__)


class TrainerRankLost(RuntimeError):
    """Another trainer rank did not take part in a collective of the sync in time: it died or hung.
    The sync cannot go on; close it (the servers keep their last complete version)."""


class TrainerRanks:
    """This process's place among the trainer ranks, and the collectives the sync runs among them."""

    def __init__(self, rank: int = 0, world: int = 1, boundary: Any = None, send: Any = None):
        self.rank, self.world, self._boundary, self._send = rank, world, boundary, send

    @classmethod
    def of(cls, trainer_ranks: str | int, deadlines: Any) -> TrainerRanks:
        """``trainer_ranks: auto``: every rank of torch.distributed's default group when it is
        initialized with more than one process (call this on every rank, in the same order as other
        group creations); otherwise, or with ``1``, this process alone.

        The groups' deadline covers the longest a rank may wait for another that is still working:
        rank 0 forming an epoch with the servers (``rendezvous_s``), a broadcast (``collective_s``),
        and the HTTP phases of a version (``http_s`` each). A rank whose process exits is noticed at
        once (its sockets close); only a hung one takes the whole deadline."""
        import torch.distributed as dist

        if trainer_ranks == 1 or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        timeout = timedelta(seconds=deadlines.version_s)
        boundary = dist.new_group(backend="gloo", timeout=timeout)
        send = dist.new_group(backend="gloo", timeout=timeout)
        ranks = cls(dist.get_rank(), dist.get_world_size(), boundary, send)
        ranks.all_agree(True, "boundary")  # warm both groups now, not in the first version
        ranks.all_agree(True, "send")
        return ranks

    @property
    def leader(self) -> bool:
        """Rank 0 talks to the servers (HTTP, membership); the others follow its plan."""
        return self.rank == 0

    def _group(self, which: str) -> Any:
        return self._boundary if which == "boundary" else self._send

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as e:
            raise TrainerRankLost(f"trainer rank {self.rank}: {what} with the other trainer ranks failed: {e}; a rank "
                                  "died or hung, so the sync stops (close it; servers keep their last version)") from None

    def all_agree(self, flag: bool, group: str = "boundary") -> bool:
        """True when every rank passes True."""
        if self.world == 1:
            return flag
        import torch.distributed as dist

        value = torch.tensor([1 if flag else 0], dtype=torch.int64)
        self._call("agreeing", lambda: dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self._group(group)))
        return bool(value.item())

    def from_leader(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (the others pass None): a version's plan, a new epoch."""
        if self.world == 1:
            return obj
        import torch.distributed as dist

        box = [obj if self.leader else None]
        self._call("receiving rank 0's plan", lambda: dist.broadcast_object_list(box, group=self._send, group_src=0))
        return box[0]

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """``tensor`` to rank ``dst``, which ``receive``s it: this rank's pieces of a bucket to its owner.
        Returns once the bytes are handed over, so the buffer may then be rewritten."""
        import torch.distributed as dist

        self._call("sending a bucket's pieces", lambda: dist.send(tensor, group=self._send, group_dst=dst))

    def receive(self, parts: dict[int, torch.Tensor]) -> None:
        """Each other rank's ``send`` into ``parts[rank]`` (sized exactly), all posted at once."""
        import torch.distributed as dist

        def run() -> None:
            works = [dist.irecv(t, group=self._send, group_src=r) for r, t in parts.items()]
            for w in works:
                w.wait()

        self._call("receiving a bucket's pieces", run)

    def gather_objects(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` at rank 0 (each rank's checksums, its outcome)."""
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        outs = [None] * self.world if self.leader else None
        self._call("reporting to rank 0", lambda: dist.gather_object(obj, outs, group=self._send, group_dst=0))
        return outs

    def close(self) -> None:
        import torch.distributed as dist

        for group in (self._boundary, self._send):
            if group is not None:
                try:
                    dist.destroy_process_group(group)
                except Exception as e:  # the default group may be gone already: nothing left to release
                    log.debug("destroying a trainer group: %s", e)
        self._boundary = self._send = None
