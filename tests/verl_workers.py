"""The Ray workers of tests/test_verl.py: verl's own worker classes around asyncsync's checkpoint engine.

``ShardedActor`` stands in for verl's FSDP actor: each of its ranks holds one shard of every tensor of
a tiny Qwen2 and produces the full tensors collectively (an all-gather per tensor on the actor ranks'
gloo group, as FSDP's ``full_tensor()`` does), so a checkpoint engine that does not drain the weights
generator on every rank stalls the others and fails at the group's deadline (``LazyEngine``, backend
``asyncsync_lazy``, is such an engine). ``RecordingRollout`` is verl's real ``CheckpointEngineWorker``
with a server adapter that records what ``receive_weights`` yields, standing in for verl's CUDA-IPC
vLLM adapter; it can refuse a version or die in the middle of one. ``Replica`` is a ``RolloutReplica``
over them that records when it was aborted and resumed.

Loaded in every Ray worker as verl's ``custom_backend_module`` (it registers ``asyncsync_lazy``).
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from verl.checkpoint_engine import CheckpointEngineRegistry, CheckpointEngineWorker
from verl.single_controller.base import Worker
from verl.single_controller.base.decorator import Dispatch, register
from verl.single_controller.ray import RayClassWithInitArgs
from verl.utils.import_utils import import_external_libs
from verl.workers.rollout import BaseRollout, RolloutReplica

from asyncsync.integrations.verl import AsyncsyncCheckpointEngine

LAZY = "asyncsync_lazy"


def digest(named: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Per name: dtype, shape and the SHA-256 of the bytes."""
    return {n: (str(t.dtype), tuple(t.shape), hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
                .hexdigest()) for n, t in named.items()}


@CheckpointEngineRegistry.register(LAZY)
class LazyEngine(AsyncsyncCheckpointEngine):
    """A faulty backend: actor ranks other than 0 return without draining the weights generator."""

    async def send_weights(self, weights: Any, global_steps: int | None = None) -> dict[str, Any]:
        if self.sender is None:
            return {}
        return await super().send_weights(weights, global_steps)


class ShardedActor(Worker):
    """One actor rank: a shard of every tensor (rank r holds elements r::world of the flattened tensor);
    a rank left alone in a collective fails after ``group_timeout_s``, never hangs."""

    def __init__(self, model_dir: str, checkpoint_engine: Any, group_timeout_s: float = 60.0) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=group_timeout_s))
        self.shard, self.world = dist.get_rank(), dist.get_world_size()
        full = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        self.specs = {n: (t.dtype, t.shape) for n, t in full.items()}
        self.shards = {n: t.detach().reshape(-1)[self.shard :: self.world].clone() for n, t in full.items()}
        self.sent: tuple[float, float] | None = None  # wall-clock start and end of the last send_weights
        import_external_libs(checkpoint_engine.custom_backend_module)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            checkpoint_engine.backend, is_master=self.shard == 0,
            bucket_size=checkpoint_engine.update_weights_bucket_megabytes << 20,
            **checkpoint_engine.engine_kwargs.get(checkpoint_engine.backend, {}))

    def per_tensor_param(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every full tensor, produced collectively (every rank must iterate in step)."""
        for name, (dtype, shape) in self.specs.items():
            parts = [torch.empty(len(range(r, shape.numel(), self.world)), dtype=dtype) for r in range(self.world)]
            dist.all_gather(parts, self.shards[name])
            full = torch.empty(shape.numel(), dtype=dtype)
            for r, part in enumerate(parts):
                full[r :: self.world] = part
            yield name, full.view(shape)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def step(self, seed: int, every: int = 1) -> None:
        """Change every ``every``-th element of every tensor, the same way whatever the world size."""
        g = torch.Generator().manual_seed(seed)
        for name, (dtype, shape) in self.specs.items():
            noise = (torch.randn(shape.numel(), generator=g) * 0.1).to(dtype)
            mask = torch.zeros(shape.numel(), dtype=torch.bool)
            mask[seed % every :: every] = True
            self.shards[name] += torch.where(mask, noise, torch.zeros_like(noise))[self.shard :: self.world]

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def full_digest(self) -> dict[str, Any]:
        return digest(dict(self.per_tensor_param()))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def flip_next_bucket(self) -> None:
        """One byte of the next packed bucket flips after its checksum was taken (rank 0 packs)."""
        if self.shard == 0:
            import pytest
            from staging_faults import FlipNextBucket

            FlipNextBucket(pytest.MonkeyPatch()).armed = True  # undone with the process

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_times(self) -> tuple[float, float] | None:
        return self.sent

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, Any]:
        start = time.time()
        try:
            return await self.checkpoint_engine.send_weights(self.per_tensor_param(), global_steps=global_steps) or {}
        finally:
            self.sent = (start, time.time())

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


HELD_LOAD_S = 60.0  # a held load goes on by itself after this


class RecordingAdapter(BaseRollout):
    """The rollout's server: keeps what each update yields (all of it, or nothing on an error); while
    ``gate`` is set and not open, a load waits for it (``HELD_LOAD_S`` at most) before it counts."""

    def __init__(self, config: Any, model_config: Any) -> None:
        super().__init__(config, model_config, device_mesh=None)
        self.weights: dict[str, torch.Tensor] = {}
        self.labels: list[int | None] = []
        self.gate: threading.Event | None = None

    async def resume(self, tags: list[str]) -> None:
        pass

    async def release(self) -> None:
        pass

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        got = {}
        async for name, tensor in weights:
            got[name] = tensor.clone()
        give_up = time.monotonic() + HELD_LOAD_S
        while self.gate is not None and not self.gate.is_set() and time.monotonic() < give_up:
            await asyncio.sleep(0.05)
        self.weights = got
        self.labels.append(kwargs.get("global_steps"))


class RecordingRollout(CheckpointEngineWorker):
    """verl's ``CheckpointEngineWorker`` over a ``RecordingAdapter``, keeping each failed update's error."""

    def __init__(self, rollout_config: Any, model_config: Any) -> None:
        super().__init__(rollout_config, model_config, RecordingAdapter(rollout_config, model_config))
        self.errors: list[str] = []

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None) -> None:
        try:
            await super().update_weights(global_steps=global_steps)
        except Exception as e:
            self.errors.append(f"{type(e).__name__}: {e}")
            raise

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received(self) -> dict[str, Any]:
        return {"digest": digest(self.server_adapter.weights), "labels": list(self.server_adapter.labels),
                "errors": list(self.errors), "pid": os.getpid()}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hold_loads(self) -> None:
        """The next loads wait until ``release_loads``."""
        self.server_adapter.gate = threading.Event()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def release_loads(self) -> None:
        if self.server_adapter.gate is not None:
            self.server_adapter.gate.set()

    def _on_next_receive(self, then: Any) -> None:
        """Run ``then(receive, request)`` in place of the receiver's next data-plane receive."""
        receiver = self.checkpoint_engine.receiver.server.receiver
        receive = receiver.receive

        def once(request: Any) -> None:
            del receiver.receive  # back to the class's method
            then(receive, request)

        receiver.receive = once

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def refuse_next_version(self) -> None:
        """Receive the next version whole, then refuse it as a failed check would (its old weights stay)."""
        from asyncsync.protocol.admission import VersionRejected

        def refuse(receive: Any, request: Any) -> None:
            receive(request)
            raise VersionRejected("checksum mismatch (injected by the test on this rollout worker)")

        self._on_next_receive(refuse)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def die_in_next_version(self) -> None:
        """This process exits as the next version's bytes start to arrive."""
        self._on_next_receive(lambda receive, request: os._exit(17))


class Replica(RolloutReplica):
    """A replica of ``world_size`` rollout workers taken from one worker group (hybrid, as verl's tests
    do), running no inference server; ``events`` records (what, wall-clock time) of each abort,
    resume and KV-cache release verl's managers ask of it."""

    events: list[tuple[str, float]]

    async def init_hybrid(self, worker_group: Any) -> None:
        self.events = []
        self.workers = worker_group.workers[self.world_size * self.replica_rank : self.world_size * (self.replica_rank + 1)]

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        self.events.append(("abort", time.time()))

    async def resume_generation(self) -> None:
        self.events.append(("resume", time.time()))

    async def release_kv_cache(self) -> None:
        self.events.append(("release_kv_cache", time.time()))

    async def resume_kv_cache(self) -> None:
        self.events.append(("resume_kv_cache", time.time()))

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        raise NotImplementedError("the test's replicas run no inference server")

    async def launch_servers(self) -> None:
        raise NotImplementedError("the test's replicas run no inference server")
