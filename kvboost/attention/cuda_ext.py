"""The CUDA FlashAttention-2 forward kernel (``kvboost/csrc/``), built lazily with ``torch.utils.cpp_extension``.

Python side of the attention contract in :mod:`kvboost.kernels_triton` for the CUDA backend::

    out = cuda_flash_attn_forward(q, k, v, causal=True, sm_scale=None, kv_start=None, kv_len=None,
                                  out=None, split_kv=None)

Supported: fp16 / bf16 inputs, head dim 64 or 128, grouped-query attention (``Hq % Hkv == 0``), causal
(bottom-right aligned: query ``i`` sits at key index ``Lk - Lq + i``) or not, per-row ``kv_start`` /
``kv_len`` padding, any strides with a contiguous last dimension, an ``out`` buffer with any strides (e.g. the
transposed view of transformers' ``[B, Lq, Hq, D]`` layout).  Not supported: ``q_positions`` (arbitrary query
positions) -- use the Triton backend for those.

Two kernels: the one-pass FlashAttention-2 kernel, and a split-K (flash-decoding) kernel that packs a GQA
group into one block and splits the keys across blocks, merged by a combine kernel; decode (``Lq <= 4``) and
short suffixes over long caches that would leave most SMs idle use the latter (``split_kv`` forces either).

The extension is compiled on first use (a minute or so; cached by torch under ``TORCH_EXTENSIONS_DIR``) and
needs an NVIDIA GPU of compute capability >= 8.0 and a CUDA build of torch.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch

from kvboost.paths import CSRC_DIR

__all__ = [
    "CSRC_DIR",
    "cuda_extension_available",
    "cuda_flash_attn_forward",
    "cuda_flash_attn_plan",
    "load_cuda_extension",
]

_SOURCES = ("flash_attn_binding.cpp", "flash_attn_fwd.cu")
_EXT_NAME = "kvboost_flash_attn"

_NO_GPU_MESSAGE = (
    "the cuda attention backend needs an NVIDIA GPU and a CUDA build of torch; this machine has none: "
    "use attn=triton (runs on CPU under TRITON_INTERPRET=1) or attn=sdpa"
)


def cuda_extension_available() -> bool:
    """True when the CUDA kernel can be built and run here (CUDA torch, a visible GPU of sm_80 or newer)."""
    if not torch.cuda.is_available() or torch.version.cuda is None:
        return False
    major, _ = torch.cuda.get_device_capability()
    return major >= 8


def _gencode_flags() -> list[str]:
    major, minor = torch.cuda.get_device_capability()
    if major < 8:
        raise RuntimeError(
            f"the cuda attention backend needs compute capability >= 8.0 (mma.sync bf16/fp16 tensor cores); "
            f"this GPU ({torch.cuda.get_device_name()}) is sm_{major}{minor}: use attn=triton or attn=sdpa"
        )
    return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]


@functools.lru_cache(maxsize=1)
def load_cuda_extension() -> Any:
    """Build (once per process; torch caches the binary on disk) and return the compiled extension module.

    Raises:
        RuntimeError: no CUDA build of torch or no visible NVIDIA GPU, or a GPU older than sm_80.
    """
    if not torch.cuda.is_available() or torch.version.cuda is None:
        raise RuntimeError(_NO_GPU_MESSAGE)
    from kvboost.attention.ext_build import load_extension

    sources = [str(CSRC_DIR / name) for name in _SOURCES]
    missing = [s for s in sources if not os.path.exists(s)]
    if missing:
        raise RuntimeError(f"the cuda attention backend's sources are missing: {missing}")
    return load_extension(
        _EXT_NAME,
        sources=sources,
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3", "--use_fast_math", *_gencode_flags()],
        extra_include_paths=[str(CSRC_DIR)],
        verbose=False,
    )


def _row_bounds(x: Any, name: str, batch: int, device: torch.device) -> torch.Tensor | None:
    if x is None:
        return None
    t = torch.as_tensor(x, device=device)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {t.dtype}")
    if t.dim() == 0:
        t = t.expand(batch)
    if t.shape != (batch,):
        raise ValueError(f"{name} must have shape [{batch}] (one entry per batch row), got {tuple(t.shape)}")
    return t.to(torch.int32).contiguous()


def _check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """What the C++ binding checks, checked here first: an error raised inside the extension crossed into
    Python as a crash (SIGSEGV) on one CUDA image (torch 2.11.0+cu130 on an H200), so inputs the kernel cannot
    take must never reach it."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        raise ValueError(f"q, k and v must be CUDA tensors, got {q.device}, {k.device}, {v.device}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.device == k.device == v.device:
        raise ValueError(f"q, k and v must be on the same device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    (batch, heads_q, len_q, head_dim), (k_batch, heads_kv, len_k, k_dim) = q.shape, k.shape
    if k_batch != batch or k_dim != head_dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head dim")
    if head_dim not in (64, 128):
        raise ValueError(f"the cuda attention backend needs head dim 64 or 128, got {head_dim}; use attn=triton")
    if heads_kv == 0 or heads_q % heads_kv:
        raise ValueError(f"the number of query heads ({heads_q}) must be a multiple of the number of key/value "
                         f"heads ({heads_kv})")  # fmt: skip
    if causal and len_q > len_k:
        raise ValueError(f"causal attention needs len_q <= len_k, got len_q={len_q} len_k={len_k}")


def cuda_flash_attn_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    q_positions: Any = None,
    kv_start: Any = None,
    kv_len: Any = None,
    out: torch.Tensor | None = None,
    split_kv: bool | None = None,
) -> torch.Tensor:
    """FlashAttention-2 forward on CUDA; see the module docstring and ``kvboost.kernels_triton`` for the contract.

    Args:
        q: ``[B, Hq, Lq, D]`` fp16/bf16 CUDA tensor.
        k, v: ``[B, Hkv, Lk, D]``, same dtype and device; ``Hq % Hkv == 0``.
        causal: key ``j`` is visible to query ``i`` only if ``j <= Lk - Lq + i`` (needs ``Lq <= Lk``).
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        q_positions: not supported by this backend (raises ``NotImplementedError`` when given).
        kv_start, kv_len: ``[B]`` ints (tensor, sequence or scalar): valid keys ``kv_start <= j < kv_len``.
        out: optional ``[B, Hq, Lq, D]`` output of q's dtype and device, any strides (written in place; must
            not overlap q, k or v).
        split_kv: None chooses the kernel (split-K for ``Lq <= 4``, and for longer queries when the one-pass
            grid has fewer blocks than the GPU has SMs over >= 2048 keys); True / False force split-K / one-pass.

    Returns:
        ``out`` (or a new tensor) ``[B, Hq, Lq, D]`` in the dtype of ``q``; queries without any valid key get
        zeros.
    """
    if q_positions is not None:
        raise NotImplementedError(
            "the cuda attention backend does not support q_positions (arbitrary query positions, e.g. "
            "CacheBlend's selected-token recompute); use attn=triton or attn=sdpa for those calls"
        )
    # Argument checks that need no GPU come first, so that they fail the same way everywhere.
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(
                f"the cuda attention backend supports float16 and bfloat16 only, {name} is {t.dtype}: "
                "cast the inputs or use attn=triton / attn=sdpa"
            )
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out must be a {tuple(q.shape)} {q.dtype} tensor on {q.device}; "
                f"got {tuple(out.shape)} {out.dtype} on {out.device}"
            )
    if split_kv is not None and not isinstance(split_kv, bool):
        raise TypeError(f"split_kv must be None, True or False, got {split_kv!r}")
    ext = load_cuda_extension()  # first: on a machine without a GPU, its error says what is missing
    _check_shapes(q, k, v, causal)
    batch = q.shape[0]
    kv_start_t = _row_bounds(kv_start, "kv_start", batch, q.device)
    kv_len_t = _row_bounds(kv_len, "kv_len", batch, q.device)
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1])
    split = -1 if split_kv is None else int(split_kv)
    return ext.forward(q, k, v, bool(causal), float(sm_scale), kv_start_t, kv_len_t, out, split)


def cuda_flash_attn_plan(
    batch: int,
    heads_q: int,
    heads_kv: int,
    len_q: int,
    len_k: int,
    head_dim: int,
    *,
    num_sms: int | None = None,
    split_kv: bool | None = None,
) -> tuple[int, int, int]:
    """``(num_splits, split_len, workspace_bytes)`` the extension would use (``num_splits`` 0: the one-pass
    kernel); ``num_sms`` defaults to the current GPU's. Needs the built extension (GPU)."""
    ext = load_cuda_extension()
    split = -1 if split_kv is None else int(split_kv)
    sms = -1 if num_sms is None else int(num_sms)
    return tuple(ext.plan(batch, heads_q, heads_kv, len_q, len_k, head_dim, sms, split))
