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
// Contract (the ``kernels_triton`` one): q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (any strides, last dim
// contiguous), query i of row b sits at position q_positions[b, i] (default Lk - Lq + i) and sees key j iff
// kv_start[b] <= j < kv_len[b] and (not causal or j <= position). A query that sees no key gets zeros. out
// [B, Hq, Lq, D] is written through its strides (a transposed view of transformers' layout is fine).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &cpu_attention_forward, "CPU attention forward (kernels_triton contract)", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("causal"), py::arg("scale"), py::arg("q_positions"), py::arg("kv_start"),
        py::arg("kv_len"), py::arg("out"), py::arg("tile"));
}
