"""CRC32C (Castagnoli) of flat byte buffers: the checksum of every bucket, on either side of the wire.

Two implementations give the same value:

* ``crc32c_of`` for host buffers: the ``crc32c`` package (hardware-accelerated on x86, a C extension
  with no dependencies), imported at first use so that importing the protocol package costs nothing.
* ``crc32c_tensor`` for a buffer on any device, in torch operations on that device: a GPU receiver
  (or the pure-torch pack path on a GPU) checksums a bucket without copying it to the host, and the
  result stays on the device as a 0-dim tensor until someone asks for it.

How the device version works: CRC registers are linear over GF(2). The buffer (front-padded with
zero bytes, which leave a CRC register that starts at 0 unchanged) is cut into rows of ``_ROW``
bytes; every row's raw CRC is computed at once, 4 bytes per step, with slicing-by-4 tables; rows are
then combined pairwise in a tree, ``crc(A || B) = shift(crc(A), |B|) ^ crc(B)``, where the shift (a
multiplication by x^(8|B|) mod P) is a 32x32 bit matrix applied as four byte-indexed tables.
"""

from __future__ import annotations

import functools

import torch

_POLY = 0x82F63B78  # Castagnoli, bit-reflected
_ROW = 64           # bytes per row in the first, row-parallel pass (16 steps of 4 bytes)
_SLAB = 64 << 20    # bytes handled per slab, which bounds the temporary memory


def crc32c_of(buf: torch.Tensor) -> int:
    """CRC32C of a flat uint8 tensor's bytes, as an int. Host tensors use the ``crc32c`` package;
    device tensors are checksummed on their device (see ``crc32c_tensor``) and only the result moves."""
    data = buf.detach()
    if data.device.type != "cpu":
        return int(crc32c_tensor(data).item())
    import crc32c

    return crc32c.crc32c(memoryview(data.contiguous().numpy()))


def bucket_crc(buf: torch.Tensor) -> int | torch.Tensor:
    """The CRC32C of a received bucket without a host copy: an int for a host buffer, a 0-dim device
    tensor (read when compared) for a device buffer."""
    return crc32c_of(buf) if buf.device.type == "cpu" else crc32c_tensor(buf)


def crc32c_tensor(buf: torch.Tensor) -> torch.Tensor:
    """CRC32C of a flat uint8 tensor, computed with torch ops on ``buf``'s device; a 0-dim int64 tensor
    on that device. Nothing is copied to the host and nothing waits for the device."""
    data = buf.detach().reshape(-1)
    if data.dtype != torch.uint8:
        raise TypeError(f"crc32c_tensor: expected a flat uint8 buffer, got {data.dtype}")
    n = data.numel()
    raw = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, n, _SLAB):
        piece = data[start : start + _SLAB]
        raw = _apply(_shift_tables(piece.numel(), data.device), raw) ^ _raw_crc(piece)
    # Standard CRC32C: the register starts at 0xFFFFFFFF (carried over all n bytes) and is inverted.
    init = _apply(_shift_tables(n, data.device), torch.full((), 0xFFFFFFFF, dtype=torch.int64, device=data.device))
    return (init ^ raw) ^ 0xFFFFFFFF


def _raw_crc(data: torch.Tensor) -> torch.Tensor:
    """Raw CRC register (from 0, no inversion) of ``data``, a 0-dim int64 tensor on its device."""
    n = data.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=data.device)
    rows = 1 << max(0, (n + _ROW - 1) // _ROW - 1).bit_length()  # a power of two, for the tree
    padded = torch.zeros(rows * _ROW, dtype=torch.uint8, device=data.device)
    padded[rows * _ROW - n :] = data  # leading zeros leave a raw CRC from 0 unchanged
    words = padded.view(rows, _ROW // 4, 4).to(torch.int64)
    words = words[..., 0] | (words[..., 1] << 8) | (words[..., 2] << 16) | (words[..., 3] << 24)
    t = _slice4_tables(data.device)
    crc = torch.zeros(rows, dtype=torch.int64, device=data.device)
    for j in range(_ROW // 4):
        c = crc ^ words[:, j]
        crc = t[3][c & 0xFF] ^ t[2][(c >> 8) & 0xFF] ^ t[1][(c >> 16) & 0xFF] ^ t[0][c >> 24]
    length = _ROW
    while crc.numel() > 1:
        pairs = crc.view(-1, 2)
        crc = _apply(_shift_tables(length, data.device), pairs[:, 0]) ^ pairs[:, 1]
        length *= 2
    return crc[0]


def _apply(tables: torch.Tensor, crc: torch.Tensor) -> torch.Tensor:
    """Multiply CRC registers by the power of x that ``tables`` (4 x 256, byte-sliced) represents."""
    return tables[0][crc & 0xFF] ^ tables[1][(crc >> 8) & 0xFF] ^ tables[2][(crc >> 16) & 0xFF] ^ tables[3][crc >> 24]


def _multmodp(a: int, b: int) -> int:
    """a * b mod P in the reflected representation (bit 31 is x^0)."""
    m, p = 1 << 31, 0
    while m:
        if a & m:
            p ^= b
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


@functools.cache
def _x_pow_8n(nbytes: int) -> int:
    """x^(8 * nbytes) mod P, by square-and-multiply."""
    result, square, n = 1 << 31, 1 << 23, nbytes  # x^0 and x^8
    while n:
        if n & 1:
            result = _multmodp(square, result)
        square = _multmodp(square, square)
        n >>= 1
    return result


@functools.lru_cache(maxsize=256)
def _shift_tables(nbytes: int, device: torch.device) -> torch.Tensor:
    """Byte-sliced tables of ``crc -> crc * x^(8 * nbytes) mod P`` (a GF(2)-linear map), on ``device``."""
    op = _x_pow_8n(nbytes)
    basis = torch.tensor([_multmodp(op, 1 << i) for i in range(32)], dtype=torch.int64)
    values = torch.arange(256, dtype=torch.int64)
    tables = torch.zeros(4, 256, dtype=torch.int64)
    for j in range(4):
        for bit in range(8):
            tables[j] ^= ((values >> bit) & 1) * basis[8 * j + bit]
    return tables.to(device)


@functools.lru_cache(maxsize=8)
def _slice4_tables(device: torch.device) -> torch.Tensor:
    """Slicing-by-4 tables of the byte-wise CRC32C step, on ``device``."""
    t = torch.zeros(4, 256, dtype=torch.int64)
    for v in range(256):
        c = v
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        t[0][v] = c
    for k in range(1, 4):
        t[k] = (t[k - 1] >> 8) ^ t[0][t[k - 1] & 0xFF]
    return t.to(device)
