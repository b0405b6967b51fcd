"""asyncsync as vLLM's trainer-side weight-transfer engine, under the backend name ``asyncsync``.

vLLM 0.32/0.33's trainer API (``vllm.distributed.weight_transfer``) builds an engine per trainer rank
with ``WeightTransferTrainerFactory.trainer_init(init_info, client=, source=)`` and then calls
``send_weights()`` per round and ``shutdown()``. Switching a trainer from vLLM's ``nccl`` backend::

    import asyncsync.integrations.vllm                      # registers the "asyncsync" trainer engine
    from asyncsync.integrations.vllm import AsyncsyncTrainerInitInfo
    engine = WeightTransferTrainerFactory.trainer_init(
        AsyncsyncTrainerInitInfo(rank=rank, async_weight_update=True),   # instead of NCCLTrainerInitInfo(...)
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))

The servers run asyncsync's worker backend (``--weight-transfer-config '{"backend": "asyncsync"}'``).
The engine is a ``WeightSync`` on trainer rank 0: every round is one asyncsync version (bucketed,
CRC32C-checked, verified whole and applied all or nothing by every server; deltas with ``delta:
auto``); a server that fails is evicted and the others keep getting versions.

What a caller must know, beyond vLLM's four client calls:

* asyncsync drives each server through more of its routes than the client's four (``/pause``,
  ``/resume``, ``/weight_info``, ``/get_world_size``, ``/server_info``), over its own HTTP pool. It
  needs each server's URL: ``init_info.servers``, or, when empty, the ``base_url`` of an
  ``HTTPVLLMWeightSyncClient``. A ``RayVLLMWeightSyncClient`` carries no URL: list the servers.
  Otherwise the client is not called.
* ``trainer_init`` is collective: every rank iterates the source once (a DTensor's ``full_tensor()``
  is an all-gather) and rank 0 plans the version and has every server judge it; a model the
  servers do not serve raises ``ConfigError`` naming both sides, on every rank (they agree through
  torch.distributed's default group when it has more than one rank). The source must yield the
  checkpoint's names and dtypes, as for vLLM's own backends.
* ``send_weights()`` iterates the source on every rank in step. On rank 0 the round's full tensors
  are held together until the version is packed (vLLM's nccl engine streams them one at a time).
  Blocking (the default) returns once every server applied the version or was evicted, and raises
  ``SyncError`` when none did; ``last_result`` is the round's ``SyncResult``. With
  ``async_weight_update`` it returns once the version is copied into the sync's snapshot (the
  trainer may change its weights then) and the servers get it in the background; a version still
  waiting when the next round is sent is superseded, never sent. ``metrics`` holds every round's
  figures either way. ``shutdown()`` drains: the last version reaches every server first.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, ClassVar

import torch

from asyncsync import ConfigError, WeightSyncConfig

log = logging.getLogger(__name__)

BACKEND = "asyncsync"
# Keys of the init info itself: the rest of a WeightSyncConfig goes in ``weight_sync``.
_OWN_KEYS = ("servers", "async_weight_update", "delta", "bucket_bytes")


@dataclass(frozen=True)
class AsyncsyncTrainerInitInfo:
    """What the ``asyncsync`` trainer engine needs, given on every trainer rank.

    vLLM's ``TrainerInitInfo`` contract (a class-level ``backend``, a keyword-only ``rank``, rank 0
    the sender), as a frozen dataclass of its own: vLLM's base class is not frozen, so a frozen
    subclass of it cannot exist; the factory reads only ``backend``.

    ``servers``: the vLLM servers' base URLs (empty: the client's ``base_url``); ``bucket_bytes``: an
    int or a size such as ``"256MiB"``; ``weight_sync``: any other ``WeightSyncConfig`` key (deadlines,
    max_staleness, a server's policies as ``servers`` entries, ...). Invalid values raise
    ``ConfigError`` naming the key, here, before any server is contacted."""

    backend: ClassVar[str] = BACKEND

    servers: tuple[str, ...] = ()
    async_weight_update: bool = False
    delta: str = "auto"
    bucket_bytes: int | str = "512MiB"
    weight_sync: Mapping[str, Any] = field(default_factory=dict)
    rank: int = field(kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 0:
            raise ConfigError(f"rank: expected this trainer rank's index (an int >= 0), got {self.rank!r}")
        if isinstance(self.servers, str) or not all(isinstance(s, str) and s for s in self.servers):
            raise ConfigError(f"servers: expected a list of vLLM server URLs, got {self.servers!r}")
        object.__setattr__(self, "servers", tuple(self.servers))
        if not isinstance(self.weight_sync, Mapping):
            raise ConfigError(f"weight_sync: expected a mapping of WeightSyncConfig keys, got {self.weight_sync!r}")
        clash = sorted(set(self.weight_sync) & set(_OWN_KEYS))
        if clash:
            raise ConfigError(f"weight_sync.{clash[0]}: set it as the init info's own field, not inside weight_sync")
        if "trainer_ranks" in self.weight_sync:
            raise ConfigError("weight_sync.trainer_ranks: the engine sends from rank 0 (the others iterate the source "
                              "in step); leave it out")
        object.__setattr__(self, "weight_sync", MappingProxyType(dict(self.weight_sync)))
        self.config(self.servers or ("http://127.0.0.1:1",))  # every other value is checked where it is read

    @property
    def is_sender(self) -> bool:
        return self.rank == 0

    def config(self, servers: tuple[str, ...]) -> WeightSyncConfig:
        """The ``WeightSyncConfig`` of rank 0's sync: every server a vLLM one, this process the only
        trainer rank (the others only iterate the source)."""
        if not servers:
            raise ConfigError("servers: list the vLLM servers' URLs (the client given has no base_url to default to)")
        data = dict(self.weight_sync)
        data.update(async_weight_update=self.async_weight_update, delta=self.delta, bucket_bytes=self.bucket_bytes,
                    servers=[{"url": url, "kind": "vllm"} for url in servers])
        return WeightSyncConfig.from_dict(data).replace(trainer_ranks=1)

    def servers_for(self, client: Any) -> tuple[str, ...]:
        """``servers``, or the URL of vLLM's HTTP client."""
        if self.servers:
            return self.servers
        url = getattr(client, "base_url", None)
        if not isinstance(url, str):
            raise ConfigError(f"servers: {type(client).__name__} has no base_url; asyncsync talks to the vLLM servers' "
                              "HTTP routes itself, so list their URLs in AsyncsyncTrainerInitInfo(servers=[...])")
        return (url.rstrip("/"),)


def full_tensors(source: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's next pass, each tensor whole and checked against ``source.metadata()`` (name,
    dtype, shape, in order), as vLLM's contract requires; ``ValueError`` naming the first difference.
    A DTensor's gather is collective: every rank calls this at the same point."""
    metadata = list(source.metadata())
    count = 0
    for count, (name, tensor) in enumerate(source, 1):
        if count > len(metadata):
            raise ValueError(f"WeightSource yielded {name!r} after the {len(metadata)} tensors its metadata() declares")
        meta = metadata[count - 1]
        full = tensor.full_tensor() if callable(getattr(tensor, "full_tensor", None)) else tensor
        if (name, full.dtype, tuple(full.shape)) != (meta.name, meta.dtype, tuple(meta.shape)):
            raise ValueError(f"WeightSource yielded {name!r} {full.dtype} {tuple(full.shape)} where metadata() "
                             f"declares {meta.name!r} {meta.dtype} {tuple(meta.shape)}: iteration must match metadata()")
        yield name, full.detach()
    if count != len(metadata):
        raise ValueError(f"WeightSource yielded {count} tensors, metadata() declares {len(metadata)}")


def agree(error: BaseException | None, rank: int) -> None:
    """Raise on every rank what rank 0 raised (torch.distributed's default group, when it has more
    than one rank; the ranks' index there must be ``init_info.rank``), so no rank goes on to a
    collective rank 0 left."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    if dist.get_rank() != rank:
        raise ConfigError(f"rank: init_info.rank is {rank} but this process is rank {dist.get_rank()} of "
                          "torch.distributed's default group; give each rank its own index there")
    box = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    if box[0] is not None:
        raise ConfigError(f"trainer rank 0 could not connect the vLLM servers: {box[0]}")


class _AsyncsyncTrainerEngine:
    """Mixed into vLLM's ``TrainerWeightTransferEngine`` (built on first use, with vLLM imported):
    one ``WeightSync`` on rank 0, one version per ``send_weights``. The contract: the module's
    docstring."""

    init_info_cls = AsyncsyncTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool = True) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)  # type: ignore[call-arg]
        self.sync: Any = None   # the WeightSync, on rank 0, from trainer_init to shutdown
        self.version = 0        # the last version sent (rank 0)
        self.last_result: Any = None  # the last blocking round's SyncResult (rank 0)

    @classmethod
    def trainer_init(cls, init_info: AsyncsyncTrainerInitInfo, *, client: Any, source: Any = None) -> Any:
        if not isinstance(init_info, AsyncsyncTrainerInitInfo):
            raise TypeError(f"init_info: the asyncsync engine takes AsyncsyncTrainerInitInfo, got {type(init_info).__name__}")
        if source is None:
            raise ValueError("source: the asyncsync engine sends a WeightSource's tensors each round; pass "
                             "source=ModuleSource(model)")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender)
        named = dict(full_tensors(source))  # collective: every rank, the same pass
        error = None
        if engine.is_sender:
            try:
                engine._connect(init_info.config(init_info.servers_for(client)), named)
            except Exception as e:  # every rank raises it (agree)
                error = e
        del named
        agree(error, init_info.rank)
        return engine

    def _connect(self, config: WeightSyncConfig, named: dict[str, torch.Tensor]) -> None:
        from asyncsync import WeightSync

        sync = WeightSync(config)
        try:
            sync.connect(named)
        except BaseException:
            sync.close()
            raise
        self.sync = sync
        self.version = max(sync.server_versions.values(), default=0)
        log.info("asyncsync trainer engine: %s to %s, versions from %d", "async" if config.async_weight_update
                 else "blocking", [s.base_url for s in config.servers], self.version + 1)

    @property
    def metrics(self) -> Any:
        """The sync's ``SyncMetrics`` on rank 0 (every round's ``SyncResult`` in ``history``), else None."""
        return self.sync.metrics if self.sync is not None else None

    @property
    def server_versions(self) -> dict[str, int]:
        return self.sync.server_versions if self.sync is not None else {}

    def send_weights(self) -> Any:
        """One round: every rank iterates the source; rank 0 sends it as the next version. Returns
        the round's ``SyncResult`` on rank 0 in blocking mode, else None."""
        named = dict(full_tensors(self.source))
        if not self.is_sender:
            return None
        if self.sync is None:
            raise RuntimeError("send_weights() after shutdown(): build a new engine with trainer_init")
        from asyncsync import SyncError

        self.version += 1
        result = self.sync.publish(named, self.version)
        if self.sync.is_async:
            self.sync.wait_snapshot()  # the version is copied: the trainer may change its weights
            return None
        self.last_result = result
        if not result.server_versions:
            raise SyncError(f"version {self.version} reached no vLLM server: "
                            + "; ".join(f"{u}: {w}" for u, w in result.failures.items()))
        return result

    def shutdown(self) -> None:
        """Drain (async: the last version reaches every server), then release the servers."""
        if self.sync is None:
            return
        sync, self.sync = self.sync, None
        sync.close()
        for error in sync.errors:
            log.error("asyncsync trainer engine: a version could not be sent: %s", error)


@functools.cache
def _engine_class() -> type:
    from vllm.distributed.weight_transfer import TrainerWeightTransferEngine

    return type("AsyncsyncTrainerEngine", (_AsyncsyncTrainerEngine, TrainerWeightTransferEngine),
                {"__module__": __name__, "__doc__": (_AsyncsyncTrainerEngine.__doc__ or "") + "\n\n" + (__doc__ or "")})


def __getattr__(name: str) -> Any:
    if name == "AsyncsyncTrainerEngine":
        return _engine_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register() -> None:
    """Register the ``asyncsync`` trainer engine with vLLM's ``WeightTransferTrainerFactory`` (once
    per process; also vLLM's ``vllm.general_plugins`` entry point ``asyncsync-trainer``)."""
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "AsyncsyncTrainerEngine")


if importlib.util.find_spec("vllm") is not None:
    register()
