"""The receiving side of a sync: join the group, take in every bucket of a version, swap it in whole."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping
from typing import Any

import torch

from asyncsync.dataplane import DataPlaneGroup, GroupSpec
from asyncsync.packing import crc32c_of, unpack
from asyncsync.plan import Bucket
from asyncsync.wire import UpdateRequest

log = logging.getLogger(__name__)


class VersionRejected(Exception):
    """A version was received but not applied; the old weights keep serving. The message says why."""


class WeightReceiver:
    """Stages a version next to the live weights and swaps it in only when all of it arrived intact.

    Lifecycle::

        receiver.join(spec, rank)
        for version in updates:
            receiver.receive(request)      # takes part in every broadcast, even for a bad request
            receiver.commit(version)       # copies staging into the live tensors under serve_lock

    A receiver always consumes every broadcast the request announces before judging it, so a
    rejected version never leaves the trainer or the other receivers waiting in a collective.
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], serve_lock: threading.Lock, version: int = 0):
        self._live = dict(weights)
        self.serve_lock = serve_lock
        self.version = version
        self._staging: dict[str, torch.Tensor] | None = None
        self._staged_version: int | None = None
        self._recv = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        self.group: DataPlaneGroup | None = None
        self.rank: int | None = None

    def join(self, spec: GroupSpec, rank: int) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.group = DataPlaneGroup.join(spec, rank)
        self.rank = rank

    def receive(self, req: UpdateRequest) -> None:
        """Receive every bucket of ``req`` into staging; raise ``VersionRejected`` after the last one if
        any bucket was wrong (unknown name, shape or dtype, bad checksum, stale version)."""
        if self.group is None:
            raise VersionRejected("no data-plane group: call /init_group before sending updates")
        if self._staging is None:
            self._staging = {n: torch.empty_like(t) for n, t in self._live.items()}
        self._staged_version = None
        problems: list[str] = []
        if req.version <= self.version:
            problems.append(f"version {req.version} is not newer than the served version {self.version}")
        crcs: list[int] = []
        buckets = [meta.to_bucket(i) for i, meta in enumerate(req.buckets)]
        # Double-buffered: bucket k+1 is already on the wire while bucket k is verified and staged.
        pending = self._post(buckets, 0)
        for index, bucket in enumerate(buckets):
            buf, work = pending
            self.group.wait(work)
            if index + 1 < len(buckets):
                pending = self._post(buckets, index + 1)
            if req.checksum:
                crcs.append(crc32c_of(buf))
            problems.extend(self._stage(buf, bucket))
        if req.checksum:
            expected = torch.zeros(len(req.buckets), dtype=torch.int64)
            self.group.broadcast(expected)
            bad = [i for i, (got, want) in enumerate(zip(crcs, expected.tolist())) if got != want]
            if bad:
                problems.append(f"checksum mismatch in bucket(s) {bad}")
        sent = {n for m in req.buckets for n in m.names}
        missing = sorted(set(self._live) - sent)
        if missing:
            problems.append(f"{len(missing)} tensor(s) missing from the version, e.g. '{missing[0]}'")
        if problems:
            log.warning("rejected version %d: %s", req.version, "; ".join(problems))
            raise VersionRejected(f"version {req.version} rejected: " + "; ".join(problems[:5]))
        self._staged_version = req.version

    def _post(self, buckets: list[Bucket], index: int) -> tuple[torch.Tensor, Any]:
        """Start receiving bucket ``index`` into the ring buffer of its parity."""
        assert self.group is not None
        buf = self._buffer(index % 2, buckets[index].nbytes)
        return buf, self.group.broadcast_async(buf)

    def _stage(self, buf: torch.Tensor, bucket: Bucket) -> list[str]:
        """Copy a bucket's tensors into staging; return what did not match this server's weights."""
        assert self._staging is not None
        problems = []
        for name, view in unpack(buf, bucket):
            target = self._staging.get(name)
            if target is None:
                problems.append(f"unknown tensor '{name}'")
            elif target.shape != view.shape or target.dtype != view.dtype:
                problems.append(f"'{name}': got {view.dtype} {tuple(view.shape)}, expected {target.dtype} {tuple(target.shape)}")
            else:
                target.copy_(view)
        return problems

    def commit(self, version: int) -> int:
        """Swap the staged tensors in (storage pointers, no copy) under ``serve_lock``, so generation
        never sees a torn state; the previous live storage becomes the next staging area."""
        if self._staged_version != version:
            raise VersionRejected(
                f"version {version} is not staged (staged: {self._staged_version}); send /update for it first"
            )
        assert self._staging is not None
        with self.serve_lock, torch.no_grad():
            for name, live in self._live.items():
                previous = live.detach()  # keeps the old storage alive as the next staging tensor
                live.set_(self._staging[name])
                self._staging[name] = previous
            self.version = version
        self._staged_version = None
        return version

    def digest(self) -> dict[str, str]:
        """SHA-256 of every live tensor's bytes: compares weights bit for bit without shipping them."""
        with self.serve_lock:
            return {n: hashlib.sha256(tensor_bytes(t)).hexdigest() for n, t in self._live.items()}

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        if self._recv[slot].numel() < nbytes:
            device = self.group.device if self.group is not None else torch.device("cpu")
            self._recv[slot] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._recv[slot][:nbytes]

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes in C order, whatever its dtype (bfloat16 has no numpy dtype)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
