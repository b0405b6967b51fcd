"""The Ray workers of tests/test_verl.py: verl's own worker classes around asyncsync's checkpoint engine.

``ShardedActor`` stands in for verl's FSDP actor: each of its ranks holds one shard of every tensor of
a tiny Qwen2 and produces the full tensors collectively (an all-gather per tensor on the actor ranks'
gloo group, as FSDP's ``full_tensor()`` does), so a checkpoint engine that does not drain the weights
generator on every rank stalls the others and fails at the group's deadline. ``RecordingRollout`` is
verl's real ``CheckpointEngineWorker`` with a server adapter that records what ``receive_weights``
yields, standing in for verl's CUDA-IPC vLLM adapter. ``Replica`` is a ``RolloutReplica`` over them.
"""

from __future__ import annotations

import datetime
import hashlib
import os
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

GROUP_TIMEOUT_S = 60  # a rank left alone in a collective fails after this, never hangs


def digest(named: dict[str, torch.Tensor]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """Per name: dtype, shape and the SHA-256 of the bytes."""
    return {n: (str(t.dtype), tuple(t.shape), hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
                .hexdigest()) for n, t in named.items()}


class ShardedActor(Worker):
    """One actor rank: a shard of every tensor (rank r holds rows r::world of the flattened tensor)."""

    def __init__(self, model_dir: str, checkpoint_engine: Any) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        self.shard, self.world = dist.get_rank(), dist.get_world_size()
        full = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
        self.specs = {n: (t.dtype, t.shape) for n, t in full.items()}
        self.shards = {n: t.detach().reshape(-1)[self.shard :: self.world].clone() for n, t in full.items()}
        self.delay_s = 0.0
        self.drain = True  # False: a faulty backend's rank > 0 that never drains the generator
        import_external_libs(checkpoint_engine.custom_backend_module)
        self.checkpoint_engine = CheckpointEngineRegistry.new(
            checkpoint_engine.backend, is_master=self.shard == 0,
            bucket_size=checkpoint_engine.update_weights_bucket_megabytes << 20,
            **checkpoint_engine.engine_kwargs.get(checkpoint_engine.backend, {}))

    def per_tensor_param(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every full tensor, produced collectively (every rank must iterate in step)."""
        for name, (dtype, shape) in self.specs.items():
            shard = self.shards[name]
            parts = [torch.empty(len(range(r, shape.numel(), self.world)), dtype=dtype) for r in range(self.world)]
            dist.all_gather(parts, shard)
            full = torch.empty(shape.numel(), dtype=dtype)
            for r, part in enumerate(parts):
                full[r :: self.world] = part
            if self.delay_s:
                time.sleep(self.delay_s)
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
    def configure(self, delay_s: float = 0.0, drain: bool = True, flip_next_bucket: bool = False) -> None:
        self.delay_s, self.drain = delay_s, drain
        if flip_next_bucket and self.shard == 0:
            import pytest
            from staging_faults import FlipNextBucket

            FlipNextBucket(pytest.MonkeyPatch()).armed = True  # undone with the process

    @register(dispatch_mode=Dispatch.ONE_TO_ALL, blocking=False)
    async def update_weights(self, global_steps: int | None = None, mode: str = "auto") -> dict[str, Any]:
        weights = self.per_tensor_param() if self.drain or self.shard == 0 else iter(())
        return await self.checkpoint_engine.send_weights(weights, global_steps=global_steps) or {}

    @register(dispatch_mode=Dispatch.DP_COMPUTE, blocking=False)
    def execute_checkpoint_engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.checkpoint_engine, method)(*args, **kwargs)


class RecordingAdapter(BaseRollout):
    """The rollout's server: keeps what each update yields (all of it, or nothing on an error)."""

    def __init__(self, config: Any, model_config: Any) -> None:
        super().__init__(config, model_config, device_mesh=None)
        self.weights: dict[str, torch.Tensor] = {}
        self.labels: list[int | None] = []

    async def resume(self, tags: list[str]) -> None:
        pass

    async def release(self) -> None:
        pass

    async def update_weights(self, weights: Any, **kwargs: Any) -> None:
        got = {}
        async for name, tensor in weights:
            got[name] = tensor.clone()
        self.weights = got
        self.labels.append(kwargs.get("global_steps"))


class RecordingRollout(CheckpointEngineWorker):
    def __init__(self, rollout_config: Any, model_config: Any) -> None:
        super().__init__(rollout_config, model_config, RecordingAdapter(rollout_config, model_config))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def received(self) -> dict[str, Any]:
        return {"digest": digest(self.server_adapter.weights), "labels": list(self.server_adapter.labels),
                "pid": os.getpid()}


class Replica(RolloutReplica):
    """A replica of ``world_size`` rollout workers taken from one worker group (hybrid, as verl's tests do)."""

    async def init_hybrid(self, worker_group: Any) -> None:
        self.workers = worker_group.workers[self.world_size * self.replica_rank : self.world_size * (self.replica_rank + 1)]

    def get_ray_class_with_init_args(self) -> RayClassWithInitArgs:
        raise NotImplementedError("the test's replicas run no inference server")

    async def launch_servers(self) -> None:
        raise NotImplementedError("the test's replicas run no inference server")
