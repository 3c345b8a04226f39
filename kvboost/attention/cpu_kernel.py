"""``cpu_kernel``: a C++ attention kernel for the CPU, faster than torch's SDPA on prefill-shaped calls.

After reuse, a request's prefill is tens to hundreds of new queries over a cached prefix; in fp32 on an
AVX-512 CPU torch's flash kernel reaches about half the GEMM rate there, and attention was a third of the
suffix prefill's time. This kernel (``kvboost/csrc/cpu_attention.cpp``, loaded by :mod:`kvboost.attention.cpu_ext`)
multiplies the queries of a whole GQA group over a tile of tokens in one MKL GEMM, cuts the keys at the tile's
causal end, and runs the softmax on full rows in cache: ``experiments/bench/bench_cpu_attention.py`` measures it
against SDPA, same inputs, same run.

Under the engine it serves both paths: transformers' forward (this backend's ``attention_forward``, the
``kvboost.kernels_triton`` mask contract; masks the contract cannot express run SDPA, counted in ``fallback_calls``) and
the runners' paged call (:meth:`CpuKernelBackend.paged`: the kernel's paged entry point reads the pool's blocks
itself). The compiled CPU decode (under `sdpa` or this backend) calls the same paged entry point as a torch custom op
(:mod:`kvboost.runtime.cpu_decode_op`). fp32 and bf16; numerics are fp32 softmax and accumulation, as SDPA's
(within 1e-6 of it in fp32 on the tests' shapes, not the same bits).

(Not named ``cpu_flash``: transformers takes any attention implementation whose name holds "flash" for a
FlashAttention package to load from its hub.)

Needs an x86 torch with MKL and g++ (the kernel is compiled on first use, ~25 s, cached by torch).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from kvboost.attention.base import Capabilities, FlashKernelBackend
from kvboost.attention.cpu_ext import check_tile
from kvboost.attention.masks import KernelMaskParams
from kvboost.registry import ATTENTION


@ATTENTION.register("cpu_kernel")
class CpuKernelBackend(FlashKernelBackend):
    """The CPU kernel of ``kvboost/csrc/cpu_attention.cpp`` behind transformers' attention interface.

    Args:
        tile: query tokens per work unit (default 32): the unit's GEMMs have ``G * tile`` rows for G query heads
            per KV head. 16-64 measured within noise of each other on a 2-core AVX-512 CPU.

    Counters: ``kernel_calls`` (layer calls run by the kernel, fused-prefill calls included), ``fallback_calls``
    (calls whose mask the kernel contract cannot express, run by transformers' SDPA).
    """

    name = "cpu_kernel"
    mask_kind = "sdpa"
    capabilities = Capabilities(paged=True, runner_decode=True)
    supports_q_positions: ClassVar[bool] = True

    def __init__(self, tile: int = 32) -> None:
        super().__init__()
        self.tile = check_tile(tile, "attn.tile")
        self._forward = None
        from kvboost.attention.cpu_ext import attention_build_tag

        # in the engine's cache fingerprint: the build's lane count sets the kernel's fp32 summation order
        self.fingerprint_tag = attention_build_tag()

    def check_available(self) -> None:
        """Build (or load the cached build of) the kernel; RuntimeError with the reason where it cannot run."""
        from kvboost.attention.cpu_ext import cpu_attention_forward, load_cpu_extension

        load_cpu_extension()
        self._forward = cpu_attention_forward

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse a model on another device or dtype, or with attention soft-capping."""
        param = next(model.parameters(), None)
        if param is not None and param.device.type != "cpu":
            raise ValueError(f"attention backend 'cpu_kernel' runs on the CPU; the model is on {param.device}")
        dtype = param.dtype if param is not None else torch.get_default_dtype()
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"attention backend 'cpu_kernel' computes in float32 or bfloat16, not {dtype}")
        cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
        if getattr(cfg, "attn_logit_softcapping", None):
            raise ValueError("attention backend 'cpu_kernel' has no logit soft-capping; use attn=eager")

    def _run_kernel(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: KernelMaskParams,
        scaling: float | None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self._forward is None:
            self.check_available()
        return self._forward(query, key, value, causal=params.causal, sm_scale=scaling,
                             q_positions=params.q_positions, kv_start=params.kv_start, kv_len=params.kv_len,
                             out=out, tile=self.tile)  # fmt: skip

    def paged(
        self, q: torch.Tensor, layer: int, batch: Any, scale: float, module: torch.nn.Module | None = None
    ) -> torch.Tensor:
        """The runners' call: every sequence of the batch in one call of the kernel's paged entry point
        (``cpu_paged_attention_forward``), keys read from the pool's blocks (no gathered copy)."""
        from kvboost.attention.cpu_ext import cpu_paged_attention_forward

        args = dict(batch.kernel_args())
        args.pop("max_q_len"), args.pop("max_kv_len")  # launch hints for the GPU kernels
        pool = batch.pool
        out = cpu_paged_attention_forward(q, pool.keys[layer], pool.values[layer], sm_scale=scale, tile=self.tile,
                                          **args)  # fmt: skip
        self.kernel_calls += 1
        return out.reshape(q.shape[0], -1)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "tile": self.tile}
