"""``connect``: from a model and a config to a ``Connection`` (``trainer/connection.py``), on every rank.

    ranks     the trainer's own gloo groups among its ranks (``trainer_ranks: auto``; a world of one)
    servers   rank 0: a ``Fleet`` per group (the data-plane groups, warmed up) and the names each
              server expects; every rank is told which tied names are sent (``TiedNames``)
    plan      rank 0: the buckets and each one's owner rank, checked against every server's layout
              (and, with ``lora: adapter``, the adapter judged and the base sent where it is not served)
    buffers   this rank's ring or snapshots (``trainer/allocate.py``); async mode: the worker
    check     ``verify``: the served check (``trainer/verify.py``); with ``logprobs`` the probe scored by
              the trainer and every server at connect (version 0), with ``auto`` first after a version

A step that fails closes everything the steps before it opened (an ``ExitStack``), and rank 0 tells
the other ranks why, so each raises too; nothing is left open.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from typing import Any

from asyncsync.config import ConfigError, WeightSyncConfig
from asyncsync.control import ControlLoop
from asyncsync.metrics import SyncMetrics
from asyncsync.packing import PackBackend, get_backend
from asyncsync.protocol.device import Runtime, runtime_for
from asyncsync.protocol.specs import LAYOUT_REFUSED, BucketPlan
from asyncsync.ranks import TrainerRankLost, TrainerRanks
from asyncsync.trainer.adapter import Adapter
from asyncsync.trainer.adapter_connect import BaseSend, adapter_of, check_adapter, start_loads
from asyncsync.trainer.allocate import BufferKinds, shared_pool
from asyncsync.trainer.buffers import Baseline
from asyncsync.trainer.connection import Connection
from asyncsync.trainer.delta import keeps_baseline
from asyncsync.trainer.layout import PeftMerge, WeightLayout
from asyncsync.trainer.publishers import Background, Blocking
from asyncsync.trainer.roles import Follower, Leader, Role, tell_ranks
from asyncsync.trainer.shards import balanced_owners
from asyncsync.trainer.source import (
    Convert, TiedNames, Weights, WeightsReader, all_tensors, check_tensors, converted, weights_device,
)
from asyncsync.trainer.streams import StreamSet
from asyncsync.trainer.verify import ServedCheck
from asyncsync.trainer.worker import SyncWorker
from asyncsync.transport.adapters import AdapterLoads
from asyncsync.transport.commands import Failed, Names, Ready
from asyncsync.transport.fleet import Fleet
from asyncsync.transport.follower import FollowingRank
from asyncsync.transport.phases import SLACK_S
from asyncsync.transport.shm import SegmentPool

log = logging.getLogger(__name__)


def connect(config: WeightSyncConfig, model: Weights, convert: Convert | None, metrics: SyncMetrics,
            session: str) -> Connection:
    """Every step of the module doc, on this rank; raises what the first failed step raised."""
    ranks = TrainerRanks.of(config.trainer_ranks, config.deadlines)
    with ExitStack() as opened:
        opened.callback(ranks.close)
        try:
            connection = Connecting(config, ranks, metrics, session, opened).run(model, convert)
        except BaseException as e:
            if ranks.world > 1 and ranks.leader and not isinstance(e, TrainerRankLost):
                tell_ranks(ranks, Failed(f"{type(e).__name__}: {e}"))  # so they raise, not wait
            raise
        opened.pop_all()
    return connection


class Connecting:
    """One ``connect`` on this rank, step by step; what a step opens is registered in ``opened``."""

    def __init__(self, config: WeightSyncConfig, ranks: TrainerRanks, metrics: SyncMetrics, session: str,
                 opened: ExitStack):
        self.config, self.ranks, self.metrics, self.session, self.opened = config, ranks, metrics, session, opened
        self.fleets: list[Fleet] = []  # rank 0's: one for all servers, or one per server (group_per_server)
        self.control: ControlLoop | None = None
        self.following: FollowingRank | None = None  # ranks other than 0
        self.runtime: Runtime | None = None
        self.packer: PackBackend | None = None
        self.base: BaseSend | None = None  # lora: adapter: the base's segments same-host servers serve from

    def run(self, model: Weights, convert: Convert | None) -> Connection:
        cfg, ranks = self.config, self.ranks
        sharded = ranks.world > 1
        if sharded and cfg.group_per_server:
            raise ConfigError("group_per_server: a sharded trainer's ranks send every version together; set it "
                              "to false (or sync from a single process)")
        held = all_tensors(model)
        if convert is None:
            check_tensors(held, sharded)  # no server hears of weights that cannot be sent
        adapter, base = adapter_of(cfg, model, held, convert)
        layout = self._layout(model, held, adapter)
        every = converted(model, convert, layout) if convert is not None else held
        if convert is not None:
            check_tensors(every, sharded)
        self.runtime = runtime_for(weights_device(every))
        self.packer = get_backend(cfg.pack_backend, self.runtime.device)  # before any group: a bad backend fails first
        buckets = -(-sum(t.nbytes for t in every.values()) // cfg.bucket_bytes)  # what fanout: auto plans by
        ties = self._servers(every if convert is not None else model, None if convert else base or layout, buckets)
        if convert is None:
            layout = layout.keeping(ties.drop(held))  # a tied weight's second name is not sent
            base = base.keeping(ties.drop(held)) if base is not None else None
        reader = WeightsReader(ties, sharded, convert, layout)
        self.opened.callback(reader.close)
        kept = layout if convert is None else None  # None: the conversion gives the engines' layout
        named = reader.read(model).tensors()  # this rank's view, read once here
        ready = self._plan(named, kept, adapter, base)
        if adapter is not None:
            assert base is not None
            self._send_base(model, base, ties)
        loads = self._start_loads(adapter)
        connection: Connection  # the check reports into it (its first run is after it is built)
        check = self._check(model, lambda error: connection.report(error))
        role = self._role(ready.plan, check, loads)
        publisher, pool = self._publisher(role, ready.plan, named, ready.owners, ready.delta, kept, reader)
        connection = Connection(ranks, self.runtime, self.packer, reader, kept, ready.plan, role, publisher, check,
                                pool, self.base)
        if check is not None and check.at_connect:
            check.expect(model, 0)
            for f in self.fleets:
                check.run(f, 0, f.member_versions())
        return connection

    def _layout(self, model: Weights, held: dict[str, Any], adapter: Adapter | None) -> WeightLayout:
        """The engines' names of the weights (``trainer/layout.py``); ``lora: adapter``: the adapter's."""
        if adapter is not None:
            return adapter.layout(held)
        layout = WeightLayout.of(model, held, self.config.layout == "checkpoint")
        if self.ranks.world > 1 and any(isinstance(s, PeftMerge) for s in layout.conversion.stages):
            raise ConfigError("a PEFT model on a sharded trainer: asyncsync merges LoRA adapters only in a single "
                              "trainer process; set lora: adapter (the adapter is gathered like any tensor), merge "
                              "them yourself and pass convert=, or sync from one process")
        return layout

    def _servers(self, weights: Weights, layout: WeightLayout | None, buckets: int) -> TiedNames:
        """Rank 0: the data-plane groups with every server, then the names sent (``weights``: the
        module, whose ``layout`` gives the names servers know it by, or the conversion's output),
        which every rank is told. ``buckets``: about how many a version will have."""
        cfg, ranks = self.config, self.ranks
        assert self.runtime is not None
        if not ranks.leader:
            self.following = FollowingRank(ranks, self.runtime)
            self.opened.callback(self.following.drop_group)
            return self.following.until(Names).ties
        self.control = ControlLoop()
        self.opened.callback(self.control.close)
        spread = ranks.world > 1 and not cfg.funnel
        for group in [cfg.replace(servers=(s,)) for s in cfg.servers] if cfg.group_per_server else [cfg]:
            fleet = Fleet.connect(group, self.control, self.metrics, self.runtime, self.session, ranks, spread, buckets)
            self.opened.callback(fleet.close)
            self.fleets.append(fleet)
        told = [names for f in self.fleets for names in f.expected_names()]
        expected = frozenset().union(*told) if told else None
        if expected is not None and layout is not None:
            expected = layout.renamed_sources(expected)
        ties = TiedNames.decide(weights, expected)
        ranks.from_leader(Names(ties))
        return ties

    def _plan(self, named: dict[str, Any], layout: WeightLayout | None, adapter: Adapter | None,
              base: WeightLayout | None) -> Ready:
        """Rank 0 plans the buckets of its view (global shapes), picks each bucket's owner, checks the
        plan (``lora: adapter``: the base's, and the adapter) against every server and decides on
        deltas; every rank is told (``Ready``)."""
        cfg, ranks = self.config, self.ranks
        if not ranks.leader:
            assert self.following is not None
            return self.following.until(Ready)
        single_dtype = any(f.single_dtype_buckets for f in self.fleets)
        if layout is not None:  # the targets of each conversion group together
            whole = ranks.world > 1 and not layout.identity  # each bucket's owner converts whole groups
            plan = BucketPlan.from_groups(layout.target_groups(), cfg.bucket_bytes, single_dtype, whole)
        else:
            plan = BucketPlan.from_tensors(named.items(), cfg.bucket_bytes, single_dtype)
        owners = balanced_owners(plan, self.fleets[0].sources)
        if adapter is None:
            check_layouts(cfg, self.fleets, plan, layout)  # a plan a server would refuse at every version fails here
        else:
            assert base is not None
            check_layouts(cfg, self.fleets, BucketPlan.from_groups(base.target_groups(), cfg.bucket_bytes), base)
            check_adapter(cfg, self.fleets, adapter, plan)
        assert self.packer is not None
        return ranks.from_leader(Ready(plan, owners, keeps_baseline(cfg, self.packer, self.fleets)))

    def _send_base(self, model: Weights, base: WeightLayout, ties: TiedNames) -> None:
        """``lora: adapter``: every rank sends the base where it is not served (``trainer/adapter_connect.py``)."""
        assert self.runtime is not None and self.packer is not None
        self.base = BaseSend(self.config, self.ranks, self.runtime, self.packer)
        self.opened.callback(self.base.close)
        self.base.run(model, base, ties, self.fleets, self.following)

    def _start_loads(self, adapter: Adapter | None) -> AdapterLoads | None:
        if adapter is None or not self.ranks.leader:
            return None
        assert self.control is not None
        loads = start_loads(self.config, self.fleets, adapter, self.session, self.control, self.metrics)
        self.opened.callback(loads.drain, self.config.deadlines.load_s + SLACK_S)
        return loads

    def _check(self, model: Weights, report: Any) -> ServedCheck | None:
        """The served check. In one trainer process it is also due while a server owes it (the books'
        ``owing_check``), and blocking it scores after the apply (``late``); a sharded trainer's ranks
        cannot all read rank 0's books, so there it is due by version numbers only."""
        single, fleets = self.ranks.world == 1, self.fleets

        def owing(since: int) -> bool:  # a server owes a check and took a version after ``since``
            return any(v > since for f in fleets for v in f.book.versions(f.book.owing_check()).values())

        late = single and not self.config.async_weight_update
        try:
            return ServedCheck.of(self.config, model, self.metrics, report, owing if single else None, late)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def _role(self, plan: BucketPlan, check: ServedCheck | None, loads: AdapterLoads | None) -> Role:
        if self.ranks.leader:
            assert self.control is not None
            return Leader(self.ranks, self.config, plan, self.fleets, self.control, check, loads)
        assert self.following is not None
        return Follower(self.ranks, self.config, plan, self.following, lambda: self.metrics.last)

    def _publisher(self, role: Role, plan: BucketPlan, named: dict[str, Any], owners: list[int], delta: bool,
                   layout: WeightLayout | None, reader: WeightsReader
                   ) -> tuple[Blocking | Background, SegmentPool | None]:
        """This rank's buffers (``delta``: with the delta baseline) and what publishes into them: a
        ring blocking, snapshots in the background worker async; and the shared memory, if any."""
        cfg, ranks, runtime, packer = self.config, self.ranks, self.runtime, self.packer
        assert runtime is not None and packer is not None
        pool = shared_pool(self.fleets, plan)  # same-host servers (a single trainer process only)
        if pool is not None:
            self.opened.callback(pool.close)
        if ranks.world > 1:  # every rank's own backend must encode (each picked its own: one may have fallen back)
            delta = ranks.all_agree(delta and packer.encodes_deltas, "send")
        kinds = BufferKinds.of(cfg, ranks, runtime, packer, plan, named, owners, layout, pool, delta)
        if not cfg.async_weight_update:
            shared = (kinds.snapshot(), self.fleets[0]) if pool is not None else None  # a leased segment per version
            single = delta and ranks.world == 1  # the baseline, beside the ring (trainer/delta.py)
            baseline = Baseline(plan, runtime.device, packer, cfg.checksum) if single else None
            return Blocking(role, plan, reader, self.metrics, kinds.ring(), shared, baseline, cfg.lora == "adapter"), pool
        worker = SyncWorker(role.senders(), plan, kinds.snapshot, StreamSet(runtime), self.metrics, ranks, role.lowest,
                            role.checked, role.reachable)
        self.opened.callback(worker.close)
        if isinstance(role, Leader) and role.loads is not None:
            role.loads.on_change = worker.poke  # a load moves the servers' versions (wait_for_fresh_servers)
        return Background(worker, reader), pool


def check_layouts(config: WeightSyncConfig, fleets: list[Fleet], plan: BucketPlan,
                  layout: WeightLayout | None) -> None:
    """Rank 0: ``ConfigError`` when a server says it does not load exactly the plan's tensors (names,
    dtypes, shapes): the first few differences on both sides, and the fix."""
    refused = {url: why for f in fleets for url, why in f.layout_refusals(plan.specs).items()}
    if not refused:
        return
    url, why = next(iter(refused.items()))
    if LAYOUT_REFUSED not in why:
        fix = "this server cannot apply versions of the model it serves (the reason above); serve it elsewhere"
    elif config.layout == "trainer":
        fix = "set layout: checkpoint to send a transformers model as its checkpoint stores it"
    elif layout is not None and layout.identity:
        fix = ("pass convert= to connect() mapping the trainer's names and layouts to those the server loads, or "
               "serve the model the trainer trains (saved with save_pretrained)")
    else:
        fix = ("the trainer's model was converted to its checkpoint layout (layout: checkpoint); serve a checkpoint "
               "saved from this model (save_pretrained), or pass convert= mapping the names to those the server loads")
    raise ConfigError(f"{len(refused)} server(s) would refuse every version: {url}: {why}. Fix: {fix}")
