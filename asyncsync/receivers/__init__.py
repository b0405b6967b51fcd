"""Receivers that run inside inference servers: asyncsync's own reference server (``reference``) and
asyncsync's weight-transfer backend for vLLM (``vllm``). Both build on ``asyncsync.protocol``."""
