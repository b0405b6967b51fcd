// asyncsync CUDA pack kernel: copies a bucket's tensors into one flat device buffer in ONE kernel
// launch, optionally computing the CRC32C of the packed bytes in the same kernel.
//
// Written against the plain CUDA runtime (no ATen/c10 CUDA headers, which the CPU torch wheel lacks)
// and exposed through a C ABI, so Python binds it with ctypes:
//
//   int64_t asyncsync_pack_cuda_workspace_bytes(int64_t total_bytes);
//   int     asyncsync_pack_cuda(srcs, sizes, dst_offsets, count, dst, total_bytes, stream,
//                               checksum_out, workspace);     // returns a cudaError_t value
//   const char* asyncsync_cuda_error_string(int code);
//
// and the delta path (csrc/delta.h has the format's shared block logic):
//
//   int     asyncsync_pack_delta_cuda(srcs, sizes, dst_offsets, count, base, total_bytes, stream,
//                                     checksum_out, workspace, mask, word, plans);
//   int64_t asyncsync_delta_plan_bytes();   // bytes of one block's plan
//   int64_t asyncsync_delta_layout(plans_host, nblocks, offsets_out);   // host: the delta's size
//   int     asyncsync_delta_write_cuda(mask, plans, offsets, base, nwords, word, out, stream);
//
// pack_delta packs into ``base`` (which holds the previous version) as the pack kernel does, and in
// the same pass each thread compares the 16 bytes it checksums with what they held before and sets
// one bit per changed word in ``mask``; a second kernel plans each block of the format (one thread
// per block). The caller reads the plans (a host sync, on the sender's thread), sizes the delta
// (asyncsync_delta_layout) and, if it pays, has a third kernel write it (one thread per block).
//
// Design. The destination range [0, total_bytes) is cut into 4 KiB tiles (256 threads x 16 bytes)
// and each block walks a contiguous run of tiles. Thread 0 binary-searches the device table of
// ranges (sorted by offset) once per block for the first one that reaches its first tile, then
// advances linearly tile by tile; the block then copies
// every range's part inside the tile, with 16-byte vector loads/stores when source and destination
// are equally aligned mod 16 and byte copies otherwise. With a checksum, each thread CRCs its 16
// bytes of the finished tile, a shared-memory tree combines them (GF(2) shift), the block folds its
// tiles into one partial CRC, and the last block to finish (atomic counter) combines the partials.
// Bytes of the range not covered by any tensor are left untouched and are checksummed as they are.
//
// The block logic is a template over an execution policy so that the self-test build
// (-DASYNCSYNC_PACK_CUDA_SELFTEST, see scripts/check_cuda.sh) can emulate a block with host
// threads and check bytes and CRC against a bitwise reference without a GPU.

#include <cuda_runtime.h>

#include <cstdint>

#include "crc32c.h"
#include "delta.h"

namespace asyncsync_cuda {

constexpr int kThreads = 256;
constexpr int64_t kVec = 16;                // bytes per thread per tile (one uint4)
constexpr int64_t kTile = kThreads * kVec;  // 4 KiB
constexpr int kBlocksPerSm = 8;
constexpr int64_t kMaxBlocks = 4096;        // bounds the partial-CRC workspace
constexpr int64_t kWorkspaceHeader = 16;    // the done-counter, padded

__host__ __device__ constexpr int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ constexpr int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

using asyncsync_crc::Tables;

__constant__ Tables c_tables = asyncsync_crc::make_tables();
#ifndef __CUDA_ARCH__
constexpr Tables kHostTables = asyncsync_crc::make_tables();
#endif

__host__ __device__ inline const Tables& tables() {
#ifdef __CUDA_ARCH__
  return c_tables;
#else
  return kHostTables;
#endif
}

// Raw CRC registers (no pre/post inversion): crc(A||B) = shift(crc(A), |B|) ^ crc(B).
__host__ __device__ inline uint32_t crc_combine(uint32_t crc_a, uint32_t crc_b, int64_t len_b) {
  return asyncsync_crc::combine(tables(), crc_a, crc_b, static_cast<uint64_t>(len_b));
}

// The shift operators of the tree reduction's levels: at level k the right-hand side covers
// kVec * 2^k bytes in a full tile, so its operator x^(8 * kVec * 2^k) is a constant; only a tile cut
// short by the end of the bucket needs the general combine.
struct LevelOps {
  uint32_t op[8];  // kThreads = 2^8
};

constexpr LevelOps make_level_ops() {
  LevelOps ops{};
  const asyncsync_crc::Tables t = asyncsync_crc::make_tables();
  for (int k = 0; k < 8; ++k) ops.op[k] = asyncsync_crc::x2nmodp(t, static_cast<uint64_t>(16) << k, 3);
  return ops;
}

__constant__ LevelOps c_level_ops = make_level_ops();
#ifndef __CUDA_ARCH__
constexpr LevelOps kHostLevelOps = make_level_ops();
#endif

__host__ __device__ inline uint32_t level_op(int level) {
#ifdef __CUDA_ARCH__
  return c_level_ops.op[level];
#else
  return kHostLevelOps.op[level];
#endif
}

using asyncsync_crc::crc_byte;

// Raw CRC (from 0) of a thread's n <= 16 bytes; one vector load when they are a whole aligned uint4.
__host__ __device__ inline uint32_t thread_crc(const uint32_t* table, const uint8_t* p, int64_t n) {
  uint32_t crc = 0;
  if (n == kVec && (reinterpret_cast<uintptr_t>(p) & (kVec - 1)) == 0) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
    for (uint32_t w : words)
      for (int i = 0; i < 4; ++i) crc = crc_byte(table, crc, static_cast<uint8_t>(w >> (8 * i)));
    return crc;
  }
  for (int64_t i = 0; i < n; ++i) crc = crc_byte(table, crc, p[i]);
  return crc;
}

struct Segments {
  const uint8_t* const* srcs;  // device pointers to each tensor's bytes
  const int64_t* sizes;        // bytes per tensor
  const int64_t* offsets;      // destination byte offsets: sorted, ranges disjoint
  int64_t count;
};

// Index of the first range ending after ``pos`` (ranges are sorted and disjoint, so ends are sorted).
__host__ __device__ inline int64_t first_ending_after(const Segments& s, int64_t pos) {
  int64_t lo = 0, hi = s.count;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (s.offsets[mid] + s.sizes[mid] > pos)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo;
}

// Thread ``tid``'s share of copying n bytes; consecutive threads touch consecutive addresses.
__host__ __device__ inline void copy_piece(uint8_t* dst, const uint8_t* src, int64_t n, int tid) {
  const uintptr_t d = reinterpret_cast<uintptr_t>(dst), s = reinterpret_cast<uintptr_t>(src);
  if (((d ^ s) & (kVec - 1)) == 0) {
    const int64_t head = imin(n, static_cast<int64_t>((kVec - (d & (kVec - 1))) & (kVec - 1)));
    const int64_t nvec = (n - head) / kVec;
    for (int64_t i = tid; i < head; i += kThreads) dst[i] = src[i];
    auto* dv = reinterpret_cast<uint4*>(dst + head);
    const auto* sv = reinterpret_cast<const uint4*>(src + head);
    for (int64_t v = tid; v < nvec; v += kThreads) dv[v] = sv[v];
    for (int64_t i = head + nvec * kVec + tid; i < n; i += kThreads) dst[i] = src[i];
  } else {
    for (int64_t i = tid; i < n; i += kThreads) dst[i] = src[i];
  }
}

struct Params {
  Segments segs;
  uint8_t* dst;
  int64_t total;            // bytes [0, total) are written (ranges) or kept (gaps) and checksummed
  int64_t tiles_per_block;
  uint32_t* partials;       // one raw CRC per block (checksum only)
  unsigned* done;           // blocks finished (checksum only); zeroed before the launch
  uint32_t* checksum_out;   // null: no checksum
  uint32_t* mask = nullptr; // delta: bit per word of [0, total) that changed (zeroed before the launch)
  int64_t word = 1;         // delta: the word size in bytes (1, 2, 4 or 8)
};

struct BlockShared {
  uint32_t table[256];
  uint32_t crc[kThreads];
  int64_t len[kThreads];
  int64_t first;
  int last;
};

// Tree-combines sh.crc[0..kThreads) (with byte lengths sh.len) into sh.crc[0] / sh.len[0].
#pragma nv_exec_check_disable
template <class Block>
__host__ __device__ void reduce_crcs(const Block& blk, BlockShared& sh) {
  const int tid = blk.tid();
  int level = 0;
  for (int s = 1; s < kThreads; s <<= 1, ++level) {
    if ((tid & (2 * s - 1)) == 0) {
      const int64_t len = sh.len[tid + s];
      sh.crc[tid] = len == kVec * s ? asyncsync_crc::multmodp(level_op(level), sh.crc[tid]) ^ sh.crc[tid + s]
                                    : crc_combine(sh.crc[tid], sh.crc[tid + s], len);
      sh.len[tid] += len;
    }
    blk.sync();
  }
}

// Bytes of [0, total) that block b covers.
__host__ __device__ inline int64_t block_bytes(const Params& p, int64_t b) {
  const int64_t span = p.tiles_per_block * kTile;
  return imax(0, imin(p.total, (b + 1) * span) - imin(p.total, b * span));
}

#pragma nv_exec_check_disable
template <class Block>
__host__ __device__ void pack_block(const Block& blk, BlockShared& sh, const Params& p) {
  const int tid = blk.tid();
  const bool checksum = p.checksum_out != nullptr;
  static_assert(kThreads == 256, "one table entry per thread");
  if (checksum) sh.table[tid] = tables().bytes[tid];  // published by the first sync below
  const int64_t ntiles = (p.total + kTile - 1) / kTile;
  const int64_t t0 = blk.block() * p.tiles_per_block;
  const int64_t t1 = imin(ntiles, t0 + p.tiles_per_block);
  uint32_t block_crc = 0;  // thread 0's running CRC of this block's tiles
  for (int64_t tile = t0; tile < t1; ++tile) {
    const int64_t lo = tile * kTile, hi = imin(p.total, lo + kTile);
    const int64_t mine = lo + tid * kVec;
    const int64_t n = imax(0, imin(kVec, hi - mine));  // this thread's bytes of the tile (CRC, delta)
    uint8_t old[kVec];
    if (p.mask)  // the baseline's bytes, read before any thread of the block writes the tile
      for (int64_t i = 0; i < n; ++i) old[i] = p.dst[mine + i];
    // The block's tiles are contiguous: one search for its first tile, then a linear advance.
    if (tid == 0) {
      if (tile == t0) {
        sh.first = first_ending_after(p.segs, lo);
      } else {
        while (sh.first < p.segs.count && p.segs.offsets[sh.first] + p.segs.sizes[sh.first] <= lo) ++sh.first;
      }
    }
    blk.sync();
    for (int64_t i = sh.first; i < p.segs.count && p.segs.offsets[i] < hi; ++i) {
      const int64_t off = p.segs.offsets[i];
      const int64_t a = imax(lo, off), b = imin(hi, off + p.segs.sizes[i]);
      if (a < b) copy_piece(p.dst + a, p.segs.srcs[i] + (a - off), b - a, tid);
    }
    if (checksum || p.mask) blk.sync();  // the whole tile is written
    if (p.mask && n > 0) {  // one bit per changed word; 16 / word bits never straddle a mask word
      uint32_t bits = 0;
      for (int64_t w = 0; w < n / p.word; ++w) {
        bool changed = false;
        for (int64_t i = 0; i < p.word; ++i) changed |= old[w * p.word + i] != p.dst[mine + w * p.word + i];
        bits |= static_cast<uint32_t>(changed) << w;
      }
      const int64_t first = mine / p.word;
      if (bits) blk.or_bits(&p.mask[first / 32], bits << (first % 32));
    }
    if (checksum) {
      sh.crc[tid] = n > 0 ? thread_crc(sh.table, p.dst + mine, n) : 0;
      sh.len[tid] = n;
      blk.sync();
      reduce_crcs(blk, sh);
      if (tid == 0) block_crc = crc_combine(block_crc, sh.crc[0], hi - lo);
    }
    blk.sync();  // sh.crc is reused by the next tile, which advances sh.first
  }
  if (!checksum) return;

  if (tid == 0) {
    p.partials[blk.block()] = block_crc;
    blk.fence();  // the partial is visible device-wide before the counter says so
    sh.last = blk.arrive(p.done) == static_cast<unsigned>(blk.grid() - 1);
  }
  blk.sync();
  if (!sh.last) return;
  blk.fence();
  const int64_t grid = blk.grid();
  const int64_t per = (grid + kThreads - 1) / kThreads;
  uint32_t crc = 0;
  int64_t len = 0;
  for (int64_t b = tid * per; b < imin(grid, (tid + 1) * per); ++b) {
    const int64_t bytes = block_bytes(p, b);
    crc = crc_combine(crc, blk.load_partial(&p.partials[b]), bytes);
    len += bytes;
  }
  sh.crc[tid] = crc;
  sh.len[tid] = len;
  blk.sync();
  reduce_crcs(blk, sh);
  // Standard CRC32C: initial register 0xFFFFFFFF carried over all bytes, final inversion.
  if (tid == 0) *p.checksum_out = ~crc_combine(0xFFFFFFFFu, sh.crc[0], p.total);
}

struct DeviceBlock {
  __device__ int tid() const { return static_cast<int>(threadIdx.x); }
  __device__ int64_t block() const { return blockIdx.x; }
  __device__ int64_t grid() const { return gridDim.x; }
  __device__ void sync() const { __syncthreads(); }
  __device__ void fence() const { __threadfence(); }
  __device__ unsigned arrive(unsigned* counter) const { return atomicAdd(counter, 1u); }
  __device__ uint32_t load_partial(const uint32_t* p) const { return __ldcg(p); }  // L2, not a stale L1
  __device__ void or_bits(uint32_t* p, uint32_t bits) const { atomicOr(p, bits); }
};

__global__ void __launch_bounds__(kThreads) pack_kernel(Params p) {
  __shared__ BlockShared sh;
  pack_block(DeviceBlock{}, sh, p);
}

// Grid shape: enough blocks to fill the device, each over a contiguous run of tiles.
inline void launch_shape(int64_t total, int64_t max_blocks, int64_t* grid, int64_t* tiles_per_block) {
  const int64_t ntiles = imax(1, (total + kTile - 1) / kTile);
  const int64_t blocks = imax(1, imin(ntiles, imin(max_blocks, kMaxBlocks)));
  *tiles_per_block = (ntiles + blocks - 1) / blocks;
  *grid = imax(1, (ntiles + *tiles_per_block - 1) / *tiles_per_block);
}

namespace d = asyncsync_delta;

// Words of bucket block ``b``.
__host__ __device__ inline int64_t block_width(int64_t nwords, int64_t b) {
  return imin(d::kBlockWords, nwords - b * d::kBlockWords);
}

// One thread per block of the delta format: its mode and sizes (d::plan_block).
__host__ __device__ inline void plan_one(const uint32_t* mask, int64_t nwords, int64_t word, d::BlockPlan* plans,
                                         int64_t b) {
  plans[b] = d::plan_block(mask + b * d::kMaskWords, block_width(nwords, b), word);
}

// One thread per block: its entry count and mode in the table, its gaps or bitmask and values at
// the offsets the host laid out (offsets[2b], offsets[2b + 1]); block 0 also writes the header.
__host__ __device__ inline void write_one(const uint32_t* mask, const d::BlockPlan* plans, const int64_t* offsets,
                                          const uint8_t* base, int64_t nwords, int64_t word, int64_t nblocks,
                                          uint8_t* out, int64_t b) {
  if (b == 0) d::write_header(out, word, nwords, nblocks);
  d::store_u32(out + d::kHeaderBytes + 4 * b, plans[b].entries);
  out[d::align8(d::kHeaderBytes + 4 * nblocks) + b] = plans[b].mode;
  d::write_block(plans[b], mask + b * d::kMaskWords, block_width(nwords, b), word, base + b * d::kBlockWords * word,
                 out + offsets[2 * b], out + offsets[2 * b + 1]);
}

__global__ void delta_plan_kernel(const uint32_t* mask, int64_t nwords, int64_t word, d::BlockPlan* plans,
                                  int64_t nblocks) {
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < nblocks; b += int64_t(gridDim.x) * blockDim.x)
    plan_one(mask, nwords, word, plans, b);
}

__global__ void delta_write_kernel(const uint32_t* mask, const d::BlockPlan* plans, const int64_t* offsets,
                                   const uint8_t* base, int64_t nwords, int64_t word, int64_t nblocks, uint8_t* out) {
  for (int64_t b = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; b < nblocks; b += int64_t(gridDim.x) * blockDim.x)
    write_one(mask, plans, offsets, base, nwords, word, nblocks, out, b);
}

// The delta's size from every block's plan, and each block's absolute index and value offsets.
inline int64_t delta_layout(const d::BlockPlan* plans, int64_t nblocks, int64_t* offsets) {
  int64_t index_bytes[d::kModes] = {}, value_bytes[d::kModes] = {};
  for (int64_t b = 0; b < nblocks; ++b) {
    index_bytes[plans[b].mode] += plans[b].index_bytes;
    value_bytes[plans[b].mode] += plans[b].value_bytes;
  }
  const d::Sections s = d::layout(nblocks, index_bytes, value_bytes);
  int64_t index_at[d::kModes], value_at[d::kModes];
  for (int k = 0; k < d::kModes; ++k) index_at[k] = s.index[k], value_at[k] = s.value[k];
  for (int64_t b = 0; b < nblocks; ++b) {
    offsets[2 * b] = index_at[plans[b].mode];
    offsets[2 * b + 1] = value_at[plans[b].mode];
    index_at[plans[b].mode] += plans[b].index_bytes;
    value_at[plans[b].mode] += plans[b].value_bytes;
  }
  return s.total;
}

constexpr int kDeltaThreads = 128;

}  // namespace asyncsync_cuda

extern "C" int64_t asyncsync_pack_cuda_workspace_bytes(int64_t total_bytes) {
  using namespace asyncsync_cuda;
  int64_t grid = 1, tpb = 1;
  launch_shape(imax(total_bytes, 0), kMaxBlocks, &grid, &tpb);
  return kWorkspaceHeader + grid * static_cast<int64_t>(sizeof(uint32_t));
}

// srcs/sizes/dst_offsets are device arrays of ``count`` entries sorted by dst offset with disjoint
// ranges; total_bytes is the end of the last range (bytes up to it are checksummed); checksum_out
// (device, may be null) receives the CRC32C; workspace (device, at least
// asyncsync_pack_cuda_workspace_bytes(total_bytes)) is needed only with a checksum. Everything is
// enqueued on ``stream``; nothing blocks the host.
extern "C" int asyncsync_pack_cuda(const uint8_t* const* srcs, const int64_t* sizes, const int64_t* dst_offsets,
                                   int64_t count, uint8_t* dst, int64_t total_bytes, cudaStream_t stream,
                                   uint32_t* checksum_out, void* workspace) {
  using namespace asyncsync_cuda;
  if (count < 0 || total_bytes < 0 || (count > 0 && (!srcs || !sizes || !dst_offsets)) ||
      (total_bytes > 0 && !dst) || (checksum_out && !workspace))
    return cudaErrorInvalidValue;
  if (total_bytes == 0)  // nothing to copy; the CRC32C of no bytes is 0
    return checksum_out ? cudaMemsetAsync(checksum_out, 0, sizeof(uint32_t), stream) : cudaSuccess;
  int device = 0, sms = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  int64_t grid = 1, tpb = 1;
  launch_shape(total_bytes, static_cast<int64_t>(sms) * kBlocksPerSm, &grid, &tpb);
  Params p{{srcs, sizes, dst_offsets, count}, dst, total_bytes, tpb, nullptr, nullptr, checksum_out};
  if (checksum_out) {
    p.done = static_cast<unsigned*>(workspace);
    p.partials = reinterpret_cast<uint32_t*>(static_cast<char*>(workspace) + kWorkspaceHeader);
    err = cudaMemsetAsync(p.done, 0, sizeof(unsigned), stream);
    if (err != cudaSuccess) return err;
  }
  pack_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

// The pack above into ``base`` (holding the previous version), with the changed words' bits in
// ``mask`` (ceil(total / word / 32) uint32, on the device) and every block's plan in ``plans``
// (asyncsync_delta_plan_bytes() each); both kernels on ``stream``, nothing blocks the host.
extern "C" int asyncsync_pack_delta_cuda(const uint8_t* const* srcs, const int64_t* sizes, const int64_t* dst_offsets,
                                         int64_t count, uint8_t* base, int64_t total_bytes, cudaStream_t stream,
                                         uint32_t* checksum_out, void* workspace, uint32_t* mask, int64_t word,
                                         void* plans) {
  using namespace asyncsync_cuda;
  if (!(word == 1 || word == 2 || word == 4 || word == 8) || total_bytes % word || !mask || !plans || !checksum_out ||
      !workspace || count < 0 || total_bytes <= 0 || !base || (count > 0 && (!srcs || !sizes || !dst_offsets)))
    return cudaErrorInvalidValue;
  const int64_t nwords = total_bytes / word, nblocks = (nwords + d::kBlockWords - 1) / d::kBlockWords;
  cudaError_t err = cudaMemsetAsync(mask, 0, static_cast<size_t>((nwords + 31) / 32) * sizeof(uint32_t), stream);
  int device = 0, sms = 0;
  if (err == cudaSuccess) err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaMemsetAsync(workspace, 0, sizeof(unsigned), stream);
  if (err != cudaSuccess) return err;
  int64_t grid = 1, tpb = 1;
  launch_shape(total_bytes, static_cast<int64_t>(sms) * kBlocksPerSm, &grid, &tpb);
  Params p{{srcs, sizes, dst_offsets, count}, base, total_bytes, tpb,
           reinterpret_cast<uint32_t*>(static_cast<char*>(workspace) + kWorkspaceHeader),
           static_cast<unsigned*>(workspace), checksum_out, mask, word};
  pack_kernel<<<static_cast<unsigned>(grid), kThreads, 0, stream>>>(p);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  const auto plan_grid = static_cast<unsigned>((nblocks + kDeltaThreads - 1) / kDeltaThreads);
  delta_plan_kernel<<<plan_grid, kDeltaThreads, 0, stream>>>(mask, nwords, word, static_cast<d::BlockPlan*>(plans),
                                                             nblocks);
  return cudaGetLastError();
}

extern "C" int64_t asyncsync_delta_plan_bytes() { return sizeof(asyncsync_delta::BlockPlan); }

// Host: from the plans (copied to the host), each block's two offsets into the delta
// (``offsets_out``: 2 x nblocks int64) and the delta's total size.
extern "C" int64_t asyncsync_delta_layout(const void* plans_host, int64_t nblocks, int64_t* offsets_out) {
  return asyncsync_cuda::delta_layout(static_cast<const asyncsync_delta::BlockPlan*>(plans_host), nblocks, offsets_out);
}

// Writes the delta into ``out`` (zeroed, of asyncsync_delta_layout's size) from the mask, the plans,
// the offsets (on the device) and the packed bytes in ``base``; on ``stream``.
extern "C" int asyncsync_delta_write_cuda(const uint32_t* mask, const void* plans, const int64_t* offsets,
                                          const uint8_t* base, int64_t nwords, int64_t word, uint8_t* out,
                                          cudaStream_t stream) {
  using namespace asyncsync_cuda;
  if (!mask || !plans || !offsets || !base || !out || nwords <= 0) return cudaErrorInvalidValue;
  const int64_t nblocks = (nwords + d::kBlockWords - 1) / d::kBlockWords;
  const auto grid = static_cast<unsigned>((nblocks + kDeltaThreads - 1) / kDeltaThreads);
  delta_write_kernel<<<grid, kDeltaThreads, 0, stream>>>(mask, static_cast<const d::BlockPlan*>(plans), offsets, base,
                                                         nwords, word, nblocks, out);
  return cudaGetLastError();
}

extern "C" const char* asyncsync_cuda_error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

#ifdef ASYNCSYNC_PACK_CUDA_SELFTEST
// Host emulation: each block's 256 threads run pack_block as std::threads meeting at a barrier,
// blocks one after another. Checks bytes (ranges copied, gaps and the tail untouched) and the
// checksum against a bitwise CRC32C over random layouts, alignments and grid sizes.
#include <atomic>
#include <barrier>
#include <cstdio>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

namespace {
using namespace asyncsync_cuda;

struct HostBlock {
  int t;
  int64_t b, g;
  std::barrier<>* bar;
  int tid() const { return t; }
  int64_t block() const { return b; }
  int64_t grid() const { return g; }
  void sync() const { bar->arrive_and_wait(); }
  void fence() const { std::atomic_thread_fence(std::memory_order_seq_cst); }
  unsigned arrive(unsigned* c) const { return __atomic_fetch_add(c, 1u, __ATOMIC_SEQ_CST); }
  uint32_t load_partial(const uint32_t* p) const { return __atomic_load_n(p, __ATOMIC_SEQ_CST); }
  void or_bits(uint32_t* p, uint32_t bits) const { __atomic_fetch_or(p, bits, __ATOMIC_SEQ_CST); }
};

uint32_t bitwise_crc32c(const uint8_t* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ asyncsync_crc::kPoly : c >> 1;
  }
  return ~c;
}

void emulate(const Params& p, int64_t grid) {
  BlockShared sh{};
  std::barrier<> bar(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int64_t b = 0; b < grid; ++b) {
        pack_block(HostBlock{t, b, grid, &bar}, sh, p);
        bar.arrive_and_wait();  // the next block reuses the shared state
      }
    });
  for (auto& th : threads) th.join();
}

bool run_case(std::mt19937_64& rng, int index) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  // Every fourth case packs thousands of 0-3 byte tensors, so ranges start and end at every
  // position around tile boundaries; the others mix empty, small, medium and multi-tile tensors.
  const bool tiny = index % 4 == 0;
  const int64_t count = tiny ? pick(1000, 6000) : pick(0, 24);
  std::vector<std::vector<uint8_t>> storage;
  std::vector<const uint8_t*> srcs;
  std::vector<int64_t> sizes, offsets;
  int64_t end = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int kind = static_cast<int>(pick(0, 3));
    const int64_t size = tiny ? pick(0, 3)
                         : kind == 0 ? 0 : kind == 1 ? pick(1, 40) : kind == 2 ? pick(41, 3000) : pick(3000, 20000);
    const int64_t align = pick(0, 15);
    storage.emplace_back(static_cast<size_t>(size + align + 16));
    for (auto& byte : storage.back()) byte = static_cast<uint8_t>(rng());
    const int64_t offset = end + (pick(0, 3) == 0 ? pick(1, 50) : 0);
    srcs.push_back(storage.back().data() + align);
    sizes.push_back(size);
    offsets.push_back(offset);
    end = offset + size;
  }
  std::vector<uint8_t> dst(static_cast<size_t>(end + 64));
  for (auto& byte : dst) byte = static_cast<uint8_t>(rng());
  std::vector<uint8_t> expected = dst;
  for (int64_t i = 0; i < count; ++i)
    if (sizes[i]) std::memcpy(expected.data() + offsets[i], srcs[i], static_cast<size_t>(sizes[i]));

  const int64_t max_blocks = pick(1, 6);
  int64_t grid = 1, tpb = 1;
  launch_shape(end, max_blocks, &grid, &tpb);
  std::vector<uint32_t> partials(static_cast<size_t>(grid));
  unsigned done = 0;
  uint32_t crc = 0xDEADBEEFu;
  const bool checksum = pick(0, 4) != 0;
  Params p{{srcs.data(), sizes.data(), offsets.data(), count}, dst.data(), end, tpb,
           partials.data(), &done, checksum ? &crc : nullptr};
  if (end > 0) emulate(p, grid);
  else crc = 0;
  const bool bytes_ok = dst == expected;
  const bool crc_ok = !checksum || crc == bitwise_crc32c(expected.data(), static_cast<size_t>(end));
  if (!bytes_ok || !crc_ok)
    std::fprintf(stderr, "case %d failed: %lld tensors, %lld bytes, grid %lld, bytes %s, crc %s\n", index,
                 static_cast<long long>(count), static_cast<long long>(end), static_cast<long long>(grid),
                 bytes_ok ? "ok" : "WRONG", crc_ok ? "ok" : "WRONG");
  return bytes_ok && crc_ok;
}

// The delta format written from its specification (asyncsync/protocol/delta.py), sharing nothing
// with delta.h: what the kernels' output must equal byte for byte.
std::vector<uint8_t> reference_delta(const std::vector<uint8_t>& old, const std::vector<uint8_t>& now, int64_t word) {
  const int64_t nwords = static_cast<int64_t>(now.size()) / word, B = 65536;
  const int64_t nblocks = (nwords + B - 1) / B;
  std::vector<uint32_t> entries;
  std::vector<uint8_t> modes, index[4], values[4];
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t lo = b * B, bw = std::min(B, nwords - lo);
    std::vector<int64_t> changed;
    for (int64_t j = 0; j < bw; ++j)
      if (std::memcmp(&old[(lo + j) * word], &now[(lo + j) * word], word)) changed.push_back(j);
    const int64_t c = static_cast<int64_t>(changed.size());
    int64_t fillers = 0, prev = -1;
    for (int64_t pos : changed) fillers += (pos - prev - 1) / 256, prev = pos;
    const int64_t cost[4] = {(c + fillers) * (1 + word), c * (2 + word), (bw + 7) / 8 + c * word, bw * word};
    int mode = 0;
    for (int k = 1; k < 4; ++k) mode = cost[k] < cost[mode] ? k : mode;
    const auto value = [&](int64_t j) { for (int64_t i = 0; i < word; ++i) values[mode].push_back(now[(lo + j) * word + i]); };
    if (c == 0) mode = 0;
    modes.push_back(static_cast<uint8_t>(mode));
    if (c == 0) {
      entries.push_back(0);
    } else if (mode == 0) {
      int64_t k = 0;
      prev = -1;
      for (int64_t pos : changed) {
        for (; pos - prev > 256; ++k) prev += 256, index[0].push_back(255), value(prev);
        index[0].push_back(static_cast<uint8_t>(pos - prev - 1));
        value(pos);
        prev = pos, ++k;
      }
      entries.push_back(static_cast<uint32_t>(k));
    } else if (mode == 1) {
      prev = -1;
      for (int64_t pos : changed) {
        const int64_t gap = pos - prev - 1;
        index[1].push_back(static_cast<uint8_t>(gap)), index[1].push_back(static_cast<uint8_t>(gap >> 8));
        value(pos);
        prev = pos;
      }
      entries.push_back(static_cast<uint32_t>(c));
    } else if (mode == 2) {
      std::vector<uint8_t> bits(static_cast<size_t>((bw + 7) / 8), 0);
      for (int64_t pos : changed) bits[pos / 8] |= static_cast<uint8_t>(1u << (pos % 8)), value(pos);
      index[2].insert(index[2].end(), bits.begin(), bits.end());
      entries.push_back(static_cast<uint32_t>(c));
    } else {
      for (int64_t j = 0; j < bw; ++j) value(j);
      entries.push_back(static_cast<uint32_t>(bw));
    }
  }
  std::vector<uint8_t> out;
  const auto put = [&](uint64_t v, int bytes) { for (int i = 0; i < bytes; ++i) out.push_back(static_cast<uint8_t>(v >> (8 * i))); };
  const auto pad = [&] { while (out.size() % 8) out.push_back(0); };
  put(0x31445341u, 4), put(static_cast<uint64_t>(word), 4), put(static_cast<uint64_t>(nwords), 8);
  put(static_cast<uint64_t>(nblocks), 4), put(static_cast<uint64_t>(B), 4);
  for (uint32_t e : entries) put(e, 4);
  pad();
  out.insert(out.end(), modes.begin(), modes.end());
  pad();
  for (int k = 0; k < 4; ++k) {
    out.insert(out.end(), index[k].begin(), index[k].end());
    pad();
    out.insert(out.end(), values[k].begin(), values[k].end());
    pad();
  }
  return out;
}

// The delta path as the GPU runs it: the pack kernel with the change mask (emulated blocks), the
// plan kernel's and the write kernel's threads (serially), the host layout in between.
bool run_delta_case(std::mt19937_64& rng, int index) {
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(rng); };
  const int64_t words[] = {1, 2, 4, 8};
  const int64_t word = words[pick(0, 3)];
  const int64_t total = (index % 3 == 0 ? pick(2 * 65536, 3 * 65536 + 999) : pick(1, 70000)) / word * word + word;
  const double densities[] = {0.0, 0.0005, 0.02, 0.3, 1.0};
  const double density = densities[index % 5];
  std::vector<uint8_t> old(static_cast<size_t>(total)), now;
  for (auto& byte : old) byte = static_cast<uint8_t>(rng());
  now = old;
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  for (int64_t j = 0; j < total / word; ++j)
    if (coin(rng) < density) now[j * word + pick(0, word - 1)] ^= static_cast<uint8_t>(pick(1, 255));
  // The new version's tensors: consecutive slices of it, with gaps between some (a gap keeps the
  // old bytes, so the new version has them there too).
  std::vector<const uint8_t*> srcs;
  std::vector<int64_t> sizes, offsets;
  for (int64_t at = 0; at < total;) {
    const int64_t size = std::min(total - at, pick(1, 40000) / word * word + word);
    if (pick(0, 5))
      srcs.push_back(now.data() + at), sizes.push_back(size), offsets.push_back(at);
    else
      std::memcpy(now.data() + at, old.data() + at, static_cast<size_t>(size));
    at += size;
  }
  std::vector<uint8_t> base = old;
  const int64_t nwords = total / word, nblocks = (nwords + 65535) / 65536;
  std::vector<uint32_t> mask(static_cast<size_t>((nwords + 31) / 32), 0);
  int64_t grid = 1, tpb = 1;
  launch_shape(total, pick(1, 6), &grid, &tpb);
  std::vector<uint32_t> partials(static_cast<size_t>(grid));
  unsigned done = 0;
  uint32_t crc = 0;
  Params p{{srcs.data(), sizes.data(), offsets.data(), static_cast<int64_t>(srcs.size())}, base.data(), total, tpb,
           partials.data(), &done, &crc, mask.data(), word};
  emulate(p, grid);
  std::vector<d::BlockPlan> plans(static_cast<size_t>(nblocks));
  for (int64_t b = 0; b < nblocks; ++b) plan_one(mask.data(), nwords, word, plans.data(), b);
  std::vector<int64_t> at(static_cast<size_t>(2 * nblocks));
  std::vector<uint8_t> delta(static_cast<size_t>(delta_layout(plans.data(), nblocks, at.data())), 0);
  for (int64_t b = 0; b < nblocks; ++b) write_one(mask.data(), plans.data(), at.data(), base.data(), nwords, word, nblocks, delta.data(), b);
  const bool bytes_ok = base == now && crc == bitwise_crc32c(now.data(), now.size());
  const bool delta_ok = delta == reference_delta(old, now, word);
  if (!bytes_ok || !delta_ok)
    std::fprintf(stderr, "delta case %d failed: %lld bytes of %lld-byte words, density %.4f: packed %s, delta %s\n", index,
                 static_cast<long long>(total), static_cast<long long>(word), density, bytes_ok ? "ok" : "WRONG",
                 delta_ok ? "ok" : "WRONG");
  return bytes_ok && delta_ok;
}
}  // namespace

int main() {
  const uint8_t check[] = "123456789";
  if (bitwise_crc32c(check, 9) != 0xE3069283u) {
    std::fprintf(stderr, "reference CRC32C is wrong\n");
    return 1;
  }
  std::mt19937_64 rng(20240611);
  int failed = 0;
  constexpr int kCases = 120;
  for (int i = 0; i < kCases; ++i) failed += run_case(rng, i) ? 0 : 1;
  std::printf("pack_cuda host emulation: %d/%d cases passed\n", kCases - failed, kCases);
  int delta_failed = 0;
  constexpr int kDeltaCases = 20;
  for (int i = 0; i < kDeltaCases; ++i) delta_failed += run_delta_case(rng, i) ? 0 : 1;
  std::printf("pack_delta_cuda host emulation: %d/%d cases passed\n", kDeltaCases - delta_failed, kDeltaCases);
  return failed || delta_failed ? 1 : 0;
}
#endif  // ASYNCSYNC_PACK_CUDA_SELFTEST
