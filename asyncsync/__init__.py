"""asyncsync: move model weights from an RL trainer to its inference servers without stalling training."""

from asyncsync.config import ConfigError, ServerConfig, WeightSyncConfig
from asyncsync.plan import Bucket, BucketPlan, TensorSpec
from asyncsync.metrics import SyncResult
from asyncsync.sync import WeightSync
from asyncsync.transfer import SyncError

__all__ = [
    "Bucket", "BucketPlan", "ConfigError", "ServerConfig", "SyncError", "SyncResult", "TensorSpec",
    "WeightSync", "WeightSyncConfig",
]
