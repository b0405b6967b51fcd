"""An engine whose workers hold different weights serves nothing: every request gets an error until a
whole version loads on every worker.

The workers agree on each version's outcome (``agreement.py``); when a load failed on some of them
after it began, each refuses the version with a message naming ``MIXED``. That refusal reaches vLLM's
engine core as the failure of the RPC, in the core's own loop, before it schedules another step. So
``install`` (from the plugin's ``register``, in the engine-core process) wraps the core:

* ``collective_rpc``: an RPC that failed naming ``MIXED`` *holds* the engine at once: every request the
  scheduler has (running, waiting, or frozen by a pause) is finished with vLLM's error reason
  (``FinishReason.ERROR``), so no step ever runs on the mixed weights. While held, each finish that
  succeeds is followed by asking every worker whether it is still mixed (``mixed_state``); when none
  is, the hold ends.
* ``add_request``: while held, a new request is finished with the same error instead of being
  scheduled (a paused engine would queue it).

What a client sees: vLLM 0.32 answers a request finished with ``FinishReason.ERROR`` as HTTP 500
(``InternalServerError``, "Internal server error"; vLLM documents this reason as a retryable
request-level failure), at once, for ``/v1/completions``, ``/v1/chat/completions`` and
``/inference/v1/generate`` alike, so a client or a router retries elsewhere. Pausing the engine
instead would not: vLLM 0.32 queues a request that arrives while paused (no error until the client
gives up), and 0.33 answers 503 "Generation is paused". The trainer's pause and resume are left as
they are. An engine core run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) has no output queue
to answer on: it is not held, and says so.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

from asyncsync.receivers.vllm.agreement import MIXED

log = logging.getLogger(__name__)

_HELD: dict[int, str] = {}  # id(engine core) -> why it serves nothing (one engine core per process)


def mixed_state(worker: Any) -> str | None:
    """Run on every worker (``collective_rpc`` with a callable): why its engine is mixed, or None."""
    engine = getattr(worker, "weight_transfer_engine", None)
    agreement = getattr(engine, "agreement", None)
    return getattr(agreement, "mixed", None)


def _release_if_whole(core: Any, rpc: Any, timeout: float | None) -> None:
    """After a finish that succeeded: end the hold if no worker is mixed. A question that fails keeps
    the hold (the finish's own success stands: it is not reported as failed)."""
    try:
        mixed = any(rpc(core, mixed_state, timeout))
    except Exception:
        log.exception("asyncsync: could not ask the workers whether they are still mixed; the engine stays held")
        return
    if not mixed:
        del _HELD[id(core)]
        log.warning("asyncsync: every worker holds one whole version again: the engine serves requests")


def held(core: Any) -> str | None:
    return _HELD.get(id(core))


def install() -> None:
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return
    if getattr(EngineCore.collective_rpc, "_asyncsync_holds", False):
        return
    rpc, add = EngineCore.collective_rpc, EngineCore.add_request

    def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> Any:
        try:
            result = rpc(self, method, timeout, args, kwargs)
        except Exception as e:
            if MIXED in str(e):
                _hold(self, str(e))
            raise
        if method == "finish_weight_update" and id(self) in _HELD:
            _release_if_whole(self, rpc, timeout)
        return result

    def add_request(self: Any, request: Any, request_wave: int = 0) -> Any:
        if id(self) in _HELD and hasattr(self, "_send_error_outputs_to_client"):
            self._send_error_outputs_to_client([request.request_id], request.client_index)
            return None
        return add(self, request, request_wave)

    collective_rpc._asyncsync_holds = True  # type: ignore[attr-defined]
    EngineCore.collective_rpc = collective_rpc  # type: ignore[method-assign]
    EngineCore.add_request = add_request  # type: ignore[method-assign]


def _hold(core: Any, why: str) -> None:
    """Serve nothing from now on: every request the scheduler holds is finished with an error."""
    from vllm.v1.request import RequestStatus

    if not hasattr(core, "_send_error_outputs_to_client"):
        log.error("asyncsync: %s, but this engine core runs in-process and cannot answer requests with an error: "
                  "it keeps serving them (run vLLM's engine core as a process, the default)", MIXED)
        return
    _HELD[id(core)] = why
    finished = core.scheduler.finish_requests(None, RequestStatus.FINISHED_ERROR)
    by_client: dict[int, list[str]] = defaultdict(list)
    for request in finished:
        by_client[request.client_index].append(request.request_id)
    for client, ids in by_client.items():
        core._send_error_outputs_to_client(ids, client)
    log.error("asyncsync: the engine serves no request until a whole version loads on every worker (%d in flight "
              "answered with an error): %s", len(finished), why)
