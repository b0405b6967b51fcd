"""The trainer's side of same-host transport: shared-memory segments, leased to the servers that map them.

    pool = SegmentPool(sizes)              # one per WeightSync; sweeps segments of dead trainers first
    book.lease_from(pool)                  # each sender's book of servers: what they still map
    seg = pool.acquire(previous)           # a segment no server holds: packed into, then sent by name
    ... send_version: servers map it (``protocol/shm.py``), answer ``end`` with what they hold ...
    pool.retire(names)                     # an evicted server's segments: never written again
    pool.close()                           # unlink everything

The lease: a segment is written only when no server holds it and no ``SharedSnapshot`` is bound to
it (a version being sent). Who holds what is each server's record in its sender's book of servers
(``transport.book``: the ``end`` answers); a server the trainer evicted (dead, hung or unreachable
while it may still be reading) loses its lease, and every segment it held or was reading is
*retired*: unlinked and never written again, so what a hung server maps stays intact, and no other
server waits for it. Segments are named
``asyncsync-<trainer pid>-<token>-<n>``: ``close`` unlinks them; after a crash of the trainer its
``multiprocessing`` resource tracker (a separate process, unless the trainer was spawned by a process
whose tracker it shares) unlinks them, a same-host reference server that maps one removes every
segment whose trainer pid no longer exists within a second (``protocol.shm.sweep_stale``), and so
does the next trainer's pool when it starts.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
from collections.abc import Callable
from multiprocessing import shared_memory

import torch

from asyncsync.protocol.shm import SEGMENT_PREFIX, HostIdentity, aligned_offsets, sweep_stale

log = logging.getLogger(__name__)


class Segment:
    """One shared-memory segment holding a whole version, every bucket at its aligned offset."""

    def __init__(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...], nbytes: int):
        self.name, self.offsets = name, offsets
        self._shm = shared_memory.SharedMemory(name, create=True, size=nbytes)
        flat = torch.frombuffer(self._shm.buf, dtype=torch.uint8)
        self.views = [flat[o : o + n] for o, n in zip(offsets, sizes)]
        self.bound = False   # a SharedSnapshot writes into it or sends from it
        self.retired = False

    @property
    def nbytes(self) -> int:
        return self._shm.size

    def unlink(self) -> None:
        """Remove the name (mappings, ours and the servers', stay valid until dropped)."""
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Unlink and drop our mapping; the pages go once no server maps them either."""
        self.unlink()
        self.views = []
        try:
            self._shm.close()
        except BufferError:  # a tensor view is still referenced somewhere: it unmaps when collected
            pass


class SegmentPool:
    """Segments for a plan's buckets (``sizes``), reused across versions under the servers' leases."""

    def __init__(self, sizes: list[int]):
        self.sizes = tuple(sizes)
        self.offsets, self.nbytes = aligned_offsets(sizes)
        self.host = HostIdentity.here()
        self._token = secrets.token_hex(4)
        self._count = 0
        self._segments: list[Segment] = []
        self._leases: list[Callable[[], frozenset[str]]] = []  # each book's segments its servers map
        self._lock = threading.Lock()  # the senders of several books pack and retire concurrently
        for name in sweep_stale():
            log.warning("removed shared-memory segment %s of a trainer that no longer runs", name)

    @property
    def allocated(self) -> int:
        """Bytes of shared memory this pool holds (every segment not retired)."""
        return sum(s.nbytes for s in self._segments)

    def track(self, leased: Callable[[], frozenset[str]]) -> None:
        """``leased()`` names segments some server maps (a book of servers): never handed out."""
        self._leases.append(leased)

    def acquire(self, previous: Segment | None = None) -> Segment:
        """A segment no server holds and nothing else is bound to (``previous``, the caller's last
        one, is unbound first, so it is reused when free); a new one if every segment is leased."""
        with self._lock:
            if previous is not None:
                previous.bound = False
            held = set().union(*(leased() for leased in self._leases))
            free = next((s for s in self._segments if not s.bound and s.name not in held), None)
            if free is None:
                self._count += 1
                free = Segment(f"{SEGMENT_PREFIX}{os.getpid()}-{self._token}-{self._count}", self.offsets, self.sizes,
                               self.nbytes)
                self._segments.append(free)
                log.info("shared memory: segment %d of %.1f MB (%d held by servers)", len(self._segments),
                         self.nbytes / 1e6, len(held))
            free.bound = True
            return free

    def retire(self, names: frozenset[str] | set[str]) -> None:
        """Segments an evicted server held or was reading: unlinked, never written again."""
        with self._lock:
            for s in [s for s in self._segments if s.name in names]:
                self._retire(s)

    def _retire(self, segment: Segment) -> None:
        segment.retired = True
        segment.unlink()  # unbound users keep their mapping; no one can map it anew
        self._segments.remove(segment)
        log.info("shared memory: retired segment %s (its server lost its lease)", segment.name)

    def close(self) -> None:
        with self._lock:
            for s in self._segments:
                s.close()
            self._segments = []
