// asyncsync CPU packing ops: copy a bucket's tensors into one flat uint8 buffer in a single call,
// optionally computing the CRC32C of the packed bytes in the same pass over memory.
//
//   asyncsync::pack(Tensor[] srcs, int[] offsets, Tensor(a!) out, bool checksum) -> int
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
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "crc32c.h"

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

// ---------------------------------------------------------------------------------------------
// Ops.

int64_t pack(at::TensorList srcs, at::IntArrayRef offsets, const at::Tensor& out, bool checksum) {
  constexpr const char* op = "asyncsync::pack";
  check_buffer(out, op, "out");
  TORCH_CHECK_VALUE(offsets.size() == srcs.size(), op, ": got ", srcs.size(), " tensors but ", offsets.size(),
                    " offsets; pass one byte offset per tensor");
  // Non-contiguous (or lazily negated/conjugated) sources are materialized in C order first: the same
  // bytes torch's copy_ writes. The copies stay alive in ``dense`` until the pack is done.
  std::vector<at::Tensor> dense;
  Layout layout;
  layout.segments.reserve(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    const at::Tensor* t = &srcs[i];
    const auto index = static_cast<int64_t>(i);
    check_tensor(*t, index, op);
    const int64_t nbytes = nbytes_of(*t);
    check_range(nbytes, offsets[i], index, out, op, "out");
    if (!t->is_contiguous() || t->is_conj() || t->is_neg()) {
      dense.push_back(t->resolve_conj().resolve_neg().contiguous());
      t = &dense.back();
    }
    auto* data = const_cast<uint8_t*>(static_cast<const uint8_t*>(t->const_data_ptr()));
    add_segment(layout, nbytes, data, offsets[i], index, out, op, "out");
  }
  finish_layout(layout, op);
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
  m.def("unpack(Tensor buf, int[] offsets, Tensor(a!)[] dsts) -> ()", TORCH_FN(unpack));
  m.def("crc_impl() -> str", TORCH_FN(crc_impl));
}
