"""Paged attention in Triton: attention of a flattened batch of sequences over one layer of a block-table KV pool,
implementing the contract of :mod:`kvboost.kernels_triton.paged_attention_reference` (read its docstring first)::

    out = paged_attention(q, k_cache, v_cache, block_tables=..., kv_lens=..., query_start=..., q_positions=...,
                          block_size=16, sm_scale=None, out=None, max_q_len=None, max_kv_len=None, decode=None)

Keys are never gathered: every kernel reads K/V rows straight from the pool, key ``j`` of sequence ``b`` at slot
``block_tables[b, j // block_size] * block_size + j % block_size``.  When a key tile lies inside one block
(``block_size % BLOCK_N == 0``) the tile costs one block-id load and its slots are contiguous; a wider tile (the
GPU configs use 32..128 keys over 16-slot blocks) loads one block id per key (a few hundred bytes, L1/L2 hits).

Two kernels (plus a small reduce kernel) share the masking semantics; both use the FlashAttention-2 online
softmax (running max ``m``, running sum ``l``, fp32 accumulator), base-2 exponentials with ``log2(e)`` folded into
the scale, and pack the GQA group: a tile's rows are the ``(query, head-in-group)`` pairs of one KV head,
query-major (row ``r`` is query ``r // GROUP`` of q-head ``kvh * GROUP + r % GROUP``), so each K/V tile is loaded
once for the whole group and a row tile covers a contiguous range of queries.

* **Varlen prefill** (``_paged_prefill_kernel``): grid ``(row tiles, B, Hkv)``, the row-tile count from the
  longest sequence (``max_q_len``); a program whose tile starts past its sequence's rows exits at once.  Keys are
  walked from 0 in ``BLOCK_N`` tiles: tiles that every row of the tile sees completely (below the smallest query
  position of the tile and below ``kv_len``) run without any mask, the tiles up to the largest query position
  run masked, and tiles past the largest position are never visited (causal block skipping; min / max over the
  tile's rows, so it holds for arbitrary, unsorted ``q_positions``).  Programs are launched heaviest first.
* **Split-K decode** (``_paged_split_kernel`` + ``_paged_split_reduce_kernel``): flash-decoding.  A decode
  step has one query per sequence: the prefill grid would be ``B * Hkv`` programs (16 for a batch of 8 on a
  2-KV-head model, on a 132-SM H100), each walking its whole context alone, and decode is bound by reading the
  K/V bytes, which needs the whole GPU busy.  So the keys are split: grid ``(B * Hkv, key splits, row blocks)``,
  enough splits for about two waves of programs over the SMs, each split a multiple of ``BLOCK_N`` keys.  Each
  program writes an unnormalised partial ``(m, l, acc)`` per row into an fp32 scratch buffer (an empty split --
  a sequence shorter than the longest -- writes ``m = -inf, l = 0``), and the reduce kernel, one program per
  query and block of heads, merges the splits with log-sum-exp rescaling.  With one split the partials are skipped and
  the split kernel normalises and writes ``out`` itself.  The same kernel, with several row blocks, also serves
  a short prefill over a long cache (a few hundred new tokens, or CacheBlend's recomputed rows, over thousands
  of cached keys), where the prefill grid would leave most SMs idle.

Path choice (:func:`choose_path`): ``max_q_len <= DECODE_MAX_Q`` runs the split kernel ("decode"); on a GPU a
prefill whose row-tile grid is smaller than the SM count over at least ``SPLIT_MIN_KEYS`` keys runs it too
("split"); everything else runs the prefill kernel.  ``decode=True`` / ``False`` force the split / prefill kernel.

CUDA-graph safety: with ``max_q_len`` and ``max_kv_len`` given (upper bounds over the batch), the call reads no
device value on the host: validation looks at shapes, dtypes, devices and strides only, and every grid size,
split count and scratch-buffer size is a function of tensor shapes, those two ints and the SM count.  So the
launch can be captured once and replayed with new block tables, lengths and positions of the same shapes (and
lengths within the bounds).  Without them the bounds are read from the tensors (one device->host copy, which also
checks the index values).  Autotuning benchmarks on first use of a key, which must not happen inside a capture:
run :func:`autotune_warmup` first.

Under ``TRITON_INTERPRET=1`` (CPU) the tiles are fixed and small (16 rows, 16 keys, 16-key splits) so that small
test shapes cover several tiles, splits and the reduce kernel; on a GPU the tiles are autotuned, keyed on
power-of-two buckets of ``max_q_len`` / ``max_kv_len``, the head dim, the group size and the block size
(``AUTOTUNE = False`` pins one config per kernel instead).  Masked scores are ``-inf``; a row whose running max
is still ``-inf`` subtracts 0 instead (no ``-inf - -inf`` NaN), masked keys load as zeros (pool slots past a
sequence may hold anything, NaN included), and a row that saw no key is divided by 1, giving zeros.
"""

from __future__ import annotations

import math

import torch

from kvboost.kernels_triton import import_triton
from kvboost.kernels_triton.flash_attn import is_interpreter

# at load time: @triton.jit decorates the kernels below (a clear error without triton)
triton, tl = import_triton()

__all__ = [
    "AUTOTUNE",
    "DECODE_MAX_Q",
    "SPLIT_MIN_KEYS",
    "autotune_warmup",
    "choose_path",
    "is_interpreter",
    "paged_attention",
]

_LOG2E = 1.4426950408889634

#: Queries per sequence up to which the split-K (flash-decoding) kernel runs ("decode").
DECODE_MAX_Q = 4
#: Longest context (``max_kv_len``) below which a prefill never takes the split kernel.
SPLIT_MIN_KEYS = 2048
#: False: one fixed config per kernel on a GPU instead of autotuning (tests, or reproducible tile choice).
AUTOTUNE = True

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256
_MAX_SPLITS = 64  # the reduce kernel holds all partials of one row in registers
_MAX_SPLIT_ROWS = 64  # row block of the split kernel (decode rows are GROUP * q_len, padded to >= 16 for tl.dot)
_REDUCE_MAX_ELEMS = 8192  # partial-accumulator elements one reduce program holds
_PREFILL_NOMINAL_ROWS = 128  # row tile used to size the prefill grid when choosing the path

# Interpreter tiles: 16 is the smallest size tl.dot accepts; small tiles and splits give the small test shapes
# several key tiles, row tiles and key splits. (The interpreter's cost is per executed op, so these are also fast.)
_INTERP_BLOCK = 16
_INTERP_SPLIT_LEN = 16

# GPU split lengths are multiples of this (the largest BLOCK_N of the split configs), so split edges are tile edges.
_GPU_SPLIT_ALIGN = 128
# Below this many keys per split, partial writes + the reduce cost more than the parallelism gains (decode rows are
# cheap per key; a prefill row block writes BLOCK_R x D partials).
_GPU_MIN_SPLIT_LEN = 256
_GPU_MIN_PREFILL_SPLIT_LEN = 512
_SPLIT_TARGET_WAVES = 2
_MAX_PARTIAL_BYTES = 256 * 2**20


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------
# fmt: off
# (Kernel signatures and calls keep several arguments per line, grouped by role, instead of one per line.)


@triton.jit
def _paged_inner(
    acc, m_i, l_i, q, qpos,
    k_head, v_head, bt_row, stride_btm,
    stride_kn, stride_kd, stride_vn, stride_vd,
    offs_n_base, offs_d, d_mask,
    lo, hi, kv_hi, qk_scale,
    MASKED: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, INT64_IDX: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) with the key tiles starting at lo, lo + BLOCK_N, ... < hi.

    MASKED=False only for tiles in which every stored row sees every key (no key/causal mask at all).  With
    MASKED=True key j is valid iff j < kv_hi and j <= qpos of the row.
    """
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base  # logical key indices of this tile
        if BLOCK_SIZE % BLOCK_N == 0:
            # The tile lies inside one block (start_n is a multiple of BLOCK_N, which divides the block): one
            # block-id load, contiguous slots. start_n < kv_hi, so the block is one of the sequence's.
            blk = tl.load(bt_row + (start_n // BLOCK_SIZE) * stride_btm)
            slots = blk * BLOCK_SIZE + (start_n % BLOCK_SIZE) + offs_n_base
        elif MASKED:
            # Table entries past the sequence's blocks may hold anything: read block 0 there (the keys are masked).
            blk = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_btm, mask=offs_n < kv_hi, other=0)
            slots = blk * BLOCK_SIZE + offs_n % BLOCK_SIZE
        else:
            blk = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_btm)
            slots = blk * BLOCK_SIZE + offs_n % BLOCK_SIZE
        if INT64_IDX:  # slot * stride may overflow int32 in a huge pool
            slots = slots.to(tl.int64)
        # K is loaded transposed ([BLOCK_D, BLOCK_N]) so that q @ k is a plain tl.dot.
        k_ptrs = k_head + slots[None, :] * stride_kn + offs_d[:, None] * stride_kd
        v_ptrs = v_head + slots[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if MASKED:
            # Keys past kv_len load as 0: their slots (rest of the last block, or block 0) may hold NaN, and
            # 0 * NaN in p @ v would poison the row even with p = 0.
            n_valid = offs_n < kv_hi
            k = tl.load(k_ptrs, mask=n_valid[None, :] & d_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=n_valid[:, None] & d_mask[None, :], other=0.0)
        elif EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)

        if DOT_F32:
            # Interpreter only: it cannot matmul bf16 (stored as raw uint16), so widen the operands exactly.
            qk = tl.dot(q.to(tl.float32), k.to(tl.float32)) * qk_scale
        else:
            qk = tl.dot(q, k, input_precision=DOT_PREC) * qk_scale
        if MASKED:
            valid = n_valid[None, :] & (offs_n[None, :] <= qpos[:, None])
            qk = tl.where(valid, qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        # A row that has seen no valid key yet keeps m = -inf; use 0 as reference so exp2(-inf - ref) = 0, not NaN.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(qk - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        # P is rounded to V's dtype (as FlashAttention-2 does) so the second product also runs on tensor cores.
        p_lo = p.to(v.dtype)
        if DOT_F32:
            acc = tl.dot(p_lo.to(tl.float32), v.to(tl.float32), acc)
        else:
            acc = tl.dot(p_lo, v, acc, input_precision=DOT_PREC)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _paged_range(
    acc, m_i, l_i, q, qpos, row_valid,
    k_head, v_head, bt_row, stride_btm,
    stride_kn, stride_kd, stride_vn, stride_vd,
    offs_n_base, offs_d, d_mask,
    lo, hi, qk_scale,
    EVEN_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, INT64_IDX: tl.constexpr,
):
    """Attend the rows of one tile to keys ``lo <= j < hi`` (``lo`` a multiple of BLOCK_N, ``hi <= kv_len``),
    each row limited to ``j <= qpos`` (already clamped to ``[-1, kv_len - 1]``).

    Rows with ``row_valid = False`` (past the sequence) neither widen nor narrow the ranges.  [lo, full_end) runs
    unmasked, [full_end, end) masked, keys >= end are skipped.
    """
    # Causal block skipping: no row of this tile sees a key past its largest position ...
    end = tl.minimum(hi, tl.max(tl.where(row_valid, qpos, -1), 0) + 1)
    # ... and every row sees every key up to its smallest position: whole tiles below that need no mask.
    full_hi = tl.minimum(end, tl.min(tl.where(row_valid, qpos, hi), 0) + 1)
    full_end = tl.maximum((full_hi // BLOCK_N) * BLOCK_N, lo)
    acc, m_i, l_i = _paged_inner(
        acc, m_i, l_i, q, qpos, k_head, v_head, bt_row, stride_btm, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_n_base, offs_d, d_mask, lo, full_end, hi, qk_scale,
        False, EVEN_D, BLOCK_SIZE, BLOCK_N, DOT_PREC, DOT_F32, INT64_IDX)
    acc, m_i, l_i = _paged_inner(
        acc, m_i, l_i, q, qpos, k_head, v_head, bt_row, stride_btm, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_n_base, offs_d, d_mask, full_end, end, hi, qk_scale,
        True, EVEN_D, BLOCK_SIZE, BLOCK_N, DOT_PREC, DOT_F32, INT64_IDX)
    return acc, m_i, l_i


@triton.jit
def _load_rows(
    Q, QPos, q_start, q_len, kv_len, kvh, offs_r, offs_d, d_mask,
    stride_qt, stride_qh, stride_qd,
    GROUP: tl.constexpr,
):
    """Rows (query, head-in-group) of one KV head: their token index t, q-head h, validity, q tile and position."""
    r_valid = offs_r < q_len * GROUP
    t = q_start + offs_r // GROUP
    h = kvh * GROUP + offs_r % GROUP
    q_ptrs = Q + t[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=r_valid[:, None] & d_mask[None, :], other=0.0)
    # Clamping to [-1, kv_len - 1] keeps the same visible keys and makes pos + 1 overflow-free.
    qpos = tl.load(QPos + t, mask=r_valid, other=-1)
    qpos = tl.minimum(tl.maximum(qpos, -1), kv_len - 1)
    return t, h, r_valid, q, qpos


@triton.jit
def _paged_prefill_kernel(
    Q, K, V, Out, BlockTables, KVLens, QStart, QPos,
    stride_qt, stride_qh, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_btb, stride_btm,
    qk_scale,
    LQ_BUCKET, LK_BUCKET,  # only used as autotuning keys
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, INT64_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Varlen prefill: one program per (row tile of one sequence, KV head); rows = (query, head-in-group)."""
    # Causal work grows with the tile index; launching the heaviest tiles first shortens the tail.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(QStart + b)
    q_len = tl.load(QStart + b + 1) - q_start
    if pid_m * BLOCK_M >= q_len * GROUP:  # the grid is sized for the longest sequence
        return
    kv_len = tl.load(KVLens + b)

    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n_base = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    if INT64_IDX:
        q_start = q_start.to(tl.int64)
    t, h, r_valid, q, qpos = _load_rows(Q, QPos, q_start, q_len, kv_len, kvh, offs_r, offs_d, d_mask,
                                        stride_qt, stride_qh, stride_qd, GROUP)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, m_i, l_i = _paged_range(
        acc, m_i, l_i, q, qpos, r_valid,
        K + kvh.to(tl.int64) * stride_kh, V + kvh.to(tl.int64) * stride_vh,
        BlockTables + b.to(tl.int64) * stride_btb, stride_btm,
        stride_kn, stride_kd, stride_vn, stride_vd, offs_n_base, offs_d, d_mask, 0, kv_len, qk_scale,
        BLOCK_D == HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PREC, DOT_F32, INT64_IDX)

    # No visible key -> l = 0 and acc = 0: divide by 1 to output zeros.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = Out + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=r_valid[:, None] & d_mask[None, :])


@triton.jit
def _paged_split_kernel(
    Q, K, V, Out, BlockTables, KVLens, QStart, QPos, PartAcc, PartM, PartL,
    stride_qt, stride_qh, stride_qd,
    stride_kh, stride_kn, stride_kd,
    stride_vh, stride_vn, stride_vd,
    stride_ot, stride_oh, stride_od,
    stride_btb, stride_btm,
    qk_scale, split_len, NUM_SPLITS, H_KV,
    LQ_BUCKET, LK_BUCKET,  # only used as autotuning keys
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, INT64_IDX: tl.constexpr, DIRECT_OUT: tl.constexpr,
    DYNAMIC_SPLIT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Split-K (flash-decoding): one program per (sequence * KV head, key split, row block).

    Attends its rows to keys [pid_s * split_len, (pid_s + 1) * split_len) of the sequence and writes the
    unnormalised partial (acc, m, l) of every row -- an empty split writes only m = -inf and l = 0, which the
    reduce reads as weight 0 -- or, with DIRECT_OUT (one split), the normalised output.  With DYNAMIC_SPLIT the
    split length is the sequence's own, ``kv_len`` over the NUM_SPLITS splits (tile-aligned, at least
    ``split_len``), so a short sequence under a long bound still spreads over the splits.
    """
    pid_bk = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_r = tl.program_id(2)
    b = pid_bk // H_KV
    kvh = pid_bk % H_KV
    q_start = tl.load(QStart + b)
    q_len = tl.load(QStart + b + 1) - q_start
    if pid_r * BLOCK_R >= q_len * GROUP:  # row blocks are sized for the longest sequence
        return
    kv_len = tl.load(KVLens + b)

    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n_base = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    if INT64_IDX:
        q_start = q_start.to(tl.int64)
    t, h, r_valid, q, qpos = _load_rows(Q, QPos, q_start, q_len, kv_len, kvh, offs_r, offs_d, d_mask,
                                        stride_qt, stride_qh, stride_qd, GROUP)

    # split_len is a multiple of BLOCK_N, so s_lo is tile-aligned and a tile never straddles two splits.
    if DYNAMIC_SPLIT:
        split_len = tl.maximum(tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N, split_len)
    s_lo = pid_s * split_len
    s_hi = tl.minimum(s_lo + split_len, kv_len)

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    acc, m_i, l_i = _paged_range(
        acc, m_i, l_i, q, qpos, r_valid,
        K + kvh.to(tl.int64) * stride_kh, V + kvh.to(tl.int64) * stride_vh,
        BlockTables + b.to(tl.int64) * stride_btb, stride_btm,
        stride_kn, stride_kd, stride_vn, stride_vd, offs_n_base, offs_d, d_mask, s_lo, s_hi, qk_scale,
        BLOCK_D == HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PREC, DOT_F32, INT64_IDX)

    if DIRECT_OUT:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        o_ptrs = Out + t[:, None] * stride_ot + h[:, None] * stride_oh + offs_d[None, :] * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=r_valid[:, None] & d_mask[None, :])
    else:
        # Partials are [T * Hq, NUM_SPLITS(, HEAD_DIM)] with row t * Hq + h: the reduce kernel's order.
        part = (t.to(tl.int64) * (H_KV * GROUP) + h) * NUM_SPLITS + pid_s
        tl.store(PartM + part, m_i, mask=r_valid)
        tl.store(PartL + part, l_i, mask=r_valid)
        # A row that saw no key here (an empty split) has weight 0 in the reduce, which does not read its acc.
        seen = r_valid & (m_i > float("-inf"))
        tl.store(PartAcc + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=seen[:, None] & d_mask[None, :])


@triton.jit
def _paged_split_reduce_kernel(
    PartAcc, PartM, PartL, Out,
    stride_ot, stride_oh, stride_od,
    H_Q, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Merge the per-split partials of BLOCK_H heads of one query with log-sum-exp rescaling.

    One program per (query, head block) rather than per (query, head): a decode step has few rows, each a few
    KB of partials, and per-program overhead would dominate.
    """
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < H_Q
    hs_mask = h_mask[:, None] & (offs_s < NUM_SPLITS)[None, :]
    part = (t * H_Q + offs_h[:, None]) * NUM_SPLITS + offs_s[None, :]  # [BLOCK_H, BLOCK_S]
    m = tl.load(PartM + part, mask=hs_mask, other=float("-inf"))
    l = tl.load(PartL + part, mask=hs_mask, other=0.0)
    m_max = tl.max(m, 1)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty -> weights 0, output 0
    w = tl.math.exp2(m - m_ref[:, None])  # m is in the base-2 domain of the split kernel
    l_tot = tl.sum(l * w, 1)
    # Splits whose rows saw no key (m = -inf) left their acc unwritten: not read (their weight is 0).
    acc_mask = (hs_mask & (m > float("-inf")))[:, :, None] & (offs_d < HEAD_DIM)[None, None, :]
    acc = tl.load(PartAcc + part[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=acc_mask, other=0.0)
    out = tl.sum(acc * w[:, :, None], 1) / tl.where(l_tot > 0.0, l_tot, 1.0)[:, None]
    o_ptrs = Out + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=h_mask[:, None] & (offs_d < HEAD_DIM)[None, :])

# fmt: on


# ----------------------------------------------------------------------------------------------------------------
# Autotuning (GPU only; the interpreter runs the plain kernels with fixed tiles)
# ----------------------------------------------------------------------------------------------------------------

_PREFILL_CONFIGS = [
    # (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M counts (query, head-in-group) rows
    (128, 128, 8, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (128, 32, 4, 2),  # big head dims (fp32 / D = 256) that do not fit the larger tiles in shared memory
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 32, 4, 2),
]
_SPLIT_CONFIGS = [
    # (BLOCK_N, num_warps, num_stages); BLOCK_R is fixed on the host by the rows of one KV head (<= 64)
    (64, 4, 3),
    (64, 4, 4),
    (128, 4, 3),
    (128, 8, 3),
    (32, 4, 2),
    (16, 4, 3),  # one 16-slot block per tile: contiguous slots, a single block-id load
]
# Used when AUTOTUNE is False (BLOCK_M / BLOCK_R, BLOCK_N, num_warps, num_stages); BLOCK_N halves for wide rows.
_FIXED_PREFILL = (64, 64, 4, 2)
_FIXED_SPLIT = (64, 4, 2)

# Timing of one config while tuning (ms of warm-up and of repetitions): Triton's default (25 + 100 ms) would make a
# warm-up over every length bucket take minutes; 25 ms medians rank tile configs that differ by tens of percent.
_TUNE_WARMUP_MS = 5
_TUNE_REP_MS = 25

_autotuned: dict = {}


def _tune_bench(kernel_call, quantiles):
    return triton.testing.do_bench(kernel_call, warmup=_TUNE_WARMUP_MS, rep=_TUNE_REP_MS, quantiles=quantiles)


def _prune_prefill_configs(configs, named_args, **kwargs):
    """Drop row tiles much taller than a sequence's rows (they would mostly compute masked rows)."""
    group = kwargs["GROUP"] if "GROUP" in kwargs else named_args["GROUP"]  # constexprs arrive as kwargs
    rows = named_args["LQ_BUCKET"] * group
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(64, rows)]
    return kept or configs


def _autotune(configs, key, fn, **kwargs):
    try:
        return triton.autotune(configs=configs, key=key, do_bench=_tune_bench, **kwargs)(fn)
    except TypeError:  # a Triton without the do_bench hook: its default timing
        return triton.autotune(configs=configs, key=key, **kwargs)(fn)


def _get_autotuned(name: str):
    """Autotuned wrappers, built lazily (importing this module never touches a GPU).

    Keys: power-of-two buckets of max_q_len / max_kv_len, the head dim, the GQA group, the block size (and, for
    the split kernel, its row block). INT64_IDX and DIRECT_OUT only select another compilation of the tuned config.
    """
    if name not in _autotuned:
        if name == "prefill":
            configs = [
                triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
                for bm, bn, w, s in _PREFILL_CONFIGS
            ]
            _autotuned[name] = _autotune(
                configs,
                ["LQ_BUCKET", "LK_BUCKET", "HEAD_DIM", "GROUP", "BLOCK_SIZE"],
                _paged_prefill_kernel,
                prune_configs_by={"early_config_prune": _prune_prefill_configs},
            )
        elif name == "split":
            configs = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s) for bn, w, s in _SPLIT_CONFIGS]
            _autotuned[name] = _autotune(
                configs, ["LQ_BUCKET", "LK_BUCKET", "HEAD_DIM", "GROUP", "BLOCK_SIZE", "BLOCK_R"], _paged_split_kernel
            )
        else:  # pragma: no cover - internal misuse
            raise KeyError(name)
    return _autotuned[name]


# ----------------------------------------------------------------------------------------------------------------
# Path choice and split sizing (functions of shapes and ints only: nothing here reads a device value)
# ----------------------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


_SM_COUNT: dict = {}


def _num_sms(device: torch.device) -> int:
    """SM count of a CUDA device (cached; a host-side property query, no device sync); 1 elsewhere."""
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_path(batch: int, q_heads: int, kv_heads: int, max_q_len: int, max_kv_len: int, num_sms: int) -> str:
    """Which kernel ``paged_attention(decode=None)`` runs: ``"decode"`` or ``"split"`` (the split-K kernel) or
    ``"prefill"``.

    ``max_q_len <= DECODE_MAX_Q`` is decode.  A longer query runs the split kernel ("split") when the prefill grid,
    ``cdiv(max_q_len * group, 128) * batch * kv_heads`` row tiles, has fewer programs than the GPU has SMs and the
    context is long (``max_kv_len >= SPLIT_MIN_KEYS``): 256 new tokens over 8k cached keys on a 12/2-head model are
    24 programs, each walking 8k keys, on a 132-SM H100.  ``num_sms`` is 1 on CPU, where it never splits.
    """
    if max_q_len <= DECODE_MAX_Q:
        return "decode"
    group = q_heads // max(1, kv_heads)
    programs = _cdiv(max_q_len * group, _PREFILL_NOMINAL_ROWS) * batch * kv_heads
    if max_kv_len >= SPLIT_MIN_KEYS and programs < num_sms:
        return "split"
    return "prefill"


def _split_plan(
    total_rows: int, base_programs: int, max_kv_len: int, head_dim: int, decode: bool, device: torch.device
) -> tuple[int, int]:
    """(split_len, num_splits) of the split kernel, from shapes and the ``max_kv_len`` bound only.

    GPU: about ``_SPLIT_TARGET_WAVES`` waves of programs over the SMs (``base_programs`` = programs of one split),
    no split shorter than the minimum (256 keys for decode, 512 for a prefill row block), at most ``_MAX_SPLITS``,
    fp32 partials (``total_rows`` = T * Hq rows x splits x (D + 2)) within ``_MAX_PARTIAL_BYTES``; a multiple of
    ``_GPU_SPLIT_ALIGN`` keys.  Interpreter: 16-key splits (several splits on tiny test shapes).
    """
    kv = max(1, max_kv_len)
    if is_interpreter():
        split_len, align = _INTERP_SPLIT_LEN, _INTERP_SPLIT_LEN
    else:
        min_len = _GPU_MIN_SPLIT_LEN if decode else _GPU_MIN_PREFILL_SPLIT_LEN
        want = _cdiv(_SPLIT_TARGET_WAVES * _num_sms(device), max(1, base_programs))
        want = min(want, _cdiv(kv, min_len), max(1, _MAX_PARTIAL_BYTES // max(1, total_rows * (head_dim + 2) * 4)))
        split_len, align = _cdiv(kv, max(1, want)), _GPU_SPLIT_ALIGN
    split_len = max(split_len, _cdiv(kv, _MAX_SPLITS))
    split_len = _cdiv(split_len, align) * align
    return split_len, _cdiv(kv, split_len)


# ----------------------------------------------------------------------------------------------------------------
# Python wrapper
# ----------------------------------------------------------------------------------------------------------------


def _index(name: str, x, dims: int, shape: tuple | None, device: torch.device) -> torch.Tensor:
    """An int32 index tensor of the contract on q's device (checked by metadata only: no device sync)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"paged_attention: {name} must be an int32 tensor, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"paged_attention: {name} must be int32, got {x.dtype}")
    if x.device != device:
        raise ValueError(f"paged_attention: {name} is on {x.device} but q is on {device}")
    if x.dim() != dims or (shape is not None and tuple(x.shape) != shape):
        want = list(shape) if shape is not None else f"{dims}-D"
        raise ValueError(f"paged_attention: {name} must have shape {want}, got {list(x.shape)}")
    return x


def _validate(
    q,
    k_cache,
    v_cache,
    block_tables,
    kv_lens,
    query_start,
    q_positions,
    block_size,
    sm_scale,
    out,
    max_q_len,
    max_kv_len,
):
    """Check everything that can be checked from metadata (shapes, dtypes, devices, limits); returns the scale and
    the index tensors made contiguous where the kernels index them flat."""
    name = "paged_attention"
    for arg, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            want = "[T, Hq, D]" if arg == "q" else "[Hkv, S, D]"
            raise ValueError(f"{name}: {arg} must be 3-D {want}, got shape {list(t.shape)}")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"{name}: q dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(
            f"{name}: q, k_cache, v_cache must share a dtype, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
        )
    if k_cache.device != q.device or v_cache.device != q.device:
        raise ValueError(
            f"{name}: q, k_cache, v_cache must be on one device, got {q.device}, {k_cache.device}, {v_cache.device}"
        )
    if not is_interpreter() and q.device.type != "cuda":
        raise ValueError(
            f"{name}: compiled Triton kernels need CUDA tensors (got {q.device}); "
            "set TRITON_INTERPRET=1 before importing triton to run on CPU"
        )
    total, heads, dim = q.shape
    kv_heads, slots, kdim = k_cache.shape
    if k_cache.shape != v_cache.shape:
        raise ValueError(
            f"{name}: k_cache and v_cache must have one shape, got {list(k_cache.shape)} and {list(v_cache.shape)}"
        )
    if kdim != dim:
        raise ValueError(f"{name}: head dim mismatch: q has {dim}, k_cache / v_cache have {kdim}")
    if not 1 <= dim <= _MAX_HEAD_DIM:
        raise ValueError(f"{name}: head dim must be in [1, {_MAX_HEAD_DIM}], got {dim}")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(f"{name}: query heads ({heads}) must be a multiple of KV heads ({kv_heads})")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1 or slots % block_size:
        raise ValueError(
            f"{name}: block_size must be a positive int dividing the pool's {slots} slots, got {block_size!r}"
        )
    tables = _index("block_tables", block_tables, 2, None, q.device)
    batch = tables.shape[0]
    lens = _index("kv_lens", kv_lens, 1, (batch,), q.device).contiguous()
    starts = _index("query_start", query_start, 1, (batch + 1,), q.device).contiguous()
    positions = _index("q_positions", q_positions, 1, (total,), q.device).contiguous()
    for arg, hint in (("max_q_len", max_q_len), ("max_kv_len", max_kv_len)):
        if hint is not None and (not isinstance(hint, int) or isinstance(hint, bool) or hint < 0):
            raise ValueError(f"{name}: {arg} must be a non-negative int (an upper bound) or None, got {hint!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{name}: out must be a torch.Tensor, got {type(out).__name__}")
        if out.dtype != q.dtype:
            raise TypeError(f"{name}: out must have q's dtype {q.dtype}, got {out.dtype}")
        if out.shape != q.shape or out.device != q.device:
            raise ValueError(
                f"{name}: out must be a {list(q.shape)} tensor on {q.device}, got {list(out.shape)} on {out.device}"
            )
    scale = 1.0 / math.sqrt(dim) if sm_scale is None else float(sm_scale)
    if not math.isfinite(scale):
        raise ValueError(f"{name}: sm_scale must be finite, got {sm_scale}")
    return scale, tables, lens, starts, positions


def _bounds_from_tensors(tables, lens, starts, total: int, num_blocks: int, block_size: int) -> tuple[int, int]:
    """(max_q_len, max_kv_len) read from the tensors -- the one device->host copy of an unhinted call -- and the
    index values checked on the way (the hinted path cannot afford to look at them)."""
    q_lens = starts[1:] - starts[:-1]
    used = torch.arange(tables.shape[1], device=tables.device)[None, :] * block_size < lens[:, None]
    bad_block = (((tables < 0) | (tables >= num_blocks)) & used).any()
    stats = torch.stack(
        [q_lens.max(), lens.max(), q_lens.min(), lens.min(), starts[0], starts[-1], bad_block.to(starts.dtype)]
    ).tolist()
    max_q, max_kv, min_q, min_kv, first, last, bad = stats
    if first != 0 or last != total or min_q < 0:
        raise ValueError(
            f"paged_attention: query_start must run from 0 to T = {total} without going back, "
            f"got first {first}, last {last}, smallest step {min_q}"
        )
    if min_kv < 0 or max_kv > tables.shape[1] * block_size:
        raise ValueError(
            f"paged_attention: kv_lens must be in [0, M * block_size = {tables.shape[1] * block_size}], "
            f"got min {min_kv}, max {max_kv}"
        )
    if bad:
        raise ValueError(f"paged_attention: a block id of some sequence's blocks is outside the pool [0, {num_blocks})")
    return int(max_q), int(max_kv)


def _needs_int64_index(*tensors: torch.Tensor) -> bool:
    """True if an element offset inside q / out, or inside one KV head of the pool, does not fit in int32 (KV-head
    and partial offsets are always 64-bit)."""
    for t, first in zip(tensors, (0, 1, 1, 0)):
        if sum((n - 1) * abs(st) for n, st in zip(t.shape[first:], t.stride()[first:])) >= 2**31:
            return True
    return False


_DUMMY: dict = {}


def _dummy_f32(device: torch.device) -> torch.Tensor:
    """A 1-element fp32 tensor standing in for the partials when they are not used (DIRECT_OUT)."""
    if device not in _DUMMY:
        _DUMMY[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return _DUMMY[device]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start: torch.Tensor,
    q_positions: torch.Tensor,
    block_size: int,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    max_q_len: int | None = None,
    max_kv_len: int | None = None,
    decode: bool | None = None,
    dynamic_splits: bool = False,
) -> torch.Tensor:
    """Attention of ``B`` sequences' queries over their keys in a paged KV pool (contract:
    :mod:`kvboost.kernels_triton.paged_attention_reference`).

    Args:
        q: ``[T, Hq, D]`` fp16 / bf16 / fp32, any strides; sequence ``b`` owns rows
            ``query_start[b] .. query_start[b + 1]``.
        k_cache, v_cache: ``[Hkv, S, D]`` one layer of the pool (``S = num_blocks * block_size``), same dtype and
            device as ``q``, any strides; ``Hq % Hkv == 0`` (query head ``h`` reads KV head ``h // (Hq // Hkv)``).
        block_tables: ``[B, M]`` int32 block ids per sequence in logical order (entries past a sequence's blocks
            are never read).
        kv_lens: ``[B]`` int32 keys per sequence (``<= M * block_size``).
        query_start: ``[B + 1]`` int32 row offsets (``0`` .. ``T``, non-decreasing; a sequence may have no query).
        q_positions: ``[T]`` int32 position of each query: it sees keys ``j <= q_positions[t]``, ``j < kv_lens[b]``
            (any order, any subset).
        block_size: slots per block.
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        out: optional ``[T, Hq, D]`` output of q's dtype (any strides), fully overwritten.
        max_q_len, max_kv_len: upper bounds of the queries / keys per sequence.  With both given nothing reads a
            device value (CUDA-graph capturable; the index values are then trusted, and a sequence longer than a
            bound is not fully computed).  Otherwise they are read from the tensors (one sync, values checked).
        decode: None picks the kernel (:func:`choose_path`); True forces the split-K kernel, False the prefill one.
        dynamic_splits: decode only: every sequence spreads its own keys over the splits (``max_kv_len`` then
            only sizes the grid, with a fixed tile config instead of autotuning). For CUDA graphs, whose bound is
            the model's context window while a step's sequences are often far shorter: with splits sized for the
            bound, a 1k-token sequence under a 32k bound uses 2 of 64 splits.

    Returns:
        ``out`` (or a new tensor) ``[T, Hq, D]`` in q's dtype; a query that sees no key gets zeros.

    Raises:
        TypeError: a tensor argument is not a tensor, or has the wrong dtype (index tensors must be int32).
        ValueError: shapes, devices, head dim (<= 256), head counts, block size, or (unhinted) index values.
    """
    scale, tables, lens, starts, positions = _validate(
        q,
        k_cache,
        v_cache,
        block_tables,
        kv_lens,
        query_start,
        q_positions,
        block_size,
        sm_scale,
        out,
        max_q_len,
        max_kv_len,
    )
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    total = q.shape[0]
    if tables.shape[0] == 0 and total > 0:
        raise ValueError(f"paged_attention: {total} query rows but no sequence (block_tables has 0 rows)")
    if total == 0 or out.numel() == 0:
        return out
    if max_q_len is None or max_kv_len is None:
        mq, mk = _bounds_from_tensors(tables, lens, starts, total, k_cache.shape[1] // block_size, block_size)
        max_q_len = mq if max_q_len is None else max_q_len
        max_kv_len = mk if max_kv_len is None else max_kv_len
    if max_q_len == 0 or max_kv_len == 0:  # no query, or no key anywhere: every row sees nothing
        return out.zero_()
    batch, heads, kv_heads = tables.shape[0], q.shape[1], k_cache.shape[0]
    if decode is None:
        path = choose_path(batch, heads, kv_heads, max_q_len, max_kv_len, _num_sms(q.device))
    else:
        path = "split" if decode else "prefill"
        if decode and max_q_len <= DECODE_MAX_Q:
            path = "decode"
    _launch(q, k_cache, v_cache, out, tables, lens, starts, positions, block_size, scale, max_q_len, max_kv_len, path,
            dynamic=dynamic_splits and path == "decode")  # fmt: skip
    return out


def _launch(
    q,
    k_cache,
    v_cache,
    out,
    tables,
    lens,
    starts,
    positions,
    block_size,
    scale,
    max_q_len,
    max_kv_len,
    path,
    num_splits=None,
    dynamic=False,
):
    """Launch one path on validated arguments (``num_splits`` overrides the split count: warm-up and tests;
    ``dynamic``: per-sequence split lengths, see ``paged_attention(dynamic_splits=...)``)."""
    total, heads, dim = q.shape
    batch, kv_heads = tables.shape[0], k_cache.shape[0]
    group = heads // kv_heads
    interp = is_interpreter()
    block_d = max(16, _next_pow2(dim))  # tl.dot needs >= 16; padded lanes are masked
    # fp32 inputs: full-precision dot products (TF32 would lose ~3 decimal digits); fp16/bf16 use tensor cores.
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    flags = {
        "GROUP": group,
        "HEAD_DIM": dim,
        "BLOCK_SIZE": block_size,
        "DOT_PREC": dot_prec,
        "DOT_F32": interp and q.dtype == torch.bfloat16,
        "INT64_IDX": _needs_int64_index(q, k_cache, v_cache, out),
    }
    strides = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), *tables.stride())
    buckets = (_next_pow2(max_q_len), _next_pow2(max_kv_len))
    # Wide rows (fp32 or D > 128) need narrower key tiles to fit the fixed config's shared memory.
    wide = block_d * q.element_size() > 256

    if path == "prefill":
        args = (q, k_cache, v_cache, out, tables, lens, starts, positions, *strides, scale * _LOG2E, *buckets)
        rows = max_q_len * group
        if interp or not AUTOTUNE:
            bm, bn, warps, stages = _FIXED_PREFILL if not interp else (_INTERP_BLOCK, _INTERP_BLOCK, 4, 1)
            bn = bn // 2 if wide and not interp else bn
            grid = (triton.cdiv(rows, bm), batch, kv_heads)
            extra = {} if interp else {"num_warps": warps, "num_stages": stages}
            _paged_prefill_kernel[grid](*args, **flags, BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=block_d, **extra)
        else:

            def grid(meta):
                return (triton.cdiv(rows, meta["BLOCK_M"]), batch, kv_heads)

            _get_autotuned("prefill")[grid](*args, **flags, BLOCK_D=block_d)
        return

    # Split-K: rows of one KV head in blocks of BLOCK_R (decode: a single block of GROUP * q_len rows).
    rows = max_q_len * group
    block_r = _INTERP_BLOCK if interp else min(_MAX_SPLIT_ROWS, max(16, _next_pow2(rows)))
    row_blocks = triton.cdiv(rows, block_r)
    if dynamic:
        # Splits of at least one tile of the fixed config, as many as the bound allows (<= _MAX_SPLITS); each
        # sequence divides its own keys among them.
        split_len = _INTERP_SPLIT_LEN if interp else _FIXED_SPLIT[0]
        num_splits = min(_MAX_SPLITS, _cdiv(max(1, max_kv_len), split_len))
    elif num_splits is None:
        split_len, num_splits = _split_plan(
            total * heads, batch * kv_heads * row_blocks, max_kv_len, dim, path == "decode", q.device
        )
    else:
        align = _INTERP_SPLIT_LEN if interp else _GPU_SPLIT_ALIGN
        split_len = _cdiv(_cdiv(max(1, max_kv_len), num_splits), align) * align
        num_splits = _cdiv(max(1, max_kv_len), split_len)
    direct = num_splits == 1
    if direct:  # the split kernel normalises and writes out itself; no partials
        part_acc = part_m = part_l = _dummy_f32(q.device)
    else:
        part_acc = torch.empty((total * heads, num_splits, dim), device=q.device, dtype=torch.float32)
        part_m = torch.empty((total * heads, num_splits), device=q.device, dtype=torch.float32)
        part_l = torch.empty((total * heads, num_splits), device=q.device, dtype=torch.float32)
    args = (
        q,
        k_cache,
        v_cache,
        out,
        tables,
        lens,
        starts,
        positions,
        part_acc,
        part_m,
        part_l,
        *strides,
        scale * _LOG2E,
        split_len,
        num_splits,
        kv_heads,
        *buckets,
    )
    grid = (batch * kv_heads, num_splits, row_blocks)
    flags["DIRECT_OUT"] = direct
    flags["DYNAMIC_SPLIT"] = dynamic and not direct
    if interp:
        _paged_split_kernel[grid](*args, **flags, BLOCK_R=block_r, BLOCK_N=_INTERP_BLOCK, BLOCK_D=block_d)
    elif not AUTOTUNE or dynamic:  # dynamic splits: tuning on a capture's inputs would tune for padding rows
        bn, warps, stages = _FIXED_SPLIT
        bn = bn // 2 if wide else bn
        _paged_split_kernel[grid](
            *args, **flags, BLOCK_R=block_r, BLOCK_N=bn, BLOCK_D=block_d, num_warps=warps, num_stages=stages
        )
    else:
        _get_autotuned("split")[grid](*args, **flags, BLOCK_R=block_r, BLOCK_D=block_d)
    if not direct:
        block_s = max(2, _next_pow2(num_splits))
        # Heads per reduce program: all partials of a program live in registers, so keep them to 8k floats.
        block_h = max(1, min(_next_pow2(heads), _REDUCE_MAX_ELEMS // (block_s * block_d)))
        _paged_split_reduce_kernel[(total, triton.cdiv(heads, block_h))](
            part_acc,
            part_m,
            part_l,
            out,
            *out.stride(),
            heads,
            num_splits,
            HEAD_DIM=dim,
            BLOCK_H=block_h,
            BLOCK_S=block_s,
            BLOCK_D=block_d,
        )


# ----------------------------------------------------------------------------------------------------------------
# Warm-up: autotuning (and compilation) outside measured requests and outside CUDA-graph capture
# ----------------------------------------------------------------------------------------------------------------


def warmup_shapes(max_len: int) -> list[tuple[int, int, str]]:
    """``(q_len, kv_len, path)`` covering every power-of-two tuning bucket up to ``max_len``: per key bucket, decode
    with 1..``DECODE_MAX_Q`` queries, and every query bucket ``8 <= q <= kv`` on the prefill and the split path
    (which one runs depends on the batch size and the GPU)."""
    shapes: list[tuple[int, int, str]] = []
    top = _next_pow2(max(1, max_len))
    kv = 1
    while kv <= top:
        shapes.extend((q, kv, "decode") for q in range(1, min(DECODE_MAX_Q, kv) + 1))
        q = _next_pow2(DECODE_MAX_Q + 1)
        while q <= kv:
            shapes.extend([(q, kv, "prefill"), (q, kv, "split")])
            q *= 2
        kv *= 2
    return shapes


def autotune_warmup(
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    max_len: int,
    block_size: int = 16,
) -> int:
    """Run every kernel variant an engine hits up to ``max_len`` keys once (one sequence per shape of
    :func:`warmup_shapes`, hinted as the engine calls it; the split path also with a single split, its
    direct-output variant), so that autotuning and compilation happen here, not in a request or a CUDA-graph
    capture.  Returns the number of calls made; a no-op (0) under the interpreter or on a non-CUDA device.
    """
    device = torch.device(device)
    if is_interpreter() or device.type != "cuda":
        return 0
    top = _next_pow2(max(1, max_len))
    blocks = _cdiv(top, block_size)
    gen = torch.Generator(device=device).manual_seed(0)
    q_all = torch.randn(top, num_q_heads, head_dim, device=device, dtype=dtype, generator=gen)
    k_cache = torch.randn(num_kv_heads, blocks * block_size, head_dim, device=device, dtype=dtype, generator=gen)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(blocks, device=device, generator=gen).to(torch.int32)[None]
    calls = 0
    for q_len, kv_len, path in warmup_shapes(max_len):
        q = q_all[:q_len]
        out = torch.empty_like(q)
        lens = torch.tensor([kv_len], dtype=torch.int32, device=device)
        starts = torch.tensor([0, q_len], dtype=torch.int32, device=device)
        positions = torch.arange(kv_len - q_len, kv_len, dtype=torch.int32, device=device)
        scale, tb, ln, st, pos = _validate(
            q, k_cache, v_cache, tables, lens, starts, positions, block_size, None, out, q_len, kv_len
        )
        for forced in [None, 1] if path != "prefill" else [None]:
            _launch(
                q, k_cache, v_cache, out, tb, ln, st, pos, block_size, scale, q_len, kv_len, path, num_splits=forced
            )
            calls += 1
    torch.cuda.synchronize(device)
    return calls
