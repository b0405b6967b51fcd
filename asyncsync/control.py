"""The control plane: an asyncio loop on its own thread and one pooled aiohttp session per server.

The trainer's code is synchronous; everything that talks HTTP runs on this loop, submitted from the
trainer or the sync worker with ``ControlLoop.submit``. Each server gets its own ``ClientSession``
and ``TCPConnector`` reused for every call, with a keep-alive shorter than the servers' (aiohttp's
server closes idle connections after 75 s; reusing a socket it just closed gives ECONNRESET).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import aiohttp

log = logging.getLogger(__name__)
T = TypeVar("T")

CLIENT_KEEPALIVE_S = 30.0


class ServerError(RuntimeError):
    """A server answered with an error or not at all; the message names the server and the call."""

    def __init__(self, url: str, message: str, status: int | None = None):
        super().__init__(f"{url}: {message}")
        self.url, self.status = url, status


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

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


class HttpClient:
    """One server's pooled connection: JSON calls with a deadline and an optional bearer token."""

    def __init__(self, base_url: str, token: str | None = None, default_timeout_s: float = 120.0):
        self.base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout_s = default_timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=8, keepalive_timeout=CLIENT_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector, headers=self._headers)
        return self._session

    async def request(self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None) -> Any:
        """Call ``path`` and return the decoded JSON; any failure becomes a ``ServerError``."""
        timeout = aiohttp.ClientTimeout(total=timeout_s or self._timeout_s)
        url = self.base_url + path
        try:
            async with self._get_session().request(method, url, json=body, timeout=timeout) as resp:
                data = await resp.json(content_type=None) if resp.content_length != 0 else None
                if resp.status >= 400:
                    detail = data.get("error") if isinstance(data, dict) else data
                    raise ServerError(self.base_url, f"{method} {path} -> HTTP {resp.status}: {detail}", resp.status)
                return data
        except asyncio.TimeoutError:
            raise ServerError(self.base_url, f"{method} {path} got no answer within {timeout.total}s") from None
        except aiohttp.ClientError as e:
            raise ServerError(self.base_url, f"{method} {path} failed: {e!r}") from e

    async def get(self, path: str, timeout_s: float | None = None) -> Any:
        return await self.request("GET", path, None, timeout_s)

    async def post(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> Any:
        return await self.request("POST", path, body, timeout_s)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
