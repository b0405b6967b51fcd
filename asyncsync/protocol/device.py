"""The one seam between asyncsync and an accelerator runtime.

Everything the sync does whose meaning depends on the kind of device goes through a ``Runtime``:
the calling thread's current device and stream, dedicated streams, events, the data-plane process
group (its backend, its error policy, the lock its operations are enqueued under), host-side waits
with a deadline, and uploads from pinned memory. The semantics therefore live in one place, and CPU
tests substitute a fake with CUDA's semantics (``tests/fakes.py``: per-thread current streams,
events that complete when their stream reaches them, NCCL works that complete late).

CUDA semantics this encodes (torch 2.13, NCCL; docs/design.md "GPU semantics" has the sources):

* The current stream and the current device are per OS thread; a new thread starts on the device's
  default stream of device 0. Every thread asyncsync starts calls ``enter_thread`` first.
* ``torch.cuda.Stream()`` hands out one of 32 pool streams round-robin, the pool ProcessGroupNCCL
  takes its internal stream from: a pool stream can be the NCCL stream itself. ``new_stream``
  creates a stream nobody else holds (``cudaStreamCreateWithFlags``, wrapped as an ExternalStream).
* A collective waits on the calling thread's current stream; ``Work.wait()`` only makes the
  caller's current stream wait and never raises for a dead peer; ``Work.wait(timeout)`` blocks the
  host and raises. The default error handling (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``) kills the
  process on a timeout; ``shutdown()`` waits for kernels (hangs with a dead peer), ``abort()`` kills
  them. So asyncsync's NCCL groups are built with blocking waits and no process teardown, every
  wait has a deadline, and a broken group is aborted.
* NCCL forbids issuing operations to communicators on one device from several threads in parallel:
  every operation on asyncsync's groups is enqueued under one process-wide lock.

Only ``HostRuntime`` runs on this project's machines; ``CudaRuntime`` is written to the semantics
above and has never run (no GPU here).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch

log = logging.getLogger(__name__)

# Every operation on asyncsync's NCCL groups in this process is enqueued under this lock (NCCL's
# thread-safety rule).
ENQUEUE_LOCK = threading.RLock()
_ENV_LOCK = threading.Lock()  # one group's environment at a time

# Read once by ProcessGroupNCCL's constructor, so setting them around it scopes them to that group:
# waits block the host with the group's timeout and raise in the waiting thread (no watchdog thread),
# nothing tears the process down, and no heartbeat monitor can kill it later.
NCCL_GROUP_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "TORCH_NCCL_ENABLE_MONITORING": "0"}


class Runtime(ABC):
    """The device-dependent primitives the sync uses; one instance per device."""

    kind: str           # "host" or "cuda": the semantics
    wire_backend: str   # the data-plane backend groups on this device use: "gloo" or "nccl"
    device: torch.device  # where this runtime's tensors are allocated
    group_env: dict[str, str] = {}  # environment a data-plane group is constructed under (its error policy)

    @abstractmethod
    def enter_thread(self) -> None:
        """Called first by every thread asyncsync starts: make ``device`` the thread's current device."""

    @abstractmethod
    def new_stream(self) -> Any:
        """A stream no one else holds (not from a shared pool), for one of the sync's own threads."""

    @abstractmethod
    def current_stream(self) -> Any:
        """The calling thread's current stream on ``device``."""

    @abstractmethod
    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        """Make ``stream`` the calling thread's current stream inside the block."""

    @abstractmethod
    def set_stream(self, stream: Any) -> None:
        """Make ``stream`` the calling thread's current stream from now on (a thread's own stream)."""

    @abstractmethod
    def record(self, stream: Any | None = None) -> Any:
        """An event marking the point reached by ``stream`` (default: the current stream)."""

    @abstractmethod
    def wait_event(self, event: Any, stream: Any | None = None) -> None:
        """Order later work of ``stream`` (default: the current stream) after ``event``; host does not block."""

    @abstractmethod
    def host_wait(self, event: Any) -> None:
        """Block the calling host thread until ``event`` has completed."""

    @abstractmethod
    def process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        """The data-plane process group for this device; the caller constructs it under ``group_env``."""

    @abstractmethod
    def wait_work(self, work: Any, timeout: timedelta) -> None:
        """Wait for a collective: later work on the current stream is ordered after it, and the host
        blocks until it completes or ``timeout`` passes; raises on failure or timeout."""

    def abort(self, pg: Any) -> None:
        """Tear down a process group whose collectives failed (a dead peer): never waits for them."""
        pg.abort()

    def shutdown(self, pg: Any) -> None:
        """Close a healthy process group."""
        pg.shutdown()

    @abstractmethod
    def upload(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on ``device`` without blocking the host (from pinned memory on CUDA)."""

    def return_freed(self) -> None:
        """Give memory freed after a load back to the operating system where an allocator keeps it: on
        the host glibc keeps the heap of freed small tensors (a weight reload frees one model's worth of
        per-layer temporaries); CUDA's caching allocator keeps its cache by design (an engine's memory
        profile counts it)."""


class HostRuntime(Runtime):
    """CPU: work runs synchronously on the calling thread, so a stream is the thread itself and an
    event is already complete when it is recorded; the data plane is gloo, whose waits block."""

    kind = "host"
    wire_backend = "gloo"

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.device = device

    def enter_thread(self) -> None:
        pass

    def new_stream(self) -> None:
        return None

    def current_stream(self) -> None:
        return None

    @contextlib.contextmanager
    def use_stream(self, stream: Any) -> Iterator[None]:
        yield

    def set_stream(self, stream: Any) -> None:
        pass

    def record(self, stream: Any | None = None) -> threading.Event:
        done = threading.Event()
        done.set()  # everything issued by this thread so far has run
        return done

    def wait_event(self, event: threading.Event, stream: Any | None = None) -> None:
        event.wait()  # on the host "the stream" is the thread

    def host_wait(self, event: threading.Event) -> None:
        event.wait()

    def process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        from torch.distributed import ProcessGroupGloo

        return ProcessGroupGloo(store, rank, world_size, timeout)

    def wait_work(self, work: Any, timeout: timedelta) -> None:
        work.wait()  # gloo's waits block and raise at the group's own timeout

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return host

    def return_freed(self) -> None:
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc: its allocator decides
            pass


class CudaRuntime(Runtime):  # unexercised on this project's CPU-only machines
    """CUDA: per-thread current device and stream, dedicated streams, CUDA events, NCCL groups."""

    kind = "cuda"
    wire_backend = "nccl"
    group_env = NCCL_GROUP_ENV

    def __init__(self, device: torch.device):
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())

    def enter_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def new_stream(self) -> torch.cuda.Stream:
        return dedicated_stream(self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager[None]:
        return torch.cuda.stream(stream)

    def set_stream(self, stream: torch.cuda.Stream) -> None:
        torch.cuda.set_stream(stream)

    def record(self, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream if stream is not None else self.current_stream())
        return event

    def wait_event(self, event: torch.cuda.Event, stream: torch.cuda.Stream | None = None) -> None:
        (stream if stream is not None else self.current_stream()).wait_event(event)

    def host_wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def process_group(self, store: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, world_size, opts)

    def wait_work(self, work: Any, timeout: timedelta) -> None:
        work.wait(timeout)  # orders the current stream, then polls the host; raises (and aborts) on failure

    def upload(self, host: torch.Tensor) -> torch.Tensor:
        return host.pin_memory().to(self.device, non_blocking=True)


def runtime_for(device: torch.device) -> Runtime:
    """The runtime for tensors on ``device``. Tests replace this function to run the CUDA code paths
    on CPU tensors with a fake runtime."""
    return CudaRuntime(device) if device.type == "cuda" else HostRuntime(device)


@contextlib.contextmanager
def scoped_env(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, for a constructor that reads them
    once. Other threads reading the environment meanwhile see the values too (nothing else in
    asyncsync reads these); torch documents that setenv may race with another thread's getenv."""
    if not values:
        yield
        return
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


_cudart: ctypes.CDLL | None = None


def dedicated_stream(device: torch.device) -> torch.cuda.Stream:
    """A non-blocking CUDA stream of our own (``cudaStreamCreateWithFlags``), wrapped as a torch
    ExternalStream. It is never destroyed: allocations made on it may outlive any owner we could pick.
    Falls back to a high-priority pool stream (with a warning) when the CUDA runtime library cannot be
    found by name."""
    global _cudart
    torch.cuda.set_device(device)
    if _cudart is None:
        for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"):
            try:
                _cudart = ctypes.CDLL(name)
                break
            except OSError:
                continue
    if _cudart is None:
        log.warning("could not load the CUDA runtime library to create a dedicated stream; using a high-priority "
                    "pool stream, which other pool users may share")
        return torch.cuda.Stream(device=device, priority=-1)
    handle = ctypes.c_void_p()
    err = _cudart.cudaStreamCreateWithFlags(ctypes.byref(handle), ctypes.c_uint(1))  # cudaStreamNonBlocking
    if err != 0:
        raise RuntimeError(f"cudaStreamCreateWithFlags failed with CUDA error {err} on {device}")
    return torch.cuda.ExternalStream(handle.value, device=device)
