"""Delta versions, byte level: the compiled encoder writes the format protocol/delta.py specifies (checked
against a plain Python encoder of that text), both decoders rebuild the new bytes from the old ones,
in place or not, and a delta that was corrupted, truncated or encoded for another bucket is refused
(or, where its table still adds up, rebuilds bytes whose CRC32C gives it away): never a crash."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncsync.protocol.checksum import bucket_crc
from asyncsync.protocol.delta import BLOCK_WORDS, HEADER_BYTES, MAGIC, DeltaError, apply_delta, rebuild

PROPERTY = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@pytest.fixture(scope="module", autouse=True)
def ops() -> None:
    from asyncsync.packing.native import status

    error = status()["cpu_extension_error"]
    if error is not None:
        pytest.skip(f"C++ extension not built here: {error}")


def align8(n: int) -> int:
    return (n + 7) & ~7


def reference_delta(old: np.ndarray, new: np.ndarray, word: int) -> bytes:
    """protocol/delta.py's format, written from its text with numpy and loops."""
    o, n = old.view(UNSIGNED[word]), new.view(UNSIGNED[word])
    nwords = len(n)
    nblocks = -(-nwords // BLOCK_WORDS)
    entries, modes = [], []
    index: dict[int, bytearray] = {m: bytearray() for m in range(4)}
    values: dict[int, bytearray] = {m: bytearray() for m in range(4)}
    for b in range(nblocks):
        lo, hi = b * BLOCK_WORDS, min(nwords, (b + 1) * BLOCK_WORDS)
        bw, changed = hi - lo, np.nonzero(o[lo:hi] != n[lo:hi])[0]
        c = len(changed)
        if c == 0:
            entries.append(0)
            modes.append(0)
            continue
        distances = np.diff(np.concatenate([[-1], changed]))
        fillers = int(((distances - 1) // 256).sum())
        costs = [(c + fillers) * (1 + word), c * (2 + word), (bw + 7) // 8 + c * word, bw * word]
        mode = costs.index(min(costs))
        block = n[lo:hi]
        if mode == 0:
            prev, gaps, at = -1, [], []
            for pos in changed.tolist():
                while pos - prev > 256:
                    prev += 256
                    gaps.append(255)
                    at.append(prev)
                gaps.append(pos - prev - 1)
                at.append(pos)
                prev = pos
            index[0] += bytes(gaps)
            values[0] += block[at].tobytes()
            entries.append(len(gaps))
        elif mode == 1:
            index[1] += (np.diff(np.concatenate([[-1], changed])) - 1).astype("<u2").tobytes()
            values[1] += block[changed].tobytes()
            entries.append(c)
        elif mode == 2:
            bits = np.zeros(align8(bw), dtype=np.uint8)
            bits[changed] = 1
            index[2] += np.packbits(bits, bitorder="little")[: (bw + 7) // 8].tobytes()
            values[2] += block[changed].tobytes()
            entries.append(c)
        else:
            values[3] += block.tobytes()
            entries.append(bw)
        modes.append(mode)
    out = bytearray(np.array([MAGIC, word], "<u4").tobytes() + np.array([nwords], "<u8").tobytes()
                    + np.array([nblocks, BLOCK_WORDS], "<u4").tobytes())
    out += np.array(entries, "<u4").tobytes()
    out += bytes(align8(len(out)) - len(out))
    out += bytes(modes)
    out += bytes(align8(len(out)) - len(out))
    for m in range(4):
        for part in (index[m], values[m]):
            out += part
            out += bytes(align8(len(out)) - len(out))
    return bytes(out)


def changed_copy(old: torch.Tensor, density: float, seed: int, runs: bool = False) -> torch.Tensor:
    """``old`` (uint8) with about ``density`` of its words changed; ``runs``: changes clustered."""
    g = torch.Generator().manual_seed(seed)
    new = old.clone()
    words = new.view(torch.int16)
    if runs:  # dense stretches (M and R blocks) between untouched ones
        for start in torch.randint(0, max(1, words.numel() - 5000), (int(density * 40) + 1,), generator=g).tolist():
            words[start : start + 5000] += 1
    else:
        words[torch.rand(words.numel(), generator=g) < density] += 1
    return new


def encode(old: torch.Tensor, new: torch.Tensor, word: int, limit: int | None = None) -> tuple[int, int, torch.Tensor]:
    base = old.clone()
    crc, changed, payload = torch.ops.asyncsync.pack_delta([new], [0], base, word, limit if limit is not None else old.numel())
    assert torch.equal(base, new), "the baseline buffer holds the new version afterwards"
    assert crc == bucket_crc(new)
    return crc, changed, payload


@PROPERTY
@given(words=st.integers(1, 3 * BLOCK_WORDS + 77), density=st.sampled_from([0.0, 1e-4, 3e-3, 0.05, 0.3, 0.97]),
       runs=st.booleans(), word=st.sampled_from([1, 2, 4, 8]), threads=st.sampled_from([1, 2]), seed=st.integers(0, 99))
def test_the_encoder_writes_the_specified_bytes_and_both_decoders_rebuild_the_version(words, density, runs, word, threads,
                                                                                       seed):
    torch.set_num_threads(threads)
    nbytes = (words * 2 + word - 1) // word * word
    old = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    new = changed_copy(old, density, seed, runs) if nbytes % 2 == 0 else old.clone()
    crc, changed, payload = encode(old, new, word, limit=10 * nbytes + 4096)
    want = reference_delta(old.numpy(), new.numpy(), word)
    assert payload.numpy().tobytes() == want
    assert changed == int((old.view(-1, word) != new.view(-1, word)).any(1).sum())
    for decode in ("compiled", "torch"):
        out = torch.full_like(old, 0xA5)
        if decode == "compiled":
            assert rebuild(payload, old, out, word) == crc
        else:
            apply_delta(payload, old, out, word)
        assert torch.equal(out, new), decode
        again = out.clone()
        apply_delta(payload, again, again, word)  # idempotent: values overwrite, in place
        assert torch.equal(again, new)


def test_every_mode_is_chosen_where_it_is_cheapest():
    """Block 0 sparse (two-byte gaps), 1 a little denser (one-byte gaps, a filler), 2 at 30% (bitmask),
    3 whole (raw), 4 unchanged."""
    old = torch.zeros(5 * BLOCK_WORDS * 2, dtype=torch.uint8)
    words = old.clone().view(torch.int16)
    words[[5, 40_000]] = 1
    words[BLOCK_WORDS + torch.arange(0, BLOCK_WORDS, 50)] = 1
    words[BLOCK_WORDS + 60_000 + 300] = 1
    words[2 * BLOCK_WORDS + torch.arange(0, BLOCK_WORDS, 3)] = 1
    words[3 * BLOCK_WORDS : 4 * BLOCK_WORDS] = 1
    new = words.view(torch.uint8)
    _, _, payload = encode(old, new, 2)
    modes_at = align8(HEADER_BYTES + 4 * 5)
    assert payload[modes_at : modes_at + 5].tolist() == [1, 0, 2, 3, 0]
    assert rebuild(payload, old, torch.empty_like(old), 2) == bucket_crc(new)


def test_a_delta_over_its_limit_is_not_written_and_the_bucket_goes_whole():
    old = torch.zeros(4 * BLOCK_WORDS * 2, dtype=torch.uint8)
    new = changed_copy(old, 0.5, 1)
    crc, changed, payload = encode(old, new, 2, limit=old.numel() // 4)
    assert payload.numel() == 0 and crc == bucket_crc(new)
    _, _, payload = encode(old, new, 2, limit=0)  # no limit: packing only
    assert payload.numel() == 0


def test_a_bucket_of_mixed_tensors_is_packed_at_its_offsets_and_encoded_in_its_smallest_word():
    g = torch.Generator().manual_seed(3)
    tensors = [torch.randn(70_000, generator=g), torch.randn(300, 7, generator=g).to(torch.bfloat16).t()]
    offsets = [0, 280_000]
    old = torch.zeros(280_000 + 4200, dtype=torch.uint8)
    crc, _, payload = torch.ops.asyncsync.pack_delta(tensors, offsets, old, 2, 2 * old.numel())
    want = torch.cat([tensors[0].view(torch.uint8), tensors[1].contiguous().view(-1).view(torch.uint8)])
    assert torch.equal(old, want) and crc == bucket_crc(want)
    out = torch.empty_like(old)
    assert rebuild(payload, torch.zeros_like(old), out, 2) == crc and torch.equal(out, want)


@pytest.mark.parametrize("decode", ["compiled", "torch"])
def test_a_corrupted_truncated_or_foreign_delta_is_refused_or_caught_by_the_checksum(decode):
    g = torch.Generator().manual_seed(7)
    old = torch.randint(0, 256, (3 * BLOCK_WORDS * 2 + 10,), dtype=torch.uint8, generator=g)
    new = changed_copy(old, 0.01, 2, runs=True)
    crc, _, payload = encode(old, new, 2)

    def outcome(delta: torch.Tensor, nbytes: int = old.numel(), word: int = 2) -> str:
        out = torch.empty(nbytes, dtype=torch.uint8)
        base = old[:nbytes] if nbytes <= old.numel() else torch.zeros(nbytes, dtype=torch.uint8)
        try:
            if decode == "compiled":
                got = rebuild(delta, base, out, word)
            else:
                apply_delta(delta, base, out, word)
                got = bucket_crc(out)
        except DeltaError:
            return "refused"
        return "intact" if got == crc and torch.equal(out, new) else "caught by the checksum"

    assert outcome(payload) == "intact"
    assert outcome(payload[:-8]) == "refused"
    assert outcome(payload[:10]) == "refused"
    assert outcome(torch.cat([payload, torch.zeros(8, dtype=torch.uint8)])) == "refused"
    assert outcome(payload, word=1) == "refused"
    assert outcome(payload, nbytes=old.numel() - 2) == "refused"
    modes_at = align8(HEADER_BYTES + 4 * 4)
    for at, value in ((HEADER_BYTES + 2, 0x10), (modes_at, 7), (0, 0xFF), (4, 4)):
        bad = payload.clone()
        bad[at] ^= value  # an entry count past the block, a mode that is none, the magic, the word
        assert outcome(bad) == "refused", at
    seen = set()
    for at in torch.randint(0, payload.numel(), (120,), generator=g).tolist():
        bad = payload.clone()
        bad[at] ^= 1 + torch.randint(0, 255, (1,), generator=g).item()
        seen.add(outcome(bad))
    assert "caught by the checksum" in seen and seen <= {"refused", "caught by the checksum"}
