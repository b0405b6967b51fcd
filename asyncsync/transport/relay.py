"""Relay planning: which server forwards each version to which (``fanout`` other than ``direct``).

The trainer sends a version once, to the tree's root; every server forwards each payload to the
servers below it as soon as it landed (``protocol.relay``), so the trainer's link carries one copy
whatever the number of servers, and a version takes about ``fanout x (buckets + depth - 1)``
bucket-times instead of one per server. Each tree edge is a two-rank data-plane group (the upper
server its rank 0) whose rendezvous store the trainer runs; a dead server breaks only its own edges.

    tree = RelayTree.plan(urls, fanout=RelayTree.auto_fanout(len(urls), buckets))
    tree.root, tree.below(url), tree.parent(url), tree.depth

The relay's policy across versions lives here too: who ends early (``ends_early``), who is sent a
version again after a hop failed (``to_repair``), and which relaying server moves to a leaf
(``Relays.demote_slow``) for holding the servers below it.

``auto`` picks the fan-out with the least pipelined time in that model: a chain (1) while the servers
do not outnumber the buckets by much, a wider tree when they do (a chain's last server waits one
bucket-time per server above it; a node of a tree sends each bucket once per server below it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

MAX_AUTO_FANOUT = 8  # ``auto`` considers trees up to this wide
SLOW_HOP = 4.0  # a relayed server whose hop took this many times the others' median is moved to a leaf
SLOW_HOP_MIN_S = 0.2  # ... and only when its hop took at least this long (noise on fast versions)


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
    """One sender's relay across epochs: the servers in the order every tree takes them
    (``seniority``: the oldest members first, so a server that was evicted or demoted comes back as
    a leaf), and whether the next version must re-plan (``replan``). The trees themselves are the
    current epoch's (``transport.epochs.Epoch.trees``)."""

    def __init__(self) -> None:
        self.seniority: list[str] = []
        self.replan = False

    def formed(self, trees: tuple[RelayTree, ...]) -> None:
        self.seniority += [u for t in trees for u in t.order if u not in self.seniority]

    def forget(self, urls: Iterable[str]) -> None:
        """``urls`` were evicted: back, each is a leaf."""
        gone = set(urls)
        self.seniority = [u for u in self.seniority if u not in gone]

    def demote(self, url: str) -> bool:
        """Move ``url`` to the end of every tree from the next epoch on; False when it is there already."""
        if url not in self.seniority or self.seniority[-1] == url:
            return False
        self.seniority = [u for u in self.seniority if u != url] + [url]
        self.replan = True
        return True

    def demote_slow(self, trees: tuple[RelayTree, ...], received: Mapping[str, float]) -> dict[str, float]:
        """Demote the relaying servers that held the servers below them (``slow_hops``); each one
        demoted now, with its hop over the median of the others."""
        return {url: ratio for url, ratio in slow_hops(trees, received).items() if self.demote(url)}


def ends_early(in_trees: set[str], engines: Iterable[Any], relayed_kind: bool) -> frozenset[str]:
    """The servers sent ``end`` as soon as their ``update`` answered: those of a relay tree, whose
    update answers once they verified the whole version (none receives in the background here), so a
    slow server below never holds them; only for a kind of version a relay carries."""
    return frozenset(e.url for e in engines if relayed_kind and e.url in in_trees and not e.receives_in_background)


def to_repair(in_trees: set[str], here: Iterable[str], failed: Iterable[str], skip: Iterable[str]) -> set[str]:
    """The servers of a tree still ``here`` that did not take a version (``failed``): a hop above them
    died, failed or corrupted it (each verifies every bucket), so they are sent it again, once.
    ``skip``: those that missed it for a reason of their own (shared memory, a refused layout); the
    trainer's other direct children too."""
    return (set(here) & in_trees & set(failed)) - set(skip)


def forgers(trees: tuple[RelayTree, ...], took: Iterable[str], unpublished: Iterable[str]) -> dict[str, str]:
    """The relaying servers that forwarded bytes the trainer did not publish: each server that took the
    version itself (its own bytes were the trainer's) while a server right below it refused what it
    received against the trainer's digests (``unpublished``); each with that server below. A server
    refusing so below a server that refused too was fed by the same culprit higher up."""
    took, unpublished = set(took), set(unpublished)
    return {parent: url for tree in trees for url in tree.order
            if url in unpublished and (parent := tree.parent(url)) is not None and parent in took}


def slow_hops(trees: tuple[RelayTree, ...], received: Mapping[str, float]) -> dict[str, float]:
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


def _depth(servers: int, fanout: int) -> int:
    depth, level, placed = 0, 1, 0
    while placed < servers:
        placed += level
        level *= fanout
        depth += 1
    return depth
