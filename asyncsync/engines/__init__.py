"""Engine clients behind one protocol; importing this package registers the built-in kinds."""

from asyncsync.engines import reference, sglang, vllm  # noqa: F401  (register their kinds)
from asyncsync.engines.base import EngineClient, make_engine, register_engine

__all__ = ["EngineClient", "make_engine", "register_engine"]
