"""Which data-plane group each server joins, and the trainer's rank 0 in all of them.

Servers take part in a group according to their engine's ``DataPlaneProtocol``: asyncsync's receivers
(the reference server, asyncsync's vLLM backend) warm the group up and verify a CRC32C manifest after
the last bucket; SGLang does neither. A collective has to be the same on every rank, so each protocol
gets a group of its own: one group when every server speaks the same protocol, and the trainer
broadcasts each bucket once per group when a config mixes them. Every group of the trainer's, and
every relay edge, rendezvouses in one store the trainer runs for its whole session
(``RendezvousStore``, bound to ``master_addr`` only, on ``master_port`` or a free port), each in a
namespace of its own with SGLang's key layout: the group's name, ``<group_name>.<epoch>.<random>``,
whose random part travels only in the token-checked ``/init_group``. asyncsync's groups and edges
are keyed (``GroupSpec.key``, drawn here per group and epoch: ``protocol.keys``); SGLang's cannot be.

A sharded trainer whose ranks own buckets (``sources`` > 1) gets, for each protocol whose receivers
can join several groups, one group per owning trainer rank: trainer rank r is rank 0 of its own group
with the servers, which join all of them at the same ranks (``InitGroupRequest.more_groups``), so a
bucket crosses only from its owner to the servers. SGLang joins one group: its buckets come from rank 0.

With ``fanout`` other than ``direct`` (one sending trainer rank), a protocol's servers that relay
(asyncsync's, one data-plane rank each) form a tree (``transport.relay``): the trainer's group holds
only the tree's root (and the servers that cannot relay), and every edge below has two ranks (a
``stream`` for host weights, ``protocol.stream``; NCCL for CUDA weights), rendezvousing in the
trainer's store too, since the trainer cannot pick free ports elsewhere.

    store = RendezvousStore(config.master_addr, config.master_port, ...)   # once per session (rank 0)
    layout = GroupLayout.of(config, engines, world_sizes, runtime, sources, port=store.port)
    # each server: await engine.init_group(*layout.membership(engine))   (concurrently with:)
    groups = layout.join(rank, store)         # rank 0 of this trainer rank's groups, once all joined
    works = groups.broadcast_async(bucket, header=frames.header(i, bucket))  # into every group (the header:
    groups.wait(works)                                                       # only where the protocol is framed)
    groups.broadcast_checksums(crcs, frames=frames)  # only to the groups whose protocol expects them
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch.distributed import TCPStore

from asyncsync.config import WeightSyncConfig
from asyncsync.protocol.device import Runtime
from asyncsync.protocol.frames import FrameHeader, VersionFrames
from asyncsync.protocol.group import DataPlaneError, DataPlaneGroup, free_port, resolve_backend, serve_store
from asyncsync.protocol.keys import new_key
from asyncsync.protocol.wire import GroupSpec
from asyncsync.engines.base import DataPlaneProtocol, EngineClient
from asyncsync.transport.relay import RelayTree, tree_order

log = logging.getLogger(__name__)


class GroupLayout:
    """The groups of one epoch: per data-plane protocol, one group per owning trainer rank (or one),
    and every server's rank in them, in config order; with a relay, its trees and their edges."""

    def __init__(self, groups: list[tuple[DataPlaneProtocol, tuple[GroupSpec, ...]]],
                 members: dict[str, tuple[tuple[GroupSpec, ...], int]], runtime: Runtime,
                 trees: Sequence[RelayTree] = (), relay: Mapping[str, tuple[GroupSpec, ...]] | None = None):
        self.groups = groups
        self._members = members
        self.runtime = runtime
        self.trees = tuple(trees)
        self._relay = dict(relay or {})  # url -> the edges it is rank 0 of

    @property
    def edges(self) -> list[GroupSpec]:
        return [spec for specs in self._relay.values() for spec in specs]

    @classmethod
    def of(cls, config: WeightSyncConfig, engines: Sequence[EngineClient], world_sizes: Mapping[str, int],
           runtime: Runtime, sources: int = 1, buckets: int = 1, seniority: Sequence[str] = (),
           apart: Collection[frozenset[str]] = (), direct: Collection[str] = (),
           port: int | None = None) -> GroupLayout:
        """The groups for ``engines``; ``runtime`` is the device of the trainer's weights, which picks the
        backend for ``backend: auto`` (NCCL for CUDA weights, gloo otherwise). ``sources``: how many
        trainer ranks send buckets; ``buckets``: how many a version has (``fanout: auto`` plans by it);
        ``seniority``: servers in the order the relay tree takes them, the others after them (in config
        order): a server that comes back after an eviction joins as a leaf, not above the others;
        ``apart``: pairs of servers whose edge failed, never an edge again; ``direct``: servers kept in
        the trainer's own group (``transport.relay.Relays``). ``port``: the trainer's rendezvous
        store's (default: ``master_port``, or a free one). Every group gets a name no answer shows
        and, where its servers speak asyncsync's data plane, a key."""
        by_protocol: dict[DataPlaneProtocol, list[EngineClient]] = {}
        for e in engines:
            by_protocol.setdefault(e.protocol, []).append(e)
        backend = resolve_backend(config.backend, runtime)
        port = port or config.master_port or free_port(config.master_addr)

        def spec(world: int, kind: str, keyed: bool) -> GroupSpec:
            return GroupSpec(host=config.master_addr, port=port, world_size=world, backend=kind,
                             group_name=f"{config.group_name}.{secrets.token_hex(8)}",
                             timeout_s=config.deadlines.collective_s, key=new_key() if keyed else "")

        groups, members, trees, relay = [], {}, [], {}
        for protocol, servers in by_protocol.items():
            tree = _plan_tree(config, protocol, servers, world_sizes, sources, buckets, (seniority, apart, direct))
            if tree is not None:
                trees.append(tree)
                below = {u for u in tree.order if u != tree.root}
                servers = [e for e in servers if e.url not in below]  # the trainer's group: the root and the rest
                for upper, lower in tree.edges():
                    edge = spec(2, "nccl" if backend == "nccl" else "stream", keyed=True)
                    relay[upper] = (*relay.get(upper, ()), edge)
                    members[lower] = ((edge,), 1)
            world = 1 + sum(world_sizes[e.url] for e in servers)
            specs = [spec(world, backend, protocol.framed) for _ in range(sources if protocol.multi_group else 1)]
            groups.append((protocol, tuple(specs)))
            rank = 1
            for e in servers:
                members[e.url] = (tuple(specs), rank)
                rank += world_sizes[e.url]
        return cls(groups, members, runtime, trees, relay)

    def membership(self, engine: EngineClient) -> tuple[tuple[GroupSpec, ...], int, tuple[GroupSpec, ...]]:
        """The groups ``engine`` joins, the rank of its first worker, and the relay edges it is rank 0
        of (``init_group``'s arguments)."""
        specs, rank = self._members[engine.url]
        return specs, rank, self._relay.get(engine.url, ())

    def specs_for(self, trainer_rank: int) -> list[tuple[DataPlaneProtocol, GroupSpec]]:
        """The groups trainer rank ``trainer_rank`` is rank 0 of."""
        return [(protocol, specs[trainer_rank]) for protocol, specs in self.groups if trainer_rank < len(specs)]

    def join(self, trainer_rank: int = 0, store: RendezvousStore | None = None) -> TrainerGroups:
        """Join this trainer rank's groups as their rank 0; each returns once all of its servers' ranks
        joined. ``store``: the trainer's rendezvous store, where rank 0 runs it (the other ranks join
        it as clients)."""
        return join_groups(self.specs_for(trainer_rank), self.runtime, store)


def _plan_tree(config: WeightSyncConfig, protocol: DataPlaneProtocol, servers: Sequence[EngineClient],
               world_sizes: Mapping[str, int], sources: int, buckets: int,
               ordering: tuple[Sequence[str], Collection[frozenset[str]], Collection[str]]) -> RelayTree | None:
    """The relay tree over ``servers`` that can relay (``protocol.relay``, one data-plane rank each),
    ordered by ``ordering`` (seniority, pairs kept apart, servers kept direct: ``relay.tree_order``),
    or None: ``fanout: direct``, a trainer that sends from several ranks, fewer than two such servers.
    A server the order leaves out stays in the trainer's group."""
    if config.fanout == "direct" or sources > 1 or not protocol.relay:
        return None
    seniority, apart, direct = ordering
    relaying = [e.url for e in servers if world_sizes[e.url] == 1 and e.url not in direct]
    fanout = RelayTree.auto_fanout(len(relaying), buckets) if config.fanout == "auto" else int(config.fanout)
    order, _ = tree_order(relaying, fanout, seniority, apart)
    if len(order) < 2:
        return None
    return RelayTree.plan(order, fanout)


class RendezvousStore:
    """The one rendezvous store of a trainer session (rank 0's): every group and relay edge of every
    epoch meets in it, each in its own namespace (the group's name). It listens on ``host`` only
    (``protocol.group.serve_store``), on ``port`` when one is configured and free, else on a free
    port (a configured port another process holds is logged, not fatal, as before); every failure
    to listen is a ``DataPlaneError``. It lives until ``close``, so a server's ownership probe of its
    trainer (``protocol.ownership``: the store refuses connections once the trainer is gone) holds
    across epochs and repairs."""

    def __init__(self, host: str, port: int, timeout_s: float):
        try:
            store = serve_store(host, port, timeout_s)
        except DataPlaneError as e:
            if not port or "EADDRINUSE" not in str(e):
                raise
            log.warning("%s; the rendezvous store takes a free port instead", e)
            store = serve_store(host, 0, timeout_s)
        self.store: TCPStore | None = store
        self.port: int = store.port

    def close(self) -> None:
        self.store = None  # a TCPStore's server stops with its last reference


def join_groups(specs: Sequence[tuple[DataPlaneProtocol, GroupSpec]], runtime: Runtime,
                store: RendezvousStore | None = None) -> TrainerGroups:
    """Join ``specs`` as their rank 0, in ``store`` (rank 0's), or as a client of the store at their
    address (a follower trainer rank, which gets its specs from rank 0)."""
    joined: list[tuple[DataPlaneProtocol, DataPlaneGroup]] = []
    try:
        for protocol, spec in specs:
            joined.append((protocol, DataPlaneGroup.join(spec, 0, runtime, warmup=protocol.warmup, hosts_store=False,
                                                         store=store.store if store is not None else None)))
            log.info("data-plane group %s for %s receivers: %d ranks on port %d", spec.group_name, protocol.name,
                     spec.world_size, spec.port)
    except BaseException:
        for _, group in joined:
            group.close(broken=True)
        raise
    return TrainerGroups(joined, runtime)


class TrainerGroups:
    """Rank 0 of every data-plane group: what the trainer broadcasts goes into each of them.

    A group whose receivers take no part in a warm-up (SGLang's) gets its NCCL communicator created
    by its first broadcast. That creation may synchronise the device, so it is never issued while
    another of the sync's collectives is in flight: before a cold group's first broadcast every
    pending one is waited for (the ordering rule docs/design.md "GPU semantics" gives)."""

    def __init__(self, groups: list[tuple[DataPlaneProtocol, DataPlaneGroup]], runtime: Runtime):
        self._groups = groups
        self.runtime = runtime
        self.device: torch.device = runtime.device
        self._cold = {id(g) for p, g in groups if not p.warmup}
        self._pending: list[list[Any]] = []

    @property
    def layout(self) -> list[tuple[str, int]]:
        """(receiver protocol, world size) of each group, for logs and tests."""
        return [(protocol.name, group.spec.world_size) for protocol, group in self._groups]

    def broadcast_async(self, tensor: torch.Tensor, timeout_s: float | None = None,
                        header: FrameHeader | None = None) -> list[Any]:
        """Start broadcasting ``tensor`` into every group (each with deadline ``timeout_s``), after
        ``header`` in the groups whose protocol is framed (``protocol.frames``: every payload of a
        version has one, whose length the caller took from ``tensor``; sealed for each group); pass
        the result to ``wait``."""
        works: list[Any] = []
        for protocol, group in self._groups:
            if id(group) in self._cold:
                if self.runtime.kind == "cuda":
                    for pending in [*self._pending, works]:
                        self.wait(pending)
                self._cold.discard(id(group))
            ops = []
            if protocol.framed:
                assert header is not None, f"a payload to {protocol.name} receivers needs its frame header"
                ops.append(group.broadcast_async(self.runtime.upload(group.seal.tensor(header)), timeout_s))
            ops.append(group.broadcast_async(tensor, timeout_s))
            works.append(ops)
        self._pending.append(works)
        return works

    def wait(self, works: list[Any]) -> None:
        """Until every group's broadcast of one tensor (and its header) is done; ``DataPlaneError`` at a
        group's deadline."""
        for (_, group), ops in zip(self._groups, works):
            for work in reversed(ops):  # the payload's first: a stream then waits once, for the whole frame
                group.wait(work)
        self._pending = [p for p in self._pending if p is not works]

    def broadcast_checksums(self, crcs: list[int | torch.Tensor], timeout_s: float | None = None,
                            frames: VersionFrames | None = None) -> None:
        """The CRC32C manifest of a version (ints, or 0-dim device tensors left by a device pack
        backend, which stay on the device), to the groups whose receivers verify it: the version's
        last frame (index ``len(crcs)``) where the protocol is framed."""
        if crcs and isinstance(crcs[0], torch.Tensor):
            manifest = torch.stack([c.to(torch.int64) for c in crcs])
        else:
            manifest = self.runtime.upload(torch.tensor(crcs, dtype=torch.int64))
        header = frames.header(len(crcs), manifest) if frames is not None else None
        for protocol, group in self._groups:
            if protocol.checksum_manifest:
                if protocol.framed:
                    assert header is not None, f"the manifest to {protocol.name} receivers needs its frame header"
                    group.broadcast(self.runtime.upload(group.seal.tensor(header)), timeout_s)
                group.broadcast(manifest, timeout_s)

    def close(self, broken: bool = False) -> None:
        self._pending = []
        for _, group in self._groups:
            group.close(broken)
