"""One whole version received off the data plane, frame by frame, into buffers chosen for it.

``protocol.intake.WireIntake`` decides whether a version may be received and where it lands; this
module receives it, in the order the trainer sends (``transport/datapath.py``): for each
payload (a bucket, or its delta, then the checksum manifest) first its frame header, checked against
the announcement before the payload's receive is posted (a member that would send more than was
announced is refused, not aborted on; its MAC, where the group is keyed, opened by the group's
``seal``), then the payload itself, while the payload before it is
checksummed, rebuilt from its delta or copied out of the device ring, and forwarded to the
servers below this one where it relays (``protocol.relay``). With ``req.digest`` each bucket is
also hashed as it lands (``protocol.digest``: the rebuilt bucket of a delta), for ``end`` to compare
with the trainer's digests. What is left after the last byte is one bucket's work; the forwards go on down (the caller waits for them before the buffers are reused).
Each wait returns only once its data has arrived (the group's waits block the host), so nothing is
judged before the bytes are really in the buffers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from asyncsync.protocol.arena import DeviceRing
from asyncsync.protocol.checksum import bucket_crc
from asyncsync.protocol.delta import DeltaError, delta_word, rebuild
from asyncsync.protocol.digest import bucket_digest
from asyncsync.protocol.device import Runtime
from asyncsync.protocol.frames import FrameHeader, VersionFrames, empty_header
from asyncsync.protocol.relay import Edge, Forward
from asyncsync.protocol.specs import Bucket
from asyncsync.protocol.wire import UpdateRequest

Crc = int | torch.Tensor | None  # on a device: computed there, read once at the end


class Unframed(Exception):
    """A frame header disagreed with the announcement: its payload was never posted."""


class FramedReceive:
    """Receives ``req``'s payloads on ``groups`` (group i: trainer rank i's) into ``buffers`` (one per
    bucket); what is wrong with what arrived is appended to ``problems``.

    ``base``: the committed version's buffers a delta bucket is rebuilt from (None: none usable; a
    delta then only adds a problem). ``ring``: device buffers a bucket lands in before it is copied
    to a host arena (NCCL into host staging). ``forward``: where each payload goes once it landed, to
    the servers below this one (``protocol.relay``; where there is a ring, made with ``in_flight`` one
    less than its slots: payload i is received into a slot only once the forward of payload i - 2,
    which held that slot, is done, while the forward of payload i - 1 still runs).

    Contract: ``run`` returns once every payload is in place, or raises ``Unframed`` or
    ``DataPlaneError``: the caller must then leave the groups (their collectives are out of step).
    Pending works live only in ``run``'s frame, so none outlives the exception that ends it."""

    def __init__(self, req: UpdateRequest, groups: Sequence[Edge], runtime: Runtime,
                 ring: DeviceRing | None, buffers: Sequence[torch.Tensor], buckets: tuple[Bucket, ...],
                 base: Sequence[torch.Tensor] | None, problems: list[str], forward: Forward | None = None):
        self.req, self.groups, self.runtime, self.ring = req, groups, runtime, ring
        self.buffers, self.buckets, self.base, self.problems = buffers, buckets, base, problems
        device = groups[0].device
        sizes = req.delta.nbytes if req.delta is not None else [0] * len(buffers)
        # Deltas land in buffers of their own and are rebuilt into the target once they arrived.
        self.deltas = [torch.empty(k, dtype=torch.uint8, device=device) if k else None for k in sizes]
        if ring is not None:
            ring.reserve(max((m.nbytes for m in req.buckets), default=0))
        self.payloads = [d if d is not None else ring.slot(i, buf.numel()) if ring is not None else buf
                         for i, (d, buf) in enumerate(zip(self.deltas, buffers))]
        if req.checksum:
            self.payloads.append(torch.zeros(len(buffers), dtype=torch.int64, device=device))
        self.crcs: list[Crc] = []
        self.digests: list[str] = []  # with ``req.digest``: each bucket's, as it landed
        self.forward = forward or Forward((), VersionFrames.of(req), runtime)

    def run(self) -> None:
        req, payloads = self.req, self.payloads
        frames = self.forward.frames  # the announcement's, computed once per version
        header = self._post_header(0)
        landing: tuple[Edge, Any] | None = None  # the payload before the current one
        for i, payload in enumerate(payloads):
            on = self.groups[req.source(i)]
            if landing is not None:  # the payload before goes down as soon as it landed (a relay)
                landing[0].wait(landing[1])
                self.forward.send(i - 1, payloads[i - 1], req.deadline_s(i - 1))
            problem = frames.mismatch(self._header(*header), i, payload.numel() * payload.element_size())
            if problem is not None:
                raise Unframed(problem)
            work = on.broadcast_async(payload, req.deadline_s(i))
            if i + 1 < len(payloads):
                header = self._post_header(i + 1)
            if landing is not None:
                self._landed(len(self.crcs))  # checked while this payload arrives
            landing = (on, work)
        assert landing is not None
        landing[0].wait(landing[1])
        self.forward.send(len(payloads) - 1, payloads[-1], req.deadline_s(len(payloads) - 1))
        if len(self.crcs) < len(self.buffers):  # the last bucket, where no manifest came after it
            self._landed(len(self.crcs))
        if self.ring is not None:
            self.runtime.host_wait(self.runtime.record())  # the arena holds every byte before it is read
            if req.digest:  # hashed once the arena holds them (the copies out of the ring are on a stream)
                self.digests = [bucket_digest(b) for b in self.buffers]
        if req.checksum:
            manifest = payloads[len(self.buffers)].tolist()
            bad = [i for i, (got, want) in enumerate(zip(self.crcs, manifest)) if got is not None and int(got) != want]
            if bad:
                self.problems.append(f"checksum mismatch in bucket(s) {bad}")

    def _landed(self, j: int) -> None:
        """Payload ``j`` has arrived (``j`` < the bucket count): checksum it, rebuild it from its
        delta, or copy it from the ring to the arena."""
        if j >= len(self.buffers):
            return
        delta = self.deltas[j]
        if delta is not None:
            crc = self._rebuild(j, delta)
        else:
            crc = bucket_crc(self.payloads[j]) if self.req.checksum else None
            if self.ring is not None:
                self.ring.copy_out(self.payloads[j], self.buffers[j])
        self.crcs.append(crc)
        if self.req.digest and self.ring is None:
            self.digests.append(bucket_digest(self.buffers[j]))

    def _rebuild(self, index: int, payload: torch.Tensor) -> Crc:
        """Bucket ``index`` rebuilt into its buffer from the committed version and its delta; its
        CRC32C, or None (and a problem) when there is no usable baseline or the delta does not decode."""
        if self.base is None:
            return None
        out = self.buffers[index]
        try:
            return rebuild(payload.to(out.device), self.base[index], out, delta_word(self.buckets[index]))
        except DeltaError as e:
            self.problems.append(f"bucket {index}'s delta does not decode: {e}")
            return None

    def _post_header(self, index: int) -> tuple[Edge, Any, torch.Tensor]:
        """Post the receive of frame ``index``'s header, on the group its payload arrives on. Its
        deadline covers the previous frame's payload too, which the sender broadcasts before it."""
        group = self.groups[self.req.source(index)]
        deadline = self.req.deadline_s(index)
        if deadline is not None and index:
            deadline += self.req.deadline_s(index - 1) or 0.0
        buf = empty_header(group.device)
        return group, group.broadcast_async(buf, deadline), buf

    @staticmethod
    def _header(group: Edge, work: Any, buf: torch.Tensor) -> FrameHeader | None:
        group.wait(work)
        return group.seal.open(buf)
