// asyncsync CPU packing ops: copy a bucket's tensors into one flat uint8 buffer in a single call,
// optionally computing the CRC32C of the packed bytes in the same pass over memory.
//
//   asyncsync::pack(Tensor[] srcs, int[] offsets, Tensor(a!) out, bool checksum) -> int
//   asyncsync::pack_delta(Tensor[] srcs, int[] offsets, Tensor(a!) base, int word, int limit)
//       -> (int crc, int changed, Tensor delta)
//   asyncsync::apply_delta(Tensor delta, Tensor base, Tensor(a!) out, int word) -> int crc
//   asyncsync::unpack(Tensor buf, int[] offsets, Tensor(a!)[] dsts) -> ()
//   asyncsync::crc_impl() -> str
//
// The work is split by bytes of the output range [0, end), not by tensor, so one huge tensor and
// 20,000 tiny ones parallelize alike. Each thread copies its byte range and CRCs it (gaps between
// tensors included: they hold the buffer's existing bytes, exactly what a CRC of out[:end] reads);
// the per-range CRCs are combined with the GF(2) shift so the result equals the serial CRC32C.
//
// Build-time switches (used by the tests to cover the portable paths on an x86 host):
//   ASYNCSYNC_SOFTWARE_CRC     use the table CRC even where SSE4.2 is available
//   ASYNCSYNC_MIN_CHUNK_BYTES  smallest per-thread byte range (default 256 KiB)
//   ASYNCSYNC_OP_NAMESPACE     torch op namespace (default asyncsync)

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <tuple>
#include <cstring>
#include <string>
#include <vector>

#include "crc32c.h"
#include "delta.h"

#if defined(__SSE4_2__) && !defined(ASYNCSYNC_SOFTWARE_CRC)
#include <nmmintrin.h>
#define ASYNCSYNC_HW_CRC 1
#endif
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "asyncsync pack_cpu.cpp assumes a little-endian host (CRC words are loaded little-endian)"
#endif

#ifndef ASYNCSYNC_OP_NAMESPACE
#define ASYNCSYNC_OP_NAMESPACE asyncsync
#endif
#ifndef ASYNCSYNC_MIN_CHUNK_BYTES
#define ASYNCSYNC_MIN_CHUNK_BYTES (256 * 1024)
#endif

namespace {

// ---------------------------------------------------------------------------------------------
// CRC32C arithmetic (crc32c.h has the shared math: raw registers, bit-reflected).

using asyncsync_crc::multmodp;
constexpr asyncsync_crc::Tables kCrc = asyncsync_crc::make_tables();

// Bytes per interleaved stream: three independent crc32 chains hide the instruction's 3-cycle
// latency. 128 measured best here; 512 and 1024 ran 2-3x slower (4 KiB store/load aliasing).
constexpr size_t kStream = 128;

struct StreamTables {
  uint32_t stream_shift[4][256];  // per-byte tables for multiplying by x^(8 * kStream)
#ifndef ASYNCSYNC_HW_CRC
  uint32_t slice[8][256];         // slicing-by-8 tables for the software CRC
#endif

  StreamTables() {
    const uint32_t op = asyncsync_crc::x2nmodp(kCrc, kStream, 3);
    for (int j = 0; j < 4; ++j)
      for (uint32_t v = 0; v < 256; ++v) stream_shift[j][v] = multmodp(op, v << (8 * j));
#ifndef ASYNCSYNC_HW_CRC
    for (uint32_t v = 0; v < 256; ++v) slice[0][v] = kCrc.bytes[v];
    for (int k = 1; k < 8; ++k)
      for (int v = 0; v < 256; ++v) slice[k][v] = (slice[k - 1][v] >> 8) ^ slice[0][slice[k - 1][v] & 0xff];
#endif
  }
};

const StreamTables kTables;

// The CRC register after ``nbytes`` zero bytes: how a prefix's CRC combines with what follows.
uint32_t crc_shift(uint32_t crc, uint64_t nbytes) { return asyncsync_crc::shift(kCrc, crc, nbytes); }

inline uint32_t shift_stream(uint32_t c) {
  const auto& t = kTables.stream_shift;
  return t[0][c & 0xff] ^ t[1][(c >> 8) & 0xff] ^ t[2][(c >> 16) & 0xff] ^ t[3][c >> 24];
}

inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline void store64(uint8_t* p, uint64_t v) { std::memcpy(p, &v, 8); }

#ifdef ASYNCSYNC_HW_CRC
inline uint32_t crc_word(uint32_t c, uint64_t w) { return static_cast<uint32_t>(_mm_crc32_u64(c, w)); }
inline uint32_t crc_byte(uint32_t c, uint8_t b) { return _mm_crc32_u8(c, b); }
#else
inline uint32_t crc_word(uint32_t c, uint64_t w) {
  const auto& s = kTables.slice;
  w ^= c;
  return s[7][w & 0xff] ^ s[6][(w >> 8) & 0xff] ^ s[5][(w >> 16) & 0xff] ^ s[4][(w >> 24) & 0xff] ^
         s[3][(w >> 32) & 0xff] ^ s[2][(w >> 40) & 0xff] ^ s[1][(w >> 48) & 0xff] ^ s[0][w >> 56];
}
inline uint32_t crc_byte(uint32_t c, uint8_t b) { return (c >> 8) ^ kTables.slice[0][(c ^ b) & 0xff]; }
#endif

// Advances ``crc`` over ``n`` bytes of ``src``; with kCopy also stores them to ``dst`` from the same
// registers, so each byte is read from memory once for both the copy and the checksum.
template <bool kCopy>
uint32_t crc_pass(uint8_t* dst, const uint8_t* src, size_t n, uint32_t crc) {
  for (; n >= 3 * kStream; n -= 3 * kStream, src += 3 * kStream) {
    uint32_t a = crc, b = 0, c = 0;
    for (size_t i = 0; i < kStream; i += 8) {
      const uint64_t x = load64(src + i), y = load64(src + kStream + i), z = load64(src + 2 * kStream + i);
      if (kCopy) {
        store64(dst + i, x);
        store64(dst + kStream + i, y);
        store64(dst + 2 * kStream + i, z);
      }
      a = crc_word(a, x);
      b = crc_word(b, y);
      c = crc_word(c, z);
    }
    crc = shift_stream(shift_stream(a) ^ b) ^ c;
    if (kCopy) dst += 3 * kStream;
  }
  for (; n >= 8; n -= 8, src += 8) {
    const uint64_t x = load64(src);
    if (kCopy) {
      store64(dst, x);
      dst += 8;
    }
    crc = crc_word(crc, x);
  }
  for (; n; --n, ++src) {
    if (kCopy) *dst++ = *src;
    crc = crc_byte(crc, *src);
  }
  return crc;
}

// Plain copy. glibc's memcpy ran 2-4x slower than this loop here for some src/dst relative
// alignments (bucket offsets are arbitrary multiples of the item size), so the bulk is copied with
// unaligned 16-byte vectors and only the tail goes through memcpy.
void copy_bytes(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__SSE2__)
  for (; n >= 64; n -= 64, src += 64, dst += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 48));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), a);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), b);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 32), c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 48), d);
  }
#endif
  if (n) std::memcpy(dst, src, n);
}

// ---------------------------------------------------------------------------------------------
// Layout: the non-empty byte ranges of the flat buffer, sorted and checked not to overlap.

struct Segment {
  int64_t offset;  // byte offset in the flat buffer
  int64_t nbytes;  // > 0
  uint8_t* data;   // the tensor's bytes (read for pack, written for unpack)
  int64_t index;   // position in the caller's list, for error messages
};

struct Layout {
  std::vector<Segment> segments;
  int64_t end = 0;  // max(offset + nbytes) over all tensors, empty ones included (the checksummed prefix)
};

void check_buffer(const at::Tensor& buf, const char* op, const char* arg) {
  TORCH_CHECK_VALUE(buf.defined(), op, ": ", arg, " is undefined; pass a 1-D uint8 CPU tensor");
  TORCH_CHECK_VALUE(buf.device().is_cpu(), op, ": ", arg, " is on ", buf.device(),
                    "; this op works on CPU buffers (the CUDA pack backend handles GPU buffers)");
  TORCH_CHECK_TYPE(buf.scalar_type() == at::kByte, op, ": ", arg, " has dtype ", buf.scalar_type(),
                   "; expected a flat uint8 buffer");
  TORCH_CHECK_VALUE(buf.layout() == at::kStrided && buf.dim() == 1, op, ": ", arg, " must be a 1-D dense tensor, got ",
                    buf.dim(), " dims with layout ", buf.layout());
  TORCH_CHECK_VALUE(buf.is_contiguous(), op, ": ", arg, " is not contiguous (stride ", buf.stride(0),
                    "); pass a contiguous buffer, e.g. torch.empty(n, dtype=torch.uint8)");
}

bool ranges_overlap(const uint8_t* a, int64_t na, const uint8_t* b, int64_t nb) {
  return na > 0 && nb > 0 && a < b + nb && b < a + na;
}

// Sorts segments by offset (a BucketPlan's already are) and rejects overlapping ranges, which a
// parallel copy could not order.
void finish_layout(Layout& layout, const char* op) {
  auto& segs = layout.segments;
  const auto by_offset = [](const Segment& x, const Segment& y) { return x.offset < y.offset; };
  if (!std::is_sorted(segs.begin(), segs.end(), by_offset)) std::stable_sort(segs.begin(), segs.end(), by_offset);
  for (size_t k = 1; k < segs.size(); ++k) {
    const Segment& prev = segs[k - 1];
    const Segment& cur = segs[k];
    TORCH_CHECK_VALUE(prev.offset + prev.nbytes <= cur.offset, op, ": byte ranges overlap: tensor ", prev.index,
                      " covers [", prev.offset, ", ", prev.offset + prev.nbytes, ") and tensor ", cur.index,
                      " starts at ", cur.offset, "; offsets must give each tensor its own range (use BucketPlan)");
  }
}

// The byte range [offset, offset + nbytes) of tensor ``index`` must lie inside ``buf``. Checked before
// a source is materialized, so a huge (e.g. expanded) view is refused without allocating for it, and
// written as a subtraction so that no offset can overflow past the check.
void check_range(int64_t nbytes, int64_t offset, int64_t index, const at::Tensor& buf, const char* op,
                 const char* buf_arg) {
  TORCH_CHECK_VALUE(offset >= 0, op, ": offset ", offset, " of tensor ", index, " is negative");
  TORCH_CHECK_VALUE(nbytes <= buf.numel() && offset <= buf.numel() - nbytes, op, ": tensor ", index, " needs ", nbytes,
                    " bytes at offset ", offset, " but ", buf_arg, " has only ", buf.numel(),
                    " bytes; allocate the buffer with at least the bucket's nbytes");
}

void add_segment(Layout& layout, int64_t nbytes, uint8_t* data, int64_t offset, int64_t index,
                 const at::Tensor& buf, const char* op, const char* buf_arg) {
  TORCH_CHECK_VALUE(!ranges_overlap(data, nbytes, static_cast<const uint8_t*>(buf.const_data_ptr()), buf.numel()),
                    op, ": tensor ", index, " shares memory with ", buf_arg,
                    "; pass tensors that do not alias the flat buffer");
  layout.end = std::max(layout.end, offset + nbytes);
  if (nbytes > 0) layout.segments.push_back({offset, nbytes, data, index});
}

// Destinations written in parallel must not share memory, or the result depends on thread timing.
void check_disjoint_destinations(const Layout& layout, const char* op) {
  std::vector<const Segment*> by_address;
  by_address.reserve(layout.segments.size());
  for (const Segment& s : layout.segments) by_address.push_back(&s);
  std::sort(by_address.begin(), by_address.end(), [](const Segment* x, const Segment* y) { return x->data < y->data; });
  for (size_t k = 1; k < by_address.size(); ++k) {
    const Segment& prev = *by_address[k - 1];
    const Segment& cur = *by_address[k];
    TORCH_CHECK_VALUE(!ranges_overlap(prev.data, prev.nbytes, cur.data, cur.nbytes), op, ": destinations ", prev.index,
                      " and ", cur.index, " share memory; unpack into tensors that do not overlap");
  }
}

int64_t nbytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// Everything that makes reading (or writing) a tensor's memory unsafe, checked before any byte is
// touched. The Python packing layer checks the same and more (the plan's dtypes, shapes and device);
// this is the op's own defence. A tensor subclass with its own dispatch (DTensor, FakeTensor) reaches
// this kernel as it is, with no storage or a null data pointer; a storage freed or shrunk with
// ``untyped_storage().resize_()`` (as FSDP does to unsharded parameters) leaves a view that points
// past the end of its allocation.
void check_tensor(const at::Tensor& t, int64_t index, const char* op) {
  TORCH_CHECK_VALUE(t.defined(), op, ": tensor ", index, " is undefined");
  TORCH_CHECK_VALUE(!t.key_set().has(c10::DispatchKey::Python), op, ": tensor ", index,
                    " is a tensor subclass with its own dispatch (e.g. a DTensor or a FakeTensor); pass plain tensors "
                    "(for a DTensor, its full_tensor())");
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": tensor ", index, " is on ", t.device(),
                    "; this op handles CPU tensors with data (the CUDA pack backend handles GPU tensors)");
  TORCH_CHECK_VALUE(t.layout() == at::kStrided, op, ": tensor ", index, " has layout ", t.layout(),
                    "; only dense tensors can be packed (call .to_dense() first)");
  TORCH_CHECK_VALUE(t.has_storage(), op, ": tensor ", index,
                    " has no storage (a wrapper tensor); pass a plain tensor that owns its data");
  if (t.numel() == 0) return;
  int64_t last = t.storage_offset();  // the furthest element the view reaches
  for (int64_t d = 0; d < t.dim(); ++d) {
    TORCH_CHECK_VALUE(t.stride(d) >= 0, op, ": tensor ", index, " has a negative stride");
    last += (t.size(d) - 1) * t.stride(d);
  }
  const int64_t needed = (last + 1) * static_cast<int64_t>(t.element_size());
  const auto have = static_cast<int64_t>(t.storage().nbytes());
  TORCH_CHECK_VALUE(t.storage().data() != nullptr && needed <= have, op, ": tensor ", index, " reads ", needed,
                    " bytes of a storage that holds ", have, ": its storage was freed or resized after the view was "
                    "made (e.g. by FSDP resharding); pack it while its data is allocated");
}


// ---------------------------------------------------------------------------------------------
// Byte-range driver.

// Handles flat-buffer bytes [begin, end): copies the parts of the segments inside it (into the
// buffer for pack, out of it for unpack). With kCrc, returns the CRC register (from 0) over all of
// [begin, end) as the buffer holds it after the copy, gaps included.
template <bool kPack, bool kCrc>
uint32_t process_range(uint8_t* buf, const std::vector<Segment>& segs, int64_t begin, int64_t end) {
  // Ranges are sorted and disjoint, so their ends are sorted too.
  auto it = std::upper_bound(segs.begin(), segs.end(), begin,
                             [](int64_t pos, const Segment& s) { return pos < s.offset + s.nbytes; });
  uint32_t crc = 0;
  int64_t pos = begin;
  for (; it != segs.end() && it->offset < end; ++it) {
    const int64_t a = std::max(begin, it->offset);
    const int64_t b = std::min(end, it->offset + it->nbytes);
    uint8_t* ext = it->data + (a - it->offset);
    if (kCrc && a > pos) crc = crc_pass<false>(nullptr, buf + pos, a - pos, crc);
    if (!kPack)
      copy_bytes(ext, buf + a, b - a);
    else if (kCrc)
      crc = crc_pass<true>(buf + a, ext, b - a, crc);
    else
      copy_bytes(buf + a, ext, b - a);
    pos = b;
  }
  if (kCrc && end > pos) crc = crc_pass<false>(nullptr, buf + pos, end - pos, crc);
  return crc;
}

// Splits [0, layout.end) into one equal byte range per thread (torch.get_num_threads()), at least
// ASYNCSYNC_MIN_CHUNK_BYTES each, and returns the standard CRC32C of the range when kCrc.
template <bool kPack, bool kCrc>
uint32_t run(uint8_t* buf, const Layout& layout) {
  const int64_t total = layout.end;
  if (total == 0) return 0;  // CRC32C of no bytes
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t min_chunk = std::max<int64_t>(1, ASYNCSYNC_MIN_CHUNK_BYTES);
  int64_t chunk = (total + threads - 1) / threads;
  chunk = std::max(min_chunk, (chunk + 63) / 64 * 64);  // whole cache lines per thread
  const int64_t nchunks = (total + chunk - 1) / chunk;
  std::vector<uint32_t> crcs(nchunks);
  const auto work = [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      crcs[i] = process_range<kPack, kCrc>(buf, layout.segments, i * chunk, std::min(total, (i + 1) * chunk));
  };
  if (nchunks == 1)
    work(0, 1);
  else
    at::parallel_for(0, nchunks, 1, work);
  if (!kCrc) return 0;
  uint32_t acc = 0xFFFFFFFFu;  // standard initial value, then combine chunk by chunk
  for (int64_t i = 0; i < nchunks; ++i)
    acc = crc_shift(acc, std::min(total, (i + 1) * chunk) - i * chunk) ^ crcs[i];
  return ~acc;
}

// The layout of a pack into ``out``: every source checked (``check_tensor``, ``check_range``) before
// any byte is read, non-contiguous (or lazily negated/conjugated) sources materialized in C order
// first (the same bytes torch's copy_ writes; the copies stay alive in ``dense`` until the pack is
// done), the ranges sorted and checked not to overlap.
Layout pack_layout(at::TensorList srcs, at::IntArrayRef offsets, const at::Tensor& out, const char* op, const char* arg,
                   std::vector<at::Tensor>& dense) {
  check_buffer(out, op, arg);
  TORCH_CHECK_VALUE(offsets.size() == srcs.size(), op, ": got ", srcs.size(), " tensors but ", offsets.size(),
                    " offsets; pass one byte offset per tensor");
  Layout layout;
  layout.segments.reserve(srcs.size());
  dense.reserve(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    const at::Tensor* t = &srcs[i];
    const auto index = static_cast<int64_t>(i);
    check_tensor(*t, index, op);
    const int64_t nbytes = nbytes_of(*t);
    check_range(nbytes, offsets[i], index, out, op, arg);
    if (!t->is_contiguous() || t->is_conj() || t->is_neg()) {
      dense.push_back(t->resolve_conj().resolve_neg().contiguous());
      t = &dense.back();
    }
    auto* data = const_cast<uint8_t*>(static_cast<const uint8_t*>(t->const_data_ptr()));
    add_segment(layout, nbytes, data, offsets[i], index, out, op, arg);
  }
  finish_layout(layout, op);
  return layout;
}

// ---------------------------------------------------------------------------------------------
// Delta encoding (delta.h): pack into the buffer that holds the previous version, and in the same
// pass over each block (while it is in cache) find the words that changed and encode them.

// ORs ``bits`` (``nbits`` <= 32 of them) into the bitmask ``mask`` at bit ``pos``.
inline void set_bits(uint32_t* mask, int64_t pos, uint32_t bits, int64_t nbits) {
  const int64_t shift = pos % 32;
  mask[pos / 32] |= bits << shift;
  if (shift + nbits > 32) mask[pos / 32 + 1] |= bits >> (32 - shift);
}

// Sets bit ``first + j`` of ``mask`` for every word j of the ``n`` words (kWord bytes each) that
// differ between ``a`` and ``b``. Runs of 64 bytes that did not change, nearly all of them in an RL
// update, cost one test.
template <int kWord>
void diff_words(const uint8_t* a, const uint8_t* b, int64_t n, int64_t first, uint32_t* mask) {
  int64_t i = 0;
#if defined(__SSE2__)
  constexpr int64_t kPer = 16 / kWord;  // words per vector
  const auto load = [](const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); };
  const auto vector_bits = [](__m128i x, __m128i y) -> uint32_t {  // one bit per word that differs
    if (kWord == 1) return ~static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(x, y))) & 0xFFFFu;
    if (kWord == 2) {
      const __m128i eq = _mm_cmpeq_epi16(x, y);
      return ~static_cast<uint32_t>(_mm_movemask_epi8(_mm_packs_epi16(eq, eq))) & 0xFFu;
    }
    const uint32_t ints = ~static_cast<uint32_t>(_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(x, y)))) & 0xFu;
    return kWord == 4 ? ints : ((ints & 3u) != 0) | (((ints & 12u) != 0) << 1);
  };
  const __m128i zero = _mm_setzero_si128();
  for (; i + 4 * kPer <= n; i += 4 * kPer) {
    const uint8_t *pa = a + i * kWord, *pb = b + i * kWord;
    const __m128i x0 = load(pa), x1 = load(pa + 16), x2 = load(pa + 32), x3 = load(pa + 48);
    const __m128i y0 = load(pb), y1 = load(pb + 16), y2 = load(pb + 32), y3 = load(pb + 48);
    const __m128i any = _mm_or_si128(_mm_or_si128(_mm_xor_si128(x0, y0), _mm_xor_si128(x1, y1)),
                                     _mm_or_si128(_mm_xor_si128(x2, y2), _mm_xor_si128(x3, y3)));
    if (_mm_movemask_epi8(_mm_cmpeq_epi8(any, zero)) == 0xFFFF) continue;
    const __m128i xs[4] = {x0, x1, x2, x3}, ys[4] = {y0, y1, y2, y3};
    for (int v = 0; v < 4; ++v) {
      const uint32_t bits = vector_bits(xs[v], ys[v]);
      if (bits) set_bits(mask, first + i + v * kPer, bits, kPer);
    }
  }
#endif
  for (; i < n; ++i)
    if (std::memcmp(a + i * kWord, b + i * kWord, kWord) != 0) set_bits(mask, first + i, 1u, 1);
}

void diff_range(const uint8_t* a, const uint8_t* b, int64_t n, int64_t first, int64_t word, uint32_t* mask) {
  switch (word) {
    case 1: return diff_words<1>(a, b, n, first, mask);
    case 2: return diff_words<2>(a, b, n, first, mask);
    case 4: return diff_words<4>(a, b, n, first, mask);
    default: return diff_words<8>(a, b, n, first, mask);
  }
}

// The changes a pack of bytes [lo, hi) would make to ``buf`` (whose words are ``word`` bytes, the
// first at ``lo``): ``mask`` (zeroed here) gets a bit per word whose new bytes, read from the
// segments, differ from what ``buf`` holds. Bytes no segment covers keep theirs: no bit. Called
// before the pack writes the range, so the baseline is read where it is, never copied aside.
void diff_block(const uint8_t* buf, const std::vector<Segment>& segs, int64_t lo, int64_t hi, int64_t word,
                uint32_t* mask) {
  std::memset(mask, 0, static_cast<size_t>(((hi - lo) / word + 31) / 32) * sizeof(uint32_t));
  auto it = std::upper_bound(segs.begin(), segs.end(), lo,
                             [](int64_t pos, const Segment& s) { return pos < s.offset + s.nbytes; });
  for (; it != segs.end() && it->offset < hi; ++it) {
    const int64_t a = std::max(lo, it->offset), b = std::min(hi, it->offset + it->nbytes);
    // Offsets are multiples of each tensor's item size, itself a multiple of the word.
    diff_range(buf + a, it->data + (a - it->offset), (b - a) / word, (a - lo) / word, word, mask);
  }
}

// Blocks a thread encodes before it may give up on a bucket whose delta is on course for twice its limit.
constexpr int64_t kProjectAfterBlocks = 8;

// One thread's contiguous run of blocks: their index and value bytes per mode (R values are taken
// from the buffer when the delta is assembled), the raw CRC of its bytes and the words that changed.
struct DeltaChunk {
  std::vector<uint8_t> index[asyncsync_delta::kModes];
  std::vector<uint8_t> value[asyncsync_delta::kModes];
  uint32_t crc = 0;
  int64_t changed = 0;
};

std::tuple<int64_t, int64_t, at::Tensor> pack_delta(at::TensorList srcs, at::IntArrayRef offsets, const at::Tensor& base,
                                                    int64_t word, int64_t limit) {
  namespace d = asyncsync_delta;
  constexpr const char* op = "asyncsync::pack_delta";
  TORCH_CHECK_VALUE(word == 1 || word == 2 || word == 4 || word == 8, op, ": word must be 1, 2, 4 or 8 bytes, got ", word);
  std::vector<at::Tensor> dense;
  const Layout layout = pack_layout(srcs, offsets, base, op, "base", dense);
  const int64_t end = layout.end;
  TORCH_CHECK_VALUE(end % word == 0, op, ": the bucket's ", end, " bytes are not whole words of ", word,
                    " bytes; the word is the smallest item size of the bucket's tensors");
  auto* buf = static_cast<uint8_t*>(base.mutable_data_ptr());
  const int64_t nwords = end / word;
  const int64_t nblocks = (nwords + d::kBlockWords - 1) / d::kBlockWords;
  const int64_t block_bytes = d::kBlockWords * word;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t per = std::max<int64_t>(1, (nblocks + threads - 1) / threads);
  const int64_t nchunks = nblocks ? (nblocks + per - 1) / per : 0;
  std::vector<DeltaChunk> chunks(nchunks);
  std::vector<d::BlockPlan> plans(nblocks);
  std::atomic<int64_t> spent{0};
  std::atomic<bool> gave_up{limit <= 0};
  const auto work = [&](int64_t lo_chunk, int64_t hi_chunk) {
    std::vector<uint32_t> mask(d::kMaskWords);
    for (int64_t c = lo_chunk; c < hi_chunk; ++c) {
      DeltaChunk& out = chunks[c];
      int64_t own_spent = 0, own_bytes = 0, own_blocks = 0;
      for (int64_t b = c * per; b < std::min(nblocks, (c + 1) * per); ++b) {
        const int64_t lo = b * block_bytes, hi = std::min(end, lo + block_bytes), bw = (hi - lo) / word;
        const bool encode = !gave_up.load(std::memory_order_relaxed);
        if (encode) diff_block(buf, layout.segments, lo, hi, word, mask.data());  // before the pack overwrites it
        out.crc = crc_shift(out.crc, hi - lo) ^ process_range<true, true>(buf, layout.segments, lo, hi);
        if (!encode) continue;
        const d::BlockPlan plan = d::plan_block(mask.data(), bw, word);
        plans[b] = plan;
        out.changed += plan.changed;
        const int64_t cost = plan.index_bytes + plan.value_bytes;
        own_spent += cost, own_bytes += hi - lo, ++own_blocks;
        // Past the limit, or on course for twice it by this thread's first blocks (a dense update):
        // the whole bucket goes out, and every thread stops encoding.
        if (spent.fetch_add(cost, std::memory_order_relaxed) + cost > limit ||
            (own_blocks >= kProjectAfterBlocks &&
             static_cast<double>(own_spent) * static_cast<double>(end) > 2.0 * static_cast<double>(limit) * own_bytes)) {
          gave_up.store(true, std::memory_order_relaxed);
          continue;
        }
        if (plan.entries == 0 || plan.mode == d::kRaw) continue;
        auto& index = out.index[plan.mode];
        auto& value = out.value[plan.mode];
        const size_t at_index = index.size(), at_value = value.size();
        index.resize(at_index + static_cast<size_t>(plan.index_bytes));
        value.resize(at_value + static_cast<size_t>(plan.value_bytes));
        d::write_block(plan, mask.data(), bw, word, buf + lo, index.data() + at_index, value.data() + at_value);
      }
    }
  };
  if (nchunks > 1)
    at::parallel_for(0, nchunks, 1, work);
  else
    work(0, nchunks);
  uint32_t acc = 0xFFFFFFFFu;
  int64_t changed = 0;
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t bytes = std::min(end, (c + 1) * per * block_bytes) - c * per * block_bytes;
    acc = crc_shift(acc, bytes) ^ chunks[c].crc;
    changed += chunks[c].changed;
  }
  const auto crc = static_cast<int64_t>(end ? ~acc : 0u);
  const at::Tensor none = at::empty({0}, base.options());
  if (gave_up.load()) return {crc, -1, none};  // -1: not every block was compared

  int64_t index_bytes[d::kModes] = {}, value_bytes[d::kModes] = {};
  for (const DeltaChunk& c : chunks)
    for (int k = 0; k < d::kModes; ++k) {
      index_bytes[k] += static_cast<int64_t>(c.index[k].size());
      value_bytes[k] += static_cast<int64_t>(c.value[k].size());
    }
  for (const d::BlockPlan& p : plans)
    if (p.mode == d::kRaw) value_bytes[d::kRaw] += p.value_bytes;
  const d::Sections sections = d::layout(nblocks, index_bytes, value_bytes);
  if (sections.total > limit) return {crc, changed, none};
  at::Tensor delta = at::zeros({sections.total}, base.options());
  auto* out = static_cast<uint8_t*>(delta.mutable_data_ptr());
  d::write_header(out, word, nwords, nblocks);
  uint8_t* modes = out + d::align8(sections.table + 4 * nblocks);
  for (int64_t b = 0; b < nblocks; ++b) {
    d::store_u32(out + sections.table + 4 * b, plans[b].entries);
    modes[b] = plans[b].mode;
  }
  int64_t index_at[d::kModes], value_at[d::kModes];
  for (int k = 0; k < d::kModes; ++k) index_at[k] = sections.index[k], value_at[k] = sections.value[k];
  for (const DeltaChunk& c : chunks)
    for (int k = 0; k < d::kModes; ++k) {
      if (!c.index[k].empty()) std::memcpy(out + index_at[k], c.index[k].data(), c.index[k].size());
      if (!c.value[k].empty()) std::memcpy(out + value_at[k], c.value[k].data(), c.value[k].size());
      index_at[k] += static_cast<int64_t>(c.index[k].size());
      value_at[k] += static_cast<int64_t>(c.value[k].size());
    }
  for (int64_t b = 0; b < nblocks; ++b) {
    if (plans[b].mode != d::kRaw) continue;
    std::memcpy(out + value_at[d::kRaw], buf + b * block_bytes, static_cast<size_t>(plans[b].value_bytes));
    value_at[d::kRaw] += plans[b].value_bytes;
  }
  return {crc, changed, delta};
}

uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// Rebuilds a bucket into ``out`` from ``base`` (the baseline's bytes; ``out`` itself to rebuild in
// place) and a delta, block by block in parallel, and returns the CRC32C of the rebuilt bytes, taken
// while each block is in cache. Every size, count and position is checked against the bucket; a
// delta that does not fit raises (ValueError) and leaves ``out`` unspecified: the caller refuses it.
int64_t apply_delta(const at::Tensor& delta, const at::Tensor& base, const at::Tensor& out, int64_t word) {
  namespace d = asyncsync_delta;
  constexpr const char* op = "asyncsync::apply_delta";
  check_buffer(delta, op, "delta");
  check_buffer(base, op, "base");
  check_buffer(out, op, "out");
  const int64_t n = delta.numel(), nbytes = out.numel();
  TORCH_CHECK_VALUE(base.numel() == nbytes, op, ": a baseline of ", base.numel(), " bytes cannot rebuild a bucket of ",
                    nbytes, " bytes");
  TORCH_CHECK_VALUE((word == 1 || word == 2 || word == 4 || word == 8) && nbytes % word == 0, op, ": a bucket of ",
                    nbytes, " bytes is not whole words of ", word, " bytes");
  const auto* p = static_cast<const uint8_t*>(delta.const_data_ptr());
  const int64_t nwords = nbytes / word, nblocks = (nwords + d::kBlockWords - 1) / d::kBlockWords;
  TORCH_CHECK_VALUE(n >= d::kHeaderBytes, op, ": a delta of ", n, " bytes is shorter than its header");
  const uint64_t got_words = load_u32(p + 8) | (static_cast<uint64_t>(load_u32(p + 12)) << 32);
  TORCH_CHECK_VALUE(load_u32(p) == d::kMagic && load_u32(p + 4) == word && got_words == static_cast<uint64_t>(nwords) &&
                        load_u32(p + 16) == nblocks && load_u32(p + 20) == d::kBlockWords,
                    op, ": the delta's header does not describe this bucket (", nwords, " words of ", word, " bytes)");
  const int64_t modes_at = d::align8(d::kHeaderBytes + 4 * nblocks);
  TORCH_CHECK_VALUE(n >= d::align8(modes_at + nblocks), op, ": a delta of ", n, " bytes cannot hold its table");
  // Where each block's index and values start: per mode, in block order.
  std::vector<int64_t> index_at(nblocks), value_at(nblocks);
  int64_t index_bytes[d::kModes] = {}, value_bytes[d::kModes] = {};
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t entries = load_u32(p + d::kHeaderBytes + 4 * b), bw = std::min(d::kBlockWords, nwords - b * d::kBlockWords);
    const uint8_t mode = p[modes_at + b];
    TORCH_CHECK_VALUE(mode < d::kModes && entries <= bw && (mode != d::kRaw || entries == bw), op, ": block ", b,
                      ": mode ", int(mode), " with ", entries, " entries does not fit a block of ", bw, " words");
    index_at[b] = index_bytes[mode];
    value_at[b] = value_bytes[mode];
    if (entries == 0) continue;
    index_bytes[mode] += mode == d::kGap1 ? entries : mode == d::kGap2 ? 2 * entries : mode == d::kMask ? (bw + 7) / 8 : 0;
    value_bytes[mode] += entries * word;
  }
  const d::Sections sections = d::layout(nblocks, index_bytes, value_bytes);
  TORCH_CHECK_VALUE(sections.total == n, op, ": the delta's table adds up to ", sections.total, " bytes, but ", n,
                    " arrived");
  const auto* from = static_cast<const uint8_t*>(base.const_data_ptr());
  auto* to = static_cast<uint8_t*>(out.mutable_data_ptr());
  const int64_t block_bytes = d::kBlockWords * word;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t per = std::max<int64_t>(1, (nblocks + threads - 1) / threads);
  const int64_t nchunks = nblocks ? (nblocks + per - 1) / per : 0;
  std::vector<uint32_t> crcs(nchunks, 0);
  std::vector<int64_t> bad(nchunks, -1);
  const auto work = [&](int64_t lo_chunk, int64_t hi_chunk) {
    for (int64_t c = lo_chunk; c < hi_chunk; ++c) {
      for (int64_t b = c * per; b < std::min(nblocks, (c + 1) * per); ++b) {
        const int64_t lo = b * block_bytes, hi = std::min(nbytes, lo + block_bytes);
        const uint8_t mode = p[modes_at + b];
        const int64_t entries = load_u32(p + d::kHeaderBytes + 4 * b);
        if (to != from) copy_bytes(to + lo, from + lo, static_cast<size_t>(hi - lo));
        if (entries && !d::apply_block(mode, entries, (hi - lo) / word, word, p + sections.index[mode] + index_at[b],
                                       p + sections.value[mode] + value_at[b], to + lo)) {
          bad[c] = b;
          break;
        }
        crcs[c] = crc_shift(crcs[c], hi - lo) ^ crc_pass<false>(nullptr, to + lo, static_cast<size_t>(hi - lo), 0);
      }
    }
  };
  if (nchunks > 1)
    at::parallel_for(0, nchunks, 1, work);
  else
    work(0, nchunks);
  uint32_t acc = 0xFFFFFFFFu;
  for (int64_t c = 0; c < nchunks; ++c) {
    TORCH_CHECK_VALUE(bad[c] < 0, op, ": block ", bad[c], "'s entries run past the block or do not match its count");
    acc = crc_shift(acc, std::min(nbytes, (c + 1) * per * block_bytes) - c * per * block_bytes) ^ crcs[c];
  }
  return static_cast<int64_t>(nbytes ? ~acc : 0u);
}

// ---------------------------------------------------------------------------------------------
// Ops.

int64_t pack(at::TensorList srcs, at::IntArrayRef offsets, const at::Tensor& out, bool checksum) {
  constexpr const char* op = "asyncsync::pack";
  std::vector<at::Tensor> dense;
  const Layout layout = pack_layout(srcs, offsets, out, op, "out", dense);
  auto* buf = static_cast<uint8_t*>(out.mutable_data_ptr());
  if (!checksum) {
    run<true, false>(buf, layout);
    return -1;
  }
  return static_cast<int64_t>(run<true, true>(buf, layout));
}

void unpack(const at::Tensor& buf, at::IntArrayRef offsets, at::TensorList dsts) {
  constexpr const char* op = "asyncsync::unpack";
  check_buffer(buf, op, "buf");
  TORCH_CHECK_VALUE(offsets.size() == dsts.size(), op, ": got ", dsts.size(), " destination tensors but ",
                    offsets.size(), " offsets; pass one byte offset per tensor");
  Layout layout;
  layout.segments.reserve(dsts.size());
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor& t = dsts[i];
    const auto index = static_cast<int64_t>(i);
    check_tensor(t, index, op);
    TORCH_CHECK_VALUE(t.is_contiguous() && !t.is_conj() && !t.is_neg(), op, ": destination ", i,
                      " is not a plain contiguous tensor; unpack into a contiguous one and copy_ it where needed");
    const int64_t nbytes = nbytes_of(t);
    check_range(nbytes, offsets[i], index, buf, op, "buf");
    add_segment(layout, nbytes, static_cast<uint8_t*>(t.mutable_data_ptr()), offsets[i], index, buf, op, "buf");
  }
  finish_layout(layout, op);
  check_disjoint_destinations(layout, op);
  run<false, false>(static_cast<uint8_t*>(const_cast<void*>(buf.const_data_ptr())), layout);
}

std::string crc_impl() {
#ifdef ASYNCSYNC_HW_CRC
  return "sse4.2";
#else
  return "software";
#endif
}

}  // namespace

#ifdef ASYNCSYNC_PYTHON_MODULE
// The install-time build is a Python extension module (asyncsync._pack_cpu): importing it loads the
// library, whose TORCH_LIBRARY block registers the ops. The module itself is empty.
#include <Python.h>
extern "C" PyMODINIT_FUNC PyInit__pack_cpu(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_pack_cpu", "asyncsync's compiled pack ops (torch.ops.asyncsync)", -1,
                            nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&def);
}
#endif

TORCH_LIBRARY(ASYNCSYNC_OP_NAMESPACE, m) {
  m.def("pack(Tensor[] srcs, int[] offsets, Tensor(a!) out, bool checksum) -> int", TORCH_FN(pack));
  m.def("pack_delta(Tensor[] srcs, int[] offsets, Tensor(a!) base, int word, int limit) -> (int, int, Tensor)",
        TORCH_FN(pack_delta));
  m.def("apply_delta(Tensor delta, Tensor base, Tensor(a!) out, int word) -> int", TORCH_FN(apply_delta));
  m.def("unpack(Tensor buf, int[] offsets, Tensor(a!)[] dsts) -> ()", TORCH_FN(unpack));
  m.def("crc_impl() -> str", TORCH_FN(crc_impl));
}
