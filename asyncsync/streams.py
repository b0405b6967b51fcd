"""Where sync work runs, and the events that order it: CUDA streams on GPUs, threads on CPUs.

The protocol code (``asyncsync.worker``) is one code path over this interface::

    marker = streams.params_ready()          # trainer, in publish(): the step's writes are issued
    with streams.copying(after=marker):      # worker: the snapshot copy runs after those writes
        pack(...)
    done = streams.snapshot_done()           # worker: marks the end of the snapshot copy
    streams.compute_wait(done)               # trainer, in wait_snapshot(): later writes wait for it
    streams.comm_wait(done)                  # worker: broadcasts start after the copy

On CUDA the copy runs on a dedicated stream created once and reused (fresh streams strand
allocator memory), and ``compute_wait`` is a stream-side wait: the host does not block. On the CPU
the copy runs synchronously on the worker thread, so a marker is a ``threading.Event`` that is set
when the copy has finished, and ``compute_wait`` blocks the trainer's thread on it.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

import torch


class StreamSet(ABC):
    @staticmethod
    def for_device(device: torch.device) -> StreamSet:
        return CudaStreams(device) if device.type == "cuda" else HostStreams()

    @abstractmethod
    def params_ready(self) -> Any: ...

    @abstractmethod
    def copying(self, after: Any) -> contextlib.AbstractContextManager[None]: ...

    @abstractmethod
    def snapshot_done(self) -> Any: ...

    @abstractmethod
    def compute_wait(self, marker: Any) -> None: ...

    @abstractmethod
    def comm_wait(self, marker: Any) -> None: ...


class HostStreams(StreamSet):
    """CPU: work is ordered by the worker thread itself; markers are events set when work is done."""

    def params_ready(self) -> threading.Event:
        ready = threading.Event()
        ready.set()  # CPU writes issued by the trainer's thread are complete when publish() runs
        return ready

    @contextlib.contextmanager
    def copying(self, after: threading.Event) -> Iterator[None]:
        after.wait()
        yield

    def snapshot_done(self) -> threading.Event:
        done = threading.Event()
        done.set()  # called after the synchronous copy returned
        return done

    def compute_wait(self, marker: threading.Event) -> None:
        marker.wait()

    def comm_wait(self, marker: threading.Event) -> None:
        marker.wait()


class CudaStreams(StreamSet):  # unexercised on this project's CPU-only machines
    """CUDA: a dedicated copy stream; markers are CUDA events; waits are stream-side."""

    def __init__(self, device: torch.device):
        self.device = device
        self.copy_stream = torch.cuda.Stream(device=device)

    def params_ready(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    @contextlib.contextmanager
    def copying(self, after: torch.cuda.Event) -> Iterator[None]:
        self.copy_stream.wait_event(after)
        with torch.cuda.stream(self.copy_stream):
            yield

    def snapshot_done(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(self.copy_stream)
        return event

    def compute_wait(self, marker: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(marker)

    def comm_wait(self, marker: torch.cuda.Event) -> None:
        # NCCL collectives are ordered after the calling thread's current stream.
        torch.cuda.current_stream(self.device).wait_event(marker)
