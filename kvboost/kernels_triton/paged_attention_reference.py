"""Plain-torch reference for the paged attention contract (``kvboost.kernels_triton.paged_attention``, the
``cpu_kernel`` backend's paged entry point, and every backend's ``paged`` call in ``kvboost.attention``).

The KV pool of one layer holds keys and values in fixed-size blocks: ``k_cache``/``v_cache`` ``[Hkv, S, D]`` with
``S = num_blocks * block_size`` slots; block ``i`` is slots ``[i * block_size, (i + 1) * block_size)``. A batch is
``B`` sequences flattened into ``T`` query rows::

    out = paged_attention(
        q,              # [T, Hq, D]     queries of every sequence, sequence b owning rows query_start[b]:query_start[b+1]
        k_cache,        # [Hkv, S, D]    one layer of the pool (last dim contiguous; any other strides)
        v_cache,        # [Hkv, S, D]
        block_tables,   # [B, M] int32   block ids of each sequence, logical block order (entries past a sequence's
                        #                blocks are never read)
        kv_lens,        # [B] int32      sequence b's keys are its logical rows 0 .. kv_lens[b] - 1
        query_start,    # [B + 1] int32  row offsets of the sequences in q (query_start[0] == 0, query_start[B] == T)
        q_positions,    # [T] int32      logical position of each query: it sees key j iff j <= q_positions[t]
                        #                (and j < kv_lens[b]); any order, any subset (CacheBlend's selected rows)
        block_size,     # int
        sm_scale=None,  # default 1 / sqrt(D)
        out=None,       # [T, Hq, D] written in place (last dim contiguous), else allocated
    ) -> out            # [T, Hq, D] in q's dtype; a query that sees no key gets zeros

Logical key row ``j`` of sequence ``b`` lives in slot ``block_tables[b, j // block_size] * block_size + j %
block_size``. Grouped-query attention: query head ``h`` reads KV head ``h // (Hq // Hkv)``.

This reference gathers each sequence's rows and runs the naive masked softmax in float64 (float64 inputs) or
float32 (anything else); it is for correctness checks on small shapes.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["gather_rows", "paged_attention_reference", "slots_of"]


def slots_of(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Slot indices (int64) of logical rows ``0 .. length - 1`` of one sequence with this block table ``[M]``."""
    rows = torch.arange(length, device=block_table.device)
    return block_table.long()[rows // block_size] * block_size + rows % block_size


def gather_rows(cache: torch.Tensor, block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Rows ``0 .. length - 1`` of one sequence from a pool layer ``[Hkv, S, D]``: ``[Hkv, length, D]`` (a copy)."""
    return cache.index_select(1, slots_of(block_table.to(cache.device), length, block_size))


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start: torch.Tensor,
    q_positions: torch.Tensor,
    block_size: int,
    sm_scale: Optional[float] = None,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """The contract above, by gathering and a dense masked softmax per sequence."""
    if q.dim() != 3 or k_cache.dim() != 3 or v_cache.dim() != 3:
        raise ValueError("q must be [T, Hq, D] and k_cache / v_cache [Hkv, S, D]")
    total, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    group = heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if sm_scale is None else float(sm_scale)
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    starts = query_start.tolist()
    lens = kv_lens.tolist()
    positions = q_positions.long().to(q.device)
    result = torch.zeros(total, heads, dim, dtype=compute, device=q.device)
    for b in range(len(lens)):
        a, e = starts[b], starts[b + 1]
        if e <= a:
            continue
        n = int(lens[b])
        if n == 0:  # no key: zeros (already there)
            continue
        k = gather_rows(k_cache, block_tables[b], n, block_size).to(compute).repeat_interleave(group, dim=0)
        v = gather_rows(v_cache, block_tables[b], n, block_size).to(compute).repeat_interleave(group, dim=0)
        qs = q[a:e].to(compute).transpose(0, 1)  # [Hq, t, D]
        allowed = torch.arange(n, device=q.device)[None, :] <= positions[a:e, None]  # [t, n]
        scores = (qs @ k.transpose(1, 2)) * scale
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        p = torch.exp(scores - row_max)
        denom = p.sum(dim=-1, keepdim=True)
        res = (p @ v) / torch.where(denom > 0, denom, torch.ones_like(denom))
        result[a:e] = res.transpose(0, 1)
    if out is None:
        return result.to(q.dtype)
    out.copy_(result)
    return out
