"""``cuda``: the project's CUDA C++ FlashAttention-2 forward (``csrc/``, loaded by ``kvboost.attention.cuda_ext``).

The extension takes ``causal``, ``kv_start`` and ``kv_len`` but no per-query positions, so masks that need
explicit ``q_positions`` (e.g. a StaticCache with empty future slots) run transformers' SDPA and are counted
in ``fallback_calls``, like every mask the contract cannot express.

Needs an NVIDIA GPU: ``check_available`` (run by ``install``) raises a clear RuntimeError otherwise, so a CPU
user learns it when the engine is built, not at the first generate call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvboost.attention.base import FlashKernelBackend
from kvboost.attention.masks import KernelMaskParams
from kvboost.registry import ATTENTION


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

    def _run_kernel(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        params: KernelMaskParams,
        scaling: float | None,
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
        )

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "extension_loaded": self._forward is not None}
