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
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore, TCPStore

from asyncsync.protocol.wire import GroupSpec

log = logging.getLogger(__name__)


class DataPlaneError(RuntimeError):
    """A rendezvous or collective failed or missed its deadline."""




def resolve_backend(backend: str, device: torch.device) -> str:
    """The data-plane backend for weights on ``device``: ``auto`` is NCCL for CUDA weights and gloo for
    everything else (CUDA on the machine is not enough: CPU weights go over gloo)."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise DataPlaneError(f"backend 'nccl' needs the weights on a CUDA device, but they are on {device}; "
                             "use backend: gloo or auto")
    return backend


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class DataPlaneGroup:
    """One member's handle on a group: broadcast from rank 0, with the deadline given at creation.

    Lifecycle::

        group = DataPlaneGroup.join(spec, rank)   # blocks until every rank joined, then warms up
        for bucket in buckets:
            group.broadcast(buffer)               # rank 0 sends, every other rank receives in place
        group.close()
    """

    def __init__(self, spec: GroupSpec, rank: int, store: TCPStore, pg: Any, device: torch.device):
        self.spec, self.rank, self._store, self._pg, self.device = spec, rank, store, pg, device

    @classmethod
    def join(cls, spec: GroupSpec, rank: int, warmup: bool = True) -> DataPlaneGroup:
        """Join as ``rank``; blocks until every rank joined. Every member must agree on ``warmup``."""
        timeout = timedelta(seconds=spec.timeout_s)
        try:
            store = TCPStore(spec.host, spec.port, spec.world_size, rank == 0, timeout=timeout, wait_for_workers=False)
        except Exception as e:  # torch raises several types (RuntimeError, DistNetworkError)
            raise DataPlaneError(f"rank {rank}: rendezvous at {spec.host}:{spec.port} failed: {e}") from e
        try:
            pg, device = _make_process_group(spec, store, rank, timeout)
        except Exception as e:
            raise DataPlaneError(
                f"rank {rank}: could not form the {spec.backend} group '{spec.group_name}' of {spec.world_size} "
                f"within {spec.timeout_s}s ({e}); check that every server reached {spec.host}:{spec.port}"
            ) from e
        group = cls(spec, rank, store, pg, device)
        if warmup:
            group.broadcast(torch.zeros(1, dtype=torch.uint8, device=device))
        log.info("rank %d joined data-plane group %s (%s, world %d)", rank, spec.group_name, spec.backend, spec.world_size)
        return group

    def broadcast_async(self, tensor: torch.Tensor) -> Any:
        """Start a broadcast from rank 0 into ``tensor`` on every rank; returns the torch Work handle."""
        from torch.distributed import BroadcastOptions

        opts = BroadcastOptions()
        opts.rootRank = 0
        opts.rootTensor = 0
        return self._pg.broadcast([tensor], opts)

    def broadcast(self, tensor: torch.Tensor) -> None:
        self.wait(self.broadcast_async(tensor))

    def wait(self, work: Any) -> None:
        try:
            work.wait()
        except Exception as e:
            raise DataPlaneError(
                f"rank {self.rank}: broadcast in group '{self.spec.group_name}' failed or exceeded "
                f"{self.spec.timeout_s}s: {e}"
            ) from e

    def barrier(self) -> None:
        """Wait until every rank got here: benchmarks use it to time delivery, not just sending."""
        self.wait(self._pg.barrier())

    def close(self) -> None:
        for closer in ("shutdown", "abort"):
            fn = getattr(self._pg, closer, None)
            if fn is not None:
                try:
                    fn()
                except Exception:  # a dead peer may make shutdown fail; the group is gone either way
                    pass
                break
        self._pg = None
        self._store = None


def _make_process_group(spec: GroupSpec, store: TCPStore, rank: int, timeout: timedelta) -> tuple[Any, torch.device]:
    """The backend's process group over SGLang's key layout: ``{name}/{name}//{device}//<key>``."""
    named = PrefixStore(f"{spec.group_name}/", PrefixStore(spec.group_name, store))
    if spec.backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        pg: Any = ProcessGroupGloo(PrefixStore("cpu/", named), rank, spec.world_size, timeout)
        device = torch.device("cpu")
    elif spec.backend == "nccl":  # unexercised on this project's CPU-only machines
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        device = torch.device("cuda", torch.cuda.current_device())
        pg = ProcessGroupNCCL(PrefixStore("cuda/", named), rank, spec.world_size, opts)
    else:
        raise DataPlaneError(f"unknown data-plane backend {spec.backend!r}; expected 'gloo' or 'nccl'")
    pg._set_sequence_number_for_group()  # rank 0 publishes it, the others wait for it: torch does the same
    return pg, device
