"""Sending one version to every server: the HTTP fan-out around the data-plane broadcasts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import torch

from asyncsync.config import WeightSyncConfig
from asyncsync.control import ControlLoop, ServerError
from asyncsync.engines import EngineClient, make_engine
from asyncsync.dataplane import DataPlaneError
from asyncsync.metrics import SyncMetrics, SyncResult
from asyncsync.plan import Bucket, BucketPlan
from asyncsync.topology import GroupLayout, TrainerGroups
from asyncsync.wire import BucketMeta, UpdateRequest

log = logging.getLogger(__name__)

BufferFor = Callable[[Bucket], tuple[torch.Tensor, int | None]]


class SyncError(RuntimeError):
    """No server could be reached at all; the message lists each server's failure."""


class Transfer:
    """The trainer's side of the data plane and the control plane, for every configured server.

    Lifecycle::

        transfer = Transfer.connect(config, metrics)  # world sizes, then the groups, eager and warmed
        for version in versions:
            transfer.send(version, plan, buffer_for)  # HTTP update in flight while buckets broadcast
        transfer.close()

    ``send`` posts each server's ``update`` before the first broadcast and awaits it only after the
    last one, under the HTTP deadline: no collective ever waits on an HTTP answer.

    Faults never raise out of ``send``; they are events. A server that gives no answer (refused
    connection, timeout) is evicted; whenever a server is evicted or a collective fails, the groups are
    rebuilt for the remaining servers (a new epoch) and the next version goes to them. A server that
    answers but refuses a version keeps its old one and stays. Evicted servers are probed at most every
    ``readmit_interval_s``; one that answers rejoins (a new epoch) and gets the next full version.
    """

    def __init__(self, config: WeightSyncConfig, control: ControlLoop, engines: list[EngineClient], metrics: SyncMetrics):
        self.config, self.control, self.engines, self.metrics = config, control, engines, metrics
        self.server_versions: dict[str, int] = {e.url: 0 for e in engines}
        self.members: list[EngineClient] = []
        self.evicted: dict[str, str] = {}
        self.group: TrainerGroups | None = None
        self.epoch = 0
        self._next_probe = 0.0

    @classmethod
    def connect(cls, config: WeightSyncConfig, metrics: SyncMetrics) -> Transfer:
        """Form the first groups; servers that do not answer start evicted. Raises ``SyncError`` only
        when no server at all could join."""
        engines = [make_engine(s, config.deadlines.http_s) for s in config.servers]
        transfer = cls(config, ControlLoop(), engines, metrics)
        try:
            transfer._form(engines)
            if not transfer.members:
                raise SyncError("no server could join the data plane: " + "; ".join(transfer.evicted.values()))
        except BaseException:
            transfer.close()
            raise
        return transfer

    @property
    def device(self) -> torch.device:
        return self.group.device if self.group is not None else torch.device("cpu")

    def member_versions(self) -> dict[str, int]:
        """The versions of the servers currently in the groups (evicted ones excluded)."""
        return {e.url: self.server_versions[e.url] for e in self.members}

    @property
    def single_dtype_buckets(self) -> bool:
        return any(e.protocol.single_dtype_buckets for e in self.engines)

    # -- membership -----------------------------------------------------------------------------

    def _form(self, candidates: list[EngineClient]) -> None:
        """(Re)build the groups over the candidates that answer, in config order; evict the others."""
        if self.group is not None:
            self.group.close()  # a receiver still in a collective of the old epoch fails now, not at its deadline
            self.group = None
        cfg = self.config
        sizes = self.control.run(gather(candidates, lambda e: e.world_size()), cfg.deadlines.http_s + 5)
        alive = self._drop_unreachable(candidates, sizes)
        while alive:
            self.epoch += 1
            # Later epochs take fresh ports: the previous epoch's store may still hold a configured one.
            epoch_cfg = cfg.replace(group_name=f"{cfg.group_name}.{self.epoch}", master_port=cfg.master_port if self.epoch == 1 else 0)
            layout = GroupLayout.of(epoch_cfg, alive, sizes)
            joined = self.control.submit(gather(alive, lambda e: e.init_group(*layout.membership(e))))
            try:
                group: TrainerGroups | None = layout.join()  # returns once every server's ranks joined
            except DataPlaneError as e:
                log.warning("epoch %d: forming the groups failed: %s", self.epoch, e)
                group = None
            answers = joined.result(cfg.deadlines.rendezvous_s + cfg.deadlines.http_s)
            still = self._drop_unreachable(alive, answers)
            if group is not None and len(still) == len(alive):
                self.group, self.members = group, alive
                log.info("epoch %d: data-plane groups of %s ranks over %d server(s)", self.epoch,
                         [spec.world_size for _, spec in layout.groups], len(alive))
                break
            if group is not None:
                group.close()
            if len(still) == len(alive):  # everyone answered yet the group did not form: give up this round
                for e in alive:
                    self._evict(e.url, f"could not form the data-plane group: {answers[e.url]!r}")
                still = []
            alive = still
        else:
            self.members = []
        for e in self.members:
            if self.evicted.pop(e.url, None) is not None:
                self.metrics.event("rejoined", e.url, None, f"epoch {self.epoch}")
        versions = self.control.run(gather(self.members, lambda e: e.version()), cfg.deadlines.http_s + 5)
        self.server_versions.update({u: v for u, v in versions.items() if not isinstance(v, BaseException)})

    def _drop_unreachable(self, engines: list[EngineClient], answers: dict[str, Any]) -> list[EngineClient]:
        """Evict the engines whose answer is a failure; return the others."""
        kept = []
        for e in engines:
            answer = answers[e.url]
            if isinstance(answer, BaseException):
                self._evict(e.url, str(answer))
            else:
                kept.append(e)
        return kept

    def _evict(self, url: str, reason: str) -> None:
        if url not in self.evicted:
            self.metrics.event("evicted", url, None, reason)
            log.warning("evicted %s: %s", url, reason)
        self.evicted[url] = reason

    def _readmit(self) -> None:
        """Probe evicted servers (rate-limited); rebuild with those that answer."""
        now = time.monotonic()
        if not self.evicted or now < self._next_probe:
            return
        self._next_probe = now + self.config.readmit_interval_s
        out = [e for e in self.engines if e.url in self.evicted]
        probes = self.control.run(gather(out, lambda e: e.health()), self.config.deadlines.http_s + 5)
        back = [e for e in out if not isinstance(probes[e.url], BaseException)]
        if back:
            self._form([e for e in self.engines if e in self.members or e in back])

    # -- one version ----------------------------------------------------------------------------

    def send(self, version: int, plan: BucketPlan, buffer_for: BufferFor, ring: int | None = None,
             result: SyncResult | None = None) -> SyncResult:
        """Broadcast every bucket of ``plan`` as returned by ``buffer_for`` and have every member apply it.

        With ``ring=k`` the buffers are a ring of k reused ones: bucket i is asked for only after the
        broadcast of bucket i-k finished. The time ``buffer_for`` takes is counted as ``pack_s``.
        Never raises for a server's failure: see ``result.failures`` and the metrics' events.
        """
        cfg = self.config
        self._readmit()
        result = result or SyncResult(version, plan.total_bytes, len(plan.buckets))
        start = time.perf_counter()
        result.send_started = start
        result.started = result.started or start
        if self.group is None:
            result.failures = dict(self.evicted)
            result.finished = time.perf_counter()
            return result
        engines = list(self.members)
        request = UpdateRequest(version, tuple(BucketMeta.of(b) for b in plan.buckets), cfg.checksum)

        async def begin_and_update(e: EngineClient) -> None:
            await e.begin(version)
            await e.update(request)

        received = self.control.submit(gather(engines, begin_and_update))
        broken = self._broadcast(plan, buffer_for, ring, result)
        if broken is not None:
            self.group.close()  # receivers still waiting for a bucket fail now instead of at their deadline
            self.group = None
        result.wire_s = time.perf_counter() - start - result.pack_s
        t0 = time.perf_counter()
        updated = received.result(cfg.deadlines.http_s + 5)
        # End the update wherever it was taken, even when another server failed: vLLM and SGLang
        # servers stay paused (and vLLM mid-update) until ``end``.
        took = [e for e in engines if not isinstance(updated[e.url], BaseException)]
        ended = self.control.run(gather(took, lambda e: e.end(version)), cfg.deadlines.http_s + 5)
        result.server_versions = {u: v for u, v in ended.items() if not isinstance(v, BaseException)}
        self.server_versions.update(result.server_versions)
        failures = {u: r for u, r in (updated | ended).items() if isinstance(r, BaseException)}
        result.failures = {u: str(r) for u, r in failures.items()}
        unreachable = [u for u, r in failures.items() if not (isinstance(r, ServerError) and r.status is not None)]
        for url, err in failures.items():
            if url not in unreachable:
                self.metrics.event("refused", url, version, str(err))
        for url in unreachable:
            self._evict(url, result.failures[url])
        if broken is not None or unreachable:
            self._form([e for e in engines if e.url not in unreachable])
        result.apply_s = time.perf_counter() - t0
        result.finished = time.perf_counter()
        result.total_s = result.finished - result.started
        return result

    def _broadcast(self, plan: BucketPlan, buffer_for: BufferFor, ring: int | None, result: SyncResult) -> DataPlaneError | None:
        """Every bucket, then the checksum manifest; returns the data-plane failure, if any."""
        assert self.group is not None
        group, works, crcs = self.group, [], []
        try:
            for i, bucket in enumerate(plan.buckets):
                if ring is not None and i >= ring:
                    group.wait(works[i - ring])  # the ring buffer is reused only once its broadcast finished
                t0 = time.perf_counter()
                buf, crc = buffer_for(bucket)
                result.pack_s += time.perf_counter() - t0
                if crc is not None:
                    crcs.append(crc)
                works.append(group.broadcast_async(buf))
            for work in works:
                group.wait(work)
            if self.config.checksum:
                group.broadcast_checksums(crcs)
        except DataPlaneError as e:
            log.warning("data plane failed in epoch %d: %s", self.epoch, e)
            return e
        return None

    def close(self) -> None:
        if not self.control.loop.is_closed():
            self.control.run(gather(self.engines, lambda e: e.close()), timeout=10)
            self.control.close()
        if self.group is not None:
            self.group.close()
            self.group = None


async def gather(engines: list[EngineClient], call: Callable[[EngineClient], Awaitable[Any]]) -> dict[str, Any]:
    """Call every server concurrently; each server's result or exception, keyed by URL."""
    results = await asyncio.gather(*(call(e) for e in engines), return_exceptions=True)
    return {e.url: r for e, r in zip(engines, results)}


def lowest_member_version(transfers: list[Transfer], default: int) -> int:
    """The oldest version served by a server in a group (evicted servers excluded), or ``default``."""
    return min((v for t in transfers for v in t.member_versions().values()), default=default)
