"""``cuda``: the project's CUDA C++ FlashAttention-2 forward (``kvboost/csrc/``, loaded by ``kvboost.attention.cuda_ext``).

The extension takes ``causal``, ``kv_start`` and ``kv_len`` but no per-query positions, so masks that need
explicit ``q_positions`` (e.g. a StaticCache with empty future slots) run transformers' SDPA and are counted
in ``fallback_calls``, like every mask the contract cannot express.

Needs an NVIDIA GPU: ``check_available`` (run by ``install``) raises a clear RuntimeError otherwise, so a CPU
user learns it when the engine is built, not at the first generate call. ``check_model`` (also run by
``install``) refuses, with the backend to use instead, models the extension cannot serve:
:func:`cuda_model_issues` (dtype, head dim, logit soft-capping, sliding windows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvboost.attention.base import FlashKernelBackend
from kvboost.attention.masks import KernelMaskParams
from kvboost.attention.triton import config_head_dim, model_dtype, text_config
from kvboost.registry import ATTENTION

#: What the CUDA extension accepts (kvboost/csrc/flash_attn_binding.cpp checks the same per call).
CUDA_DTYPES = (torch.float16, torch.bfloat16)
CUDA_HEAD_DIMS = (64, 128)


def config_sliding_window(config: Any) -> int | None:
    """The sliding window some layers of this model apply, or None (Qwen2's ``use_sliding_window=False`` and
    ``layer_types`` without a sliding layer mean no window, whatever ``sliding_window`` says)."""
    config = text_config(config)
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def cuda_model_issues(config: Any, dtype: torch.dtype) -> list[str]:
    """Reasons the CUDA extension cannot serve a model with this config and dtype (empty: it can).

    A pure function of the config and the model's dtype, so it is testable without a GPU. Each reason names the
    backend to use instead.
    """
    config = text_config(config)
    issues = []
    if dtype not in CUDA_DTYPES:
        issues.append(
            f"model dtype {dtype}: the CUDA kernel supports float16 and bfloat16 only; load the model in "
            "bfloat16/float16, or use attn=triton (float32 too) or attn=sdpa"
        )
    head_dim = config_head_dim(config)
    if head_dim is not None and head_dim not in CUDA_HEAD_DIMS:
        issues.append(
            f"head dim {head_dim}: the CUDA kernel supports head dims {' and '.join(map(str, CUDA_HEAD_DIMS))} "
            "only; use attn=triton (head dims up to 256) or attn=sdpa"
        )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        issues.append(
            f"attn_logit_softcapping={softcap} (Gemma2-style attention logit soft-capping) is not applied by the "
            "CUDA kernel; use attn=eager"
        )
    window = config_sliding_window(config)
    context = getattr(config, "max_position_embeddings", None)
    if window is not None and (context is None or window < context):
        issues.append(
            f"sliding_window={window} is shorter than the model's context ({context}): prompts past the window "
            "need a sliding-window mask, which the kernel contract (causal + kv_start/kv_len) cannot express; "
            "use attn=sdpa (or attn=triton, which runs those calls through SDPA, counted as fallback_calls)"
        )
    return issues


@ATTENTION.register("cuda")
class CudaBackend(FlashKernelBackend):
    """FlashAttention-2 forward as a CUDA C++ extension (built on first use).

    Counters: ``kernel_calls`` (layer calls run by the extension), ``fallback_calls`` (layer calls run by
    transformers' SDPA because the mask needs what the extension lacks).
    """

    name = "cuda"
    mask_kind = "sdpa"
    supports_q_positions = False

    def __init__(self) -> None:
        super().__init__()
        self._forward: Callable[..., torch.Tensor] | None = None

    def check_available(self) -> None:
        """Raise RuntimeError unless a CUDA GPU is present and the extension builds/loads."""
        if not torch.cuda.is_available():
            build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", built without CUDA")
            raise RuntimeError(
                "attention backend 'cuda' needs an NVIDIA GPU with CUDA, but torch.cuda.is_available() is "
                f"False here ({build}). Use attn=sdpa, or attn=triton (CPU interpreter, correctness only)."
            )
        if self._forward is not None:
            return
        try:
            from kvboost.attention import cuda_ext
        except ImportError as exc:
            raise RuntimeError(f"attention backend 'cuda': cannot import kvboost.attention.cuda_ext: {exc}") from exc
        try:
            cuda_ext.load_cuda_extension()
        except RuntimeError as exc:
            raise RuntimeError(f"attention backend 'cuda': the CUDA extension is unavailable: {exc}") from exc
        self._forward = cuda_ext.cuda_flash_attn_forward

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse (ValueError) a model the extension cannot serve, before ``install`` changes it."""
        issues = cuda_model_issues(model.config, model_dtype(model))
        if issues:
            raise ValueError("attention backend 'cuda' cannot run this model:\n  - " + "\n  - ".join(issues))

    def warmup(
        self,
        *,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_len: int,
    ) -> None:
        """Launch both kernels of the extension once (one-pass and split-K), so that lazy CUDA module loading
        happens here rather than in a measured request. Nothing is tuned: the tiles are fixed."""
        if torch.device(device).type != "cuda" or dtype not in CUDA_DTYPES or head_dim not in CUDA_HEAD_DIMS:
            return
        if self._forward is None:
            self.check_available()
        kv_len = max(1, min(max_len, 512))
        q = torch.zeros(1, num_q_heads, kv_len, head_dim, dtype=dtype, device=device)
        k = torch.zeros(1, num_kv_heads, kv_len, head_dim, dtype=dtype, device=device)
        for q_len, split_kv in ((kv_len, False), (1, True), (min(kv_len, 16), True)):
            self._forward(q[:, :, :q_len], k, k, causal=True, split_kv=split_kv)
        torch.cuda.synchronize(device)

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
        assert params.q_positions is None  # guaranteed by supports_q_positions = False
        return self._forward(
            query,
            key,
            value,
            causal=params.causal,
            sm_scale=scaling,
            kv_start=params.kv_start,
            kv_len=params.kv_len,
            out=out,
        )

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "extension_loaded": self._forward is not None}
