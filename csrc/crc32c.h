// CRC32C (Castagnoli) arithmetic shared by pack_cpu.cpp and pack_cuda.cu.
//
// CRC values here are raw registers (no pre/post inversion) in the bit-reflected representation,
// where bit 31 is the coefficient of x^0. Two raw CRCs combine as
//   crc(A || B) = shift(crc(A), |B|) ^ crc(B),    shift(c, n) = c * x^(8n) mod P,
// which is how both ops merge the checksums of byte ranges computed in parallel, and
//   CRC32C(data) = ~(shift(0xFFFFFFFF, |data|) ^ raw(data))
// gives the standard checksum (initial register 0xFFFFFFFF, final inversion).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define ASYNCSYNC_HD __host__ __device__
#else
#define ASYNCSYNC_HD
#endif

namespace asyncsync_crc {

constexpr uint32_t kPoly = 0x82F63B78u;  // Castagnoli polynomial 0x1EDC6F41, reflected

// a * b mod P; ``a`` must be non-zero (it is always a power of x here).
ASYNCSYNC_HD constexpr uint32_t multmodp(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ kPoly : b >> 1;
  }
  return p;
}

// x^(2^k) mod P for k < 64, and the byte-at-a-time table.
struct Tables {
  uint32_t x2n[64];
  uint32_t bytes[256];
};

constexpr Tables make_tables() {
  Tables t{};
  t.x2n[0] = 1u << 30;  // x^1
  for (int k = 1; k < 64; ++k) t.x2n[k] = multmodp(t.x2n[k - 1], t.x2n[k - 1]);
  for (uint32_t v = 0; v < 256; ++v) {
    uint32_t c = v;
    for (int i = 0; i < 8; ++i) c = (c & 1) ? (c >> 1) ^ kPoly : c >> 1;
    t.bytes[v] = c;
  }
  return t;
}

// x^(n * 2^k) mod P.
ASYNCSYNC_HD constexpr uint32_t x2nmodp(const Tables& t, uint64_t n, unsigned k) {
  uint32_t p = 1u << 31;  // x^0
  for (; n; n >>= 1, ++k)
    if (n & 1) p = multmodp(t.x2n[k & 63], p);
  return p;
}

// The register after ``nbytes`` zero bytes: how a prefix's raw CRC combines with what follows.
ASYNCSYNC_HD constexpr uint32_t shift(const Tables& t, uint32_t crc, uint64_t nbytes) {
  return multmodp(x2nmodp(t, nbytes, 3), crc);
}

ASYNCSYNC_HD constexpr uint32_t combine(const Tables& t, uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return shift(t, crc_a, len_b) ^ crc_b;
}

ASYNCSYNC_HD constexpr uint32_t crc_byte(const uint32_t* table, uint32_t crc, uint8_t b) {
  return table[(crc ^ b) & 0xff] ^ (crc >> 8);
}

}  // namespace asyncsync_crc
