"""GRPO on the inference servers with asyncsync moving the weights: the demo and the benchmark workload."""

from asyncsync.grpo.config import GRPOConfig
from asyncsync.grpo.loop import RunSummary, run_grpo

__all__ = ["GRPOConfig", "RunSummary", "run_grpo"]
