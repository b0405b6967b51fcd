"""A bucket sent as what changed since the version the receiver committed last, and its rebuild.

The trainer encodes a bucket against the bytes of the version a server committed last (its
baseline), in the same pass that packs it (csrc/delta.h, ``asyncsync.packing.delta``); the receiver
rebuilds the whole bucket in its staging from the committed bytes and the delta
(``apply_delta``) and checks the rebuilt bucket against the CRC32C the full bucket would have
carried, so a delta against the wrong base, or a corrupted one, is refused whole like any bad
version. The encoding overwrites words with their new values (never NaN markers or differences), so
applying it twice changes nothing.

Format (little-endian). The bucket is ``nwords`` words of ``word`` bytes (``delta_word``: the
smallest item size of its tensors), cut into blocks of ``BLOCK_WORDS`` words (the last may be short,
``bw`` words)::

    header    u32 magic "ASD1", u32 word, u64 nwords, u32 nblocks, u32 BLOCK_WORDS      24 bytes
    entries   u32 per block                                               padded to 8 bytes
    modes     u8 per block: 0 G1, 1 G2, 2 M, 3 R                          padded to 8 bytes
    G1 gaps   u8 per entry of the G1 blocks, block after block            padded to 8 bytes
    G1 values ``word`` bytes per entry                                    padded to 8 bytes
    G2 gaps   u16 per entry; G2 values                                    each padded to 8 bytes
    M masks   ceil(bw / 8) bytes per M block (bit j: word j changed); M values   each padded
    R values  every word of each R block                                  padded to 8 bytes

In a G block, entry k sits ``gap + 1`` words after entry k - 1 (the first after position -1); a G1
gap spans at most 256 words, so longer distances carry filler entries (an unchanged word with its
own value). A block without changes is mode 0 with no entries. The encoder picks the cheapest mode
per block; the decoder accepts any valid choice, and refuses anything that does not add up exactly
(sizes, counts, positions inside their block) before it writes a byte.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from collections.abc import Callable

import torch

from asyncsync.protocol.checksum import bucket_crc
from asyncsync.protocol.specs import Bucket

log = logging.getLogger(__name__)

MAGIC = 0x31445341  # "ASD1"
BLOCK_WORDS = 65536
HEADER_BYTES = 24
G1, G2, M, R = 0, 1, 2, 3
_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_M_CHUNK = 64  # M blocks unpacked at a time: bounds the decoder's temporaries (64 x 64 Ki words)


class DeltaError(ValueError):
    """A delta that does not decode against the bucket it names: refused before anything is written."""


def delta_word(bucket: Bucket) -> int:
    """The unit a bucket's delta is counted in: its smallest item size (every tensor's bytes are
    whole words of it, since a bucket orders its tensors by item size, largest first)."""
    return min(spec.itemsize for spec in bucket.specs)


def _align8(n: int) -> int:
    return (n + 7) & ~7


def _u32(head: list[int], at: int) -> int:
    return int.from_bytes(bytes(head[at : at + 4]), "little")


class _Plan:
    """The table of a delta, checked against the bucket, and where each section starts."""

    def __init__(self, payload: torch.Tensor, nbytes: int, word: int):
        n = payload.numel()
        if n < HEADER_BYTES:
            raise DeltaError(f"a delta of {n} bytes is shorter than its {HEADER_BYTES}-byte header")
        head = payload[:HEADER_BYTES].tolist()
        magic, got_word = _u32(head, 0), _u32(head, 4)
        nwords = _u32(head, 8) | (_u32(head, 12) << 32)
        nblocks, block_words = _u32(head, 16), _u32(head, 20)
        want_blocks = -(-(nbytes // word) // BLOCK_WORDS)
        if (magic, got_word, nwords, nblocks, block_words) != (MAGIC, word, nbytes // word, want_blocks, BLOCK_WORDS):
            raise DeltaError(f"the delta's header (magic {magic:#x}, word {got_word}, {nwords} words, {nblocks} blocks "
                             f"of {block_words}) does not describe this bucket ({nbytes // word} words of {word} bytes)")
        self.word, self.nwords, self.nblocks = word, nwords, nblocks
        modes_at = _align8(HEADER_BYTES + 4 * nblocks)
        sections_at = _align8(modes_at + nblocks)
        if n < sections_at:
            raise DeltaError(f"a delta of {n} bytes cannot hold the table of {nblocks} blocks")
        self.entries = payload[HEADER_BYTES : HEADER_BYTES + 4 * nblocks].cpu().view(torch.int32).tolist()
        self.modes = payload[modes_at : modes_at + nblocks].tolist()
        self.widths = [min(BLOCK_WORDS, nwords - b * BLOCK_WORDS) for b in range(nblocks)]
        self.blocks: dict[int, list[int]] = {G1: [], G2: [], M: [], R: []}
        for b, (mode, entries, bw) in enumerate(zip(self.modes, self.entries, self.widths)):
            if mode not in self.blocks or not 0 <= entries <= bw or (mode == R and entries != bw):
                raise DeltaError(f"block {b}: mode {mode} with {entries} entries does not fit a block of {bw} words")
            if entries:
                self.blocks[mode].append(b)
        index = {G1: sum(self.entries[b] for b in self.blocks[G1]), G2: 2 * sum(self.entries[b] for b in self.blocks[G2]),
                 M: sum((self.widths[b] + 7) // 8 for b in self.blocks[M]), R: 0}
        self.sections: dict[int, tuple[int, int, int]] = {}  # mode -> (index start, values start, values bytes)
        at = sections_at
        for mode in (G1, G2, M, R):
            values = word * sum(self.entries[b] for b in self.blocks[mode])
            self.sections[mode] = (at, _align8(at + index[mode]), values)
            at = _align8(_align8(at + index[mode]) + values)
        if at != n:
            raise DeltaError(f"the delta's table adds up to {at} bytes, but {n} arrived")

    def values(self, payload: torch.Tensor, mode: int) -> torch.Tensor:
        _, start, size = self.sections[mode]
        return payload[start : start + size].view(_WORD_DTYPES[self.word])

    def index(self, payload: torch.Tensor, mode: int, nbytes: int) -> torch.Tensor:
        start = self.sections[mode][0]
        return payload[start : start + nbytes]


def rebuild(payload: torch.Tensor, base: torch.Tensor, out: torch.Tensor, word: int) -> int | torch.Tensor:
    """Rebuild a bucket into ``out`` (uint8, the bucket's bytes) from ``base`` (the bytes of the
    version the delta was encoded against; ``out`` itself to rebuild in place) and ``payload``, and
    return the CRC32C of the rebuilt bytes (a 0-dim tensor on a device), which the caller compares
    with the full bucket's. Raises ``DeltaError`` when the delta does not decode against a bucket of
    ``out.numel()`` bytes; ``out`` is then unspecified and the version must be refused.

    On the host the compiled op does it in one parallel pass (copy, overwrite and CRC32C of each
    block while it is in cache) where the installed extension has it; otherwise ``apply_delta``
    (torch ops, any device), then the checksum: the same bytes either way."""
    compiled = _compiled_rebuild() if out.device.type == "cpu" else None
    if compiled is not None:
        try:
            return int(compiled(payload, base, out, word))
        except (RuntimeError, ValueError) as e:  # the op's checks: a delta that does not fit
            raise DeltaError(str(e).splitlines()[0]) from None
    apply_delta(payload, base, out, word)
    return bucket_crc(out)


@functools.cache
def _compiled_rebuild() -> Callable[..., int] | None:
    """``torch.ops.asyncsync.apply_delta`` (csrc/pack_cpu.cpp: torch ops only, no trainer code) where
    the extension is installed, or was already loaded in this process, and has it; else None."""
    if os.environ.get("ASYNCSYNC_NO_EXT", "") not in ("", "0"):
        return None
    try:
        if not hasattr(torch.ops.asyncsync, "apply_delta"):
            importlib.import_module("asyncsync._pack_cpu")  # registers the ops as it loads
        return torch.ops.asyncsync.apply_delta
    except (ImportError, AttributeError, RuntimeError) as e:
        log.info("rebuilding deltas with torch ops (no compiled apply_delta: %s)", e)
        return None


def apply_delta(payload: torch.Tensor, base: torch.Tensor, out: torch.Tensor, word: int) -> None:
    """Rebuild a bucket into ``out`` from ``base`` and ``payload`` with torch ops (the reference, and
    the path for device buffers). Raises ``DeltaError`` before writing anything when the delta does
    not decode against a bucket of ``out.numel()`` bytes."""
    nbytes = out.numel()
    if base.numel() != nbytes or nbytes % word:
        raise DeltaError(f"a baseline of {base.numel()} bytes cannot rebuild a bucket of {nbytes} bytes")
    plan = _Plan(payload, nbytes, word)
    device = out.device
    positions: dict[int, torch.Tensor] = {}
    for mode, dtype, span in ((G1, torch.uint8, 1), (G2, torch.int16, 2)):
        blocks = plan.blocks[mode]
        if blocks:
            counts = torch.tensor([plan.entries[b] for b in blocks], dtype=torch.int64, device=device)
            starts = torch.tensor([b * BLOCK_WORDS for b in blocks], dtype=torch.int64, device=device)
            widths = torch.tensor([plan.widths[b] for b in blocks], dtype=torch.int64, device=device)
            gaps = plan.index(payload, mode, span * int(counts.sum())).view(dtype).to(torch.int64)
            positions[mode] = _gap_positions(gaps & (0xFF if span == 1 else 0xFFFF), counts, starts, widths, mode)
    masks = _masks(plan, payload) if plan.blocks[M] else []
    if out.data_ptr() != base.data_ptr():
        out.copy_(base)
    words = out.view(_WORD_DTYPES[word])
    for mode, where in positions.items():
        words.index_put_((where,), plan.values(payload, mode))
    values = plan.values(payload, M)
    for first, bits, taken, count in masks:  # runs of consecutive M blocks: one masked write each
        words[first * BLOCK_WORDS : first * BLOCK_WORDS + bits.numel()].masked_scatter_(bits, values[taken : taken + count])
    raw = plan.values(payload, R)
    taken = 0
    for first, last in _runs(plan.blocks[R]):  # consecutive R blocks are one slice of the bucket
        size = sum(plan.widths[b] for b in range(first, last + 1))
        words[first * BLOCK_WORDS : first * BLOCK_WORDS + size] = raw[taken : taken + size]
        taken += size


def _gap_positions(gaps: torch.Tensor, counts: torch.Tensor, starts: torch.Tensor, widths: torch.Tensor,
                   mode: int) -> torch.Tensor:
    """Word positions in the bucket of the entries of G blocks (``counts`` entries each, in order)."""
    steps = torch.cumsum(gaps + 1, 0)
    ends = torch.cumsum(counts, 0)
    before = torch.zeros_like(counts)
    before[1:] = steps[ends[:-1] - 1]  # the running sum where each block's entries start
    inside = steps - torch.repeat_interleave(before, counts) - 1
    if bool((inside[ends - 1] >= widths).any()):
        raise DeltaError(f"a mode {mode} block's gaps run past the end of the block")
    return torch.repeat_interleave(starts, counts) + inside


def _masks(plan: _Plan, payload: torch.Tensor) -> list[tuple[int, torch.Tensor, int, int]]:
    """The M blocks as runs of consecutive blocks (at most ``_M_CHUNK`` each): (first block, the
    run's words as a bool mask, where its values start, how many), each run's counts checked."""
    shifts = torch.arange(8, dtype=torch.uint8, device=payload.device)
    runs, at, taken = [], plan.sections[M][0], 0
    for first, last in _runs(plan.blocks[M]):
        for lo in range(first, last + 1, _M_CHUNK):
            blocks = list(range(lo, min(last + 1, lo + _M_CHUNK)))
            widths = [plan.widths[b] for b in blocks]
            nbytes = sum((w + 7) // 8 for w in widths)
            bits = ((payload[at : at + nbytes].unsqueeze(-1) >> shifts) & 1).reshape(-1).bool()
            if sum(widths) % 8 and bool(bits[sum(widths) :].any()):  # only the bucket's last block is short
                raise DeltaError(f"block {blocks[-1]}: its mask marks words past the end of the bucket")
            bits = bits[: sum(widths)]
            counts = bits.view(len(blocks), -1).sum(1).tolist() if len(set(widths)) == 1 else [
                int(c.sum()) for c in bits.split(widths)]
            if counts != [plan.entries[b] for b in blocks]:
                raise DeltaError(f"the masks of blocks {blocks[0]}..{blocks[-1]} mark {sum(counts)} words, the table "
                                 f"says {sum(plan.entries[b] for b in blocks)}")
            runs.append((lo, bits, taken, sum(counts)))
            at += nbytes
            taken += sum(counts)
    return runs


def _runs(blocks: list[int]) -> list[tuple[int, int]]:
    """Consecutive block numbers as (first, last) runs."""
    runs: list[tuple[int, int]] = []
    for b in blocks:
        if runs and runs[-1][1] == b - 1:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((b, b))
    return runs
