"""The data plane: a torch.distributed process group between the trainer (rank 0) and the receivers.

Groups are built without touching torch.distributed's global default group (a trainer already has
one for its own training, and a server may have one for tensor parallelism): a TCPStore rendezvous,
then a backend-specific process group object used directly. Keys and the start-up handshake are
exactly those of SGLang's ``init_custom_process_group`` (``PrefixStore(group_name)``, then torch's
``_new_process_group_helper`` adds ``group_name/`` and the device type, and the backend exchanges a
sequence number through the store), so an SGLang server joins the trainer's group as it is.

asyncsync's own receivers warm every group with one small broadcast right after creation: a lazily
initialised NCCL communicator deadlocks when its first use comes under memory pressure in the middle
of a sync. SGLang does not take part in such a broadcast, so its groups are joined with ``warmup=False``.

What differs between gloo and NCCL (which stream a collective waits on, what a wait blocks, how a
failed group is torn down, the enqueue lock) is the member's ``Runtime`` (``protocol.device``).
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import BroadcastOptions, PrefixStore, TCPStore

from asyncsync.protocol.device import ENQUEUE_LOCK, Runtime, scoped_env
from asyncsync.protocol.wire import GroupSpec

log = logging.getLogger(__name__)

_DEVICE_PREFIX = {"gloo": "cpu/", "nccl": "cuda/"}  # the device type torch's _new_process_group_helper adds


class DataPlaneError(RuntimeError):
    """A rendezvous or collective failed or missed its deadline."""


def resolve_backend(backend: str, runtime: Runtime) -> str:
    """The data-plane backend for weights on ``runtime``'s device: ``auto`` is NCCL for CUDA weights and
    gloo for everything else (CUDA on the machine is not enough: CPU weights go over gloo). A backend
    named in the config must be the one the weights' device takes."""
    if backend in ("auto", runtime.wire_backend):
        return runtime.wire_backend
    raise DataPlaneError(f"backend {backend!r} cannot send weights on {runtime.device}, which take "
                         f"{runtime.wire_backend}; use backend: auto")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Work:
    """A collective in flight and its deadline."""

    __slots__ = ("handle", "timeout")

    def __init__(self, handle: Any, timeout: timedelta):
        self.handle, self.timeout = handle, timeout


class DataPlaneGroup:
    """One member's handle on a group: broadcast from rank 0, with the deadline given at creation.

    Lifecycle::

        group = DataPlaneGroup.join(spec, rank, runtime)   # blocks until every rank joined, then warms up
        for bucket in buckets:
            work = group.broadcast_async(buffer)           # rank 0 sends, every other rank receives in place
            group.wait(work)                               # raises DataPlaneError by the group's deadline
        group.close(broken=failed)                         # abort() after a failure, shutdown() otherwise
    """

    def __init__(self, spec: GroupSpec, rank: int, store: TCPStore, pg: Any, runtime: Runtime):
        self.spec, self.rank, self._store, self._pg, self.runtime = spec, rank, store, pg, runtime
        self.timeout = timedelta(seconds=spec.timeout_s)

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    @classmethod
    def join(cls, spec: GroupSpec, rank: int, runtime: Runtime, warmup: bool = True) -> DataPlaneGroup:
        """Join as ``rank``; blocks until every rank joined. Every member must agree on ``warmup``.
        ``runtime`` is the member's device: its data-plane backend must be the group's."""
        if spec.backend != runtime.wire_backend:
            raise DataPlaneError(f"rank {rank}: the group '{spec.group_name}' uses {spec.backend}, but this member's "
                                 f"tensors are on {runtime.device}, which takes {runtime.wire_backend}: put both sides' "
                                 "weights on the same kind of device or set the trainer's backend to match")
        timeout = timedelta(seconds=spec.timeout_s)
        try:
            store = TCPStore(spec.host, spec.port, spec.world_size, rank == 0, timeout=timeout, wait_for_workers=False)
        except Exception as e:  # torch raises several types (RuntimeError, DistNetworkError)
            raise DataPlaneError(f"rank {rank}: rendezvous at {spec.host}:{spec.port} failed: {e}") from e
        # SGLang's key layout: {name}/{name}//{device}//<key>
        named = PrefixStore(f"{spec.group_name}/", PrefixStore(spec.group_name, store))
        try:
            with scoped_env(runtime.group_env):  # the group's error policy, read by its constructor
                pg = runtime.process_group(PrefixStore(_DEVICE_PREFIX[spec.backend], named), rank, spec.world_size, timeout)
            pg._set_sequence_number_for_group()  # rank 0 publishes it, the others wait for it: torch does the same
        except Exception as e:
            raise DataPlaneError(
                f"rank {rank}: could not form the {spec.backend} group '{spec.group_name}' of {spec.world_size} "
                f"within {spec.timeout_s}s ({e}); check that every server reached {spec.host}:{spec.port}"
            ) from e
        group = cls(spec, rank, store, pg, runtime)
        if warmup:
            group.broadcast(torch.zeros(1, dtype=torch.uint8, device=runtime.device))
        log.info("rank %d joined data-plane group %s (%s, world %d)", rank, spec.group_name, spec.backend, spec.world_size)
        return group

    def broadcast_async(self, tensor: torch.Tensor, timeout_s: float | None = None) -> Work:
        """Start a broadcast from rank 0 into ``tensor`` on every rank; pass the result to ``wait``.
        It is ordered after the calling thread's current stream (NCCL) and enqueued under the
        process-wide lock. ``timeout_s`` is this broadcast's deadline (default: the group's); gloo
        applies it to the operation itself, so a rank 0 whose send misses it closes its connections
        and releases the other ranks."""
        if self._pg is None:
            raise DataPlaneError(f"rank {self.rank}: group '{self.spec.group_name}' is closed")
        timeout = timedelta(seconds=timeout_s) if timeout_s is not None else self.timeout
        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        opts.timeout = timeout
        with ENQUEUE_LOCK:
            return Work(self._pg.broadcast([tensor], opts), timeout)

    def broadcast(self, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
        self.wait(self.broadcast_async(tensor, timeout_s))

    def wait(self, work: Work) -> None:
        """Until ``work`` is done (host and current stream), or ``DataPlaneError`` at its deadline."""
        try:
            self.runtime.wait_work(work.handle, work.timeout)
        except Exception as e:
            raise DataPlaneError(
                f"rank {self.rank}: broadcast in group '{self.spec.group_name}' failed or exceeded "
                f"{work.timeout.total_seconds():.1f}s: {e}"
            ) from None

    def barrier(self) -> None:
        """Wait until every rank got here: benchmarks use it to time delivery, not just sending."""
        self.wait(Work(self._pg.barrier(), self.timeout))

    def close(self, broken: bool = False) -> None:
        """Release the group. After a failure (``broken``) it is aborted, which kills in-flight
        collectives instead of waiting for them (on NCCL ``shutdown`` would hang on a dead peer)."""
        pg, self._pg, self._store = self._pg, None, None
        if pg is None:
            return
        try:
            (self.runtime.abort if broken else self.runtime.shutdown)(pg)
        except Exception as e:  # the group is gone either way
            log.debug("closing group %s: %s", self.spec.group_name, e)
