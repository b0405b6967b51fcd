"""SGLang's weight-update HTTP API, spoken by the reference server so the SGLang client is tested end to end.

Routes (SGLang's paths and JSON fields; failures answer HTTP 400 ``{"success": false, "message": ...}``)::

    GET  /get_server_info                  {"tp_size": 1, "dp_size": 1, "weight_version": ..., "paused": ...}
    GET  /get_weight_version               {"weight_version": "default" | "7"}
    POST /init_weights_update_group        join the trainer's group, without a warm-up broadcast
    POST /begin_weight_update              } only with ``sessions`` (SGLang >= 0.5.21), which then
    POST /end_weight_update                } requires them around updates; without, both answer 404
    POST /update_weights_from_distributed  one flattened bucket; the one carrying weight_version
                                           completes the version, which is then swapped in whole
    POST /pause_generation                 {"mode": "abort" | "retract" | "in_place"}: recorded only,
    POST /continue_generation              as a whole-version swap never needs generation to stop

Where SGLang would go wrong silently, this is stricter, so a nonconforming client fails here first:
a flattened bucket must hold one dtype (SGLang before November 2025 reads it as one), and a version
is applied only when all its tensors arrived (SGLang applies each bucket as it comes).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from asyncsync.protocol.group import DataPlaneError
from asyncsync.protocol.sglang import FLATTENED_BUCKET, InitWeightsUpdateGroup, UpdateWeightsFromDistributed
from asyncsync.protocol.wire import WireError
from asyncsync.receivers.reference.receiver import VersionRejected, WeightReceiver

log = logging.getLogger(__name__)

PAUSE_MODES = ("abort", "retract", "in_place")
RunOnCommThread = Callable[..., Awaitable[Any]]


class Refused(Exception):
    """An SGLang request that is answered with ``success: false``."""


class SglangApi:
    """SGLang's routes over the reference server's receiver."""

    def __init__(self, receiver: WeightReceiver, run_comm: RunOnCommThread, sessions: bool, group_timeout_s: float):
        self.receiver = receiver
        self._run_comm = run_comm  # the receiver's work runs on the server's data-plane thread
        self.sessions = sessions
        self.group_timeout_s = group_timeout_s
        self.paused = False
        self._session_open = False
        self._group_name: str | None = None

    @property
    def session_open(self) -> bool:
        """Whether a ``/begin_weight_update`` session is open (operators and tests read it)."""
        return self._session_open

    def routes(self) -> list[web.RouteDef]:
        routes = [
            web.get("/get_server_info", self.server_info), web.get("/get_weight_version", self.weight_version),
            web.post("/init_weights_update_group", self._sglang(self.init_group)),
            web.post("/update_weights_from_distributed", self._sglang(self.update)),
            web.post("/pause_generation", self._sglang(self.pause)),
            web.post("/continue_generation", self._sglang(self.resume)),
        ]
        if self.sessions:
            routes += [web.post("/begin_weight_update", self._sglang(self.begin)),
                       web.post("/end_weight_update", self._sglang(self.end))]
        return routes

    def _sglang(self, handler: Callable[[Any], Awaitable[str]]) -> Callable[[web.Request], Awaitable[web.Response]]:
        """Wrap ``handler(body) -> message`` into SGLang's answer shape."""

        async def route(request: web.Request) -> web.Response:
            try:
                body = await request.json() if request.can_read_body else {}
            except ValueError:
                return _answer(False, f"{request.path}: the body is not valid JSON")
            try:
                message = await handler(body)
            except (Refused, WireError, VersionRejected, DataPlaneError) as e:
                log.warning("%s refused: %s", request.path, e)
                return _answer(False, str(e))
            return _answer(True, message)

        return route

    def _version_str(self) -> str:
        return str(self.receiver.version) if self.receiver.version else "default"

    async def server_info(self, _r: web.Request) -> web.Response:
        return web.json_response({"tp_size": 1, "dp_size": 1, "weight_version": self._version_str(), "paused": self.paused})

    async def weight_version(self, _r: web.Request) -> web.Response:
        return web.json_response({"weight_version": self._version_str()})

    async def init_group(self, body: Any) -> str:
        req = InitWeightsUpdateGroup.from_json(body)
        await self._run_comm(self.receiver.join, req.spec(self.group_timeout_s), req.rank_offset, False)
        self._group_name = req.group_name
        return "Succeeded to initialize custom process group."

    async def begin(self, _body: Any) -> str:
        if self._session_open:
            raise Refused("begin_weight_update called while a weight-update session is already open")
        await self._run_comm(self.receiver.discard)
        self._session_open = True
        return "Success"

    async def end(self, _body: Any) -> str:
        if not self._session_open:
            raise Refused("end_weight_update called without begin_weight_update")
        self._session_open = False
        await self._run_comm(self.receiver.discard)
        return "Success"

    async def update(self, body: Any) -> str:
        req = UpdateWeightsFromDistributed.from_json(body)
        if req.load_format != FLATTENED_BUCKET:
            raise Refused(f"load_format {req.load_format!r}: the reference server takes only '{FLATTENED_BUCKET}'")
        if req.group_name != self._group_name:
            raise Refused(f"group {req.group_name!r} is not initialized (have {self._group_name!r}); "
                          "call /init_weights_update_group first")
        if self.sessions and not self._session_open:
            raise Refused("update_weights_from_distributed requires an open begin_weight_update session")
        await self._run_comm(self.receiver.receive_bucket, req.bucket)
        if len(set(req.bucket.dtypes)) > 1:
            await self._run_comm(self.receiver.discard)
            raise Refused(f"flattened bucket mixes dtypes {sorted(set(req.bucket.dtypes))}: SGLang releases before "
                          "sgl-project/sglang#13413 read a flattened bucket as one dtype; send one dtype per bucket")
        if req.weight_version is None:
            return f"Received {len(req.bucket.names)} tensor(s)."
        try:
            version = int(req.weight_version)
        except ValueError:
            await self._run_comm(self.receiver.discard)
            raise Refused(f"weight_version {req.weight_version!r}: the reference server's versions are integers") from None
        await self._run_comm(self.receiver.seal, version)
        await self._run_comm(self.receiver.commit, version)
        return f"Succeeded to update parameter online. Weight version updated to {version}."

    async def pause(self, body: Any) -> str:
        mode = body.get("mode", "abort") if isinstance(body, dict) else "abort"
        if mode not in PAUSE_MODES:
            raise Refused(f"pause mode {mode!r} is not one of {list(PAUSE_MODES)}")
        self.paused = True
        return "Generation paused successfully."

    async def resume(self, _body: Any) -> str:
        self.paused = False
        return "Generation continued successfully."


def _answer(success: bool, message: str) -> web.Response:
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)
