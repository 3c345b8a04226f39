// CPU attention forward for prefill-shaped calls (kvboost attention backend ``cpu_kernel``).
//
// Why not torch's own CPU flash kernel: for the shapes kvboost serves after reuse (tens to hundreds of new
// queries over a cached prefix of ~1000 keys, head dim 64) it runs its GEMMs on small query blocks, one head at
// a time, and reaches ~150-180 GFLOP/s in fp32 on a 2-core AVX-512 machine where a plain GEMM reaches ~300.
// Here one work unit is (batch row, KV head, tile of query tokens): the queries of every head of the GQA group
// over that tile are gathered into one matrix, so one GEMM computes the scores of G * tile rows against the
// keys the tile can see (causal: up to its last query's position, no further), the softmax runs on full rows
// that stay in L2 (exp once per visible score), and one GEMM multiplies by V. Row sums scale the output at the
// end (no pass over the probabilities to normalise them).
//
// GEMMs are MKL's, found in torch's own library (``sgemm_`` for fp32, ``cblas_gemm_bf16bf16f32`` for bf16 with
// fp32 accumulation, which runs on AMX where the CPU has it); the softmax uses ATen's vectorised exp. Threads:
// at::parallel_for over the work units (torch's OpenMP pool; MKL runs single-threaded inside a parallel region).
//
// A second entry point, ``paged_forward``, runs the same attention over a paged KV pool (block tables, no
// gathered copy of the sequences): see "paged entry point" below.
//
// Contract (the ``kvboost.kernels_triton`` one): q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (any strides, last dim
// contiguous), query i of row b sits at position q_positions[b, i] (default Lk - Lq + i) and sees key j iff
// kv_start[b] <= j < kv_len[b] and (not causal or j <= position). A query that sees no key gets zeros. out
// [B, Hq, Lq, D] is written through its strides (a transposed view of transformers' layout is fine).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

// How the paged kernel runs `workers` copies of its worker loop (each claims units from a shared counter): torch's
// OpenMP pool here; the quantized step (cpu_quant.cpp) defines it first to run them on its own pool where every
// unit is on the direct path (`direct_only`: no MKL call, which inside an OpenMP region runs single-threaded but
// from a thread of another pool could start a team of its own).
#ifndef KVB_RUN_WORKERS
#define KVB_RUN_WORKERS(workers, direct_only, body) at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { body(); })
#endif

extern "C" {
// MKL, exported by libtorch_cpu on x86 builds (LP64: 32-bit integers).
void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k, const float* alpha,
            const float* a, const int* lda, const float* b, const int* ldb, const float* beta, float* c,
            const int* ldc);
void cblas_gemm_bf16bf16f32(int layout, int transa, int transb, int m, int n, int k, float alpha,
                            const uint16_t* a, int lda, const uint16_t* b, int ldb, float beta, float* c, int ldc);
}

namespace {

constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;
using Vec = at::vec::Vectorized<float>;

// Row-major C[m, n] = alpha * A[m, k] * op(B) where op(B) = B^T for B [n, k] (trans_b) or B for B [k, n].
void gemm(int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda, const float* b, int64_t ldb,
          bool trans_b, float* c, int64_t ldc) {
  // Column-major view: C^T [n, m] = op(B)^T [n, k] * A^T [k, m].
  const char ta = trans_b ? 'T' : 'N', tb = 'N';
  const int mi = static_cast<int>(n), ni = static_cast<int>(m), ki = static_cast<int>(k);
  const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(ldc);
  const float beta = 0.f;
  sgemm_(&ta, &tb, &mi, &ni, &ki, &alpha, b, &la, a, &lb, &beta, c, &lc);
}

void gemm(int64_t m, int64_t n, int64_t k, float alpha, const at::BFloat16* a, int64_t lda, const at::BFloat16* b,
          int64_t ldb, bool trans_b, float* c, int64_t ldc) {
  cblas_gemm_bf16bf16f32(kRowMajor, kNoTrans, trans_b ? kTrans : kNoTrans, static_cast<int>(m),
                         static_cast<int>(n), static_cast<int>(k), alpha, reinterpret_cast<const uint16_t*>(a),
                         static_cast<int>(lda), reinterpret_cast<const uint16_t*>(b), static_cast<int>(ldb), 0.f, c,
                         static_cast<int>(ldc));
}

// exp(row - max) in place over n scores; returns their sum.
float exp_and_sum(float* row, int64_t n) {
  const float mx = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, row, n);
  const Vec vmx(mx);
  Vec acc(0.f);
  int64_t j = 0;
  for (; j + Vec::size() <= n; j += Vec::size()) {
    Vec e = (Vec::loadu(row + j) - vmx).exp_u20();
    e.store(row + j);
    acc = acc + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; j < n; ++j) {
    row[j] = std::exp(row[j] - mx);
    sum += row[j];
  }
  return sum;
}

template <typename T>
void attention_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, float scale,
                      const int32_t* q_pos, const int32_t* kv_start, const int32_t* kv_len, at::Tensor& out,
                      int64_t tile) {
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), G = Hq / Hkv;
  const int64_t tiles = (Lq + tile - 1) / tile;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), qs2 = q.stride(2);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  constexpr bool kLowPrecision = !std::is_same<T, float>::value;

  at::parallel_for(0, B * Hkv * tiles, 1, [&](int64_t begin, int64_t end) {
    const int64_t max_rows = G * tile;
    std::vector<T> a(max_rows * D);
    std::vector<float> s(max_rows * Lk), o(max_rows * D), inv(max_rows);
    std::vector<T> p(kLowPrecision ? max_rows * Lk : 0);
    std::vector<int64_t> pos(tile);
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t b = unit / (Hkv * tiles), g = (unit / tiles) % Hkv, t0 = (unit % tiles) * tile;
      const int64_t tn = std::min(tile, Lq - t0), rows = G * tn;
      const int64_t lo = kv_start ? std::max<int64_t>(0, kv_start[b]) : 0;
      const int64_t hi_row = kv_len ? std::min<int64_t>(Lk, kv_len[b]) : Lk;
      int64_t hi = lo;  // one past the last key any query of the tile sees
      for (int64_t t = 0; t < tn; ++t) {
        pos[t] = q_pos ? q_pos[b * Lq + t0 + t] : Lk - Lq + t0 + t;
        hi = std::max(hi, causal ? std::min(hi_row, pos[t] + 1) : hi_row);
      }
      const int64_t n = hi - lo;
      // Query rows ordered (head of the group, token).
      for (int64_t h = 0; h < G; ++h)
        for (int64_t t = 0; t < tn; ++t)
          std::memcpy(&a[(h * tn + t) * D], qp + b * qs0 + (g * G + h) * qs1 + (t0 + t) * qs2, D * sizeof(T));
      if (n > 0) {
        gemm(rows, n, D, scale, a.data(), D, kp + b * ks0 + g * ks1 + lo * ks2, ks2, true, s.data(), n);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t t = r % tn;
          const int64_t seen = std::max<int64_t>(0, (causal ? std::min(hi_row, pos[t] + 1) : hi_row) - lo);
          float* row = s.data() + r * n;
          inv[r] = seen > 0 ? 1.f / exp_and_sum(row, seen) : 0.f;
          if constexpr (kLowPrecision) {
            T* prow = p.data() + r * n;
            at::vec::convert(row, prow, seen);
            std::fill(prow + seen, prow + n, T(0.f));
          } else {
            std::fill(row + seen, row + n, 0.f);
          }
        }
        if constexpr (kLowPrecision) {
          gemm(rows, D, n, 1.f, p.data(), n, vp + b * vs0 + g * vs1 + lo * vs2, vs2, false, o.data(), D);
        } else {
          gemm(rows, D, n, 1.f, s.data(), n, vp + b * vs0 + g * vs1 + lo * vs2, vs2, false, o.data(), D);
        }
      } else {
        std::fill(inv.begin(), inv.begin() + rows, 0.f);
        std::fill(o.begin(), o.begin() + rows * D, 0.f);
      }
      for (int64_t h = 0; h < G; ++h)
        for (int64_t t = 0; t < tn; ++t) {
          const int64_t r = h * tn + t;
          T* dst = op + b * os0 + (g * G + h) * os1 + (t0 + t) * os2;
          const float* src = o.data() + r * D;
          const float f = inv[r];
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d] * f);
        }
    }
  });
}

void check_rows(const c10::optional<at::Tensor>& t, const char* name, int64_t batch, int64_t cols) {
  if (!t.has_value()) return;
  TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(), name, " must be a contiguous int32 tensor");
  TORCH_CHECK(cols ? (t->dim() == 2 && t->size(0) == batch && t->size(1) == cols)
                   : (t->dim() == 1 && t->size(0) == batch),
              name, " has the wrong shape");
}

// ------------------------------------------------------------------------------------------ paged entry point
//
// The same attention over a paged KV pool (contract: kvboost/kernels_triton/paged_attention_reference.py). k_cache /
// v_cache [Hkv, S, D] hold one layer of the pool in blocks of block_size slots; sequence b's logical key j lives
// in slot block_tables[b, j / block_size] * block_size + j % block_size. q [T, Hq, D] holds the queries of B
// sequences back to back (rows query_start[b] .. query_start[b + 1]); query t sees key j iff j <= q_positions[t]
// and j < kv_lens[b]. No gathered copy of a whole sequence is ever made.
//
// Work unit: (sequence, KV head, tile of that sequence's queries), the queries of the GQA group's G heads over the
// tile stacked as the rows of one problem, as in the dense kernel. A unit reads only the keys its tile can see
// (0 .. hi - 1, hi = min(kv_len, largest position + 1)), block by block, so pool slots past kv_len (stale or
// uninitialised memory) and block-table entries past a sequence's blocks are never read. Each row is masked to
// its own position. Two ways to run a unit, chosen by its row count (G x tile queries):
//  * GEMM path (prefill tiles, > kDirectMaxRows rows): the visible keys and values are copied block by block
//    into a thread-local contiguous buffer (hi x D; it stays in L2, and the copy is small next to the
//    4 x rows x hi x D FLOPs), then the dense kernel's score GEMM / softmax on rows / value GEMM. Measured against
//    one GEMM per block (no copy): with the copy, fp32 was 3-6% faster and bf16 1.15-1.6x (suffix prefills of
//    32-256 queries over 1000 keys, blocks of 16 and 32): with 16-32 keys per block MKL's per-call cost and
//    the value GEMM's short inner dimension dominate.
//  * Direct path (decode and short tiles): a 3-row GEMM is a matrix-vector product that MKL runs far from memory
//    speed (cblas_gemm_bf16bf16f32 worst), and a gathered copy would add a write and a read of every key. Here
//    each block is streamed once from the pool, the unit's rows sharing every key / value row while it is in
//    registers: fp32 FMAs (bf16 widened on load), the rows in register groups, the dot products reduced a vector's
//    worth at a time (transpose_sum). Faster than the GEMM path up to ~48 rows (G = 3, D = 64, 4 x 1024
//    keys per call).
// Splitting: a batch-1 decode step has B x Hkv = 3 units for the bundled model, which 2 threads run in 2 rounds
// (4 threads: 1 idle). Direct-path units over more than kSplitKeys keys are therefore split into parts of
// kSplitKeys keys (by absolute key position, whole blocks); each part keeps its rows' max score, sum of exps and
// unnormalised output, and the thread that finishes a unit's last part merges them (flash-decoding).
// Scheduling: units differ a lot in cost in a mixed batch (a 32-query prefill tile next to decode rows), so they
// are sorted by estimated cost, largest first, and each thread takes the next one from a shared counter
// (longest-processing-time-first) instead of at::parallel_for's static contiguous split.
// Invariance: every unit is computed by one thread with code that does not depend on the rest of the batch, so a
// sequence's output does not either (on the GEMM path: as far as MKL gives the same bits for the same shapes; MKL's
// bits do follow the shape, so a prompt tile's rows differ from the same rows in a shorter call: `row_invariant`
// keeps every tile on the direct path).
// On the direct path a row's bits do not even depend on the other rows of its tile: its reductions run over its
// own keys in a fixed order (scores: one reduction tree per key; parts: by absolute position, so a row sees the
// same parts whatever the tile's furthest position; keys past its position add exact zeros).
//
// Software prefetch of the next blocks was tried on the direct path (1, 2 and 4 blocks ahead, into L1 or L2)
// and gave nothing measurable: random 4 KB blocks read at ~9 GB/s per core here with or without it (sequential
// reads: ~20 GB/s), and the kernel reaches about that.

// Units of at most this many rows (G heads x tile queries) run on the direct path.
constexpr int64_t kDirectMaxRows = 48;
// In the cost estimate, streaming a unit's keys counts as this many rows of arithmetic.
constexpr int64_t kStreamRows = 8;
// Direct-path units that see more keys are split in parts of this many keys (rounded to whole blocks).
constexpr int64_t kSplitKeys = 512;

inline Vec load_float(const float* p) { return Vec::loadu(p); }
inline Vec load_float(const at::BFloat16* p) {
  Vec out;
  at::vec::load_to_float(p, out);
  return out;
}

inline float reduce_add(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// Thread-local scratch that grows to the largest unit the thread runs (uninitialised: no memset per call).
template <typename U>
struct Scratch {
  std::unique_ptr<U[]> data;
  int64_t size = 0;
  U* get(int64_t n) {
    if (n > size) {
      data.reset(new U[n]);
      size = n;
    }
    return data.get();
  }
};

struct PagedUnit {
  int64_t b, g, t0, tn;  // sequence, KV head, its queries t0 .. t0 + tn - 1
  int64_t lo, hi;        // the keys this unit reads (a split unit's part: a range of kSplitKeys)
  int64_t cost;          // estimate, for the scheduling order
  int64_t parts = 1;     // parts of its split unit (1: not split)
  int64_t group = -1;    // split units: index of the unit's parts in the partial-result and counter arrays
  int64_t part = 0;      // which part this is
};

template <typename T>
struct PagedProblem {
  const T *q, *k, *v;
  T* out;
  const int32_t *tables, *kv_lens, *query_start, *q_pos;
  int64_t Hq, Hkv, G, D, block_size, table_stride;
  int64_t qs0, qs1, ks0, ks1, vs0, vs1, os0, os1;
  float scale;

  // Slot of logical key row j (its block's first row for j a multiple of block_size) of sequence b.
  int64_t slot(int64_t b, int64_t j) const {
    return static_cast<int64_t>(tables[b * table_stride + j / block_size]) * block_size + j % block_size;
  }
};

// Full unrolling of the register-group loops below, forced: without it GCC 12 at -O3 (its loop vectoriser)
// keeps the accumulator arrays in memory and stores them on every iteration.
#define KVB_UNROLL _Pragma("GCC unroll 16")

// Rows per register group on the direct path: the group's query rows (scores) or output accumulators (values),
// RG x NC vectors, stay in registers next to one key / value row's NC vectors (32 zmm registers).
constexpr int group_rows(int NC) { return NC <= 4 ? 4 : (NC <= 5 ? 3 : 2); }

// The VS sums of VS vectors at once: lane i of the result is the sum of v[i]'s lanes. A tree of VS - 1
// deinterleave-and-add steps (each halves the vectors while keeping the lanes of the first operand first, so
// the result comes out in order) instead of one horizontal reduction (log2(VS) shuffle + add) per vector.
inline Vec transpose_sum(Vec* v) {
  constexpr int VS = Vec::size();
  KVB_UNROLL for (int width = VS; width > 1; width /= 2) {
    KVB_UNROLL for (int i = 0; i < width / 2; ++i) {
      auto halves = at::vec::deinterleave2(v[2 * i], v[2 * i + 1]);
      v[i] = halves.first + halves.second;
    }
  }
  return v[0];
}

// s[r * ld_s + j] = a_r . key_j for RG rows a (fp32, stride D) and jn keys at kb (row stride ld). Per run of VS
// keys, each row's VS partial-sum vectors go to a small L1 buffer and are reduced together (transpose_sum); a
// block's last keys go through the same tree (padded with zero vectors), so a key's score has the same bits
// wherever it sits in a run, whatever the number of keys the unit reads.
template <int RG, int NC, typename T>
inline void score_group(const float* a, int64_t D, const T* kb, int64_t ld, int64_t jn, float* s, int64_t ld_s) {
  constexpr int64_t VS = Vec::size();
  Vec qv[RG][NC];
  KVB_UNROLL for (int r = 0; r < RG; ++r)
    KVB_UNROLL for (int c = 0; c < NC; ++c) qv[r][c] = Vec::loadu(a + r * D + c * VS);
  auto dot = [&](int r, const Vec* kc) {
    Vec acc = qv[r][0] * kc[0];
    KVB_UNROLL for (int c = 1; c < NC; ++c) acc = at::vec::fmadd(qv[r][c], kc[c], acc);
    return acc;
  };
  alignas(64) float part[RG][VS][VS];
  int64_t j = 0;
  for (; j + VS <= jn; j += VS) {
    for (int64_t jj = 0; jj < VS; ++jj) {
      Vec kc[NC];
      KVB_UNROLL for (int c = 0; c < NC; ++c) kc[c] = load_float(kb + (j + jj) * ld + c * VS);
      KVB_UNROLL for (int r = 0; r < RG; ++r) dot(r, kc).store(part[r][jj]);
    }
    KVB_UNROLL for (int r = 0; r < RG; ++r) {
      Vec v[VS];
      KVB_UNROLL for (int jj = 0; jj < VS; ++jj) v[jj] = Vec::loadu(part[r][jj]);
      transpose_sum(v).store(s + r * ld_s + j);
    }
  }
  if (j < jn) {  // the block's last keys (fewer than VS): the same reduction, the missing keys' vectors zero
    const int64_t rem = jn - j;
    for (int64_t jj = 0; jj < VS; ++jj) {
      if (jj < rem) {
        Vec kc[NC];
        KVB_UNROLL for (int c = 0; c < NC; ++c) kc[c] = load_float(kb + (j + jj) * ld + c * VS);
        KVB_UNROLL for (int r = 0; r < RG; ++r) dot(r, kc).store(part[r][jj]);
      } else {
        KVB_UNROLL for (int r = 0; r < RG; ++r) Vec(0.f).store(part[r][jj]);
      }
    }
    KVB_UNROLL for (int r = 0; r < RG; ++r) {
      Vec v[VS];
      KVB_UNROLL for (int jj = 0; jj < VS; ++jj) v[jj] = Vec::loadu(part[r][jj]);
      transpose_sum(v).store(s + r * ld_s + j, static_cast<int>(rem));
    }
  }
}

// o_r += sum_j p[r * ld_p + j] v_j for RG rows and jn values at vb (row stride ld): the accumulators stay in
// registers over the keys, each value row is loaded (and widened) once for the group.
template <int RG, int NC, typename T>
inline void value_group(const float* p, int64_t ld_p, const T* vb, int64_t ld, int64_t jn, float* o, int64_t D) {
  constexpr int64_t VS = Vec::size();
  Vec acc[RG][NC];
  KVB_UNROLL for (int r = 0; r < RG; ++r)
    KVB_UNROLL for (int c = 0; c < NC; ++c) acc[r][c] = Vec::loadu(o + r * D + c * VS);
  for (int64_t j = 0; j < jn; ++j) {
    Vec vc[NC];
    KVB_UNROLL for (int c = 0; c < NC; ++c) vc[c] = load_float(vb + j * ld + c * VS);
    KVB_UNROLL for (int r = 0; r < RG; ++r) {
      const Vec pr(p[r * ld_p + j]);
      KVB_UNROLL for (int c = 0; c < NC; ++c) acc[r][c] = at::vec::fmadd(pr, vc[c], acc[r][c]);
    }
  }
  KVB_UNROLL for (int r = 0; r < RG; ++r)
    KVB_UNROLL for (int c = 0; c < NC; ++c) acc[r][c].store(o + r * D + c * VS);
}

// Any D (NC == 0): one row at a time, vector lanes plus a scalar tail.
template <typename T>
void score_rows_any_d(const float* a, int64_t rows, int64_t D, const T* kb, int64_t ld, int64_t jn, float* s,
                      int64_t ld_s) {
  const int64_t nv = D / Vec::size() * Vec::size();
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < jn; ++j) {
      const T* kj = kb + j * ld;
      Vec acc(0.f);
      for (int64_t d = 0; d < nv; d += Vec::size())
        acc = at::vec::fmadd(Vec::loadu(a + r * D + d), load_float(kj + d), acc);
      float dot = reduce_add(acc);
      for (int64_t d = nv; d < D; ++d) dot += a[r * D + d] * static_cast<float>(kj[d]);
      s[r * ld_s + j] = dot;
    }
}

template <typename T>
void value_rows_any_d(const float* p, int64_t ld_p, int64_t rows, const T* vb, int64_t ld, int64_t jn, float* o,
                      int64_t D) {
  const int64_t nv = D / Vec::size() * Vec::size();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < nv; d += Vec::size()) {
      Vec acc = Vec::loadu(o + r * D + d);
      for (int64_t j = 0; j < jn; ++j) acc = at::vec::fmadd(Vec(p[r * ld_p + j]), load_float(vb + j * ld + d), acc);
      acc.store(o + r * D + d);
    }
    for (int64_t d = nv; d < D; ++d) {
      float acc = o[r * D + d];
      for (int64_t j = 0; j < jn; ++j) acc += p[r * ld_p + j] * static_cast<float>(vb[j * ld + d]);
      o[r * D + d] = acc;
    }
  }
}

// One block's scores / values for all `rows`, in register groups.
template <int NC, typename T>
void score_block(const float* a, int64_t rows, int64_t D, const T* kb, int64_t ld, int64_t jn, float* s, int64_t n) {
  if constexpr (NC == 0) {
    score_rows_any_d(a, rows, D, kb, ld, jn, s, n);
  } else {
    constexpr int G = group_rows(NC);
    for (int64_t r = 0; r < rows; r += G) {
      const float* ar = a + r * D;
      float* sr = s + r * n;
      switch (std::min<int64_t>(G, rows - r)) {
        case 1: score_group<1, NC>(ar, D, kb, ld, jn, sr, n); break;
        case 2: score_group<2, NC>(ar, D, kb, ld, jn, sr, n); break;
        case 3: if constexpr (G >= 3) score_group<3, NC>(ar, D, kb, ld, jn, sr, n); break;
        default: if constexpr (G >= 4) score_group<4, NC>(ar, D, kb, ld, jn, sr, n); break;
      }
    }
  }
}

template <int NC, typename T>
void value_block(const float* p, int64_t n, int64_t rows, const T* vb, int64_t ld, int64_t jn, float* o, int64_t D) {
  if constexpr (NC == 0) {
    value_rows_any_d(p, n, rows, vb, ld, jn, o, D);
  } else {
    constexpr int G = group_rows(NC);
    for (int64_t r = 0; r < rows; r += G) {
      const float* pr = p + r * n;
      float* orow = o + r * D;
      switch (std::min<int64_t>(G, rows - r)) {
        case 1: value_group<1, NC>(pr, n, vb, ld, jn, orow, D); break;
        case 2: value_group<2, NC>(pr, n, vb, ld, jn, orow, D); break;
        case 3: if constexpr (G >= 3) value_group<3, NC>(pr, n, vb, ld, jn, orow, D); break;
        default: if constexpr (G >= 4) value_group<4, NC>(pr, n, vb, ld, jn, orow, D); break;
      }
    }
  }
}

// Rows' row maximum (the max exp_and_sum subtracts), for the partial results of split units.
inline float row_max(const float* row, int64_t n) {
  return at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, row, n);
}

// The direct path for one unit: keys lo .. hi - 1 (block-aligned lo) for `rows` query rows (ordered head-major,
// as in `a`). NC > 0: D == NC vectors (register-blocked loops); NC == 0: any D. An unsplit unit writes its rows
// to out; one part of a split unit writes, per row, its max score m, its sum l of exp(score - m) and its
// unnormalised output o (rows x (D + 2) floats at `partial`), merged by merge_split once every part is done.
template <typename T, int NC>
void paged_unit_direct(const PagedProblem<T>& P, const PagedUnit& u, const int64_t* seen, float* partial,
                       Scratch<float>& a_buf, Scratch<float>& s_buf, Scratch<float>& o_buf, Scratch<float>& inv_buf) {
  const int64_t D = P.D, tn = u.tn, rows = P.G * tn, lo = u.lo, n = u.hi - u.lo, bs = P.block_size;
  float* a = a_buf.get(rows * D);
  float* s = s_buf.get(rows * n);
  float* o = partial ? partial : o_buf.get(rows * D);
  const int64_t row0 = P.query_start[u.b] + u.t0;
  for (int64_t h = 0; h < P.G; ++h)
    for (int64_t t = 0; t < tn; ++t) {
      const T* src = P.q + (row0 + t) * P.qs0 + (u.g * P.G + h) * P.qs1;
      float* dst = a + (h * tn + t) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * P.scale;  // scale folded into q
    }
  const T* kh = P.k + u.g * P.ks0;
  const T* vh = P.v + u.g * P.vs0;
  // Scores, block by block: each key row is read from the pool once and used by all rows.
  for (int64_t j0 = 0; j0 < n; j0 += bs)
    score_block<NC>(a, rows, D, kh + P.slot(u.b, lo + j0) * P.ks1, P.ks1, std::min(bs, n - j0), s + j0, n);
  // Softmax per row over the keys of the range it sees; the rest of the row becomes 0 (adds nothing below).
  float* inv = inv_buf.get(rows);
  float* stats = partial ? partial + rows * D : nullptr;  // m (rows), then l (rows)
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * n;
    const int64_t m = std::clamp<int64_t>(seen[r % tn] - lo, 0, n);
    if (stats) {
      stats[r] = m > 0 ? row_max(sr, m) : -std::numeric_limits<float>::infinity();
      stats[rows + r] = m > 0 ? exp_and_sum(sr, m) : 0.f;
    } else {
      inv[r] = m > 0 ? 1.f / exp_and_sum(sr, m) : 0.f;
    }
    std::fill(sr + m, sr + n, 0.f);
  }
  // o[r] = sum_j p[r, j] v_j, block by block.
  std::fill(o, o + rows * D, 0.f);
  for (int64_t j0 = 0; j0 < n; j0 += bs)
    value_block<NC>(s + j0, n, rows, vh + P.slot(u.b, lo + j0) * P.vs1, P.vs1, std::min(bs, n - j0), o, D);
  if (partial) return;
  for (int64_t h = 0; h < P.G; ++h)
    for (int64_t t = 0; t < tn; ++t) {
      const int64_t r = h * tn + t;
      T* dst = P.out + (row0 + t) * P.os0 + (u.g * P.G + h) * P.os1;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(o[r * D + d] * inv[r]);
    }
}

// Combines the parts of a split unit (u: any of them; `partial`: the first part's results, the others after it)
// into its rows of out: o = sum_i o_i exp(m_i - M) / sum_i l_i exp(m_i - M), M = max_i m_i. A part a row does not
// reach adds exact zeros, and with a single contributing part the arithmetic is the unsplit unit's (exp(0) = 1,
// then o * (1 / l)): a row's bits do not depend on how far the other rows of its tile see.
template <typename T>
void merge_split(const PagedProblem<T>& P, const PagedUnit& u, const float* partial) {
  const int64_t D = P.D, tn = u.tn, rows = P.G * tn, stride = rows * (D + 2), parts = u.parts;
  const int64_t row0 = P.query_start[u.b] + u.t0;
  std::vector<float> acc(D);
  for (int64_t r = 0; r < rows; ++r) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < parts; ++i) mx = std::max(mx, partial[i * stride + rows * D + r]);
    float sum = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    if (mx > -std::numeric_limits<float>::infinity()) {
      for (int64_t i = 0; i < parts; ++i) {
        const float* part = partial + i * stride;
        const float l = part[rows * D + rows + r];
        if (l == 0.f) continue;  // the row sees no key of this part
        const float w = std::exp(part[rows * D + r] - mx);
        sum += l * w;
        for (int64_t d = 0; d < D; ++d) acc[d] += part[r * D + d] * w;
      }
    }
    const float f = sum > 0.f ? 1.f / sum : 0.f;
    const int64_t h = r / tn, t = r % tn;
    T* dst = P.out + (row0 + t) * P.os0 + (u.g * P.G + h) * P.os1;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[d] * f);
  }
}

// Copies logical rows 0 .. n - 1 of sequence b, KV head g, from a pool layer into dst [n, D] (contiguous).
template <typename T>
void gather_rows(const PagedProblem<T>& P, const T* cache, int64_t s0, int64_t s1, int64_t b, int64_t g, int64_t n,
                 T* dst) {
  const int64_t D = P.D, bs = P.block_size;
  for (int64_t j0 = 0; j0 < n; j0 += bs) {
    const int64_t jn = std::min(bs, n - j0);
    const T* src = cache + g * s0 + P.slot(b, j0) * s1;
    if (s1 == D) {
      std::memcpy(dst + j0 * D, src, jn * D * sizeof(T));  // the block's rows are one run in memory
    } else {
      for (int64_t j = 0; j < jn; ++j) std::memcpy(dst + (j0 + j) * D, src + j * s1, D * sizeof(T));
    }
  }
}

// The GEMM path for one unit: gather the visible keys / values, then the dense kernel's three steps.
template <typename T>
void paged_unit_gemm(const PagedProblem<T>& P, const PagedUnit& u, const int64_t* seen, Scratch<T>& a_buf,
                     Scratch<T>& kv_buf, Scratch<float>& s_buf, Scratch<T>& p_buf, Scratch<float>& o_buf,
                     Scratch<float>& inv_buf) {
  constexpr bool kLowPrecision = !std::is_same<T, float>::value;
  const int64_t D = P.D, tn = u.tn, rows = P.G * tn, n = u.hi;
  T* a = a_buf.get(rows * D);
  T* kv = kv_buf.get(2 * n * D);
  float* s = s_buf.get(rows * n);
  float* o = o_buf.get(rows * D);
  float* inv = inv_buf.get(rows);
  const int64_t row0 = P.query_start[u.b] + u.t0;
  for (int64_t h = 0; h < P.G; ++h)
    for (int64_t t = 0; t < tn; ++t)
      std::memcpy(a + (h * tn + t) * D, P.q + (row0 + t) * P.qs0 + (u.g * P.G + h) * P.qs1, D * sizeof(T));
  T* kc = kv;
  T* vc = kv + n * D;
  gather_rows(P, P.k, P.ks0, P.ks1, u.b, u.g, n, kc);
  gather_rows(P, P.v, P.vs0, P.vs1, u.b, u.g, n, vc);
  gemm(rows, n, D, P.scale, a, D, kc, D, true, s, n);
  T* p = kLowPrecision ? p_buf.get(rows * n) : nullptr;
  for (int64_t r = 0; r < rows; ++r) {
    float* row = s + r * n;
    const int64_t m = std::max<int64_t>(seen[r % tn], 0);
    inv[r] = m > 0 ? 1.f / exp_and_sum(row, m) : 0.f;
    if constexpr (kLowPrecision) {
      T* prow = p + r * n;
      at::vec::convert(row, prow, m);
      std::fill(prow + m, prow + n, T(0.f));
    } else {
      std::fill(row + m, row + n, 0.f);
    }
  }
  if constexpr (kLowPrecision) {
    gemm(rows, D, n, 1.f, p, n, vc, D, false, o, D);
  } else {
    gemm(rows, D, n, 1.f, s, n, vc, D, false, o, D);
  }
  for (int64_t h = 0; h < P.G; ++h)
    for (int64_t t = 0; t < tn; ++t) {
      const int64_t r = h * tn + t;
      T* dst = P.out + (row0 + t) * P.os0 + (u.g * P.G + h) * P.os1;
      const float* src = o + r * D;
      const float f = inv[r];
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d] * f);
    }
}

// row_invariant: every unit on the direct path (no MKL GEMM, whose bits follow the call's shape), in tiles of at most
// kDirectMaxRows rows, split by absolute key position wherever it sees more than kSplitKeys keys: a query row's bits
// then depend only on its own position and keys, not on how many queries share the call (a prompt prefilled whole,
// a reuse's suffix, a decode row), which is what lets reuse equal a cold prefill to the bit (issue 61). Otherwise
// tiles of more than kDirectMaxRows rows take the GEMM path (faster for long prompt chunks).
template <typename T>
void paged_kernel(const PagedProblem<T>& P, int64_t B, int64_t tile, bool row_invariant) {
  if (row_invariant) tile = std::max<int64_t>(1, std::min(tile, kDirectMaxRows / P.G));
  // Split direct-path units into parts of this many keys (a multiple of block_size), by absolute key position.
  const int64_t split_keys = std::max<int64_t>(1, kSplitKeys / P.block_size) * P.block_size;
  // Units, with the keys each tile sees: hi = one past the last key of its furthest-seeing query.
  std::vector<PagedUnit> units;
  int64_t groups = 0, partial_floats = 0, max_tn = 0;
  std::vector<int64_t> group_offset;  // start of each split unit's partial results
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = P.query_start[b], nq = P.query_start[b + 1] - q0, kv_len = P.kv_lens[b];
    for (int64_t t0 = 0; t0 < nq; t0 += tile) {
      const int64_t tn = std::min(tile, nq - t0), rows = P.G * tn;
      max_tn = std::max(max_tn, tn);
      int64_t hi = 0;
      for (int64_t t = 0; t < tn; ++t) hi = std::max(hi, std::min(kv_len, P.q_pos[q0 + t0 + t] + int64_t{1}));
      const bool direct = row_invariant || rows <= kDirectMaxRows;
      const int64_t parts = direct && hi > split_keys ? (hi + split_keys - 1) / split_keys : 1;
      for (int64_t g = 0; g < P.Hkv; ++g) {
        if (parts == 1) {
          units.push_back({b, g, t0, tn, 0, hi, (rows + kStreamRows) * hi});
          continue;
        }
        group_offset.push_back(partial_floats);
        partial_floats += parts * rows * (P.D + 2);
        for (int64_t i = 0; i < parts; ++i) {
          const int64_t lo = i * split_keys, end = std::min(hi, lo + split_keys);
          units.push_back({b, g, t0, tn, lo, end, (rows + kStreamRows) * (end - lo), parts, groups, i});
        }
        ++groups;
      }
    }
  }
  if (units.empty()) return;
  std::stable_sort(units.begin(), units.end(), [](const PagedUnit& x, const PagedUnit& y) { return x.cost > y.cost; });
  std::unique_ptr<float[]> partial(partial_floats ? new float[partial_floats] : nullptr);
  std::unique_ptr<std::atomic<int64_t>[]> done(groups ? new std::atomic<int64_t>[groups] : nullptr);
  for (int64_t i = 0; i < groups; ++i) done[i].store(0, std::memory_order_relaxed);
  const int64_t n_units = static_cast<int64_t>(units.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n_units);
  // Head dims of 2..8 vectors (32..128 with AVX-512, 16..64 with AVX2) get the direct path's unrolled loops.
  const int nc = P.D % Vec::size() == 0 && P.D / Vec::size() <= 8 ? static_cast<int>(P.D / Vec::size()) : 0;
  auto worker = [&]() {
    Scratch<float> af, sf, of, invf;
    Scratch<T> at_, kvt, pt;
    std::vector<int64_t> seen(max_tn);
    for (int64_t i = next.fetch_add(1); i < n_units; i = next.fetch_add(1)) {
      const PagedUnit& u = units[i];
      const int64_t q0 = P.query_start[u.b] + u.t0, kv_len = P.kv_lens[u.b];
      // Keys each query of the tile sees (0 .. seen - 1; <= 0: none).
      for (int64_t t = 0; t < u.tn; ++t) seen[t] = std::min(kv_len, P.q_pos[q0 + t] + int64_t{1});
      float* part = u.parts > 1 ? partial.get() + group_offset[u.group] + u.part * P.G * u.tn * (P.D + 2) : nullptr;
      if (u.hi <= 0) {  // no query of the tile sees a key: zeros
        for (int64_t h = 0; h < P.G; ++h)
          for (int64_t t = 0; t < u.tn; ++t)
            std::fill_n(P.out + (q0 + t) * P.os0 + (u.g * P.G + h) * P.os1, P.D, T(0.f));
      } else if (row_invariant || P.G * u.tn <= kDirectMaxRows) {
        switch (nc) {
          case 2: paged_unit_direct<T, 2>(P, u, seen.data(), part, af, sf, of, invf); break;
          case 3: paged_unit_direct<T, 3>(P, u, seen.data(), part, af, sf, of, invf); break;
          case 4: paged_unit_direct<T, 4>(P, u, seen.data(), part, af, sf, of, invf); break;
          case 5: paged_unit_direct<T, 5>(P, u, seen.data(), part, af, sf, of, invf); break;
          case 6: paged_unit_direct<T, 6>(P, u, seen.data(), part, af, sf, of, invf); break;
          case 8: paged_unit_direct<T, 8>(P, u, seen.data(), part, af, sf, of, invf); break;
          default: paged_unit_direct<T, 0>(P, u, seen.data(), part, af, sf, of, invf);
        }
        // The thread that finishes a split unit's last part merges it (acq_rel: it sees the other parts' writes).
        if (part && done[u.group].fetch_add(1, std::memory_order_acq_rel) == u.parts - 1)
          merge_split(P, u, partial.get() + group_offset[u.group]);
      } else {
        paged_unit_gemm(P, u, seen.data(), at_, kvt, sf, pt, of, invf);
      }
    }
  };
  const bool direct_only = row_invariant || std::all_of(units.begin(), units.end(), [&](const PagedUnit& u) {
    return u.hi <= 0 || P.G * u.tn <= kDirectMaxRows;
  });
  KVB_RUN_WORKERS(workers, direct_only, worker);
}

void check_index(const at::Tensor& t, const char* name, int64_t dim0, int64_t dims) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, "paged_forward: ", name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.is_contiguous(), "paged_forward: ", name,
                    " must be a contiguous CPU tensor");
  TORCH_CHECK_VALUE(t.dim() == dims && t.size(0) == dim0, "paged_forward: ", name, " has shape ", t.sizes(),
                    ", expected ", dims, "-D with ", dim0, " rows");
}

}  // namespace

// Returns out ([B, Hq, Lq, D]) after writing it.
at::Tensor cpu_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, double scale,
                             const c10::optional<at::Tensor>& q_positions, const c10::optional<at::Tensor>& kv_start,
                             const c10::optional<at::Tensor>& kv_len, at::Tensor out, int64_t tile) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && out.device().is_cpu(),
              "cpu_kernel: tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && out.dim() == 4, "cpu_kernel: q, k, v, out are 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  q.scalar_type() == out.scalar_type(),
              "cpu_kernel: q, k, v and out must share a dtype");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1 && out.stride(3) == 1,
              "cpu_kernel: the last dimension must be contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(3) == q.size(3) &&
                  q.size(1) % k.size(1) == 0 && out.sizes() == q.sizes(),
              "cpu_kernel: shapes do not match (q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D], Hq % Hkv == 0)");
  TORCH_CHECK(tile > 0, "cpu_kernel: tile must be positive");
  const int64_t B = q.size(0), Lq = q.size(2);
  check_rows(q_positions, "q_positions", B, Lq);
  check_rows(kv_start, "kv_start", B, 0);
  check_rows(kv_len, "kv_len", B, 0);
  const int32_t* qp = q_positions ? q_positions->data_ptr<int32_t>() : nullptr;
  const int32_t* ks = kv_start ? kv_start->data_ptr<int32_t>() : nullptr;
  const int32_t* kl = kv_len ? kv_len->data_ptr<int32_t>() : nullptr;
  if (q.scalar_type() == at::kFloat) {
    attention_kernel<float>(q, k, v, causal, static_cast<float>(scale), qp, ks, kl, out, tile);
  } else if (q.scalar_type() == at::kBFloat16) {
    attention_kernel<at::BFloat16>(q, k, v, causal, static_cast<float>(scale), qp, ks, kl, out, tile);
  } else {
    TORCH_CHECK(false, "cpu_kernel: float32 and bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

// Returns out ([T, Hq, D]) after writing it. Checks everything the kernel's memory accesses depend on (shapes,
// strides, and the values of the index tensors: offsets, lengths, the block ids of every sequence's blocks).
at::Tensor cpu_paged_attention_forward(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_tables, const at::Tensor& kv_lens,
                                       const at::Tensor& query_start, const at::Tensor& q_positions,
                                       int64_t block_size, double scale, at::Tensor out, int64_t tile,
                                       bool row_invariant = false) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu() &&
                        out.device().is_cpu(),
                    "paged_forward: tensors must be on the CPU");
  TORCH_CHECK_VALUE(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3 && out.dim() == 3,
                    "paged_forward: q / out must be [T, Hq, D] and k_cache / v_cache [Hkv, S, D]");
  TORCH_CHECK_TYPE(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type() &&
                       q.scalar_type() == out.scalar_type(),
                   "paged_forward: q, k_cache, v_cache and out must share a dtype");
  TORCH_CHECK_VALUE(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1 && out.stride(2) == 1,
                    "paged_forward: the last dimension must be contiguous");
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == q.size(2) &&
                        k_cache.size(0) > 0 && q.size(1) % k_cache.size(0) == 0 && out.sizes() == q.sizes(),
                    "paged_forward: shapes do not match (q / out [T, Hq, D], k_cache / v_cache [Hkv, S, D], Hq % Hkv "
                    "== 0), got q ", q.sizes(), ", k_cache ", k_cache.sizes(), ", v_cache ", v_cache.sizes(),
                    ", out ", out.sizes());
  TORCH_CHECK_VALUE(block_size > 0 && k_cache.size(1) % block_size == 0, "paged_forward: block_size (", block_size,
                    ") must be positive and divide the pool's slot count (", k_cache.size(1), ")");
  TORCH_CHECK_VALUE(tile > 0, "paged_forward: tile must be positive");
  TORCH_CHECK_VALUE(block_tables.dim() == 2, "paged_forward: block_tables must be 2-D [B, M]");
  const int64_t B = block_tables.size(0), M = block_tables.size(1), T = q.size(0);
  const int64_t num_blocks = k_cache.size(1) / block_size;
  check_index(block_tables, "block_tables", B, 2);
  check_index(kv_lens, "kv_lens", B, 1);
  check_index(query_start, "query_start", B + 1, 1);
  check_index(q_positions, "q_positions", T, 1);
  const int32_t* qs = query_start.data_ptr<int32_t>();
  const int32_t* lens = kv_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  TORCH_CHECK_VALUE(qs[0] == 0 && qs[B] == T, "paged_forward: query_start must run from 0 to T = ", T, ", got ",
                    qs[0], " .. ", qs[B]);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(qs[b + 1] >= qs[b], "paged_forward: query_start must be non-decreasing (sequence ", b, ")");
    TORCH_CHECK_VALUE(lens[b] >= 0 && lens[b] <= M * block_size, "paged_forward: kv_lens[", b, "] = ", lens[b],
                      " is outside [0, ", M * block_size, "] (block_tables has ", M, " blocks of ", block_size,
                      " per sequence)");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i) {
      const int32_t id = tables[b * M + i];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "paged_forward: block_tables[", b, ", ", i, "] = ", id,
                        " is not a block of the pool (", num_blocks, " blocks)");
    }
  }
  if (T == 0) return out;
  auto run = [&](auto* tag) {
    using U = std::remove_pointer_t<decltype(tag)>;
    PagedProblem<U> P{q.data_ptr<U>(), k_cache.data_ptr<U>(), v_cache.data_ptr<U>(), out.data_ptr<U>(), tables, lens,
                      qs, q_positions.data_ptr<int32_t>(), q.size(1), k_cache.size(0), q.size(1) / k_cache.size(0),
                      q.size(2), block_size, M, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                      v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1), static_cast<float>(scale)};
    paged_kernel<U>(P, B, tile, row_invariant);
  };
  if (q.scalar_type() == at::kFloat) {
    run(static_cast<float*>(nullptr));
  } else if (q.scalar_type() == at::kBFloat16) {
    run(static_cast<at::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK_TYPE(false, "paged_forward: float32 and bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

// The quantized decode step (cpu_quant.cpp) compiles this file into its own extension and calls the paged kernel
// directly, so it defines KVBOOST_CPU_ATTENTION_NO_MODULE to leave this module definition out.
#ifndef KVBOOST_CPU_ATTENTION_NO_MODULE
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &cpu_attention_forward, "CPU attention forward (kvboost.kernels_triton contract)", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("causal"), py::arg("scale"), py::arg("q_positions"), py::arg("kv_start"),
        py::arg("kv_len"), py::arg("out"), py::arg("tile"));
  m.def("paged_forward", &cpu_paged_attention_forward,
        "CPU paged attention forward (kvboost/kernels_triton/paged_attention_reference.py contract)", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("kv_lens"), py::arg("query_start"),
        py::arg("q_positions"), py::arg("block_size"), py::arg("scale"), py::arg("out"), py::arg("tile"),
        py::arg("row_invariant") = false);
}
#endif  // KVBOOST_CPU_ATTENTION_NO_MODULE
