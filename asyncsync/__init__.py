"""asyncsync: move model weights from an RL trainer to its inference servers without stalling training."""

from asyncsync.config import ConfigError, ServerConfig, WeightSyncConfig
from asyncsync.plan import Bucket, BucketPlan, TensorSpec
from asyncsync.sync import SyncError, SyncResult, WeightSync

__all__ = [
    "Bucket", "BucketPlan", "ConfigError", "ServerConfig", "SyncError", "SyncResult", "TensorSpec",
    "WeightSync", "WeightSyncConfig",
]
