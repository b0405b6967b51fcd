"""Relay planning: which server forwards each version to which (``fanout`` other than ``direct``).

The trainer sends a version once, to the tree's root; every server forwards each payload to the
servers below it as soon as it landed (``protocol.relay``), so the trainer's link carries one copy
whatever the number of servers, and a version takes about ``fanout x (buckets + depth - 1)``
bucket-times instead of one per server. Each tree edge is a two-rank data-plane group (the upper
server its rank 0) whose rendezvous store the trainer runs; a dead server breaks only its own edges.

    tree = RelayTree.plan(urls, fanout=RelayTree.auto_fanout(len(urls), buckets))
    tree.root, tree.below(url), tree.parent(url), tree.depth

``auto`` picks the fan-out with the least pipelined time in that model: a chain (1) while the servers
do not outnumber the buckets by much, a wider tree when they do (a chain's last server waits one
bucket-time per server above it; a node of a tree sends each bucket once per server below it).
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_AUTO_FANOUT = 8  # ``auto`` considers trees up to this wide


@dataclass(frozen=True)
class RelayTree:
    """Servers in breadth-first order (``order[0]``, the root, is the only one the trainer sends to);
    server j > 0 is below server ``(j - 1) // fanout``."""

    order: tuple[str, ...]
    fanout: int

    def __post_init__(self) -> None:
        if not self.order:
            raise ValueError("a relay tree needs at least one server")
        if len(set(self.order)) != len(self.order):
            raise ValueError(f"a server is in the relay tree twice: {list(self.order)}")
        if not isinstance(self.fanout, int) or self.fanout < 1:
            raise ValueError(f"fanout must be a whole number >= 1, got {self.fanout!r}")

    @classmethod
    def plan(cls, urls: list[str], fanout: int) -> RelayTree:
        return cls(tuple(urls), fanout)

    @staticmethod
    def auto_fanout(servers: int, buckets: int) -> int:
        """The fan-out whose pipelined time ``k x (buckets + depth_k - 1)`` is least (ties: the narrower)."""
        return min(range(1, MAX_AUTO_FANOUT + 1), key=lambda k: (k * (max(buckets, 1) + _depth(servers, k) - 1), k))

    @property
    def root(self) -> str:
        return self.order[0]

    @property
    def depth(self) -> int:
        """Servers on the longest path down from the root (the root included)."""
        return _depth(len(self.order), self.fanout)

    def parent(self, url: str) -> str | None:
        """The server ``url`` gets versions from; None for the root (the trainer's)."""
        j = self.order.index(url)
        return self.order[(j - 1) // self.fanout] if j else None

    def below(self, url: str) -> tuple[str, ...]:
        j = self.order.index(url)
        return self.order[j * self.fanout + 1: (j + 1) * self.fanout + 1]

    def edges(self) -> list[tuple[str, str]]:
        """(upper, lower) of every edge, in breadth-first order of the lower server."""
        return [(self.order[(j - 1) // self.fanout], self.order[j]) for j in range(1, len(self.order))]

    def describe(self) -> str:
        """The tree as text for logs and notes: ``a -> b -> c`` for a chain, else each node's servers below."""
        if self.fanout == 1 or len(self.order) <= 2:
            return " -> ".join(["trainer", *self.order])
        return "; ".join(f"{u} -> {', '.join(self.below(u))}" for u in self.order if self.below(u))


class Relays:
    """One sender's relay across epochs: the current epoch's trees, the servers in the order every
    tree takes them (``seniority``: the oldest members first, so a server that was evicted or demoted
    comes back as a leaf), and whether the next version must re-plan (``replan``)."""

    def __init__(self) -> None:
        self.trees: tuple[RelayTree, ...] = ()
        self.seniority: list[str] = []
        self.replan = False

    def formed(self, trees: tuple[RelayTree, ...]) -> None:
        self.trees = trees
        self.seniority += [u for t in trees for u in t.order if u not in self.seniority]

    def evicted(self, url: str) -> None:
        self.seniority = [u for u in self.seniority if u != url]

    def relayed(self) -> set[str]:
        """The servers that get versions from another server, not from the trainer."""
        return self.in_trees() - {tree.root for tree in self.trees}

    def in_trees(self) -> set[str]:
        """Every server of a tree, its root included (not the trainer's other direct children)."""
        return {u for tree in self.trees for u in tree.order}

    def demote(self, url: str) -> bool:
        """Move ``url`` to the end of every tree from the next epoch on; False when it is there already."""
        if url not in self.seniority or self.seniority[-1] == url:
            return False
        self.seniority = [u for u in self.seniority if u != url] + [url]
        self.replan = True
        return True


def _depth(servers: int, fanout: int) -> int:
    depth, level, placed = 0, 1, 0
    while placed < servers:
        placed += level
        level *= fanout
        depth += 1
    return depth
