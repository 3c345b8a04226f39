"""``batch_invariant``: every token's arithmetic independent of the forward it runs in (bit-exact reuse in bf16).

Why: in bf16 a prefix hit is not bit-equal to a cold prefill, because the kernels pick their blocking from the
shapes of the call. On AMX CPUs oneDNN's bf16 GEMM gives some rows other bits when the same rows sit in a
forward of another length (``experiments/results/bf16_exactness/``), and torch's flash-attention kernel splits
queries and keys by the call's lengths. A row computed in a cold prefill of n tokens and the same row
computed in a suffix prefill after a cached prefix then differ in their last bits, the difference grows
through the layers, and greedy outputs part ways (the "outputs change with prefix caching" reports of vLLM and
SGLang users). Thinking Machines' "Defeating Nondeterminism in LLM Inference" (He et al., 2025) names the cure:
kernels whose reduction order per row does not depend on the batch.

How, with stock torch kernels:

- projections: every ``nn.Linear`` of the decoder layers runs in GEMMs of exactly ``tile`` rows, the tiles
  aligned to the absolute cache position (row p always sits at offset ``p % tile`` of a tile; the tile is padded
  with zero rows). A GEMM of fixed shape reduces each output element in a fixed order whatever the other rows
  hold, so a token's projection no longer depends on how many tokens share the forward. Decode steps (one
  row) pay for a padded tile: that is the price of the guarantee. Where it pays (``packed_weights``), the tiles
  multiply prepacked copies of the weights (one fixed kernel as well, without ``F.linear``'s per-call re-layout).
- attention: fp32, queries in position-aligned tiles of ``query_tile`` rows, keys in blocks of ``key_block``
  rows, every product one fixed-shape GEMM per (tile, block) (see :func:`invariant_attention`). The row maximum
  is exact whatever the order; probabilities ``exp(s - max)`` are elementwise; each block's contribution (with
  a column of ones in V giving the row sums in the same product) is added in block order. Blocks past a
  query's position contribute exact zeros (and are skipped when no query of the tile sees them), so the result
  depends only on the keys the query may see.

The fixed shapes are what the guarantee needs on a CPU whose kernels pick their reduction order by row count
(oneDNN's bf16 GEMM on AMX). Where a kernel does not, the padding is waste: ``rows="auto"`` (the default)
checks, once per GEMM shape, dtype and thread count, on this CPU, whether calls of other row counts give every
row the fixed shapes' bits (:func:`linear_rows_are_free`, :func:`probe_attention_rows`; a GEMM's reduction order
depends on its shape, threads and ISA, not on the data, so random rows settle it), and uses them where they do:
projections in unpadded calls of up to ``chunk`` rows (a decode step multiplies its one row instead of a
64-row tile), an attention call of one query tile on its own rows (at least the few the probe asks for), and
several query tiles per GEMM in the key-block-major schedule. The bits are the fixed shapes', so exactness and
the fingerprint are unchanged. On an AMD Zen 4 (AVX-512 BF16, no AMX, torch 2.13) every bf16 projection shape
of the bundled model is free for every row count, and the fp32 attention GEMMs for 4 rows or more (1-3 rows
take another path). On AMX, where bf16 rows differ by call length (``experiments/results/bf16_exactness/``),
bf16 projections keep their tiles without probing: run there, the probe passed the k/v shape (192 x 576) although
engine calls of 70 and 80 rows gave one or two rows other bits than the tiles (the reduction orders differ, and
bf16 rounding of the output hides the difference in all but a few rows, so random rows see it only by chance).
The fp32 attention probe holds there (checked the same way). ``rows="tiles"`` keeps the fixed shapes everywhere.

The LM head is left alone: the engine and the HF baselines both compute only the last row's logits.

Content reuse (layer-wise execution of selected rows) runs through the same code, correct but not aligned
(its result is an approximation anyway). The engine's eager decode step calls this backend (its tiled modules,
:meth:`BatchInvariantBackend.set_offset`, its attention), so its tokens are HF's under the backend, bit for bit.
Models with attention soft-capping are refused; sliding windows come in the mask. Cost against ``attn=sdpa``
on an AMX CPU in bf16: ``experiments/results/bf16_exactness/cost/bench_bfloat16.md``.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kvboost.attention.base import SELECTED_Q_POSITIONS, AttentionBackend, Capabilities
from kvboost.env import has_amx
from kvboost.models import prepack
from kvboost.registry import ATTENTION

#: Upper bound on the fp32 score buffer of one group of query tiles (bytes); longer prompts loop over groups.
SCORE_BUDGET_BYTES = 64 * 2**20
_PATCHED = "_kvboost_tiled_linear"


def tiled_linear(
    module: torch.nn.Linear, x: torch.Tensor, offset: int, tile: int, multiply: Callable | None = None
) -> torch.Tensor:
    """``F.linear(x, module.weight, module.bias)`` in GEMMs of exactly ``tile`` rows aligned to ``offset``.

    The rows of ``x`` (all leading dims flattened) are the tokens at cache positions ``offset, offset + 1, ...``;
    row p is computed at row ``p % tile`` of a zero-padded tile, so its bits do not depend on the call's length.
    ``multiply`` (``[tile, in] -> [tile, out]``, bias included) replaces ``F.linear`` per tile: a prepacked copy
    of the weight (:mod:`kvboost.models.prepack`), the same fixed shape on every call.
    """
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    front = offset % tile
    padded = F.pad(rows, (0, 0, front, -(front + n) % tile))
    tiles = [F.linear(t, module.weight, module.bias) if multiply is None else multiply(t) for t in padded.split(tile)]
    out = tiles[0] if len(tiles) == 1 else torch.cat(tiles)
    return out[front : front + n].reshape(*x.shape[:-1], out.shape[-1])


def chunked_linear(
    module: torch.nn.Linear, x: torch.Tensor, chunk: int, multiply: Callable | None = None
) -> torch.Tensor:
    """``F.linear(x, module.weight, module.bias)`` in calls of at most ``chunk`` rows, unpadded and unaligned: for
    a kernel whose rows were found independent of the call's row count (:func:`linear_rows_are_free`), the bits
    of :func:`tiled_linear`'s at a fraction of its cost (a decode step multiplies one row, not a tile)."""
    rows = x.reshape(-1, x.shape[-1])
    fn = (lambda t: F.linear(t, module.weight, module.bias)) if multiply is None else multiply
    parts = [fn(t) for t in rows.split(chunk)]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(*x.shape[:-1], out.shape[-1])


#: Probe results, per GEMM shape, kernel and thread count (kernel choice, hence reduction order, depends on them).
_ROW_PROBES: dict[tuple, Any] = {}


def linear_rows_are_free(fn: Callable, in_features: int, dtype: torch.dtype, tile: int, chunk: int) -> bool:
    """Whether ``fn`` (a linear: ``[M, in] -> [M, out]``) gives every row the bits it gets in a ``tile``-row call,
    for every M in ``1..chunk`` (each at a few row offsets): checked on this CPU with random rows. A GEMM's
    reduction order is a function of its shape, thread count and ISA, never of the data, so one set of rows
    per M settles it for these. Where it holds (AVX-512 BF16 without AMX: every M of the bundled model's
    shapes), :func:`chunked_linear` gives :func:`tiled_linear`'s bits; where it does not (AMX: some M give
    other bits), the backend tiles."""
    gen = torch.Generator().manual_seed(0)
    total = -(-(chunk + tile) // tile) * tile
    x = torch.randn(total, in_features, generator=gen).to(dtype)
    with torch.inference_mode():
        ref = torch.cat([fn(t) for t in x.split(tile)])
        for m in range(1, chunk + 1):
            start = (m * 7) % tile
            if not torch.equal(fn(x[start : start + m]), ref[start : start + m]):
                return False
    return True


def _qk_tiles(q: torch.Tensor, k_t: torch.Tensor) -> torch.Tensor:
    """Scores of query tiles ``[B, Hkv, n, rows, D]`` against one key block ``[B, Hkv, D, kb]`` (transposed
    view): the old schedule's batch of ``n`` GEMMs of ``rows`` rows."""
    return torch.matmul(q, k_t[:, :, None])


def _qk_merged(q: torch.Tensor, k_t: torch.Tensor) -> torch.Tensor:
    """The same scores as :func:`_qk_tiles` in one GEMM of ``n * rows`` rows (``q`` contiguous)."""
    b, h, n, rows, d = q.shape
    return torch.matmul(q.reshape(b, h, n * rows, d), k_t).view(b, h, n, rows, k_t.shape[-1])


def _pv_tiles(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.matmul(p, v[:, :, None])


def _pv_merged(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    b, h, n, rows, kb = p.shape
    return torch.matmul(p.reshape(b, h, n * rows, kb), v).view(b, h, n, rows, v.shape[-1])


@dataclass(frozen=True)
class AttentionRows:
    """What the probe found for one attention geometry (:func:`probe_attention_rows`): ``short``: the fewest
    query rows per head a call of one tile may compute instead of the whole tile (None: the whole tile);
    ``merge``: how many query tiles the key-block-major schedule may multiply in one GEMM (1: one GEMM per tile,
    batched, as before)."""

    short: int | None
    merge: int


def probe_attention_rows(
    batch: int, kv_heads: int, groups: int, dim: int, tile: int, key_block: int, max_merge: int = 16
) -> AttentionRows:
    """Finds, on this CPU, which fp32 GEMM shapes of :func:`invariant_attention` give each query row the bits it
    gets in the fixed ``groups * tile``-row GEMMs: calls of one tile computing ``r`` rows per head (for the
    smallest ``r`` such that every ``r..tile`` does), and tiles merged ``n`` at a time into one GEMM (every
    ``n`` up to ``max_merge``). Both products (scores, then probabilities times values) are checked, in the
    layouts the kernel uses, with random rows (a GEMM's reduction order depends on its shape, not the data).
    Measured on AVX-512 CPUs: 1-3-row fp32 GEMMs take another path, 4 or more agree."""
    gen = torch.Generator().manual_seed(0)
    rows, spans = groups * tile, (1, 3)
    n_max = max_merge
    q = torch.randn(batch, kv_heads, n_max, rows, dim, generator=gen)
    keys = torch.randn(batch, kv_heads, 3 * key_block, dim, generator=gen)
    k_t = keys.view(batch, kv_heads, 3, key_block, dim).transpose(-1, -2)
    p = torch.rand(batch, kv_heads, n_max, rows, key_block, generator=gen)
    v = torch.randn(batch, kv_heads, 3, key_block, dim + 1, generator=gen)
    with torch.inference_mode():
        # short calls: tile-major form, q [B, Hkv, 1, g * r, D] against ``span`` blocks at once
        ref_s = {sp: torch.matmul(q[:, :, :1], k_t[:, :, :sp]) for sp in spans}
        ref_o = {sp: torch.matmul(p[:, :, :1].expand(-1, -1, sp, -1, -1).contiguous(), v[:, :, :sp]) for sp in spans}
        short = None
        for r in range(tile, 0, -1):
            lo = (r * 3) % (tile - r + 1)  # a window of r rows of each head's tile (head-major rows)
            sel = (torch.arange(groups)[:, None] * tile + lo + torch.arange(r)[None, :]).reshape(-1)
            ok = True
            for sp in spans:
                s = torch.matmul(q[:, :, :1, sel].contiguous(), k_t[:, :, :sp])
                o = torch.matmul(p[:, :, :1, sel].expand(-1, -1, sp, -1, -1).contiguous(), v[:, :, :sp])
                ok = ok and torch.equal(s, ref_s[sp][..., sel, :]) and torch.equal(o, ref_o[sp][..., sel, :])
            if not ok:
                break
            short = r
        # merged tiles: key-block-major form
        ref_s2 = _qk_tiles(q, k_t[:, :, 0])
        ref_o2 = _pv_tiles(p, v[:, :, 0])
        merge = 1
        for n in range(2, n_max + 1):
            a = (n * 5) % (n_max - n + 1)
            if not (torch.equal(_qk_merged(q[:, :, a : a + n], k_t[:, :, 0]), ref_s2[:, :, a : a + n])
                    and torch.equal(_pv_merged(p[:, :, a : a + n].contiguous(), v[:, :, 0]), ref_o2[:, :, a : a + n])):
                break
            merge = n
    return AttentionRows(short if short is not None and short < tile else None, merge)


@dataclass(frozen=True)
class BlockPlan:
    """Which (query tile, key block) pairs an attention call computes, from its mask alone (so every layer of a
    forward can share one: :meth:`BatchInvariantBackend.attention_forward` builds it once per mask).

    ``mask`` ``[Bm, tiles, tile, blocks, kb]`` is the padded ``allowed``; ``seen[t, j]``: some query of tile ``t``
    may see some key of block ``j`` (else the pair is skipped: its contribution would be exact zeros);
    ``full[t, j]``: every real query of the tile sees every key of the block (else the scores are masked). The
    padding rows count as seeing all for ``full``: their results are dropped, and no row's bits depend on
    another row's.
    """

    front: int
    back: int
    k_pad: int
    mask: torch.Tensor
    seen: torch.Tensor
    full: torch.Tensor

    @classmethod
    def build(cls, allowed: torch.Tensor, *, front: int, tile: int, key_block: int) -> BlockPlan:
        q_len, k_len = allowed.shape[-2], allowed.shape[-1]
        back = -(front + q_len) % tile
        k_pad = -k_len % key_block
        n_tiles, blocks = (front + q_len + back) // tile, (k_len + k_pad) // key_block
        keys_padded = F.pad(allowed, (0, k_pad), value=False)
        mask = F.pad(keys_padded, (0, 0, front, back), value=False)
        mask = mask.reshape(mask.shape[0], n_tiles, tile, blocks, key_block)
        rows_padded = F.pad(keys_padded, (0, 0, front, back), value=True).reshape(mask.shape)
        seen = mask.any(dim=4).any(dim=2).any(dim=0)
        full = rows_padded.all(dim=4).all(dim=2).all(dim=0)
        return cls(front, back, k_pad, mask, seen.cpu(), full.cpu())


def invariant_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    allowed: torch.Tensor | None,
    *,
    front: int,
    tile: int,
    key_block: int,
    scaling: float,
    plan: BlockPlan | None = None,
    rows: AttentionRows | None = None,
) -> torch.Tensor:
    """Attention of ``query [B, Hq, Lq, D]`` over ``key``/``value [B, Hkv, Lk, D]`` where ``allowed
    [B or 1, 1, Lq, Lk]`` (bool) says which key each query may see; ``front`` zero rows are put before the
    queries so that they sit at their position-aligned tile offsets. Returns ``[B, Lq, Hq, D]`` in the query's
    dtype. Rows that may see no key give zeros. ``plan``: the :class:`BlockPlan` of this mask and these settings,
    when the caller keeps one (``allowed`` may then be None); built here otherwise.

    Every product is a GEMM of one fixed shape: the ``Hq / Hkv`` query heads that read one KV head, ``tile``
    query rows each, times one block of ``key_block`` keys (scores ``[g * tile, D] x [D, key_block]`` in fp32,
    then probabilities ``[g * tile, key_block] x [key_block, D + 1]``, the extra column of ones giving the row
    sums). The row maximum is exact whatever the order, ``exp(s - max)`` is elementwise, and the blocks'
    contributions are added one after the other in key order, from zero; a block no query of a tile may see is
    skipped, which is what adding its exact zeros would give. So a query's bits depend only on its own inputs and
    the keys it may see, not on the call. Two schedules make the same operations: query-tile-major for calls of
    one or two tiles (decode steps, short suffixes: one batch of GEMMs over all blocks at once) and
    key-block-major for longer calls (a Python loop over key blocks instead of over tiles).

    ``rows`` (:func:`probe_attention_rows`, for this geometry on this CPU): GEMM shapes found to give every row
    the fixed shapes' bits, used instead of them: a call of one tile computes only its query rows (at least
    ``rows.short`` per head) instead of the whole tile (a decode step: 1 row, not ``tile``), and the
    key-block-major schedule multiplies ``rows.merge`` tiles per GEMM. Same bits, less work.
    """
    if plan is None:
        if allowed is None:
            raise ValueError("invariant_attention needs the mask (allowed) or its block plan")
        plan = BlockPlan.build(allowed, front=front, tile=tile, key_block=key_block)
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    n_tiles, blocks = plan.seen.shape
    front, back = plan.front, plan.back
    if rows is not None and rows.short is not None and n_tiles == 1 and q_len < tile:
        # One tile: only a window of its rows holding the queries (the padding rows' results are dropped anyway).
        width = max(q_len, rows.short)
        lo = min(front, tile - width)
        plan = BlockPlan(front - lo, lo + width - front - q_len, plan.k_pad, plan.mask[:, :, lo : lo + width],
                         plan.seen, plan.full)  # fmt: skip
        front, back, tile = plan.front, plan.back, width
    merge = 1 if rows is None else rows.merge
    n_rows = groups * tile
    # Queries [B, Hkv, tiles, g * tile, D]: the g heads reading one KV head stacked, one GEMM per KV head.
    q = F.pad(query, (0, 0, front, back)).view(batch, kv_heads, groups, n_tiles, tile, dim)
    q = q.permute(0, 1, 3, 2, 4, 5).to(torch.float32).reshape(batch, kv_heads, n_tiles, n_rows, dim)
    # Keys in fp32 blocks, read transposed ([B, Hkv, blocks, D, kb] views); values [B, Hkv, blocks, kb, D + 1]
    # with the ones. Written once each (a padded copy then a converted one cost ~2x on a long cache, per layer).
    k_len = key.shape[2]
    keys = torch.empty(batch, kv_heads, blocks * key_block, dim, dtype=torch.float32, device=key.device)
    keys[:, :, :k_len] = key
    v1 = torch.empty(batch, kv_heads, blocks * key_block, dim + 1, dtype=torch.float32, device=key.device)
    v1[:, :, :k_len, :dim] = value
    v1[:, :, :k_len, dim] = 1.0
    if plan.k_pad:  # padding keys: zeros (they are masked; no row sum either)
        keys[:, :, k_len:] = 0.0
        v1[:, :, k_len:] = 0.0
    k_t = keys.view(batch, kv_heads, blocks, key_block, dim).transpose(-1, -2)
    v1 = v1.view(batch, kv_heads, blocks, key_block, dim + 1)
    out = q.new_empty(batch, kv_heads, n_tiles, n_rows, dim)
    if n_tiles <= 2:
        for t in range(n_tiles):
            _tile_major(q, k_t, v1, plan, out, t, groups, scaling)
    else:
        step = max(1, SCORE_BUDGET_BYTES // max(1, batch * kv_heads * n_rows * blocks * key_block * 4))
        for a in range(0, n_tiles, step):
            _block_major(q, k_t, v1, plan, out, a, min(n_tiles, a + step), groups, scaling, merge)
    out = out.view(batch, kv_heads, n_tiles, groups, tile, dim).permute(0, 1, 3, 2, 4, 5)
    out = out.reshape(batch, heads, n_tiles * tile, dim)[:, :, front : front + q_len]
    return out.transpose(1, 2).to(query.dtype).contiguous()


def _version(tensor: torch.Tensor) -> int:
    """The tensor's in-place version counter; inference tensors keep none (-1: only identity is checked)."""
    return -1 if tensor.is_inference() else tensor._version


def _span(flags: torch.Tensor) -> tuple[int, int] | None:
    """``(first, last + 1)`` of the True entries of a 1-D bool tensor, None if there are none."""
    where = flags.nonzero()
    return (int(where[0]), int(where[-1]) + 1) if where.numel() else None


def _hide(s: torch.Tensor, hidden: torch.Tensor, groups: int, value: float) -> torch.Tensor:
    """Writes ``value`` into ``s`` ``[B, Hkv, n, g * tile, kb]`` where ``hidden`` (:func:`_cut`) is True."""
    shape = s.shape
    return s.view(*shape[:-2], groups, shape[-2] // groups, shape[-1]).masked_fill_(hidden, value).view(shape)


def _cut(s: torch.Tensor, c0: int, c1: int, mask: torch.Tensor, groups: int) -> tuple[int, int, torch.Tensor]:
    """Masks entries ``c0..c1`` of ``s``'s third dim with ``-inf`` where ``mask`` ``[Bm, c1 - c0, tile, kb]`` is
    False; returns ``(c0, c1, hidden)`` for :func:`_exp_shifted` (``hidden``: the inverted mask, broadcast over
    the batch's KV heads and the query heads of a group)."""
    hidden = ~mask.unsqueeze(1).unsqueeze(-3)
    _hide(s[:, :, c0:c1], hidden, groups, float("-inf"))
    return c0, c1, hidden


def _exp_shifted(s: torch.Tensor, m: torch.Tensor, cut: tuple[int, int, torch.Tensor] | None, groups: int) -> None:
    """``exp(s - m)`` in place of ``s``, exact zeros where ``cut`` masked. Masked scores go through ``exp`` as 0,
    not as ``-inf``: ``exp`` of a value that underflows takes a slow path on x86 (~20x a normal one)."""
    s.sub_(m)
    if cut is not None:
        c0, c1, hidden = cut
        _hide(s[:, :, c0:c1], hidden, groups, 0.0)
    s.exp_()
    if cut is not None:
        _hide(s[:, :, c0:c1], hidden, groups, 0.0)


def _finite(m: torch.Tensor) -> torch.Tensor:
    """Row maxima of rows that see no key are -inf: 0 instead (their probabilities are all exact zeros)."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _normalise(acc: torch.Tensor, dim: int) -> torch.Tensor:
    total = acc[..., dim:]
    return torch.where(total > 0, acc[..., :dim] / total.clamp_min(torch.finfo(torch.float32).tiny), 0.0)


def _tile_major(q, k_t, v1, plan: BlockPlan, out, t: int, groups: int, scaling: float) -> None:
    """One query tile against all the key blocks it sees, each product a batch of fixed-shape GEMMs."""
    span = _span(plan.seen[t])
    if span is None:
        out[:, :, t] = 0.0
        return
    lo, hi = span
    # [B, Hkv, span, g * tile, kb]: the tile's queries broadcast over the blocks, one [g*tile, D] x [D, kb] each.
    s = torch.matmul(q[:, :, t, None], k_t[:, :, lo:hi]).mul_(scaling)
    cut = _span(~plan.full[t, lo:hi])  # the blocks to mask (causal: the last)
    if cut is not None:
        cut = _cut(s, *cut, plan.mask[:, t, :, lo + cut[0] : lo + cut[1]].transpose(1, 2), groups)
    _exp_shifted(s, _finite(s.amax(dim=(2, 4), keepdim=True)), cut, groups)
    parts = torch.matmul(s, v1[:, :, lo:hi])  # [B, Hkv, span, g*tile, D+1]
    acc = torch.zeros_like(parts[:, :, 0])  # from zero, as the block-major schedule: the same additions
    for j in range(hi - lo):  # in key order: the additions every call that sees these keys makes
        acc += parts[:, :, j]
    out[:, :, t] = _normalise(acc, out.shape[-1])


def _block_major(
    q, k_t, v1, plan: BlockPlan, out, a: int, b: int, groups: int, scaling: float, merge: int = 1
) -> None:
    """Query tiles ``a..b``: a loop over key blocks, each block's products for every tile that sees it in one
    batch of fixed-shape GEMMs (or, ``merge`` > 1, GEMMs of up to ``merge`` tiles' rows: see
    :func:`probe_attention_rows`). Two passes: the scores and their row maxima, then the probabilities and their
    products added in block order."""
    qk, pv = (_qk_tiles, _pv_tiles) if merge <= 1 else (_qk_merged, _pv_merged)

    def scores_of(t0: int, t1: int, j: int) -> torch.Tensor:
        if t1 - t0 <= merge:
            return qk(q[:, :, t0:t1], k_t[:, :, j])
        return torch.cat([qk(q[:, :, c : min(t1, c + merge)], k_t[:, :, j]) for c in range(t0, t1, merge)], dim=2)

    def products_of(s: torch.Tensor, j: int) -> torch.Tensor:
        n = s.shape[2]
        if n <= merge:
            return pv(s, v1[:, :, j])
        return torch.cat([pv(s[:, :, c : c + merge], v1[:, :, j]) for c in range(0, n, merge)], dim=2)

    used = _span(plan.seen[a:b].any(dim=0))
    if used is None:
        out[:, :, a:b] = 0.0
        return
    scores: list[tuple[int, int, torch.Tensor, tuple[int, int, torch.Tensor] | None]] = []
    m = q.new_full((*q.shape[:2], b - a, q.shape[3], 1), float("-inf"))
    for j in range(*used):
        tiles = _span(plan.seen[a:b, j])
        if tiles is None:
            continue
        t0, t1 = a + tiles[0], a + tiles[1]
        # [B, Hkv, n, g * tile, kb]: this block for tiles t0..t1, one [g*tile, D] x [D, kb] each.
        s = scores_of(t0, t1, j).mul_(scaling)
        cut = _span(~plan.full[t0:t1, j])  # the tiles it cuts through (causal: the diagonal ones)
        if cut is not None:
            cut = _cut(s, *cut, plan.mask[:, t0 + cut[0] : t0 + cut[1], :, j], groups)
        rows_m = m[:, :, t0 - a : t1 - a]
        torch.maximum(rows_m, s.amax(dim=-1, keepdim=True), out=rows_m)
        scores.append((j, t0, s, cut))
    m = _finite(m)
    acc = q.new_zeros((*q.shape[:2], b - a, q.shape[3], v1.shape[-1]))
    for j, t0, s, cut in scores:  # in key order: the additions every call that sees these keys makes
        _exp_shifted(s, m[:, :, t0 - a : t0 - a + s.shape[2]], cut, groups)
        acc[:, :, t0 - a : t0 - a + s.shape[2]] += products_of(s, j)
    out[:, :, a:b] = _normalise(acc, out.shape[-1])


@ATTENTION.register("batch_invariant")
class BatchInvariantBackend(AttentionBackend):
    """Attention and decoder-layer projections whose per-token bits do not depend on the call's length.

    With it, a bf16 prefix hit gives the same logits and greedy tokens as a cold prefill, bit for bit (the
    HF baselines of a run use the same arithmetic, since the backend is installed in the model they share).

    Args:
        tile: rows per GEMM tile of the decoder projections, aligned to cache positions. Larger tiles mean
            fewer GEMM calls per prefill and more padding per decode step.
        query_tile: query rows per attention GEMM, aligned to cache positions the same way (a decode step
            computes ``query_tile`` rows per head for its one).
        key_block: keys per block of the attention's in-order accumulation.
        packed_weights: multiply the tiles with prepacked copies of the projection weights (oneDNN's layout in
            bf16, MKL's in fp32; :mod:`kvboost.models.prepack`), which a GEMM of a few dozen rows runs 1.2-2x
            faster than ``F.linear``, whose bf16 kernel re-lays the weight out on every call. ``"auto"`` packs on
            CPUs with native bf16 (bf16) or MKL (fp32) when the copies take at most 5% of the memory; ``True``
            insists (an error where it cannot), ``False`` keeps ``F.linear``. Packed copies are rebuilt when a
            weight is changed in place or replaced.
        rows: ``"auto"`` checks on first use, per GEMM shape and thread count, whether this CPU's kernel gives
            every row the bits of the fixed shapes whatever the call's row count (:func:`linear_rows_are_free`,
            :func:`probe_attention_rows`), and where it does computes without the padding: projections in
            calls of up to ``chunk`` rows (a decode step multiplies its one row), attention calls of one tile on
            their own query rows, longer ones with several tiles per GEMM. The bits are the fixed shapes' (the
            probe compares against them), so the fingerprint does not change. ``"tiles"``: always the fixed
            shapes.
        chunk: rows per projection call under ``rows="auto"`` where the rows are free (every count up to it is
            checked).
    """

    name = "batch_invariant"
    mask_kind = "sdpa"
    capabilities = Capabilities(batch_invariant=True, tiled_projections=True)

    def __init__(
        self, tile: int = 64, key_block: int = 128, query_tile: int = 16, packed_weights: bool | str = "auto",
        rows: str = "auto", chunk: int = 128,
    ) -> None:  # fmt: skip
        super().__init__()
        if rows not in ("auto", "tiles"):
            raise ValueError(f"attn.rows must be 'auto' or 'tiles', got {rows!r}")
        for field, value in (("tile", tile), ("query_tile", query_tile), ("key_block", key_block), ("chunk", chunk)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"attn.{field} must be a positive integer, got {value!r}")
        if packed_weights not in ("auto", True, False):
            raise ValueError(f"attn.packed_weights must be 'auto', true or false, got {packed_weights!r}")
        self.tile, self.query_tile, self.key_block = tile, query_tile, key_block
        self.packed_weights = packed_weights
        self.rows, self.chunk = rows, chunk
        self._weight_bytes = 0  # of the tiled linears' weights (install): what packing them all would copy
        self._packs: dict[torch.nn.Module, tuple[tuple, Callable | None]] = {}
        self._plan_cache: tuple[torch.Tensor | None, tuple, BlockPlan] | None = None
        # The settings choose the GEMM shapes and kernels, so the bits: entries computed under other ones stay apart.
        self.fingerprint_tag = f"batch_invariant(tile={tile},query_tile={query_tile},key_block={key_block})"
        self._offset = 0  # cache position of the first row of the forward that runs now
        self._hooks: list[Any] = []

    def check_available(self) -> None:
        """Plain torch ops; always available."""

    def check_model(self, model: torch.nn.Module) -> None:
        config = model.config.get_text_config(decoder=True)
        # Sliding windows need nothing here: transformers hands a mask whenever the window hides a key.
        if getattr(config, "attn_logit_softcapping", None):
            raise ValueError(
                "attention backend 'batch_invariant' does not support attention soft-capping; use attn=sdpa"
            )

    # ------------------------------------------------------------------ install: projections and offsets
    def install(self, model: torch.nn.Module) -> torch.nn.Module:
        """Install the attention (as every backend does), tile the decoder layers' projections, and record each
        forward's first cache position (the tiles' alignment)."""
        super().install(model)
        if self._hooks:
            return model
        base = model.get_decoder() if hasattr(model, "get_decoder") else model
        linears = [module for layer in getattr(base, "layers", []) for module in layer.modules()
                   if isinstance(module, torch.nn.Linear) and not hasattr(module, _PATCHED)]  # fmt: skip
        self._weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
        if self.packed_weights is True and linears:
            reason = self._pack_unavailable(linears[0].weight)
            if reason is not None:
                raise ValueError(f"attn.packed_weights=true cannot run here: {reason}; use 'auto' or false")
        self._hooks.append(base.register_forward_pre_hook(self._record_offset, with_kwargs=True))
        for module in linears:
            module.forward = types.MethodType(self._linear_forward, module)
            setattr(module, _PATCHED, self)
        return model

    def uninstall(self, model: torch.nn.Module) -> torch.nn.Module:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for module in model.modules():
            if getattr(module, _PATCHED, None) is self:
                del module.forward  # back to the class's forward
                delattr(module, _PATCHED)
        self._packs.clear()
        self._plan_cache = None
        return super().uninstall(model)

    def _record_offset(self, module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        position = kwargs.get("cache_position")
        if position is not None and position.numel():
            self._offset = int(position.reshape(-1)[0])
            return
        cache = kwargs.get("past_key_values", kwargs.get("cache"))  # transformers renames it to ``cache``
        self._offset = int(cache.get_seq_length()) if cache is not None else 0

    def set_offset(self, position: int) -> None:
        """The cache position of the first row the next projections compute (the tiles' alignment): what the
        forward hook records from HF's forward, for a caller that runs the layers itself (the decode step)."""
        self._offset = int(position)

    def _linear_forward(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        multiply = self._packed(module, x)
        if self._linear_free(module, x, multiply):
            return chunked_linear(module, x, self.chunk, multiply)
        return tiled_linear(module, x, self._offset, self.tile, multiply)

    def _linear_free(self, module: torch.nn.Linear, x: torch.Tensor, multiply: Callable | None) -> bool:
        """Whether ``module``'s rows are free of the call's row count here (probed once per shape, kernel, dtype
        and thread count, for the process)."""
        if self.rows != "auto" or x.dtype != module.weight.dtype or x.device.type != "cpu":
            return False
        weight = module.weight
        if weight.dtype in (torch.bfloat16, torch.float16) and has_amx():
            # oneDNN's AMX kernels reduce by the call's row count; bf16 output rounding hides that in most rows,
            # so a probe with random rows can pass a shape that is not free (module docstring): keep the tiles.
            return False
        key = ("linear", tuple(weight.shape), weight.dtype, module.bias is not None, multiply is not None,
               self.tile, self.chunk, torch.get_num_threads())  # fmt: skip
        free = _ROW_PROBES.get(key)
        if free is None:
            fn = multiply if multiply is not None else (lambda t: F.linear(t, weight, module.bias))
            free = _ROW_PROBES[key] = linear_rows_are_free(fn, weight.shape[1], weight.dtype, self.tile, self.chunk)
        return free

    def _attention_rows(self, batch: int, kv_heads: int, groups: int, dim: int, device: torch.device):
        """The probed shapes for this attention geometry (None under ``rows="tiles"`` or off the CPU)."""
        if self.rows != "auto" or device.type != "cpu":
            return None
        key = ("attention", batch, kv_heads, groups, dim, self.query_tile, self.key_block, torch.get_num_threads())
        found = _ROW_PROBES.get(key)
        if found is None:
            found = _ROW_PROBES[key] = probe_attention_rows(batch, kv_heads, groups, dim, self.query_tile,
                                                            self.key_block)  # fmt: skip
        return found

    @property
    def probes(self) -> dict[str, Any]:
        """What the row probes found in this process (for ``decode_info``-style reports)."""
        return {" ".join(map(str, key)): value for key, value in _ROW_PROBES.items()}

    @property
    def packed_bytes(self) -> int:
        """Bytes of the prepacked weight copies built so far (they are built on first use)."""
        return sum(int(getattr(multiply, "nbytes", 0)) for _, multiply in self._packs.values() if multiply)

    def _pack_unavailable(self, weight: torch.Tensor) -> str | None:
        """Why this weight is not packed (None: it is)."""
        if self.packed_weights is False:
            return "attn.packed_weights=false"
        reason = prepack.unavailable_reason(weight.dtype, weight.device)
        if reason is not None or self.packed_weights is True:
            return reason
        return prepack.auto_skip_reason(weight.dtype, self._weight_bytes)

    def _packed(self, module: torch.nn.Linear, x: torch.Tensor) -> Callable | None:
        """The packed multiply for ``module``'s weight as it is now (built on first use, rebuilt when the weight
        was replaced or changed in place), or None where ``F.linear`` runs."""
        weight = module.weight
        if x.dtype != weight.dtype:
            return None  # F.linear raises its own error
        key = (weight.data_ptr(), _version(weight), weight.dtype, weight.device, module.bias is not None)
        entry = self._packs.get(module)
        if entry is None or entry[0] != key:
            reason = self._pack_unavailable(weight)
            if reason is not None and self.packed_weights is True:
                raise RuntimeError(f"attn.packed_weights=true cannot pack {tuple(weight.shape)} here: {reason}")
            multiply = None
            if reason is None:
                multiply = prepack.packed_linear(weight.detach(), None if module.bias is None else module.bias.detach())
            entry = self._packs[module] = (key, multiply)
        return entry[1]

    # ------------------------------------------------------------------ attention
    def _plan(self, attention_mask: torch.Tensor | None, q_len: int, k_len: int, device: torch.device) -> BlockPlan:
        """The block plan of this call's mask, shared by every layer of a forward (they get the same mask
        object, or none): kept while the mask object is alive and unchanged."""
        source = attention_mask
        key = (q_len, k_len, str(device), None if source is None else _version(source))
        cached = self._plan_cache
        if cached is not None and cached[0] is source and cached[1] == key:
            return cached[2]
        front = (k_len - q_len) % self.query_tile
        if source is not None:
            allowed = source if source.dtype == torch.bool else source == 0
        else:  # causal, aligned bottom-right: the queries are the last q_len positions
            keys = torch.arange(k_len, device=device)
            allowed = (keys[None, :] <= torch.arange(k_len - q_len, k_len, device=device)[:, None])[None, None]
        plan = BlockPlan.build(allowed, front=front, tile=self.query_tile, key_block=self.key_block)
        # The mask itself is held, so its storage cannot be reused by another mask while this entry lives.
        self._plan_cache = (source, key, plan)
        return plan

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
        if dropout:
            raise ValueError("attention backend 'batch_invariant' runs inference only (dropout must be 0)")
        q_len, k_len = query.shape[2], key.shape[2]
        q_positions = kwargs.pop(SELECTED_Q_POSITIONS, None)
        if q_positions is not None:  # layer-wise execution: selected rows, by their own positions
            keys = torch.arange(k_len, device=query.device)
            allowed = (keys[None, :] <= q_positions.to(query.device)[:, None])[None, None]
            plan = BlockPlan.build(allowed, front=0, tile=self.query_tile, key_block=self.key_block)
        else:
            plan = self._plan(attention_mask, q_len, k_len, query.device)
        rows = self._attention_rows(query.shape[0], key.shape[1], query.shape[1] // key.shape[1], query.shape[-1],
                                    query.device)  # fmt: skip
        out = invariant_attention(
            query, key, value, None, front=plan.front, tile=self.query_tile, key_block=self.key_block,
            scaling=scaling if scaling is not None else query.shape[-1] ** -0.5, plan=plan, rows=rows,
        )  # fmt: skip
        self.kernel_calls += 1
        return out, None
