"""Frame headers: the data plane agrees the size of every payload before the payload moves.

A gloo receive is posted with a size, and gloo *aborts the process* (``gloo::EnforceNotMet``,
``op.preamble.length <= op.nbytes``) when the sender sends more than that: so a receiver that posted
a bucket's receive with the size the trainer announced over HTTP can be killed by any member of the
group that sends something longer (a trainer of another release, a packing bug, a lie). Under
``PROTOCOL_VERSION`` 2 every payload of a version (each bucket, then the checksum manifest) is
preceded by one broadcast of a ``FrameHeader``: ``HEADER_WORDS`` int64s, always the same size, that
carry the protocol, a hash of the version's plan (its ``UpdateRequest``: names, dtypes, shapes,
sizes, sources), the version, the frame's index and the exact byte length of the payload that
follows. The receiver posts the header's receive, checks it against the announcement, and only then
posts the payload's receive, with a size now agreed by both; on any difference it posts nothing
more and leaves the group, which fails the sender's broadcast at once instead of aborting anyone.

The sender takes each header's length from the very tensor it broadcasts next, so a bug that
packs a bucket of another size changes the header with it and is refused, never aborted on. What
frames cannot close (a member that lies in the header itself, or skips one) is in docs/faults.md.

SGLang's receivers know nothing of frames: its groups stay unframed (``DataPlaneProtocol.framed``).
Only torch and the standard library are imported here (receivers load this package).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch

from asyncsync.protocol.wire import PROTOCOL_VERSION, UpdateRequest

HEADER_WORDS = 8
LOST = -1  # a frame index no payload has: a relaying server lost the version (``protocol.relay``)
MAGIC = 0x6173796E63_6672  # "asyncfr": a header that does not start with it is no header of ours


@dataclass(frozen=True)
class FrameHeader:
    """One frame's header: which plan and version it belongs to, its index (bucket i; the manifest
    is index ``len(buckets)``) and the exact byte length of the payload broadcast right after it."""

    plan: int
    version: int
    index: int
    nbytes: int
    protocol: int = PROTOCOL_VERSION

    def tensor(self) -> torch.Tensor:
        """The header as it travels: ``HEADER_WORDS`` int64s on the host (upload it to the group's device)."""
        words = [MAGIC, self.protocol, self.plan, self.version, self.index, self.nbytes]
        return torch.tensor(words + [0] * (HEADER_WORDS - len(words)), dtype=torch.int64)

    @classmethod
    def parse(cls, received: torch.Tensor) -> FrameHeader | None:
        """The header in a received ``HEADER_WORDS`` int64 tensor, or None when it is not one."""
        words = received.tolist()
        if len(words) != HEADER_WORDS or words[0] != MAGIC or any(words[6:]):
            return None
        return cls(plan=words[2], version=words[3], index=words[4], nbytes=words[5], protocol=words[1])


def empty_header(device: torch.device) -> torch.Tensor:
    """A buffer to receive a header into."""
    return torch.zeros(HEADER_WORDS, dtype=torch.int64, device=device)


def plan_hash(request: UpdateRequest) -> int:
    """A 63-bit hash of what a version's frames must match: every bucket's layout, the group each
    arrives on, and whether a checksum manifest follows. Trainer and receiver compute it from the
    same ``UpdateRequest``; a receiver that was announced another plan refuses the first frame."""
    layout = [[b.to_json() for b in request.buckets], list(request.sources), request.checksum]
    digest = hashlib.blake2b(json.dumps(layout, separators=(",", ":")).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class VersionFrames:
    """The frames of one version: every header carries its ``plan`` hash and ``version``."""

    plan: int
    version: int

    @classmethod
    def of(cls, request: UpdateRequest) -> VersionFrames:
        return cls(plan_hash(request), request.version)

    def header(self, index: int, payload: torch.Tensor) -> FrameHeader:
        """The header of frame ``index``, whose length is taken from ``payload`` itself (the sender's side)."""
        return FrameHeader(self.plan, self.version, index, payload.numel() * payload.element_size())

    def lost(self) -> FrameHeader:
        """What a relaying server sends instead of the next frame once it lost the version: the server
        below refuses it at once (gloo fails its receive only at the deadline while the group lives)."""
        return FrameHeader(self.plan, self.version, LOST, 0)

    def mismatch(self, got: FrameHeader | None, index: int, nbytes: int) -> str | None:
        """What is wrong with the header received for frame ``index``, announced as ``nbytes`` long,
        or None when its payload may be received (the receiver's side)."""
        if got is None:
            return f"frame {index} has no asyncsync frame header: the sender does not speak protocol {PROTOCOL_VERSION}"
        if got.protocol != PROTOCOL_VERSION:
            return f"frame {index} is of data-plane protocol {got.protocol}, this receiver speaks {PROTOCOL_VERSION}"
        if got.plan != self.plan:
            return (f"frame {index} belongs to another plan than the one announced (hash {got.plan:#x}, announced "
                    f"{self.plan:#x}): the trainer broadcasts a layout its update request does not describe")
        if got.index == LOST and got.version == self.version:
            return (f"the server above this one lost version {self.version} before frame {index}: the trainer sends it "
                    "again")
        if got.version != self.version or got.index != index:
            return f"frame {index} of version {self.version} arrived as frame {got.index} of version {got.version}"
        if got.nbytes != nbytes:
            return (f"frame {index} is {got.nbytes} bytes on the wire but was announced as {nbytes}: "
                    "the trainer's buffer does not match its plan")
        return None

