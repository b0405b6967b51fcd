"""Models for the served check's tests (``tests/test_verify.py``): built in the test and, the same way,
in a spawned reference server's process (``ServerProcess(factory, args)``), so both hold the same
bytes. What differs is how they compute: in training mode (dropout, a sampled router), or on the
server's side only (a NaN head, another norm epsilon), as no byte of a version can show."""

from __future__ import annotations

import torch

from asyncsync.families import build
from asyncsync.models import ModelConfig, build_model

NAN_TOKEN = 7  # the token id whose logit the NaN head computes as NaN


def dropout_model(cfg: ModelConfig, p: float = 0.3) -> torch.nn.Module:
    """``build_model(cfg)`` with attention dropout ``p`` (eager attention applies it in training mode)."""
    model = build_model(cfg)
    model.config.attention_dropout = p
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = p
    return model


def stochastic_phimoe() -> torch.nn.Module:
    """The tiny PhiMoE (``families.build``) with its router's sparsemixer sampling among every expert
    in training mode (a jitter epsilon that masks none: Gumbel sampling, as Phi-3.5-MoE trains) and
    its input jitter on: in training mode two forwards of the same tokens differ."""
    model = build("phimoe")
    for module in model.modules():
        if hasattr(module, "router_jitter_noise"):
            module.router_jitter_noise, module.input_jitter_noise = 1.0, 0.1
    return model


def nan_head_model(cfg: ModelConfig) -> torch.nn.Module:
    """``build_model(cfg)`` whose head computes NaN for ``NAN_TOKEN``'s logit (a hook: no byte differs),
    as a server with a broken derived state might: every log-probability of its softmax is NaN."""
    model = build_model(cfg)

    def nan_logit(module: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
        out = out.clone()
        out[..., NAN_TOKEN] = float("nan")
        return out

    model.get_output_embeddings().register_forward_hook(nan_logit)
    return model


def other_norm_eps_model(cfg: ModelConfig, eps: float = 0.1) -> torch.nn.Module:
    """``build_model(cfg)`` (the same bytes) computed with RMSNorm epsilon ``eps`` instead of 1e-6: a
    server whose configuration of the family differs from the trainer's, with no asyncsync involved."""
    model = build_model(cfg)
    model.config.rms_norm_eps = eps
    for module in model.modules():
        if hasattr(module, "variance_epsilon"):
            module.variance_epsilon = eps
    return model
