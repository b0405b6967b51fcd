"""Stand-ins that make timing visible on a CPU: device work that completes late.

``LateStreams`` is a ``StreamSet`` whose copies run on a separate "device" thread, each after a
delay, the way a GPU runs queued kernels after the host has moved on. A marker is set only when its
copy has really run, so code that reads a snapshot before waiting on its marker, or lets the trainer
write parameters before waiting, reads or writes at the wrong time, and the bytes show it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from asyncsync.trainer.streams import StreamSet


class LateStreams(StreamSet):
    def __init__(self, delay_s: float = 0.05):
        self.delay_s = delay_s
        self._work: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._device = threading.Thread(target=self._run, name="fake-device", daemon=True)
        self._device.start()
        self.copies = 0

    def _run(self) -> None:
        while (item := self._work.get()) is not None:
            item()

    def params_ready(self) -> threading.Event:
        ready = threading.Event()
        ready.set()  # the trainer's CPU writes are done when it calls publish()
        return ready

    def copy(self, fn: Callable[[], None], after: threading.Event) -> threading.Event:
        done = threading.Event()

        def late() -> None:
            after.wait()
            time.sleep(self.delay_s)
            fn()
            self.copies += 1
            done.set()

        self._work.put(late)
        return done

    def compute_wait(self, marker: threading.Event) -> None:
        marker.wait()

    def comm_wait(self, marker: threading.Event) -> None:
        marker.wait()

    def close(self) -> None:
        self._work.put(None)
        self._device.join(10)
