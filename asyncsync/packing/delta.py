"""The trainer's half of delta versions: encode each bucket against the bytes its buffer held before.

A buffer that holds the last version packed into it is that version's baseline: packing the next
version into it with ``PackBackend.pack_delta`` overwrites it with the new bytes and, in the same
pass over each block (csrc/delta.h), finds the words that changed and encodes them (the format is
``asyncsync.protocol.delta``'s, whose ``rebuild`` is the receiver's half). One read of the weights
and one of the baseline, no second copy of the model: the baseline lives in the buffers the sync
packs into anyway (async mode's snapshot, or blocking mode's whole-version buffers).

Full fallback, per bucket: the encoder gives up, and the bucket goes out whole, once its delta
would exceed ``limit(nbytes)`` (``MAX_FRACTION`` of the bucket, about 7% of its elements changed:
below where, on an 8 gbit/s link, encoding and rebuilding a delta stop costing less than the bytes
it saves, 10-20%; benchmarks/results/delta.json ``links.*.break_even`` has the measurement), or once a thread's first blocks put it on course for
twice that (a dense update: it then costs little more than a plain pack). Which servers may get a
delta at all (those that committed exactly the baseline's version) is the sender's business
(``transport.send``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A bucket's delta is sent only while it is at most this fraction of the bucket's bytes.
MAX_FRACTION = 0.1


def limit(nbytes: int) -> int:
    """The most bytes a bucket of ``nbytes`` may be sent as a delta in; past it, the whole bucket."""
    return int(nbytes * MAX_FRACTION)


@dataclass
class Delta:
    """One bucket's delta as its encoder left it: ``payload()`` is the encoded bytes to broadcast, or
    None when the bucket goes out whole (it did not pay); ``changed`` the words that differ from the
    baseline (-1 where the encoder stopped counting). A device encoder's result is read, on the
    sender's thread, when ``payload`` is first called; a host encoder's is ready at once."""

    encoded: torch.Tensor | None
    changed: int

    def payload(self) -> torch.Tensor | None:
        return self.encoded


def encoded(payload: torch.Tensor, changed: int) -> Delta:
    """A host encoder's result: an empty payload means "send it whole"."""
    return Delta(payload if payload.numel() else None, changed)
