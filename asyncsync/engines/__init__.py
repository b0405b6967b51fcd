"""Engine clients by kind: a lazy registry of module paths (``asyncsync.registry.ENGINES``), as vLLM's
weight-transfer factory.

``servers[].kind`` in the configuration names one of these; the config refuses a kind that is not
registered when it loads (naming the key), and a client module is imported only when a server of its
kind is connected. A new engine registers before the config is loaded::

    from asyncsync.engines import register_engine
    register_engine("myengine", "mypackage.client:MyEngineClient")   # an EngineClient subclass
    sync = WeightSync.from_config({"servers": [{"url": "...", "kind": "myengine"}]})
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from asyncsync.registry import ENGINES

if TYPE_CHECKING:
    from asyncsync.config import ServerConfig
    from asyncsync.engines.base import EngineClient


def register_engine(kind: str, target: str) -> None:
    """Make ``kind`` usable in ``servers[].kind``; ``target`` is ``"package.module:ClassName"`` of an
    ``EngineClient`` subclass, imported when a server of that kind is first connected."""
    ENGINES.register(kind, target)


def engine_kinds() -> list[str]:
    return ENGINES.names()


def engine_class(kind: str) -> type[EngineClient]:
    from asyncsync.engines.base import EngineClient

    try:
        cls = ENGINES.load(kind)
    except KeyError:
        raise ValueError(f"no engine client for kind {kind!r}; registered kinds: {engine_kinds()}") from None
    if not (isinstance(cls, type) and issubclass(cls, EngineClient)):
        raise TypeError(f"engine kind {kind!r} points at {ENGINES.targets[kind]}, which is not an EngineClient subclass")
    return cls


def make_engine(server: ServerConfig, timeout_s: float, session: str | None = None) -> EngineClient:
    """A client for ``server``, of the class registered for its kind; ``timeout_s`` bounds each HTTP
    call; ``session`` is the trainer session it speaks for (None: a client that only reads, e.g. rollouts)."""
    return engine_class(server.kind).for_server(server, timeout_s, session)
