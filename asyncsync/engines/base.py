"""The one small protocol every inference engine speaks to the trainer."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from asyncsync.config import ServerConfig
from asyncsync.protocol.shm import HostIdentity
from asyncsync.protocol.wire import GroupSpec, UpdateRequest
from asyncsync.transport.control import CLIENT_KEEPALIVE_S, HttpClient, ServerError

log = logging.getLogger(__name__)

Phase = Literal["begin", "update", "end", "abort"]


class UnsupportedServer(ServerError):
    """The server runs a setup its engine client can never sync (SGLang with data-parallel replicas,
    say): a configuration to change, not a fault to wait out. Raised by ``world_size``; ``connect``
    raises it instead of starting without that server."""


@dataclass(frozen=True)
class Generation:
    """``n`` completions of one prompt and the weight version that generated them."""

    completions: list[list[int]]
    version: int


@dataclass(frozen=True)
class DataPlaneProtocol:
    """How a kind of receiver takes part in its data-plane group. The trainer builds one group per
    protocol (servers whose protocols are equal share it) and broadcasts every bucket into each."""

    name: str
    warmup: bool               # every member joins with one warm-up broadcast
    checksum_manifest: bool    # a request with ``checksum`` is followed by the CRC32C manifest broadcast
    single_dtype_buckets: bool  # every bucket must hold tensors of one dtype
    multi_group: bool = False   # a server can join several groups, one per owning trainer rank


# asyncsync's own receivers: the reference server and asyncsync's vLLM weight-transfer engine.
ASYNCSYNC_PROTOCOL = DataPlaneProtocol("asyncsync", warmup=True, checksum_manifest=True, single_dtype_buckets=False,
                                       multi_group=True)


class EngineClient(ABC):
    """The trainer's view of one inference server.

    Contract, per server and in this order::

        n = await client.world_size()                 # data-plane ranks the server contributes
        await client.claim(takeover)                  # the server is this trainer session's (or 423)
        host = await client.host_identity()           # same host as the trainer: shared memory, no group
        await client.init_group(spec, rank_offset)    # answered once the server's ranks joined (not
                                                      # for a server on shared memory)
        names = await client.expected_names()         # at connect: the tensor names it loads, or None
        for version in versions:
            await client.begin(version)
            await client.update(request)              # answered after the server received the buckets;
                                                      # the trainer broadcasts them concurrently
            live = await client.end(version)          # the server now serves `live`
            # or, when begin/update/end failed or missed its deadline:
            await client.abort(version)               # undo whatever begin left open
        gen = await client.generate(prompt, n, ...)   # rollouts, tagged with the version used
        await client.release()                        # the server may serve another trainer now
        await client.close()

    ``update`` is sent before the broadcast starts and awaited after it, so no collective ever waits
    on an HTTP answer. Every call raises ``ServerError`` naming the server on failure. Engine policies
    (pausing generation, resetting the prefix cache, an update session) live in ``begin`` and ``end``.
    The trainer enforces one deadline per phase, ``calls(phase) x deadlines.http_s`` (each HTTP call
    has ``http_s`` of its own); a phase that fails or misses its deadline is followed by ``abort``,
    so no server is ever left paused or inside an update session.
    """

    kind: ClassVar[str]
    protocol: ClassVar[DataPlaneProtocol] = ASYNCSYNC_PROTOCOL
    keepalive_s: ClassVar[float] = CLIENT_KEEPALIVE_S  # must stay below the server's idle timeout

    def __init__(self, server: ServerConfig, timeout_s: float, session: str | None = None):
        self.server = server
        self.session = session  # the trainer session this client speaks for (sent with every call)
        self.http = HttpClient(server.base_url, server.token, timeout_s, self.keepalive_s, session=session)
        # The trainer's shared-memory segments the server still maps, as its last ``end`` answered.
        self.holds: frozenset[str] = frozenset()

    @property
    def url(self) -> str:
        return self.server.base_url

    @abstractmethod
    async def world_size(self) -> int: ...

    async def claim(self, takeover: bool) -> None:
        """Make the server this client's trainer session's before a group is formed with it; raises
        ``ServerError`` with status ``OWNED_STATUS`` (423) when another trainer session owns it.
        Servers that track no owner (vLLM, SGLang: see docs/faults.md) keep this default: nothing."""

    async def release(self) -> None:
        """Tell the server this trainer session is done with it (its ``close()``); best effort."""

    async def host_identity(self) -> HostIdentity | None:
        """Whose shared memory the server sees (``protocol/shm.py``), or None when it cannot tell or
        cannot receive from shared memory (the default): then it gets the data-plane broadcast, unless
        the config says ``transport: shm``."""
        return None

    @abstractmethod
    async def init_group(self, specs: tuple[GroupSpec, ...], rank_offset: int) -> None:
        """Join ``specs`` (one group, or one per owning trainer rank when ``protocol.multi_group``)."""

    async def expected_names(self) -> frozenset[str] | None:
        """The tensor names the server checks every version against, or None when it cannot tell (the
        default). The trainer uses them only to decide whether a tied weight's second name
        (``lm_head.weight``) is sent: a server that cannot tell is taken to expect a checkpoint saved
        from the model, which stores a tied weight once (``trainer.source.TiedNames``)."""
        return None

    @abstractmethod
    async def begin(self, version: int) -> None: ...

    @abstractmethod
    async def update(self, request: UpdateRequest) -> None: ...

    @abstractmethod
    async def end(self, version: int) -> int: ...

    async def abort(self, version: int) -> None:
        """Undo what ``begin`` left open (generation paused, an update session) after ``begin``,
        ``update`` or ``end`` failed. A server that will not take part in the rest of the version's
        broadcasts (it refused before receiving) must also make them fail rather than wait, e.g. by
        leaving the group: the trainer is broadcasting while this runs and would otherwise wait for
        ``collective_s``. Idempotent, and never raises: a failure here is logged, as the version's
        failure is already being reported. Engines with nothing to undo keep this default."""

    def calls(self, phase: Phase, buckets: int) -> int:
        """The most HTTP calls ``phase`` makes for a version of ``buckets`` buckets: the phase's
        deadline is this many times ``deadlines.http_s``."""
        return 1

    @abstractmethod
    async def version(self) -> int: ...

    @abstractmethod
    async def generate(self, prompt: list[int], n: int, max_new_tokens: int, temperature: float, seed: int) -> Generation:
        """Sample ``n`` completions of exactly ``max_new_tokens`` tokens (no early stop at EOS)."""

    async def health(self) -> None:
        """Return if the server answers ``GET /health`` with success; raise ``ServerError`` otherwise."""
        await self.http.get("/health")

    async def best_effort(self, call: Awaitable[Any], what: str) -> None:
        """Run a call whose failure must not hide the one already being reported: logged, not raised."""
        try:
            await call
        except ServerError as e:
            log.warning("%s: could not %s: %s", self.url, what, e)

    async def close(self) -> None:
        await self.http.close()


def parse_weight_version(url: str, value: Any) -> int:
    """A version reported by vLLM or SGLang (a string; ``"default"`` or null before any update) as an int."""
    if value is None or value == "default":
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ServerError(url, f"reports weight version {value!r}, which asyncsync did not set: "
                               "versions set by asyncsync are integers") from None
