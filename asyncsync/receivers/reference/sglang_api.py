"""SGLang's weight-update HTTP API, answered by the reference server as SGLang 0.5.23 answers it.

Routes, methods, bodies and status codes come from SGLang 0.5.23's own source (``SGLANG_RELEASE``):
``sglang/srt/entrypoints/http_server.py`` for the routes and answers, ``managers/io_struct.py`` for
the request fields (``asyncsync.protocol.sglang``), ``managers/tokenizer_control_mixin.py`` for what
the HTTP side adds, and the scheduler's and model runner's ``weight_updater.py`` for every answer
of the weight routes (``ReceiverScheduler`` below)::

    POST /init_weights_update_group        200/400 {"success", "message"}
    POST /destroy_weights_update_group     200/400 {"success", "message"}
    POST /begin_weight_update              200/400 {"success", "message"}   } absent (404) with
    POST /end_weight_update                200/400 {"success", "message"}   } sessions=False (0.5.20)
    POST /update_weights_from_distributed  200/400 {"success", "message"}; a success carrying
                                           weight_version adds " Weight version updated to v."
    POST /pause_generation                 200 {"message": "Generation paused successfully.", "status": "ok"}
    POST /continue_generation              200 {"message": "Generation continued successfully.", "status": "ok"}
    GET  /model_info, /get_model_info      200 {..., "weight_version": the live version}
    GET  /server_info, /get_server_info    200 {the start-up arguments: tp_size, dp_size, ..., "weight_version"}
    GET  /ready                            200, or 503 while generation is paused (empty bodies)
    POST /load_lora_adapter                200/400 {"success", "error_message", "loaded_adapters"}
    POST /unload_lora_adapter              200/400 {"success", "error_message", "loaded_adapters"}
    GET  /get_weight_version               404 {"detail": "Not Found"} (0.5.21+; 0.5.20 answers its
                                           deprecation 404 {"object": "error", ...})

A body that fails validation gets 400 ``{"object": "error", "message": ..., "type": "Bad Request",
"param": null, "code": 400}`` (the message lists the problems as pydantic does, in its own words); an
unknown path 404 ``{"detail": "Not Found"}`` and a wrong method 405 ``{"detail": "Method Not Allowed"}``
(``starlette_errors``). The reference server has no data-parallel replicas, so SGLang's
``dp_size == 1`` assertion (a 500) never fires.

Where the reference server departs from SGLang, on purpose:

* a version is applied whole when the bucket carrying ``weight_version`` arrives, and only then
  (SGLang loads each bucket as it comes); a bucket refused after its broadcast is answered with
  SGLang's load-failure message, though here the served weights are untouched;
* nothing is allocated for a bucket that names a tensor the model does not have or that would take
  the version past the server's staging budget (``Admission.max_version_bytes``): it is refused
  before its broadcast, with SGLang's receive-failure message (SGLang receives it, then refuses);
* a message longer than ``wire.MAX_ERROR_CHARS`` is cut there, and a validation error quotes at most
  ``ECHO_CHARS`` of each input (SGLang quotes it whole);
* only ``load_format="flattened_bucket"`` is received (the per-tensor path is refused before any
  broadcast, with SGLang's receive-failure message), and an empty ``group_name`` is refused (SGLang's
  scheduler process dies on it);
* a group name the server already holds is refused before the rendezvous (SGLang refuses it with the
  same message after the rendezvous, when torch registers the name);
* the bearer token check and ``/health`` are the reference server's own, and ``/generate`` speaks
  the reference server's API, not SGLang's;
* the LoRA routes load and unload the reference server's own adapters (``adapters.ServedAdapters``:
  PEFT); ``/server_info`` says LoRA is enabled, with no rank or target limit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

import torch
from aiohttp import web

from asyncsync.protocol.group import Abandoner, DataPlaneError, DataPlaneGroup
from asyncsync.protocol.sglang import (
    FLATTENED_BUCKET, GROUP_CREATED, GROUP_DESTROYED, NO_GROUP_TO_DESTROY, NO_SESSION, NO_SESSION_TO_END, RECEIVE_FAILED,
    SESSION_OPEN, SGLANG_RELEASE, UPDATED, BeginWeightUpdate, ContinueGeneration, DestroyWeightsUpdateGroup,
    EndWeightUpdate, InitWeightsUpdateGroup, LoadLoraAdapter, PauseGeneration, RequestInvalid, SglangRequest,
    UnloadLoraAdapter, UpdateWeightsFromDistributed, group_missing, load_failure,
)
from asyncsync.protocol.admission import BucketRefused
from asyncsync.protocol.wire import MAX_VERSION, WireError, short, shown
from asyncsync.protocol.admission import VersionRejected
from asyncsync.receivers.reference.receiver import WeightReceiver
from asyncsync.receivers.reference.routes import Route, served

log = logging.getLogger(__name__)

RunOnCommThread = Callable[..., Awaitable[Any]]
Q = TypeVar("Q", bound=SglangRequest)
DEPRECATED_WEIGHT_VERSION = ("Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
                             "Please use '/model_info' instead.")


class SglangScheduler(Protocol):
    """SGLang's scheduler side of the weight routes: each call runs on the server's one scheduler
    thread and answers ``(success, message)`` as SGLang's weight updater does. ``ReceiverScheduler``
    is the reference server's; a test may put SGLang's own code behind the same HTTP layer."""

    session_open: bool  # whether a begin_weight_update session is open

    def init_weights_update_group(self, req: InitWeightsUpdateGroup) -> tuple[bool, str]: ...
    def destroy_weights_update_group(self, req: DestroyWeightsUpdateGroup) -> tuple[bool, str]: ...
    def begin_weight_update(self, req: BeginWeightUpdate) -> tuple[bool, str]: ...
    def end_weight_update(self, req: EndWeightUpdate) -> tuple[bool, str]: ...
    def update_weights_from_distributed(self, req: UpdateWeightsFromDistributed) -> tuple[bool, str]: ...
    def close(self) -> None: ...


class ReceiverScheduler:
    """SGLang 0.5.23's weight updater over the reference server's ``WeightReceiver``: the same
    groups by name, the same session rule (``sessions=False``: none, as SGLang 0.5.20), the same
    checks in the same order and the same answers. Whatever SGLang refuses before its receive is
    refused here before any broadcast; everything else is refused only after the bucket arrived."""

    def __init__(self, receiver: WeightReceiver, sessions: bool, group_timeout_s: float,
                 abandoner: Abandoner | None = None):
        self.receiver = receiver
        self.sessions = sessions
        self.group_timeout_s = group_timeout_s
        self.abandoner = abandoner  # the server's: a newer join or a release gives up a hanging rendezvous
        self.groups: dict[str, DataPlaneGroup] = {}
        self.session_open = False

    def init_weights_update_group(self, req: InitWeightsUpdateGroup) -> tuple[bool, str]:
        if not req.group_name:
            return False, "Failed to initialize custom process group: Group name cannot be empty."
        if req.group_name in self.groups:  # torch's own check, which SGLang relies on
            return False, ("Failed to initialize custom process group: The specified group name has already been "
                           "created, please use a different group name.")
        try:
            self.groups[req.group_name] = DataPlaneGroup.join(req.spec(self.group_timeout_s), req.rank_offset,
                                                              self.receiver.runtime, warmup=False,
                                                              abandoner=self.abandoner)
        except (WireError, DataPlaneError) as e:
            return False, f"Failed to initialize custom process group: {e}."
        return True, GROUP_CREATED

    def destroy_weights_update_group(self, req: DestroyWeightsUpdateGroup) -> tuple[bool, str]:
        group = self.groups.pop(req.group_name, None)
        if group is None:
            return False, NO_GROUP_TO_DESTROY
        group.close()
        return True, GROUP_DESTROYED

    def begin_weight_update(self, req: BeginWeightUpdate) -> tuple[bool, str]:
        if self.session_open:
            return False, SESSION_OPEN
        self.receiver.discard()
        self.session_open = True
        return True, "Success"

    def end_weight_update(self, req: EndWeightUpdate) -> tuple[bool, str]:
        if not self.session_open:
            return False, NO_SESSION_TO_END
        self.session_open = False
        self.receiver.discard()  # a version whose last bucket never came is dropped
        return True, "Success"

    def update_weights_from_distributed(self, req: UpdateWeightsFromDistributed) -> tuple[bool, str]:
        if self.sessions and not self.session_open:
            return False, NO_SESSION
        group = self.groups.get(req.group_name)
        try:  # SGLang's checks before its receive, in its order; it catches them all
            if group is None:
                raise AssertionError(group_missing(req.group_name, list(self.groups)))
            if req.load_format != FLATTENED_BUCKET:
                raise ValueError(f"load_format {req.load_format!r}: the reference server receives only "
                                 f"'{FLATTENED_BUCKET}' buckets")
            nbytes = req.flattened_nbytes()
            if nbytes > self.receiver.stager.admission.max_version_bytes:  # nothing is allocated for it
                raise ValueError(f"a bucket of {nbytes} bytes is more than this server's staging budget of "
                                 f"{self.receiver.stager.admission.max_version_bytes}")
        except Exception as e:
            return False, f"{RECEIVE_FAILED}{e}"
        try:
            self._receive(req, group, nbytes)
            if req.weight_version is not None:
                version = _int_version(req.weight_version)
                self.receiver.seal(version)
                self.receiver.commit(version)
        except (DataPlaneError, BucketRefused) as e:
            return False, f"{RECEIVE_FAILED}{e}"
        except (VersionRejected, WireError) as e:
            return False, load_failure(e)
        return True, UPDATED

    def _receive(self, req: UpdateWeightsFromDistributed, group: DataPlaneGroup, nbytes: int) -> None:
        """Take part in the bucket's broadcast, then judge it (``VersionRejected``/``WireError``)."""
        try:
            bucket = req.bucket()
        except WireError:  # a layout SGLang receives but asyncsync cannot hold: consume it, then refuse
            group.broadcast(torch.empty(nbytes, dtype=torch.uint8, device=group.device))
            self.receiver.discard()
            raise
        self.receiver.receive_bucket(bucket, group)

    def close(self) -> None:
        for group in self.groups.values():
            group.close()
        self.groups.clear()


def _int_version(value: str) -> int:
    try:
        version = int(value)
    except ValueError:
        version = -1
    if not 0 <= version <= MAX_VERSION:
        raise VersionRejected(f"weight_version {shown(value)}: the reference server's versions are integers in "
                              f"[0, {MAX_VERSION}]")
    return version


class SglangApi:
    """The HTTP side of SGLang's weight API (what SGLang's tokenizer manager does) over a scheduler.

    The live weight version is the HTTP side's, as in SGLang: set when an update carrying
    ``weight_version`` succeeds, reported by ``/model_info``; ``/server_info`` keeps the start-up one."""

    def __init__(self, scheduler: SglangScheduler, run_comm: RunOnCommThread, model_info: Mapping[str, Any],
                 sessions: bool = True, on_join: Callable[[], None] | None = None, adapters: Any = None):
        self.scheduler = scheduler
        self.adapters = adapters  # the server's adapters (``adapters.ServedAdapters``), loaded by the LoRA routes
        self._run_comm = run_comm  # scheduler work runs on the server's data-plane thread, in order
        self._on_join = on_join  # told when a group is asked for (the server abandons a join still hanging)
        self.model_info = dict(model_info)
        self.sessions = sessions
        self.weight_version = "default"
        self.paused = False

    @property
    def session_open(self) -> bool:
        """Whether an update session is open (tests read it; SGLang has no route for it)."""
        return self.scheduler.session_open

    def routes(self) -> list[web.RouteDef]:
        """SGLang's routes of ``routes.TABLE`` this API serves (0.5.20 without sessions still routes
        ``/get_weight_version``, only to answer that it is gone): a weight route runs the scheduler's
        method of its name on the data-plane thread; a route that takes a struct gets it validated."""
        return [web.route(r.method, r.path, self._route(r)) for r in served("sglang", self.sessions)]

    def _route(self, route: Route) -> Callable[[web.Request], Awaitable[web.Response]]:
        if route.takes is None:
            return getattr(self, route.handler)
        if route.data_plane:
            return self._weight_route(route.takes, route.handler)
        return self._validated(route.takes, getattr(self, route.handler))

    def _validated(self, struct: type[Q], handler: Callable[[Q], Awaitable[web.Response]]) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def route(request: web.Request) -> web.Response:
            try:
                body = await request.json() if request.can_read_body else None
            except (ValueError, RecursionError, LookupError):  # bad JSON or UTF-8, too deep, unknown charset
                return _error(400, "Bad Request", "1 validation error:\n  {'type': 'json_invalid', 'loc': ('body',), "
                                                  "'msg': 'JSON decode error'}")
            try:
                req = struct.from_json(body)
            except RequestInvalid as e:
                return _error(400, "Bad Request", str(e))
            return await handler(req)

        return route

    def _weight_route(self, struct: type[SglangRequest], name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(req: SglangRequest) -> web.Response:
            if isinstance(req, InitWeightsUpdateGroup) and self._on_join is not None:
                self._on_join()
            success, message = await self._run_comm(getattr(self.scheduler, name), req)
            if success and isinstance(req, UpdateWeightsFromDistributed) and req.weight_version is not None:
                self.weight_version = req.weight_version
                message += f" Weight version updated to {req.weight_version}."
            if not success:
                log.warning("%s refused: %s", name, message)
            return web.json_response({"success": success, "message": short(message)}, status=200 if success else 400)

        return self._validated(struct, handle)

    async def pause(self, _req: PauseGeneration) -> web.Response:
        self.paused = True  # a whole-version swap never needs generation to stop: recorded only
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def resume(self, _req: ContinueGeneration) -> web.Response:
        self.paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def get_model_info(self, _r: web.Request) -> web.Response:
        return web.json_response({**self.model_info, "weight_version": self.weight_version})

    async def server_info(self, _r: web.Request) -> web.Response:
        return web.json_response({"tp_size": 1, "pp_size": 1, "dp_size": 1, "attn_dp_size": 1,
                                  "enable_dp_attention": False, "weight_version": "default",
                                  "version": SGLANG_RELEASE, "frontend": "python", "enable_lora": True,
                                  "max_lora_rank": None, "lora_target_modules": None, "max_loaded_loras": None})

    async def load_lora(self, req: LoadLoraAdapter) -> web.Response:
        return await self._lora(self.adapters.load, req.lora_name, req.lora_path)

    async def unload_lora(self, req: UnloadLoraAdapter) -> web.Response:
        return await self._lora(self.adapters.unload, req.lora_name)

    async def _lora(self, change: Callable[..., None], *args: str) -> web.Response:
        """SGLang's ``LoRAUpdateOutput``: the adapters loaded after the change, or why it failed."""
        try:
            await asyncio.to_thread(change, *args)
        except (VersionRejected, WireError, LookupError, OSError, ValueError) as e:
            return web.json_response({"success": False, "error_message": short(str(e)), "loaded_adapters": None},
                                     status=400)
        return web.json_response({"success": True, "error_message": None, "loaded_adapters": dict(self.adapters.loaded)})

    async def ready(self, _r: web.Request) -> web.Response:
        return web.Response(status=503 if self.paused else 200)

    async def deprecated(self, _r: web.Request) -> web.Response:
        return _error(404, "404", DEPRECATED_WEIGHT_VERSION)

    def close(self) -> None:
        self.scheduler.close()


def model_info(model: torch.nn.Module, sessions: bool = True) -> dict[str, Any]:
    """``/model_info``'s fields (SGLang 0.5.23, ``http_server.py``) for a reference server's model;
    ``weight_version`` is added live. SGLang 0.5.20 has no ``disaggregation_mode``."""
    config = getattr(model, "config", None)
    info = {
        "model_path": "asyncsync-reference", "served_model_name": "asyncsync-reference", "tokenizer_path": None,
        "is_generation": True, "preferred_sampling_params": None, "load_format": "auto",
        "reasoning_parser": None, "tool_call_parser": None, "disaggregation_mode": "null",
        "has_image_understanding": False, "has_audio_understanding": False,
        "model_type": getattr(config, "model_type", None), "architectures": getattr(config, "architectures", None),
    }
    if not sessions:
        del info["disaggregation_mode"]
    return info


@web.middleware
async def starlette_errors(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Unknown paths and wrong methods answered as SGLang's framework (Starlette) answers them."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response({"detail": "Not Found"}, status=404)
    except web.HTTPMethodNotAllowed:
        return web.json_response({"detail": "Method Not Allowed"}, status=405)


def _error(status: int, kind: str, message: str) -> web.Response:
    """SGLang's error body (``ErrorResponse`` in ``entrypoints/openai/protocol.py``)."""
    return web.json_response({"object": "error", "message": short(message), "type": kind, "param": None, "code": status},
                             status=status)
