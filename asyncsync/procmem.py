"""Memory as the operating system counts it: a process's private bytes and the shared segments it maps.

``benchmarks/memory.py`` and the staging tests hold receivers to their memory bounds with these
figures (Linux ``/proc/<pid>/smaps``), never with the receivers' own bookkeeping:

* a process's **private bytes**: the pages only it maps (``Private_Clean + Private_Dirty``),
  summed over every mapping except shared-memory objects;
* its **segments**: the shared-memory objects it maps (POSIX ``/dev/shm`` files, ``memfd``s, System V
  segments), each with its resident bytes. A segment is the node's memory once, however many
  processes map it (and however many do: a segment mapped by one process alone is private to it
  by the kernel's count, and would otherwise move between the two figures with the number of its
  readers).

So a node's bytes are the sum of its processes' private bytes plus every segment once
(``node_bytes``). Standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field

_SHM_NAMES = ("/dev/shm/", "/memfd:", "/SYSV")


@dataclass(frozen=True)
class ProcessMemory:
    """One process's private bytes and the resident bytes of each segment it maps, keyed
    ``"<device>:<inode> <path>"`` (a ``memfd``'s path is ``/memfd:<name> (deleted)``)."""

    pid: int
    private: int
    segments: dict[str, int] = field(default_factory=dict)


def process_memory(pid: int) -> ProcessMemory:
    """``pid``'s memory now; ``OSError`` when it is gone or not ours to read."""
    private, segments = 0, {}
    segment: str | None = None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            key, _, rest = line.partition(" ")
            if not key.endswith(":"):  # a mapping's header: address perms offset dev inode [path]
                parts = line.split(None, 5)
                path = parts[5].strip() if len(parts) > 5 else ""
                segment = f"{parts[3]}:{parts[4]} {path}" if path.startswith(_SHM_NAMES) else None
                if segment is not None:
                    segments.setdefault(segment, 0)
            elif segment is not None:
                if key == "Rss:":
                    segments[segment] += _kib(rest)
            elif key in ("Private_Clean:", "Private_Dirty:"):
                private += _kib(rest)
    return ProcessMemory(pid, private, segments)


def node_bytes(processes: Iterable[ProcessMemory]) -> int:
    """Their private bytes plus every segment once (its largest resident size among them)."""
    private, segments = 0, {}
    for p in processes:
        private += p.private
        for key, rss in p.segments.items():
            segments[key] = max(segments.get(key, 0), rss)
    return private + sum(segments.values())


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (children, their children...), in pid order."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, p in parents.items():
            if p == parent and child not in tree:
                tree.add(child)
                frontier.append(child)
    return sorted(tree)


def command(pid: int) -> str:
    """``pid``'s command line as ``ps`` shows it (a process may rename itself: vLLM's workers do)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _kib(rest: str) -> int:
    return int(rest.split()[0]) * 1024
