"""Frame headers: the data plane agrees the size of every payload before the payload moves.

A gloo receive is posted with a size, and gloo *aborts the process* (``gloo::EnforceNotMet``,
``op.preamble.length <= op.nbytes``) when the sender sends more than that: so a receiver that posted
a bucket's receive with the size the trainer announced over HTTP can be killed by any member of the
group that sends something longer (a trainer of another release, a packing bug, a lie). Under
``PROTOCOL_VERSION`` 2 and later every payload of a version (each bucket, then the checksum
manifest) is preceded by one broadcast of a ``FrameHeader``: ``HEADER_WORDS`` int64s, always the
same size, that carry the protocol, a hash of the version's plan (its ``UpdateRequest``: names,
dtypes, shapes, sizes, sources), the version, the frame's index and the exact byte length of the
payload that follows. The receiver posts the header's receive, checks it against the announcement,
and only then posts the payload's receive, with a size now agreed by both; on any difference it
posts nothing more and leaves the group, which fails the sender's broadcast at once instead of
aborting anyone.

Since protocol 3 the last two words are the header's MAC (``FrameSeal``) under the group's
data-plane key (``protocol.keys``), bound to the group (its name; a relay edge's also to the nonces
of its connection): a header that does not carry it is refused like any other lie, so only a key
holder, a member the trainer chose, can announce a payload.

The sender takes each header's length from the very tensor it broadcasts next, so a bug that
packs a bucket of another size changes the header with it and is refused, never aborted on. What
frames cannot close (a member that lies in the header itself, or skips one) is in docs/faults.md.

SGLang's receivers know nothing of frames: its groups stay unframed (``DataPlaneProtocol.framed``).
Only torch and the standard library are imported here (receivers load this package).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, field

import torch

from asyncsync.protocol.keys import mac
from asyncsync.protocol.wire import PROTOCOL_VERSION, UpdateRequest

HEADER_WORDS = 8
_FIELDS = 6  # the words a header's MAC covers; the rest of the header is the MAC itself
_MAC_WORDS = HEADER_WORDS - _FIELDS
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
    authentic: bool = field(default=True, compare=False)  # its MAC held (``FrameSeal.open``)

    def words(self) -> list[int]:
        """What the MAC covers: every word but the MAC's."""
        return [MAGIC, self.protocol, self.plan, self.version, self.index, self.nbytes]

    def tensor(self, mac_words: tuple[int, ...] = (0,) * _MAC_WORDS) -> torch.Tensor:
        """The header as it travels: ``HEADER_WORDS`` int64s on the host (upload it to the group's device);
        an unsealed one (a group without a key) carries zeros where the MAC goes."""
        return torch.tensor(self.words() + list(mac_words), dtype=torch.int64)

    @classmethod
    def parse(cls, received: torch.Tensor) -> FrameHeader | None:
        """The header in a received ``HEADER_WORDS`` int64 tensor, or None when it is not one (its MAC
        is ``FrameSeal.open``'s business)."""
        words = received.tolist()
        if len(words) != HEADER_WORDS or words[0] != MAGIC:
            return None
        return cls(plan=words[2], version=words[3], index=words[4], nbytes=words[5], protocol=words[1])


class FrameSeal:
    """The MAC of every frame header of one group (or relay edge): HMAC-SHA256 under the group's
    data-plane ``key``, over the header's words and ``binding`` (the group's name, so a header of one
    group is no header of another), cut to the header's last ``_MAC_WORDS`` words. Without a key (a
    group formed outside ``/init_group``: tests) headers carry no MAC and every one opens."""

    def __init__(self, key: bytes = b"", binding: bytes = b""):
        self.key, self.binding = key, binding

    def _mac_words(self, header: FrameHeader) -> tuple[int, ...]:
        if not self.key:
            return (0,) * _MAC_WORDS
        digest = mac(self.key, b"asyncsync frame", self.binding, struct.pack(f"<{_FIELDS}q", *header.words()))
        return struct.unpack(f"<{_MAC_WORDS}q", digest[: 8 * _MAC_WORDS])

    def tensor(self, header: FrameHeader) -> torch.Tensor:
        """``header`` as it travels on this group, sealed."""
        return header.tensor(self._mac_words(header))

    def open(self, received: torch.Tensor) -> FrameHeader | None:
        """The header in ``received`` (None: no header at all), ``authentic`` only when its MAC holds."""
        header = FrameHeader.parse(received)
        if header is None or not self.key:
            return header
        got = struct.pack(f"<{_MAC_WORDS}q", *received.tolist()[_FIELDS:])
        want = struct.pack(f"<{_MAC_WORDS}q", *self._mac_words(header))
        if hmac.compare_digest(got, want):
            return header
        return FrameHeader(header.plan, header.version, header.index, header.nbytes, header.protocol, authentic=False)


UNSEALED = FrameSeal()


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
            return (f"frame {index} has no asyncsync frame header: the sender does not speak protocol {PROTOCOL_VERSION}, "
                    "or sent a payload of another length before it")
        if got.protocol != PROTOCOL_VERSION:
            return f"frame {index} is of data-plane protocol {got.protocol}, this receiver speaks {PROTOCOL_VERSION}"
        if not got.authentic:
            return (f"frame {index}'s header does not carry this group's MAC: a peer that does not hold the group's "
                    "data-plane key sent it (not the trainer, nor a server the trainer put above this one)")
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

