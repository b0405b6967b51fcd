"""The one small protocol every inference engine speaks to the trainer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from asyncsync.config import ServerConfig
from asyncsync.control import HttpClient
from asyncsync.dataplane import GroupSpec
from asyncsync.wire import UpdateRequest


class EngineClient(ABC):
    """The trainer's view of one inference server.

    Contract, per server and in this order::

        n = await client.world_size()                 # data-plane ranks the server contributes
        await client.init_group(spec, rank_offset)    # answered once the server's ranks joined
        for version in versions:
            await client.begin(version)
            await client.update(request)              # answered after the server received the buckets;
                                                      # the trainer broadcasts them concurrently
            live = await client.end(version)          # the server now serves `live`
        await client.close()

    ``update`` is sent before the broadcast starts and awaited after it, so no collective ever waits
    on an HTTP answer. Every call raises ``ServerError`` naming the server on failure.
    """

    kind: str

    def __init__(self, server: ServerConfig, timeout_s: float):
        self.server = server
        self.http = HttpClient(server.base_url, server.token, timeout_s)

    @property
    def url(self) -> str:
        return self.server.base_url

    @abstractmethod
    async def world_size(self) -> int: ...

    @abstractmethod
    async def init_group(self, spec: GroupSpec, rank_offset: int) -> None: ...

    @abstractmethod
    async def begin(self, version: int) -> None: ...

    @abstractmethod
    async def update(self, request: UpdateRequest) -> None: ...

    @abstractmethod
    async def end(self, version: int) -> int: ...

    @abstractmethod
    async def version(self) -> int: ...

    async def close(self) -> None:
        await self.http.close()


_ENGINES: dict[str, type[EngineClient]] = {}


def register_engine(kind: str) -> Callable[[type[EngineClient]], type[EngineClient]]:
    """Class decorator: make an ``EngineClient`` available to ``servers[].kind`` in the config."""

    def wrap(cls: type[EngineClient]) -> type[EngineClient]:
        cls.kind = kind
        _ENGINES[kind] = cls
        return cls

    return wrap


def make_engine(server: ServerConfig, timeout_s: float) -> EngineClient:
    try:
        cls = _ENGINES[server.kind]
    except KeyError:
        raise ValueError(f"no engine client for kind {server.kind!r}; available: {sorted(_ENGINES)}") from None
    return cls(server, timeout_s)
