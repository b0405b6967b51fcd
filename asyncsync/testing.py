"""Models for tests: what real checkpoints mix in, so the data plane is exercised on all of it."""

from __future__ import annotations

import torch

from asyncsync.models import ModelConfig, build_model
from asyncsync.receivers.reference.app import Faults
from asyncsync.receivers.reference.launch import ServerProcess, running

__all__ = ["Faults", "ServerProcess", "mixed_dtype_model", "running"]


def mixed_dtype_model(cfg: ModelConfig) -> torch.nn.Module:
    """``build_model`` plus what real checkpoints mix in: a bf16 embedding and final norm, an int64
    buffer and a 0-dim fp32 buffer (greedy decoding still works: Qwen2's RMSNorm upcasts)."""
    model = build_model(cfg)
    model.model.embed_tokens.to(torch.bfloat16)
    model.model.norm.to(torch.bfloat16)
    model.register_buffer("token_counts", torch.zeros(cfg.vocab_size, dtype=torch.int64))
    model.register_buffer("temperature_scale", torch.tensor(1.0))
    return model
