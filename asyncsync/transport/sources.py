"""Where ``send_version`` takes each bucket's bytes from: a ``BucketSource``, with every optional
capability declared here, answered "none" by default, and given by the sources that have it.

    source.reuses(bucket)    the earlier bucket whose buffer these bytes will be written into (a ring),
                             or None: ``bucket`` is asked for only after that bucket's broadcast finished
    source.bucket(bucket)    the flat bytes to broadcast
    source.checksum(bucket)  asked right after the broadcast started (a checksum not fused into
                             packing is taken while the bytes are on the wire): the CRC32C of exactly
                             those bytes, an int or a 0-dim device tensor, or None without checksums

Capabilities, each with its default:

* deltas (``trainer.buffers.Prepacked`` over a baseline, ``trainer.shards.Encoded``): ``delta_base``
  is the version the buckets were encoded against (None: not encoded); ``delta(bucket)`` a bucket's
  ``packing.delta.Delta`` (asked by its owner only); ``delta_nbytes()`` every bucket's delta size (0:
  whole; None where none was encoded; rank 0 has them all). ``send.delta_for`` decides who gets them.
* shared memory (a version packed into a leased segment): ``segment`` is where it lies (None: not
  in shared memory); same-host servers map it instead of receiving the broadcast.
* sharded trainers (``trainer.shards``): ``owner(bucket)`` is the rank that broadcasts it (0 for
  every other source); only the owner asks for ``bucket`` (receiving the other ranks' pieces), every
  other rank calls ``contribute(bucket)`` at that point instead (sends its pieces to the owner).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from asyncsync.protocol.specs import Bucket

if TYPE_CHECKING:
    from asyncsync.packing.delta import Delta
    from asyncsync.transport.shm import Segment


class BucketSource:
    """A version's buckets as ``send_version`` reads them (the module doc has the contract)."""

    delta_base: int | None = None
    segment: Segment | None = None

    def reuses(self, bucket: Bucket) -> int | None:
        return None

    def bucket(self, bucket: Bucket) -> torch.Tensor:
        raise NotImplementedError

    def checksum(self, bucket: Bucket) -> int | torch.Tensor | None:
        return None

    def delta(self, bucket: Bucket) -> Delta | None:
        return None

    def delta_nbytes(self) -> tuple[int, ...] | None:
        return None

    def owner(self, bucket: Bucket) -> int:
        return 0

    def contribute(self, bucket: Bucket) -> None:
        raise RuntimeError(f"{type(self).__name__} is a single process's: every bucket is its own (owner 0)")
