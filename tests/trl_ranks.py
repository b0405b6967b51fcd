"""Two CPU ranks of a TRL run against a real vLLM server, for tests/test_trl_vllm.py (each function
runs on every rank of a gloo world made by ``run_local_ranks``; rank 0 returns what it measured).

``grpo_ddp``: TRL's GRPOTrainer with asyncsync under accelerate on 2 processes. On CPU accelerate
makes that a MULTI_CPU (gloo) run with the model wrapped in DDP: rank 0 syncs, every rank trains.

``fsdp2_sync``: accelerate enables FSDP only on accelerator devices (its ``AcceleratorState`` reaches
the FSDP branch for MULTI_GPU/NPU/XPU/..., never MULTI_CPU), so GRPOTrainer cannot run FSDP2 on CPU.
This drives asyncsync's generation object, the one GRPOTrainer builds, directly on a ``fully_shard``-ed
model: every rank calls ``sync_weights`` as TRL does, and vLLM must serve the unsharded weights.
"""

from __future__ import annotations

import os
from typing import Any

import torch

STEPS = 3


def _accelerate_env(rank: int, world: int) -> None:
    """What a launcher sets, so accelerate finds the gloo world ``run_local_ranks`` made."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))


def grpo_ddp(rank: int, world: int, url: str, out_dir: str) -> dict[str, Any]:
    import trl_helpers

    _accelerate_env(rank, world)
    trainer = trl_helpers.trainer(url, {"async_weight_update": True}, STEPS, out_dir, batch=4)
    generation = trainer.vllm_generation
    trainer.train()
    rollouts = generation.rollouts
    return {"ranks": trainer.accelerator.num_processes, "wrapper": type(trainer.model_wrapped).__name__,
            "version": generation.version, "rollout_versions": None if rollouts is None else list(rollouts.versions),
            "served": trl_helpers.served_logprobs(url, trl_helpers.FIXED)[1] if rank == 0 else None,
            "steps": trainer.state.global_step}


def fsdp2_sync(rank: int, world: int, url: str) -> dict[str, Any]:
    from accelerate import Accelerator
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import trl_helpers
    from asyncsync.integrations.trl import _trl_classes
    from asyncsync.models import build_model, word_tokenizer

    _accelerate_env(rank, world)
    accelerator = Accelerator(cpu=True)
    model = build_model(trl_helpers.MODEL)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    generation = _trl_classes()["generation"](
        model=model, accelerator=accelerator, processing_class=word_tokenizer(trl_helpers.MODEL.vocab_size),
        mode="server", server_base_url=url, weight_sync=trl_helpers.weight_sync({"async_weight_update": False}))
    reference = build_model(trl_helpers.MODEL)  # rank 0 checks the server against the unsharded weights
    diffs, versions = [], []
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(STEPS):
        with torch.no_grad():
            for p in model.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                local.add_(torch.randn(local.shape, generator=g) * 0.05)
        generation.sync_weights()  # every rank, as TRL calls it
        full = {n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()}
        if rank == 0:
            reference.load_state_dict(full, strict=False)
            served, version = trl_helpers.served_logprobs(url, trl_helpers.FIXED)
            versions.append((generation.version, version))
            diffs.append(max(abs(a - b) for a, b in zip(served, trl_helpers.model_logprobs(reference, trl_helpers.FIXED))))
    generation.close()
    return {"sharded": all(isinstance(p, DTensor) for p in model.parameters()), "versions": versions, "diffs": diffs,
            "publishes": generation._publishes}
