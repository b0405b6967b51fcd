"""Test helpers: one digest of weights, a reference server on a thread of this process, and the
trainer's send path driven version by version with the product's own pieces (``Fleet``,
``Ring``, ``send_version``), for tests that need to reach below ``WeightSync``."""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch
from aiohttp import web

from asyncsync.config import WeightSyncConfig
from asyncsync.launch.http import http_call
from asyncsync.metrics import SyncMetrics, SyncResult
from asyncsync.packing.delta import Delta
from asyncsync.packing.torch_backend import TorchPackBackend
from asyncsync.engines.base import ASYNCSYNC_PROTOCOL
from asyncsync.protocol.device import HostRuntime
from asyncsync.protocol.frames import VersionFrames
from asyncsync.protocol.group import DataPlaneGroup, free_port
from asyncsync.protocol.specs import Bucket, BucketPlan
from asyncsync.protocol.wire import UpdateRequest
from asyncsync.receivers.reference.app import ReferenceServer
from asyncsync.launch.reference import ServerProcess
from asyncsync.receivers.reference.receiver import tensor_bytes
from asyncsync.trainer.buffers import Ring
from asyncsync.control import ControlLoop
from asyncsync.transport.fleet import Fleet
from asyncsync.transport.send import send_version
from asyncsync.transport.sources import BucketSource
from asyncsync.transport.topology import TrainerGroups

CPU = torch.device("cpu")


def digest(weights: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, str]:
    """SHA-256 of every tensor's bytes, by name: what ``GET /weights/digest`` answers for the same weights."""
    named = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    return {n: hashlib.sha256(tensor_bytes(t)).hexdigest() for n, t in named.items()}


def weights(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """``model``'s state with every parameter redrawn from ``seed`` (buffers kept)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(p.dtype))
    return dict(model.state_dict())


def call(url: str, method: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    """(status, decoded body or None) of one plain HTTP call; 4xx/5xx are returned, not raised."""
    return http_call(url, method, path, body, timeout_s=30, raw=raw)


def listening_addresses(port: int) -> set[str]:
    """The local addresses of this host's TCP sockets listening on ``port`` (IPv4 and IPv6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


def live_version(url: str) -> str:
    """What an SGLang server reports as its live weight version (``/model_info``)."""
    return call(url, "GET", "/model_info")[1]["weight_version"]


def sglang_config(url: str, bucket_bytes: int | str = "16KiB", **options: Any) -> WeightSyncConfig:
    """One server addressed as ``kind: sglang``; ``options`` are further WeightSyncConfig keys."""
    return WeightSyncConfig.from_dict({"servers": [{"url": url, "kind": "sglang"}], "bucket_bytes": bucket_bytes, **options})


def send_frames(group: DataPlaneGroup, request: UpdateRequest, buckets: list[torch.Tensor],
                crcs: list[int] | None = None) -> None:
    """Rank 0's broadcasts of ``request`` into ``group`` as asyncsync's trainer sends them (each bucket
    after its frame header; then the manifest ``crcs``, if given), for tests that play the trainer
    below ``send_version``."""
    groups, frames = TrainerGroups([(ASYNCSYNC_PROTOCOL, group)], group.runtime), VersionFrames.of(request)
    for i, bucket in enumerate(buckets):
        groups.wait(groups.broadcast_async(bucket, None, frames.header(i, bucket)))
    if crcs is not None:
        groups.broadcast_checksums(list(crcs), None, frames)


class Watcher:
    """Polls every server's (version, digest) while training runs: each sample must be a whole version."""

    def __init__(self, servers: list[ServerProcess]):
        self.servers = servers
        self.samples: dict[str, list[tuple[int, dict[str, str]]]] = {s.url: [] for s in servers}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        for _ in range(2000):  # bounded
            if self._stop.is_set():
                return
            for s in self.servers:
                got = s.get("/weights/digest")
                self.samples[s.url].append((got["version"], got["digest"]))
            self._stop.wait(0.01)

    def __enter__(self) -> Watcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


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


class Trainer:
    """Rank 0 of the servers' groups, sending one version at a time through ``send_version``."""

    def __init__(self, config: WeightSyncConfig):
        self.control = ControlLoop()
        self.metrics = SyncMetrics()
        # The data plane below WeightSync: same-host servers too (tests/test_shm.py covers shared memory).
        config = config.replace(transport="collective") if config.transport == "auto" else config
        self.fleet = Fleet.connect(config, self.control, self.metrics, HostRuntime())

    @property
    def groups(self) -> list[tuple[str, int]]:
        """(receiver protocol, world size) of each data-plane group of the current epoch."""
        group = self.fleet.epochs.current.group
        assert group is not None
        return group.layout

    def send(self, named: Mapping[str, torch.Tensor], version: int, *, bucket_bytes: int | None = None,
             single_dtype: bool | None = None, wrap: Callable[[BucketSource], BucketSource] | None = None) -> SyncResult:
        """Send ``named`` as ``version``; ``wrap`` may tamper with the bytes on their way to the wire."""
        cfg = self.fleet.config
        plan = BucketPlan.from_tensors(named.items(), bucket_bytes or cfg.bucket_bytes,
                                       self.fleet.single_dtype_buckets if single_dtype is None else single_dtype)
        source: BucketSource = Ring(plan, CPU, TorchPackBackend(), cfg.checksum).packing(named)
        return send_version(self.fleet, plan, version, wrap(source) if wrap else source)

    def publish(self, named: Mapping[str, torch.Tensor], version: int, **options: object) -> dict[str, int | str]:
        """Each server's live version after ``version`` was sent, or the reason it failed."""
        result = self.send(named, version, **options)  # type: ignore[arg-type]
        return {**result.server_versions, **result.failures}

    def close(self) -> None:
        self.fleet.close()
        self.control.close()


class Wrapped(BucketSource):
    """A bucket source that hands everything to ``inner``: the base of the tests' wrappers that hold
    or tamper with one part of a version."""

    def __init__(self, inner: BucketSource):
        self.inner = inner
        self.delta_base, self.segment = inner.delta_base, inner.segment

    def reuses(self, bucket: Bucket) -> int | None:
        return self.inner.reuses(bucket)

    def bucket(self, bucket: Bucket) -> torch.Tensor:
        return self.inner.bucket(bucket)

    def checksum(self, bucket: Bucket) -> int | torch.Tensor | None:
        return self.inner.checksum(bucket)

    def delta(self, bucket: Bucket) -> Delta | None:
        return self.inner.delta(bucket)

    def delta_nbytes(self) -> tuple[int, ...] | None:
        return self.inner.delta_nbytes()


class HoldAt(Wrapped):
    """Wraps the trainer's bucket source: the transfer stops before bucket ``index`` until released."""

    def __init__(self, inner: BucketSource, index: int):
        super().__init__(inner)
        self.index = index
        self.reached, self.release = threading.Event(), threading.Event()

    def bucket(self, bucket: Bucket) -> torch.Tensor:
        if bucket.index == self.index:
            self.reached.set()
            self.release.wait(60)  # bounded: the test releases it
        return self.inner.bucket(bucket)
