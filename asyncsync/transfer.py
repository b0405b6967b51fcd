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
from asyncsync.metrics import SyncResult
from asyncsync.plan import Bucket, BucketPlan
from asyncsync.topology import GroupLayout, TrainerGroups
from asyncsync.wire import BucketMeta, UpdateRequest

log = logging.getLogger(__name__)

BufferFor = Callable[[Bucket], tuple[torch.Tensor, int | None]]


class SyncError(RuntimeError):
    """A sync could not reach every server; the message lists each server's failure."""


class Transfer:
    """The trainer's side of the data plane and the control plane, for every configured server.

    Lifecycle::

        transfer = Transfer.connect(config)    # world sizes, then the group, built eagerly and warmed
        for version in versions:
            transfer.send(version, plan, buffer_for)   # HTTP update in flight while buckets broadcast
        transfer.close()

    ``send`` posts each server's ``update`` before the first broadcast and awaits it only after the
    last one, under the HTTP deadline: no collective ever waits on an HTTP answer.
    """

    def __init__(self, config: WeightSyncConfig, control: ControlLoop, engines: list[EngineClient], group: TrainerGroups):
        self.config, self.control, self.engines, self.group = config, control, engines, group
        self.server_versions: dict[str, int] = {e.url: 0 for e in engines}

    @classmethod
    def connect(cls, config: WeightSyncConfig) -> Transfer:
        control = ControlLoop()
        engines = [make_engine(s, config.deadlines.http_s) for s in config.servers]
        try:
            group = _build_group(config, control, engines)
        except BaseException:
            control.run(gather(engines, lambda e: e.close()), timeout=10)
            control.close()
            raise
        transfer = cls(config, control, engines, group)
        transfer.server_versions = transfer.fanout(lambda e: e.version(), "version")
        return transfer

    def send(self, version: int, plan: BucketPlan, buffer_for: BufferFor, ring: int | None = None,
             result: SyncResult | None = None) -> SyncResult:
        """Broadcast every bucket of ``plan`` as returned by ``buffer_for`` and have every server apply it.

        With ``ring=k`` the buffers are a ring of k reused ones: bucket i is asked for only after the
        broadcast of bucket i-k finished. The time ``buffer_for`` takes is counted as ``pack_s``.
        """
        cfg, group = self.config, self.group
        request = UpdateRequest(version, tuple(BucketMeta.of(b) for b in plan.buckets), cfg.checksum)
        result = result or SyncResult(version, plan.total_bytes, len(plan.buckets))
        start = time.perf_counter()
        result.send_started = start
        result.started = result.started or start

        async def begin_and_update(e: EngineClient) -> None:
            await e.begin(version)
            await e.update(request)

        received = self.control.submit(gather(self.engines, begin_and_update))
        works: list[Any] = []
        crcs: list[int] = []
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
        if cfg.checksum:
            group.broadcast_checksums(crcs)
        result.wire_s = time.perf_counter() - start - result.pack_s
        t0 = time.perf_counter()
        updated = received.result(cfg.deadlines.http_s)
        # End the update wherever it was taken, even when another server failed: vLLM and SGLang
        # servers stay paused (and vLLM mid-update) until ``end``.
        took = [e for e in self.engines if not isinstance(updated[e.url], BaseException)]
        ended = self.control.run(gather(took, lambda e: e.end(version)), cfg.deadlines.http_s)
        self.server_versions.update({url: v for url, v in ended.items() if not isinstance(v, BaseException)})
        check(updated, "update")
        result.server_versions = check(ended, "end")
        result.apply_s = time.perf_counter() - t0
        result.finished = time.perf_counter()
        result.total_s = result.finished - result.started
        return result

    def fanout(self, call: Callable[[EngineClient], Awaitable[Any]], what: str) -> dict[str, Any]:
        """Call every server concurrently and wait; raises ``SyncError`` naming each failed server."""
        return check(self.control.run(gather(self.engines, call), self.config.deadlines.http_s), what)

    def close(self) -> None:
        if not self.control.loop.is_closed():
            self.control.run(gather(self.engines, lambda e: e.close()), timeout=10)
            self.control.close()
        self.group.close()


def _build_group(config: WeightSyncConfig, control: ControlLoop, engines: list[EngineClient]) -> TrainerGroups:
    """Ask each server for its rank count, then form one group per data-plane protocol: rank 0 here."""
    sizes = check(control.run(gather(engines, lambda e: e.world_size()), config.deadlines.http_s), "world_size")
    layout = GroupLayout.of(config, engines, sizes)
    joined = control.submit(gather(engines, lambda e: e.init_group(*layout.membership(e))))
    group = layout.join()  # returns once every server's ranks joined
    check(joined.result(config.deadlines.rendezvous_s), "init_group")
    log.info("data-plane groups of %s ranks over %d server(s)", [s.world_size for _, s in layout.groups], len(engines))
    return group


async def gather(engines: list[EngineClient], call: Callable[[EngineClient], Awaitable[Any]]) -> dict[str, Any]:
    """Call every server concurrently; each server's result or exception, keyed by URL."""
    results = await asyncio.gather(*(call(e) for e in engines), return_exceptions=True)
    return {e.url: r for e, r in zip(engines, results)}


def check(results: dict[str, Any], what: str) -> dict[str, Any]:
    """Return ``results`` if no server failed, else raise ``SyncError`` naming each failure."""
    failed = {url: r for url, r in results.items() if isinstance(r, BaseException)}
    if failed:
        detail = "; ".join(str(r) if isinstance(r, ServerError) else f"{url}: {r!r}" for url, r in failed.items())
        raise SyncError(f"{what} failed on {len(failed)} of {len(results)} server(s): {detail}")
    return results
