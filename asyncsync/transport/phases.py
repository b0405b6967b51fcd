"""The HTTP phases of one version on one server, each within its own deadline, run on the control loop.

    phases = Phases(kind, http_s, buckets, ends_early, digested)
    future = control.submit(phases.begin_and_update(engine, request))   # before the first broadcast
    phases.until_begun({url: future}, engines)                          # every server can receive now
    ...the data path...; phases.digested_as(digests)                  # the trainer's digests of what it sent
    answers = collect({url: future}, phases.update_s(engines))          # after the last one
    served = await phases.end(engine, version)

Each phase has its own deadline, ``engine.calls(phase, buckets) x http_s`` (vLLM's ``begin`` is two
calls with its pause, SGLang's ``update`` one per bucket), and a relayed server's ``update`` and
``end`` also the time the version takes to reach it below its tree's root (``reach``:
``transport.relay.reach_s``), so a deep server is not given up on for its depth; each deadline is
enforced inside the control loop. The first broadcast waits for every server's ``begin``
(``until_begun``): a server that pauses lets the requests in flight finish first (vLLM's
``mode=wait``, SGLang's pause), and until then it is not receiving, which no broadcast deadline may
count (``transport.pace`` measures the wire, not a server's last requests). A phase
that fails or misses it is followed by ``abort`` (resume generation, close an update session), so no
server is left paused. A server in ``ends_early`` (a relayed one) is sent ``end`` as soon as its
``update`` answered: it serves the version then, not once the slowest server received it. A server in
``digested`` (its request announced digests) gets the trainer's digests with ``end``: its ``end`` waits
for the data path to have hashed every bucket. The trainer's waits on the control loop (``collect``)
are derived from these deadlines.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from asyncsync.control import ServerError, within
from asyncsync.engines.base import Phase
from asyncsync.engines.protocols import UpdateTarget
from asyncsync.protocol.wire import UpdateRequest
from asyncsync.transport.kinds import VersionKind

log = logging.getLogger(__name__)

SLACK_S = 5.0  # added to a wait on the control loop derived from the deadlines inside it


class Phases:
    """One version's calls to its servers (the module doc): what each server answered and when."""

    def __init__(self, kind: VersionKind, http_s: float, buckets: int, ends_early: frozenset[str] = frozenset(),
                 reach: Mapping[str, float] | None = None, digested: frozenset[str] = frozenset()):
        self.kind, self.http_s, self.buckets, self.ends_early, self.digested = kind, http_s, buckets, ends_early, digested
        self.reach = dict(reach or {})  # per relayed server: how much later than the root the version reaches it
        self.digests: concurrent.futures.Future[tuple[str, ...]] = concurrent.futures.Future()
        # When each server's update answered yes, for a relay's slow hops (not background receivers).
        self.received: dict[str, float] = {}
        self.ended: dict[str, Any] = {}  # ``end``'s answer (or failure) of the servers that ended early
        self._begun: dict[str, concurrent.futures.Future[None]] = {}

    def deadline(self, e: UpdateTarget, phase: Phase) -> float:
        later = self.reach.get(e.url, 0.0) if phase in ("update", "end") else 0.0
        return e.calls(phase, self.buckets) * self.http_s + later

    def update_s(self, engines: Sequence[UpdateTarget]) -> float:
        """How long ``begin_and_update`` may take on any of ``engines``, its abort included."""
        return max((self.deadline(e, "begin") + self.deadline(e, "update") + self.deadline(e, "abort")
                    + (self.deadline(e, "end") if e.url in self.ends_early else 0.0) for e in engines), default=0.0)

    def end_s(self, engines: Sequence[UpdateTarget]) -> float:
        return max((self.deadline(e, "end") + self.deadline(e, "abort") for e in engines), default=0.0)

    def abort_s(self, engines: Sequence[UpdateTarget]) -> float:
        return max((self.deadline(e, "abort") for e in engines), default=0.0)

    def begun(self, url: str) -> concurrent.futures.Future[None]:
        """Done once ``url``'s ``begin`` answered yes (never set when it failed)."""
        return self._begun.setdefault(url, concurrent.futures.Future())

    def until_begun(self, posted: Mapping[str, concurrent.futures.Future[Any]], engines: Sequence[UpdateTarget]) -> None:
        """Returns once each server of ``posted`` has begun, or its ``begin_and_update`` ended (a
        failed ``begin``, aborted: the data path sees an answer before its data and stops before the
        first bucket). Each ``begin`` and ``abort`` has its own deadline, so this wait only guards
        against a bug."""
        give_up = time.monotonic() + max((self.deadline(e, "begin") + self.deadline(e, "abort") for e in engines),
                                         default=0.0) + SLACK_S
        for url, future in posted.items():
            concurrent.futures.wait((self.begun(url), future), max(0.0, give_up - time.monotonic()),
                                    concurrent.futures.FIRST_COMPLETED)

    async def begin_and_update(self, e: UpdateTarget, request: UpdateRequest) -> None:
        try:
            await within(e.url, self.kind.begin(e, request.version), self.deadline(e, "begin"), "begin")
            self.begun(e.url).set_result(None)
            await within(e.url, self.kind.update(e, request), self.deadline(e, "update"), "update")
            if self.kind.relayed and not e.receives_in_background:  # its answer says when the version reached it
                self.received[e.url] = time.perf_counter()
        except Exception:
            await self.abort(e, request.version)
            raise
        if e.url in self.ends_early:  # it serves the version now, not once the slowest received it
            try:
                self.ended[e.url] = await self.end(e, request.version)
            except Exception as error:  # ``end`` aborted it; the version's failure, not the update's
                self.ended[e.url] = error

    def digested_as(self, digests: tuple[str, ...]) -> None:
        """The trainer's digests of every bucket it sent (empty: none, or the data path broke)."""
        if not self.digests.done():
            self.digests.set_result(digests)

    async def end(self, e: UpdateTarget, version: int) -> int:
        try:
            return await within(e.url, self._end(e, version), self.deadline(e, "end"), "end")
        except Exception:
            await self.abort(e, version)
            raise

    async def _end(self, e: UpdateTarget, version: int) -> int:
        digests = await asyncio.wrap_future(self.digests) if e.url in self.digested else ()
        return await self.kind.end(e, version, digests)

    async def abort(self, e: UpdateTarget, version: int) -> None:
        """Undo the server's open policies; its own failure is logged, never raised over the first."""
        try:
            await within(e.url, e.abort(version), self.deadline(e, "abort"), "abort")
        except ServerError as err:
            log.warning("%s", err)


def collect(futures: dict[str, concurrent.futures.Future[Any]], within_s: float) -> dict[str, Any]:
    """Each server's result (or exception) of one phase run in the control loop. The phase carries its
    own deadline, so this wait only guards against a bug: past it, a server still pending has failed."""
    out: dict[str, Any] = {}
    give_up = time.monotonic() + within_s + SLACK_S
    for url, future in futures.items():
        try:
            out[url] = future.result(max(0.0, give_up - time.monotonic()))
        except concurrent.futures.TimeoutError:
            future.cancel()
            out[url] = ServerError(url, f"no answer within {within_s:.1f}s", timed_out=True)
        except Exception as e:  # the phase's own failure
            out[url] = e
    return out
