"""Same-host receive: a version packed by the trainer into POSIX shared memory, mapped and verified.

A trainer on the same host as a receiver does not push a version through sockets: it packs the
version into a shared-memory segment (``/dev/shm/asyncsync-<pid>-<token>-<n>``, one segment per
version slot, every bucket at a 64-byte-aligned offset) and sends only a ``SharedVersion`` in the
update request: the segment's name, each bucket's offset and CRC32C, and the trainer's host
identity. The receiver maps the segment (``MappedSegments``: each once) and judges the version
exactly like one that arrived on the wire (``protocol.intake.SharedMemoryIntake``): every name,
dtype and shape against the tensors it serves, every bucket's CRC32C against the request, the
version against the served one; a bad version is refused whole.

The mapping is read-only: the receiver reads the trainer's bytes without a copy, and a write to
them (a bug: nothing serves by writing its weights in place) faults instead of reaching the trainer
or another receiver. A receiver that can serve from the
mapping keeps it as its live weights (zero copy) and says so (``holds``: the segments it still
maps); the trainer never rewrites a segment a receiver holds, and retires (unlinks, never reuses)
the ones held by a receiver it evicted, so even a receiver that hung while reading keeps intact
bytes. ``release`` is simply dropping the tensors: the kernel unmaps the segment with them.

Host identity (``HostIdentity.here``): the kernel's boot id and the device number of the
shared-memory filesystem. Two processes see the same segments only when both match (containers on
one host share the boot id but not, unless configured so, ``/dev/shm``).

Only torch and the standard library are imported here (receivers load this package).
"""

from __future__ import annotations

import functools
import mmap
import os
import re
import warnings
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

SHM_DIR = "/dev/shm"        # where Linux keeps POSIX shared memory (shm_open names)
SEGMENT_PREFIX = "asyncsync-"
ALIGN = 64                  # every bucket starts at a multiple of this many bytes (any dtype, a cache line)
_NAME = re.compile(r"^asyncsync-(\d+)-[0-9a-f]+-\d+$")


class ShmUnavailable(ValueError):
    """The segment a request names cannot be mapped here (another host, or it is gone)."""


@dataclass(frozen=True)
class HostIdentity:
    """Which host's shared memory a process sees: the boot id and the shared-memory filesystem's
    device number. Equal identities can map each other's segments."""

    boot_id: str
    shm_dev: int

    @classmethod
    @functools.cache
    def here(cls) -> HostIdentity | None:
        """This process's identity, or None where there is no POSIX shared memory to use."""
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot_id = f.read().strip()
            return cls(boot_id, os.stat(SHM_DIR).st_dev)
        except OSError:
            return None

    def to_json(self) -> dict[str, Any]:
        return {"boot_id": self.boot_id, "shm_dev": self.shm_dev}

    @classmethod
    def from_json(cls, data: Any) -> HostIdentity | None:
        if not isinstance(data, dict):
            return None
        boot_id, dev = data.get("boot_id"), data.get("shm_dev")
        if not isinstance(boot_id, str) or not isinstance(dev, int) or isinstance(dev, bool):
            return None
        return cls(boot_id, dev)


def aligned_offsets(sizes: list[int]) -> tuple[tuple[int, ...], int]:
    """Each bucket's offset in a segment (every one a multiple of ``ALIGN``) and the segment's size."""
    offsets, at = [], 0
    for n in sizes:
        offsets.append(at)
        at += -(-n // ALIGN) * ALIGN
    return tuple(offsets), max(at, ALIGN)


def valid_segment_name(name: Any) -> bool:
    return isinstance(name, str) and _NAME.match(name) is not None


def segment_pid(name: str) -> int | None:
    """The pid of the trainer that made segment ``name`` (it is in the name), or None for another name."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def map_segment(name: str, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor over segment ``name``'s first ``nbytes`` bytes: a read-only mapping that
    lives as long as the tensor or any view of it. ``ShmUnavailable`` if it cannot be mapped."""
    if not valid_segment_name(name):
        raise ShmUnavailable(f"{name!r} is not an asyncsync segment name")
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except OSError as e:
        raise ShmUnavailable(f"segment {name} cannot be opened here ({e.strerror}): is the trainer on this host, "
                             "and still running?") from None
    try:
        size = os.fstat(fd).st_size
        if size < nbytes:
            raise ShmUnavailable(f"segment {name} holds {size} bytes, the request needs {nbytes}")
        # Read-only and populated at once: one pass over the page tables instead of a fault per page
        # while verifying. (A writable private mapping would be populated by copying every page: a
        # hidden copy of the whole version per receiver.)
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
        mapping = mmap.mmap(fd, nbytes, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # torch warns that the buffer is not writable: that is the point
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive


class MappedSegments:
    """Each of the trainer's segments mapped once, and kept while it may be mapped again: the trainer
    packs its versions into the same few segments in turn, and mapping 300 MB again costs as much as
    checksumming it. Kept: the segments the live weights map (``keep``) and the last one mapped; the
    others' mappings are dropped. A segment the trainer retired is never written again under a new
    version, so a kept mapping is never stale."""

    def __init__(self) -> None:
        self._mappings: dict[str, torch.Tensor] = {}

    def map(self, segment: str, nbytes: int, keep: Collection[str] = ()) -> torch.Tensor:
        """``segment`` mapped (at least ``nbytes``); ``ShmUnavailable`` if it cannot be."""
        mapped = self._mappings.get(segment)
        if mapped is None or mapped.numel() < nbytes:
            mapped = map_segment(segment, nbytes)
        self._mappings = {n: m for n, m in self._mappings.items() if n in keep} | {segment: mapped}
        return mapped


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (in this pid namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Unlink segments left by asyncsync trainers that no longer run (their pid is in the name)."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        pid = segment_pid(name)
        if pid is not None and pid != os.getpid() and not alive(pid):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed
