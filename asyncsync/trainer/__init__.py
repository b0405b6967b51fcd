"""The trainer's side: ``WeightSync`` (the facade), the async worker, the buffers versions are packed
into, the weights view, stream ordering and metrics. Transport lives in ``asyncsync.transport``."""
