"""One log line per refused version in a vLLM server, not three tracebacks.

A refused version (or a refused plan at the trainer's ``connect``) raises ``VersionRejected`` in the
worker's RPC, so that vLLM neither loads it nor adopts its number. vLLM then logs the exception
with its traceback three times over (the worker, the engine core, the API server's exception
handler): about 90 ERROR lines for one refusal, in which the reason drowns. The receiver has
already logged the reason as one warning (``protocol.staging``), so this filter drops vLLM's
records of exactly these exceptions, recognised by the refusal's own wording, and nothing else.
"""

from __future__ import annotations

import logging
import re

from asyncsync.protocol.lora import ADAPTER_REFUSED
from asyncsync.protocol.specs import LAYOUT_REFUSED

# What every VersionRejected message says (protocol/staging.py, receivers/vllm/transfer_engine.py, ties.py,
# adapters.py).
REFUSAL = re.compile(r"version \d+ rejected: |bucket rejected: |this engine refuses every version: |"
                     + re.escape(LAYOUT_REFUSED) + "|" + re.escape(ADAPTER_REFUSED))


def _refusal(exc: BaseException | None) -> bool:
    seen = 0
    while exc is not None and seen < 8:  # the exception vLLM re-raised, and what it wraps
        if REFUSAL.search(str(exc)):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


class RefusalFilter(logging.Filter):
    """Drops records that log a refused version's exception (they carry it as ``exc_info``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and _refusal(record.exc_info[1]))


def install() -> None:
    """Add the filter, once per process, to the handlers of vLLM's logger and of the root logger
    (the worker's and the engine core's records reach them), and to uvicorn's error logger itself
    (Starlette re-raises an exception its handler answered, and uvicorn logs it again; its
    handlers are configured only when the server starts, after the plugins load)."""
    for logger in (logging.getLogger("vllm"), logging.getLogger()):
        for handler in logger.handlers:
            _add(handler)
    _add(logging.getLogger("uvicorn.error"))


def _add(target: logging.Filterer) -> None:
    if not any(isinstance(f, RefusalFilter) for f in target.filters):
        target.addFilter(RefusalFilter())
