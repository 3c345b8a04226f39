"""The elementwise arithmetic of a Llama-structured decoder, as HF computes it (leaf module: no kvboost imports).

One implementation of each: RMSNorm, RoPE tables and their application, SiLU-gated MLP input. The runner
(:mod:`kvboost.runtime.llama`) and the RoPE re-rotation of content hits (:mod:`kvboost.rope`) use these, so their
bits are HF's wherever the tests say so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's ``LlamaRMSNorm`` in one kernel: statistics in fp32 (``F.rms_norm`` computes ``x * rsqrt(mean(x^2) +
    eps)``, HF's bits, tested), the weight applied in the input's dtype."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def rms_norm_decomposed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The same formula written out (what ``torch.compile`` fuses into its neighbours; not bit-identical to
    :func:`rms_norm` in every case, which is why only the compiled path uses it)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` ``[T, head_dim]`` of ``positions`` ``[T]``, as HF's rotary embedding computes them: positions
    times inverse frequencies in fp32 (one product each), duplicated halves, scaled, cast to ``dtype``."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[T, heads, head_dim]`` with tables ``[T, head_dim]`` (HF's ``apply_rotary_pos_emb``)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return x * cos + rotate_half(x) * sin
