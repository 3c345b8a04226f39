// kvboost's quantized CPU decode step: the projections of a Llama-structured decoder multiplied straight from a
// GGUF model's 4-bit blocks (Q4_0 / Q4_1 / Q4_K, one (scale, min) pair per 32 weights) and the head from its Q8_0
// blocks, with fp32 activations; norms, RoPE and the K/V write fused around them.
//
// Why: a CPU decode step reads every weight once per token, so its floor is the weights' bytes over the memory
// bandwidth. Dense fp32 weights are 4 bytes each; GGUF's Q4_1 blocks are 0.625 (llama.cpp decodes from them). The
// bundled model's dense weights *are* those blocks dequantized (transformers' GGUF loader), so multiplying the
// blocks computes the same function, only summed in another order: the activations stay fp32 (llama.cpp rounds
// them to 8-bit blocks; this kernel does not, so the result is the dense model's up to fp32 rounding).
//
// Layouts (built by kvboost/runtime/quant_step.py):
//   q4 weight [N, K]: codes uint8 [N, K/2] (per 32-weight group: 16 bytes, value i < 16 in the low nibble of byte i,
//   value 16 + i in its high nibble: GGUF's own order), scale / min fp32 [N, K/32]; w = q * scale + min.
//   q8 weight [N, K]: codes int8 [N, K], scale fp32 [N, K/32]; w = q * scale.
// Every product reads each weight once for all M rows of the step (the rows share the dequantized group), which is
// what makes a batched decode step cheaper than M single steps.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

// The paged attention kernel (cpu_paged_attention_forward), compiled into this extension so that a whole decode
// step is one call from Python (the per-layer Python loop and its calls cost ~2 ms of a ~17 ms step).
#define KVBOOST_CPU_ATTENTION_NO_MODULE
#include "cpu_attention.cpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KVB_AVX2 1
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kRowTile = 4;  // rows of the step sharing one dequantized group per pass (registers: 4 accs)

#ifdef KVB_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}
#endif

// Sums of each 32-value group of each row of x [M, K]: the min term of a q4 product is min * sum(x over the group).
std::vector<float> group_sums(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / kGroup;
  std::vector<float> s(M * G);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      const float* p = x + r * K + g * kGroup;
      for (int64_t i = 0; i < kGroup; ++i) acc += p[i];
      s[r * G + g] = acc;
    }
  return s;
}

#ifdef KVB_AVX2
// One group's 32 weights as four vectors of fp32 codes (q, not yet scaled): values 0-7, 8-15, 16-23, 24-31.
inline void q4_codes(const uint8_t* g16, __m256 w[4]) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g16));
  __m128i lo = _mm_and_si128(b, low4);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

inline void q8_codes(const int8_t* g32, __m256 w[4]) {
  __m128i b0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g32));
  __m128i b1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g32 + 16));
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b0, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b1, 8)));
}

// The dot products of one weight row (G groups, codes by `codes_of`) with R rows of x, as R sums. The group's
// codes are scaled first (q * scale: exact, a 4-bit or 8-bit code times a scale with <= 11 significant bits), then
// multiplied into A independent accumulators per row: a single chain of dependent FMAs per group would wait on
// each FMA's latency (measured 17 cycles per group that way on AVX2, against ~6 with independent chains).
template <int R, int A, typename Codes>
inline void dot_rows(const float* x, int64_t K, int64_t G, const float* sn, Codes codes_of, float* res) {
  __m256 acc[R][A];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
  __m256 w[4];
  for (int64_t g = 0; g < G; ++g) {
    codes_of(g, w);
    const __m256 s = _mm256_set1_ps(sn[g]);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(w[j], s);
    for (int r = 0; r < R; ++r) {
      const float* xr = x + r * K + g * kGroup;
      for (int j = 0; j < 4; ++j) acc[r][j % A] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xr + 8 * j), acc[r][j % A]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 t = acc[r][0];
    for (int a = 1; a < A; ++a) t = _mm256_add_ps(t, acc[r][a]);
    res[r] = hsum(t);
  }
}

template <typename Codes>
void dot_tile(int64_t R, const float* x, int64_t K, int64_t G, const float* sn, Codes codes_of, float* res) {
  switch (R) {  // registers: R x A accumulators + 4 weight vectors fit AVX2's 16 (R = 1: 4 chains; else 2 per row)
    case 1: dot_rows<1, 4>(x, K, G, sn, codes_of, res); break;
    case 2: dot_rows<2, 4>(x, K, G, sn, codes_of, res); break;
    case 3: dot_rows<3, 2>(x, K, G, sn, codes_of, res); break;
    default: dot_rows<4, 2>(x, K, G, sn, codes_of, res); break;
  }
}
#endif

// out[r, n] (+)= sum_k x[r, k] * w[n, k] (+ bias[n]) for n in [n0, n1), rows [r0, r0 + R), R <= kRowTile.
void q4_tile(const float* x, const float* xsum, int64_t K, const uint8_t* codes, const float* scale, const float* minv,
             int64_t n0, int64_t n1, int64_t r0, int64_t R, float* out, int64_t ldo, const float* bias, bool accumulate) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* cn = codes + n * (K / 2);
    const float* sn = scale + n * G;
    const float* mn = minv + n * G;
    float res[kRowTile];
#ifdef KVB_AVX2
    dot_tile(R, x + r0 * K, K, G, sn, [cn](int64_t g, __m256* w) { q4_codes(cn + g * 16, w); }, res);
#else
    for (int64_t r = 0; r < R; ++r) res[r] = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* cb = cn + g * 16;
      for (int64_t r = 0; r < R; ++r) {
        const float* xr = x + (r0 + r) * K + g * kGroup;
        float t = 0.f;
        for (int i = 0; i < 16; ++i) t += float(cb[i] & 0x0F) * xr[i] + float(cb[i] >> 4) * xr[16 + i];
        res[r] += sn[g] * t;
      }
    }
#endif
    for (int64_t r = 0; r < R; ++r) {
      const float* xs = xsum + (r0 + r) * G;
      float m = 0.f;
      for (int64_t g = 0; g < G; ++g) m += mn[g] * xs[g];
      float v = res[r] + m + (bias ? bias[n] : 0.f);
      float* o = out + (r0 + r) * ldo + n;
      *o = accumulate ? *o + v : v;
    }
  }
}

void q8_tile(const float* x, int64_t K, const int8_t* codes, const float* scale, int64_t n0, int64_t n1, int64_t r0,
             int64_t R, float* out, int64_t ldo) {
  const int64_t G = K / kGroup;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* cn = codes + n * K;
    const float* sn = scale + n * G;
    float res[kRowTile];
#ifdef KVB_AVX2
    dot_tile(R, x + r0 * K, K, G, sn, [cn](int64_t g, __m256* w) { q8_codes(cn + g * kGroup, w); }, res);
#else
    for (int64_t r = 0; r < R; ++r) {
      const float* xr = x + (r0 + r) * K;
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        float t = 0.f;
        for (int64_t i = 0; i < kGroup; ++i) t += float(cn[g * kGroup + i]) * xr[g * kGroup + i];
        acc += sn[g] * t;
      }
      res[r] = acc;
    }
#endif
    for (int64_t r = 0; r < R; ++r) out[(r0 + r) * ldo + n] = res[r];
  }
}

// ---- int8 activations (llama.cpp's arithmetic): each row's 32-value group rounded to int8 with its own scale
// (max |x| / 127), products in integers (u8 x s8 pairs summed by vpmaddubsw / vpmaddwd), scaled once per group.
// 2.5x fewer instructions per group than converting every code to fp32; the rounding of x (at most half a step of
// 1/127 of the group's largest value) is what llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0 products do.
// int16 activations: the same with 16-bit codes (scale max |x| / 32767, products by vpmaddwd): a rounding step of
// 3e-5 of the group's largest value, so two runs whose inputs differ by fp32 noise round alike but for flips that
// move the logits by ~1e-5 (int8's steps move them by ~1e-2: greedy tokens of reuse and cold part at near ties).
template <typename T>
struct QuantRows {
  std::vector<T> q;         // [M, K]
  std::vector<float> d;     // [M, G] scale of each group
  std::vector<float> sum;   // [M, G] exact fp32 sum of each group of x (the q4 min term)
};

template <typename T>
QuantRows<T> quantize_rows(const float* x, int64_t M, int64_t K) {
  constexpr float qmax = sizeof(T) == 1 ? 127.f : 32767.f;
  const int64_t G = K / kGroup;
  QuantRows<T> out{std::vector<T>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  for (int64_t r = 0; r < M; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* p = x + r * K + g * kGroup;
      float amax = 0.f, s = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) {
        amax = std::max(amax, std::fabs(p[i]));
        s += p[i];
      }
      const float d = amax / qmax, inv = d > 0.f ? 1.f / d : 0.f;
      T* q = out.q.data() + r * K + g * kGroup;
      for (int64_t i = 0; i < kGroup; ++i) q[i] = static_cast<T>(std::nearbyint(p[i] * inv));
      out.d[r * G + g] = d;
      out.sum[r * G + g] = s;
    }
  return out;
}

#ifdef KVB_AVX2
// R rows' integer dot products with one weight row; `codes_of(g)` gives the group's 32 codes as unsigned bytes
// (q4: 0..15) or, for signed codes, `sign` makes them |w| and moves the sign onto x (vpmaddubsw takes u8 x s8).
template <int R, bool Signed, typename Codes>
inline void idot_rows(const int8_t* xq, const float* xd, int64_t K, int64_t G, const float* sn, Codes codes_of,
                      float* res) {
  constexpr int A = R == 1 ? 2 : 1;  // R = 1: alternate two accumulators over the groups (FMA latency)
  __m256 acc[R][A];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < G; ++g) {
    const __m256i w = codes_of(g);
    const __m256i aw = Signed ? _mm256_sign_epi8(w, w) : w;
    for (int r = 0; r < R; ++r) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + r * K + g * kGroup));
      if (Signed) xv = _mm256_sign_epi8(xv, w);
      const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xv), ones);
      const __m256 s = _mm256_set1_ps(sn[g] * xd[r * G + g]);
      acc[r][g % A] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[r][g % A]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 t = acc[r][0];
    for (int a = 1; a < A; ++a) t = _mm256_add_ps(t, acc[r][a]);
    res[r] = hsum(t);
  }
}

// The same with int16 rows: `codes_of(g, w)` gives the group's 32 codes as two vectors of 16 int16 (values 0-15,
// 16-31); products by vpmaddwd (int16 pairs summed into int32: |q| <= 127, |x| <= 32767, no overflow).
template <int R, typename Codes>
inline void idot16_rows(const int16_t* xq, const float* xd, int64_t K, int64_t G, const float* sn, Codes codes_of,
                        float* res) {
  constexpr int A = R == 1 ? 2 : 1;
  __m256 acc[R][A];
  for (int r = 0; r < R; ++r)
    for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
  __m256i w[2];
  for (int64_t g = 0; g < G; ++g) {
    codes_of(g, w);
    for (int r = 0; r < R; ++r) {
      const int16_t* xr = xq + r * K + g * kGroup;
      const __m256i p = _mm256_add_epi32(
          _mm256_madd_epi16(w[0], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr))),
          _mm256_madd_epi16(w[1], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + 16))));
      const __m256 s = _mm256_set1_ps(sn[g] * xd[r * G + g]);
      acc[r][g % A] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[r][g % A]);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m256 t = acc[r][0];
    for (int a = 1; a < A; ++a) t = _mm256_add_ps(t, acc[r][a]);
    res[r] = hsum(t);
  }
}

template <typename Codes>
void idot16_tile(int64_t R, const int16_t* xq, const float* xd, int64_t K, int64_t G, const float* sn, Codes codes_of,
                 float* res) {
  switch (R) {
    case 1: idot16_rows<1>(xq, xd, K, G, sn, codes_of, res); break;
    case 2: idot16_rows<2>(xq, xd, K, G, sn, codes_of, res); break;
    case 3: idot16_rows<3>(xq, xd, K, G, sn, codes_of, res); break;
    default: idot16_rows<4>(xq, xd, K, G, sn, codes_of, res); break;
  }
}

template <bool Signed, typename Codes>
void idot_tile(int64_t R, const int8_t* xq, const float* xd, int64_t K, int64_t G, const float* sn, Codes codes_of,
               float* res) {
  switch (R) {
    case 1: idot_rows<1, Signed>(xq, xd, K, G, sn, codes_of, res); break;
    case 2: idot_rows<2, Signed>(xq, xd, K, G, sn, codes_of, res); break;
    case 3: idot_rows<3, Signed>(xq, xd, K, G, sn, codes_of, res); break;
    default: idot_rows<4, Signed>(xq, xd, K, G, sn, codes_of, res); break;
  }
}
#endif

// q4 x int8 rows: out[r, n] (+)= sum_g scale * d_x * sum(q * x_q) + min * sum(x) (+ bias).
template <typename T>
void q4i_tile(const QuantRows<T>& xr, int64_t K, const uint8_t* codes, const float* scale, const float* minv, int64_t n0,
              int64_t n1, int64_t r0, int64_t R, float* out, int64_t ldo, const float* bias, bool accumulate) {
  const int64_t G = K / kGroup;
  const T* xq = xr.q.data() + r0 * K;
  const float* xd = xr.d.data() + r0 * G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* cn = codes + n * (K / 2);
    const float* sn = scale + n * G;
    const float* mn = minv + n * G;
    float res[kRowTile];
#ifdef KVB_AVX2
    if constexpr (sizeof(T) == 1) {
      const __m256i low4 = _mm256_set1_epi8(0x0F);
      idot_tile<false>(R, xq, xd, K, G, sn, [cn, low4](int64_t g) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cn + g * 16));
        return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), low4);  // values 0..15 | 16..31
      }, res);
    } else {
      const __m128i low4 = _mm_set1_epi8(0x0F);
      idot16_tile(R, xq, xd, K, G, sn, [cn, low4](int64_t g, __m256i* w) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(cn + g * 16));
        w[0] = _mm256_cvtepu8_epi16(_mm_and_si128(b, low4));                     // values 0..15
        w[1] = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), low4));  // values 16..31
      }, res);
    }
#else
    for (int64_t r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* cb = cn + g * 16;
        const T* q = xq + r * K + g * kGroup;
        int32_t t = 0;
        for (int i = 0; i < 16; ++i) t += int32_t(cb[i] & 0x0F) * q[i] + int32_t(cb[i] >> 4) * q[16 + i];
        acc += sn[g] * xd[r * G + g] * float(t);
      }
      res[r] = acc;
    }
#endif
    for (int64_t r = 0; r < R; ++r) {
      const float* xs = xr.sum.data() + (r0 + r) * G;
      float m = 0.f;
      for (int64_t g = 0; g < G; ++g) m += mn[g] * xs[g];
      float v = res[r] + m + (bias ? bias[n] : 0.f);
      float* o = out + (r0 + r) * ldo + n;
      *o = accumulate ? *o + v : v;
    }
  }
}

template <typename T>
void q8i_tile(const QuantRows<T>& xr, int64_t K, const int8_t* codes, const float* scale, int64_t n0, int64_t n1,
              int64_t r0, int64_t R, float* out, int64_t ldo) {
  const int64_t G = K / kGroup;
  const T* xq = xr.q.data() + r0 * K;
  const float* xd = xr.d.data() + r0 * G;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* cn = codes + n * K;
    const float* sn = scale + n * G;
    float res[kRowTile];
#ifdef KVB_AVX2
    if constexpr (sizeof(T) == 1) {
      idot_tile<true>(R, xq, xd, K, G, sn, [cn](int64_t g) {
        return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cn + g * kGroup));
      }, res);
    } else {
      idot16_tile(R, xq, xd, K, G, sn, [cn](int64_t g, __m256i* w) {
        w[0] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cn + g * kGroup)));
        w[1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cn + g * kGroup + 16)));
      }, res);
    }
#else
    for (int64_t r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t t = 0;
        for (int64_t i = 0; i < kGroup; ++i) t += int32_t(cn[g * kGroup + i]) * xq[r * K + g * kGroup + i];
        acc += sn[g] * xd[r * G + g] * float(t);
      }
      res[r] = acc;
    }
#endif
    for (int64_t r = 0; r < R; ++r) out[(r0 + r) * ldo + n] = res[r];
  }
}

// How a product sees the activations (the Python side's ACTIVATIONS): exact fp32, or each row's 32-value groups
// rounded to int8 / int16 codes with a scale of their own.
constexpr int64_t kActFp32 = 0, kActInt8 = 1, kActInt16 = 2;

void check_act(int64_t act) {
  TORCH_CHECK(act == kActFp32 || act == kActInt8 || act == kActInt16, "activations code must be 0 (fp32), 1 (int8) "
              "or 2 (int16), got ", act);
}

// Output features per parallel task: enough work per task to amortize the fork (a few microseconds per region).
int64_t grain(int64_t N) { return std::max<int64_t>(16, N / (4 * std::max(1, at::get_num_threads()))); }

void check_q4(const torch::Tensor& codes, const torch::Tensor& scale, const torch::Tensor& minv, int64_t K) {
  TORCH_CHECK(K % kGroup == 0, "q4: in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.dim() == 2 && codes.size(1) * 2 == K && codes.is_contiguous(),
              "q4: codes must be contiguous uint8 [N, K/2]");
  const int64_t N = codes.size(0);
  for (const auto* t : {&scale, &minv})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == K / kGroup,
                "q4: scale and min must be contiguous float32 [N, K/32]");
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous() && x.device().is_cpu(), name,
              " must be a contiguous float32 CPU matrix [M, K]");
}

// out [M, N] (+)= x [M, K] @ w^T (+ bias)
void q4_matmul_into(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                    const torch::Tensor& minv, const c10::optional<torch::Tensor>& bias, torch::Tensor& out,
                    bool accumulate, int64_t act) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  check_q4(codes, scale, minv, K);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 2 && out.size(0) == M && out.size(1) == N &&
                  out.stride(1) == 1,
              "q4: out must be float32 [M, N] with contiguous rows");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(), "q4: bad bias");
    b = bias->data_ptr<float>();
  }
  const int64_t ldo = out.stride(0);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* mp = minv.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto integer = [&](auto tag) {
    using T = decltype(tag);
    const QuantRows<T> xr = quantize_rows<T>(x.data_ptr<float>(), M, K);
    at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
      for (int64_t r0 = 0; r0 < M; r0 += kRowTile)
        q4i_tile(xr, K, cp, sp, mp, n0, n1, r0, std::min(kRowTile, M - r0), op, ldo, b, accumulate);
    });
  };
  check_act(act);
  if (act == kActInt8) return integer(int8_t{});
  if (act == kActInt16) return integer(int16_t{});
  std::vector<float> xs = group_sums(x.data_ptr<float>(), M, K);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += kRowTile)
      q4_tile(xp, xs.data(), K, cp, sp, mp, n0, n1, r0, std::min(kRowTile, M - r0), op, ldo, b, accumulate);
  });
}

torch::Tensor q4_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale,
                        const torch::Tensor& minv, const c10::optional<torch::Tensor>& bias, int64_t act) {
  check_rows(x, "q4_matmul: x");
  auto out = torch::empty({x.size(0), codes.size(0)}, x.options());
  q4_matmul_into(x, codes, scale, minv, bias, out, false, act);
  return out;
}

torch::Tensor q8_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scale, int64_t act) {
  check_rows(x, "q8_matmul: x");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(K % kGroup == 0, "q8: in_features must be a multiple of 32, got ", K);
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.size(1) == K && codes.is_contiguous(),
              "q8: codes must be contiguous int8 [N, K]");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.size(0) == N &&
                  scale.size(1) == K / kGroup,
              "q8: scale must be contiguous float32 [N, K/32]");
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  auto integer = [&](auto tag) {
    using T = decltype(tag);
    const QuantRows<T> xr = quantize_rows<T>(xp, M, K);
    at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
      for (int64_t r0 = 0; r0 < M; r0 += kRowTile) q8i_tile(xr, K, cp, sp, n0, n1, r0, std::min(kRowTile, M - r0), op, N);
    });
  };
  check_act(act);
  if (act == kActInt8) integer(int8_t{});
  else if (act == kActInt16) integer(int16_t{});
  if (act != kActFp32) return out;
  at::parallel_for(0, N, grain(N), [&](int64_t n0, int64_t n1) {
    for (int64_t r0 = 0; r0 < M; r0 += kRowTile) q8_tile(xp, K, cp, sp, n0, n1, r0, std::min(kRowTile, M - r0), op, N);
  });
  return out;
}

// HF's LlamaRMSNorm in fp32: x * rsqrt(mean(x^2) + eps) * w.
void rms_norm_rows(const float* x, const float* w, float eps, int64_t M, int64_t H, float* out) {
  for (int64_t r = 0; r < M; ++r) {
    const float* xr = x + r * H;
    float ss = 0.f;
    for (int64_t i = 0; i < H; ++i) ss += xr[i] * xr[i];
    const float inv = 1.f / std::sqrt(ss / float(H) + eps);
    for (int64_t i = 0; i < H; ++i) out[r * H + i] = w[i] * (xr[i] * inv);
  }
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
  TORCH_CHECK(codes.size(0) == nq + 2 * nk, "attention_input: the q/k/v weight has ", codes.size(0),
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
  for (int64_t r = 0; r < M; ++r) {
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
  const int64_t I2 = gu_codes.size(0), I = I2 / 2;
  auto gu = torch::empty({M, I2}, x.options());
  q4_matmul_into(m, gu_codes, gu_scale, gu_min, c10::nullopt, gu, false, act);
  auto h = torch::empty({M, I}, x.options());
  using Vec = at::vec::Vectorized<float>;
  for (int64_t r = 0; r < M; ++r) {
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
  q4_matmul_into(h, d_codes, d_scale, d_min, c10::nullopt, x, true, act);
}


c10::optional<torch::Tensor> maybe(const torch::Tensor& t) {
  return t.defined() && t.numel() > 0 ? c10::optional<torch::Tensor>(t) : c10::nullopt;
}

// Every decoder layer of one decode step, in place on x [M, H] (fp32): per layer, `weights` holds 16 tensors
// (ln1, q/k/v codes, scale, min, bias | ln2 ... see kvboost/runtime/quant_step.py: QuantDecodeStep.flat) and
// `keys` / `values` its pool layer. Attention: cpu_paged_attention_forward, one query per sequence at
// position kv_lens - 1 (the paged contract).
void decode_layers(torch::Tensor x, const std::vector<torch::Tensor>& weights, const std::vector<torch::Tensor>& keys,
                   const std::vector<torch::Tensor>& values, const torch::Tensor& cos, const torch::Tensor& sin,
                   const torch::Tensor& slots, const torch::Tensor& block_tables, const torch::Tensor& kv_lens,
                   const torch::Tensor& query_start, const torch::Tensor& q_positions, int64_t heads,
                   int64_t kv_heads, int64_t head_dim, double eps, double scale, int64_t block_size, int64_t act) {
  constexpr size_t kPer = 16;
  const size_t L = keys.size();
  TORCH_CHECK(weights.size() == kPer * L && values.size() == L, "decode_layers: ", weights.size(),
              " weight tensors and ", L, " pool layers (16 per layer expected)");
  for (size_t l = 0; l < L; ++l) {
    const torch::Tensor* w = weights.data() + kPer * l;
    auto q = attention_input(x, w[0], eps, w[1], w[2], w[3], maybe(w[4]), cos, sin, heads, kv_heads, head_dim,
                             keys[l], values[l], slots, act);
    auto attn = torch::empty_like(q);
    cpu_paged_attention_forward(q, keys[l], values[l], block_tables, kv_lens, query_start, q_positions, block_size,
                                scale, attn, 32);
    mlp_block(x, attn, w[5], w[6], w[7], maybe(w[8]), w[9], eps, w[10], w[11], w[12], w[13], w[14], w[15],
              act);
  }
}

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
#ifdef KVB_AVX2
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "scalar";
#endif
}
