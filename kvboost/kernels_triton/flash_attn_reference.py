"""Plain-torch reference for :func:`kvboost.kernels_triton.flash_attn.flash_attn_forward` (the attention contract).

Deliberately the naive formulation: build the full boolean mask, softmax(Q K^T * scale + mask) V, with GQA done by
``repeat_interleave``.  It is meant for correctness checks on small shapes (memory is O(B * Hq * Lq * Lk)), and runs
in float64 when given float64 inputs.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["flash_attn_reference", "attention_mask"]


def attention_mask(
    B: int,
    Lq: int,
    Lk: int,
    *,
    causal: bool = True,
    q_positions: Optional[torch.Tensor] = None,
    kv_start: Optional[torch.Tensor] = None,
    kv_len: Optional[torch.Tensor] = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Boolean ``[B, Lq, Lk]`` mask of the contract: True where query i of row b may attend key j."""
    j = torch.arange(Lk, device=device)
    if q_positions is None:
        if Lq > Lk:
            raise ValueError(f"q_len ({Lq}) > kv_len ({Lk}) needs explicit q_positions")
        pos = (torch.arange(Lq, device=device) + (Lk - Lq)).expand(B, Lq)
    else:
        pos = torch.as_tensor(q_positions, device=device).long()
        if pos.dim() == 1:
            pos = pos.expand(B, Lq)
        if pos.shape != (B, Lq):
            raise ValueError(f"q_positions must have shape [{B}, {Lq}] or [{Lq}], got {tuple(pos.shape)}")
    start = torch.zeros(B, dtype=torch.long, device=device) if kv_start is None else \
        torch.as_tensor(kv_start, device=device).long().reshape(B)
    stop = torch.full((B,), Lk, dtype=torch.long, device=device) if kv_len is None else \
        torch.as_tensor(kv_len, device=device).long().reshape(B)
    valid = (j[None, :] >= start[:, None]) & (j[None, :] < stop[:, None])  # [B, Lk]
    valid = valid[:, None, :].expand(B, Lq, Lk)
    if causal:
        valid = valid & (j[None, None, :] <= pos[:, :, None])
    return valid


def flash_attn_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: Optional[float] = None,
    q_positions: Optional[torch.Tensor] = None,
    kv_start: Optional[torch.Tensor] = None,
    kv_len: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    split_kv: Optional[bool] = None,
) -> torch.Tensor:
    """Reference attention with the same signature and semantics as ``flash_attn_forward``.

    Computes in float64 for float64 inputs and in float32 otherwise; returns q's dtype (or writes into ``out``).
    Queries without any valid key get zeros. ``split_kv`` (the kernel's path choice) does not change the result
    and is accepted only so that both functions take the same arguments.
    """
    del split_kv
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D [B, H, L, D]")
    B, Hq, Lq, D = q.shape
    _, Hkv, Lk, _ = k.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"incompatible shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"number of q heads ({Hq}) must be a multiple of the number of kv heads ({Hkv})")
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32

    group = Hq // Hkv
    qf = q.to(compute)
    kf = k.to(compute).repeat_interleave(group, dim=1)
    vf = v.to(compute).repeat_interleave(group, dim=1)
    valid = attention_mask(B, Lq, Lk, causal=causal, q_positions=q_positions, kv_start=kv_start,
                           kv_len=kv_len, device=q.device)[:, None]  # [B, 1, Lq, Lk]

    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~valid, float("-inf"))
    # Explicit max-subtracted softmax so that fully masked rows give 0 / 0 -> guarded to zeros, not NaN.
    row_max = scores.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
    p = torch.exp(scores - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    res = (p @ vf) / torch.where(denom > 0, denom, torch.ones_like(denom))
    if out is None:
        return res.to(q.dtype)
    out.copy_(res)
    return out
