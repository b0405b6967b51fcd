"""Where the sync's device work runs, and the markers that order it: CUDA streams on GPUs, threads on CPUs.

The worker is one code path over this interface::

    marker = streams.params_ready()            # trainer, in publish(): the step's writes are issued
    done = streams.copy(pack_all, after=marker)  # snapshotter: the snapshot copy, ordered after them
    streams.compute_wait(done)                 # trainer, in wait_snapshot(): later writes wait for it
    streams.comm_wait(done)                    # sender: broadcasts read the snapshot after the copy

``copy`` runs ``fn`` so that its device work is ordered after ``after`` and returns the marker of its
end. On CUDA the copy's kernels are enqueued on a dedicated stream (created once: fresh streams strand
allocator memory) and every wait is stream-side, so the host never blocks. On the CPU the copy runs
synchronously on the worker's thread and a marker is a ``threading.Event`` set when it has finished.
Tests substitute a set whose copies complete late (``tests/fakes``) to prove every wait is in place.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

Marker = Any


class StreamSet(ABC):
    @staticmethod
    def for_device(device: torch.device) -> StreamSet:
        return CudaStreams(device) if device.type == "cuda" else HostStreams()

    @abstractmethod
    def params_ready(self) -> Marker:
        """Called by the trainer thread: marks the point after every write of the step just issued."""

    @abstractmethod
    def copy(self, fn: Callable[[], None], after: Marker) -> Marker:
        """Run ``fn``'s copies ordered after ``after``; returns the marker of their end."""

    @abstractmethod
    def compute_wait(self, marker: Marker) -> None:
        """Called by the trainer thread: work it issues from now on runs after ``marker``."""

    @abstractmethod
    def comm_wait(self, marker: Marker) -> None:
        """Called by a sender thread: broadcasts it issues from now on read data ready at ``marker``."""


class HostStreams(StreamSet):
    """CPU: work is ordered by the threads themselves; markers are events set when work is done."""

    def params_ready(self) -> threading.Event:
        ready = threading.Event()
        ready.set()  # CPU writes issued by the trainer's thread are complete when publish() runs
        return ready

    def copy(self, fn: Callable[[], None], after: threading.Event) -> threading.Event:
        after.wait()
        fn()
        done = threading.Event()
        done.set()
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

    def copy(self, fn: Callable[[], None], after: torch.cuda.Event) -> torch.cuda.Event:
        self.copy_stream.wait_event(after)
        with torch.cuda.stream(self.copy_stream):
            fn()
        done = torch.cuda.Event()
        done.record(self.copy_stream)
        return done

    def compute_wait(self, marker: torch.cuda.Event) -> None:
        torch.cuda.current_stream(self.device).wait_event(marker)

    def comm_wait(self, marker: torch.cuda.Event) -> None:
        # NCCL collectives are ordered after the calling thread's current stream.
        torch.cuda.current_stream(self.device).wait_event(marker)
