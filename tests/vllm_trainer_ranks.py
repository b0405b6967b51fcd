"""The trainer ranks of tests/test_vllm_trainer_api.py's FSDP2 case: each a spawned process running one
rank of a gloo world, driving vLLM's own trainer API (``WeightTransferTrainerFactory``,
``ModuleSource``, ``HTTPVLLMWeightSyncClient``) with the ``asyncsync`` engine on a ``fully_shard``-ed
Qwen2. Rank 0 reports, per round, what the server decodes and what the unsharded weights decode."""

from __future__ import annotations

import time
from typing import Any

import torch


def fsdp2_rounds(rank: int, world: int, url: str, model_cfg: Any, async_mode: bool, rounds: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient, ModuleSource, WeightTransferTrainerFactory

    from asyncsync.integrations.vllm import AsyncsyncTrainerInitInfo
    from asyncsync.models import build_model, generate
    from test_vllm_integration import PROMPT, greedy

    model = build_model(model_cfg)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    engine = WeightTransferTrainerFactory.trainer_init(
        AsyncsyncTrainerInitInfo(rank=rank, async_weight_update=async_mode, bucket_bytes="1MiB"),
        client=HTTPVLLMWeightSyncClient(url), source=ModuleSource(model))
    reference = build_model(model_cfg)  # rank 0 decodes the unsharded weights of every round
    g = torch.Generator().manual_seed(200 + rank)
    pairs = []
    try:
        for _ in range(rounds):
            with torch.no_grad():
                for p in model.parameters():
                    local = p.to_local() if isinstance(p, DTensor) else p
                    local.add_(torch.randn(local.shape, generator=g) * 0.3)
            engine.send_weights()  # every rank, in step
            full = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective, after the round
            if rank == 0:
                version = engine.version
                if async_mode:
                    wait_served(url, version)
                reference.load_state_dict(full, strict=False)
                served, served_version = greedy(url)
                pairs.append({"version": version, "served_version": served_version, "served": served,
                              "trainer": generate(reference, PROMPT, 16)[0]})
    finally:
        engine.shutdown()
    return {"sharded": all(isinstance(p, DTensor) for p in model.parameters()), "rounds": pairs,
            "sender": engine.is_sender}


def wait_served(url: str, version: int, timeout_s: float = 120.0) -> None:
    """Until the server serves ``version`` (async rounds land in the background); bounded."""
    import json
    import urllib.request

    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        with urllib.request.urlopen(url + "/weight_info", timeout=10) as resp:
            if json.loads(resp.read())["weight_version"] == str(version):
                return
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not serve version {version} within {timeout_s:.0f}s")
