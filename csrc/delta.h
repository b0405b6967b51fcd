// The delta encoding of a bucket, shared by the CPU op (pack_cpu.cpp) and the CUDA kernels
// (pack_cuda.cu), host and device: how a block's mode is chosen and how a block is written. The
// receiver's decoder is asyncsync/protocol/delta.py; the format is specified there too.
//
// A bucket of nbytes is a sequence of nwords words of ``word`` bytes (the smallest item size among
// its tensors), cut into blocks of kBlockWords words. Which words changed since the baseline is a
// bitmask (bit j of the little-endian uint32 array = word j of the block changed). Each block is
// written in the cheapest of four modes (ties go to the lower mode):
//   0 G1  entries one-byte gaps (distance to the previous entry - 1; the first from position -1),
//         a distance over 256 inserts filler entries every 256 words (unchanged words re-sent with
//         their own value: an overwrite of a word with its value changes nothing), then the values
//   1 G2  two-byte gaps, never fillers (a block has at most 65536 words), then the values
//   2 M   the block's bitmask, ceil(bw / 8) bytes, then the values of the set bits
//   3 R   every word of the block (raw)
// A block with no change is mode 0 with no entries. Values are the new words, in position order.
// Sections are laid out per mode across the bucket (G1 gaps, G1 values, G2 gaps, G2 values, M masks,
// M values, R values), each starting at a multiple of 8 bytes, after a 24-byte header, the entry
// count of every block (uint32) and the mode of every block (uint8), each padded to 8 bytes.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define ASYNCSYNC_DELTA_HD __host__ __device__
#else
#define ASYNCSYNC_DELTA_HD
#endif

namespace asyncsync_delta {

constexpr uint32_t kMagic = 0x31445341u;  // "ASD1" little-endian
constexpr int64_t kBlockWords = 65536;
constexpr int64_t kMaskWords = kBlockWords / 32;  // uint32 words of a block's bitmask
constexpr int64_t kHeaderBytes = 24;   // magic u32, word u32, nwords u64, nblocks u32, block words u32
constexpr int kModes = 4;
enum Mode : uint8_t { kGap1 = 0, kGap2 = 1, kMask = 2, kRaw = 3 };

ASYNCSYNC_DELTA_HD inline int64_t align8(int64_t n) { return (n + 7) & ~int64_t(7); }

ASYNCSYNC_DELTA_HD inline int lowest_bit(uint32_t x) {
#ifdef __CUDA_ARCH__
  return __ffs(static_cast<int>(x)) - 1;
#else
  return __builtin_ctz(x);
#endif
}

ASYNCSYNC_DELTA_HD inline int highest_bit(uint32_t x) {
#ifdef __CUDA_ARCH__
  return 31 - __clz(static_cast<int>(x));
#else
  return 31 - __builtin_clz(x);
#endif
}

ASYNCSYNC_DELTA_HD inline int popcount(uint32_t x) {
#ifdef __CUDA_ARCH__
  return __popc(x);
#else
  return __builtin_popcount(x);
#endif
}

// How one block is written: its mode, its entries, and the bytes it adds to its mode's sections.
struct BlockPlan {
  uint32_t entries;      // gaps (G1, with fillers), changes (G2, M) or words (R)
  uint32_t changed;      // words that differ from the baseline
  uint8_t mode;
  int64_t index_bytes;   // gap bytes (G1, G2) or mask bytes (M); 0 for R
  int64_t value_bytes;   // entries * word
};

// The cheapest mode for a block of ``bw`` words whose changes are ``mask``. One step per mask word:
// two changes inside one word are never 256 words apart, so fillers come only from the distance
// between one word's last change and the next word's first.
ASYNCSYNC_DELTA_HD inline BlockPlan plan_block(const uint32_t* mask, int64_t bw, int64_t word) {
  int64_t changed = 0, fillers = 0, prev = -1;
  const int64_t nmask = (bw + 31) / 32;
  for (int64_t m = 0; m < nmask; ++m) {
    const uint32_t bits = mask[m];
    if (!bits) continue;
    changed += popcount(bits);
    fillers += (m * 32 + lowest_bit(bits) - prev - 1) / 256;
    prev = m * 32 + highest_bit(bits);
  }
  BlockPlan plan{0, static_cast<uint32_t>(changed), kGap1, 0, 0};
  if (changed == 0) return plan;
  const int64_t cost[kModes] = {(changed + fillers) * (1 + word), changed * (2 + word),
                                (bw + 7) / 8 + changed * word, bw * word};
  int best = 0;
  for (int k = 1; k < kModes; ++k)
    if (cost[k] < cost[best]) best = k;
  plan.mode = static_cast<uint8_t>(best);
  plan.entries = static_cast<uint32_t>(best == kGap1 ? changed + fillers : best == kRaw ? bw : changed);
  plan.index_bytes = best == kGap1 ? plan.entries : best == kGap2 ? 2 * int64_t(plan.entries)
                                                   : best == kMask ? (bw + 7) / 8 : 0;
  plan.value_bytes = int64_t(plan.entries) * word;
  return plan;
}

ASYNCSYNC_DELTA_HD inline void copy_word(uint8_t* dst, const uint8_t* src, int64_t word) {
  for (int64_t i = 0; i < word; ++i) dst[i] = src[i];
}

// Writes a planned block: its gaps or bitmask to ``index`` and its values to ``values``; ``data`` is
// the block's new bytes (bw words). R blocks copy every word.
ASYNCSYNC_DELTA_HD inline void write_block(const BlockPlan& plan, const uint32_t* mask, int64_t bw, int64_t word,
                                           const uint8_t* data, uint8_t* index, uint8_t* values) {
  if (plan.entries == 0) return;
  if (plan.mode == kRaw) {
    for (int64_t i = 0; i < bw * word; ++i) values[i] = data[i];
    return;
  }
  if (plan.mode == kMask)
    for (int64_t i = 0; i < (bw + 7) / 8; ++i) index[i] = static_cast<uint8_t>(mask[i / 4] >> (8 * (i % 4)));
  int64_t prev = -1, k = 0;
  const int64_t nmask = (bw + 31) / 32;
  for (int64_t m = 0; m < nmask; ++m) {
    uint32_t bits = mask[m];
    while (bits) {
      const int64_t pos = m * 32 + lowest_bit(bits);
      bits &= bits - 1;
      if (plan.mode == kGap1) {
        for (; pos - prev > 256; ++k) {  // fillers: the unchanged word 256 further, with its own value
          prev += 256;
          index[k] = 255;
          copy_word(values + k * word, data + prev * word, word);
        }
        index[k] = static_cast<uint8_t>(pos - prev - 1);
      } else if (plan.mode == kGap2) {
        const uint16_t gap = static_cast<uint16_t>(pos - prev - 1);
        index[2 * k] = static_cast<uint8_t>(gap);
        index[2 * k + 1] = static_cast<uint8_t>(gap >> 8);
      }
      copy_word(values + k * word, data + pos * word, word);
      prev = pos;
      ++k;
    }
  }
}

// Where each block's bytes go, once every block is planned: per mode, the running offsets of its
// index and value sections. ``layout`` fills the section starts and the total size.
struct Sections {
  int64_t index[kModes];  // start of each mode's gap/mask section (R: unused)
  int64_t value[kModes];  // start of each mode's value section
  int64_t table;          // start of the entry counts (the modes follow, 8-aligned)
  int64_t total;          // bytes of the whole delta
};

// ``index_bytes[k]`` / ``value_bytes[k]``: the sums over the blocks of mode k.
ASYNCSYNC_DELTA_HD inline Sections layout(int64_t nblocks, const int64_t* index_bytes, const int64_t* value_bytes) {
  Sections s{};
  s.table = kHeaderBytes;
  int64_t at = align8(s.table + 4 * nblocks);
  at = align8(at + nblocks);
  for (int k = 0; k < kModes; ++k) {
    s.index[k] = at;
    at = align8(at + index_bytes[k]);
    s.value[k] = at;
    at = align8(at + value_bytes[k]);
  }
  s.total = at;
  return s;
}

ASYNCSYNC_DELTA_HD inline void store_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

// Overwrites the words a block's entries name in ``data`` (the block's bw words, holding the
// baseline) with their values. False when the entries do not fit the block: a gap past its end, a
// mask that marks words past it or another number of words than ``entries``.
ASYNCSYNC_DELTA_HD inline bool apply_block(uint8_t mode, int64_t entries, int64_t bw, int64_t word,
                                           const uint8_t* index, const uint8_t* values, uint8_t* data) {
  if (mode == kRaw) {
    for (int64_t i = 0; i < bw * word; ++i) data[i] = values[i];
    return true;
  }
  if (mode == kMask) {
    int64_t k = 0;
    for (int64_t i = 0; i < (bw + 7) / 8; ++i) {
      for (uint32_t bits = index[i]; bits; bits &= bits - 1) {
        const int64_t pos = 8 * i + lowest_bit(bits);
        if (pos >= bw || k >= entries) return false;
        copy_word(data + pos * word, values + k * word, word);
        ++k;
      }
    }
    return k == entries;
  }
  int64_t pos = -1;
  for (int64_t k = 0; k < entries; ++k) {
    pos += 1 + (mode == kGap1 ? index[k] : index[2 * k] | (index[2 * k + 1] << 8));
    if (pos >= bw) return false;
    copy_word(data + pos * word, values + k * word, word);
  }
  return true;
}

// The header (the table's entries and modes are written per block).
ASYNCSYNC_DELTA_HD inline void write_header(uint8_t* out, int64_t word, int64_t nwords, int64_t nblocks) {
  store_u32(out, kMagic);
  store_u32(out + 4, static_cast<uint32_t>(word));
  store_u32(out + 8, static_cast<uint32_t>(static_cast<uint64_t>(nwords)));
  store_u32(out + 12, static_cast<uint32_t>(static_cast<uint64_t>(nwords) >> 32));
  store_u32(out + 16, static_cast<uint32_t>(nblocks));
  store_u32(out + 20, static_cast<uint32_t>(kBlockWords));
}

}  // namespace asyncsync_delta
