// Torch binding of the kvboost FlashAttention-2 forward kernel (kvboost/csrc/flash_attn_fwd.cu).
//
// Built on a CUDA machine by kvboost/attention/cuda_ext.py (torch.utils.cpp_extension.load); it needs a
// CUDA build of torch.  Exposes
//     forward(q, k, v, causal, sm_scale, kv_start, kv_len, out=None, split_kv=-1) -> out
// with q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] (fp16 or bf16, D in {64, 128}, Hq % Hkv == 0), sm_scale None ->
// 1/sqrt(D), kv_start/kv_len None or integer tensors of shape [B], out None or a [B, Hq, Lq, D] tensor of q's
// dtype and device with any strides (written in place; it must not overlap q, k or v), split_kv -1 (automatic),
// 0 (one-pass kernel) or 1 (split-K kernel).  See kvboost/csrc/README.md for the contract.
#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <cmath>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "flash_attn_fwd.h"

namespace {

void check_qkv(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "kvboost flash_attn: ", name, " must be a CUDA tensor, got device ", t.device());
  TORCH_CHECK(t.dim() == 4, "kvboost flash_attn: ", name, " must be 4-D [batch, heads, seq, head_dim], got ",
              t.dim(), "-D");
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16,
              "kvboost flash_attn: ", name, " must be float16 or bfloat16, got ", t.scalar_type());
}

// Last dimension contiguous (the kernel reads rows as contiguous vectors); other strides are free.
at::Tensor last_dim_contiguous(const at::Tensor& t) {
  return (t.size(3) <= 1 || t.stride(3) == 1) ? t : t.contiguous();
}

std::optional<at::Tensor> row_bounds(const std::optional<at::Tensor>& t, const char* name, int64_t batch,
                                     const at::Device& device) {
  if (!t.has_value() || !t->defined()) return std::nullopt;
  const at::Tensor& x = *t;
  TORCH_CHECK(!at::isFloatingType(x.scalar_type()) && !at::isComplexType(x.scalar_type()) &&
                  x.scalar_type() != at::kBool,
              "kvboost flash_attn: ", name, " must be an integer tensor, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 1 && x.size(0) == batch, "kvboost flash_attn: ", name, " must have shape [", batch,
              "] (one entry per batch row), got ", x.sizes());
  return x.to(device, at::kInt).contiguous();
}

// Streaming-multiprocessor count of a device (the split-K plan aims for a few waves of blocks), cached.
int num_sms(int device) {
  static std::mutex mutex;
  static std::vector<int> cache;
  const std::lock_guard<std::mutex> lock(mutex);
  if (device >= static_cast<int>(cache.size())) cache.resize(device + 1, 0);
  if (cache[device] == 0) {
    int n = 0;
    const cudaError_t err = cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device);
    TORCH_CHECK(err == cudaSuccess, "kvboost flash_attn: cannot query the SM count: ", cudaGetErrorString(err));
    cache[device] = n;
  }
  return cache[device];
}

at::Tensor forward(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, bool causal,
                   std::optional<double> sm_scale, const std::optional<at::Tensor>& kv_start_in,
                   const std::optional<at::Tensor>& kv_len_in, const std::optional<at::Tensor>& out_in,
                   int64_t split_kv) {
  check_qkv(q_in, "q");
  check_qkv(k_in, "k");
  check_qkv(v_in, "v");
  TORCH_CHECK(k_in.scalar_type() == q_in.scalar_type() && v_in.scalar_type() == q_in.scalar_type(),
              "kvboost flash_attn: q, k and v must share a dtype, got ", q_in.scalar_type(), ", ",
              k_in.scalar_type(), ", ", v_in.scalar_type());
  TORCH_CHECK(k_in.device() == q_in.device() && v_in.device() == q_in.device(),
              "kvboost flash_attn: q, k and v must be on the same device, got ", q_in.device(), ", ",
              k_in.device(), ", ", v_in.device());
  TORCH_CHECK(k_in.sizes() == v_in.sizes(), "kvboost flash_attn: k and v must have the same shape, got ",
              k_in.sizes(), " and ", v_in.sizes());

  const int64_t batch = q_in.size(0), heads_q = q_in.size(1), len_q = q_in.size(2), head_dim = q_in.size(3);
  const int64_t heads_kv = k_in.size(1), len_k = k_in.size(2);
  TORCH_CHECK(k_in.size(0) == batch, "kvboost flash_attn: q and k must have the same batch size, got ", batch,
              " and ", k_in.size(0));
  TORCH_CHECK(k_in.size(3) == head_dim, "kvboost flash_attn: q and k must have the same head dim, got ",
              head_dim, " and ", k_in.size(3));
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "kvboost flash_attn: head dim must be 64 or 128, got ",
              head_dim);
  TORCH_CHECK(heads_kv > 0 && heads_q % heads_kv == 0,
              "kvboost flash_attn: the number of query heads (", heads_q,
              ") must be a multiple of the number of key/value heads (", heads_kv, ")");
  TORCH_CHECK(!causal || len_q <= len_k, "kvboost flash_attn: causal attention needs len_q <= len_k, got len_q=",
              len_q, " len_k=", len_k);
  TORCH_CHECK(batch <= 65535 && heads_q <= 65535, "kvboost flash_attn: batch and heads must be <= 65535");
  TORCH_CHECK(len_q <= INT32_MAX && len_k <= INT32_MAX, "kvboost flash_attn: sequence too long");
  TORCH_CHECK(split_kv >= -1 && split_kv <= 1, "kvboost flash_attn: split_kv must be -1 (auto), 0 or 1, got ",
              split_kv);
  const bool has_out = out_in.has_value() && out_in->defined();
  if (has_out) {
    const at::Tensor& o = *out_in;
    TORCH_CHECK(o.device() == q_in.device(), "kvboost flash_attn: out must be on ", q_in.device(), ", got ",
                o.device());
    TORCH_CHECK(o.scalar_type() == q_in.scalar_type(), "kvboost flash_attn: out must have q's dtype ",
                q_in.scalar_type(), ", got ", o.scalar_type());
    TORCH_CHECK(o.dim() == 4 && o.size(0) == batch && o.size(1) == heads_q && o.size(2) == len_q &&
                    o.size(3) == head_dim,
                "kvboost flash_attn: out must have shape [", batch, ", ", heads_q, ", ", len_q, ", ", head_dim,
                "], got ", o.sizes());
  }

  const c10::cuda::CUDAGuard guard(q_in.device());
  const at::Tensor q = last_dim_contiguous(q_in);
  const at::Tensor k = last_dim_contiguous(k_in);
  const at::Tensor v = last_dim_contiguous(v_in);
  const auto kv_start = row_bounds(kv_start_in, "kv_start", batch, q.device());
  const auto kv_len = row_bounds(kv_len_in, "kv_len", batch, q.device());

  // The kernel writes any (batch, head, seq) strides but needs a contiguous last dimension; an out without one
  // gets a temporary that is copied into it afterwards.
  const bool out_direct = has_out && (head_dim <= 1 || out_in->stride(3) == 1);
  at::Tensor out = out_direct ? *out_in : at::empty({batch, heads_q, len_q, head_dim}, q.options());
  const double scale = sm_scale.has_value() ? *sm_scale : 1.0 / std::sqrt(static_cast<double>(head_dim));

  const int64_t q_st[3] = {q.stride(0), q.stride(1), q.stride(2)};
  const int64_t k_st[3] = {k.stride(0), k.stride(1), k.stride(2)};
  const int64_t v_st[3] = {v.stride(0), v.stride(1), v.stride(2)};
  const int64_t o_st[3] = {out.stride(0), out.stride(1), out.stride(2)};
  const KvboostDType dtype = q.scalar_type() == at::kHalf ? KvboostDType::kFloat16 : KvboostDType::kBFloat16;

  const KvboostFlashAttnPlan plan = kvboost_flash_attn_plan(
      static_cast<int>(batch), static_cast<int>(heads_q), static_cast<int>(heads_kv), static_cast<int>(len_q),
      static_cast<int>(len_k), static_cast<int>(head_dim), num_sms(q.get_device()), static_cast<int>(split_kv));
  at::Tensor workspace;  // fp32 split-K partials, from torch's caching allocator
  if (plan.workspace_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>((plan.workspace_bytes + 3) / 4)}, q.options().dtype(at::kFloat));
  }

  const cudaError_t err = kvboost_flash_attn_fwd(
      q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
      kv_start.has_value() ? kv_start->data_ptr<int32_t>() : nullptr,
      kv_len.has_value() ? kv_len->data_ptr<int32_t>() : nullptr, static_cast<int>(batch),
      static_cast<int>(heads_q), static_cast<int>(heads_kv), static_cast<int>(len_q), static_cast<int>(len_k),
      static_cast<int>(head_dim), q_st, k_st, v_st, o_st, causal, static_cast<float>(scale), dtype, plan,
      workspace.defined() ? workspace.data_ptr() : nullptr, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "kvboost flash_attn: kernel launch failed: ", cudaGetErrorString(err));
  if (has_out && !out_direct) {
    out_in->copy_(out);
    return *out_in;
  }
  return out;
}

// The plan forward() would use (num_sms -1: the current device's), for tests and benchmarks.
std::tuple<int64_t, int64_t, int64_t> plan(int64_t batch, int64_t heads_q, int64_t heads_kv, int64_t len_q,
                                           int64_t len_k, int64_t head_dim, int64_t sms, int64_t split_kv) {
  if (sms < 0) {
    int device = 0;
    TORCH_CHECK(cudaGetDevice(&device) == cudaSuccess, "kvboost flash_attn: no current CUDA device");
    sms = num_sms(device);
  }
  const KvboostFlashAttnPlan p = kvboost_flash_attn_plan(
      static_cast<int>(batch), static_cast<int>(heads_q), static_cast<int>(heads_kv), static_cast<int>(len_q),
      static_cast<int>(len_k), static_cast<int>(head_dim), static_cast<int>(sms), static_cast<int>(split_kv));
  return {p.num_splits, p.split_len, static_cast<int64_t>(p.workspace_bytes)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvboost FlashAttention-2 forward (CUDA, fp16/bf16, head dim 64/128, GQA, causal, padding)";
  m.def("forward", &forward, "FlashAttention-2 forward: out = softmax(q k^T * sm_scale) v", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("causal") = true, py::arg("sm_scale") = py::none(),
        py::arg("kv_start") = py::none(), py::arg("kv_len") = py::none(), py::arg("out") = py::none(),
        py::arg("split_kv") = -1);
  m.def("plan", &plan, "the launch plan (num_splits, split_len, workspace_bytes) forward would use",
        py::arg("batch"), py::arg("heads_q"), py::arg("heads_kv"), py::arg("len_q"), py::arg("len_k"),
        py::arg("head_dim"), py::arg("num_sms") = -1, py::arg("split_kv") = -1);
}
