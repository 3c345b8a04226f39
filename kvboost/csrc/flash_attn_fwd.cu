// kvboost FlashAttention-2 forward kernel (fp16 / bf16 inputs, fp32 accumulation, tensor cores).
//
// Algorithm (FlashAttention-2, Dao 2023): one thread block owns kBlockM = 64 query rows of one
// (batch, query head); it streams the valid keys of that row in tiles of kBlockN = 64 through shared
// memory and keeps a running (online) softmax, so the Lq x Lk score matrix never exists in memory.
//
// Work split inside a block: 4 warps (128 threads); warp w owns query rows [16 w, 16 w + 16) of the
// block and computes, per key tile, S = Q K^T (16 x 64) and O += P V (16 x D) with the Ampere tensor
// core instruction mma.sync.m16n8k16 (fp32 accumulators, fp16/bf16 operands).  The S accumulators are
// re-packed in registers into the A operand of the P V product (no shared-memory round trip for P).
//
// Shared memory (static, no opt-in needed): one K tile and one V tile of 64 x D elements, each row padded
// by 8 elements so that the fragment loads are free of bank conflicts:
//     D = 64 : 2 * 64 * 72  * 2 B = 18 KiB          D = 128 : 2 * 64 * 136 * 2 B = 34 KiB
// The Q tile is staged once through the V buffer (then held in registers for the whole key loop) and the
// output tile is staged through the K buffer so that global stores are coalesced 16-byte writes.
//
// Pipelining (single-buffered, as in FlashAttention-2): the copy of V(t) runs while S(t) = Q K(t)^T and
// the softmax are computed, and the copy of K(t+1) runs while O += P V(t) is computed (cp.async).  When
// rows are not 16-byte aligned (odd strides) a synchronous element-wise copy path is used instead.
//
// Masking: the key loop starts at kv_start[b] and stops at min(kv_len[b], last causal key of the block),
// so fully masked tiles are never loaded (causal early exit); only tiles that straddle a boundary pay for
// the element-wise mask.  Causal alignment is bottom-right: query i sits at key index Lk - Lq + i.
// A query row without any valid key produces zeros (row sum 0 -> output 0, never NaN).
//
// Split-K path (flash-decoding; kSplit = true), for decode and short suffixes over long caches: the one-pass
// grid has cdiv(Lq, 64) * Hq * B blocks, so a decode step or a 100-token suffix over 16k cached keys occupies a
// few dozen of an H100's 132 SMs, and a single query row fills 1/64 of its block's tensor-core tile.  The
// split kernel (a) packs a GQA group into one block: its 64 rows are (query, head-in-group) pairs of one kv
// head, query-major (row r = query r / G of head hkv * G + r % G), so each K/V tile is loaded once per group
// and a decode step with G = 4 fills 4 rows instead of 1; and (b) splits the keys into num_splits ranges of
// split_len keys, one block each: grid (row blocks * num_splits, Hkv, B).  Each block writes its rows'
// unnormalised partial output and (running max, row sum) in fp32; flash_attn_combine_kernel merges the splits
// with the log-sum-exp rescaling.  With one split the block normalises and writes the output itself.  The
// key loop, masking and softmax are the one-pass code: only the row -> (query, head) map, the key range and
// the epilogue differ.  plan_split chooses the path (see there).
//
// This file has no torch dependency; the torch binding lives in flash_attn_binding.cpp.
// Defining KVBOOST_FA_EMULATION compiles only the kernel body, against primitives supplied by the includer
// (used to run the kernel logic on a CPU, thread by thread, for testing without a GPU).

#include "flash_attn_fwd.h"

#include <cstddef>
#include <cstdint>
#include <cstring>

#if !defined(KVBOOST_FA_EMULATION)
#include <cmath>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define KVBOOST_FA_DEVICE __device__ __forceinline__
#endif

namespace kvboost_fa {

constexpr int kBlockM = 64;   // query rows per block
constexpr int kBlockN = 64;   // keys per tile
constexpr int kWarps = 4;     // each warp owns 16 query rows
constexpr int kThreads = kWarps * 32;
constexpr int kPad = 8;       // shared-memory row padding (elements): conflict-free fragment loads
static_assert(kBlockM == kWarps * 16, "one warp per 16 query rows");
static_assert(kBlockM == kBlockN, "the Q tile is staged through the V tile buffer");

// Split-K planning (host side, plan_split).
constexpr int kDecodeMaxQ = 4;            // up to this many queries per row: always split-K (GQA packing)
constexpr int kSplitMinKeys = 2048;       // longer prefills split only over at least this many keys
constexpr int kMinSplitLenDecode = 256;   // keys per split, at least (decode rows are cheap per key) ...
constexpr int kMinSplitLenPrefill = 512;  // ... (a prefill row block writes 64 x D partials per split)
constexpr int kTargetWaves = 2;           // blocks aimed for, in waves over the SMs
constexpr int kMaxSplits = 64;
constexpr size_t kMaxWorkspaceBytes = size_t(256) << 20;

struct Params {
  const void* q;
  const void* k;
  const void* v;
  void* o;
  const int32_t* kv_start;  // nullable, int32[B]
  const int32_t* kv_len;    // nullable, int32[B]
  int64_t q_sb, q_sh, q_ss;
  int64_t k_sb, k_sh, k_ss;
  int64_t v_sb, v_sh, v_ss;
  int64_t o_sb, o_sh, o_ss;
  int batch;
  int heads_q;
  int len_q;
  int len_k;
  int group;         // heads_q / heads_kv
  float scale_log2;  // sm_scale * log2(e): softmax is evaluated with exp2
  int causal;
  int vec;           // 1: every row start is 16-byte aligned -> cp.async 16-byte copies
  // split-K path only
  int num_splits;    // key splits; blockIdx.x = row block * num_splits + split
  int split_len;     // keys per split (a multiple of kBlockN)
  float* part_acc;   // [B * Hq * Lq, num_splits, D] unnormalised partial outputs; nullptr: one split, the
                     // block writes the normalised output itself
  float* part_ml;    // [B * Hq * Lq, num_splits, 2]: running max (log2 domain) and row sum of each partial
};

KVBOOST_FA_DEVICE int imin(int a, int b) { return a < b ? a : b; }
KVBOOST_FA_DEVICE int imax(int a, int b) { return a > b ? a : b; }
#if !defined(KVBOOST_FA_EMULATION)
// ----------------------------------------------------------------------------------------------------
// Device primitives (sm_80+).  Kept in one place so that the kernel body reads as plain index math.

template <typename T>
struct MmaOp;

template <>
struct MmaOp<__half> {
  // D (16x8, f32) += A (16x16, row) * B (16x8, col)
  static KVBOOST_FA_DEVICE void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // two floats -> one 32-bit register holding (lo, hi) as 16-bit values, lo in the low half
  static KVBOOST_FA_DEVICE uint32_t pack(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &h, sizeof(u));
    return u;
  }
};

template <>
struct MmaOp<__nv_bfloat16> {
  static KVBOOST_FA_DEVICE void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  static KVBOOST_FA_DEVICE uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    uint32_t u;
    memcpy(&u, &h, sizeof(u));
    return u;
  }
};

KVBOOST_FA_DEVICE uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy; when !valid the destination is zero-filled and nothing is read.
KVBOOST_FA_DEVICE void cp_async_16(void* dst_smem, const void* src_gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst_smem)),
               "l"(src_gmem), "r"(src_bytes)
               : "memory");
}
KVBOOST_FA_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
KVBOOST_FA_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

// Four transposed 8x8 b16 matrices: lanes 8i..8i+7 give the row addresses of matrix i; lane l receives in
// r[i] the elements (row 2 (l % 4), col l / 4) and (row 2 (l % 4) + 1, col l / 4) of matrix i, i.e. the
// B-operand fragment of mma.m16n8k16 when the rows are keys and the columns head dims of V.
KVBOOST_FA_DEVICE void ldsm_x4_trans(uint32_t (&r)[4], const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr))
               : "memory");
}

KVBOOST_FA_DEVICE float shfl_xor(float x, int mask) { return __shfl_xor_sync(0xffffffffu, x, mask); }
KVBOOST_FA_DEVICE void block_sync() { __syncthreads(); }
KVBOOST_FA_DEVICE void copy16(void* dst, const void* src) {
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
}
KVBOOST_FA_DEVICE float fast_exp2(float x) { return exp2f(x); }
#define KVBOOST_FA_KERNEL __global__ void __launch_bounds__(kvboost_fa::kThreads)
#define KVBOOST_FA_SHARED(decl) __shared__ __align__(16) decl
#endif  // !KVBOOST_FA_EMULATION

KVBOOST_FA_DEVICE uint32_t lds32(const uint16_t* p) { return *reinterpret_cast<const uint32_t*>(p); }
KVBOOST_FA_DEVICE void sts32(uint16_t* p, uint32_t x) { *reinterpret_cast<uint32_t*>(p) = x; }

// Copy kBlockN rows of a [rows, D] operand into shared memory (row stride D + kPad): row r < n_rows starts at
// row_ptr(r) (columns contiguous); rows r >= n_rows are zero-filled and never read (`any_row` is a valid
// address used as the dummy source of the zero-fill).  Asynchronous when vec (the caller commits and waits),
// synchronous otherwise.
template <int D, typename RowPtr>
KVBOOST_FA_DEVICE void load_rows(uint16_t* smem, const RowPtr& row_ptr, int n_rows, const uint16_t* any_row,
                                 bool vec, int tid) {
  constexpr int kLd = D + kPad;
  if (vec) {
    constexpr int kChunksPerRow = D / 8;  // 16-byte chunks
    constexpr int kIters = kBlockN * kChunksPerRow / kThreads;
    static_assert(kBlockN * kChunksPerRow % kThreads == 0, "tile copy must divide evenly");
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int c = tid + it * kThreads;
      const int r = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * 8;
      const bool valid = r < n_rows;
      const uint16_t* src = valid ? row_ptr(r) + col : any_row;
      cp_async_16(smem + r * kLd + col, src, valid);
    }
  } else {
    for (int e = tid; e < kBlockN * D; e += kThreads) {
      const int r = e / D;
      const int col = e % D;
      smem[r * kLd + col] = r < n_rows ? row_ptr(r)[col] : uint16_t(0);
    }
  }
}

// Rows [row0, row0 + kBlockN) of a [rows, D] slice with row stride `stride` (elements); rows >= row_end are
// zero-filled.
template <int D>
KVBOOST_FA_DEVICE void load_tile(uint16_t* smem, const uint16_t* gmem, int64_t stride, int row0, int row_end,
                                 bool vec, int tid) {
  load_rows<D>(smem, [=](int r) { return gmem + static_cast<int64_t>(row0 + r) * stride; }, row_end - row0, gmem,
               vec, tid);
}

// Inverse of load_rows for the output: shared-memory rows r < min(kBlockM, n_rows) -> row_ptr(r).
template <int D, typename RowPtr>
KVBOOST_FA_DEVICE void store_rows(const RowPtr& row_ptr, int n_rows, const uint16_t* smem, bool vec, int tid) {
  constexpr int kLd = D + kPad;
  if (vec) {
    constexpr int kChunksPerRow = D / 8;
    constexpr int kIters = kBlockM * kChunksPerRow / kThreads;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int c = tid + it * kThreads;
      const int r = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * 8;
      if (r < n_rows) copy16(row_ptr(r) + col, smem + r * kLd + col);
    }
  } else {
    for (int e = tid; e < kBlockM * D; e += kThreads) {
      const int r = e / D;
      const int col = e % D;
      if (r < n_rows) row_ptr(r)[col] = smem[r * kLd + col];
    }
  }
}

// kSplit = false: the one-pass kernel, grid (cdiv(Lq, 64), Hq, B).
// kSplit = true:  the split-K kernel, grid (cdiv(G * Lq, 64) * num_splits, Hkv, B) (see the file comment).
template <typename T, int D, bool kSplit>
KVBOOST_FA_KERNEL flash_attn_fwd_kernel(const Params p) {
  static_assert(D == 64 || D == 128, "head dim must be 64 or 128");
  constexpr int kLd = D + kPad;
  constexpr int kKStepsQK = D / 16;      // k-steps of S = Q K^T
  constexpr int kNTilesS = kBlockN / 8;  // n8 tiles of S
  constexpr int kKStepsPV = kBlockN / 16;
  constexpr int kNTilesO = D / 8;        // n8 tiles of O
  static_assert(kNTilesO % 2 == 0, "ldmatrix.x4 covers two n8 tiles of O");

  KVBOOST_FA_SHARED(uint16_t sK[kBlockN * kLd]);  // K tile; output staging at the end
  KVBOOST_FA_SHARED(uint16_t sV[kBlockN * kLd]);  // V tile; Q staging at the start

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int g = lane >> 2;   // "groupID" of the mma fragment layouts: row within an 8-row group
  const int tq = lane & 3;   // "threadID_in_group": pair of columns

  // Block coordinates.  One-pass: heaviest (causal) query blocks first, so the tail of the grid is made of
  // cheap blocks.  Split-K: row block and key split of one kv head.
  int m_block, split = 0, hq = 0, hkv;
  if constexpr (kSplit) {
    split = static_cast<int>(blockIdx.x) % p.num_splits;
    m_block = static_cast<int>(blockIdx.x) / p.num_splits;
    hkv = blockIdx.y;
  } else {
    m_block = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);
    hq = blockIdx.y;
    hkv = hq / p.group;
  }
  const int b = blockIdx.z;
  const int m0 = m_block * kBlockM;
  const int rows_here = imin(kBlockM, (kSplit ? p.group * p.len_q : p.len_q) - m0);  // valid rows (> 0)

  // Block row r -> (query, q head).  Split-K rows are query-major, so a block covers consecutive queries.
  auto query_of = [&](int r) { return kSplit ? (m0 + r) / p.group : m0 + r; };
  auto head_of = [&](int r) { return kSplit ? hkv * p.group + (m0 + r) % p.group : hq; };

  const uint16_t* qb = static_cast<const uint16_t*>(p.q) + b * p.q_sb;
  const uint16_t* kg = static_cast<const uint16_t*>(p.k) + b * p.k_sb + hkv * p.k_sh;
  const uint16_t* vg = static_cast<const uint16_t*>(p.v) + b * p.v_sb + hkv * p.v_sh;
  uint16_t* ob = static_cast<uint16_t*>(p.o) + b * p.o_sb;
  auto q_row = [&](int r) { return qb + head_of(r) * p.q_sh + query_of(r) * p.q_ss; };
  auto o_row = [&](int r) { return ob + head_of(r) * p.o_sh + query_of(r) * p.o_ss; };
  // Split-K partials: row (b, h, query) of the [B * Hq * Lq, num_splits] layout the combine kernel reads.
  auto part_row = [&](int r) {
    return ((static_cast<int64_t>(b) * p.heads_q + head_of(r)) * p.len_q + query_of(r)) * p.num_splits + split;
  };
  const bool vec = p.vec != 0;
  const bool causal = p.causal != 0;

  // Key range of this block: [kv_lo, kv_hi).
  int kv_lo = 0;
  int kv_hi = p.len_k;
  if (p.kv_start != nullptr) kv_lo = imin(imax(p.kv_start[b], 0), p.len_k);
  if (p.kv_len != nullptr) kv_hi = imin(imax(p.kv_len[b], 0), p.len_k);
  const int causal_off = p.len_k - p.len_q;  // query i attends keys j <= causal_off + i
  const int first_q = query_of(0);
  if (causal) kv_hi = imin(kv_hi, causal_off + query_of(rows_here - 1) + 1);
  if constexpr (kSplit) {
    const int64_t s0 = static_cast<int64_t>(split) * p.split_len;
    kv_lo = static_cast<int>(s0 > kv_lo ? s0 : kv_lo);
    kv_hi = static_cast<int>(s0 + p.split_len < kv_hi ? s0 + p.split_len : kv_hi);
  }

  if (kv_hi <= kv_lo) {  // no valid key for any row of the block (block-uniform branch)
    if constexpr (kSplit) {
      if (p.part_acc != nullptr) {  // an empty partial: max -inf, sum 0, acc 0 (the combine weighs it 0)
        for (int e = tid; e < rows_here * D; e += kThreads) p.part_acc[part_row(e / D) * D + e % D] = 0.f;
        for (int r = tid; r < rows_here; r += kThreads) {
          p.part_ml[part_row(r) * 2] = -INFINITY;
          p.part_ml[part_row(r) * 2 + 1] = 0.f;
        }
        return;
      }
    }
    for (int e = tid; e < rows_here * D; e += kThreads) o_row(e / D)[e % D] = 0;  // zeros
    return;
  }

  // Prologue: Q -> sV, K(0) -> sK; Q fragments -> registers (A operand of S = Q K^T).
  load_rows<D>(sV, q_row, rows_here, qb, vec, tid);
  load_tile<D>(sK, kg, p.k_ss, kv_lo, kv_hi, vec, tid);
  cp_async_commit();
  cp_async_wait_all();
  block_sync();

  uint32_t qa[kKStepsQK][4];
  {
    const uint16_t* r0 = sV + (warp * 16 + g) * kLd + tq * 2;
    const uint16_t* r1 = r0 + 8 * kLd;
#pragma unroll
    for (int ks = 0; ks < kKStepsQK; ++ks) {
      qa[ks][0] = lds32(r0 + ks * 16);
      qa[ks][1] = lds32(r1 + ks * 16);
      qa[ks][2] = lds32(r0 + ks * 16 + 8);
      qa[ks][3] = lds32(r1 + ks * 16 + 8);
    }
  }
  block_sync();  // every warp holds its Q before V(0) overwrites the buffer

  float o_acc[kNTilesO][4];
#pragma unroll
  for (int dt = 0; dt < kNTilesO; ++dt) {
    o_acc[dt][0] = o_acc[dt][1] = o_acc[dt][2] = o_acc[dt][3] = 0.f;
  }
  // This lane owns block rows lr0 = warp*16 + g and lr0 + 8; row_lim is each one's last causal key.
  float row_max[2] = {-INFINITY, -INFINITY};  // running max of scaled scores (log2 domain)
  float row_sum[2] = {0.f, 0.f};              // partial (this lane's columns) running sum
  const int lr0 = warp * 16 + g;
  const int row_lim[2] = {causal_off + query_of(lr0), causal_off + query_of(lr0 + 8)};

  const int n_tiles = (kv_hi - kv_lo + kBlockN - 1) / kBlockN;
  for (int t = 0; t < n_tiles; ++t) {
    const int n0 = kv_lo + t * kBlockN;

    // V(t) streams in while S(t) and the softmax are computed.
    load_tile<D>(sV, vg, p.v_ss, n0, kv_hi, vec, tid);
    cp_async_commit();

    // ---- S = Q K^T (16 x kBlockN per warp) ----
    float s[kNTilesS][4];
#pragma unroll
    for (int nt = 0; nt < kNTilesS; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < kKStepsQK; ++ks) {
#pragma unroll
      for (int nt = 0; nt < kNTilesS; ++nt) {
        const uint16_t* kr = sK + (nt * 8 + g) * kLd + ks * 16 + tq * 2;
        MmaOp<T>::run(s[nt], qa[ks], lds32(kr), lds32(kr + 8));
      }
    }

    // ---- scale, mask ----
#pragma unroll
    for (int nt = 0; nt < kNTilesS; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) s[nt][e] *= p.scale_log2;
    }
    const bool need_mask =
        (n0 + kBlockN > kv_hi) || (causal && n0 + kBlockN - 1 > causal_off + first_q);
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < kNTilesS; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = n0 + nt * 8 + tq * 2 + (e & 1);
          const bool ok = j < kv_hi && (!causal || j <= row_lim[e >> 1]);
          if (!ok) s[nt][e] = -INFINITY;
        }
      }
    }

    // ---- online softmax ----
    float mx[2] = {row_max[0], row_max[1]};
#pragma unroll
    for (int nt = 0; nt < kNTilesS; ++nt) {
      mx[0] = fmaxf(mx[0], fmaxf(s[nt][0], s[nt][1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[nt][2], s[nt][3]));
    }
    float base[2], alpha[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // the 4 lanes of a quad hold the same two rows
      mx[r] = fmaxf(mx[r], shfl_xor(mx[r], 1));
      mx[r] = fmaxf(mx[r], shfl_xor(mx[r], 2));
      base[r] = mx[r] == -INFINITY ? 0.f : mx[r];  // fully masked so far: keep exp2 finite (-> 0)
      alpha[r] = fast_exp2(row_max[r] - base[r]);
      row_max[r] = mx[r];
    }
    float part[2] = {0.f, 0.f};
#pragma unroll
    for (int nt = 0; nt < kNTilesS; ++nt) {
      s[nt][0] = fast_exp2(s[nt][0] - base[0]);
      s[nt][1] = fast_exp2(s[nt][1] - base[0]);
      s[nt][2] = fast_exp2(s[nt][2] - base[1]);
      s[nt][3] = fast_exp2(s[nt][3] - base[1]);
      part[0] += s[nt][0] + s[nt][1];
      part[1] += s[nt][2] + s[nt][3];
    }
    row_sum[0] = row_sum[0] * alpha[0] + part[0];
    row_sum[1] = row_sum[1] * alpha[1] + part[1];
#pragma unroll
    for (int dt = 0; dt < kNTilesO; ++dt) {
      o_acc[dt][0] *= alpha[0];
      o_acc[dt][1] *= alpha[0];
      o_acc[dt][2] *= alpha[1];
      o_acc[dt][3] *= alpha[1];
    }

    // P (fp32 accumulator layout) -> A operand of O += P V: two adjacent n8 tiles form one k16 step.
    uint32_t pa[kKStepsPV][4];
#pragma unroll
    for (int kk = 0; kk < kKStepsPV; ++kk) {
      pa[kk][0] = MmaOp<T>::pack(s[2 * kk][0], s[2 * kk][1]);
      pa[kk][1] = MmaOp<T>::pack(s[2 * kk][2], s[2 * kk][3]);
      pa[kk][2] = MmaOp<T>::pack(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      pa[kk][3] = MmaOp<T>::pack(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }

    cp_async_wait_all();
    block_sync();  // V(t) landed; every warp is done reading K(t)

    // K(t+1) streams in while O += P V(t) is computed.
    if (t + 1 < n_tiles) {
      load_tile<D>(sK, kg, p.k_ss, n0 + kBlockN, kv_hi, vec, tid);
      cp_async_commit();
    }

    // ---- O += P V ----
#pragma unroll
    for (int kk = 0; kk < kKStepsPV; ++kk) {
#pragma unroll
      for (int dp = 0; dp < kNTilesO / 2; ++dp) {
        uint32_t vb[4];
        ldsm_x4_trans(vb, sV + (kk * 16 + (lane & 15)) * kLd + (dp * 2 + (lane >> 4)) * 8);
        MmaOp<T>::run(o_acc[2 * dp], pa[kk], vb[0], vb[1]);
        MmaOp<T>::run(o_acc[2 * dp + 1], pa[kk], vb[2], vb[3]);
      }
    }

    cp_async_wait_all();
    block_sync();  // K(t+1) landed; every warp is done reading V(t)
  }

  // ---- epilogue ----
  float l_row[2], inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += shfl_xor(l, 1);
    l += shfl_xor(l, 2);
    l_row[r] = l;
    inv[r] = l > 0.f ? 1.f / l : 0.f;  // no valid key -> zeros
  }
  if constexpr (kSplit) {
    if (p.part_acc != nullptr) {
      // Unnormalised partial straight from the accumulator registers (fp32, [row, split, D] layout) and the
      // row's (max, sum), which the quad's lanes agree on after the shuffles above.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (lr0 + 8 * r >= rows_here) continue;
        const int64_t pr = part_row(lr0 + 8 * r);
        float* acc_out = p.part_acc + pr * D + tq * 2;
#pragma unroll
        for (int dt = 0; dt < kNTilesO; ++dt) {
          acc_out[dt * 8] = o_acc[dt][2 * r];
          acc_out[dt * 8 + 1] = o_acc[dt][2 * r + 1];
        }
        if (tq == 0) {
          p.part_ml[pr * 2] = row_max[r];
          p.part_ml[pr * 2 + 1] = l_row[r];
        }
      }
      return;
    }
  }
  // Normalise, stage through sK (free after the loop's last barrier), coalesced store.
  {
    uint16_t* r0 = sK + lr0 * kLd + tq * 2;
    uint16_t* r1 = r0 + 8 * kLd;
#pragma unroll
    for (int dt = 0; dt < kNTilesO; ++dt) {
      sts32(r0 + dt * 8, MmaOp<T>::pack(o_acc[dt][0] * inv[0], o_acc[dt][1] * inv[0]));
      sts32(r1 + dt * 8, MmaOp<T>::pack(o_acc[dt][2] * inv[1], o_acc[dt][3] * inv[1]));
    }
  }
  block_sync();
  store_rows<D>(o_row, rows_here, sK, vec, tid);
}

// Split-K combine: out[row] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s with M = max_s m_s, for every
// row (b, h, query) of the [B * Hq * Lq, num_splits] partials.  A thread owns 8 output elements of one row
// (D / 8 threads per row), so a block covers kThreads / (D / 8) rows; no shared memory, no barriers.
template <typename T, int D>
KVBOOST_FA_KERNEL flash_attn_combine_kernel(const Params p) {
  constexpr int kChunks = D / 8;
  constexpr int kRowsPerBlock = kThreads / kChunks;
  const int tid = threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + tid / kChunks;
  if (row >= static_cast<int64_t>(p.batch) * p.heads_q * p.len_q) return;
  const int col = (tid % kChunks) * 8;
  const int qi = static_cast<int>(row % p.len_q);
  const int h = static_cast<int>((row / p.len_q) % p.heads_q);
  const int b = static_cast<int>(row / (static_cast<int64_t>(p.len_q) * p.heads_q));

  const float* ml = p.part_ml + row * p.num_splits * 2;
  float m_max = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) m_max = fmaxf(m_max, ml[2 * s]);
  const float m_ref = m_max == -INFINITY ? 0.f : m_max;  // every split empty: weights 0, output 0
  float l = 0.f;
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const float* pa = p.part_acc + row * p.num_splits * D + col;
  for (int s = 0; s < p.num_splits; ++s) {
    const float w = fast_exp2(ml[2 * s] - m_ref);
    l += ml[2 * s + 1] * w;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] += pa[static_cast<int64_t>(s) * D + e] * w;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
  alignas(16) uint32_t packed[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) packed[i] = MmaOp<T>::pack(acc[2 * i] * inv, acc[2 * i + 1] * inv);
  uint16_t* o = static_cast<uint16_t*>(p.o) + b * p.o_sb + h * p.o_sh + qi * p.o_ss + col;
  if (p.vec != 0) {
    copy16(o, packed);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      o[2 * i] = static_cast<uint16_t>(packed[i] & 0xffffu);
      o[2 * i + 1] = static_cast<uint16_t>(packed[i] >> 16);
    }
  }
}

}  // namespace kvboost_fa

// --------------------------------------------------------------------------------------------------------
// Host side: path choice, argument checks and kernel parameters (plain C++, shared with the CPU emulation),
// then launch.

namespace kvboost_fa {

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// A stride only matters when its dimension has more than one index.
inline bool strides_vec_ok(const int64_t s[3], int n_b, int n_h, int n_s) {
  return (n_b <= 1 || s[0] % 8 == 0) && (n_h <= 1 || s[1] % 8 == 0) && (n_s <= 1 || s[2] % 8 == 0);
}

inline int64_t cdiv64(int64_t a, int64_t b) { return (a + b - 1) / b; }

// fp32 partials of a split-K call with num_splits > 1: [rows, num_splits, D] outputs + [rows, num_splits, 2].
inline size_t workspace_bytes(int batch, int heads_q, int len_q, int head_dim, int num_splits) {
  if (num_splits <= 1) return 0;
  const size_t rows = size_t(batch) * size_t(heads_q) * size_t(len_q);
  return rows * size_t(num_splits) * size_t(head_dim + 2) * sizeof(float);
}

// Path choice.  split_kv: -1 automatic, 0 one-pass, 1 split-K.  Automatic:
//   * len_q <= kDecodeMaxQ (decode, speculative verification): split-K, whose GQA packing loads each K/V tile
//     once per group instead of once per q head and fills G rows of the tile instead of 1;
//   * longer queries: split-K iff the one-pass grid, cdiv(Lq, 64) * Hq * B blocks, is smaller than the SM count
//     (most SMs would idle while a few blocks walk all the keys) and len_k >= kSplitMinKeys.
// Splits: enough for about kTargetWaves waves of blocks over the SMs, none shorter than kMinSplitLen*, at
// most kMaxSplits, and partials within kMaxWorkspaceBytes; split_len is a multiple of kBlockN.
inline KvboostFlashAttnPlan plan_split(int batch, int heads_q, int heads_kv, int len_q, int len_k, int head_dim,
                                       int num_sms, int split_kv) {
  KvboostFlashAttnPlan plan{0, 0, 0};
  if (batch <= 0 || heads_q <= 0 || heads_kv <= 0 || len_q <= 0 || len_k <= 0 || heads_q % heads_kv != 0) {
    return plan;
  }
  const int64_t one_pass_blocks = cdiv64(len_q, kBlockM) * heads_q * batch;
  bool use = false;
  if (split_kv >= 0) {
    use = split_kv > 0;
  } else if (len_q <= kDecodeMaxQ) {
    use = true;
  } else {
    use = len_k >= kSplitMinKeys && one_pass_blocks < num_sms;
  }
  if (!use) return plan;
  const int group = heads_q / heads_kv;
  const int64_t blocks_per_split = cdiv64(int64_t(group) * len_q, kBlockM) * heads_kv * batch;
  int64_t want = cdiv64(int64_t(kTargetWaves) * (num_sms > 0 ? num_sms : 1), blocks_per_split);
  const int min_len = len_q <= kDecodeMaxQ ? kMinSplitLenDecode : kMinSplitLenPrefill;
  want = want < cdiv64(len_k, min_len) ? want : cdiv64(len_k, min_len);
  const size_t per_split = workspace_bytes(batch, heads_q, len_q, head_dim, 2) / 2;
  const int64_t by_memory = per_split > 0 ? int64_t(kMaxWorkspaceBytes / per_split) : kMaxSplits;
  want = want < by_memory ? want : by_memory;
  want = want < kMaxSplits ? want : kMaxSplits;
  want = want > 1 ? want : 1;
  const int64_t split_len = cdiv64(cdiv64(len_k, want), kBlockN) * kBlockN;
  plan.split_len = static_cast<int>(split_len);
  plan.num_splits = static_cast<int>(cdiv64(len_k, split_len));
  plan.workspace_bytes = workspace_bytes(batch, heads_q, len_q, head_dim, plan.num_splits);
  return plan;
}

// What to launch: the main kernel (one-pass or split-K) and, for split-K with several splits, the combine.
struct Launch {
  Params p;
  unsigned grid[3];
  unsigned combine_blocks;  // 0: no combine kernel
  bool split;
  bool needed;              // false when there is nothing to compute (empty output)
};

// Validates the arguments and fills the kernel parameters and grids.  `plan` comes from plan_split (any plan
// with num_splits * split_len >= len_k is valid); `workspace` must hold plan.workspace_bytes when it is > 0.
inline cudaError_t prepare(const void* q, const void* k, const void* v, void* out, const int32_t* kv_start,
                           const int32_t* kv_len, int batch, int heads_q, int heads_kv, int len_q, int len_k,
                           int head_dim, const int64_t q_strides[3], const int64_t k_strides[3],
                           const int64_t v_strides[3], const int64_t out_strides[3], bool causal,
                           float sm_scale, KvboostDType dtype, const KvboostFlashAttnPlan& plan, void* workspace,
                           Launch* launch) {
  launch->needed = false;
  if (batch < 0 || heads_q < 0 || heads_kv <= 0 || len_q < 0 || len_k < 0) return cudaErrorInvalidValue;
  if (heads_q % heads_kv != 0) return cudaErrorInvalidValue;
  if (head_dim != 64 && head_dim != 128) return cudaErrorInvalidValue;
  if (dtype != KvboostDType::kFloat16 && dtype != KvboostDType::kBFloat16) return cudaErrorInvalidValue;
  if (batch == 0 || heads_q == 0 || len_q == 0) return cudaSuccess;  // nothing to write
  if (q == nullptr || out == nullptr || (len_k > 0 && (k == nullptr || v == nullptr))) {
    return cudaErrorInvalidValue;
  }
  if (q_strides == nullptr || k_strides == nullptr || v_strides == nullptr || out_strides == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (batch > 65535 || heads_q > 65535) return cudaErrorInvalidConfiguration;  // grid.z / grid.y limits
  const bool split = plan.num_splits > 0 && len_k > 0;
  if (split) {
    if (plan.split_len <= 0 || int64_t(plan.num_splits) * plan.split_len < len_k) return cudaErrorInvalidValue;
    if (plan.num_splits > 1 &&
        (workspace == nullptr ||
         plan.workspace_bytes < workspace_bytes(batch, heads_q, len_q, head_dim, plan.num_splits))) {
      return cudaErrorInvalidValue;
    }
  }

  Params& p = launch->p;
  p = Params{};
  p.q = q;
  p.k = k;
  p.v = v;
  p.o = out;
  p.kv_start = kv_start;
  p.kv_len = kv_len;
  p.q_sb = q_strides[0], p.q_sh = q_strides[1], p.q_ss = q_strides[2];
  p.k_sb = k_strides[0], p.k_sh = k_strides[1], p.k_ss = k_strides[2];
  p.v_sb = v_strides[0], p.v_sh = v_strides[1], p.v_ss = v_strides[2];
  p.o_sb = out_strides[0], p.o_sh = out_strides[1], p.o_ss = out_strides[2];
  p.batch = batch;
  p.heads_q = heads_q;
  p.len_q = len_q;
  p.len_k = len_k;
  p.group = heads_q / heads_kv;
  p.scale_log2 = sm_scale * 1.4426950408889634f;
  p.causal = causal ? 1 : 0;
  const bool vec = aligned16(q) && aligned16(out) && (len_k == 0 || (aligned16(k) && aligned16(v))) &&
                   strides_vec_ok(q_strides, batch, heads_q, len_q) &&
                   strides_vec_ok(out_strides, batch, heads_q, len_q) &&
                   strides_vec_ok(k_strides, batch, heads_kv, len_k) &&
                   strides_vec_ok(v_strides, batch, heads_kv, len_k);
  p.vec = vec ? 1 : 0;
  launch->split = split;
  launch->combine_blocks = 0;
  if (split) {
    p.num_splits = plan.num_splits;
    p.split_len = plan.split_len;
    if (plan.num_splits > 1) {
      const size_t rows = size_t(batch) * size_t(heads_q) * size_t(len_q);
      p.part_acc = static_cast<float*>(workspace);
      p.part_ml = p.part_acc + rows * size_t(plan.num_splits) * size_t(head_dim);
      const int64_t rows_per_block = kThreads / (head_dim / 8);
      launch->combine_blocks = static_cast<unsigned>(cdiv64(int64_t(rows), rows_per_block));
    }
    const int64_t row_blocks = cdiv64(int64_t(p.group) * len_q, kBlockM);
    if (row_blocks * plan.num_splits > 0x7fffffff) return cudaErrorInvalidConfiguration;
    launch->grid[0] = static_cast<unsigned>(row_blocks * plan.num_splits);
    launch->grid[1] = static_cast<unsigned>(heads_kv);
  } else {
    p.num_splits = 1;
    launch->grid[0] = static_cast<unsigned>((len_q + kBlockM - 1) / kBlockM);
    launch->grid[1] = static_cast<unsigned>(heads_q);
  }
  launch->grid[2] = static_cast<unsigned>(batch);
  launch->needed = true;
  return cudaSuccess;
}

}  // namespace kvboost_fa

#if !defined(KVBOOST_FA_EMULATION)
namespace {

template <typename T, int D>
cudaError_t launch(const kvboost_fa::Launch& l, cudaStream_t stream) {
  const dim3 g(l.grid[0], l.grid[1], l.grid[2]);
  if (l.split) {
    kvboost_fa::flash_attn_fwd_kernel<T, D, true><<<g, kvboost_fa::kThreads, 0, stream>>>(l.p);
    if (l.combine_blocks > 0) {
      kvboost_fa::flash_attn_combine_kernel<T, D><<<l.combine_blocks, kvboost_fa::kThreads, 0, stream>>>(l.p);
    }
  } else {
    kvboost_fa::flash_attn_fwd_kernel<T, D, false><<<g, kvboost_fa::kThreads, 0, stream>>>(l.p);
  }
  return cudaGetLastError();
}

}  // namespace

KvboostFlashAttnPlan kvboost_flash_attn_plan(int batch, int heads_q, int heads_kv, int len_q, int len_k,
                                             int head_dim, int num_sms, int split_kv) {
  return kvboost_fa::plan_split(batch, heads_q, heads_kv, len_q, len_k, head_dim, num_sms, split_kv);
}

cudaError_t kvboost_flash_attn_fwd(const void* q, const void* k, const void* v, void* out,
                                   const int32_t* kv_start, const int32_t* kv_len,
                                   int batch, int heads_q, int heads_kv, int len_q, int len_k, int head_dim,
                                   const int64_t q_strides[3], const int64_t k_strides[3],
                                   const int64_t v_strides[3], const int64_t out_strides[3],
                                   bool causal, float sm_scale, KvboostDType dtype,
                                   const KvboostFlashAttnPlan& plan, void* workspace, cudaStream_t stream) {
  kvboost_fa::Launch l;
  const cudaError_t err = kvboost_fa::prepare(q, k, v, out, kv_start, kv_len, batch, heads_q, heads_kv, len_q,
                                              len_k, head_dim, q_strides, k_strides, v_strides, out_strides,
                                              causal, sm_scale, dtype, plan, workspace, &l);
  if (err != cudaSuccess || !l.needed) return err;
  if (dtype == KvboostDType::kFloat16) {
    return head_dim == 64 ? launch<__half, 64>(l, stream) : launch<__half, 128>(l, stream);
  }
  return head_dim == 64 ? launch<__nv_bfloat16, 64>(l, stream) : launch<__nv_bfloat16, 128>(l, stream);
}
#endif  // !KVBOOST_FA_EMULATION
