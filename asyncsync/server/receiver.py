"""The receiving side of a sync: join the group, take in every bucket of a version, swap it in whole."""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from asyncsync.dataplane import DataPlaneGroup, GroupSpec
from asyncsync.packing import crc32c_of
from asyncsync.plan import Bucket
from asyncsync.wire import BucketMeta, UpdateRequest

log = logging.getLogger(__name__)


class VersionRejected(Exception):
    """A version was received but not applied; the old weights keep serving. The message says why."""


@dataclass
class _FlatSet:
    """One version's bucket buffers. After a commit the live tensors are views into one of these;
    the version after that is received into the other one, so receiving never copies."""

    layout: tuple[BucketMeta, ...]
    buffers: list[torch.Tensor]


class WeightReceiver:
    """Receives a version into flat staging buffers and swaps it in only when all of it arrived intact.

    Lifecycle::

        receiver.join(spec, rank)
        for version in updates:
            receiver.receive(request)      # takes part in every broadcast, even for a bad request
            receiver.commit(version)       # live tensors become views of the received buffers

    Bytes land directly in the buffers the model will use (no unpack copy). A receiver always
    consumes every broadcast a request announces before judging it, so a rejected version never
    leaves the trainer or the other receivers waiting in a collective.
    """

    def __init__(self, weights: Mapping[str, torch.Tensor], serve_lock: threading.Lock, version: int = 0):
        self._live = dict(weights)
        self.serve_lock = serve_lock
        self.version = version
        self.applied: deque[int] = deque(maxlen=256)  # recent versions swapped in, for operators and tests
        self._sets: list[_FlatSet] = []
        self._live_set: _FlatSet | None = None
        self._staged: tuple[int, _FlatSet, list[Bucket]] | None = None
        self.group: DataPlaneGroup | None = None
        self.rank: int | None = None

    def join(self, spec: GroupSpec, rank: int) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self.group = DataPlaneGroup.join(spec, rank)
        self.rank = rank

    def receive(self, req: UpdateRequest) -> None:
        """Receive every bucket of ``req``; raise ``VersionRejected`` after the last one if anything
        was wrong (unknown name, shape or dtype, missing tensor, bad checksum, stale version)."""
        if self.group is None:
            raise VersionRejected("no data-plane group: call /init_group before sending updates")
        self._staged = None
        buckets = [meta.to_bucket(i) for i, meta in enumerate(req.buckets)]
        problems = self._check_layout(req, buckets)
        target = self._set_for(req.buckets)
        # Every receive is posted at once; gloo runs them in order while earlier buckets are checksummed.
        works = [self.group.broadcast_async(buf) for buf in target.buffers]
        crcs = []
        for buf, work in zip(target.buffers, works):
            self.group.wait(work)
            if req.checksum:
                crcs.append(crc32c_of(buf))
        if req.checksum:
            expected = torch.zeros(len(buckets), dtype=torch.int64, device=self.group.device)
            self.group.broadcast(expected)
            bad = [i for i, (got, want) in enumerate(zip(crcs, expected.tolist())) if got != want]
            if bad:
                problems.append(f"checksum mismatch in bucket(s) {bad}")
        if problems:
            log.warning("rejected version %d: %s", req.version, "; ".join(problems))
            raise VersionRejected(f"version {req.version} rejected: " + "; ".join(problems[:5]))
        self._staged = (req.version, target, buckets)

    def _check_layout(self, req: UpdateRequest, buckets: list[Bucket]) -> list[str]:
        problems = []
        if req.version <= self.version:
            problems.append(f"version {req.version} is not newer than the served version {self.version}")
        sent = set()
        for spec in (s for b in buckets for s in b.specs):
            sent.add(spec.name)
            live = self._live.get(spec.name)
            if live is None:
                problems.append(f"unknown tensor '{spec.name}'")
            elif tuple(live.shape) != spec.shape or live.dtype != spec.dtype:
                problems.append(f"'{spec.name}': got {spec.dtype} {spec.shape}, expected {live.dtype} {tuple(live.shape)}")
        missing = sorted(set(self._live) - sent)
        if missing:
            problems.append(f"{len(missing)} tensor(s) missing from the version, e.g. '{missing[0]}'")
        return problems

    def _set_for(self, layout: tuple[BucketMeta, ...]) -> _FlatSet:
        """A buffer set for ``layout`` that the live weights do not use; sets of stale layouts are dropped."""
        self._sets = [s for s in self._sets if s is self._live_set or s.layout == layout]
        for s in self._sets:
            if s is not self._live_set:
                return s
        assert self.group is not None
        fresh = _FlatSet(layout, [torch.empty(m.nbytes, dtype=torch.uint8, device=self.group.device) for m in layout])
        self._sets.append(fresh)
        return fresh

    def commit(self, version: int) -> int:
        """Point every live tensor at its bytes in the received buffers, under ``serve_lock`` so
        generation never sees a torn state."""
        if self._staged is None or self._staged[0] != version:
            staged = self._staged[0] if self._staged else None
            raise VersionRejected(f"version {version} is not staged (staged: {staged}); send /update for it first")
        _, target, buckets = self._staged
        with self.serve_lock, torch.no_grad():
            for buf, bucket in zip(target.buffers, buckets):
                for spec, offset in zip(bucket.specs, bucket.offsets):
                    live = self._live[spec.name]
                    live.set_(buf.untyped_storage(), offset // spec.itemsize, spec.shape, _contiguous_strides(spec.shape))
            self.version = version
            self.applied.append(version)
            self._live_set = target
        self._staged = None
        return version

    def digest(self) -> tuple[int, dict[str, str]]:
        """The served version and the SHA-256 of every live tensor's bytes, taken together: compares
        weights bit for bit without shipping them."""
        with self.serve_lock:
            return self.version, {n: hashlib.sha256(tensor_bytes(t)).hexdigest() for n, t in self._live.items()}

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def tensor_bytes(t: torch.Tensor) -> bytes:
    """A tensor's bytes in C order, whatever its dtype (bfloat16 has no numpy dtype)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
