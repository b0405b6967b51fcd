"""What each part of the trainer needs of an inference server: one small Protocol per consumer.

Every engine kind's client (``EngineClient``, one per server) is all of these; each consumer names
only the one it uses, as vLLM's ``VLLMWeightSyncClient`` names the four calls of a weight update::

    DataPlaneMember   transport.epochs   world_size, claim, host_identity, init_group, release
    UpdateTarget      transport.phases   begin, update, end, abort (a version of the weights)
    ConnectChecks     trainer.connect    expected_names, check_layout, check_adapter, serves_base, staging_bytes
    Generator         grpo, verify, TRL  generate, score, version, health
    AdapterReceiver   transport.kinds    begin_adapter, update_adapter, end_adapter (a version of an adapter)
    AdapterHost       transport.adapters load_adapter, unload_adapter, adapter_versions

Each call raises ``ServerError`` naming the server on failure; ``EngineClient``'s docstring gives
the order the trainer calls them in.
"""

from __future__ import annotations

from typing import Protocol

from asyncsync.engines.base import DataPlaneProtocol, Generation, Phase, Scored
from asyncsync.protocol.lora import AdapterCheck, AdapterUpdate, BaseCheck
from asyncsync.protocol.shm import HostIdentity
from asyncsync.protocol.wire import GroupSpec, LayoutCheck, UpdateRequest


class Server(Protocol):
    """Which server, of which kind, receiving how."""

    @property
    def url(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def protocol(self) -> DataPlaneProtocol: ...


class DataPlaneMember(Server, Protocol):
    """Joining the trainer's data-plane groups, epoch by epoch (``transport.epochs``)."""

    async def world_size(self) -> int: ...

    async def claim(self, takeover: bool) -> None: ...

    async def host_identity(self) -> HostIdentity | None: ...

    async def init_group(self, specs: tuple[GroupSpec, ...], rank_offset: int,
                         relay: tuple[GroupSpec, ...] = ()) -> None: ...

    async def release(self) -> None: ...


class UpdateTarget(Server, Protocol):
    """One version of the weights (``transport.phases``); ``calls`` bounds each phase's deadline, and
    what the last ``end`` left: ``holds`` (shared-memory segments still mapped), ``last_switch_s``."""

    holds: frozenset[str]
    last_switch_s: float | None

    @property
    def receives_in_background(self) -> bool: ...

    def calls(self, phase: Phase, buckets: int) -> int: ...

    async def begin(self, version: int) -> None: ...

    async def update(self, request: UpdateRequest) -> None: ...

    async def end(self, version: int, digests: tuple[str, ...] = ()) -> int: ...

    async def abort(self, version: int) -> None: ...


class ConnectChecks(Server, Protocol):
    """What ``connect`` asks before the first version: the names, whether the plan (or the adapter)
    would be refused, whether the base is served already, and what the server stages a version in."""

    async def expected_names(self) -> frozenset[str] | None: ...

    async def check_layout(self, check: LayoutCheck) -> str | None: ...

    async def check_adapter(self, check: AdapterCheck) -> str | None: ...

    async def serves_base(self, check: BaseCheck) -> bool | None: ...

    def staging_bytes(self, version_bytes: int, ranks: int) -> int | None: ...


class Generator(Server, Protocol):
    """Rollouts and the served check: what the weights it serves compute."""

    async def generate(self, prompt: list[int], n: int, max_new_tokens: int, temperature: float, seed: int,
                       adapter: str | None = None) -> Generation: ...

    async def score(self, tokens: list[int]) -> Scored: ...

    async def version(self) -> int: ...

    async def health(self) -> None: ...


class AdapterReceiver(Server, Protocol):
    """One version of an adapter (``lora: adapter``), verified and written by the receiver."""

    async def begin_adapter(self, version: int) -> None: ...

    async def update_adapter(self, update: AdapterUpdate) -> None: ...

    async def end_adapter(self, version: int, digests: tuple[str, ...] = ()) -> None: ...


class AdapterHost(Server, Protocol):
    """The engine's own adapter API: loading, unloading and listing versions."""

    async def load_adapter(self, name: str, path: str, timeout_s: float) -> None: ...

    async def unload_adapter(self, name: str) -> None: ...

    async def adapter_versions(self, name: str) -> list[int]: ...
