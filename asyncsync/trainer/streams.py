"""Which stream each of the sync's threads uses, and the markers that order their work.

Threads and streams (on CUDA; on the CPU every stream is the thread itself and every marker is
complete when it is recorded, so the same code runs synchronously)::

    trainer thread    its own current stream (the compute stream)  params_ready(), compute_wait()
    snapshotter       a dedicated copy stream                      copy(fn, after=[...]) -> done
    each sender       its own dedicated stream, current for life   comm_wait(done), sent()

    publish:       ready = params_ready()                 # after every write of the step
    snapshot:      done = copy(pack, after=[ready, *sent_of_that_snapshot])
    wait_snapshot: compute_wait(done)                     # later writes wait for the copy: stream-side
    send:          comm_wait(done); broadcast...; sent()  # broadcasts read the snapshot after the copy;
                                                          # the copy into it again waits for sent()

A collective waits on the calling thread's current stream, so a sender's broadcasts, the waits on
their works and ``sent`` all live on the sender's own stream and never on the trainer's. Streams are
dedicated (``Runtime.new_stream``), never taken from torch's shared pool, so no sync stream is the
NCCL stream of another group and a hung server cannot hold up the snapshot copy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from asyncsync.protocol.device import Runtime

Marker = Any


class StreamSet:
    """The sync's streams on one device, over its ``Runtime``."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.copy_stream: Any = None

    # -- per-thread set-up: the first thing each of the sync's threads does ---------------------

    def enter_copy_thread(self) -> None:
        """The snapshotter's start: its device, and a dedicated copy stream."""
        self.runtime.enter_thread()
        self.copy_stream = self.runtime.new_stream()

    def enter_sender_thread(self) -> None:
        """A sender's start: its device, and a dedicated stream made current for the thread's life,
        so every collective it issues, and every wait on one, is ordered on it."""
        self.runtime.enter_thread()
        self.runtime.set_stream(self.runtime.new_stream())

    # -- markers --------------------------------------------------------------------------------

    def params_ready(self) -> Marker:
        """Trainer thread, in publish(): marks the point after every write of the step just issued."""
        return self.runtime.record()

    def copy(self, fn: Callable[[], None], after: Sequence[Marker]) -> Marker:
        """Snapshotter: run ``fn``'s copies on the copy stream, ordered after every marker in ``after``;
        returns the marker of their end. Enqueues only: the host does not wait for the copies."""
        for marker in after:
            self.runtime.wait_event(marker, self.copy_stream)
        with self.runtime.use_stream(self.copy_stream):
            fn()
        return self.runtime.record(self.copy_stream)

    def compute_wait(self, marker: Marker) -> None:
        """Trainer thread: work it issues from now on runs after ``marker`` (no host wait on CUDA)."""
        self.runtime.wait_event(marker)

    def comm_wait(self, marker: Marker) -> None:
        """Sender thread: broadcasts it issues from now on read data ready at ``marker``."""
        self.runtime.wait_event(marker)

    def sent(self) -> Marker:
        """Sender thread, after its last wait on a version's broadcasts: the point after which the
        snapshot they read may be rewritten."""
        return self.runtime.record()
