"""The pause guard: an engine that a trainer paused is resumed when that trainer dies or hangs.

vLLM's ``/pause`` lasts until ``/resume``. The trainer pauses an engine around a load (policy
``pause``) and resumes it afterwards; a trainer that died or hung in between used to leave the engine
answering nothing until the next trainer connected (70 s in the issue's run). A pause belongs to
the engine, not to a living trainer, so the engine's first worker, which sees every weight-update
RPC, runs this guard on a thread of its own::

    guard = PauseGuard()
    guard.joined(spec, url)        # init_transfer_engine: the trainer's rendezvous store, the API server's URL
    with guard.rpc(start=True):    # start_weight_update arms the guard; every RPC runs inside ``rpc``
        ...
    with guard.rpc(finish=True):   # finish_weight_update: the trainer's resume should follow
        ...
    guard.close()

From a trainer's ``start_weight_update`` until the engine is seen unpaused after its
``finish_weight_update`` (or after that trainer is gone) the guard is *armed*. While armed, and no
weight-update RPC runs on this worker nor ended in the last ``SETTLE_S`` (a load in progress always
completes first, and the API server labels the version it loaded before anyone resumes), it asks
the API server ``GET /is_paused`` every ``POLL_S``. While the engine is paused it asks the trainer whether it
lives (``TrainerProbe``: its rendezvous store, which runs in the trainer's process); a trainer whose
store refuses connections is dead, one whose store has not answered for ``HUNG_S`` is hung (SIGSTOP,
a partition). Either way the guard sends ``POST /resume`` and disarms. A living trainer's pause is
never touched: its store answers within milliseconds (a native thread, whatever its Python does).

The bound, from the trainer's death to the resume: ``POLL_S`` plus the resume's round trip for a
dead trainer, ``POLL_S + HUNG_S`` for a hung one, after the RPC in progress ended (a load completes;
with ``receive: in_rpc`` a receive ends by its bucket's deadline first). docs/faults.md has the
measured figures per phase.

Where the API server answers: ``ASYNCSYNC_VLLM_URL`` in the server's environment (the launcher sets
it; set it where the trainer reaches the server through an address this host cannot), else the URL
the trainer uses for this server (``InitGroupRequest.server_url``). Neither: the guard stays off
and says so once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from datetime import timedelta
from typing import Literal

from asyncsync.protocol.wire import GroupSpec

log = logging.getLogger(__name__)

URL_ENV = "ASYNCSYNC_VLLM_URL"  # where this engine's API server answers, as seen from its workers
POLL_S = 0.5   # how often an armed guard asks whether the engine is paused
HUNG_S = 5.0   # a trainer whose store has not answered for this long is hung
SETTLE_S = 0.5  # after an RPC ends, the API server's own steps (the version's label) land before a resume
CONNECT_S = 1.0  # a connection to the trainer's store that takes longer is a store that does not answer
HTTP_S = 30.0  # the API server's answer (a resume waits for the engine core's RPC in progress)

Liveness = Literal["alive", "dead", "silent"]


def knock(host: str, port: int) -> Liveness:
    """A connection to the store and nothing else: ``dead`` when refused (nobody listens: the process
    that hosted it is gone), ``silent`` when it cannot be made in time, else ``alive`` (the kernel
    accepts for a stopped process too: only a round trip tells a hung one)."""
    try:
        socket.create_connection((host, port), timeout=CONNECT_S).close()
    except ConnectionRefusedError:
        return "dead"
    except OSError:
        return "silent"
    return "alive"


def ask_store(host: str, port: int) -> Liveness:
    """One round trip to a rendezvous store (``knock`` first): ``alive`` when the store answered. Against
    a stopped process torch's client blocks until that process runs or dies (and, if it dies, retries
    until its timeout): call it on a thread."""
    knocked = knock(host, port)
    if knocked != "alive":
        return knocked
    from torch.distributed import TCPStore

    try:
        store = TCPStore(host, port, None, False, timedelta(seconds=HUNG_S), wait_for_workers=False)
        store.check(["asyncsync-liveness"])
    except (RuntimeError, ValueError, OSError):  # torch's DistNetworkError: reset by a process that died
        return "dead"
    return "alive"


class TrainerProbe:
    """Whether the trainer behind one rendezvous store lives, without ever blocking the caller: each
    ``state()`` collects the last round trip (on a daemon thread) and starts the next one; while one
    is outstanding it only knocks (a store that died meanwhile refuses at once). ``hung`` once no
    round trip answered for ``hung_s`` since the probe began or last heard an answer."""

    def __init__(self, host: str, port: int, hung_s: float = HUNG_S, clock: Callable[[], float] = time.monotonic,
                 ask: Callable[[str, int], Liveness] = ask_store):
        self.host, self.port, self.hung_s = host, port, hung_s
        self._clock, self._ask = clock, ask
        self._asking: Future[Liveness] | None = None
        self._heard: float | None = None  # when the store last answered (or probing began)

    def state(self) -> Literal["alive", "dead", "hung"]:
        now = self._clock()
        if self._heard is None:
            self._heard = now
        if self._asking is None or self._asking.done():
            answer = self._asking.result() if self._asking is not None else None
            if answer == "dead":
                return "dead"
            if answer == "alive":
                self._heard = now
            self._asking = self._spawn()
        elif knock(self.host, self.port) == "dead":
            return "dead"
        return "hung" if now - self._heard > self.hung_s else "alive"

    def reset(self) -> None:
        """Forget what was heard (a round trip still outstanding is kept: one at a time)."""
        self._heard = None

    def _spawn(self) -> Future[Liveness]:
        future: Future[Liveness] = Future()

        def run() -> None:
            future.set_result(self._ask(self.host, self.port))

        threading.Thread(target=run, name="asyncsync-trainer-probe", daemon=True).start()
        return future


class ApiServer:
    """The two development routes of vLLM's API server the guard uses (``VLLM_SERVER_DEV_MODE=1``)."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")

    def is_paused(self) -> bool | None:
        """None when the API server does not answer (it is the guard's next poll's business)."""
        try:
            with urllib.request.urlopen(self.url + "/is_paused", timeout=HTTP_S) as answer:
                return bool(json.loads(answer.read())["is_paused"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.debug("%s/is_paused: %s", self.url, e)
            return None

    def resume(self) -> bool:
        try:
            urllib.request.urlopen(urllib.request.Request(self.url + "/resume", method="POST"), timeout=HTTP_S).close()
        except OSError as e:
            log.error("could not resume generation at %s/resume (%s): resume it by hand", self.url, e)
            return False
        return True


class PauseGuard:
    """One engine's guard (the module doc): armed by a trainer's version, it resumes a pause that
    trainer left behind. Inert until ``joined`` gives it a trainer and an API server."""

    def __init__(self, poll_s: float = POLL_S, settle_s: float = SETTLE_S,
                 probe: Callable[[str, int], TrainerProbe] = TrainerProbe):
        self.poll_s, self.settle_s, self._probe_of = poll_s, settle_s, probe
        self.api: ApiServer | None = None
        self.probe: TrainerProbe | None = None
        self.armed = self.finished = False
        self._busy = 0
        self._ended = 0.0  # when the last RPC ended
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def joined(self, spec: GroupSpec, server_url: str | None) -> None:
        """The trainer whose group this worker joined (its store tells whether it lives), and the API
        server to ask (``URL_ENV`` first, else the URL the trainer uses)."""
        url = os.environ.get(URL_ENV) or server_url
        with self._lock:
            self.probe = self._probe_of(spec.host, spec.port)
            if url is None:
                if self.api is None:
                    log.warning("asyncsync: no URL of this vLLM's API server (set %s, or use a trainer that sends "
                                "it): a trainer that dies while the engine is paused leaves it paused", URL_ENV)
                return
            self.api = ApiServer(url)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="asyncsync-pause-guard", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def rpc(self, start: bool = False, finish: bool = False) -> Iterator[None]:
        """A weight-update RPC runs (the guard waits for it); ``start`` arms the guard, ``finish`` says
        the trainer's resume comes next."""
        with self._lock:
            self._busy += 1
            if start:
                self.armed, self.finished = True, False
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                self.finished = self.finished or finish
                self._ended = time.monotonic()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:  # the guard must outlive anything one poll meets
                log.exception("asyncsync: the pause guard's check failed; it checks again in %.1fs", self.poll_s)

    def check(self) -> None:
        """One poll: resume a pause whose trainer is gone, disarm once the trainer resumed or is gone."""
        with self._lock:
            if not self.armed or self._busy or self.api is None or self.probe is None or \
                    time.monotonic() - self._ended < self.settle_s:
                return
            api, probe, finished, ended = self.api, self.probe, self.finished, self._ended
        paused = api.is_paused()
        if paused is None:
            return
        if not paused:
            if finished:
                self._disarm(probe)
            return
        state = probe.state()
        if state == "alive":
            return
        with self._lock:
            if self._busy or not self.armed or self.probe is not probe or self._ended != ended:
                return  # a trainer (this one, or a new one that joined) spoke meanwhile: it decides
        why = "refuses connections (it died)" if state == "dead" else f"has not answered for {probe.hung_s:.0f}s (it hangs)"
        log.warning("asyncsync: the engine was left paused and its trainer's store %s:%d %s: resuming generation",
                    probe.host, probe.port, why)
        api.resume()
        self._disarm(probe)

    def _disarm(self, probe: TrainerProbe) -> None:
        with self._lock:
            self.armed = False
        probe.reset()
