"""asyncsync: move model weights from an RL trainer to its inference servers without stalling training.

The names below are imported on first use (PEP 562), so ``import asyncsync.protocol`` in a receiver
loads nothing of the trainer's stack.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "WeightSync": "asyncsync.trainer.sync",
    "WeightSyncConfig": "asyncsync.config",
    "ServerConfig": "asyncsync.config",
    "ConfigError": "asyncsync.config",
    "SyncResult": "asyncsync.metrics",
    "SyncError": "asyncsync.transport.fleet",
    "TensorSpec": "asyncsync.protocol.specs",
    "Bucket": "asyncsync.protocol.specs",
    "BucketPlan": "asyncsync.protocol.specs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncsync' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
