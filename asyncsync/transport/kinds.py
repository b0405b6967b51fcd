"""What a version is to the servers: its calls, and what a server that took it now holds.

``send_version`` moves every kind of version the same way (announce, deliver, repair); the kind
supplies what differs, so the send path has no branch on it::

    await kind.begin(engine, version)       # prepare (vLLM: pause generation, open an update session)
    await kind.update(engine, request)      # answered once the server received and verified it
    served = await kind.end(engine, version, digests)   # it applies it (digests: commit only those bytes)
    kind.confirm(book, engine, version, served, result)   # the book's transition for a server that took it
    kind.after(took, version, book)         # once the trainer ranks were released (adapter loads)
    version = await kind.served(engine)     # the version a server serves, as this kind counts versions

``Weights`` are the model's tensors (the default). ``AdapterVersions`` (``lora: adapter``) are a PEFT
adapter's: each server verifies and writes the adapter's directory, then its engine loads it under
``<name>-v<N>`` off every collective (``transport.adapters``); a server's version is the newest
adapter version it serves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

from asyncsync.engines.base import EngineClient
from asyncsync.engines.protocols import AdapterReceiver, UpdateTarget
from asyncsync.metrics import SyncResult
from asyncsync.protocol.lora import AdapterUpdate
from asyncsync.protocol.wire import UpdateRequest
from asyncsync.transport.adapters import AdapterLoads
from asyncsync.transport.book import ServerBook


class VersionKind(ABC):
    """The calls of one kind of version (the module doc); each kind calls the engine through its own
    Protocol (``engines.protocols``: ``UpdateTarget``, ``AdapterReceiver``)."""

    relayed: ClassVar[bool]  # with a relay, its servers end as soon as they received it and are repaired

    @abstractmethod
    async def served(self, engine: EngineClient) -> int: ...

    @abstractmethod
    async def begin(self, engine: Any, version: int) -> None: ...

    @abstractmethod
    async def update(self, engine: Any, request: UpdateRequest) -> None: ...

    @abstractmethod
    async def end(self, engine: Any, version: int, digests: tuple[str, ...]) -> int:
        """Apply ``version``; ``digests``: the trainer's of every bucket, where it was announced with
        them (``protocol/digest.py``): the server commits only bytes that hash to these."""

    @abstractmethod
    def confirm(self, book: ServerBook, engine: EngineClient, version: int, served: int, result: SyncResult) -> None:
        """``engine`` ended ``version`` and serves ``served``: the book's transition."""

    def after(self, took: list[EngineClient], version: int, book: ServerBook) -> None:
        """Once the version is over on every trainer rank: nothing (an adapter's are loaded then)."""


class Weights(VersionKind):
    """A version of the model's weights: committed whole by each server, its next delta's baseline."""

    relayed = True

    async def served(self, engine: EngineClient) -> int:
        return await engine.version()

    async def begin(self, engine: UpdateTarget, version: int) -> None:
        await engine.begin(version)

    async def update(self, engine: UpdateTarget, request: UpdateRequest) -> None:
        await engine.update(request)

    async def end(self, engine: UpdateTarget, version: int, digests: tuple[str, ...]) -> int:
        return await engine.end(version, digests)

    def confirm(self, book: ServerBook, engine: EngineClient, version: int, served: int, result: SyncResult) -> None:
        if served == version:
            book.took(engine.url, version, engine.holds)
        else:  # it serves another version than it was sent: no delta base
            book.reported(engine.url, served)
            book.missed(engine.url)
        if engine.last_switch_s is not None:
            result.switch_s[engine.url] = engine.last_switch_s


class AdapterVersions(VersionKind):
    """A version of a PEFT adapter (``lora: adapter``): written by each server, then loaded by its engine."""

    relayed = False  # adapters are small and go direct; a server that missed one gets the next

    def __init__(self, loads: AdapterLoads):
        self.loads = loads

    async def served(self, engine: EngineClient) -> int:
        return max(await engine.adapter_versions(self.loads.name), default=0)

    async def begin(self, engine: AdapterReceiver, version: int) -> None:
        await engine.begin_adapter(version)

    async def update(self, engine: AdapterReceiver, request: UpdateRequest) -> None:
        await engine.update_adapter(AdapterUpdate(request, self.loads.target(engine.url, request.version)))

    async def end(self, engine: AdapterReceiver, version: int, digests: tuple[str, ...]) -> int:
        await engine.end_adapter(version, digests)
        return version  # written; served once loaded

    def confirm(self, book: ServerBook, engine: EngineClient, version: int, served: int, result: SyncResult) -> None:
        book.wrote(engine.url)

    def after(self, took: list[EngineClient], version: int, book: ServerBook) -> None:
        self.loads.offer(took, version, book.loaded)


WEIGHTS = Weights()
