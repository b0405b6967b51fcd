"""``GRPOConfig``: the trainer's settings, the policy's shape and the weight sync, from one YAML file.

Any key can be overridden from the command line as ``dotted.key=value`` (the value is parsed as
YAML), e.g. ``weight_sync.async_weight_update=true steps=20``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from asyncsync.config import ConfigError, WeightSyncConfig, from_mapping
from asyncsync.grpo.task import VOCAB_SIZE
from asyncsync.models import ModelConfig

SERVER_KINDS = ("reference", "vllm")  # what the demo can start itself


@dataclass(frozen=True)
class GRPOConfig:
    """One GRPO run. With ``weight_sync.servers`` empty the run starts ``num_servers`` servers of
    ``server_kind`` itself (reference servers, or stock vLLM servers of the policy's checkpoint) and
    stops them at the end. ``link_gbit``: the emulated link of the ``link`` regime (``asyncsync
    grpo --regimes host,link``: trainer and servers as if on different hosts)."""

    steps: int = 60
    prompts_per_step: int = 16
    group_size: int = 8
    temperature: float = 1.0
    lr: float = 1e-3
    clip_eps: float = 0.2
    ppo_epochs: int = 2
    seed: int = 0
    num_servers: int = 2
    server_kind: str = "reference"
    link_gbit: float = 4.0
    trainer_ranks: int = 1  # > 1: the policy is fully_shard-ed (FSDP2) over that many spawned CPU ranks (gloo)
    simulate_step_s: float = 0.0
    policy: ModelConfig = field(default_factory=lambda: ModelConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128))
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)

    def __post_init__(self) -> None:
        for key in ("steps", "prompts_per_step", "group_size", "ppo_epochs", "num_servers", "trainer_ranks"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{key}: expected an integer >= 1, got {v!r}")
        if self.group_size < 2:
            raise ConfigError(f"group_size: GRPO normalises rewards within a group, so it needs >= 2, got {self.group_size}")
        for key in ("temperature", "lr", "clip_eps", "simulate_step_s"):
            v = getattr(self, key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"{key}: expected a number >= 0, got {v!r}")
        if self.server_kind not in SERVER_KINDS:
            raise ConfigError(f"server_kind: expected one of {list(SERVER_KINDS)}, got {self.server_kind!r}")
        if not isinstance(self.link_gbit, (int, float)) or isinstance(self.link_gbit, bool) or not self.link_gbit > 0:
            raise ConfigError(f"link_gbit: expected a rate in gbit/s > 0, got {self.link_gbit!r}")
        if self.temperature == 0:
            raise ConfigError("temperature: GRPO needs sampling; use a temperature > 0")
        if self.policy.vocab_size < VOCAB_SIZE:
            raise ConfigError(f"policy.vocab_size: the addition task needs at least {VOCAB_SIZE} tokens")

    @classmethod
    def load(cls, path: str | Path | None, overrides: list[str] = ()) -> GRPOConfig:  # type: ignore[assignment]
        data: dict[str, Any] = {}
        if path is not None:
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        for item in overrides:
            apply_override(data, item)
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GRPOConfig:
        return from_mapping(cls, data)


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set ``dotted.key=value`` in a nested mapping; the value is parsed as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {item!r}: expected key=value, e.g. weight_sync.async_weight_update=true")
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {item!r}: '{part}' is not a section")
        node = child
    node[parts[-1]] = _scalar(raw)


def _scalar(raw: str) -> Any:
    """YAML's reading of a value, plus numbers YAML 1.1 leaves as strings (``1e-4``)."""
    value = yaml.safe_load(raw)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    return value
