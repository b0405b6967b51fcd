"""Every route of the reference server, as data: the one table its router is built from.

A row says what a route takes and answers, so that the server (``app.py``: asyncsync's own routes;
``sglang_api.py``: SGLang's), the ownership rule (``owner``: only the owning trainer session may
call it) and the route fuzzer (``asyncsync/testing/probes.py``: which routes exist, a valid body of
each from its message type, and each declared field's limits to break) all read the same rows. A
route that takes a message is handed it decoded (``takes``; ``where`` names it in errors where the
message's own name does not fit); a route whose body is checked against the served model (the
token ids of ``/generate``) or speaks another server's words (vLLM's LoRA routes) reads it itself.
docs/engines/reference.md "Routes" says what each one does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from asyncsync.protocol import sglang
from asyncsync.protocol.lora import AdapterCheck, AdapterUpdate, BaseCheck
from asyncsync.protocol.wire import ClaimRequest, EndRequest, InitGroupRequest, LayoutCheck, UpdateRequest, VersionRequest


@dataclass(frozen=True)
class Route:
    """One route: ``handler`` names the method that answers it (``ReferenceServer``'s, or with
    ``api="sglang"`` ``SglangApi``'s; for SGLang's weight routes the scheduler's). ``data_plane``:
    its work runs on the data-plane thread, so it may answer 503 (a group that failed or missed a
    deadline, a call that could not start behind a stalled one). ``sessions``: SGLang's routes that
    only a server with (True) or without (False) weight-update sessions serves (0.5.21+ / 0.5.20)."""

    method: Literal["GET", "POST"]
    path: str
    handler: str
    answers: str
    takes: type[Any] | None = None
    where: str | None = None
    owner: bool = False
    data_plane: bool = False
    api: Literal["asyncsync", "sglang"] = "asyncsync"
    sessions: bool | None = None


_SGLANG_WEIGHT = {"owner": True, "data_plane": True, "api": "sglang"}  # SGLang's weight routes: its scheduler's

TABLE: tuple[Route, ...] = (
    Route("GET", "/health", "health", '{"status": "ok", "version"}'),
    Route("GET", "/version", "get_version", '{"version", "applied"}'),
    Route("GET", "/world_size", "world_size", '{"world_size": 1, "protocol"}'),
    Route("GET", "/host", "host", '{"host": HostIdentity | null}'),
    Route("GET", "/weights/digest", "digest", '{"version", "digest": {name: sha256}}'),
    Route("GET", "/weights/names", "names", '{"names"}'),
    Route("POST", "/check_layout", "check_layout", '{"ok": true}, 409 naming the differences', LayoutCheck),
    Route("POST", "/generate", "generate", '{"completions", "weight_version"}'),
    Route("POST", "/score", "score", '{"logprobs", "weight_version"}'),
    Route("POST", "/claim", "claim", '{"ok": true, "owner"}, 423 if another session owns it', ClaimRequest),
    Route("POST", "/release", "release", '{"released": bool}'),
    Route("POST", "/init_group", "init_group", '{"ok": true, "rank"}', InitGroupRequest, owner=True,
          data_plane=True),
    Route("POST", "/begin", "begin", '{"ok": true}', VersionRequest, "begin", owner=True),
    Route("POST", "/update", "update", '{"ok": true, "version"} once received and verified', UpdateRequest,
          owner=True, data_plane=True),
    Route("POST", "/end", "end", '{"version", "switch_s", "holds"}', EndRequest, "end", owner=True,
          data_plane=True),
    Route("POST", "/check_adapter", "check_adapter", '{"ok": true}, 409 why not', AdapterCheck),
    Route("POST", "/check_base", "check_base", '{"ok": true}, 409 the first difference', BaseCheck),
    Route("POST", "/update_adapter", "update_adapter", '{"ok": true, "version"}', AdapterUpdate, owner=True,
          data_plane=True),
    Route("POST", "/end_adapter", "end_adapter", '{"path"}: where the version was written', EndRequest,
          "end_adapter", owner=True, data_plane=True),
    Route("POST", "/v1/load_lora_adapter", "load_adapter", "vLLM's: a text", owner=True),
    Route("POST", "/v1/unload_lora_adapter", "unload_adapter", "vLLM's: a text", owner=True),
    Route("GET", "/v1/models", "list_models", '{"object": "list", "data": [...]}'),
    Route("POST", "/init_weights_update_group", "init_weights_update_group", '{"success", "message"}',
          sglang.InitWeightsUpdateGroup, **_SGLANG_WEIGHT),
    Route("POST", "/destroy_weights_update_group", "destroy_weights_update_group", '{"success", "message"}',
          sglang.DestroyWeightsUpdateGroup, **_SGLANG_WEIGHT),
    Route("POST", "/update_weights_from_distributed", "update_weights_from_distributed",
          '{"success", "message"}', sglang.UpdateWeightsFromDistributed, **_SGLANG_WEIGHT),
    Route("POST", "/begin_weight_update", "begin_weight_update", '{"success", "message"}',
          sglang.BeginWeightUpdate, **_SGLANG_WEIGHT, sessions=True),
    Route("POST", "/end_weight_update", "end_weight_update", '{"success", "message"}', sglang.EndWeightUpdate,
          **_SGLANG_WEIGHT, sessions=True),
    Route("POST", "/pause_generation", "pause", '{"message", "status": "ok"}', sglang.PauseGeneration,
          owner=True, api="sglang"),
    Route("POST", "/continue_generation", "resume", '{"message", "status": "ok"}', sglang.ContinueGeneration,
          owner=True, api="sglang"),
    Route("GET", "/model_info", "get_model_info", '{..., "weight_version"}', api="sglang"),
    Route("GET", "/get_model_info", "get_model_info", '{..., "weight_version"}', api="sglang"),
    Route("GET", "/server_info", "server_info", "the start-up arguments", api="sglang"),
    Route("GET", "/get_server_info", "server_info", "the start-up arguments", api="sglang"),
    Route("GET", "/ready", "ready", "200, or 503 while generation is paused", api="sglang"),
    Route("POST", "/load_lora_adapter", "load_lora", '{"success", "error_message", "loaded_adapters"}',
          sglang.LoadLoraAdapter, owner=True, api="sglang"),
    Route("POST", "/unload_lora_adapter", "unload_lora", '{"success", "error_message", "loaded_adapters"}',
          sglang.UnloadLoraAdapter, owner=True, api="sglang"),
    Route("GET", "/get_weight_version", "deprecated", "404: gone, use /model_info", api="sglang", sessions=False),
    Route("GET", "/weight_version", "deprecated", "404: gone, use /model_info", api="sglang", sessions=False),
)


def served(api: str, sessions: bool = True) -> tuple[Route, ...]:
    """The routes ``api`` serves, by a server with (or without) SGLang's weight-update sessions."""
    return tuple(r for r in TABLE if r.api == api and r.sessions in (None, sessions))
