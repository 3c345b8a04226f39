"""Tests of the CUDA FlashAttention-2 forward (``kvboost/csrc/flash_attn_fwd.cu``, ``kvboost.attention.cuda_ext``).

Three layers, so that most of the kernel is checked on a machine without a GPU:

1. ``bash kvboost/csrc/compile_check.sh``: every .cu compiles for sm_80 and sm_90 without register spills (needs nvcc).
2. CPU emulation: the kernel source is compiled with g++ (``KVBOOST_FA_EMULATION``) and run with one std::thread
   per CUDA thread; ``mma.sync``, ``ldmatrix`` and warp shuffles are emulated from the PTX fragment layouts and
   ``cp.async`` copies are either done at issue or deferred to the wait (catches missing waits/barriers).  This
   checks tiling, masking, online softmax, GQA, strides and padding against a float64 reference, but not the
   hardware itself.  Both kernels run: the one-pass kernel and the split-K (flash-decoding) kernel with its
   combine kernel, whose fp32 partials are poisoned with NaN (a partial the split kernel forgets to write fails),
   and each case checks the host planner's choice (plan_split).  Needs g++ with C++20 and the CUDA headers.
3. On a CUDA machine: the built extension against a float64 torch reference on odd shapes, with the caching
   allocator poisoned with NaN so that an output element the kernel forgets to write fails the comparison; both
   paths (forced and automatic) writing through a transposed ``out`` view; the planner's choices.

Without CUDA, layer 3 is skipped and the CPU path is checked to fail with a clear message; the install-time model
checks (``cuda_model_issues``) are pure functions of the config and run everywhere.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from kvboost.attention import cuda_ext

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "kvboost" / "csrc"
HAS_GPU = cuda_ext.cuda_extension_available()


def _find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for cand in [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]:
        if cand and os.access(os.path.join(cand, "bin", "nvcc"), os.X_OK):
            return os.path.join(cand, "bin", "nvcc")
    return None


def _find_cuda_include() -> str | None:
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"]
    nvcc = _find_nvcc()
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parents[1]))
    for root in roots:
        if root and os.path.isfile(os.path.join(root, "include", "cuda_fp16.h")):
            return os.path.join(root, "include")
    return None


# ------------------------------------------------------------------------------------------------------------
# 1. compile check
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_compile_check_script():
    nvcc = _find_nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin: cannot compile kvboost/csrc/")
    env = dict(os.environ, NVCC=nvcc, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(CSRC / "compile_check.sh")],
        check=False,
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"compile_check.sh failed:\n{proc.stdout}\n{proc.stderr}"
    assert "spills" not in proc.stdout, proc.stdout


# ------------------------------------------------------------------------------------------------------------
# 2. CPU-only behaviour
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown on machines without a GPU")
def test_cpu_only_raises_clear_error():
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU and a CUDA build of torch") as info:
        cuda_ext.load_cuda_extension()
    assert "attn=triton" in str(info.value) and "attn=sdpa" in str(info.value)
    q = torch.randn(1, 2, 3, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU"):
        cuda_ext.cuda_flash_attn_forward(q, q, q)
    assert not cuda_ext.cuda_extension_available()


def test_q_positions_not_supported():
    q = torch.randn(1, 2, 3, 64, dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="q_positions"):
        cuda_ext.cuda_flash_attn_forward(q, q, q, q_positions=torch.arange(3))


@pytest.mark.parametrize(
    "bad",
    [
        {"out": torch.empty(1, 2, 3, 32, dtype=torch.float16)},
        {"out": torch.empty(1, 2, 3, 64, dtype=torch.float32)},
        {"out": [0.0]},
        {"split_kv": 1},
    ],
    ids=["out_shape", "out_dtype", "out_type", "split_kv_int"],
)
def test_out_and_split_arguments_checked_before_the_gpu(bad):
    """``out`` / ``split_kv`` are validated in Python, before the extension is needed (same error everywhere)."""
    q = torch.randn(1, 2, 3, 64, dtype=torch.float16)
    with pytest.raises((ValueError, TypeError)):
        cuda_ext.cuda_flash_attn_forward(q, q, q, **bad)


# ------------------------------------------------------------------------------------------------------------
# 2a. install-time model checks (pure functions of the config: no GPU needed)
# ------------------------------------------------------------------------------------------------------------


def _issues(config, dtype=torch.bfloat16):
    from kvboost.attention.cuda import cuda_model_issues

    return cuda_model_issues(config, dtype)


def test_cuda_model_issues_accepts_supported_models():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    assert _issues(LlamaConfig(hidden_size=512, num_attention_heads=8)) == []  # head dim 64
    assert _issues(LlamaConfig(head_dim=128), torch.float16) == []
    assert _issues(Qwen2Config()) == []  # sliding_window set but use_sliding_window=False
    # A window as long as the context is plain causal attention.
    assert _issues(MistralConfig(sliding_window=4096, max_position_embeddings=4096)) == []
    assert _issues(MistralConfig(sliding_window=None)) == []


@pytest.mark.parametrize(
    "case",
    ["fp32", "head_dim_96", "head_dim_256", "softcap", "sliding_window", "gemma2"],
)
def test_cuda_model_issues_refuses_with_alternative(case):
    from transformers import Gemma2Config, LlamaConfig, MistralConfig

    config, dtype, expect = {
        "fp32": (LlamaConfig(head_dim=64), torch.float32, ("float32", "attn=triton")),
        "head_dim_96": (LlamaConfig(head_dim=96), torch.bfloat16, ("head dim 96", "attn=triton")),
        "head_dim_256": (LlamaConfig(head_dim=256), torch.float16, ("head dim 256", "attn=sdpa")),
        "softcap": (
            LlamaConfig(head_dim=64, attn_logit_softcapping=30.0),
            torch.bfloat16,
            ("soft-capping", "attn=eager"),
        ),
        "sliding_window": (
            MistralConfig(sliding_window=1024, max_position_embeddings=8192),
            torch.bfloat16,
            ("sliding_window=1024", "attn=sdpa"),
        ),
        "gemma2": (Gemma2Config(head_dim=128), torch.bfloat16, ("soft-capping", "sliding_window=4096")),
    }[case]
    issues = _issues(config, dtype)
    text = " | ".join(issues)
    assert issues and all(word in text for word in expect), text


def test_cuda_check_model_refuses_before_install():
    """check_model (called by install after check_available) raises with every reason, on any machine."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvboost.attention.cuda import CudaBackend

    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_hidden_layers=1,
        vocab_size=32,
        head_dim=32,
    )
    model = LlamaForCausalLM(config)  # fp32, head dim 32: two issues
    with pytest.raises(ValueError, match="cannot run this model") as info:
        CudaBackend().check_model(model)
    assert "float32" in str(info.value) and "head dim 32" in str(info.value)
    config.head_dim = 64
    CudaBackend().check_model(LlamaForCausalLM(config).to(torch.bfloat16))  # supported: no error


# ------------------------------------------------------------------------------------------------------------
# 2b. CPU emulation of the kernel
# ------------------------------------------------------------------------------------------------------------

_EMU_HARNESS = r"""
// CPU emulation of kvboost/csrc/flash_attn_fwd.cu (generated by tests/kernel_tests/test_cuda_kernel.py).
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <functional>
#include <iostream>
#include <random>
#include <thread>
#include <vector>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

struct EmuDim3 { unsigned x = 0, y = 0, z = 0; };
thread_local EmuDim3 threadIdx, blockIdx;
EmuDim3 gridDim;
static std::barrier<>* g_block_bar = nullptr;
static std::barrier<>* g_warp_bar[4];
static int g_async_mode = 0;  // 0: cp.async copies at issue; 1: deferred to the wait

#define KVBOOST_FA_EMULATION 1
#define KVBOOST_FA_DEVICE inline
#define KVBOOST_FA_KERNEL void
#define KVBOOST_FA_SHARED(decl) alignas(16) static decl

namespace kvboost_fa {
static uint16_t bits_f16(float x) { __half h = __float2half_rn(x); uint16_t u; memcpy(&u, &h, 2); return u; }
static uint16_t bits_bf16(float x) {
  __nv_bfloat16 h = __float2bfloat16_rn(x); uint16_t u; memcpy(&u, &h, 2); return u;
}
static float f16_bits(uint16_t u) { __half h; memcpy(&h, &u, 2); return __half2float(h); }
static float bf16_bits(uint16_t u) { uint32_t w = uint32_t(u) << 16; float f; memcpy(&f, &w, 4); return f; }

struct WarpXchg { uint32_t a[32][4]; uint32_t b[32][2]; const void* addr[32]; float f[32]; };
static WarpXchg g_x[4];
inline int lane_id() { return threadIdx.x & 31; }
inline int warp_id() { return threadIdx.x >> 5; }
inline void warp_sync() { g_warp_bar[warp_id()]->arrive_and_wait(); }

template <bool BF>
struct MmaImpl {
  static float to_f(uint16_t u) { return BF ? bf16_bits(u) : f16_bits(u); }
  static uint16_t from_f(float x) { return BF ? bits_bf16(x) : bits_f16(x); }
  // PTX ISA, mma.m16n8k16 .f16/.bf16 fragments (g = lane / 4, t = lane % 4): A element (row, col) is held by
  // lane (row % 8) * 4 + (col % 8) / 2 in register (row >= 8) + 2 (col >= 8), half col & 1; B element (k, n)
  // by lane n * 4 + (k % 8) / 2 in register (k >= 8), half k & 1; C register i is (g + 8 (i >= 2), 2 t + i % 2).
  static void run(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    const int l = lane_id();
    WarpXchg& x = g_x[warp_id()];
    for (int i = 0; i < 4; ++i) x.a[l][i] = a[i];
    x.b[l][0] = b0; x.b[l][1] = b1;
    warp_sync();
    auto A = [&](int row, int col) {
      uint32_t r = x.a[(row % 8) * 4 + (col % 8) / 2][(row >= 8) + 2 * (col >= 8)];
      return to_f(uint16_t(col & 1 ? r >> 16 : r & 0xffff));
    };
    auto B = [&](int k, int n) {
      uint32_t r = x.b[n * 4 + (k % 8) / 2][k >= 8];
      return to_f(uint16_t(k & 1 ? r >> 16 : r & 0xffff));
    };
    float out[4];
    for (int i = 0; i < 4; ++i) {
      const int row = l / 4 + 8 * (i >= 2), col = 2 * (l % 4) + (i & 1);
      float acc = c[i];
      for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
      out[i] = acc;
    }
    warp_sync();
    for (int i = 0; i < 4; ++i) c[i] = out[i];
  }
  static uint32_t pack(float lo, float hi) { return uint32_t(from_f(lo)) | (uint32_t(from_f(hi)) << 16); }
};
template <typename T> struct MmaOp;
template <> struct MmaOp<__half> : MmaImpl<false> {};
template <> struct MmaOp<__nv_bfloat16> : MmaImpl<true> {};

thread_local std::deque<std::function<void()>> t_pending;
inline void cp_async_16(void* dst, const void* src, bool valid) {
  auto f = [=]() { if (valid) memcpy(dst, src, 16); else memset(dst, 0, 16); };
  if (g_async_mode == 0) f(); else t_pending.push_back(f);
}
inline void cp_async_commit() {}
inline void cp_async_wait_all() { while (!t_pending.empty()) { t_pending.front()(); t_pending.pop_front(); } }
// ldmatrix .x4 .trans: lanes 8i..8i+7 address the rows of matrix i; lane l receives (row 2 (l%4), col l/4)
// and (row 2 (l%4) + 1, col l/4) of matrix i.
inline void ldsm_x4_trans(uint32_t (&r)[4], const void* row_addr) {
  const int l = lane_id();
  WarpXchg& x = g_x[warp_id()];
  x.addr[l] = row_addr;
  warp_sync();
  for (int i = 0; i < 4; ++i) {
    const uint16_t* r0 = static_cast<const uint16_t*>(x.addr[8 * i + 2 * (l % 4)]);
    const uint16_t* r1 = static_cast<const uint16_t*>(x.addr[8 * i + 2 * (l % 4) + 1]);
    r[i] = uint32_t(r0[l / 4]) | (uint32_t(r1[l / 4]) << 16);
  }
  warp_sync();
}
inline float shfl_xor(float v, int mask) {
  const int l = lane_id();
  WarpXchg& x = g_x[warp_id()];
  x.f[l] = v;
  warp_sync();
  const float r = x.f[l ^ mask];
  warp_sync();
  return r;
}
inline void block_sync() { g_block_bar->arrive_and_wait(); }
inline void copy16(void* dst, const void* src) { memcpy(dst, src, 16); }
inline float fast_exp2(float x) { return exp2f(x); }
}  // namespace kvboost_fa

#include KVBOOST_SRC

using namespace kvboost_fa;

using KernelFn = void (*)(const Params);

// Runs every block of a grid, one after the other, with kThreads std::threads (shared memory is reused).
void run_grid(KernelFn kernel, const Params& p, unsigned gx, unsigned gy, unsigned gz) {
  gridDim = {gx, gy, gz};
  std::barrier<> bb(kThreads);
  g_block_bar = &bb;
  for (int w = 0; w < kWarps; ++w) g_warp_bar[w] = new std::barrier<>(32);
  std::vector<std::thread> th;
  for (int t = 0; t < kThreads; ++t)
    th.emplace_back([&, t]() {
      threadIdx = {unsigned(t), 0, 0};
      for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
          for (unsigned x = 0; x < gx; ++x) {
            blockIdx = {x, y, z};
            kernel(p);
            cp_async_wait_all();
            bb.arrive_and_wait();  // blocks run one after the other (shared memory is reused)
          }
    });
  for (auto& t : th) t.join();
  for (int w = 0; w < kWarps; ++w) delete g_warp_bar[w];
}

template <typename T, int D>
void run_launch(const Launch& l) {
  if (l.split) {
    run_grid(&flash_attn_fwd_kernel<T, D, true>, l.p, l.grid[0], l.grid[1], l.grid[2]);
    if (l.combine_blocks > 0) run_grid(&flash_attn_combine_kernel<T, D>, l.p, l.combine_blocks, 1, 1);
  } else {
    run_grid(&flash_attn_fwd_kernel<T, D, false>, l.p, l.grid[0], l.grid[1], l.grid[2]);
  }
}

// One case per input line: B Hq Hkv Lq Lk D causal bf16 padding odd_strides bshd async_mode split_kv num_sms
// split_len expect_splits.  split_kv / num_sms go to plan_split; split_len > 0 then overrides the plan's split
// length (many splits on short keys); expect_splits >= 0 checks the plan (0: one-pass kernel).
int run_case(int B, int Hq, int Hkv, int Lq, int Lk, int D, int causal, int bf16, int padding, int odd, int bshd,
             int async_mode, int split_kv, int num_sms, int split_len, int expect_splits, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  auto layout = [&](int H, int L, int64_t st[3]) -> int64_t {
    const int64_t row = D + (odd ? 1 : 0);  // odd row pitch -> unaligned rows -> scalar copy path
    if (bshd) { st[2] = row * H; st[1] = row; st[0] = row * H * L; }
    else { st[2] = row; st[1] = row * L; st[0] = row * L * H; }
    return st[0] * B + 16;
  };
  int64_t qs[3], ks[3], vs[3], os[3];
  const int64_t nq = layout(Hq, Lq, qs), nk = layout(Hkv, Lk, ks);
  layout(Hkv, Lk, vs);
  const int64_t no = layout(Hq, Lq, os);
  auto to_bits = [&](float x) { return bf16 ? bits_bf16(x) : bits_f16(x); };
  auto to_f = [&](uint16_t u) { return bf16 ? bf16_bits(u) : f16_bits(u); };
  std::vector<uint16_t> Q(nq), K(nk), V(nk), O(no, to_bits(NAN));
  for (auto& x : Q) x = to_bits(nd(rng));
  for (auto& x : K) x = to_bits(nd(rng));
  for (auto& x : V) x = to_bits(nd(rng));
  std::vector<int32_t> kst(B, 0), kln(B, Lk);
  std::uniform_int_distribution<int> ud(0, std::max(0, Lk / 3));
  for (int b = 0; padding && b < B; ++b) {
    kst[b] = ud(rng);
    kln[b] = Lk - ud(rng);
    if (b == 0 && B > 2) { kst[b] = Lk / 2; kln[b] = Lk / 2; }  // a row without any key
    if (b == 1) { kst[b] = Lk / 2; kln[b] = Lk; }  // causal: the first queries of the row see no key
  }
  const float scale = 1.f / std::sqrt(float(D));
  KvboostFlashAttnPlan plan = plan_split(B, Hq, Hkv, Lq, Lk, D, num_sms, split_kv);
  if (split_len > 0 && plan.num_splits > 0) {
    plan.split_len = split_len;
    plan.num_splits = (Lk + split_len - 1) / split_len;
    plan.workspace_bytes = workspace_bytes(B, Hq, Lq, D, plan.num_splits);
  }
  if (expect_splits >= 0 && plan.num_splits != expect_splits) {
    printf("FAIL plan: %d splits (split_len %d), expected %d\n", plan.num_splits, plan.split_len, expect_splits);
    return 1;
  }
  // Partials poisoned with NaN: a partial the split kernel forgets to write poisons the combined output.
  std::vector<float> workspace(plan.workspace_bytes / sizeof(float) + 1, NAN);
  Launch l;
  if (prepare(Q.data(), K.data(), V.data(), O.data(), padding ? kst.data() : nullptr, padding ? kln.data() : nullptr,
              B, Hq, Hkv, Lq, Lk, D, qs, ks, vs, os, causal, scale,
              bf16 ? KvboostDType::kBFloat16 : KvboostDType::kFloat16, plan, workspace.data(), &l) != cudaSuccess) {
    printf("FAIL prepare\n");
    return 1;
  }
  if (l.p.vec != (odd ? 0 : 1)) { printf("FAIL vec flag %d\n", l.p.vec); return 1; }
  g_async_mode = async_mode;
  if (l.needed) {
    if (bf16) { if (D == 64) run_launch<__nv_bfloat16, 64>(l); else run_launch<__nv_bfloat16, 128>(l); }
    else { if (D == 64) run_launch<__half, 64>(l); else run_launch<__half, 128>(l); }
  }
  double max_err = 0, max_ref = 0;
  const int G = Hq / Hkv;
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < Hq; ++h)
      for (int i = 0; i < Lq; ++i) {
        const int hk = h / G;
        std::vector<double> sc(Lk, -INFINITY), o(D, 0.0);
        double mx = -INFINITY, sum = 0;
        for (int j = 0; j < Lk; ++j) {
          if (j < kst[b] || j >= kln[b] || (causal && j > Lk - Lq + i)) continue;
          double s = 0;
          for (int d = 0; d < D; ++d)
            s += double(to_f(Q[b * qs[0] + h * qs[1] + i * qs[2] + d])) *
                 to_f(K[b * ks[0] + hk * ks[1] + j * ks[2] + d]);
          sc[j] = s * scale;
          mx = std::max(mx, sc[j]);
        }
        for (int j = 0; mx > -INFINITY && j < Lk; ++j) {
          if (sc[j] == -INFINITY) continue;
          const double pj = std::exp(sc[j] - mx);
          sum += pj;
          for (int d = 0; d < D; ++d) o[d] += pj * to_f(V[b * vs[0] + hk * vs[1] + j * vs[2] + d]);
        }
        for (int d = 0; d < D; ++d) {
          const double ref = sum > 0 ? o[d] / sum : 0.0;
          const double got = to_f(O[b * os[0] + h * os[1] + i * os[2] + d]);
          const double err = std::isfinite(got) ? std::fabs(got - ref) : 1e30;
          max_err = std::max(max_err, err);
          max_ref = std::max(max_ref, std::fabs(ref));
        }
      }
  const double rel = max_err / std::max(max_ref, 1e-6);
  const bool pass = rel < 1e-2;
  printf("%s B=%d Hq=%d Hkv=%d Lq=%d Lk=%d D=%d causal=%d %s padding=%d odd=%d bshd=%d async=%d splits=%d "
         "split_len=%d rel_err=%.3g\n",
         pass ? "PASS" : "FAIL", B, Hq, Hkv, Lq, Lk, D, causal, bf16 ? "bf16" : "fp16", padding, odd, bshd,
         async_mode, plan.num_splits, plan.split_len, rel);
  return pass ? 0 : 1;
}

int main() {
  int c[16], fails = 0;
  unsigned seed = 1;
  while (true) {
    for (int i = 0; i < 16; ++i)
      if (!(std::cin >> c[i])) goto done;
    fails += run_case(c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11], c[12], c[13], c[14],
                      c[15], seed++);
  }
done:
  printf("%d failures\n", fails);
  return fails ? 1 : 0;
}
"""

# B Hq Hkv Lq Lk D causal bf16 padding odd_strides bshd async_mode split_kv num_sms split_len expect_splits.
# One-pass kernel (split_kv 0, or automatic where it picks one-pass): every feature at least once, both copy
# paths, both cp.async timings, partial query and key tiles, rows without keys, Lk = 0.
# Split-K kernel: decode (automatic plan), GQA packing with 1..2 row blocks, several splits (split_len override
# on short keys) merged by the combine kernel, a single split (direct output), splits that are empty for some
# rows (causal, padding), odd strides (scalar copies and stores), HF's [B, L, H, D] layout, and the automatic
# plan for a short prefill over >= 2048 keys.
_EMU_CASES = [
    (1, 2, 1, 64, 64, 64, 1, 0, 0, 0, 0, 1, 0, 132, 0, 0),
    (2, 4, 2, 37, 101, 64, 1, 0, 1, 0, 0, 1, 0, 132, 0, 0),
    (1, 2, 2, 130, 130, 128, 1, 1, 0, 0, 0, 0, 0, 132, 0, 0),
    (2, 3, 1, 70, 200, 128, 0, 1, 1, 0, 1, 1, 0, 132, 0, 0),
    (1, 2, 1, 5, 77, 64, 1, 1, 1, 1, 0, 0, -1, 132, 0, 0),
    (1, 2, 2, 65, 65, 128, 1, 0, 0, 1, 1, 1, 0, 132, 0, 0),
    (3, 2, 1, 100, 100, 64, 1, 1, 1, 0, 0, 1, 0, 132, 0, 0),
    (3, 2, 2, 70, 90, 128, 1, 0, 1, 1, 0, 0, 0, 132, 0, 0),
    (1, 4, 2, 1, 90, 64, 1, 0, 1, 0, 0, 0, 0, 132, 0, 0),
    (1, 4, 2, 129, 129, 64, 0, 0, 0, 0, 0, 1, 0, 132, 0, 0),
    (1, 1, 1, 3, 0, 64, 0, 0, 0, 0, 0, 0, 1, 132, 0, 0),
    # split-K
    (2, 2, 2, 1, 300, 128, 1, 1, 1, 0, 1, 1, -1, 132, 0, 2),
    (2, 8, 2, 1, 300, 128, 1, 0, 1, 0, 0, 0, -1, 132, 64, 5),
    (1, 4, 1, 3, 200, 64, 1, 0, 0, 0, 0, 1, 1, 132, 64, 4),
    (2, 8, 2, 20, 333, 64, 1, 1, 1, 0, 0, 1, 1, 132, 64, 6),
    (1, 6, 2, 37, 150, 128, 0, 0, 1, 1, 0, 0, 1, 132, 64, 3),
    (3, 4, 4, 5, 70, 64, 1, 1, 1, 0, 1, 1, 1, 132, 0, 1),
    (1, 2, 2, 4, 130, 64, 1, 0, 1, 1, 1, 0, 1, 132, 64, 3),
    (1, 8, 1, 9, 2100, 64, 1, 0, 0, 0, 0, 1, -1, 132, 0, 5),
]


def test_kernel_cpu_emulation(tmp_path):
    cxx = shutil.which(os.environ.get("CXX", "g++")) or shutil.which("g++")
    cuda_inc = _find_cuda_include()
    if cxx is None or cuda_inc is None:
        pytest.skip("needs g++ (C++20) and the CUDA headers (cuda_fp16.h) to emulate the kernel on the CPU")
    src = tmp_path / "emu.cpp"
    src.write_text(_EMU_HARNESS)
    exe = tmp_path / "emu"
    cmd = [
        cxx,
        "-std=c++20",
        "-O2",
        "-pthread",
        f"-I{cuda_inc}",
        f"-I{CSRC}",
        f'-DKVBOOST_SRC="{CSRC / "flash_attn_fwd.cu"}"',
        str(src),
        "-o",
        str(exe),
    ]
    build = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    if build.returncode != 0 and "barrier" in build.stderr and "No such file" in build.stderr:
        pytest.skip(f"{cxx} lacks C++20 <barrier>: {build.stderr[-300:]}")
    assert build.returncode == 0, f"emulation build failed:\n{build.stderr}"
    cases = "\n".join(" ".join(map(str, c)) for c in _EMU_CASES) + "\n"
    run = subprocess.run([str(exe)], check=False, input=cases, capture_output=True, text=True, timeout=800)
    assert run.returncode == 0 and "0 failures" in run.stdout, (
        f"emulated kernel mismatches:\n{run.stdout}\n{run.stderr}"
    )
    assert run.stdout.count("PASS") == len(_EMU_CASES), run.stdout


# ------------------------------------------------------------------------------------------------------------
# 3. GPU: the real extension against a float64 reference
# ------------------------------------------------------------------------------------------------------------

needs_gpu = pytest.mark.skipif(
    not HAS_GPU, reason="needs an NVIDIA GPU (sm_80+) and a CUDA build of torch to run the CUDA kernel"
)


def reference_attention(q, k, v, *, causal, sm_scale=None, kv_start=None, kv_len=None):
    """Plain float64 attention following the contract in kvboost/kernels_triton/__init__.py."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(D) if sm_scale is None else sm_scale
    qd = q.double().cpu()
    kd = k.double().cpu().repeat_interleave(Hq // Hkv, dim=1)
    vd = v.double().cpu().repeat_interleave(Hq // Hkv, dim=1)
    s = (qd @ kd.transpose(-1, -2)) * scale
    j = torch.arange(Lk)
    valid = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
    if kv_start is not None:
        valid &= j.view(1, 1, 1, Lk) >= torch.as_tensor(kv_start).cpu().view(B, 1, 1, 1)
    if kv_len is not None:
        valid &= j.view(1, 1, 1, Lk) < torch.as_tensor(kv_len).cpu().view(B, 1, 1, 1)
    if causal:
        i = torch.arange(Lq)
        valid &= j.view(1, 1, 1, Lk) <= (Lk - Lq + i).view(1, 1, Lq, 1)
    s = s.masked_fill(~valid, float("-inf"))
    has_key = valid.any(dim=-1, keepdim=True)
    p = torch.where(has_key, torch.softmax(s.masked_fill(~has_key, 0.0), dim=-1), torch.zeros_like(s))
    return p @ vd


def rel_err(out, ref):
    out = out.detach().double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    scale = ref.abs().max().item()
    return (out - ref).abs().max().item() / (scale if scale > 0 else 1.0)


def _poison_allocator(numel, dtype):
    """Fill a freed block of the caching allocator with NaN so that the next same-size output reuses it."""
    junk = torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
    del junk


def _layout(t, kind):
    """Same values, another memory layout: 'bshd' (HF [B, L, H, D] transposed), 'pad' (row pitch D + 1:
    unaligned rows), 'offset' (base pointer 2 bytes past an aligned address)."""
    if kind == "contig":
        return t.contiguous()
    if kind == "bshd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    B, H, L, D = t.shape
    if kind == "pad":
        buf = torch.zeros(B, H, L, D + 1, dtype=t.dtype, device=t.device)
        buf[..., :D] = t
        return buf[..., :D]
    if kind == "offset":
        buf = torch.zeros(B * H * L * D + 1, dtype=t.dtype, device=t.device)
        view = buf[1:].view(B, H, L, D)
        view.copy_(t)
        return view
    raise ValueError(kind)


# (B, Hq, Hkv, Lq, Lk, D, causal, padding, layout)
GPU_CASES = [
    (1, 1, 1, 1, 1, 64, True, False, "contig"),
    (2, 4, 4, 64, 64, 64, True, False, "contig"),
    (2, 6, 2, 37, 101, 128, True, True, "contig"),
    (3, 8, 2, 1, 257, 128, True, True, "bshd"),
    (2, 4, 1, 130, 130, 64, False, False, "bshd"),
    (2, 4, 2, 77, 200, 128, False, True, "pad"),
    (3, 2, 2, 100, 100, 64, True, True, "offset"),
    (1, 32, 8, 300, 1000, 128, True, False, "contig"),
    (2, 2, 1, 5, 0, 64, False, False, "contig"),
    (4, 3, 3, 129, 517, 64, True, True, "pad"),
]


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "case",
    GPU_CASES,
    ids=lambda c: "B{}_H{}-{}_L{}-{}_D{}_{}{}_{}".format(
        c[0], c[1], c[2], c[3], c[4], c[5], "causal" if c[6] else "full", "_pad" if c[7] else "", c[8]
    ),
)
def test_cuda_kernel_matches_reference(case, dtype, record_error):
    B, Hq, Hkv, Lq, Lk, D, causal, padding, layout = case
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    q = _layout(torch.randn(B, Hq, Lq, D, generator=g).to("cuda", dtype), layout)
    k = _layout(torch.randn(B, Hkv, Lk, D, generator=g).to("cuda", dtype), layout)
    v = _layout(torch.randn(B, Hkv, Lk, D, generator=g).to("cuda", dtype), layout)
    kw = {}
    if padding:
        starts = torch.randint(0, max(1, Lk // 3), (B,), generator=g)
        ends = Lk - torch.randint(0, max(1, Lk // 3), (B,), generator=g)
        starts[0], ends[0] = Lk // 2, Lk // 2  # a row without any key -> zeros
        if B > 1:
            starts[1], ends[1] = Lk // 2, Lk  # causal: the first queries of row 1 see no key
        kw = {"kv_start": starts.to("cuda"), "kv_len": ends.to("cuda", torch.int64)}
    _poison_allocator(B * Hq * Lq * D, dtype)
    out = cuda_ext.cuda_flash_attn_forward(q, k, v, causal=causal, **kw)
    torch.cuda.synchronize()
    assert out.shape == (B, Hq, Lq, D) and out.dtype == dtype
    ref = reference_attention(q, k, v, causal=causal, **kw)
    err = rel_err(out, ref)
    record_error("cuda_fa2", dtype, err)
    assert err < 1e-2, f"relative error {err:.3e}"


@needs_gpu
def test_cuda_kernel_sm_scale_and_python_bounds():
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 4, 33, 64, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    out = cuda_ext.cuda_flash_attn_forward(q, k, v, causal=False, sm_scale=0.3, kv_start=[0, 4], kv_len=30)
    ref = reference_attention(q, k, v, causal=False, sm_scale=0.3, kv_start=[0, 4], kv_len=[30, 30])
    assert rel_err(out, ref) < 1e-2


@needs_gpu
def test_cuda_kernel_input_checks():
    """Inputs the kernel cannot take are refused in Python, before the extension (whose own C++ checks are the
    second line, see the next test)."""
    q = torch.randn(1, 4, 8, 64, device="cuda", dtype=torch.float16)
    kv = torch.randn(1, 3, 8, 64, device="cuda", dtype=torch.float16)
    forward = cuda_ext.cuda_flash_attn_forward
    with pytest.raises(ValueError, match="multiple of the number of key/value heads"):
        forward(q, kv, kv)
    with pytest.raises(ValueError, match="head dim 64 or 128"):
        x = torch.randn(1, 1, 8, 96, device="cuda", dtype=torch.float16)
        forward(x, x, x)
    with pytest.raises(TypeError, match="float16 and bfloat16"):
        x = torch.randn(1, 1, 8, 64, device="cuda")
        forward(x, x, x)
    with pytest.raises(ValueError, match="len_q <= len_k"):
        forward(q, q[:, :, :4], q[:, :, :4])
    with pytest.raises(ValueError, match="CUDA tensors"):
        x = torch.randn(1, 1, 8, 64, dtype=torch.float16)
        forward(x, x, x)
    with pytest.raises(TypeError, match="share a dtype"):
        forward(q, q.bfloat16(), q)
    with pytest.raises(ValueError, match="same shape"):
        forward(q, q, q[:, :, :4])


_RAW_CHECK = """
import torch
from kvboost.attention import cuda_ext
ext = cuda_ext.load_cuda_extension()
q = torch.randn(1, 4, 8, 64, device="cuda", dtype=torch.float16)
kv = torch.randn(1, 3, 8, 64, device="cuda", dtype=torch.float16)
try:
    ext.forward(q, kv, kv, True, None, None, None)
except RuntimeError as exc:
    print("RAISED", exc)
"""


@needs_gpu
def test_cuda_extension_own_checks_raise_in_a_subprocess():
    """The binding's C++ checks raise a RuntimeError naming the problem. Run in a child process: on the H200
    image of 2026-11 (torch 2.11.0+cu130) the throw killed the process with SIGSEGV instead, which would take
    the whole test session down (the Python checks above keep users away from it)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", _RAW_CHECK], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    if proc.returncode < 0:
        pytest.xfail(f"the extension's C++ error path crashed the process (signal {-proc.returncode}); known on "
                     "torch 2.11.0+cu130, H200 image, cause not established")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "RAISED" in proc.stdout and "multiple of the number of key/value heads" in proc.stdout, proc.stdout


# (B, Hq, Hkv, Lq, Lk, D, causal, padding): decode (GQA 4 and 8), a 3-query verification step, short suffixes
# over long caches (one and two row blocks per kv head), a suffix whose automatic plan splits over >= 2048 keys,
# and a square prefill (automatic: one-pass).
SPLIT_CASES = [
    (2, 8, 2, 1, 1000, 128, True, True),
    (1, 32, 4, 1, 4097, 64, True, False),
    (3, 6, 2, 3, 777, 64, True, True),
    (2, 8, 2, 17, 1500, 128, True, True),
    (1, 8, 2, 33, 2500, 64, False, False),
    (1, 32, 8, 100, 4096, 128, True, False),
    (2, 4, 4, 200, 200, 64, True, True),
]


@needs_gpu
@pytest.mark.parametrize("split_kv", [None, True, False], ids=["auto", "split", "one_pass"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "case",
    SPLIT_CASES,
    ids=lambda c: "B{}_H{}-{}_L{}-{}_D{}_{}{}".format(
        c[0], c[1], c[2], c[3], c[4], c[5], "causal" if c[6] else "full", "_pad" if c[7] else ""
    ),
)
def test_cuda_split_k_and_strided_out(case, dtype, split_kv, record_error):
    """Both kernels (forced and automatic) against the reference, writing through the [B, Hq, Lq, D] view of a
    NaN-poisoned [B, Lq, Hq, D] buffer (as FlashKernelBackend does), so that every element must be written."""
    B, Hq, Hkv, Lq, Lk, D, causal, padding = case
    g = torch.Generator().manual_seed(zlib.crc32(repr((case, split_kv)).encode()))
    q = torch.randn(B, Hq, Lq, D, generator=g).to("cuda", dtype)
    k = torch.randn(B, Hkv, Lk, D, generator=g).to("cuda", dtype)
    v = torch.randn(B, Hkv, Lk, D, generator=g).to("cuda", dtype)
    kw = {}
    if padding:
        starts = torch.randint(0, Lk // 3, (B,), generator=g)
        ends = Lk - torch.randint(0, Lk // 3, (B,), generator=g)
        starts[0], ends[0] = Lk // 2, Lk // 2  # a row without any key -> zeros
        kw = {"kv_start": starts.to("cuda"), "kv_len": ends.to("cuda")}
    buf = torch.full((B, Lq, Hq, D), float("nan"), dtype=dtype, device="cuda")
    res = cuda_ext.cuda_flash_attn_forward(q, k, v, causal=causal, out=buf.transpose(1, 2), split_kv=split_kv, **kw)
    torch.cuda.synchronize()
    assert res.data_ptr() == buf.data_ptr()
    err = rel_err(buf.transpose(1, 2), reference_attention(q, k, v, causal=causal, **kw))
    record_error("cuda_fa2_split" if split_kv is not False else "cuda_fa2", dtype, err)
    assert err < 1e-2, f"relative error {err:.3e}"


@needs_gpu
def test_cuda_out_without_contiguous_last_dim_and_plan():
    """An out whose last dim is strided goes through a temporary; the plan follows the documented rule."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 40, 64, generator=g).to("cuda", torch.float16) for _ in range(3))
    out = torch.full((1, 4, 40, 128), float("nan"), dtype=torch.float16, device="cuda")[..., ::2]
    cuda_ext.cuda_flash_attn_forward(q, k, v, out=out)
    assert rel_err(out, reference_attention(q, k, v, causal=True)) < 1e-2
    plan = cuda_ext.cuda_flash_attn_plan
    assert plan(1, 32, 8, 100, 16384, 128, num_sms=132)[0] > 1  # short suffix over a long cache: split
    assert plan(1, 32, 8, 4096, 4096, 128, num_sms=132)[0] == 0  # square 4k prefill: one pass
    assert plan(64, 32, 8, 1, 4096, 128, num_sms=132)[0] == 1  # decode, busy GPU: packed, no key split
    assert plan(1, 32, 8, 1, 4096, 128, num_sms=132)[0] > 1  # decode, idle GPU: key splits
    with pytest.raises(ValueError, match="out must be"):
        cuda_ext.cuda_flash_attn_forward(q, k, v, out=torch.empty_like(q)[:, :2])
