"""``sdpa``: transformers' own SDPA attention (torch ``scaled_dot_product_attention``), counted.

The reference backend: every other backend is tested against it. Installing it (rather than leaving the
model on plain ``attn_implementation="sdpa"``) adds the call counter and a selected-query mode for layer-wise
execution (below).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvboost.attention.base import SELECTED_Q_POSITIONS, AttentionBackend, Capabilities
from kvboost.registry import ATTENTION

#: Selected queries are split into at most this many position-sorted groups (see ``selected_query_attention``).
MAX_QUERY_GROUPS = 8
MIN_QUERIES_PER_GROUP = 32


@dataclass(frozen=True)
class QueryGroups:
    """Selected queries cut into position-sorted groups, each with the keys it reads and its additive mask.

    Layer-wise execution runs the same selection through every layer; :meth:`SdpaBackend.selected_query_inputs`
    builds this once per selection, so the layers neither compare positions nor convert masks again.
    """

    groups: tuple[tuple[int, int, int, torch.Tensor], ...]  # (first query, end query, keys read, [b-a, keys] mask)

    @classmethod
    def build(cls, q_positions: torch.Tensor, dtype: torch.dtype) -> QueryGroups:
        """Groups for sorted ``q_positions``; masks are 0 where query i may see key j (``j <= q_positions[i]``) and
        ``-inf`` elsewhere, in ``dtype`` (what SDPA makes of a bool mask on every call: the same bits)."""
        q_len = int(q_positions.numel())
        count = max(1, min(MAX_QUERY_GROUPS, q_len // MIN_QUERIES_PER_GROUP))
        bounds = [round(i * q_len / count) for i in range(count + 1)]
        groups = []
        for a, b in itertools.pairwise(bounds):
            k_end = int(q_positions[b - 1]) + 1
            allowed = torch.arange(k_end, device=q_positions.device)[None, :] <= q_positions[a:b, None]
            mask = torch.zeros(allowed.shape, dtype=dtype, device=q_positions.device)
            groups.append((a, b, k_end, mask.masked_fill_(~allowed, float("-inf"))))
        return cls(tuple(groups))


def selected_query_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_positions: torch.Tensor | QueryGroups,
    scaling: float | None,
) -> torch.Tensor:
    """Attention of queries at sorted absolute positions over keys ``[0, Lk)``: query i sees key j iff
    ``j <= q_positions[i]``. Returns ``[B, Lq, Hq, D]``.

    A dense ``[Lq, Lk]`` mask makes SDPA compute every score, half of them masked. The queries are cut into a
    few groups of consecutive positions and each group attends only to the keys up to its last position, so
    the work approaches the causal half (8 groups: ~56% of the dense work) at the cost of a few more calls.
    ``q_positions`` may come as :class:`QueryGroups` already built (once per selection, for every layer).
    """
    batch, heads, q_len, head_dim = query.shape
    plan = q_positions if isinstance(q_positions, QueryGroups) else QueryGroups.build(q_positions, query.dtype)
    if plan.groups[-1][1] != q_len:
        raise ValueError(f"the query groups cover {plan.groups[-1][1]} queries; the layer has {q_len}")
    out = query.new_empty(batch, q_len, heads, head_dim)
    gqa = key.shape[1] != heads
    for a, b, k_end, mask in plan.groups:
        part = F.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, :k_end], value[:, :, :k_end], attn_mask=mask.to(query.dtype),
            scale=scaling, enable_gqa=gqa,
        )  # fmt: skip
        out[:, a:b] = part.transpose(1, 2)
    return out


def pad_keys(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, tile: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``key``/``value`` padded with zero rows to a multiple of ``tile`` and the bool mask that hides them.

    ``mask`` None means causal aligned bottom-right (transformers passes None when SDPA's ``is_causal``
    suffices); a bool mask is padded with False, an additive float mask with its dtype's minimum.
    """
    q_len, k_len = query.shape[2], key.shape[2]
    pad = -k_len % tile
    key = F.pad(key, (0, 0, 0, pad))
    value = F.pad(value, (0, 0, 0, pad))
    if mask is None:
        q_pos = torch.arange(k_len - q_len, k_len, device=query.device)
        mask = (torch.arange(k_len + pad, device=query.device)[None, :] <= q_pos[:, None])[None, None]
    elif mask.dtype == torch.bool:
        mask = F.pad(mask, (0, pad), value=False)
    else:
        mask = F.pad(mask, (0, pad), value=torch.finfo(mask.dtype).min)
    return key, value, mask


@ATTENTION.register("sdpa")
class SdpaBackend(AttentionBackend):
    """Delegates to ``transformers.integrations.sdpa_attention.sdpa_attention_forward``; selected queries
    (layer-wise execution) run :func:`selected_query_attention`."""

    name = "sdpa"
    mask_kind = "sdpa"
    capabilities = Capabilities(exact=True, runner_decode=True)

    def __init__(self, key_tile: int = 0) -> None:
        """Args:
            key_tile: 0 (default) passes keys as they are. N > 1 pads the keys of every multi-query call
                (prefill, suffix) with masked zero rows to a multiple of N. torch's CPU flash kernel computes
                the rows of a last, partial key block by another path than full blocks, so without padding a
                token's attention output depends on how long the forward it was computed in was; with it, the
                K/V a prefix hit reuses equal a longer cold prefill's far more often (the bf16 study in the
                README, "Exactness in bf16"). Single-query calls (decode) are left as they are: the baseline's
                and the engine's decode pass the same shapes.
        """
        super().__init__()
        if not isinstance(key_tile, int) or isinstance(key_tile, bool) or key_tile < 0:
            raise ValueError(f"attn.key_tile must be a non-negative integer (0 = off), got {key_tile!r}")
        self.key_tile = key_tile

    def check_available(self) -> None:
        """SDPA ships with torch >= 2.0; always available."""
        if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
            raise RuntimeError("attention backend 'sdpa' needs torch >= 2.0 (scaled_dot_product_attention)")

    def paged(
        self, q: torch.Tensor, layer: int, batch: Any, scale: float, module: torch.nn.Module | None = None
    ) -> torch.Tensor:
        """Sequence by sequence, torch's SDPA over the sequence's rows (a view when its blocks are consecutive,
        else a gather) with ``enable_gqa`` (K/V never repeated), and the masks transformers would build: none for
        a decode step, ``is_causal`` for a cold prefill, the additive causal-by-position mask (built once per
        batch) for a suffix; rows at arbitrary positions take :func:`selected_query_attention`. transformers'
        own call repeats K/V for a masked GQA call on CPU; the result is the same bits (tested against HF's
        forward), without the copies."""
        if self.key_tile > 1:
            return super().paged(q, layer, batch, scale, module)
        total, heads, dim = q.shape
        single = batch.num_seqs == 1
        out = None if single else q.new_empty(total, heads * dim)  # one sequence: its result is the output
        gqa = batch.pool.num_kv_heads != heads
        for b in range(batch.num_seqs):
            rows = batch.rows_of(b)
            t, n = rows.stop - rows.start, batch.kv_lens[b]
            if t == 0:
                continue
            keys, values = batch.layer_kv(b, layer)
            qb = q[rows].transpose(0, 1)[None]
            if not batch.contiguous[b]:
                mask, extra = batch.cached(("sdpa_selected", b), lambda rows=rows, n=n: self.selected_query_inputs(
                    batch.positions[rows], n, q.dtype))  # fmt: skip
                if SELECTED_Q_POSITIONS in extra:  # sorted positions: query groups over the keys each one sees
                    result = selected_query_attention(qb, keys, values, extra[SELECTED_Q_POSITIONS], scale)[0]
                else:  # unsorted: the dense causal-by-position mask
                    o = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
                    result = o[0].transpose(0, 1)
            else:
                if t == 1:
                    o = F.scaled_dot_product_attention(qb, keys, values, scale=scale, enable_gqa=gqa)
                elif t == n:
                    o = F.scaled_dot_product_attention(qb, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
                else:
                    mask = batch.cached(("sdpa_mask", b), lambda rows=rows, n=n: self.causal_mask(
                        batch.positions[rows], n, q.dtype))  # fmt: skip
                    o = F.scaled_dot_product_attention(qb, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
                result = o[0].transpose(0, 1)
            self.kernel_calls += 1
            if single:
                return result.reshape(t, heads * dim)
            out[rows] = result.reshape(t, heads * dim)
        return out

    def causal_mask(self, positions: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The causal-by-position mask as the additive 0 / -inf tensor SDPA makes of a bool mask on every call
        (the same bits), built once per forward for every layer: that saves the conversion in each layer (~0.1-0.2
        ms per layer at a few hundred tokens on 2 cores), and the CPU flash kernel reads it a little faster."""
        allowed = torch.arange(n, device=positions.device)[None, :] <= positions[:, None]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=positions.device)
        return mask.masked_fill_(~allowed, float("-inf"))[None, None]

    def selected_query_inputs(
        self, q_positions: torch.Tensor, k_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor | None, dict[str, Any]]:
        if q_positions.numel() > 1 and not bool((q_positions[1:] > q_positions[:-1]).all()):
            return super().selected_query_inputs(q_positions, k_len, dtype)  # unsorted: the dense mask
        return None, {SELECTED_Q_POSITIONS: QueryGroups.build(q_positions, dtype)}

    def attention_forward(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        q_positions = kwargs.pop(SELECTED_Q_POSITIONS, None)
        if q_positions is not None and query.shape[0] == 1:
            out = selected_query_attention(query, key, value, q_positions, scaling)
            self.kernel_calls += 1
            return out, None
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if self.key_tile > 1 and query.shape[2] > 1 and key.shape[2] % self.key_tile:
            key, value, attention_mask = pad_keys(query, key, value, attention_mask, self.key_tile)
        out = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        self.kernel_calls += 1
        return out
