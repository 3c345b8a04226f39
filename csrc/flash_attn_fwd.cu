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
// This file has no torch dependency; the torch binding lives in flash_attn_binding.cpp.
// Defining KVBOOST_FA_EMULATION compiles only the kernel body, against primitives supplied by the includer
// (used to run the kernel logic on a CPU, thread by thread, for testing without a GPU).

#include "flash_attn_fwd.h"

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
  int len_q;
  int len_k;
  int group;         // heads_q / heads_kv
  float scale_log2;  // sm_scale * log2(e): softmax is evaluated with exp2
  int causal;
  int vec;           // 1: every row start is 16-byte aligned -> cp.async 16-byte copies
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

// Copy kBlockN rows [row0, row0 + kBlockN) of a [rows, D] slice (row stride `stride` elements, columns
// contiguous) into shared memory (row stride D + kPad); rows >= row_end are zero-filled.  Asynchronous
// when vec (the caller commits and waits), synchronous otherwise.
template <int D>
KVBOOST_FA_DEVICE void load_tile(uint16_t* smem, const uint16_t* gmem, int64_t stride, int row0, int row_end,
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
      const int grow = row0 + r;
      const bool valid = grow < row_end;
      const uint16_t* src = valid ? gmem + static_cast<int64_t>(grow) * stride + col : gmem;
      cp_async_16(smem + r * kLd + col, src, valid);
    }
  } else {
    for (int e = tid; e < kBlockN * D; e += kThreads) {
      const int r = e / D;
      const int col = e % D;
      const int grow = row0 + r;
      smem[r * kLd + col] = grow < row_end ? gmem[static_cast<int64_t>(grow) * stride + col] : uint16_t(0);
    }
  }
}

// Inverse of load_tile for the output: rows [row0, min(row0 + kBlockM, row_end)) of shared memory -> global.
template <int D>
KVBOOST_FA_DEVICE void store_tile(uint16_t* gmem, int64_t stride, const uint16_t* smem, int row0, int row_end,
                                  bool vec, int tid) {
  constexpr int kLd = D + kPad;
  if (vec) {
    constexpr int kChunksPerRow = D / 8;
    constexpr int kIters = kBlockM * kChunksPerRow / kThreads;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int c = tid + it * kThreads;
      const int r = c / kChunksPerRow;
      const int col = (c % kChunksPerRow) * 8;
      const int grow = row0 + r;
      if (grow < row_end) copy16(gmem + static_cast<int64_t>(grow) * stride + col, smem + r * kLd + col);
    }
  } else {
    for (int e = tid; e < kBlockM * D; e += kThreads) {
      const int r = e / D;
      const int col = e % D;
      const int grow = row0 + r;
      if (grow < row_end) gmem[static_cast<int64_t>(grow) * stride + col] = smem[r * kLd + col];
    }
  }
}

template <typename T, int D>
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

  // Heaviest (causal) query blocks first: the tail of the grid is made of cheap blocks.
  const int m_block = static_cast<int>(gridDim.x) - 1 - static_cast<int>(blockIdx.x);
  const int hq = blockIdx.y;
  const int b = blockIdx.z;
  const int hkv = hq / p.group;
  const int m0 = m_block * kBlockM;

  const uint16_t* qg = static_cast<const uint16_t*>(p.q) + b * p.q_sb + hq * p.q_sh;
  const uint16_t* kg = static_cast<const uint16_t*>(p.k) + b * p.k_sb + hkv * p.k_sh;
  const uint16_t* vg = static_cast<const uint16_t*>(p.v) + b * p.v_sb + hkv * p.v_sh;
  uint16_t* og = static_cast<uint16_t*>(p.o) + b * p.o_sb + hq * p.o_sh;
  const bool vec = p.vec != 0;
  const bool causal = p.causal != 0;

  // Key range of this block: [kv_lo, kv_hi).
  int kv_lo = 0;
  int kv_hi = p.len_k;
  if (p.kv_start != nullptr) kv_lo = imin(imax(p.kv_start[b], 0), p.len_k);
  if (p.kv_len != nullptr) kv_hi = imin(imax(p.kv_len[b], 0), p.len_k);
  const int causal_off = p.len_k - p.len_q;  // query i attends keys j <= causal_off + i
  if (causal) {
    const int last_q = imin(m0 + kBlockM, p.len_q) - 1;
    kv_hi = imin(kv_hi, causal_off + last_q + 1);
  }

  if (kv_hi <= kv_lo) {  // no valid key for any query of the block: zeros (block-uniform branch)
    const int rows = imin(kBlockM, p.len_q - m0);
    for (int e = tid; e < rows * D; e += kThreads) {
      og[static_cast<int64_t>(m0 + e / D) * p.o_ss + e % D] = 0;
    }
    return;
  }

  // Prologue: Q -> sV, K(0) -> sK; Q fragments -> registers (A operand of S = Q K^T).
  load_tile<D>(sV, qg, p.q_ss, m0, p.len_q, vec, tid);
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
  // This lane owns query rows q_row and q_row + 8 (block-relative warp*16 + g, + 8).
  float row_max[2] = {-INFINITY, -INFINITY};  // running max of scaled scores (log2 domain)
  float row_sum[2] = {0.f, 0.f};              // partial (this lane's columns) running sum
  const int q_row = m0 + warp * 16 + g;

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
        (n0 + kBlockN > kv_hi) || (causal && n0 + kBlockN - 1 > causal_off + m0);
    if (need_mask) {
#pragma unroll
      for (int nt = 0; nt < kNTilesS; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = n0 + nt * 8 + tq * 2 + (e & 1);
          const int i = q_row + (e >> 1) * 8;
          const bool ok = j < kv_hi && (!causal || j <= causal_off + i);
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

  // ---- epilogue: normalise, stage through sK (free after the loop's last barrier), coalesced store ----
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += shfl_xor(l, 1);
    l += shfl_xor(l, 2);
    inv[r] = l > 0.f ? 1.f / l : 0.f;  // no valid key -> zeros
  }
  {
    uint16_t* r0 = sK + (warp * 16 + g) * kLd + tq * 2;
    uint16_t* r1 = r0 + 8 * kLd;
#pragma unroll
    for (int dt = 0; dt < kNTilesO; ++dt) {
      sts32(r0 + dt * 8, MmaOp<T>::pack(o_acc[dt][0] * inv[0], o_acc[dt][1] * inv[0]));
      sts32(r1 + dt * 8, MmaOp<T>::pack(o_acc[dt][2] * inv[1], o_acc[dt][3] * inv[1]));
    }
  }
  block_sync();
  store_tile<D>(og, p.o_ss, sK, m0, p.len_q, vec, tid);
}

}  // namespace kvboost_fa

// --------------------------------------------------------------------------------------------------------
// Host side: argument checks and kernel parameters (plain C++, shared with the CPU emulation), then launch.

namespace kvboost_fa {

inline bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15u) == 0; }

// A stride only matters when its dimension has more than one index.
inline bool strides_vec_ok(const int64_t s[3], int n_b, int n_h, int n_s) {
  return (n_b <= 1 || s[0] % 8 == 0) && (n_h <= 1 || s[1] % 8 == 0) && (n_s <= 1 || s[2] % 8 == 0);
}

// Validates the arguments and fills the kernel parameters and grid (x: query blocks, y: q heads, z: batch).
// *launch is false when there is nothing to compute (empty output).
inline cudaError_t prepare(const void* q, const void* k, const void* v, void* out, const int32_t* kv_start,
                           const int32_t* kv_len, int batch, int heads_q, int heads_kv, int len_q, int len_k,
                           int head_dim, const int64_t q_strides[3], const int64_t k_strides[3],
                           const int64_t v_strides[3], const int64_t out_strides[3], bool causal,
                           float sm_scale, KvboostDType dtype, Params* p, unsigned grid[3], bool* launch) {
  *launch = false;
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

  *p = Params{};
  p->q = q;
  p->k = k;
  p->v = v;
  p->o = out;
  p->kv_start = kv_start;
  p->kv_len = kv_len;
  p->q_sb = q_strides[0], p->q_sh = q_strides[1], p->q_ss = q_strides[2];
  p->k_sb = k_strides[0], p->k_sh = k_strides[1], p->k_ss = k_strides[2];
  p->v_sb = v_strides[0], p->v_sh = v_strides[1], p->v_ss = v_strides[2];
  p->o_sb = out_strides[0], p->o_sh = out_strides[1], p->o_ss = out_strides[2];
  p->len_q = len_q;
  p->len_k = len_k;
  p->group = heads_q / heads_kv;
  p->scale_log2 = sm_scale * 1.4426950408889634f;
  p->causal = causal ? 1 : 0;
  const bool vec = aligned16(q) && aligned16(out) && (len_k == 0 || (aligned16(k) && aligned16(v))) &&
                   strides_vec_ok(q_strides, batch, heads_q, len_q) &&
                   strides_vec_ok(out_strides, batch, heads_q, len_q) &&
                   strides_vec_ok(k_strides, batch, heads_kv, len_k) &&
                   strides_vec_ok(v_strides, batch, heads_kv, len_k);
  p->vec = vec ? 1 : 0;
  grid[0] = static_cast<unsigned>((len_q + kBlockM - 1) / kBlockM);
  grid[1] = static_cast<unsigned>(heads_q);
  grid[2] = static_cast<unsigned>(batch);
  *launch = true;
  return cudaSuccess;
}

}  // namespace kvboost_fa

#if !defined(KVBOOST_FA_EMULATION)
namespace {

template <typename T, int D>
cudaError_t launch(const kvboost_fa::Params& p, const unsigned grid[3], cudaStream_t stream) {
  const dim3 g(grid[0], grid[1], grid[2]);
  kvboost_fa::flash_attn_fwd_kernel<T, D><<<g, kvboost_fa::kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t kvboost_flash_attn_fwd(const void* q, const void* k, const void* v, void* out,
                                   const int32_t* kv_start, const int32_t* kv_len,
                                   int batch, int heads_q, int heads_kv, int len_q, int len_k, int head_dim,
                                   const int64_t q_strides[3], const int64_t k_strides[3],
                                   const int64_t v_strides[3], const int64_t out_strides[3],
                                   bool causal, float sm_scale, KvboostDType dtype, cudaStream_t stream) {
  kvboost_fa::Params p;
  unsigned grid[3];
  bool needed = false;
  const cudaError_t err = kvboost_fa::prepare(q, k, v, out, kv_start, kv_len, batch, heads_q, heads_kv, len_q,
                                              len_k, head_dim, q_strides, k_strides, v_strides, out_strides,
                                              causal, sm_scale, dtype, &p, grid, &needed);
  if (err != cudaSuccess || !needed) return err;
  if (dtype == KvboostDType::kFloat16) {
    return head_dim == 64 ? launch<__half, 64>(p, grid, stream) : launch<__half, 128>(p, grid, stream);
  }
  return head_dim == 64 ? launch<__nv_bfloat16, 64>(p, grid, stream)
                        : launch<__nv_bfloat16, 128>(p, grid, stream);
}
#endif  // !KVBOOST_FA_EMULATION
