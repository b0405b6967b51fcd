"""The trainer's side: ``WeightSync`` (the facade), the async worker, the buffers versions are packed
into, the weights view and stream ordering. Transport lives in ``asyncsync.transport``; the metrics
and the trainer ranks' groups, which both use, in ``asyncsync.metrics`` and ``asyncsync.ranks``."""
