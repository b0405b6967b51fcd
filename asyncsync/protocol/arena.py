"""Where a receiver stages a version: the memory its buckets land in before the version is applied.

A version is verified whole (every bucket's CRC32C, names, dtypes, shapes) before the served weights
change, so it must be held whole somewhere first. ``Staging`` says where; it is a receiver-side
setting, the same two choices for every receiver that applies versions by copying them out:

* ``host`` (vLLM's default): one copy of a version in host shared memory per node, received and
  verified by one process (the node's *stager*: vLLM's first worker of the engine) and read by its
  peers, each of which loads what it keeps from it. Device memory per worker: none on the host
  runtime, on CUDA the stager's ring of two bucket-sized receive buffers (``DeviceRing``). What a
  large model needs.
* ``device``: one copy per receiver process on its weights' device (today's arena): a small model's
  choice, with no host round trip.

Every arena is touched when it is made (at start-up or at the trainer's connect), so the first
versions of a layout are not slowed by page faults and an engine sizing its caches from resident
memory sees it.

``HostArena`` is a ``memfd`` mapped shared: it has no name in ``/dev/shm`` to leak when its owner is
killed (the kernel frees it with the last mapping), and a peer on the same host maps it read-only
through ``/proc/<owner pid>/fd/<fd>`` (``HostArena.attach``), which only processes of the same user
can open.

Only torch and the standard library are imported here (receivers load this package).
"""

from __future__ import annotations

import logging
import mmap
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

log = logging.getLogger(__name__)

Staging = Literal["host", "device"]
STAGINGS: tuple[Staging, ...] = ("host", "device")

RING_SLOTS = 2  # receive buffers of a stager whose arena is not on its weights' device

# vLLM's --weight-transfer-config takes only a backend name (its config forbids other keys), so that
# name chooses the staging of asyncsync's vLLM backend; the trainer's client reads it back from the
# server (docs/engines/vllm.md, "Memory").
VLLM_BACKENDS: dict[str, Staging] = {"asyncsync": "host", "asyncsync-host": "host", "asyncsync-device": "device"}


def vllm_staging(backend: str) -> Staging:
    """The staging a vLLM backend name asks for; ``ValueError`` naming the choices for another name."""
    try:
        return VLLM_BACKENDS[backend]
    except KeyError:
        raise ValueError(f"{backend!r} is not one of asyncsync's vLLM backends {sorted(VLLM_BACKENDS)}") from None


@dataclass(frozen=True)
class StagingCost:
    """What a staging choice adds to a receiver, for a version of ``version_bytes`` served with
    tensor parallelism ``tp`` on nodes of ``gpus_per_node``: ``device_per_gpu`` (the most any one GPU
    gets: host staging's stager holds its two receive buffers, the other workers nothing) and
    ``host_per_node`` (host staging: a copy per engine on the node). Docs and ``asyncsync doctor``
    print these; ``benchmarks/memory.py`` measures them."""

    staging: Staging
    device_per_gpu: int
    host_per_node: int

    @classmethod
    def of(cls, staging: Staging, version_bytes: int, tp: int, bucket_bytes: int, gpus_per_node: int) -> StagingCost:
        if staging == "device":
            return cls(staging, version_bytes, 0)
        engines = max(1, gpus_per_node // tp)
        return cls(staging, RING_SLOTS * min(bucket_bytes, version_bytes), engines * version_bytes)


class Arena:
    """A flat uint8 buffer of one whole version (``tensor``), touched when made."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def views(self, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """Consecutive views of ``sizes`` bytes each from the start (a version's buckets, in order)."""
        views, at = [], 0
        for n in sizes:
            views.append(self.tensor[at : at + n])
            at += n
        if at > self.nbytes:
            raise ValueError(f"{at} bytes do not fit an arena of {self.nbytes}")
        return tuple(views)

    @classmethod
    def on_device(cls, nbytes: int, device: torch.device) -> Arena:
        """``nbytes`` on ``device``, zeroed (every page written now)."""
        return cls(torch.zeros(nbytes, dtype=torch.uint8, device=device))


class HostArena(Arena):
    """An arena in host shared memory (a ``memfd``), writable by its owner, readable by same-host peers
    through ``path``. On CUDA it is page-locked (``pin``), so the stager's device-to-host copies and
    every worker's loads move at full speed."""

    def __init__(self, nbytes: int, name: str = "asyncsync-staging"):
        self._fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, max(nbytes, 1))
            # Populated at once: every page is allocated now, not faulted in during a version.
            mapping = mmap.mmap(self._fd, max(nbytes, 1), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            os.close(self._fd)
            raise
        super().__init__(torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes])
        self.path = f"/proc/{os.getpid()}/fd/{self._fd}"
        self._pinned = False

    @classmethod
    def attach(cls, path: str, nbytes: int) -> Arena:
        """A same-host peer's arena at ``path``, mapped read-only (a write faults instead of reaching the
        owner's bytes). ``OSError`` when it cannot be opened (another host or user, or its owner is gone)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise OSError(f"{path} holds {size} bytes, {nbytes} expected")
            mapping = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # torch warns that the buffer is not writable: that is the point
            warnings.simplefilter("ignore", UserWarning)
            return Arena(torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes])

    def pin(self) -> None:
        """Page-lock the arena for CUDA copies (``cudaHostRegister``). Unexercised: no GPU here."""
        if self._pinned or not self.nbytes:
            return
        err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), self.nbytes, 0)
        if int(err) != 0:
            log.warning("could not page-lock the %d-byte host staging arena (CUDA error %s): copies to and from "
                        "it run at pageable speed", self.nbytes, err)
            return
        self._pinned = True


class DeviceRing:
    """The receive buffers of a stager whose arena is in host memory while its data plane delivers into
    device memory (NCCL): each bucket lands in one of ``RING_SLOTS`` device buffers of the largest
    bucket's size and is copied to the arena on the current stream, which also orders the next
    receive into that buffer after the copy. The only device memory host staging adds."""

    def __init__(self, device: torch.device):
        self.device = device
        self._slots: list[torch.Tensor] = []

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self._slots)

    def reserve(self, nbytes: int) -> None:
        """Grow every buffer to at least ``nbytes`` (a version's largest bucket) before it is received."""
        self._slots = [s if s.numel() >= nbytes else torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                       for s in self._slots or [torch.empty(0, dtype=torch.uint8, device=self.device)] * RING_SLOTS]

    def slot(self, index: int, nbytes: int) -> torch.Tensor:
        """Where bucket ``index`` (``nbytes``, no more than reserved) lands."""
        return self._slots[index % RING_SLOTS][:nbytes]

    @staticmethod
    def copy_out(landed: torch.Tensor, host: torch.Tensor) -> None:
        """Copy a landed bucket into its place in the host arena (ordered on the current stream)."""
        host.copy_(landed, non_blocking=True)
