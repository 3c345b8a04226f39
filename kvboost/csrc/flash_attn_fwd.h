// kvboost FlashAttention-2 forward: host-side interface.
//
// Plain C++ (no torch, no CUDA device code): included by flash_attn_fwd.cu and by the torch binding.
// See kvboost/csrc/README.md and kvboost/kernels_triton/__init__.py for the attention contract.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

enum class KvboostDType : int {
  kFloat16 = 0,
  kBFloat16 = 1,
};

// How kvboost_flash_attn_fwd executes a call: the one-pass kernel, or the split-K (flash-decoding) kernel that
// packs a GQA group into one block and splits the keys over several blocks (decode and short suffixes over long
// caches), merged by a combine kernel.
struct KvboostFlashAttnPlan {
  int num_splits;          // 0: one-pass kernel; >= 1: split-K kernel with this many key splits
  int split_len;           // keys per split (split-K only); num_splits * split_len >= len_k
  size_t workspace_bytes;  // fp32 partials the caller passes as `workspace` (0 unless num_splits > 1)
};

// Chooses the path for these sizes on a GPU with `num_sms` SMs.  split_kv: -1 automatic (split-K for
// len_q <= 4, and for longer queries when the one-pass grid has fewer blocks than SMs over >= 2048 keys),
// 0 always one-pass, 1 always split-K.
KvboostFlashAttnPlan kvboost_flash_attn_plan(int batch, int heads_q, int heads_kv, int len_q, int len_k,
                                             int head_dim, int num_sms, int split_kv);

// out[b, h, i, :] = softmax_j(sm_scale * q[b, h, i, :] . k[b, h / G, j, :]) @ v[b, h / G, j, :]
// with G = heads_q / heads_kv, over the valid keys of row b:
//     kv_start[b] <= j < kv_len[b]   and, if causal, j <= len_k - len_q + i  (bottom-right alignment).
// A query with no valid key gets zeros.
//
// Layout: q/out are [batch, heads_q, len_q, head_dim], k/v are [batch, heads_kv, len_k, head_dim], all with
// the last dimension contiguous; every *_strides array holds the element strides of (batch, head, seq), so out
// may be any strided view (e.g. the [B, Hq, Lq, D] transpose of a [B, Lq, Hq, D] buffer).
// kv_start / kv_len are optional device pointers to int32[batch] (nullptr: 0 and len_k); values are clamped
// to [0, len_k].  `plan` comes from kvboost_flash_attn_plan; `workspace` is a device buffer of at least
// plan.workspace_bytes (unused when that is 0).  All pointers must live on the current device; the call is
// asynchronous on `stream`.
//
// Supports head_dim 64 and 128, fp16 and bf16 (fp32 accumulation), compute capability >= 8.0.
// Returns cudaErrorInvalidValue for unsupported arguments, otherwise the launch status.
cudaError_t kvboost_flash_attn_fwd(const void* q, const void* k, const void* v, void* out,
                                   const int32_t* kv_start, const int32_t* kv_len,
                                   int batch, int heads_q, int heads_kv, int len_q, int len_k, int head_dim,
                                   const int64_t q_strides[3], const int64_t k_strides[3],
                                   const int64_t v_strides[3], const int64_t out_strides[3],
                                   bool causal, float sm_scale, KvboostDType dtype,
                                   const KvboostFlashAttnPlan& plan, void* workspace, cudaStream_t stream);
