"""``WeightSync``: the trainer's handle on every inference server (the loop it serves is in README.md).

With ``async_weight_update: false`` ``publish`` sends the version on the caller's thread and returns
once every server applied it (the baseline); with ``true`` a ``SyncWorker`` does the same in the
background and ``publish`` returns at once. Both modes run the same pipeline: the same pack path
(``trainer.buffers``), the same layout policy (``check_layout``) and the same ``send_version``; they
differ in where the bytes are packed from (the live weights into a ring of a few buckets, or a snapshot).

With ``lora: adapter`` a PEFT model's versions are its adapter's tensors only (``trainer/adapter.py``):
``connect`` also has every server judge the adapter and sends the base once where it is not served,
and each version is loaded into every engine under ``<name>-v<N>`` by the control loop
(``transport/adapters.py``), never inside a trainer collective.

A sharded trainer (FSDP2, DTensors on a DeviceMesh) calls every method on every rank, like a
collective (``trainer_ranks: auto``). Rank 0 talks to the servers and plans; every rank sends the
buckets it owns (``trainer.shards``: the owner gathers that bucket's pieces from the other ranks),
so no rank holds the whole model; with ``funnel: true`` rank 0 owns every bucket, for comparison.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch

from asyncsync.checkpoint import LayoutError
from asyncsync.config import ConfigError, WeightSyncConfig
from asyncsync.metrics import SyncEvent, SyncMetrics, SyncResult
from asyncsync.packing import PackBackend, get_backend
from asyncsync.protocol.device import Runtime, runtime_for
from asyncsync.protocol.lora import AdapterCheck, BaseCheck, tensor_crc, version_name
from asyncsync.protocol.specs import LAYOUT_REFUSED, BucketPlan
from asyncsync.ranks import TrainerRankLost, TrainerRanks
from asyncsync.trainer.adapter import Adapter
from asyncsync.trainer.buffers import Baseline, Prepacked, Ring, SharedSnapshot, Snapshot
from asyncsync.trainer.delta import EncodeAhead, keeps_baseline
from asyncsync.trainer.layout import PeftMerge, WeightLayout
from asyncsync.trainer.shards import Encoded, ShardedBuffers, ShardLayout, SourcePlan, balanced_owners, sources
from asyncsync.trainer.source import (Convert, TiedNames, Weights, WeightsReader, all_tensors, check_tensors, converted,
                                      weights_device)
from asyncsync.trainer.streams import StreamSet
from asyncsync.trainer.verify import ServedCheck
from asyncsync.trainer.worker import Sender, SyncWorker
from asyncsync.transport.adapters import AdapterLoads
from asyncsync.control import ControlLoop
from asyncsync.transport.commands import BaseVersion, Command, Failed, Loading, Names, PackAhead, Ready, Stop
from asyncsync.transport.follower import Follower, Stopped
from asyncsync.transport.membership import Membership, lowest_member_version, new_session
from asyncsync.transport.datapath import follow_version
from asyncsync.transport.send import SLACK_S, send_version
from asyncsync.transport.sources import BucketSource
from asyncsync.transport.shm import SegmentPool

log = logging.getLogger(__name__)

R = TypeVar("R")
LOAD_ROUND_S = 0.5  # a blocking publish waits for adapter loads in rounds this long, every rank told after each


class WeightSync:
    """Plans, packs and broadcasts versions of a model's weights to the configured servers.

    Contract: ``connect`` once, then ``wait_snapshot`` before changing parameters and ``publish``
    after; ``close`` drains. A server's failure never raises out of these calls: it is reported in
    the ``SyncResult`` (blocking), ``events`` and the metrics. What raises is a mistake of the caller:
    publishing before ``connect``, a version that is not newer, weights that are not a module or a
    mapping of tensors, sharded weights in a single process (``ShardedWeightsUnsupported``), another
    trainer rank gone (``TrainerRankLost``: close the sync), and, where the version is
    read (``connect``, a blocking ``publish``; async mode records it in ``errors``), a tensor that
    cannot be packed (``UnpackableTensor``) or a layout that changed since ``connect`` (``LayoutChanged``).
    Every such error names the tensor and says what to do; none reaches a compiled pack."""

    def __init__(self, config: WeightSyncConfig):
        if not config.servers:
            raise ValueError("weight_sync.servers is empty: list at least one server URL to sync to")
        self.config = config
        self.metrics = SyncMetrics()
        self.plan: BucketPlan | None = None
        self._control: ControlLoop | None = None
        self._members: list[Membership] = []  # one for all servers, or one per server (group_per_server)
        self._packer: PackBackend | None = None
        self._worker: SyncWorker | None = None
        self._ring: Ring | ShardedBuffers | None = None
        self._pool: SegmentPool | None = None      # shared memory for same-host servers (transport/shm.py)
        self._shared: SharedSnapshot | None = None  # blocking mode's buffers in it
        self._baseline: Baseline | None = None  # blocking mode's delta baseline (trainer/delta.py)
        self._ahead = EncodeAhead()
        self._reader = WeightsReader()
        self.layout: WeightLayout | None = None  # the engines' layout of the weights (None: convert= gives it)
        self.ranks = TrainerRanks()  # this process's place among a sharded trainer's ranks (a world of one)
        self._follower: Follower | None = None  # ranks other than 0 follow rank 0's plans
        self._lost: str | None = None  # why another trainer rank is gone (blocking mode)
        self._connected = False  # from the plan agreed in connect() to close()
        self.runtime: Runtime | None = None
        self._last_version = 0
        self._versions_at_close: dict[str, int] = {}
        self._errors: list[str] = []  # blocking mode's (a failed check), and async mode's after close
        self._check: ServedCheck | None = None  # verify: logprobs (trainer/verify.py)
        self._loads: AdapterLoads | None = None  # lora: adapter: rank 0's loads of each version into the engines
        self._base_pools: list[SegmentPool] = []  # the base's segments same-host servers serve from (lora: adapter)
        self.session = new_session()  # the trainer session that owns the servers from connect() to close()

    @classmethod
    def from_config(cls, config: WeightSyncConfig | Mapping[str, Any] | str | Path) -> WeightSync:
        if isinstance(config, WeightSyncConfig):
            return cls(config)
        if isinstance(config, Mapping):
            return cls(WeightSyncConfig.from_dict(dict(config)))
        return cls(WeightSyncConfig.from_yaml(config))

    @property
    def is_async(self) -> bool:
        return self.config.async_weight_update

    @property
    def pack_backend(self) -> str:
        return self._packer.name if self._packer else "unconnected"

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the sync's own buffers on the weights' device (a ring of buckets blocking, and the
        delta baseline; snapshots async; the shared-memory segments same-host servers map)."""
        shared = self._pool.allocated if self._pool is not None else 0
        if self._worker is not None:
            return self._worker.nbytes + shared
        return sum(b.nbytes for b in (self._ring, self._baseline) if b is not None) + shared

    @property
    def conversion_bytes(self) -> int:
        """The most bytes converting to the engines' layout allocates at once while a version is
        packed (``trainer/layout.py``: copies such as fused experts' gate/up split), on the weights' device."""
        return self.layout.scratch_bytes(self.plan) if self.layout is not None and self.plan is not None else 0

    @property
    def host_buffer_bytes(self) -> int:
        """Bytes of the sync's own buffers in host memory (a snapshot with ``snapshot: host``)."""
        return self._worker.host_nbytes if self._worker is not None else 0

    @property
    def baseline_bytes(self) -> int:
        """Bytes of the buffers that hold the delta baseline (part of ``buffer_bytes``): async mode's
        snapshots themselves, blocking mode's one whole-version set beside the ring, a sharded
        trainer's rank the buckets it owns; 0 without deltas."""
        if self._worker is not None:
            return self._worker.baseline_nbytes
        return sum(b.baseline_nbytes for b in (self._ring, self._baseline) if b is not None)

    def connect(self, model: Weights, convert: Convert | None = None) -> None:
        """Pick the pack backend, build the data-plane groups with every server (warmed up), decide
        which names are sent (a tied weight once, unless a server expects it twice: ``TiedNames``),
        plan the buckets and allocate the buffers; in async mode start the worker. On failure nothing
        is left open. Pass the module, not a copy of its state dict, so that its ties are known: later
        versions may then be published either way.

        ``convert``, when given, maps the trainer's (name, tensor) view to the names and layouts the
        servers load (fused qkv to q/k/v, ``_orig_mod.`` prefixes): it runs at connect and at every
        publish, on the caller's thread, and nothing it builds is kept (docs/sharded.md).

        A sharded trainer calls this on every rank (``trainer_ranks: auto``): the sync's own gloo
        groups among the ranks are created here, then rank 0 connects the servers and sends every
        rank the plan and each bucket's owner."""
        cfg = self.config
        self.ranks = ranks = TrainerRanks.of(cfg.trainer_ranks, cfg.deadlines)
        sharded = ranks.world > 1
        try:
            if sharded and cfg.group_per_server:
                raise ConfigError("group_per_server: a sharded trainer's ranks send every version together; set it "
                                  "to false (or sync from a single process)")
            held = all_tensors(model)
            if convert is None:
                check_tensors(held, sharded)  # no server hears of weights that cannot be sent
            adapter, base = self._adapter_of(model, held, convert)
            # the engines' names (trainer/layout.py); lora: adapter sends the adapter's (trainer/adapter.py)
            layout = WeightLayout.of(model, held, cfg.layout == "checkpoint") if adapter is None else adapter.layout(held)
            if sharded and not layout.identity and any(isinstance(s, PeftMerge) for s in layout.conversion.stages):
                raise ConfigError("a PEFT model on a sharded trainer: asyncsync merges LoRA adapters only in a single "
                                  "trainer process; set lora: adapter (the adapter is gathered like any tensor), merge "
                                  "them yourself and pass convert=, or sync from one process")
            every = converted(model, convert, layout) if convert is not None else held
            if convert is not None:
                check_tensors(every, sharded)
            self.runtime = runtime = runtime_for(weights_device(every))
            self._packer = get_backend(cfg.pack_backend, runtime.device)  # before any group: a bad backend fails first
            if ranks.leader:
                ties = self._connect_servers(every if convert is not None else model, None if convert else base or layout)
            else:
                self._follower = Follower(ranks, runtime)
                ties = self._follower.until(Names).ties
            if convert is None:
                layout = layout.keeping(ties.drop(held))  # a tied weight's second name is not sent
                base = base.keeping(ties.drop(held)) if base is not None else None
            self._reader.close()
            self._reader = WeightsReader(ties, sharded, convert, layout)
            self.layout = layout if convert is None else None
            named = self._reader.read(model).tensors()  # this rank's view, read once here
            if ranks.leader:
                plan, owners = self._plan(named)
                if adapter is None:
                    self._check_layouts(plan)  # a plan a server would refuse at every version fails here
                else:
                    assert base is not None
                    self._check_layouts(BucketPlan.from_groups(base.target_groups(), cfg.bucket_bytes))  # the base's
                    self._check_adapter(adapter, plan)
                    self._send_base(model, base)
                delta = keeps_baseline(cfg, self._packer, self._members)
                ranks.from_leader(Ready(plan, owners, delta))
            else:
                if adapter is not None:
                    assert base is not None
                    self._send_base(model, base)
                ready = self._follower.until(Ready)
                plan, owners, delta = ready.plan, ready.owners, ready.delta
            self.plan, self._connected = plan, True
            if adapter is not None:
                self._start_loads(adapter)
            self._allocate(plan, named, owners, delta)
            self._start_check(model)
        except BaseException as e:
            if sharded and ranks.leader and not isinstance(e, TrainerRankLost):
                self._tell_followers(Failed(f"{type(e).__name__}: {e}"))
            self._connected = False
            self.close()
            raise
        self.metrics.allocated(self.buffer_bytes, self.host_buffer_bytes, self.conversion_bytes, self.baseline_bytes)
        staging = {e.url: e.staging_bytes(plan.total_bytes, m.server_ranks[e.url])  # rank 0's members
                   for m in self._members for e in m.engines if e.url in m.server_ranks}
        self.metrics.staging({u: n for u, n in staging.items() if n is not None})
        log.info("connected: %s mode, rank %d of %d, pack backend %s, %d bucket(s), %.1f MB of sync buffers on the "
                 "weights' device, %.1f MB in host memory", "async" if self.is_async else "blocking", ranks.rank,
                 ranks.world, self._packer.name, len(plan.buckets), self.buffer_bytes / 1e6, self.host_buffer_bytes / 1e6)

    def _start_check(self, model: Weights) -> None:
        """``verify: logprobs``: the check, and its first run, on what the servers serve at connect
        (every rank scores the probe; rank 0 asks the servers)."""
        try:
            self._check = ServedCheck.of(self.config, model, self.metrics, self._report)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self._check is not None:
            self._check.expect(model, 0)
            for m in self._members:
                self._check.run(m, 0, m.member_versions())

    def _checked(self, members: Membership, result: SyncResult) -> SyncResult:
        """Rank 0, once ``result``'s version is live: the check, where it is due (``trainer/verify.py``)."""
        if self._check is not None:
            self._check.run(members, result.version,
                            {u: v for u, v in result.server_versions.items() if v == result.version})
        return result

    def _report(self, error: str) -> None:
        if self._worker is not None:
            self._worker.report(error)
        else:
            self._errors.append(error)

    def _adapter_of(self, model: Weights, held: dict[str, Any], convert: Convert | None
                    ) -> tuple[Adapter | None, WeightLayout | None]:
        """``lora: adapter``: the model's active adapter and the layout of its base; (None, None) otherwise."""
        if self.config.lora != "adapter":
            return None, None
        if convert is not None or not isinstance(model, torch.nn.Module):
            raise ConfigError("lora: adapter sends a peft.PeftModel's adapter: pass the PEFT model itself to connect(), "
                              "without convert=")
        try:
            return Adapter.of(model, held), WeightLayout.of(model, held, True, base_only=True)
        except LayoutError as e:
            raise ConfigError(str(e)) from None

    def _check_adapter(self, adapter: Adapter, plan: BucketPlan) -> None:
        """Rank 0: raise ``ConfigError`` unless every server can serve the adapter (``check_adapter``:
        LoRA enabled, its rank, its targets, the versions held at once), before anything is sent."""
        cfg = self.config
        check = AdapterCheck(cfg.lora_name, adapter.config, plan.specs, cfg.max_staleness + 2)
        refused = {url: why for m in self._members for url, why in m.refusals(lambda e: e.check_adapter(check),
                                                                             "check_adapter").items()}
        if refused:
            url, why = next(iter(refused.items()))
            raise ConfigError(f"{len(refused)} server(s) cannot serve the adapter (lora: adapter): {url}: {why}")

    def _send_base(self, model: Weights, base: WeightLayout) -> None:
        """Every rank, at connect (``lora: adapter``): the base, as one version, to each group holding
        a server that does not serve it (a sharded trainer cannot fingerprint its shards: its servers
        always get it); ``ConfigError`` when a server refuses it."""
        cfg, ranks = self.config, self.ranks
        reader = WeightsReader(self._reader.ties, ranks.world > 1, None, base)
        try:
            named = reader.read(model).tensors()
        finally:
            reader.close()
        if ranks.leader:
            plan = BucketPlan.from_groups(base.target_groups(), cfg.bucket_bytes,
                                          any(m.single_dtype_buckets for m in self._members), ranks.world > 1)
            sources = self._members[0].sources
            owners = balanced_owners(plan, sources) if sources > 1 else [0] * len(plan.buckets)
            todo = self._without_base(named)
            version = 1 + max((v for m in todo for v in m.member_versions().values()), default=0)
            setup = (version, plan, owners) if todo else None
            ranks.from_leader(BaseVersion(setup))
        else:
            assert self._follower is not None
            setup = self._follower.until(BaseVersion).setup
        if setup is None:
            return
        version, plan, owners = setup
        ring, _ = self._buffers(plan, named, owners, "device", layout=base)
        if not ranks.leader:
            follow_version(self._follower, plan, ring().packing(named), cfg.checksum)
            return
        for m in todo:
            log.info("sending the base (%.1f MB) as version %d to %s", plan.total_bytes / 1e6, version,
                     [e.url for e in m.members])
            result = send_version(m, version, plan, self._base_source(m, plan, named, ring))
            if result.failures:
                url, why = next(iter(result.failures.items()))
                raise ConfigError(f"the base (lora: adapter) could not be sent to {url}: {why}")

    def _without_base(self, named: Any) -> list[Membership]:
        """Rank 0: the memberships with a server that does not serve the base ``named`` (each server
        compares CRC32Cs; a sharded trainer's servers are all sent it)."""
        if self.ranks.world > 1:
            return list(self._members)
        check = BaseCheck(tuple((n, tensor_crc(t)) for n, t in named.items()))
        todo = []
        for m in self._members:
            answers = m.call_all(m.members, lambda e: e.serves_base(check), "serves_base")
            unknown = [u for u, a in answers.items() if a is None]
            if unknown:
                log.warning("%s cannot tell which base they serve: the adapter is applied to what they serve", unknown)
            if any(a is False or isinstance(a, BaseException) for a in answers.values()):
                todo.append(m)
        return todo

    def _base_source(self, members: Membership, plan: BucketPlan, named: Any, ring: Any) -> BucketSource:
        """Where the base is sent from: a ring packed from the live weights, or, with a server on
        shared memory, a segment it then serves from (kept until ``close``)."""
        if not members.shared:
            return ring().packing(named)
        assert self.runtime is not None and self._packer is not None
        pool = SegmentPool([b.nbytes for b in plan.buckets])
        self._base_pools.append(pool)
        members.pool = pool
        buffers = SharedSnapshot(plan, self.runtime.device, self._packer, self.config.checksum, pool)
        buffers.pack_all(named)
        return buffers.packed()

    def _start_loads(self, adapter: Adapter) -> None:
        """Rank 0: the servers' versions become the adapter's (those they already serve are adopted,
        and unloaded like this session's once they fall behind)."""
        if not self.ranks.leader:
            return
        cfg = self.config
        assert self._control is not None
        self._loads = loads = AdapterLoads(cfg.lora_name, adapter.config, self.session, cfg.max_staleness,
                                           self._control, self.metrics, cfg.deadlines.load_s)
        for m in self._members:
            m.adapter = cfg.lora_name
            served = m.call_all(m.members, lambda e: e.adapter_versions(cfg.lora_name), "adapter_versions")
            for url, versions in served.items():
                listed = versions if isinstance(versions, list) else []
                loads.adopt(url, listed)
                m.server_versions[url] = max(listed, default=0)

    def adapter_name(self, version: int) -> str:
        """The name version ``version`` of the adapter is served under (``lora: adapter``): pass it to
        a generation request (``EngineClient.generate(..., adapter=)``) to be served that version."""
        return version_name(self.config.lora_name, version)

    def _connect_servers(self, weights: Weights, layout: WeightLayout | None) -> TiedNames:
        """Rank 0 (or the single process): the data-plane groups with every server, then the names
        sent (``weights``: the module, whose ``layout`` gives the names servers know it by, or the
        conversion's output), which every rank is told."""
        cfg, ranks = self.config, self.ranks
        self._control = ControlLoop()
        groups = [cfg.replace(servers=(s,)) for s in cfg.servers] if cfg.group_per_server else [cfg]
        spread = ranks.world > 1 and not cfg.funnel
        for group_cfg in groups:
            self._members.append(Membership.connect(group_cfg, self._control, self.metrics, self.runtime, self.session,
                                                    ranks, spread))
        told = [names for m in self._members for names in m.expected_names()]
        expected = frozenset().union(*told) if told else None
        if expected is not None and layout is not None:
            expected = layout.renamed_sources(expected)
        ties = TiedNames.decide(weights, expected)
        ranks.from_leader(Names(ties))
        return ties

    def _check_layouts(self, plan: BucketPlan) -> None:
        """Rank 0: raise ``ConfigError`` when a server says it does not load exactly the plan's
        tensors (names, dtypes, shapes): the first few differences on both sides, and the fix."""
        refused = {url: why for m in self._members for url, why in m.layout_refusals(plan.specs).items()}
        if not refused:
            return
        url, why = next(iter(refused.items()))
        if LAYOUT_REFUSED not in why:
            fix = "this server cannot apply versions of the model it serves (the reason above); serve it elsewhere"
        elif self.config.layout == "trainer":
            fix = "set layout: checkpoint to send a transformers model as its checkpoint stores it"
        elif self.layout is not None and self.layout.identity:
            fix = ("pass convert= to connect() mapping the trainer's names and layouts to those the server loads, or "
                   "serve the model the trainer trains (saved with save_pretrained)")
        else:
            fix = ("the trainer's model was converted to its checkpoint layout (layout: checkpoint); serve a checkpoint "
                   "saved from this model (save_pretrained), or pass convert= mapping the names to those the server loads")
        raise ConfigError(f"{len(refused)} server(s) would refuse every version: {url}: {why}. Fix: {fix}")

    def _plan(self, named: dict[str, Any]) -> tuple[BucketPlan, list[int]]:
        """Rank 0: the bucket plan of its view (global shapes), and each bucket's owner rank."""
        single_dtype = any(m.single_dtype_buckets for m in self._members)
        if self.layout is not None:  # the targets of each conversion group together
            whole = self.ranks.world > 1 and not self.layout.identity  # each bucket's owner converts whole groups
            plan = BucketPlan.from_groups(self.layout.target_groups(), self.config.bucket_bytes, single_dtype, whole)
        else:
            plan = BucketPlan.from_tensors(named.items(), self.config.bucket_bytes, single_dtype)
        sources = self._members[0].sources
        return plan, balanced_owners(plan, sources) if sources > 1 else [0] * len(plan.buckets)

    def _buffers(self, plan: BucketPlan, named: dict[str, Any], owners: list[int], snapshot: str,
                 pool: SegmentPool | None = None, layout: WeightLayout | None = None,
                 delta: bool = False) -> tuple[Any, Any]:
        """Factories of this rank's blocking ring and of one async snapshot (``snapshot``: device or
        host; with a ``pool``, a version-sized snapshot in its shared memory, which is host memory)
        of ``plan`` in ``layout`` (default: the versions'). With ``delta``, the snapshot is or keeps
        the delta baseline (a device snapshot), and so does a sharded trainer's ring (a single
        process keeps blocking mode's baseline beside its ring: ``_allocate``)."""
        cfg, ranks, runtime, packer = self.config, self.ranks, self.runtime, self._packer
        assert runtime is not None and packer is not None
        if ranks.world > 1 or (snapshot == "host" and pool is None):
            weights = layout or self.layout
            converts = weights is not None and not weights.identity
            assembled = plan if not converts else SourcePlan(tuple(weights.source_bucket(b) for b in plan.buckets))
            layout = ShardLayout.of(assembled, sources(named), ranks.world, owners)
            conversion = weights.conversion if converts else None
            # A sharded rank's baseline (its owned buckets) is on the weights' device: not with a host
            # snapshot, which is there to keep device memory free (nor for a single process's).
            encoder = packer if delta and ranks.world > 1 else None
            return (lambda: ShardedBuffers(plan, layout, ranks, runtime, cfg.checksum, None, conversion, encoder),
                    lambda: ShardedBuffers(plan, layout, ranks, runtime, cfg.checksum, snapshot, conversion,
                                           encoder if snapshot == "device" else None))
        if pool is not None:
            snapshot_kind = lambda: SharedSnapshot(plan, runtime.device, packer, cfg.checksum, pool)  # noqa: E731
        elif delta:
            snapshot_kind = lambda: Baseline(plan, runtime.device, packer, cfg.checksum)  # noqa: E731
        else:
            snapshot_kind = lambda: Snapshot(plan, runtime.device, packer, cfg.checksum)  # noqa: E731
        return lambda: Ring(plan, runtime.device, packer, cfg.checksum), snapshot_kind

    def _allocate(self, plan: BucketPlan, named: dict[str, Any], owners: list[int], delta: bool) -> None:
        """The buffers of this rank (a ring blocking, a snapshot async; ``delta``: with the delta
        baseline) and, async, the worker."""
        self._pool = shared_pool(self._members, plan)  # same-host servers (a single trainer process only)
        assert self._packer is not None
        if self.ranks.world > 1:  # every rank's own backend must encode (each picked its own: one may have fallen back)
            delta = self.ranks.all_agree(delta and self._packer.encodes_deltas, "send")
        ring, snapshot = self._buffers(plan, named, owners, self.config.snapshot, self._pool, delta=delta)
        if not self.is_async:
            self._ring = ring()
            self._shared = snapshot() if self._pool is not None else None  # every version packed into a leased segment
            if delta and self.ranks.world == 1:  # the baseline, beside the ring (trainer/delta.py)
                self._baseline = Baseline(plan, self.runtime.device, self._packer, self.config.checksum)
            return
        if self.ranks.leader:
            senders: list[Sender] = [lambda v, src, res, m=m: self._checked(m, send_version(m, v, plan, src, res,
                                                                                          self._loads))
                                     for m in self._members]
            served = lambda needed: lowest_member_version(self._members, needed)  # noqa: E731
            reachable = lambda: any(m.reachable() for m in self._members)  # noqa: E731
        else:
            senders = [lambda v, src, res: self._follow(v, src) or res]
            served = lambda needed: min(self.server_versions.values(), default=needed)  # noqa: E731
            reachable = lambda: True  # noqa: E731
        assert self.runtime is not None
        self._worker = SyncWorker(senders, plan, snapshot, StreamSet(self.runtime), self.metrics, self.ranks, served,
                                  reachable)
        if self._loads is not None:
            self._loads.on_change = self._worker.poke  # a load moves the servers' versions (wait_for_fresh_servers)

    def memory(self, model: Weights) -> dict[str, dict[str, int]]:
        """The bytes a single trainer process's sync allocates for ``model`` in each mode (blocking,
        async with the snapshot on the device, async with it in host memory), on the weights' device
        and in host memory, as ``connect`` would allocate them (tied weights once), without any server;
        ``conversion``: the most a version's conversion to the engines' layout allocates at once.
        The buffers are allocated to be measured, then released (``asyncsync doctor`` prints this)."""
        cfg = self.config
        held, ties = all_tensors(model), TiedNames.decide(model, None)
        self.layout = layout = WeightLayout.of(model, held, cfg.layout == "checkpoint").keeping(ties.drop(held))
        named = WeightsReader(ties, layout=layout).read(model).tensors()
        self.runtime = runtime_for(weights_device(held))
        self._packer = get_backend(cfg.pack_backend, self.runtime.device)
        plan = BucketPlan.from_groups(layout.target_groups(), cfg.bucket_bytes)
        owners = [0] * len(plan.buckets)
        out = {}
        for mode, snapshot in (("blocking", None), ("async_device", "device"), ("async_host", "host")):
            ring, snap = self._buffers(plan, named, owners, snapshot or "device")
            buffers = ring() if snapshot is None else snap()
            out[mode] = {"device": buffers.nbytes, "host": buffers.host_nbytes, "conversion": layout.scratch_bytes(plan)}
            del buffers
        if cfg.delta == "auto" and cfg.checksum and self._packer.encodes_deltas:
            # async mode's baseline is its snapshot; blocking mode keeps a whole version beside its ring
            out["blocking_delta"] = {**out["blocking"], "device": out["blocking"]["device"] + plan.total_bytes}
        return out

    def _follow(self, version: int, source: Any) -> SyncResult | None:
        assert self._follower is not None and self.plan is not None
        return follow_version(self._follower, self.plan, source, self.config.checksum)

    def _tell_followers(self, command: Command) -> None:
        """Rank 0: a last word to the other ranks (connect failed, close); a lost rank is only logged."""
        try:
            self.ranks.from_leader(command)
        except TrainerRankLost as e:
            log.warning("%s", e)

    # -- the step boundary ----------------------------------------------------------------------

    def wait_snapshot(self) -> None:
        """Return once parameters may be changed: async mode waits for the snapshot copy of the last
        published version (a stream-side wait on CUDA); blocking mode has nothing to wait for."""
        if self._worker is not None:
            self._worker.wait_snapshot()

    def publish(self, model: Weights, version: int) -> SyncResult | None:
        """Hand ``version`` of ``model``'s weights to the servers.

        Async mode: O(1), returns None; the sync happens in the background. Blocking mode: returns
        the ``SyncResult`` once every server applied ``version`` or failed to; ``result.failures`` and
        ``events`` say which server missed it and why."""
        if not self._connected:
            raise RuntimeError("call WeightSync.connect(model) before publish()")
        if self._check is not None:
            self._check.expect(model, version)  # a forward of the probe, when the check is due
        if self._worker is not None:
            self._worker.publish(self._reader.read(model), version)  # the view is read here, on the trainer's thread
            return None
        if self._lost is not None:
            raise TrainerRankLost(self._lost)
        if version <= self._last_version:
            raise ValueError(f"version {version} is not newer than the last published {self._last_version}")
        assert self._ring is not None and self.plan is not None
        named = self._reader.read(model).tensors()
        result = SyncResult(version, self.plan.total_bytes, len(self.plan.buckets))
        try:
            source, packed_s = self._blocking_source(named, result)  # raises before anything is sent
        except TrainerRankLost as e:  # a sharded trainer's ranks encode together
            self._lost = str(e)
            raise
        self._last_version = version
        self.metrics.count("published")
        try:
            if self.ranks.leader:  # blocking mode has one membership
                result = self._checked(self._members[0], send_version(self._members[0], version, self.plan, source,
                                                                       result, self._loads))
                if self._loads is not None:
                    self._await_loads(result)
            else:
                followed = self._follow(version, source)
                if followed is not None and self.config.lora == "adapter":
                    self._await_loads(followed)
                result = followed or result
        except TrainerRankLost as e:
            self._lost = str(e)
            raise
        result.pack_s += packed_s
        self.metrics.record(result)
        self.metrics.count("sent" if result.server_versions else "failed")
        return result

    def _await_loads(self, result: SyncResult) -> None:
        """Blocking mode, ``lora: adapter``: return once every server that wrote ``result``'s version
        loaded it or failed to (``result`` then says which). Rank 0 waits in rounds of
        ``LOAD_ROUND_S`` and tells every other rank after each whether the loads are over, so each
        collective is answered within a round however long an engine takes: none waits on a load."""
        if not self.ranks.leader:
            assert self._follower is not None
            while not self._follower.until(Loading).over:
                pass
            return
        assert self._loads is not None
        urls = list(result.server_versions)
        give_up = time.monotonic() + self.config.deadlines.load_s * 2 + SLACK_S  # the loads' own deadlines end them first
        t0 = time.perf_counter()
        while True:
            outcome = self._loads.wait(result.version, urls, LOAD_ROUND_S)
            over = outcome is not None or time.monotonic() > give_up
            self.ranks.from_leader(Loading(over))
            if over:
                break
        outcome = outcome or {u: f"{self.adapter_name(result.version)}: no load ended in time" for u in urls}
        result.server_versions = {u: v for u, v in outcome.items() if isinstance(v, int)}
        result.failures.update({u: v for u, v in outcome.items() if isinstance(v, str)})
        result.apply_s += time.perf_counter() - t0
        result.finished = time.perf_counter()
        result.total_s = result.finished - result.started

    def _blocking_source(self, named: dict[str, Any], result: SyncResult) -> tuple[BucketSource, float]:
        """Blocking mode's buckets and the seconds packed ahead: with a server on shared memory, the
        whole version packed into a leased segment before any server is told (they map it); else a
        ring, each bucket packed from the live weights just before its broadcast."""
        assert self._ring is not None
        members = self._members[0] if self._members else None  # rank 0's (a sharded trainer has no pool)
        if self._shared is not None and members is not None:
            members.readmit()  # before choosing the buffers: a readmitted server may be on shared memory
            if members.shared:
                result.started = t0 = time.perf_counter()
                self._shared.pack_all(named)
                return self._shared.packed(), time.perf_counter() - t0
        encodes = self._baseline is not None or (isinstance(self._ring, ShardedBuffers) and self._ring.delta)  # a sharded ring keeps its own
        if encodes and self._encode_ahead():
            result.started = t0 = time.perf_counter()
            source: Prepacked | Encoded
            if self._baseline is not None:
                self._baseline.pack_all(named, result.version)  # encoded against the last version packed into it
                source = self._baseline.packed()
            else:
                source = self._ring.encoding(named, result.version)  # a sharded trainer's owners encode theirs
            self._ahead.encoded(self.plan, source.delta_nbytes())
            return source, time.perf_counter() - t0
        return self._ring.packing(named), 0.0

    def _encode_ahead(self) -> bool:
        """Blocking mode: whether this version is encoded ahead (``EncodeAhead``): rank 0 decides,
        and a sharded trainer's other ranks hear it from rank 0, so every rank packs alike."""
        if self.ranks.leader:
            return self.ranks.from_leader(PackAhead(self._ahead.ahead())).ahead
        assert self._follower is not None
        return self._follower.until(PackAhead).ahead

    # -- versions and staleness -----------------------------------------------------------------

    @property
    def server_versions(self) -> dict[str, int]:
        """The version each server serves, as last reported by the server (kept after close()); on a
        sharded trainer's other ranks, as rank 0 last told them."""
        versions = dict(self._versions_at_close)
        if self._follower is not None and self.metrics.last is not None:
            versions.update(self.metrics.last.server_versions)
        for m in self._members:
            versions.update(m.server_versions)
        return versions

    def is_fresh(self, rollout_version: int, trainer_version: int) -> bool:
        """True when a rollout generated with ``rollout_version`` is within ``max_staleness``."""
        return trainer_version - rollout_version <= self.config.max_staleness

    def filter_fresh(self, rollouts: Iterable[R], version_of: Callable[[R], int], trainer_version: int) -> tuple[list[R], int]:
        """Keep the rollouts within ``max_staleness``; returns (kept, number dropped)."""
        every = list(rollouts)
        kept = [r for r in every if self.is_fresh(version_of(r), trainer_version)]
        return kept, len(every) - len(kept)

    def wait_for_fresh_servers(self, trainer_version: int, timeout: float | None = None) -> bool:
        """Wait until every server is within ``max_staleness`` of ``trainer_version`` (async mode);
        rollouts generated afterwards are fresh enough. False on timeout, and as soon as no server
        can get there (every one evicted, or refusing this plan's layout: ``errors`` says why)."""
        needed = trainer_version - self.config.max_staleness
        if self._worker is None:
            return lowest_member_version(self._members, needed) >= needed
        return self._worker.wait_served(needed, timeout)

    @property
    def events(self) -> list[SyncEvent]:
        """Evictions, rejoins and refused versions, oldest first."""
        return list(self.metrics.events)

    @property
    def errors(self) -> list[str]:
        """Versions the background worker could not send for a reason on the trainer's side (a layout
        that changed, an exception in a sender), oldest first. Servers' failures are in ``events``;
        blocking mode raises trainer-side problems from ``publish`` instead. Kept after ``close``."""
        return self._worker.errors if self._worker else list(self._errors)

    def prometheus_text(self) -> str:
        return self.metrics.prometheus_text()

    # -- tear-down ------------------------------------------------------------------------------

    def close(self) -> None:
        """Drain (async: the last published version reaches every server), then release everything."""
        lost = self._lost
        if self._worker is not None:
            self._worker.close()
            self._errors = self._worker.errors
            if self._errors:
                log.error("%d version(s) could not be sent (sync.errors): the last: %s", len(self._errors),
                          self._errors[-1])
            lost = lost or self._worker.lost
            self._worker = None
        if self._connected and self.ranks.world > 1 and lost is None:  # connected: the ranks part together
            if self.ranks.leader:
                self._tell_followers(Stop())
            else:
                self._await_stop()
        if self._loads is not None:  # after the other ranks were let go: the last version's loads end
            self._loads.drain(self.config.deadlines.load_s + SLACK_S)
            self._loads = None
        self._versions_at_close.update(self.server_versions)
        for m in self._members:
            m.close()
        self._members = []
        if self._control is not None:
            self._control.close()
            self._control = None
        self._ring = self._shared = self._baseline = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        for pool in self._base_pools:
            pool.close()
        self._base_pools = []
        self._reader.close()
        if self._follower is not None:
            self._follower.drop_group()
            self._follower = None
        self.ranks.close()
        self._connected = False

    def _await_stop(self) -> None:
        assert self._follower is not None
        try:
            self._follower.until(Stop)
        except Stopped:
            pass
        except TrainerRankLost as e:
            log.warning("%s", e)

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def shared_pool(memberships: list[Membership], plan: BucketPlan) -> SegmentPool | None:
    """The shared-memory segments versions are packed into when a server maps them (``transport``),
    known to every membership so it can track what its servers hold; None when no server is on
    shared memory."""
    if not any(m.shared for m in memberships):
        return None
    pool = SegmentPool([b.nbytes for b in plan.buckets])
    for m in memberships:
        m.pool = pool
    return pool
