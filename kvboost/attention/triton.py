"""``triton``: the project's Triton FlashAttention-2 forward (``kvboost.kernels_triton.flash_attn``).

transformers' mask is translated into the kernel contract (``causal``, ``q_positions``, ``kv_start``,
``kv_len``) by :func:`kvboost.attention.masks.mask_to_kernel_params`, verified exactly; masks the contract
cannot express (sliding windows shorter than the context, packed sequences, biases) run transformers' SDPA
and are counted in ``fallback_calls``.

Without a GPU the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``). That is for
correctness checks only: it is orders of magnitude slower than SDPA. Triton reads the variable when a kernel
is *decorated*, i.e. when ``kvboost.kernels_triton.flash_attn`` is imported, so the variable is set before that
import; if the kernel module was already imported without it the backend raises instead of failing later.
(``triton`` itself is typically already imported by torch by then, which is harmless.)

``install`` refuses models the kernel cannot serve (:func:`triton_model_issues`: dtype, head dim, logit
soft-capping) before touching them, and ``warmup`` runs Triton's autotuning for every length bucket up to a
maximum length, so that no measured request pays for it (GPU only).
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import time
from types import ModuleType
from typing import Any

import torch

from kvboost.attention.base import Capabilities, FlashKernelBackend
from kvboost.attention.masks import KernelMaskParams
from kvboost.kernels_triton import import_triton
from kvboost.registry import ATTENTION

log = logging.getLogger(__name__)

KERNEL_MODULE = "kvboost.kernels_triton.flash_attn"
PAGED_MODULE = "kvboost.kernels_triton.paged_attention"

_INTERPRETER_FALSE = ("0", "false", "no", "off")
_warned_interpreter = False


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() not in ("", *_INTERPRETER_FALSE)


def load_kernel_module() -> ModuleType:
    """Import ``kvboost.kernels_triton.flash_attn``, switching Triton to its CPU interpreter when there is no GPU.

    Raises:
        RuntimeError: triton is not installed; or there is no GPU and the interpreter cannot be used
            (``TRITON_INTERPRET`` explicitly disabled, or the kernel module was imported before it was set).
    """
    global _warned_interpreter
    try:
        import_triton()
    except ModuleNotFoundError as exc:
        raise RuntimeError(f"attention backend 'triton': {exc}") from exc

    if not torch.cuda.is_available():
        raw = os.environ.get("TRITON_INTERPRET")
        if raw is None or raw.strip() == "":
            if KERNEL_MODULE in sys.modules:
                raise RuntimeError(
                    f"attention backend 'triton': no CUDA GPU, and {KERNEL_MODULE} was already imported "
                    "without TRITON_INTERPRET=1, so its kernels were compiled for a GPU. Set "
                    "TRITON_INTERPRET=1 in the environment before anything imports the kernels "
                    "(or use attn=sdpa)."
                )
            os.environ["TRITON_INTERPRET"] = "1"
        elif raw.strip().lower() in _INTERPRETER_FALSE:
            raise RuntimeError(
                f"attention backend 'triton': no CUDA GPU here and TRITON_INTERPRET={raw!r} disables Triton's "
                "CPU interpreter; unset it or set TRITON_INTERPRET=1 (correctness only), or use attn=sdpa"
            )

    try:
        module = importlib.import_module(KERNEL_MODULE)
    except ImportError as exc:
        raise RuntimeError(f"attention backend 'triton': cannot import {KERNEL_MODULE}: {exc}") from exc

    if not torch.cuda.is_available():
        if not module.is_interpreter():
            raise RuntimeError(
                f"attention backend 'triton': no CUDA GPU, and {KERNEL_MODULE} was imported before "
                "TRITON_INTERPRET=1 was set, so its kernels were compiled for a GPU. Set TRITON_INTERPRET=1 "
                "in the environment before anything imports the kernels (or use attn=sdpa)."
            )
        _check_interpreted_stdlib()
        if not _warned_interpreter:
            _warned_interpreter = True
            log.warning(
                "kvboost attention 'triton': no GPU, running the Triton CPU interpreter "
                "(TRITON_INTERPRET=1): for correctness checks, not speed"
            )
    return module


#: What the Triton kernel accepts (``kvboost.kernels_triton.flash_attn``): dtypes and the largest head dim.
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TRITON_MAX_HEAD_DIM = 256


def config_head_dim(config: Any) -> int | None:
    """The attention head dim of a transformers config (``head_dim``, else hidden_size / num_attention_heads)."""
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    hidden, heads = getattr(config, "hidden_size", None), getattr(config, "num_attention_heads", None)
    if hidden and heads:
        return int(hidden) // int(heads)
    return None


def text_config(config: Any) -> Any:
    """The decoder's config (multimodal configs nest it)."""
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def triton_model_issues(config: Any, dtype: torch.dtype) -> list[str]:
    """Reasons the Triton kernel cannot serve a model with this config and dtype (empty: it can).

    A pure function of the config (so it is testable without a GPU). Sliding windows are not an issue here:
    their masks run through transformers' SDPA (counted in ``fallback_calls``).
    """
    config = text_config(config)
    issues = []
    if dtype not in TRITON_DTYPES:
        issues.append(
            f"model dtype {dtype} is not supported by the Triton kernel (float16, bfloat16, float32); "
            "cast the model or use attn=sdpa"
        )
    head_dim = config_head_dim(config)
    if head_dim is not None and not 1 <= head_dim <= TRITON_MAX_HEAD_DIM:
        issues.append(
            f"head dim {head_dim} is above the Triton kernel's maximum ({TRITON_MAX_HEAD_DIM}); use attn=sdpa"
        )
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap:
        issues.append(
            f"attn_logit_softcapping={softcap} (Gemma2-style attention logit soft-capping) is not applied by the "
            "Triton kernel; use attn=eager"
        )
    return issues


def _check_interpreted_stdlib() -> None:
    """Triton's own jit'd helpers (tl.max, tl.sum...) must be interpreted too, or kernels fail inside."""
    from triton.language import standard
    from triton.runtime.jit import JITFunction

    helper = getattr(standard, "max", None)
    if isinstance(helper, JITFunction) and type(helper).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "attention backend 'triton': triton.language was imported (e.g. by transformers) before "
            "TRITON_INTERPRET=1 was set, so Triton's standard library was compiled for a GPU and cannot run "
            "in the CPU interpreter. Import kvboost before transformers, or export TRITON_INTERPRET=1 "
            "before starting Python (or use attn=sdpa)."
        )


@ATTENTION.register("triton")
class TritonBackend(FlashKernelBackend):
    """FlashAttention-2 forward in Triton; GPU, or the CPU interpreter for correctness.

    Counters: ``kernel_calls`` (layer calls run by the Triton kernel), ``fallback_calls`` (layer calls whose
    mask the kernel contract cannot express, run by transformers' SDPA).
    """

    name = "triton"
    mask_kind = "sdpa"  # bool masks (or None): the cheapest to translate
    supports_q_positions = True
    capabilities = Capabilities(paged=True)

    def __init__(self) -> None:
        super().__init__()
        self._module: ModuleType | None = None
        self._forward = None
        self._interpreter = False
        self._paged: Any = None
        self.warmup_calls = 0

    def check_available(self) -> None:
        """Import the kernels (setting up the CPU interpreter when there is no GPU); raise if impossible."""
        module = load_kernel_module()
        self._module = module
        self._forward = module.flash_attn_forward
        self._interpreter = bool(module.is_interpreter())

    def check_model(self, model: torch.nn.Module) -> None:
        """Refuse (ValueError) a model whose dtype, head dim or soft-capping the kernel cannot serve."""
        issues = triton_model_issues(model.config, model_dtype(model))
        if issues:
            raise ValueError(
                "attention backend 'triton' cannot run this model:\n  - " + "\n  - ".join(issues)
            )

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
        """Run the kernels once per power-of-two length bucket up to ``max_len`` (prefill q = kv, short suffixes
        over long caches on both the one-pass and the split-KV path, decode), so that Triton's autotuning and
        compilation happen here, not in a measured request. A no-op on CPU and under the interpreter.

        The first warm-up of a shape family on a GPU can take minutes (every bucket benchmarks each config);
        later calls in the same process find the tuned configs cached and return quickly.
        """
        if torch.device(device).type != "cuda":
            return
        if self._module is None:
            self.check_available()
        if self._interpreter:
            return
        start = time.perf_counter()
        calls = self._module.autotune_warmup(
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
            max_len=max_len,
        )
        self.warmup_calls += calls
        log.info("kvboost attention 'triton': warm-up ran %d kernel calls in %.1f s", calls,
                 time.perf_counter() - start)

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
        if query.device.type != "cuda" and not self._interpreter:
            raise RuntimeError(
                f"attention backend 'triton': tensors are on {query.device} but the Triton kernels were "
                "compiled for CUDA; move the model to the GPU (or run with TRITON_INTERPRET=1 on a CPU-only "
                "machine, correctness only)"
            )
        return self._forward(
            query,
            key,
            value,
            causal=params.causal,
            sm_scale=scaling,
            q_positions=params.q_positions,
            kv_start=params.kv_start,
            kv_len=params.kv_len,
            out=out,
        )

    def paged(
        self, q: torch.Tensor, layer: int, batch: Any, scale: float, module: torch.nn.Module | None = None
    ) -> torch.Tensor:
        """The paged kernels (``kvboost.kernels_triton.paged_attention``): every sequence of the batch in one launch,
        keys read from the pool's blocks through the block tables (no gather)."""
        if self._paged is None:
            self.check_available()
            self._paged = importlib.import_module(PAGED_MODULE).paged_attention
        pool = batch.pool
        out = self._paged(q, pool.keys[layer], pool.values[layer], sm_scale=scale, **batch.kernel_args())
        self.kernel_calls += 1
        return out.reshape(q.shape[0], -1)

    def stats(self) -> dict[str, Any]:
        return {**super().stats(), "interpreter": self._interpreter}


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model computes in (its ``dtype`` property, else its first floating parameter's)."""
    dtype = getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    for param in model.parameters():
        if param.is_floating_point():
            return param.dtype
    return torch.get_default_dtype()
