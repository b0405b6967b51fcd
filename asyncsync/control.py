"""The control plane: an asyncio loop on its own thread and one pooled aiohttp session per server.

The trainer's code is synchronous; everything that talks HTTP runs on this loop, submitted from the
trainer or the sync worker with ``ControlLoop.submit``. Each server gets its own ``ClientSession``
and ``TCPConnector`` reused for every call, with a keep-alive shorter than the server's: reusing a
socket the server just closed as idle gives ECONNRESET. Servers close idle sockets after 75 s
(aiohttp, the reference server) or 5 s (uvicorn: vLLM and SGLang), so each engine kind picks its own;
a keep-alive of None reuses no connection (vLLM's client: uvicorn also closes a connection right
after answering 500 for an RPC that raised, and the next call, often a discard that is never
retried, would go out on it).

Every call has a deadline covering all its attempts. Only idempotent calls (reads such as
``/version``) are retried, with exponential backoff, and only after failures that say nothing was
done (no connection, or 502/503/504): an update that may have been applied is never sent twice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import aiohttp

from asyncsync.protocol.wire import SESSION_HEADER

log = logging.getLogger(__name__)
T = TypeVar("T")

AIOHTTP_SERVER_KEEPALIVE_S = 75.0  # aiohttp.web's default idle timeout
UVICORN_KEEPALIVE_S = 5.0          # uvicorn's default, used by vLLM and SGLang
CLIENT_KEEPALIVE_S = 30.0          # default for our pools: well below the aiohttp server's
RETRYABLE_STATUS = frozenset({502, 503, 504})


class ServerError(RuntimeError):
    """A server answered with an error or not at all; the message names the server and the call.
    ``detail`` is the server's own message from its answer's body, when it had one."""

    def __init__(self, url: str, message: str, status: int | None = None, timed_out: bool = False,
                 detail: Any = None):
        super().__init__(f"{url}: {message}")
        self.url, self.status, self.timed_out, self.detail = url, status, timed_out, detail

    @property
    def transient(self) -> bool:
        """The server was unreachable or said it is momentarily unable to answer: nothing was done."""
        return self.status in RETRYABLE_STATUS or (self.status is None and not self.timed_out)


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop

        return uvloop.new_event_loop()
    except ImportError:
        return asyncio.new_event_loop()


class ControlLoop:
    """An event loop running on a daemon thread; ``submit`` hands it a coroutine from any thread."""

    def __init__(self) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="asyncsync-control", daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def call_all(self, servers: Sequence[HasUrl], call: Callable[[Any], Awaitable[Any]], what: str,
                 deadline_s: float) -> dict[str, Any]:
        """``call`` on every server concurrently, each within ``deadline_s`` (``ServerError`` naming the
        server and ``what`` past it); each server's result or exception, by URL."""
        return self.run(gather(servers, lambda s: within(s.url, call(s), deadline_s, what)), deadline_s + 5)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class HasUrl(Protocol):
    @property
    def url(self) -> str: ...


async def within(url: str, call: Awaitable[T], deadline_s: float, what: str) -> T:
    """Await ``call``, or raise ``ServerError`` (timed out) naming ``url`` and ``what`` at the deadline."""
    try:
        return await asyncio.wait_for(call, deadline_s)
    except asyncio.TimeoutError:
        raise ServerError(url, f"{what} missed its deadline of {deadline_s:.1f}s", timed_out=True) from None


async def gather(servers: Sequence[HasUrl], call: Callable[[Any], Awaitable[Any]]) -> dict[str, Any]:
    """Call every server concurrently; each server's result or exception, keyed by URL."""
    results = await asyncio.gather(*(call(s) for s in servers), return_exceptions=True)
    return {s.url: r for s, r in zip(servers, results)}


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts and backoff for idempotent calls; the delay doubles after each failed attempt."""

    attempts: int = 4
    first_delay_s: float = 0.05
    max_delay_s: float = 2.0

    def delay(self, attempt: int) -> float:
        return min(self.first_delay_s * 2**attempt, self.max_delay_s)


class HttpClient:
    """One server's pooled connections: JSON calls with a deadline, an optional bearer token, and the
    trainer's session id in ``SESSION_HEADER`` (servers that track their owner renew its lease).

    ``get`` is retried (see ``RetryPolicy``); ``post`` is not, unless the caller says the call is
    idempotent. Any failure becomes a ``ServerError`` naming the server, the call and the cause.
    """

    def __init__(self, base_url: str, token: str | None = None, default_timeout_s: float = 120.0,
                 keepalive_s: float | None = CLIENT_KEEPALIVE_S, retry: RetryPolicy = RetryPolicy(),
                 session: str | None = None):
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        if session:
            self._headers[SESSION_HEADER] = session
        self._timeout_s = default_timeout_s
        self._keepalive_s = keepalive_s
        self._retry = retry
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            if self._keepalive_s is None:  # a new connection for every call
                connector = aiohttp.TCPConnector(limit=8, force_close=True)
            else:
                connector = aiohttp.TCPConnector(limit=8, keepalive_timeout=self._keepalive_s)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

    async def request(self, method: str, path: str, body: Mapping[str, Any] | None = None,
                      timeout_s: float | None = None, idempotent: bool = False,
                      params: Mapping[str, str] | None = None,
                      retry_while: Callable[[ServerError], bool] | None = None) -> Any:
        """Call ``path`` and return the decoded JSON (or text, or None for an empty body).

        The deadline ``timeout_s`` bounds the whole call, retries included. ``retry_while``: an answer
        that says the call was not run and may be repeated (a paused engine's), retried until the
        deadline whatever the call.
        """
        deadline = time.monotonic() + (timeout_s or self._timeout_s)
        attempt = 0
        while True:
            try:
                return await self._once(method, path, body, params, deadline - time.monotonic())
            except ServerError as e:
                attempt += 1
                pause = self._retry.delay(attempt - 1)
                again = (idempotent and e.transient and attempt < self._retry.attempts) or \
                    (retry_while is not None and retry_while(e))
                if not again or time.monotonic() + pause >= deadline:
                    raise
                log.info("%s: retrying %s %s in %.2fs (attempt %d of %d): %s",
                         self.base_url, method, path, pause, attempt + 1, self._retry.attempts, e)
                await asyncio.sleep(pause)

    async def _once(self, method: str, path: str, body: Mapping[str, Any] | None,
                    params: Mapping[str, str] | None, timeout_s: float) -> Any:
        where = f"{method} {path}"
        try:
            async with self._get_session().request(
                method, self.base_url + path, json=body, params=params, timeout=aiohttp.ClientTimeout(total=timeout_s)
            ) as resp:
                data = _decode(await resp.text())
                if resp.status >= 400:
                    detail = _detail(data)
                    raise ServerError(self.base_url, f"{where} -> HTTP {resp.status}: {detail}", resp.status, detail=detail)
                return data
        except asyncio.TimeoutError:
            raise ServerError(self.base_url, f"{where} got no answer within {timeout_s:.1f}s", timed_out=True) from None
        except aiohttp.ClientError as e:
            raise ServerError(self.base_url, f"{where} failed: {e!r}") from e

    async def get(self, path: str, timeout_s: float | None = None, params: Mapping[str, str] | None = None) -> Any:
        return await self.request("GET", path, None, timeout_s, idempotent=True, params=params)

    async def post(self, path: str, body: Mapping[str, Any] | None = None, timeout_s: float | None = None,
                   params: Mapping[str, str] | None = None, idempotent: bool = False,
                   retry_while: Callable[[ServerError], bool] | None = None) -> Any:
        """``idempotent=True`` only for a call that is harmless to repeat, such as resuming generation."""
        return await self.request("POST", path, body, timeout_s, idempotent, params, retry_while)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def _decode(text: str) -> Any:
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def _detail(data: Any) -> Any:
    """The error message inside the body shapes our servers, vLLM (FastAPI) and SGLang answer with."""
    if isinstance(data, dict):
        detail = data.get("error") or data.get("message") or data.get("detail") or data
        return detail.get("message", detail) if isinstance(detail, dict) else detail
    return data
