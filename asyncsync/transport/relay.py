"""Relay planning: which server forwards each version to which (``fanout`` other than ``direct``).

The trainer sends a version once, to the tree's root; every server forwards each payload to the
servers below it as soon as it landed (``protocol.relay``), so the trainer's link carries one copy
whatever the number of servers, and a version takes about ``fanout x (buckets + depth - 1)``
bucket-times instead of one per server. Each tree edge is a two-rank data-plane group (the upper
server its rank 0) whose rendezvous store the trainer runs; a dead server breaks only its own edges.

    tree = RelayTree.plan(urls, fanout=RelayTree.auto_fanout(len(urls), buckets))
    tree.root, tree.below(url), tree.parent(url), tree.depth

The relay's policy across versions lives here too: how much later than the root each relayed
server may get a version's first frame (``reach_s``: its deadlines grow with its depth), who ends
early (``ends_early``), who is sent a version again after a hop failed (``to_repair``), which edge a
failure is blamed on (``failed_edges``; ``Relays.blame`` keeps its two servers apart, demotes a
relay whose children keep failing, and takes a server that fails under every parent out of the
tree), and which relaying server moves to a leaf (``Relays.demote_slow``) for holding the servers
below it.

``auto`` picks the fan-out with the least pipelined time in that model: a chain (1) while the servers
do not outnumber the buckets by much, a wider tree when they do (a chain's last server waits one
bucket-time per server above it; a node of a tree sends each bucket once per server below it).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

MAX_AUTO_FANOUT = 8  # ``auto`` considers trees up to this wide
SLOW_HOP = 4.0  # a relayed server whose hop took this many times the others' median is moved to a leaf
SLOW_HOP_MIN_S = 0.2  # ... and only when its hop took at least this long (noise on fast versions)
BLAMED = 2  # a relay whose children failed this many times is demoted; a server that failed under this many
# parents leaves the tree (the failures follow it, not its parents)


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

    def above(self, url: str) -> int:
        """How many servers are above ``url`` (0 for the root): the hops a version makes before it."""
        j, n = self.order.index(url), 0
        while j:
            j, n = (j - 1) // self.fanout, n + 1
        return n

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
    a leaf), the pairs of servers whose edge failed (``apart``: never an edge again), the servers
    that failed under every parent they had (``direct``: the trainer's own children, in no tree),
    and whether the next version must re-plan (``replan``). The trees themselves are the current
    epoch's (``transport.epochs.Epoch.trees``). Kept for the sender's life: a partition that healed
    costs only a different order."""

    def __init__(self) -> None:
        self.seniority: list[str] = []
        self.apart: set[frozenset[str]] = set()
        self.direct: set[str] = set()
        self.replan = False
        self._failed_below: Counter[str] = Counter()  # per relay: servers below it that failed since it moved
        self._failed_under: dict[str, set[str]] = {}  # per server: the parents it failed under

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
        self._failed_below.pop(url, None)
        self.replan = True
        return True

    def demote_slow(self, trees: tuple[RelayTree, ...], received: Mapping[str, float]) -> dict[str, float]:
        """Demote the relaying servers that held the servers below them (``slow_hops``); each one
        demoted now, with its hop over the median of the others."""
        return {url: ratio for url, ratio in slow_hops(trees, received).items() if self.demote(url)}

    def blame(self, edges: Iterable[tuple[str, str]]) -> dict[str, tuple[str, str]]:
        """Each failed edge (upper, lower: what reached the upper never reached the lower, at a
        rendezvous or in a version; ``failed_edges``): the two are never an edge again (``apart``),
        so from the next epoch on the lower is planned below another parent, and a partition between
        two servers costs one version. A failure follows the server that keeps failing: a lower that
        failed under ``BLAMED`` parents leaves the trees (``direct``: the trainer sends it versions
        itself); otherwise a relay whose children failed ``BLAMED`` times moves to a leaf
        (``demote``). Returns, per server moved, the event's kind (``direct``, ``demoted``) and why."""
        moved: dict[str, tuple[str, str]] = {}
        for upper, lower in edges:
            self.apart.add(frozenset((upper, lower)))
            self.replan = True
            parents = self._failed_under.setdefault(lower, set())
            parents.add(upper)
            if len(parents) >= BLAMED:
                if lower not in self.direct:
                    self.direct.add(lower)
                    moved[lower] = ("direct", f"it failed below {len(parents)} relaying servers "
                                              f"({', '.join(sorted(parents))}): the trainer sends it versions itself")
                continue
            self._failed_below[upper] += 1
            failed = self._failed_below[upper]
            if failed >= BLAMED and self.demote(upper):
                moved[upper] = ("demoted", f"servers below it failed {failed} times")
        return moved


def tree_order(urls: Sequence[str], fanout: int, seniority: Sequence[str] = (),
               apart: Collection[frozenset[str]] = ()) -> tuple[list[str], list[str]]:
    """A tree's order over the relaying servers ``urls`` (config order): by ``seniority``, the others
    after them, with no edge between two servers kept ``apart`` (``arrange``); and the servers that
    found no place (they stay in the trainer's own group)."""
    rank = {url: i for i, url in enumerate(seniority)}
    return arrange(sorted(urls, key=lambda u: rank.get(u, len(rank))), fanout, apart)


def arrange(ranked: Sequence[str], fanout: int, apart: Collection[frozenset[str]]) -> tuple[list[str], list[str]]:
    """``ranked`` as a tree's breadth-first order (fan-out ``fanout``) in which no edge joins two
    servers kept ``apart``: each place takes the first server left that is not kept apart from the
    parent of that place; when every server left is, the first of them goes to the trainer's own
    group instead (the second list). Without ``apart``, ``ranked`` as it is."""
    order: list[str] = []
    out: list[str] = []
    left = list(ranked)
    while left:
        parent = order[(len(order) - 1) // fanout] if order else None
        fits = next((u for u in left if parent is None or frozenset((parent, u)) not in apart), None)
        if fits is None:
            out.append(left.pop(0))
            continue
        order.append(fits)
        left.remove(fits)
    return order, out


def reach_s(trees: Iterable[RelayTree], hop_s: float, most_s: float = math.inf) -> dict[str, float]:
    """How much later than its tree's root each relayed server may get a version's first frame: one
    hop per server above it, each within ``hop_s`` (the first payload's own deadline: a server
    forwards a payload once it landed whole, so a hop takes what the payload may take to cross one
    link), all of them within ``most_s`` (``collective_s``, the ceiling of one broadcast: before the
    rate is known every bucket's deadline is that ceiling, and a chain's depth must not multiply
    it). A relayed server's first-frame deadline, its ``update`` and ``end`` deadlines and its
    background receive's window add it (``transport.send``), so a deep server is not failed for
    being deep."""
    return {u: min(n * hop_s, most_s) for tree in trees for u in tree.order if (n := tree.above(u))}


def failed_edges(trees: Iterable[RelayTree], failed: Collection[str], reached: Collection[str]) -> list[tuple[str, str]]:
    """The edges (upper, lower) failures are blamed on: ``lower`` failed while ``upper`` was
    ``reached`` (it joined the epoch, or took the version). A server below a failed one failed with
    it, not by its own edge; a root's failure is its own link to the trainer, no server's."""
    return [(p, u) for tree in trees for p, u in tree.edges() if u in failed and p in reached]


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
