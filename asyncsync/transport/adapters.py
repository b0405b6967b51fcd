"""``lora: adapter``: each version written on a server is loaded into its engine, older ones unloaded.

``send_version`` moves an adapter version like any version (its bytes, verified; the receiver then
writes the PEFT directory: ``receivers/adapters.py``) and, once the trainer ranks were told the
version is done, hands every server that wrote it to ``AdapterLoads.offer``. From there it is the
control loop's business alone::

    loads = AdapterLoads(name, config, session, max_staleness, control, metrics, load_s)
    fleet.serve(AdapterVersions(loads))                  # the fleet's versions are the adapter's
    send_version(fleet, v, plan, source)                 # ..., then loads.offer(engines, v, book.loaded)
    loads.wait(v, urls, timeout)                            # blocking mode: the loads of v, or None yet
    loads.drain(timeout)                                    # close(): every load offered has ended

Per server, one task at a time on the control loop: load the newest version written (a version
overtaken while an earlier load ran is skipped: the newer one is loaded next) through the engine's
own API under ``<name>-v<N>`` from its directory, then unload the versions older than
``max_staleness`` behind it. A load that fails leaves the server serving what it served, and is
reported (a ``refused`` event naming the version); the other servers are not affected. No trainer
collective ever waits on a load: the trainer ranks were told the version is done before it starts,
and a blocking ``publish`` waits for it in short rounds (``WeightSync``), so a slow engine cannot
outlast the ranks' deadline.

Directories: ``slot`` (the trainer session's token and a hash of the server's URL) names the
server's folder of this trainer's versions; every update tells the receiver which versions to keep
(``AdapterVersion.keep``: the one being loaded, and those still served once the new one is), the
rest are removed.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from asyncsync.engines.protocols import AdapterHost
from asyncsync.protocol.lora import AdapterVersion, adapter_dir, version_name
from asyncsync.metrics import SyncMetrics
from asyncsync.control import ControlLoop, ServerError

log = logging.getLogger(__name__)


@dataclass
class _Server:
    """One server's adapter versions, as this trainer session knows them (touched on the control loop)."""

    slot: str
    loaded: set[int] = field(default_factory=set)  # registered with the engine by this session's loads
    written: int = 0        # the newest version the receiver wrote
    loading: int | None = None
    ended: int = 0          # the newest version whose load ended (loaded, failed or skipped)
    failures: dict[int, str] = field(default_factory=dict)
    task: Any = None


class AdapterLoads:
    """The loads of every server's adapter versions, off every trainer collective (module doc)."""

    def __init__(self, name: str, config: dict[str, Any], session: str, max_staleness: int, control: ControlLoop,
                 metrics: SyncMetrics, load_s: float):
        self.name, self.config, self.max_staleness = name, config, max_staleness
        self.control, self.metrics, self.load_s = control, metrics, load_s
        self._token = session.rsplit(":", 1)[-1]
        self._servers: dict[str, _Server] = {}
        self._cond = threading.Condition()  # woken whenever a load ends
        self.on_change: Callable[[], None] = lambda: None  # the async worker re-checks wait_served

    def _server(self, url: str) -> _Server:
        if url not in self._servers:
            self._servers[url] = _Server(f"{self._token}-{hashlib.sha1(url.encode()).hexdigest()[:8]}")
        return self._servers[url]

    def target(self, url: str, version: int) -> AdapterVersion:
        """Where version ``version`` goes on server ``url``, and which of its versions stay on disk:
        the one being loaded, and those still served once ``version`` is (within ``max_staleness``
        of it). The others are unloaded right after ``version`` loads; until then the engine holds
        them in memory (vLLM: ``--max-loras`` >= ``max_staleness + 2`` keeps every one cached)."""
        s = self._server(url)
        keep = {v for v in s.loaded | {s.written} if v >= version - self.max_staleness}
        if s.loading is not None:
            keep.add(s.loading)
        return AdapterVersion(self.name, s.slot, self.config, tuple(sorted(v for v in keep if v and v != version)))

    def path(self, url: str, version: int) -> str:
        return adapter_dir(self._server(url).slot, self.name, version)

    def offer(self, engines: Iterable[AdapterHost], version: int, loaded: Callable[[str, int], None]) -> None:
        """``version`` was written on each of ``engines``: load it there (``loaded(url, version)`` is
        told of each load: the book's transition). Returns at once."""
        listed = [(e, self._server(e.url)) for e in engines]

        async def start() -> None:  # on the loop, so a task about to end cannot miss the new version
            for e, s in listed:
                s.written = max(s.written, version)
                if s.task is None or s.task.done():
                    s.task = asyncio.ensure_future(self._run(e, s, loaded))

        self.control.submit(start())

    async def _run(self, engine: AdapterHost, s: _Server, loaded: Callable[[str, int], None]) -> None:
        while s.ended < s.written:
            version = s.loading = s.written
            try:
                await asyncio.wait_for(engine.load_adapter(version_name(self.name, version), self.path(engine.url, version),
                                                           self.load_s), self.load_s)
                s.loaded.add(version)
                loaded(engine.url, version)
                await self._unload_old(engine, s, version)
            except (ServerError, asyncio.TimeoutError) as e:
                reason = f"loading {version_name(self.name, version)} failed: {e or 'no answer within load_s'}"
                s.failures[version] = reason
                log.warning("%s: %s (it keeps serving %s)", engine.url, reason,
                            version_name(self.name, max(s.loaded)) if s.loaded else "no version of the adapter")
                self.metrics.event("refused", engine.url, version, reason)
            finally:
                s.loading = None
                with self._cond:
                    s.ended = version
                    self._cond.notify_all()
                self.on_change()

    async def _unload_old(self, engine: AdapterHost, s: _Server, newest: int) -> None:
        """Unload the versions more than ``max_staleness`` behind ``newest`` (each failure logged)."""
        for old in sorted(v for v in s.loaded if v < newest - self.max_staleness):
            try:
                await engine.unload_adapter(version_name(self.name, old))
                s.loaded.discard(old)
            except ServerError as e:
                log.warning("%s: could not unload %s: %s", engine.url, version_name(self.name, old), e)

    def adopt(self, url: str, versions: Iterable[int]) -> None:
        """Versions of the adapter the server already serves under its name (an earlier session's):
        unloaded like this session's once they fall behind."""
        self._server(url).loaded.update(versions)

    def wait(self, version: int, urls: Iterable[str], timeout: float) -> dict[str, int | str] | None:
        """Each server's outcome for ``version`` (the version it serves, or why its load failed) once
        every load of it ended; None if that did not happen within ``timeout``."""
        servers = [(u, self._servers[u]) for u in urls if u in self._servers]
        with self._cond:
            if not self._cond.wait_for(lambda: all(s.ended >= version for _, s in servers), timeout):
                return None
        return {u: self._outcome(s, version) for u, s in servers}

    def _outcome(self, s: _Server, version: int) -> int | str:
        if version in s.failures:
            return s.failures[version]
        newer = [v for v in s.loaded if v >= version]
        return max(newer) if newer else f"{version_name(self.name, version)} was not loaded"

    def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout``) for every load offered to end: ``close()``, after the last version."""
        with self._cond:
            self._cond.wait_for(lambda: all(s.ended >= s.written for s in self._servers.values()), timeout)
