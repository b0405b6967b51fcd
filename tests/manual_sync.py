"""Engine-level test helpers: a reference server on a thread of this process, and a trainer driven by
hand through the engine clients and the trainer's data-plane groups (WeightSync's flow, unpipelined)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from aiohttp import web

from asyncsync.config import WeightSyncConfig
from asyncsync.control import ControlLoop
from asyncsync.dataplane import free_port
from asyncsync.engines import EngineClient, make_engine
from asyncsync.packing import TorchPackBackend
from asyncsync.plan import BucketPlan
from asyncsync.server.app import ReferenceServer
from asyncsync.topology import GroupLayout
from asyncsync.transfer import gather
from asyncsync.wire import BucketMeta, UpdateRequest


class ThreadedServer:
    """A ``ReferenceServer`` served from its own event-loop thread, for options ``ServerProcess`` lacks."""

    def __init__(self, server: ReferenceServer):
        self.server = server
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._runner = web.AppRunner(server.app())
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    async def _start(self) -> None:
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


class ManualTrainer:
    """Rank 0 of every group the servers need, publishing versions one at a time."""

    def __init__(self, config: WeightSyncConfig):
        self.config = config
        self.control = ControlLoop()
        self.engines: Sequence[EngineClient] = [make_engine(s, config.deadlines.http_s) for s in config.servers]
        sizes = answered(self.control.run(gather(self.engines, lambda e: e.world_size())))
        self.layout = GroupLayout.of(config, self.engines, sizes)
        joined = self.control.submit(gather(self.engines, lambda e: e.init_group(*self.layout.membership(e))))
        self.groups = self.layout.join()
        answered(joined.result(60))

    def publish(self, named: Mapping[str, torch.Tensor], version: int) -> dict[str, Any]:
        """Send ``version``; each server's live version after ``end``, or the exception it failed with."""
        plan = BucketPlan.from_tensors(named.items(), self.config.bucket_bytes)
        request = UpdateRequest(version, tuple(BucketMeta.of(b) for b in plan.buckets), self.config.checksum)

        async def begin_and_update(e: EngineClient) -> None:
            await e.begin(version)
            await e.update(request)

        received = self.control.submit(gather(self.engines, begin_and_update))
        crcs = []
        for bucket in plan.buckets:
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8)
            crcs.append(TorchPackBackend().pack([named[s.name] for s in bucket.specs], bucket.offsets, buf, True))
            self.groups.wait(self.groups.broadcast_async(buf))
        if self.config.checksum:
            self.groups.broadcast_checksums(crcs)
        results = received.result(60)
        applied = [e for e in self.engines if not isinstance(results[e.url], BaseException)]
        results.update(self.control.run(gather(applied, lambda e: e.end(version)), 60))
        return results

    def close(self) -> None:
        self.control.run(gather(self.engines, lambda e: e.close()), 10)
        self.control.close()
        self.groups.close()


def answered(results: dict[str, Any]) -> dict[str, Any]:
    """The results, or the first server's failure raised."""
    for r in results.values():
        if isinstance(r, BaseException):
            raise r
    return results
