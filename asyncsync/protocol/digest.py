"""The trainer's own word on a version's bytes: a cryptographic digest of every bucket (``digest: on``).

CRC32C catches accidents, not intent: it is linear, so whoever forwards a bucket can change it and
make its CRC32C whatever the manifest says (four chosen bytes do it). With a relay (``fanout``) the
bytes a server receives, and the CRC32C manifest they are checked against, come through the servers
above it, so a relaying server that is compromised, or buggy in a self-consistent way, could make
every server below it commit bytes the trainer never published. The digests do not travel that way:
the trainer hashes every bucket it sends (BLAKE3, 256 bits: no second preimage is known) and sends
each server the list over that server's own token-checked control channel, with ``end``. BLAKE3,
from the ``blake3`` package (SIMD; it frees the GIL), hashes 4.4 GB/s per core here, 3.5x SHA-256 and
9x BLAKE2b, so a receiver keeps up with a 25 gbit/s link on one core (``benchmarks/digest.py``).
A receiver hashes every bucket as it lands (the rebuilt bucket of a delta: the bytes it would
serve), and commits a version only when every digest is the trainer's::

    request.digest                     # announced: the trainer sends the digests with ``end``
    digest = bucket_digest(buffer)     # as each bucket lands (overlapped with the next one's receive)
    digest_problems(staged, expected)  # at ``end``, before anything is applied

A server above can then deny a version (send garbage: refused whole) but not make one commit bytes
the trainer did not publish. Which server sent other bytes is for the trainer to tell from the
tree: the refusal says ``NOT_PUBLISHED`` and the server above it took the version (``transport/relay.py``).
Only torch, ``blake3`` and the standard library are used (receivers load this package).
"""

from __future__ import annotations

import blake3
import torch

ALGORITHM = "blake3-256"
DIGEST_CHARS = 64  # hex characters of one digest
NOT_PUBLISHED = "not the bytes the trainer published"  # a digest refusal's words (the trainer blames the server above)


def bucket_digest(buffer: torch.Tensor) -> str:
    """The BLAKE3 (256 bits) of a flat bucket's bytes, as hex (a device buffer is read back to the
    host). The GIL is released while it hashes, so several buckets hash in parallel threads; one call
    uses one core (a receiver's hashing must not take the cores generation runs on)."""
    host = buffer.detach().reshape(-1).view(torch.uint8)
    if host.device.type != "cpu":
        host = host.cpu()
    return blake3.blake3(memoryview(host.contiguous().numpy())).hexdigest()


def valid_digest(value: object) -> bool:
    """A digest as it travels: ``DIGEST_CHARS`` lower-case hex characters."""
    return (isinstance(value, str) and len(value) == DIGEST_CHARS
            and all(c in "0123456789abcdef" for c in value))


def digest_problems(received: tuple[str, ...], expected: tuple[str, ...], version: int) -> list[str]:
    """Why a version whose buckets hashed to ``received`` is not the one the trainer published
    (``expected``, from ``end``); empty when every bucket's digest matches."""
    if not expected:
        return [f"version {version} was announced with digests, but its end carried none: nothing can tell its "
                "bytes are the trainer's"]
    if len(expected) != len(received):
        return [f"the trainer sent {len(expected)} digest(s) for the {len(received)} bucket(s) received"]
    bad = [i for i, (got, want) in enumerate(zip(received, expected)) if got != want]
    if not bad:
        return []
    return [f"bucket(s) {bad[:8]}{' ...' if len(bad) > 8 else ''} of version {version} are {NOT_PUBLISHED} "
            f"({ALGORITHM} mismatch): the server above this one forwarded other bytes; nothing was applied"]
