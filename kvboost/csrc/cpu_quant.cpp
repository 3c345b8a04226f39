// kvboost's quantized CPU decode step: the projections of a Llama-structured decoder multiplied straight from a
// GGUF model's 4-bit blocks (Q4_0 / Q4_1 / Q4_K, one (scale, min) pair per 32 weights) and the head from its Q8_0
// blocks; norms, RoPE and the K/V write fused around them.
//
// Why: a CPU decode step reads every weight once per token, so its floor is the weights' bytes over the memory
// bandwidth. Dense fp32 weights are 4 bytes each; GGUF's Q4_1 blocks are 0.625 (llama.cpp decodes from them). The
// bundled model's dense weights *are* those blocks dequantized (transformers' GGUF loader), so multiplying the
// blocks computes the same function, only summed in another order, when the activations stay fp32; rounded to
// int16 codes per 32 values (the default) it is that function up to ~1e-5; int8 codes are llama.cpp's arithmetic.
//
// Layouts (built by kvboost/runtime/quant_step.py): tiles of 8 output features (tile_rows below; every build and
// activation), and for int16 / int8 rows on the VNNI build wide tiles of 16 (wide_tile_rows; the same bits, faster).
// Every product reads each weight once for all M rows of the step (the rows are broadcast against a tile's
// features), which is what makes a batched decode step cheaper than M single steps.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

// The paged attention kernel (cpu_paged_attention_forward), compiled into this extension so that a whole decode
// step is one call from Python (the per-layer Python loop and its calls cost ~2 ms of a ~17 ms step).
#define KVBOOST_CPU_ATTENTION_NO_MODULE
#include "work_pool.h"

namespace kvb {
// Where the step's parallel parts run. Torch's OpenMP pool by default. kvb::WorkPool for decode steps (every
// sequence one row: many short products, where a descheduled thread would stall each) once set_decode_pool(true)
// was called: kvboost-server's engine loop does, where HTTP threads and clients share the cores (one client: 7.2
// against 13.9 ms between tokens on 2 Zen 4 cores). Not by default: in a process alone, torch's OpenMP workers,
// woken by the ops between steps, spin on the core the pool's helper needs (engine.generate 106 against 151 tok/s).
// Steps with prompt rows always keep OpenMP (their attention calls MKL, which belongs in an OpenMP region, and two
// pools spinning beside each other fought for the cores: a 32-token quantized prefill took 2.5x as long).
// $KVBOOST_QUANT_POOL=omp | pool overrides both (A/B runs).
inline std::atomic<bool>& decode_pool_requested() {
  static std::atomic<bool> requested{false};
  return requested;
}
inline bool work_pool_enabled() {
  static const int forced = [] {  // -1: not forced; 0: OpenMP; 1: the pool
    const char* v = std::getenv("KVBOOST_QUANT_POOL");
    if (v == nullptr) return -1;
    return std::string(v) == "omp" ? 0 : std::string(v) == "pool" ? 1 : -1;
  }();
  return forced >= 0 ? forced == 1 : decode_pool_requested().load(std::memory_order_relaxed);
}
inline thread_local bool decode_rows_only = true;  // set by decode_layers for its call
struct DecodeRowsOnly {
  bool saved;
  explicit DecodeRowsOnly(bool value) : saved(decode_rows_only) { decode_rows_only = value; }
  ~DecodeRowsOnly() { decode_rows_only = saved; }
};
// body(begin, end) over [0, n) in chunks of about `chunk`, on `threads` threads: on kvb::WorkPool where it is enabled,
// the step has decode rows only and the caller allows it (`pool_ok`), else on torch's OpenMP pool.
template <typename F>
void parallel_chunks(int64_t n, int64_t chunk, int64_t threads, const F& body, bool pool_ok = true) {
  if (pool_ok && decode_rows_only && work_pool_enabled()) WorkPool::instance().run(n, chunk, threads, body);
  else at::parallel_for(0, n, chunk, body);
}
// body(r0, r1) over the rows [0, M) of a step: split over `threads` from kParallelRows rows (a prompt chunk's, or a
// batch's), one call below (the fork would cost more than the rows).
template <typename F>
void parallel_rows(int64_t M, const F& body) {
  constexpr int64_t kParallelRows = 16;
  const int64_t threads = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
  if (M >= kParallelRows && threads > 1) parallel_chunks(M, std::max<int64_t>(4, M / (2 * threads)), threads, body);
  else if (M > 0) body(0, M);
}
}  // namespace kvb

// The attention kernel's workers run on the same pool as the products (see work_pool.h for why) where no unit calls
// MKL (decode rows); a prompt chunk's GEMM units keep torch's OpenMP pool.
#define KVB_RUN_WORKERS(workers, direct_only, body) \
  kvb::parallel_chunks(workers, 1, workers, [&](int64_t, int64_t) { body(); }, direct_only)
#include "cpu_attention.cpp"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVB_AVX2 1
#endif
// AVX-512 VNNI on 256-bit vectors (AMD Zen 4, Intel Xeon since Cascade Lake): one vpdpwssd / vpdpbusd per product
// where AVX2 needs a multiply-add and an add (int16) or three instructions (int8). The integer sums are exact either
// way, so both builds give the same bits (tests/test_quant_step.py compares them).
#if defined(KVB_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__) && defined(__AVX512BW__)
#define KVB_VNNI 1
#endif
// The 256-bit dot products of tile_rows: AVX-512 VNNI's (EVEX) where the build has them, else AVX-VNNI's VEX-encoded
// ones (Intel client CPUs from Alder Lake, which have no AVX-512): the same integer sums, fewer instructions than
// AVX2's vpmaddwd + vpaddd (int16) and vpmaddubsw + vpmaddwd + vpaddd (int8).
#if defined(KVB_VNNI)
#define KVB_DOT256 1
#define KVB_DPWSSD256(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#define KVB_DPBUSD256(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
#elif defined(KVB_AVX2) && defined(__AVXVNNI__)
#define KVB_DOT256 1
#define KVB_AVXVNNI 1
#define KVB_DPWSSD256(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#define KVB_DPBUSD256(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#endif
// AMX-INT8 tiles (Intel Xeon since Sapphire Rapids): the amx build is the VNNI build plus amx_tile_product for
// products of kAmxMinRows rows or more.
#if defined(KVB_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVB_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#include <cerrno>
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kTile = 8;      // output features per tile: one AVX2 vector of fp32 / int32 results
constexpr int64_t kWideTile = 16;  // output features per wide tile (VNNI builds: wide_tile_rows)
// Rows of the step sharing each unpacked tile of weights: 4 in AVX2's 16 vector registers (2 accumulators a row),
// 8 in AVX-512's 32.
#ifdef KVB_VNNI
constexpr int64_t kRowBlock = 8;
#else
constexpr int64_t kRowBlock = 4;
#endif
// Rows of tile_row_pairs' pass (VNNI, int16): 16 rows share each unpacked quad of weights (16 int32 accumulators and
// 8 fp32 ones of 32 registers); from memory, at 16-64 rows, 1.03-1.07x the products of 8-row passes on a Zen 4.
constexpr int64_t kPairBlock = 16;

// How a product sees the activations (the Python side's ACTIVATIONS): exact fp32, or each row's 32-value groups
// rounded to int8 / int16 codes with a scale of their own.
constexpr int64_t kActFp32 = 0, kActInt8 = 1, kActInt16 = 2;

// The rows of a product as the kernels read them. fp32: `x` itself. int8 / int16 (llama.cpp's arithmetic is int8):
// each row's 32-value group rounded to codes `q` with scale `d` = max|x| / 127 (or / 32767), products in integers,
// scaled once per group. int16's rounding step is 3e-5 of the group's largest value, so two runs whose inputs differ
// by fp32 noise round alike but for flips that move the logits by ~1e-5 (int8's steps move them by ~1e-2: greedy
// tokens of reuse and cold part at near ties). `sum` is each group's exact fp32 sum (the q4 min term).
struct Rows {
  const float* x = nullptr;
  std::vector<int8_t> q8;
  std::vector<int16_t> q16;
  // `d` and `sum` group-major, [G, Mp]: a group's rows side by side, so that the int16 row-pair kernel
  // (tile_row_pairs; VNNI builds, 2 rows or more) broadcasts two rows' values as one 64-bit load. Mp is M, rounded
  // up to even for that kernel, whose pad row (zero codes, d and sum 0) is computed and not stored.
  std::vector<float> d;    // [G, Mp]
  std::vector<float> sum;  // [G, Mp]
  int64_t K = 0, G = 0, Mp = 0;
};

#ifdef KVB_VNNI
inline bool row_pairs(int64_t M, int64_t act) { return act == kActInt16 && M >= 2; }
#else
inline bool row_pairs(int64_t, int64_t) { return false; }
#endif

// A tile's per-group scales (or mins), as the layouts above order them: fp32, or fp16 where every value of the
// weight is an fp16 (Q4_0 / Q4_1 / Q8_0 store theirs so; kvboost/runtime/quant_step.py decides). fp16 is converted
// to fp32 exactly, so both give the same bits; fp16 is 4 bytes less per 32 weights to stream (24 -> 20 for 4-bit
// blocks with a min), and a one-row decode step streams every weight from memory.
struct GroupVals {
  const void* p = nullptr;
  bool half = false;
  GroupVals at(int64_t i) const {
    return {half ? static_cast<const void*>(static_cast<const uint16_t*>(p) + i)
                 : static_cast<const void*>(static_cast<const float*>(p) + i),
            half};
  }
  float operator[](int64_t i) const {
    return half ? static_cast<float>(c10::Half(static_cast<const uint16_t*>(p)[i], c10::Half::from_bits()))
                : static_cast<const float*>(p)[i];
  }
#ifdef KVB_AVX2
  __m256 load8(int64_t i) const {  // values i .. i+7
    return half ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)))
                : _mm256_loadu_ps(static_cast<const float*>(p) + i);
  }
#endif
#ifdef KVB_VNNI
  __m512 load16(int64_t i) const {  // values i .. i+15
    if (!half) return _mm512_loadu_ps(static_cast<const float*>(p) + i);
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)));
  }
#endif
};

// A 32-value group's fp32 sum in one fixed order, the same in every build: lane i < 8 adds p[i], p[i+8], p[i+16],
// p[i+24] in turn, then lanes i and i+4, then i and i+2, then the last two. (A left-to-right sum is a chain of 32
// dependent adds: it was most of the rows' preparation, which runs before the products of every step.)
inline float group_sum(const float* p) {
#ifdef KVB_AVX2
  __m256 v = _mm256_loadu_ps(p);
  v = _mm256_add_ps(v, _mm256_loadu_ps(p + 8));
  v = _mm256_add_ps(v, _mm256_loadu_ps(p + 16));
  v = _mm256_add_ps(v, _mm256_loadu_ps(p + 24));
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // lanes i + (i + 4)
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));                                         // (0 + 2), (1 + 3)
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_shuffle_ps(a, a, 1)));
#else
  float lane[8];
  for (int i = 0; i < 8; ++i) lane[i] = ((p[i] + p[i + 8]) + p[i + 16]) + p[i + 24];
  for (int i = 0; i < 4; ++i) lane[i] = lane[i] + lane[i + 4];
  return (lane[0] + lane[2]) + (lane[1] + lane[3]);
#endif
}

// One row's group rounded to int8 / int16 codes `q` (to nearest, ties to even, as std::nearbyint) with scale
// d = max|x| / qmax; returns d.
template <typename Code>
float round_group(const float* p, float qmax, Code* q) {
#ifdef KVB_AVX2
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 32; i += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(p + i)));
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  const float amax = _mm_cvtss_f32(_mm_max_ss(a, _mm_shuffle_ps(a, a, 1)));
  const float d = amax / qmax, inv = d > 0.f ? 1.f / d : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256i c[4];
  for (int i = 0; i < 4; ++i)
    c[i] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(p + 8 * i), vinv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  // packs work within 128-bit halves: put the values back in order (codes are within int16 / int8 range)
  const __m256i w01 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[0], c[1]), 0xD8);
  const __m256i w23 = _mm256_permute4x64_epi64(_mm256_packs_epi32(c[2], c[3]), 0xD8);
  if constexpr (sizeof(Code) == 2) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), w01);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), w23);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                        _mm256_permute4x64_epi64(_mm256_packs_epi16(w01, w23), 0xD8));
  }
  return d;
#else
  float amax = 0.f;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(p[i]));
  const float d = amax / qmax, inv = d > 0.f ? 1.f / d : 0.f;
  for (int i = 0; i < 32; ++i) q[i] = static_cast<Code>(std::nearbyint(p[i] * inv));
  return d;
#endif
}

Rows prepare_rows(const float* x, int64_t M, int64_t K, int64_t act) {
  Rows rows;
  rows.x = x;
  rows.K = K;
  rows.G = K / kGroup;
  const int64_t G = rows.G;
  const int64_t Mp = rows.Mp = row_pairs(M, act) ? (M + 1) / 2 * 2 : M;
  rows.sum.assign(G * Mp, 0.f);
  if (act != kActFp32) rows.d.assign(G * Mp, 0.f);
  if (act == kActInt8) rows.q8.resize(M * K);
  if (act == kActInt16) rows.q16.resize(Mp * K);  // the pad row (if any) stays zero
  auto prepare = [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const float* p = x + r * K + g * kGroup;
        rows.sum[g * Mp + r] = group_sum(p);
        if (act == kActInt8) rows.d[g * Mp + r] = round_group(p, 127.f, rows.q8.data() + r * K + g * kGroup);
        else if (act == kActInt16) rows.d[g * Mp + r] = round_group(p, 32767.f, rows.q16.data() + r * K + g * kGroup);
      }
  };
  kvb::parallel_rows(M, prepare);  // each row's values are its own: the same bits on any thread
  return rows;
}

// One tile of a product: out[r, 8t + j] (+)= sum_k x[r, k] w[8t + j, k] (+ bias) for rows [r0, r0 + RB).
//
// Layouts (built by kvboost/runtime/quant_step.py): a weight's output features in tiles of 8, so that one vector
// holds one tile's 8 results and a weight read once serves every row of the step (the rows are broadcast):
//   q4 [N, K]: codes uint8 [N/8][K/4][16]: for tile t and 4 consecutive k, byte 2j holds w[8t+j, k] (low nibble)
//      and w[8t+j, k+2] (high), byte 2j+1 w[8t+j, k+1] and w[8t+j, k+3]; scale and min fp32 or fp16 (GroupVals)
//      [N/8][K/32][8];
//      w = q * scale + min.
//   q8 [N, K]: codes int8 [N/8][K/2][16]: byte 2j = w[8t+j, k], byte 2j+1 = w[8t+j, k+1]; scale [N/8][K/32][8].
// Per 32-value group each row's integer products are summed exactly in int32 (int16 rows: vpmaddwd on pairs of k;
// int8: vpmaddubsw on fours), then scaled once: fa += float(isum) * (scale * d_row) (+ min * sum_row). Each row's
// arithmetic is the same whichever rows share its block, so a row's result does not depend on the batch.
#ifdef KVB_AVX2
template <bool Q4>
struct TileCodes {  // a tile's codes for 4 consecutive k (one "quad")
  const uint8_t* base;
  // int16 pairs: p01 lanes (w[j, k], w[j, k+1]), p23 (w[j, k+2], w[j, k+3])
  inline void pairs(int64_t quad, __m256i& p01, __m256i& p23) const {
    if constexpr (Q4) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 16 * quad));
      const __m128i low4 = _mm_set1_epi8(0x0F);
      p01 = _mm256_cvtepu8_epi16(_mm_and_si128(b, low4));
      p23 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low4));
    } else {
      p01 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 32 * quad)));
      p23 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 32 * quad + 16)));
    }
  }
  // bytes: lane j holds w[j, k..k+3] (q4: unsigned 0..15; q8: signed)
  inline __m256i fours(int64_t quad) const {
    __m128i a, b;
    if constexpr (Q4) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 16 * quad));
      const __m128i low4 = _mm_set1_epi8(0x0F);
      a = _mm_and_si128(raw, low4);
      b = _mm_and_si128(_mm_srli_epi16(raw, 4), low4);
    } else {
      a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 32 * quad));
      b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(base + 32 * quad + 16));
    }
    return _mm256_set_m128i(_mm_unpackhi_epi16(a, b), _mm_unpacklo_epi16(a, b));
  }
};

inline __m256i bcast32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

template <int RB, int64_t Act, bool Q4>
void tile_rows(const Rows& xr, int64_t r0, const uint8_t* ct, GroupVals st, GroupVals mt, float* out,
               int64_t ldo, const float* bias, bool accumulate) {
  const int64_t K = xr.K, G = xr.G;
  constexpr int64_t kQuadBytes = Q4 ? 16 : 32;
  __m256 fa[RB];
  for (int r = 0; r < RB; ++r) fa[r] = _mm256_setzero_ps();
  [[maybe_unused]] const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g) {
    const TileCodes<Q4> codes{ct + g * 8 * kQuadBytes};
    const __m256 sc = st.load8(g * kTile);
    if constexpr (Act == kActFp32) {
      __m256 ga[RB];
      for (int r = 0; r < RB; ++r) ga[r] = _mm256_setzero_ps();
      const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
      for (int64_t quad = 0; quad < 8; ++quad) {
        __m256i p01, p23;
        codes.pairs(quad, p01, p23);
        __m256 w[4];
        if constexpr (Q4) {  // unsigned codes: the low half of each lane, then the high half
          w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(p01, lo16));
          w[1] = _mm256_cvtepi32_ps(_mm256_srli_epi32(p01, 16));
          w[2] = _mm256_cvtepi32_ps(_mm256_and_si256(p23, lo16));
          w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(p23, 16));
        } else {  // signed: shift up, then arithmetic shift down
          w[0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(p01, 16), 16));
          w[1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(p01, 16));
          w[2] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(p23, 16), 16));
          w[3] = _mm256_cvtepi32_ps(_mm256_srai_epi32(p23, 16));
        }
        for (int r = 0; r < RB; ++r) {
          const float* xk = xr.x + (r0 + r) * K + g * kGroup + 4 * quad;
          for (int i = 0; i < 4; ++i) ga[r] = _mm256_fmadd_ps(w[i], _mm256_set1_ps(xk[i]), ga[r]);
        }
      }
      for (int r = 0; r < RB; ++r) fa[r] = _mm256_fmadd_ps(ga[r], sc, fa[r]);
    } else {
      __m256i ia[RB];
      for (int r = 0; r < RB; ++r) ia[r] = _mm256_setzero_si256();
#ifdef KVB_DOT256
      __m256i ib[RB];
      for (int r = 0; r < RB; ++r) ib[r] = _mm256_setzero_si256();
#endif
#pragma GCC unroll 2
      for (int64_t quad = 0; quad < 8; ++quad) {
        if constexpr (Act == kActInt16) {
          __m256i p01, p23;
          codes.pairs(quad, p01, p23);
          for (int r = 0; r < RB; ++r) {
            const int16_t* xk = xr.q16.data() + (r0 + r) * K + g * kGroup + 4 * quad;
#ifdef KVB_DOT256  // two accumulators a row: one vpdpwssd's latency between dependent ones, not two
            ia[r] = KVB_DPWSSD256(ia[r], p01, bcast32(xk));
            ib[r] = KVB_DPWSSD256(ib[r], p23, bcast32(xk + 2));
#else
            ia[r] = _mm256_add_epi32(ia[r], _mm256_madd_epi16(p01, bcast32(xk)));
            ia[r] = _mm256_add_epi32(ia[r], _mm256_madd_epi16(p23, bcast32(xk + 2)));
#endif
          }
        } else {  // int8: unsigned x signed bytes (vpmaddubsw / vpdpbusd); q8's signed codes give |w| and their sign to x
          const __m256i w = codes.fours(quad);
          const __m256i aw = Q4 ? w : _mm256_sign_epi8(w, w);
          for (int r = 0; r < RB; ++r) {
            __m256i xv = bcast32(xr.q8.data() + (r0 + r) * K + g * kGroup + 4 * quad);
            if constexpr (!Q4) xv = _mm256_sign_epi8(xv, w);
#ifdef KVB_DOT256  // the 4 products summed in int32 at once (vpmaddubsw's int16 pair sums cannot saturate here either)
            ia[r] = KVB_DPBUSD256(ia[r], aw, xv);
#else
            ia[r] = _mm256_add_epi32(ia[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones));
#endif
          }
        }
      }
#ifdef KVB_DOT256
      for (int r = 0; r < RB; ++r) ia[r] = _mm256_add_epi32(ia[r], ib[r]);
#endif
      for (int r = 0; r < RB; ++r) {
        const __m256 s = _mm256_mul_ps(sc, _mm256_set1_ps(xr.d[g * xr.Mp + r0 + r]));
        fa[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[r]), s, fa[r]);
      }
    }
    if constexpr (Q4) {
      const __m256 mn = mt.load8(g * kTile);
      for (int r = 0; r < RB; ++r) fa[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xr.sum[g * xr.Mp + r0 + r]), fa[r]);
    }
  }
  const __m256 b = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  for (int r = 0; r < RB; ++r) {
    float* o = out + (r0 + r) * ldo;
    __m256 v = _mm256_add_ps(fa[r], b);
    if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(o), v);
    _mm256_storeu_ps(o, v);
  }
}
#endif

#ifdef KVB_VNNI
// int16 rows on 512-bit vectors, two rows at a time: the same products and the same fp32 operations per output as
// tile_rows<RB, kActInt16> (so the same bits), with one vpdpwssd per row and quad instead of two, one broadcast
// instead of two, and one weight unpacking per quad for 16 rows (kPairBlock). Zen 4 runs 1 zmm or 2 ymm vpdpwssd a
// cycle (4 cycles' latency), so the peak is the same; what tile_rows loses is the work around it: in a standalone
// loop on one Zen 4 core at 8-32 rows, tile_rows reached ~50% of that peak and this ~65% (tests/test_quant_step.py
// checks the bits, experiments/bench/bench_quant_products.py the speed). One row stays on tile_rows: it streams the
// weights from memory, and this adds nothing there.
//
// Per 4 consecutive k ("quad") one zmm holds the tile's weights with dword lane 2j = (w[j, k], w[j, k+1]) and 2j+1 =
// (w[j, k+2], w[j, k+3]) (TileCodes::fours widened to int16), so a row's 4 int16 codes broadcast as one 64-bit value
// and one vpdpwssd adds all 32 products of the quad. After a group's 8 quads, lanes 2j and 2j+1 add up (in int32, so
// exactly) to feature j's group sum; two rows share one fp32 vector from there on: lane 2j row r, lane 2j+1 row r+1.
// RB rows (even) starting at r0; rows at or past `valid` (the pad row) are computed and not stored.
inline __m512i bcast64(const void* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm512_set1_epi64(v);
}

inline __m512 bcast_pair(const float* p) {  // p[0] in even lanes, p[1] in odd ones
  double v;
  std::memcpy(&v, p, 8);
  return _mm512_castpd_ps(_mm512_set1_pd(v));
}

template <int RB, bool Q4>
void tile_row_pairs(const Rows& xr, int64_t r0, int64_t valid, const uint8_t* ct, GroupVals st, GroupVals mt,
                    float* out, int64_t ldo, const float* bias, bool accumulate) {
  static_assert(RB % 2 == 0 && RB >= 2, "rows come in pairs");
  constexpr int P = RB / 2;
  constexpr int64_t kQuadBytes = Q4 ? 16 : 32;
  const int64_t K = xr.K, G = xr.G, Mp = xr.Mp;
  const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const int16_t* xb = xr.q16.data() + r0 * K;
  __m512 fa[P];
  for (int p = 0; p < P; ++p) fa[p] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const TileCodes<Q4> codes{ct + g * 8 * kQuadBytes};
    auto weights = [&](int64_t quad) {
      return Q4 ? _mm512_cvtepu8_epi16(codes.fours(quad)) : _mm512_cvtepi8_epi16(codes.fours(quad));
    };
    __m512i ia[RB];
    const __m512i w0 = weights(0);
    for (int r = 0; r < RB; ++r) ia[r] = _mm512_madd_epi16(w0, bcast64(xb + r * K + g * kGroup));
#pragma GCC unroll 7
    for (int64_t quad = 1; quad < 8; ++quad) {
      const __m512i w = weights(quad);
      for (int r = 0; r < RB; ++r) ia[r] = _mm512_dpwssd_epi32(ia[r], w, bcast64(xb + r * K + g * kGroup + 4 * quad));
    }
    const __m512 sc = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(st.load8(g * kTile)));
    [[maybe_unused]] __m512 mn;
    if constexpr (Q4) mn = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(mt.load8(g * kTile)));
    for (int p = 0; p < P; ++p) {
      // row 2p's sums into even lanes, row 2p+1's into odd ones
      const __m512i even = _mm512_add_epi32(ia[2 * p], _mm512_srli_epi64(ia[2 * p], 32));
      const __m512i odd = _mm512_add_epi32(ia[2 * p + 1], _mm512_slli_epi64(ia[2 * p + 1], 32));
      const __m512i sums = _mm512_mask_blend_epi32(0xAAAA, even, odd);
      const __m512 s = _mm512_mul_ps(sc, bcast_pair(xr.d.data() + g * Mp + r0 + 2 * p));
      fa[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), s, fa[p]);
      if constexpr (Q4) fa[p] = _mm512_fmadd_ps(mn, bcast_pair(xr.sum.data() + g * Mp + r0 + 2 * p), fa[p]);
    }
  }
  const __m512i split = _mm512_set_epi32(15, 13, 11, 9, 7, 5, 3, 1, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m256 b = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  for (int p = 0; p < P; ++p) {
    const __m512 both = _mm512_permutexvar_ps(split, fa[p]);  // row 2p in the low half, row 2p+1 in the high one
    for (int half = 0; half < 2 && r0 + 2 * p + half < valid; ++half) {
      float* o = out + (r0 + 2 * p + half) * ldo;
      __m256 v = _mm256_add_ps(half ? _mm512_extractf32x8_ps(both, 1) : _mm512_castps512_ps256(both), b);
      if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(o), v);
      _mm256_storeu_ps(o, v);
    }
  }
}

// The last M - r0 (< kPairBlock) rows, as the fewest RB rows that hold them (the pad row fills an odd count).
template <int RB, bool Q4>
void tail_row_pairs(const Rows& xr, int64_t r0, int64_t M, const uint8_t* ct, GroupVals st, GroupVals mt,
                    float* out, int64_t ldo, const float* bias, bool accumulate) {
  if constexpr (RB >= 2) {
    if (M - r0 > RB - 2) tile_row_pairs<RB, Q4>(xr, r0, M, ct, st, mt, out, ldo, bias, accumulate);
    else tail_row_pairs<RB - 2, Q4>(xr, r0, M, ct, st, mt, out, ldo, bias, accumulate);
  }
}

// Rows against 4-bit weights in tiles of 16 output features ("wide" tiles; VNNI builds), the layouts
// kvboost/runtime/quant_step.py builds for int8 and int16 activations there (tiled_product reads them). For tile t and
// 8 consecutive k (an "octet"), 64 bytes:
//   int8 rows, "quads": codes uint8 [N/16][K/8][64]: byte 4j+i holds w[16t+j, k+i] (low nibble) and w[16t+j, k+4+i]
//     (high). A mask and a shift give two vpdpbusd operands, dword lane j feature j's 4 consecutive k.
//   int16 rows, "words": codes uint8 [N/16][K/8][32][2], 32 little-endian 16-bit words: word 2j+i holds w[16t+j,
//     k+2n+i] in its nibble n (bits 4n..4n+3). Masks and shifts of 16-bit lanes give four vpdpwssd operands, dword
//     lane j feature j's pair (k+2n, k+2n+1), each against a row's pair of codes broadcast: no widening shuffle and
//     no gather of lanes after the group (the quads' int16 kernel spent six shuffles per octet and two permutes per
//     row and group; the words' were 1.09x its products at 8-32 rows, in cache, on a Zen 4).
//   scale and min [N/16][K/32][16] (fp32 or fp16, GroupVals), both layouts.
// Why wide: the tiles of 8 spend three shuffles and three logic operations on each quad of 32 weights (int16 rows one
// widening more); here one 512-bit load holds 128 weights. A tile's codes are one contiguous stream, prefetched
// kPrefetchBytes ahead. The integer group sums are exact and the fp32 operations per output and group are
// tile_rows<RB, Act>'s, in its order, so every layout gives the same bits (tests/test_quant_step.py).
constexpr int64_t kWideRows = 8;          // rows sharing each unpacked octet (int32 and fp32 accumulators: 24-32)
constexpr int64_t kPrefetchBytes = 2048;  // ~8 groups ahead; from memory, 2-4 KB were best on a Zen 4

// Four bytes at p in every dword lane (the compiler reads them straight from memory: see the int16 rows below).
inline __m512i bcast32_512(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int RB, int64_t Act>
void wide_tile_rows(const Rows& xr, int64_t r0, const uint8_t* ct, GroupVals st, GroupVals mt, float* out,
                    int64_t ldo, const float* bias, bool accumulate, bool prefetch) {
  static_assert(Act == kActInt8 || Act == kActInt16, "wide tiles take int8 or int16 rows");
  // Two accumulators a row where few rows cannot hide the dot products' latency, one where 5 or more rows do.
  constexpr int NA = RB <= 4 ? 2 : 1;
  const int64_t K = xr.K, G = xr.G;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  [[maybe_unused]] const __m512i word_low4 = _mm512_set1_epi16(0x000F);
  __m512 fa[RB];
  for (int r = 0; r < RB; ++r) fa[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g, ct += 4 * 64) {
    if (prefetch)
      for (int64_t line = 0; line < 4 * 64; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ct) + kPrefetchBytes + line, _MM_HINT_T0);
    __m512i ia[RB][NA];
    for (int r = 0; r < RB; ++r)
      for (int a = 0; a < NA; ++a) ia[r][a] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int64_t o = 0; o < 4; ++o) {
      const __m512i v = _mm512_loadu_si512(ct + 64 * o);
      if constexpr (Act == kActInt8) {
        const __m512i lo = _mm512_and_si512(v, low4);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        for (int r = 0; r < RB; ++r) {
          const int8_t* xk = xr.q8.data() + (r0 + r) * K + g * kGroup + 8 * o;
          ia[r][0] = _mm512_dpbusd_epi32(ia[r][0], lo, bcast32_512(xk));
          ia[r][NA - 1] = _mm512_dpbusd_epi32(ia[r][NA - 1], hi, bcast32_512(xk + 4));
        }
      } else {
        const __m512i n0 = _mm512_and_si512(v, word_low4);  // lane j: feature j's codes for k, k+1
        const __m512i n1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), word_low4);  // k+2, k+3
        const __m512i n2 = _mm512_and_si512(_mm512_srli_epi16(v, 8), word_low4);  // k+4, k+5
        const __m512i n3 = _mm512_srli_epi16(v, 12);                               // k+6, k+7
        for (int r = 0; r < RB; ++r) {
          const int16_t* xk = xr.q16.data() + (r0 + r) * K + g * kGroup + 8 * o;
          // the row's codes for (k, k+1), (k+2, k+3), ..., each pair broadcast straight from memory (one 16-byte
          // read split into general registers first made the kernel ~25% slower)
          ia[r][0] = _mm512_dpwssd_epi32(ia[r][0], n0, bcast32_512(xk));
          ia[r][NA - 1] = _mm512_dpwssd_epi32(ia[r][NA - 1], n1, bcast32_512(xk + 2));
          ia[r][0] = _mm512_dpwssd_epi32(ia[r][0], n2, bcast32_512(xk + 4));
          ia[r][NA - 1] = _mm512_dpwssd_epi32(ia[r][NA - 1], n3, bcast32_512(xk + 6));
        }
      }
    }
    const __m512 sc = st.load16(g * kWideTile);
    const __m512 mn = mt.load16(g * kWideTile);
    for (int r = 0; r < RB; ++r) {
      const __m512i sums = NA == 2 ? _mm512_add_epi32(ia[r][0], ia[r][1]) : ia[r][0];
      const __m512 s = _mm512_mul_ps(sc, _mm512_set1_ps(xr.d[g * xr.Mp + r0 + r]));
      fa[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), s, fa[r]);
      fa[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xr.sum[g * xr.Mp + r0 + r]), fa[r]);
    }
  }
  const __m512 b = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < RB; ++r) {
    float* o = out + (r0 + r) * ldo;
    __m512 v = _mm512_add_ps(fa[r], b);
    if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(o), v);
    _mm512_storeu_ps(o, v);
  }
}

// The last rem (< kWideRows) rows in one pass of wide_tile_rows<rem, Act>.
template <int RB, int64_t Act>
void wide_tail_rows(const Rows& xr, int64_t r0, int64_t rem, const uint8_t* ct, GroupVals st, GroupVals mt,
                    float* out, int64_t ldo, const float* bias, bool accumulate, bool prefetch) {
  if constexpr (RB >= 1) {
    if (rem == RB) wide_tile_rows<RB, Act>(xr, r0, ct, st, mt, out, ldo, bias, accumulate, prefetch);
    else wide_tail_rows<RB - 1, Act>(xr, r0, rem, ct, st, mt, out, ldo, bias, accumulate, prefetch);
  }
}

// A tile's row blocks run one after the other while its codes sit in L1; only the first streams (and prefetches)
// them from memory.
template <int64_t Act>
void wide_tile_all_rows(const Rows& xr, int64_t M, const uint8_t* ct, GroupVals st, GroupVals mt, float* out,
                        int64_t ldo, const float* bias, bool accumulate) {
  int64_t r0 = 0;
  for (; r0 + kWideRows <= M; r0 += kWideRows)
    wide_tile_rows<kWideRows, Act>(xr, r0, ct, st, mt, out, ldo, bias, accumulate, r0 == 0);
  if (M > r0) wide_tail_rows<kWideRows - 1, Act>(xr, r0, M - r0, ct, st, mt, out, ldo, bias, accumulate, r0 == 0);
}
#endif


#ifdef KVB_AMX
// AMX-INT8: a product's integer group sums on tiles, the fp32 scaling as everywhere else.
//
// Per 32-value group, tile products C[16 rows][NT features] (int32) = A[16 rows][32 codes] . B[8 quads][NT x 4
// codes]: one tdpbssd per group for int8 rows; for int16 rows each code x split as x = 256 * hi + lo (hi = x >> 8
// signed, lo = x & 0xFF unsigned), tdpbssd on the high bytes and tdpbusd on the low ones, combined as
// (hi_sum << 8) + lo_sum in int32 -- the same exact integer as the VNNI kernels' sum (|sum| <= 32 * 32767 * 128 <
// 2^31). A tile's weights are the same codes the other kernels read (4-bit codes 0..15 are the same bytes signed or
// unsigned; 8-bit ones signed), unpacked into B tiles for all its groups once and read by every 16-row block. A tile
// product may not span two groups (each has its own scale), so it covers exactly one group and C goes to memory
// after each: then fa += float(isum) * (scale * d_row) and fa += min * sum_row per output (the 16 rows' fa in
// registers across the groups), tile_rows' operations in its order, so the same bits. As measured (2-core Xeon,
// experiments/results/README.md "Per CPU kind") this is slower than the AVX-512 VNNI kernels at 16-32 rows: each
// group's tile product waits on the last one's store (one group per product), so the amx build is opt-in.
// Layouts: tiles of 8 (NT = 8: TileCodes::fours is B's row for a quad) and wide tiles of 16
// (NT = 16): quads' low / high nibbles are B's rows for k..k+3 / k+4..k+7; words' nibbles n0 | n1 << 8 give feature
// j's codes in the order (k, k+2, k+1, k+3), so the rows' codes are stored in that order for them (AmxRows).
constexpr int64_t kAmxMinRows = 16;  // fewer rows run the VNNI kernels (experiments/results/README.md, "AMX")
constexpr int64_t kAmxRows = 16;     // rows of an A tile

// Linux hands out the tile state only to a process that asks (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
// once; it covers every thread); without it the first tile instruction kills the process. Empty: granted.
const std::string& amx_state() {
  static const std::string reason = [] {
    constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
      return std::string("arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) failed: ") + std::strerror(errno);
    return std::string();
  }();
  return reason;
}
std::string amx_unavailable_reason() { return amx_state(); }
// Products run on tiles so far in this process (tests check the kernel ran; one relaxed add per product).
std::atomic<int64_t> amx_products{0};

struct alignas(64) AmxConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0, 1: C (16 rows x NT int32); 2, 3: A (16 rows x 32 codes: int8 rows, or int16's high / low bytes);
// 4: B (8 quads x NT features x 4 codes). Per thread: loaded at the start of each chunk of tiles.
inline void amx_configure(int64_t NT) {
  AmxConfig c;
  for (int t = 0; t < 4; ++t) {
    c.rows[t] = kAmxRows;
    c.colsb[t] = t < 2 ? uint16_t(4 * NT) : uint16_t(kGroup);
  }
  c.rows[4] = kGroup / 4;
  c.colsb[4] = uint16_t(4 * NT);
  _tile_loadconfig(&c);
}

// The rows as A tiles read them: Mp (M rounded up to 16; the pad rows zero, computed and not stored) rows of K
// codes: int8 rows in `a`; int16 rows' high bytes in `a`, low bytes in `b`; for words, each 4 codes in the order
// (0, 2, 1, 3) (see above).
struct AmxRows {
  std::vector<int8_t> a, b;
  int64_t Mp = 0;
};

AmxRows amx_rows(const Rows& xr, int64_t M, int64_t act, bool words) {
  AmxRows out;
  const int64_t K = xr.K;
  out.Mp = (M + kAmxRows - 1) / kAmxRows * kAmxRows;
  out.a.assign(out.Mp * K, 0);
  if (act == kActInt8) {
    std::memcpy(out.a.data(), xr.q8.data(), M * K);
    return out;
  }
  out.b.assign(out.Mp * K, 0);
  for (int64_t i = 0; i < M * K; ++i) {
    const int64_t at = words ? (i & ~int64_t(3)) | ((i & 1) << 1) | ((i >> 1) & 1) : i;  // swaps codes 1 and 2
    const int16_t v = xr.q16[i];
    out.a[at] = static_cast<int8_t>(v >> 8);
    out.b[at] = static_cast<int8_t>(v & 0xFF);
  }
  return out;
}

// A tile's codes of every group as B tiles: wb [G][8 quads][NT features][4 codes].
template <int64_t NT, int64_t Act, bool Q4, bool Wide>
void amx_unpack(const uint8_t* ct, int64_t G, uint8_t* wb) {
  constexpr int64_t kGroupBytes = Q4 ? kGroup / 2 * NT : kGroup * NT;
  for (int64_t g = 0; g < G; ++g, wb += 8 * 4 * NT) {
    const uint8_t* cg = ct + g * kGroupBytes;
    if constexpr (Wide) {  // 4 octets of 64 bytes -> 8 B rows of 64 bytes
      const __m512i low4 = _mm512_set1_epi8(0x0F);
      for (int64_t o = 0; o < 4; ++o) {
        const __m512i v = _mm512_loadu_si512(cg + 64 * o);
        __m512i r0, r1;
        if constexpr (Act == kActInt8) {  // quads
          r0 = _mm512_and_si512(v, low4);
          r1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        } else {  // words: nibble n of 16-bit lane 2j+i is w[j, k+2n+i]
          const __m512i w4 = _mm512_set1_epi16(0x000F);
          const __m512i n0 = _mm512_and_si512(v, w4), n1 = _mm512_and_si512(_mm512_srli_epi16(v, 4), w4);
          const __m512i n2 = _mm512_and_si512(_mm512_srli_epi16(v, 8), w4), n3 = _mm512_srli_epi16(v, 12);
          r0 = _mm512_or_si512(n0, _mm512_slli_epi16(n1, 8));
          r1 = _mm512_or_si512(n2, _mm512_slli_epi16(n3, 8));
        }
        _mm512_storeu_si512(wb + 128 * o, r0);
        _mm512_storeu_si512(wb + 128 * o + 64, r1);
      }
    } else {
      const TileCodes<Q4> codes{cg};
      for (int64_t quad = 0; quad < 8; ++quad)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(wb + 32 * quad), codes.fours(quad));
    }
  }
}

// Rows [r0, r0 + 16) (those below M stored) against one tile of NT features whose B tiles are wb; the 16 rows' fp32
// sums stay in registers across the groups.
template <int64_t NT, int64_t Act, bool Q4>
void amx_tile_rows(const Rows& xr, const AmxRows& ar, int64_t r0, int64_t M, const uint8_t* wb, GroupVals st,
                   GroupVals mt, float* out, int64_t ldo, const float* bias, bool accumulate) {
  using V = std::conditional_t<NT == 16, __m512, __m256>;
  const int64_t K = xr.K, G = xr.G, rows = std::min(kAmxRows, M - r0);
  alignas(64) int32_t c0[kAmxRows * NT], c1[kAmxRows * NT];
  V fa[kAmxRows];
  for (auto& f : fa) f = V{};
  for (int64_t g = 0; g < G; ++g) {
    _tile_loadd(4, wb + g * 8 * 4 * NT, 4 * NT);
    _tile_zero(0);
    _tile_loadd(2, ar.a.data() + r0 * K + g * kGroup, K);
    _tile_dpbssd(0, 2, 4);
    if constexpr (Act == kActInt16) {
      _tile_zero(1);
      _tile_loadd(3, ar.b.data() + r0 * K + g * kGroup, K);
      _tile_dpbusd(1, 3, 4);
      _tile_stored(1, c1, 4 * NT);
    }
    _tile_stored(0, c0, 4 * NT);
    const float* d = xr.d.data() + g * xr.Mp + r0;
    const float* sum = xr.sum.data() + g * xr.Mp + r0;
    if constexpr (NT == 16) {
      const __m512 sc = st.load16(g * NT);
      [[maybe_unused]] __m512 mn;
      if constexpr (Q4) mn = mt.load16(g * NT);
#pragma GCC unroll 16
      for (int64_t r = 0; r < kAmxRows; ++r) {
        if (r >= rows) break;
        __m512i isum = _mm512_load_si512(c0 + r * NT);
        if constexpr (Act == kActInt16) isum = _mm512_add_epi32(_mm512_slli_epi32(isum, 8), _mm512_load_si512(c1 + r * NT));
        fa[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(sc, _mm512_set1_ps(d[r])), fa[r]);
        if constexpr (Q4) fa[r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sum[r]), fa[r]);
      }
    } else {
      const __m256 sc = st.load8(g * NT);
      [[maybe_unused]] __m256 mn;
      if constexpr (Q4) mn = mt.load8(g * NT);
#pragma GCC unroll 16
      for (int64_t r = 0; r < kAmxRows; ++r) {
        if (r >= rows) break;
        __m256i isum = _mm256_load_si256(reinterpret_cast<const __m256i*>(c0 + r * NT));
        if constexpr (Act == kActInt16)
          isum = _mm256_add_epi32(_mm256_slli_epi32(isum, 8),
                                  _mm256_load_si256(reinterpret_cast<const __m256i*>(c1 + r * NT)));
        fa[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(sc, _mm256_set1_ps(d[r])), fa[r]);
        if constexpr (Q4) fa[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(sum[r]), fa[r]);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* o = out + (r0 + r) * ldo;
    if constexpr (NT == 16) {
      __m512 v = _mm512_add_ps(fa[r], bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps());
      if (accumulate) v = _mm512_add_ps(_mm512_loadu_ps(o), v);
      _mm512_storeu_ps(o, v);
    } else {
      __m256 v = _mm256_add_ps(fa[r], bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps());
      if (accumulate) v = _mm256_add_ps(_mm256_loadu_ps(o), v);
      _mm256_storeu_ps(o, v);
    }
  }
}

template <int64_t NT, int64_t Act, bool Q4, bool Wide>
void amx_tiles(const Rows& xr, const AmxRows& ar, int64_t M, int64_t t0, int64_t t1, const uint8_t* codes,
               int64_t tile_bytes, GroupVals scale, GroupVals minv, const float* bias, float* out, int64_t ldo,
               bool accumulate) {
  const int64_t G = xr.G;
  std::vector<uint8_t> wb(G * 8 * 4 * NT);
  amx_configure(NT);
  for (int64_t t = t0; t < t1; ++t) {
    amx_unpack<NT, Act, Q4, Wide>(codes + t * tile_bytes, G, wb.data());
    for (int64_t r0 = 0; r0 < M; r0 += kAmxRows)
      amx_tile_rows<NT, Act, Q4>(xr, ar, r0, M, wb.data(), scale.at(t * G * NT), Q4 ? minv.at(t * G * NT) : GroupVals{},
                                 out + t * NT, ldo, bias ? bias + t * NT : nullptr, accumulate);
  }
  _tile_release();
}

// Whether a product of M rows runs on AMX tiles here: integer rows, enough of them, and the tile state granted.
inline bool amx_rows_ok(int64_t M, int64_t act) {
  return act != kActFp32 && M >= kAmxMinRows && amx_state().empty();
}
#endif

// The same arithmetic without AVX2 (the integer sums exact, then the same fp32 operations per group).
template <int64_t Act, bool Q4>
void tile_rows_scalar(const Rows& xr, int64_t r0, int64_t R, const uint8_t* ct, GroupVals st, GroupVals mt,
                      float* out, int64_t ldo, const float* bias, bool accumulate) {
  const int64_t K = xr.K, G = xr.G;
  auto code = [&](int64_t j, int64_t k) -> int32_t {  // w's code at tile row j, column k (see the layouts above)
    const int64_t quad = k / 4, i = k % 4;
    if constexpr (Q4) {
      const uint8_t byte = ct[16 * quad + 2 * j + (i & 1)];
      return i < 2 ? (byte & 0x0F) : (byte >> 4);
    } else {
      return reinterpret_cast<const int8_t*>(ct)[16 * (k / 2) + 2 * j + (k & 1)];
    }
  };
  for (int64_t r = r0; r < r0 + R; ++r)
    for (int64_t j = 0; j < kTile; ++j) {
      float fa = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        if (Act == kActFp32) {
          float ga = 0.f;
          for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k) ga = std::fma(float(code(j, k)), xr.x[r * K + k], ga);
          fa = std::fma(ga, st[g * kTile + j], fa);
        } else {
          int32_t isum = 0;
          for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k)
            isum += code(j, k) * (Act == kActInt8 ? int32_t(xr.q8[r * K + k]) : int32_t(xr.q16[r * K + k]));
          fa = std::fma(float(isum), st[g * kTile + j] * xr.d[g * xr.Mp + r], fa);
        }
        if (Q4) fa = std::fma(mt[g * kTile + j], xr.sum[g * xr.Mp + r], fa);
      }
      float v = fa + (bias ? bias[j] : 0.f);
      float* o = out + r * ldo + j;
      *o = accumulate ? *o + v : v;
    }
}

#ifdef KVB_AVX2
// The last rem (< kRowBlock) rows in one pass of tile_rows<rem>.
template <int RB, int64_t Act, bool Q4>
void tail_rows(const Rows& xr, int64_t r0, int64_t rem, const uint8_t* ct, GroupVals st, GroupVals mt,
               float* out, int64_t ldo, const float* bias, bool accumulate) {
  if constexpr (RB >= 1) {
    if (rem == RB) tile_rows<RB, Act, Q4>(xr, r0, ct, st, mt, out, ldo, bias, accumulate);
    else tail_rows<RB - 1, Act, Q4>(xr, r0, rem, ct, st, mt, out, ldo, bias, accumulate);
  }
}
#endif

template <int64_t Act, bool Q4>
void tile_all_rows(const Rows& xr, int64_t M, const uint8_t* ct, GroupVals st, GroupVals mt, float* out,
                   int64_t ldo, const float* bias, bool accumulate) {
#ifdef KVB_VNNI
  if (row_pairs(M, Act)) {
    int64_t r0 = 0;
    for (; r0 + kPairBlock <= M; r0 += kPairBlock)
      tile_row_pairs<kPairBlock, Q4>(xr, r0, M, ct, st, mt, out, ldo, bias, accumulate);
    if (M > r0) tail_row_pairs<kPairBlock, Q4>(xr, r0, M, ct, st, mt, out, ldo, bias, accumulate);
    return;
  }
#endif
#ifdef KVB_AVX2
  int64_t r0 = 0;
  for (; r0 + kRowBlock <= M; r0 += kRowBlock)
    tile_rows<kRowBlock, Act, Q4>(xr, r0, ct, st, mt, out, ldo, bias, accumulate);
  if (M > r0) tail_rows<kRowBlock - 1, Act, Q4>(xr, r0, M - r0, ct, st, mt, out, ldo, bias, accumulate);
#else
  tile_rows_scalar<Act, Q4>(xr, 0, M, ct, st, mt, out, ldo, bias, accumulate);
#endif
}

// out [M, N] (+)= x [M, K] @ w^T (+ bias), w tiled (q4: `minv` given; q8: `minv` null) in tiles of 8, or for q4 in
// wide tiles of 16 (`wide`, VNNI builds: checked by the caller). Tiles run in parallel (kvb::parallel_chunks: OpenMP,
// or kvb::WorkPool for a decode step in kvboost-server).
template <bool Q4>
void tiled_product(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* codes, GroupVals scale,
                   GroupVals minv, const float* bias, float* out, int64_t ldo, bool accumulate, int64_t act,
                   bool wide = false) {
  const Rows xr = prepare_rows(x, M, K, act);
  const int64_t tile = wide ? kWideTile : kTile;
  const int64_t G = K / kGroup, T = N / tile;
  const int64_t tile_bytes = Q4 ? K / 2 * tile : K * tile;
  const int64_t threads = at::in_parallel_region() ? 1 : std::max(1, at::get_num_threads());
#ifdef KVB_AMX
  if (amx_rows_ok(M, act)) {
    const AmxRows ar = amx_rows(xr, M, act, wide && act == kActInt16);
    amx_products.fetch_add(1, std::memory_order_relaxed);
    kvb::parallel_chunks(T, std::max<int64_t>(2, T / (4 * threads)), threads, [&](int64_t t0, int64_t t1) {
      auto run = [&](auto nt, auto act_c, auto q4_c, auto wide_c) {
        amx_tiles<decltype(nt)::value, decltype(act_c)::value, decltype(q4_c)::value, decltype(wide_c)::value>(
            xr, ar, M, t0, t1, codes, tile_bytes, scale, minv, bias, out, ldo, accumulate);
      };
      using I16 = std::integral_constant<int64_t, kActInt16>;
      using I8 = std::integral_constant<int64_t, kActInt8>;
      using Q = std::integral_constant<bool, Q4>;
      if (wide) {
        if constexpr (Q4) {
          if (act == kActInt16) run(std::integral_constant<int64_t, 16>{}, I16{}, Q{}, std::true_type{});
          else run(std::integral_constant<int64_t, 16>{}, I8{}, Q{}, std::true_type{});
        }
      } else if (act == kActInt16) {
        run(std::integral_constant<int64_t, 8>{}, I16{}, Q{}, std::false_type{});
      } else {
        run(std::integral_constant<int64_t, 8>{}, I8{}, Q{}, std::false_type{});
      }
    });
    return;
  }
#endif
  kvb::parallel_chunks(T, std::max<int64_t>(2, T / (4 * threads)), threads, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* ct = codes + t * tile_bytes;
      const GroupVals st = scale.at(t * G * tile);
      const GroupVals mt = Q4 ? minv.at(t * G * tile) : GroupVals{};
      const float* bt = bias ? bias + t * tile : nullptr;
      float* ot = out + t * tile;
#ifdef KVB_VNNI
      if constexpr (Q4) {
        if (wide) {
          if (act == kActInt16) wide_tile_all_rows<kActInt16>(xr, M, ct, st, mt, ot, ldo, bt, accumulate);
          else wide_tile_all_rows<kActInt8>(xr, M, ct, st, mt, ot, ldo, bt, accumulate);
          continue;
        }
      }
#endif
      if (act == kActInt16) tile_all_rows<kActInt16, Q4>(xr, M, ct, st, mt, ot, ldo, bt, accumulate);
      else if (act == kActInt8) tile_all_rows<kActInt8, Q4>(xr, M, ct, st, mt, ot, ldo, bt, accumulate);
      else tile_all_rows<kActFp32, Q4>(xr, M, ct, st, mt, ot, ldo, bt, accumulate);
    }
  });
}

void check_act(int64_t act) {
  TORCH_CHECK(act == kActFp32 || act == kActInt8 || act == kActInt16, "activations code must be 0 (fp32), 1 (int8) "
              "or 2 (int16), got ", act);
}

// A q4 weight's layout, told by its codes' shape: tiles of 8 features ([N, K/2]) or wide tiles of 16 (read by
// wide_tile_rows): quads for int8 rows ([N/16, K/8, 64]), words for int16 rows ([N/16, K/8, 32, 2]).
inline bool wide_layout(const torch::Tensor& codes) { return codes.dim() >= 3; }

// Output features of a q4 weight in either layout.
inline int64_t q4_rows(const torch::Tensor& codes) {
  return wide_layout(codes) ? codes.size(0) * kWideTile : codes.size(0);
}

void check_wide_q4(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& minv, int64_t K,
                   int64_t act) {
#ifndef KVB_VNNI
  TORCH_CHECK(false, "q4: wide tiles (codes [N/16, K/8, ...]) are read by the avx512_vnni build only");
#endif
  TORCH_CHECK(act == kActInt8 || act == kActInt16, "q4: wide tiles are read with int8 or int16 activations (act 1 "
              "or 2), got act ", act);
  const bool words = codes.dim() == 4;
  TORCH_CHECK(words == (act == kActInt16), "q4: wide tiles for ", act == kActInt16 ? "int16" : "int8",
              " rows are ", act == kActInt16 ? "words (codes [N/16, K/8, 32, 2])" : "quads (codes [N/16, K/8, 64])",
              ", got codes ", codes.sizes());
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(1) * 8 == K &&
                  (words ? codes.size(2) == 32 && codes.size(3) == 2 : codes.dim() == 3 && codes.size(2) == 64),
              "q4: wide codes must be contiguous uint8 [N/16, K/8, 64] (quads) or [N/16, K/8, 32, 2] (words)");
  const int64_t T = codes.size(0);
  for (const auto* t : {&scale, &minv})
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) && t->is_contiguous() &&
                    t->dim() == 3 && t->size(0) == T && t->size(1) == K / kGroup && t->size(2) == kWideTile,
                "q4: a wide weight's scale and min must be contiguous float32 or float16 [N/16, K/32, 16]");
  TORCH_CHECK(scale.scalar_type() == minv.scalar_type(), "q4: scale and min must have the same dtype");
}

void check_q4(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& minv, int64_t K,
              int64_t act) {
  TORCH_CHECK(K % kGroup == 0, "q4: in_features must be a multiple of 32, got ", K);
  if (wide_layout(codes)) return check_wide_q4(codes, scale, minv, K, act);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.size(1) * 2 == K && codes.is_contiguous(),
              "q4: codes must be contiguous uint8 [N, K/2]");
  const int64_t N = codes.size(0);
  TORCH_CHECK(N % kTile == 0, "q4: out_features must be a multiple of 8 (the kernel's tiles), got ", N);
  for (const auto* t : {&scale, &minv})
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kHalf) && t->is_contiguous() &&
                    t->dim() == 2 && t->size(0) == N && t->size(1) == K / kGroup,
                "q4: scale and min must be contiguous float32 or float16 [N, K/32]");
  TORCH_CHECK(scale.scalar_type() == minv.scalar_type(), "q4: scale and min must have the same dtype");
}

// A weight's per-group values for the kernels (float32 or float16, checked by the caller).
GroupVals group_vals(const torch::Tensor& t) { return {t.data_ptr(), t.scalar_type() == at::kHalf}; }

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), name,
              " must be a contiguous float32 CPU matrix [M, K]");
}

// out [M, N] (+)= x [M, K] @ w^T (+ bias)
void q4_matmul_into(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                    const torch::Tensor& minv, const c10::optional<torch::Tensor>& bias, torch::Tensor& out,
                    bool accumulate, int64_t act) {
  const int64_t M = x.size(0), K = x.size(1), N = q4_rows(codes);
  check_act(act);
  check_q4(codes, scale, minv, K, act);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  out.stride(1) == 1,
              "q4: out must be float32 [M, N] with contiguous rows");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(), "q4: bad bias");
    b = bias->data_ptr<float>();
  }
  tiled_product<true>(x.data_ptr<float>(), M, K, N, codes.data_ptr<uint8_t>(), group_vals(scale), group_vals(minv), b,
                      out.data_ptr<float>(), out.stride(0), accumulate, act, wide_layout(codes));
}

torch::Tensor q4_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                        const torch::Tensor& minv, const c10::optional<torch::Tensor>& bias, int64_t act) {
  check_rows(x, "q4_matmul: x");
  auto out = torch::empty({x.size(0), q4_rows(codes)}, x.options());
  q4_matmul_into(x, codes, scale, minv, bias, out, false, act);
  return out;
}

torch::Tensor q8_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale, int64_t act) {
  check_rows(x, "q8_matmul: x");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % kGroup == 0, "q8: in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.size(1) == K && codes.is_contiguous(),
              "q8: codes must be contiguous int8 [N, K]");
  TORCH_CHECK(N % kTile == 0, "q8: out_features must be a multiple of 8 (the kernel's tiles), got ", N);
  TORCH_CHECK((scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf) && scale.is_contiguous() &&
                  scale.dim() == 2 && scale.size(0) == N && scale.size(1) == K / kGroup,
              "q8: scale must be contiguous float32 or float16 [N, K/32]");
  check_act(act);
  auto out = torch::empty({M, N}, x.options());
  tiled_product<false>(x.data_ptr<float>(), M, K, N, reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>()),
                       group_vals(scale), GroupVals{}, nullptr, out.data_ptr<float>(), N, false, act);
  return out;
}

// HF's LlamaRMSNorm in fp32: x * rsqrt(mean(x^2) + eps) * w.
void rms_norm_rows(const float* x, const float* w, float eps, int64_t M, int64_t H, float* out) {
  kvb::parallel_rows(M, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * H;
      float ss = 0.f;
      for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(ss / float(H) + eps);
      for (int64_t i = 0; i < H; ++i) out[r * H + i] = w[i] * (xr[i] * inv);
    }
  });
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_rows(x, "rms_norm: x");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.numel() == x.size(1), "rms_norm: bad weight");
  auto out = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), float(eps), x.size(0), x.size(1), out.data_ptr<float>());
  return out;
}

// HF's rotate-half RoPE of one head row in place: out[i] = x[i] cos[i] - x[i + D/2] sin[i],
// out[i + D/2] = x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2].
inline void rope_row(float* v, const float* cos, const float* sin, int64_t D) {
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) {
    const float a = v[i], b = v[i + h];
    v[i] = a * cos[i] - b * sin[i];
    v[i + h] = b * cos[i + h] + a * sin[i + h];
  }
}

template <typename T>
inline void store_row(T* dst, const float* src, int64_t D) {
  for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<T>(src[i]);
}

// The attention half's input: rows' RMSNorm, the fused q/k/v product (+ bias), RoPE on q and k, the K/V rows
// written into one pool layer [Hkv, S, D] at `slots`; returns q [M, Hq, D] in the pool's dtype (the paged
// attention kernel's input).
torch::Tensor attention_input(const torch::Tensor& x, const torch::Tensor& ln, double eps, const torch::Tensor& codes,
                              const torch::Tensor& scale, const torch::Tensor& minv,
                              const c10::optional<torch::Tensor>& bias, const torch::Tensor& cos,
                              const torch::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim,
                              torch::Tensor k_cache, torch::Tensor v_cache, const torch::Tensor& slots,
                              int64_t act) {
  check_rows(x, "attention_input: x");
  const int64_t M = x.size(0), H = x.size(1), D = head_dim;
  const int64_t nq = heads * D, nk = kv_heads * D;
  TORCH_CHECK(q4_rows(codes) == nq + 2 * nk, "attention_input: the q/k/v weight has ", q4_rows(codes),
              " rows, expected ", nq + 2 * nk);
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_contiguous() &&
                  sin.is_contiguous() && cos.size(0) == M && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "attention_input: cos / sin must be contiguous float32 [M, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == M && slots.is_contiguous(),
              "attention_input: slots must be int64 [M]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(0) == kv_heads && k_cache.size(2) == D && k_cache.stride(2) == 1 &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.strides() == k_cache.strides() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "attention_input: k_cache / v_cache must be one pool layer [Hkv, S, D]");
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "attention_input: the pool must be float32 or bfloat16");
  const int64_t S = k_cache.size(1);
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < M; ++r) TORCH_CHECK(sl[r] >= 0 && sl[r] < S, "attention_input: slot ", sl[r], " out of range");

  auto a = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), ln.data_ptr<float>(), float(eps), M, H, a.data_ptr<float>());
  auto qkv = torch::empty({M, nq + 2 * nk}, x.options());
  q4_matmul_into(a, codes, scale, minv, bias, qkv, false, act);
  auto q = torch::empty({M, heads, D}, x.options().dtype(dtype));
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1);
  kvb::parallel_rows(M, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = qkv.data_ptr<float>() + r * (nq + 2 * nk);
      const float* c = cp + r * D;
      const float* s = sp + r * D;
      for (int64_t h = 0; h < heads + kv_heads; ++h) rope_row(row + h * D, c, s, D);
      const int64_t off = sl[r] * ks1;
      if (dtype == at::kFloat) {
        store_row(q.data_ptr<float>() + r * nq, row, nq);
        for (int64_t h = 0; h < kv_heads; ++h) {
          store_row(k_cache.data_ptr<float>() + h * ks0 + off, row + nq + h * D, D);
          store_row(v_cache.data_ptr<float>() + h * ks0 + off, row + nq + nk + h * D, D);
        }
      } else {
        using bf = c10::BFloat16;
        store_row(q.data_ptr<bf>() + r * nq, row, nq);
        for (int64_t h = 0; h < kv_heads; ++h) {
          store_row(k_cache.data_ptr<bf>() + h * ks0 + off, row + nq + h * D, D);
          store_row(v_cache.data_ptr<bf>() + h * ks0 + off, row + nq + nk + h * D, D);
        }
      }
    }
  });
  return q;
}

// The rest of the layer, in place on x [M, H]: x += o(attn); m = RMSNorm(x); x += down(silu(gate(m)) * up(m)),
// gate/up one fused product of 2 * intermediate rows (gate first).
void mlp_block(torch::Tensor x, const torch::Tensor& attn, const torch::Tensor& o_codes, const torch::Tensor& o_scale,
               const torch::Tensor& o_min, const c10::optional<torch::Tensor>& o_bias, const torch::Tensor& ln,
               double eps, const torch::Tensor& gu_codes, const torch::Tensor& gu_scale, const torch::Tensor& gu_min,
               const torch::Tensor& d_codes, const torch::Tensor& d_scale, const torch::Tensor& d_min,
               int64_t act) {
  check_rows(x, "mlp_block: x");
  const int64_t M = x.size(0), H = x.size(1);
  auto a = attn.reshape({M, -1}).to(at::kFloat).contiguous();
  q4_matmul_into(a, o_codes, o_scale, o_min, o_bias, x, true, act);
  auto m = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), ln.data_ptr<float>(), float(eps), M, H, m.data_ptr<float>());
  const int64_t I2 = q4_rows(gu_codes), I = I2 / 2;
  auto gu = torch::empty({M, I2}, x.options());
  q4_matmul_into(m, gu_codes, gu_scale, gu_min, c10::nullopt, gu, false, act);
  auto h = torch::empty({M, I}, x.options());
  using Vec = at::vec::Vectorized<float>;
  kvb::parallel_rows(M, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gu.data_ptr<float>() + r * I2;
      const float* u = g + I;
      float* hr = h.data_ptr<float>() + r * I;
      int64_t i = 0;
      for (; i + Vec::size() <= I; i += Vec::size()) {  // silu(g) * u, vectorized exp (Sleef, ~1 ulp)
        const Vec gv = Vec::loadu(g + i);
        (gv / (Vec(1.f) + gv.neg().exp()) * Vec::loadu(u + i)).store(hr + i);
      }
      for (; i < I; ++i) hr[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  q4_matmul_into(h, d_codes, d_scale, d_min, c10::nullopt, x, true, act);
}


c10::optional<torch::Tensor> maybe(const torch::Tensor& t) {
  return t.defined() && t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// Every decoder layer of one decode step, in place on x [M, H] (fp32): per layer, `weights` holds 16 tensors
// (ln1, q/k/v codes, scale, min, bias | ln2 ... see kvboost/runtime/quant_step.py: QuantDecodeStep.flat) and
// `keys` / `values` its pool layer. Attention: cpu_paged_attention_forward over the paged contract's query spans
// (`query_start`) and positions (`q_positions`): one row per sequence in a decode step, a prompt chunk's rows under
// engine.prefill=quantized.
void decode_layers(torch::Tensor x, const std::vector<torch::Tensor>& weights, const std::vector<torch::Tensor>& keys,
                   const std::vector<torch::Tensor>& values, const torch::Tensor& cos, const torch::Tensor& sin,
                   const torch::Tensor& slots, const torch::Tensor& block_tables, const torch::Tensor& kv_lens,
                   const torch::Tensor& query_start, const torch::Tensor& q_positions, int64_t heads,
                   int64_t kv_heads, int64_t head_dim, double eps, double scale, int64_t block_size, int64_t act) {
  constexpr size_t kPer = 16;
  const size_t L = keys.size();
  check_index(query_start, "query_start", std::max<int64_t>(1, query_start.numel()), 1);  // [B + 1] int32
  const int32_t* qs = query_start.data_ptr<int32_t>();
  bool one_row_each = true;
  for (int64_t b = 0; b + 1 < query_start.size(0); ++b) one_row_each = one_row_each && qs[b + 1] - qs[b] <= 1;
  const kvb::DecodeRowsOnly pool_choice(one_row_each);
  TORCH_CHECK(weights.size() == kPer * L && values.size() == L, "decode_layers: ", weights.size(),
              " weight tensors and ", L, " pool layers (16 per layer expected)");
  for (size_t l = 0; l < L; ++l) {
    const torch::Tensor* w = weights.data() + kPer * l;
    auto q = attention_input(x, w[0], eps, w[1], w[2], w[3], maybe(w[4]), cos, sin, heads, kv_heads, head_dim,
                             keys[l], values[l], slots, act);
    auto attn = torch::empty_like(q);
    // row_invariant: a row's attention bits do not depend on the rows beside it in the call (prompt chunk, reuse
    // suffix or decode row), as its products' do not: reuse then gives a cold prefill's bits (issue 61).
    cpu_paged_attention_forward(q, keys[l], values[l], block_tables, kv_lens, query_start, q_positions, block_size,
                                scale, attn, 32, /*row_invariant=*/true);
    mlp_block(x, attn, w[5], w[6], w[7], maybe(w[8]), w[9], eps, w[10], w[11], w[12], w[13], w[14], w[15],
              act);
  }
}

#ifndef KVB_AMX
std::string amx_unavailable_reason() { return "not the amx build"; }
constexpr int64_t kAmxMinRows = 0;
std::atomic<int64_t> amx_products{0};
#endif

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every call releases the GIL while it computes (it touches only the tensors it was given, as torch's own ops):
  // in kvboost-server the frontend's thread (HTTP, detokenizing, SSE) then runs beside a decode step instead of
  // after it.
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("q4_matmul", &q4_matmul, "x [M, K] fp32 times a q4 weight [N, K] -> [M, N]", py::arg("x"), py::arg("codes"),
        py::arg("scale"), py::arg("minv"), py::arg("bias") = c10::nullopt, py::arg("act") = 0, release());
  m.def("q8_matmul", &q8_matmul, "x [M, K] fp32 times a q8 weight [N, K] -> [M, N]", py::arg("x"), py::arg("codes"),
        py::arg("scale"), py::arg("act") = 0, release());
  m.def("rms_norm", &rms_norm, "RMSNorm of fp32 rows", py::arg("x"), py::arg("weight"), py::arg("eps"), release());
  m.def("attention_input", &attention_input, "norm, q/k/v, RoPE and the K/V write of one layer", release());
  m.def("mlp_block", &mlp_block, "o-projection + residual, norm, SiLU-gated MLP + residual, in place", release());
  m.def("decode_layers", &decode_layers, "every decoder layer of one decode step, in place on x", release());
  m.def("set_decode_pool", [](bool on) { kvb::decode_pool_requested().store(on); },
        "run decode steps on the step's own thread pool (kvboost/csrc/work_pool.h) instead of OpenMP", py::arg("on"));
  m.def("decode_pool", [] { return kvb::work_pool_enabled(); }, "whether decode steps run on the step's own pool");
  m.def("amx_unavailable_reason", &amx_unavailable_reason,
        "why this build's products cannot run on AMX tiles (empty: they can; asks Linux for the tile state once)");
  m.def("amx_products", [] { return amx_products.load(); }, "products this process ran on AMX tiles");
  m.attr("amx_min_rows") = kAmxMinRows;
#if defined(KVB_AMX)
  m.attr("isa") = "amx";
#elif defined(KVB_VNNI)
  m.attr("isa") = "avx512_vnni";
#elif defined(KVB_AVXVNNI)
  m.attr("isa") = "avx_vnni";
#elif defined(KVB_AVX2)
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "scalar";
#endif
}
