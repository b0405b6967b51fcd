"""The reference server's HTTP API (aiohttp): generation, health, version and the weight-update protocol.

``ReferenceServer`` serves asyncsync's own routes (``/generate``, ``/score``, ``/health``, the
weight-update routes ``/claim``, ``/init_group``, ``/update``, ``/end``, ...), the LoRA adapter
routes (``asyncsync.receivers.reference.adapters``) and SGLang 0.5.23's weight-update API
(``asyncsync.receivers.reference.sglang_api``; ``sglang_sessions=False`` answers as SGLang 0.5.20).
Data-plane work runs on one dedicated thread and generation on another, so the old weights serve
while a new version streams in, and every data-plane call ends by its own deadline.

What a caller must know: one trainer session owns the server at a time (``X-Asyncsync-Session``;
weight-update calls, ``WEIGHT_ROUTES``, from another session get 423), and no input makes it answer
500 or exit: a failed request is a 4xx with ``{"error": message}``, a data-plane failure a 503.
The router is built from ``routes.TABLE`` (what each route takes and answers); every route with its
body and answer: docs/engines/reference.md "Routes".
"""

from __future__ import annotations

import asyncio
import hmac
import random
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from aiohttp import web

from asyncsync.models import generate, score
from asyncsync.protocol.arena import Staging
from asyncsync.protocol.background import enter_background_thread
from asyncsync.protocol.group import Abandoner, DataPlaneError
from asyncsync.protocol.ownership import OwnedByAnotherTrainer, TrainerOwnership
from asyncsync.protocol.shm import HostIdentity, sweep_stale
from asyncsync.protocol.specs import distinct_tensors
from asyncsync.protocol.lora import AdapterCheck, AdapterUpdate, BaseCheck, check_name, parse_version_name
from asyncsync.protocol.wire import (
    MAX_SESSION_CHARS, OWNED_STATUS, PROTOCOL_VERSION, SESSION_HEADER, ClaimRequest, EndRequest, InitGroupRequest,
    LayoutCheck, UpdateRequest, VersionRequest, WireError, sane_text, short, shown,
)
from asyncsync.receivers.reference.adapters import AdapterNotFound, ServedAdapters
from asyncsync.protocol.admission import VersionRejected
from asyncsync.receivers.reference.receiver import WeightReceiver
from asyncsync.receivers.reference.routes import TABLE, Route, served
from asyncsync.receivers.reference.sglang_api import ReceiverScheduler, SglangApi, model_info, starlette_errors
from asyncsync.control import new_event_loop

log = logging.getLogger(__name__)

MAX_NEW_TOKENS = 4096
MAX_SAMPLES = 256
# Below this a temperature turns logits into infinities (softmax of logits / 1e-300): 0 means greedy.
MIN_TEMPERATURE = 1e-2
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes 64-bit seeds
SGLANG_GROUP_TIMEOUT_S = 120.0  # SGLang's own requests carry no timeout for the weight-update group
# A trainer that made no call for this long while its store still answers (hung) loses the server to
# the next claim: the collective deadline's default, past which its broadcasts would fail anyway.
TRAINER_LEASE_S = 120.0
# A data-plane call waits at most this long to start on the data-plane thread (503 after), so a call
# stalled on a silent peer never holds the ones behind it for longer, whatever its own deadline.
WEIGHT_QUEUE_S = 10.0
# Calls that change what the server receives or serves: only the owning trainer session may make them.
WEIGHT_ROUTES = frozenset(r.path for r in TABLE if r.owner)
SWEEP_S = 1.0  # how often a server on shared memory looks for segments of trainers that died
SWEEPER = web.AppKey("sweeper", asyncio.Task)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Faults:
    """Fault injection for tests and benchmarks; everything is off by default.

    ``apply_delay_s``: a random sleep of up to this long before each swap-in (versions pile up and
    supersede). ``call_delay_s``: each listed route (path, seconds) does its work, then holds its answer
    this long: a server slow to answer, near or past the trainer's deadlines."""

    apply_delay_s: float = 0.0
    call_delay_s: tuple[tuple[str, float], ...] = ()

    def delay_for(self, path: str) -> float:
        return sum(s for p, s in self.call_delay_s if p == path)


class ReferenceServer:
    """Holds the model, the receiver and the two worker threads behind the routes."""

    def __init__(self, model: torch.nn.Module, token: str | None = None, faults: Faults = Faults(),
                 sglang_sessions: bool = True, trainer_lease_s: float = TRAINER_LEASE_S,
                 max_version_bytes: int | None = None, layout: str = "checkpoint", staging: Staging = "device"):
        self.model = model
        self.token = token
        self.faults = faults
        self.owners = TrainerOwnership(trainer_lease_s)
        self.serve_lock = threading.Lock()
        self.context = int(model.config.max_position_embeddings)  # the most tokens a prompt and its completion hold
        # A newer /init_group or a /release gives up a rendezvous still in progress (a silent peer).
        self.joins = Abandoner()
        self.receiver = WeightReceiver(distinct_tensors(model.state_dict(keep_vars=True)), self.serve_lock,
                                       model=model, max_version_bytes=max_version_bytes, abandoner=self.joins,
                                       layout=layout, staging=staging)
        self.adapters = ServedAdapters(model, self.receiver, self.serve_lock)
        # Data-plane work runs on one thread, which starts on the weights' device (per thread on CUDA)
        # at a lower CPU priority than generation (and so do the threads of the groups it creates).
        self._comm = ThreadPoolExecutor(1, thread_name_prefix="asyncsync-recv", initializer=enter_background_thread,
                                        initargs=(self.receiver.runtime,))
        self._gen = ThreadPoolExecutor(1, thread_name_prefix="asyncsync-gen")
        self._busy: tuple[str, float] | None = None  # the data-plane call running, and since when
        self.sglang = SglangApi(ReceiverScheduler(self.receiver, sglang_sessions, SGLANG_GROUP_TIMEOUT_S, self.joins),
                                self._data_plane, model_info(model, sglang_sessions), sglang_sessions,
                                on_join=self.joins.abandon, adapters=self.adapters)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[starlette_errors, error_statuses, self._auth, self._owned, self._delay],
                              client_max_size=64 * 1024 * 1024)
        app.add_routes([web.route(r.method, r.path, _bound(getattr(self, r.handler), r)) for r in served("asyncsync")])
        app.add_routes(self.sglang.routes())
        app.on_startup.append(self._start_sweeping)
        app.on_cleanup.append(self._close)
        return app

    async def _start_sweeping(self, app: web.Application) -> None:
        app[SWEEPER] = asyncio.create_task(self._sweep())

    async def _sweep(self) -> None:
        """While this server maps a trainer's shared memory, remove the segments of trainers that no
        longer run (a trainer killed before it could unlink them): a crash leaves nothing in /dev/shm."""
        while True:
            await asyncio.sleep(SWEEP_S)
            if self.receiver.holds:
                for name in sweep_stale():
                    log.warning("removed shared-memory segment %s: its trainer no longer runs", name)

    async def _close(self, app: web.Application) -> None:
        app[SWEEPER].cancel()
        self.close()

    def close(self) -> None:
        """Leave every group, remove the adapter directories written here, stop the worker threads
        (also for a server whose app never ran: ``asyncsync/testing/fuzz.py`` reads its routes)."""
        self.sglang.close()
        self.adapters.close()
        self.receiver.close()
        self._comm.shutdown(wait=False, cancel_futures=True)
        self._gen.shutdown(wait=False, cancel_futures=True)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self.token is not None:
            # aiohttp decodes header bytes that are not UTF-8 as surrogates: compared as the bytes sent
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, f"Bearer {self.token}".encode()):
                return _error(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>'")
        return await handler(request)

    @web.middleware
    async def _owned(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Renew the owner's lease on each of its calls; refuse weight-update calls from anyone else.
        The slow path (another session: the owner's store may be probed) runs off the event loop."""
        session = _session(request)
        self.owners.seen(session)
        if request.path in WEIGHT_ROUTES and not self.owners.admits(session):
            await asyncio.to_thread(self.owners.check, session)
        return await handler(request)

    @web.middleware
    async def _delay(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await handler(request)
        delay = self.faults.delay_for(request.path)
        if delay:
            await asyncio.sleep(delay)
        return response

    async def _run(self, pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    async def _data_plane(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the data-plane thread, after the calls queued before it. A call that cannot
        start within ``WEIGHT_QUEUE_S`` (one before it is stalled on a silent peer until its own
        deadline) never runs: ``DataPlaneError`` (503) names the call that holds the thread."""
        lock, state = threading.Lock(), {"started": False, "dropped": False}

        def run() -> Any:
            with lock:
                if state["dropped"]:
                    return None
                state["started"] = True
            self._busy = (getattr(fn, "__name__", "a call"), time.monotonic())
            try:
                return fn(*args)
            finally:
                self._busy = None

        future = asyncio.get_running_loop().run_in_executor(self._comm, run)
        try:
            return await asyncio.wait_for(asyncio.shield(future), WEIGHT_QUEUE_S)
        except asyncio.TimeoutError:
            with lock:
                if not state["started"]:
                    state["dropped"] = True
                    what, since = self._busy or ("another call", time.monotonic())
                    raise DataPlaneError(f"could not start within {WEIGHT_QUEUE_S:.0f}s: the data-plane thread is busy "
                                         f"with {what} for {time.monotonic() - since:.1f}s (it ends by its own "
                                         "deadline, or at once on a new /init_group); retry") from None
            return await future

    async def health(self, _r: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "version": self.receiver.version})

    async def get_version(self, _r: web.Request) -> web.Response:
        return web.json_response({"version": self.receiver.version, "applied": list(self.receiver.applied)})

    async def world_size(self, _r: web.Request) -> web.Response:
        return web.json_response({"world_size": 1, "protocol": PROTOCOL_VERSION})

    async def host(self, _r: web.Request) -> web.Response:
        here = HostIdentity.here()
        return web.json_response({"host": here.to_json() if here is not None and self.receiver.runtime.kind == "host" else None})

    async def digest(self, _r: web.Request) -> web.Response:
        version, digest = await self._run(self._gen, self.receiver.digest)
        return web.json_response({"version": version, "digest": digest})

    async def names(self, _r: web.Request) -> web.Response:
        return web.json_response({"names": self.receiver.expected_names})

    async def check_layout(self, _r: web.Request, check: LayoutCheck) -> web.Response:
        """409 naming the differences unless a trainer's plan sends exactly the tensors served."""
        self.receiver.stager.admission.check_layout(check)
        return web.json_response({"ok": True})

    async def generate(self, request: web.Request) -> web.Response:
        body = await _json(request)
        prompt = body.get("prompt")
        vocab = self.model.config.vocab_size
        context = self.context
        if not isinstance(prompt, list) or not 0 < len(prompt) <= context or \
                not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt):
            raise WireError(f"generate.prompt: expected a list of 1 to {context} token ids in [0, {vocab})")
        max_new = _int(body, "max_new_tokens", 16, 0, min(MAX_NEW_TOKENS, context - len(prompt)))
        n = _int(body, "n", 1, 1, MAX_SAMPLES)
        temperature = body.get("temperature", 0.0)
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or \
                not (temperature == 0 or MIN_TEMPERATURE <= temperature <= 1e6):
            raise WireError(f"generate.temperature: expected 0 (greedy) or a number in [{MIN_TEMPERATURE}, 1e6], "
                            f"got {shown(temperature)}")
        seed = body.get("seed")
        if seed is not None:
            _int(body, "seed", 0, 0, MAX_SEED)
        adapter = body.get("adapter")
        if adapter is not None:
            check_name(adapter, "generate.adapter")  # the name of a loaded adapter (<name>-v<N>)

        def run() -> tuple[list[list[int]], int]:
            gen = torch.Generator().manual_seed(seed) if seed is not None else None
            with self.serve_lock, self.adapters.active(adapter):  # one version for the whole request
                version = self.receiver.version if adapter is None else parse_version_name(adapter)
                return generate(self.model, prompt, max_new, n, float(temperature), gen), version or 0

        completions, version = await self._run(self._gen, run)
        return web.json_response({"completions": completions, "weight_version": version})

    async def score(self, request: web.Request) -> web.Response:
        tokens = (await _json(request)).get("tokens")
        vocab, context = self.model.config.vocab_size, self.context
        if not isinstance(tokens, list) or not 1 < len(tokens) <= context or \
                not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in tokens):
            raise WireError(f"score.tokens: expected a list of 2 to {context} token ids in [0, {vocab})")

        def run() -> tuple[list[float], int]:
            with self.serve_lock:  # one version for the whole request
                return score(self.model, tokens), self.receiver.version

        logprobs, version = await self._run(self._gen, run)
        return web.json_response({"logprobs": logprobs, "weight_version": version})

    async def claim(self, _r: web.Request, req: ClaimRequest) -> web.Response:
        await asyncio.to_thread(self.owners.claim, req.session, req.takeover)  # may probe the owner's store
        return web.json_response({"ok": True, "owner": req.session})

    async def release(self, request: web.Request) -> web.Response:
        released = self.owners.release(_session(request))
        if released:
            self.joins.abandon()  # a rendezvous of the released owner's still in progress ends now
        return web.json_response({"released": released})

    async def init_group(self, request: web.Request, req: InitGroupRequest) -> web.Response:
        self.joins.abandon()  # the trainer wants this group now: a join still hanging on an older one ends
        await self._data_plane(self.receiver.join, req.groups, req.rank_offset, True, req.relay)
        self.owners.joined(_session(request), req.group.host, req.group.port)
        return web.json_response({"ok": True, "rank": req.rank_offset})

    async def begin(self, _r: web.Request, _req: VersionRequest) -> web.Response:
        # Never refused: a stale version is judged in /update, after its broadcasts were consumed,
        # so a refusal here cannot leave the trainer waiting in a collective.
        return web.json_response({"ok": True})

    async def update(self, _r: web.Request, req: UpdateRequest) -> web.Response:
        await self._data_plane(self.receiver.receive, req)
        return web.json_response({"ok": True, "version": req.version})

    async def check_adapter(self, _r: web.Request, check: AdapterCheck) -> web.Response:
        self.adapters.check(check)
        return web.json_response({"ok": True})

    async def check_base(self, _r: web.Request, check: BaseCheck) -> web.Response:
        await self._run(self._gen, self.adapters.check_base, check)
        return web.json_response({"ok": True})

    async def update_adapter(self, _r: web.Request, update: AdapterUpdate) -> web.Response:
        await self._data_plane(self.adapters.receive, update)
        return web.json_response({"ok": True, "version": update.update.version})

    async def end_adapter(self, _r: web.Request, req: EndRequest) -> web.Response:
        return web.json_response({"path": await self._data_plane(self.adapters.write, req.version, req.digests)})

    async def load_adapter(self, request: web.Request) -> web.Response:
        body = await _json(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
            raise WireError("Both 'lora_name' and 'lora_path' must be provided.")
        await self._run(self._gen, self.adapters.load, name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_adapter(self, request: web.Request) -> web.Response:
        name = (await _json(request)).get("lora_name")
        if not isinstance(name, str) or not name:
            raise WireError("'lora_name' needs to be provided to unload a LoRA adapter.")
        await self._run(self._gen, self.adapters.unload, name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def list_models(self, _r: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": self.adapters.models()})

    async def end(self, _r: web.Request, req: EndRequest) -> web.Response:
        if self.faults.apply_delay_s:
            await asyncio.sleep(random.uniform(0, self.faults.apply_delay_s))
        version = await self._data_plane(self.receiver.commit, req.version, req.digests)
        return web.json_response({"version": version, "switch_s": self.receiver.last_switch_s,
                                  "holds": list(self.receiver.holds)})


@web.middleware
async def error_statuses(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Each refusal the routes raise as the status that says what kind it is (a bad request, a refused
    version, a failed data plane, another trainer's server, a body too large, an unknown adapter)."""
    try:
        return await handler(request)
    except WireError as e:
        return _error(400, str(e))
    except VersionRejected as e:
        return _error(409, str(e))
    except DataPlaneError as e:
        return _error(503, str(e))
    except OwnedByAnotherTrainer as e:
        return _error(OWNED_STATUS, str(e))
    except web.HTTPRequestEntityTooLarge as e:
        return _error(413, f"the body is larger than this server takes ({e.reason}): send a smaller request")
    except AdapterNotFound as e:
        return _error(404, short(str(e)))


def _bound(handler: Callable[..., Awaitable[web.StreamResponse]], route: Route) -> Handler:
    """``handler``; for a route that takes a message, called with it decoded from the body (a 400 if not)."""
    takes = route.takes
    if takes is None:
        return handler

    async def decoded(request: web.Request) -> web.StreamResponse:
        return await handler(request, takes.from_json(await _json(request), route.where))

    return decoded


def _session(request: web.Request) -> str:
    """The calling trainer's session ("" for callers that send none); ``WireError`` for a value no
    trainer sends (``ClaimRequest``'s rule)."""
    session = request.headers.get(SESSION_HEADER, "")
    if session and not sane_text(session, MAX_SESSION_CHARS):
        raise WireError(f"{SESSION_HEADER}: expected a printable string of 1 to {MAX_SESSION_CHARS} characters, "
                        f"got {shown(session)}")
    return session


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, RecursionError, LookupError):  # bad JSON or UTF-8, nested too deep, unknown charset
        raise WireError(f"{request.path}: the body is not valid JSON (UTF-8, nested at most ~1000 deep)") from None
    if not isinstance(body, dict):
        raise WireError(f"{request.path}: expected a JSON object, got {type(body).__name__}")
    return body


def _int(body: dict[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = body.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise WireError(f"generate.{key}: expected an integer in [{lo}, {hi}], got {shown(v)}")
    return v


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": short(message)}, status=status)


def run_server(model: torch.nn.Module, host: str, port: int, token: str | None = None, faults: Faults = Faults(),
               trainer_lease_s: float = TRAINER_LEASE_S, max_version_bytes: int | None = None,
               layout: str = "checkpoint", staging: Staging = "device") -> None:
    """Serve until interrupted (SIGINT/SIGTERM), on uvloop when installed."""
    app = ReferenceServer(model, token, faults, trainer_lease_s=trainer_lease_s, max_version_bytes=max_version_bytes,
                          layout=layout, staging=staging).app()
    web.run_app(app, host=host, port=port, print=None, access_log=None, loop=new_event_loop())
