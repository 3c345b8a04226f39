"""FlashAttention-2 forward pass in Triton, implementing the attention contract of :mod:`kvboost.kernels_triton`.

Two kernels (plus a small reduce kernel) share the same masking semantics:

* **One-pass prefill** (``_attn_fwd_kernel``): one program per (query block, batch * q-head).  Keys are streamed
  in ``BLOCK_N`` tiles with an online softmax (running max ``m``, running sum ``l``, fp32 accumulator), exactly as
  in FlashAttention-2.  The key loop is split into up to three ranges (``_attn_fwd_range``) so that only the tiles
  that actually straddle a boundary (left padding, right padding / ``Lk`` tail, causal diagonal) pay for the mask
  computation; tiles that lie entirely after every query's causal limit are never visited (causal block
  skipping, computed from the block's largest query position, so it also works for arbitrary ``q_positions``).
* **Split-KV** (``_attn_split_kv_kernel`` + ``_attn_split_kv_reduce_kernel``): flash-decoding, generalised to
  short prefills.  The one-pass grid has ``cdiv(Lq, BLOCK_M) * B * Hq`` programs: a decode step, or a 100-token
  suffix over 16k cached keys (what chunk reuse produces), launches a few dozen programs on a 132-SM GPU, each
  walking all the keys.  The split kernel instead (a) packs a GQA group's query heads into one tile -- the rows
  are the ``(query, head-in-group)`` pairs of one kv head, query-major, so each K/V tile is loaded once per group
  and a row block covers a contiguous range of queries (causal skipping keeps working) -- and (b) splits the keys
  across programs; grid ``(row blocks, key splits, B * Hkv)``.  Each program writes an unnormalised partial
  ``(m, l, acc)`` per row, and the reduce kernel merges the splits with the usual log-sum-exp rescaling.  With a
  single split the partials are skipped and the program normalises and writes the output itself.

Which path runs (see :func:`flash_attn_forward`): ``Lq <= DECODE_MAX_Q`` always uses the split kernel (decode);
longer queries use it when :func:`use_split_kv` says the one-pass grid would leave the GPU mostly idle; the
``split_kv`` argument forces either path.

Under ``TRITON_INTERPRET=1`` (CPU) all paths use small fixed block sizes; on a GPU the block sizes are autotuned,
keyed on the head dim and power-of-two buckets of the lengths (so that varying prompt lengths do not re-trigger
tuning for every new length).  :func:`autotune_warmup` runs every bucket up to a length once, so that tuning
happens in an engine's warm-up rather than in a measured request.

All softmax arithmetic is done in base 2 (``exp2``) with ``log2(e)`` folded into the scale, which saves a multiply
per score.  Masked scores are ``-inf``; a row whose running max is still ``-inf`` uses 0 as the subtraction
reference so that ``-inf - -inf`` never produces NaN, and the final division is guarded so that a query with no
valid key yields zeros.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from kvboost.kernels_triton import import_triton

# at load time: @triton.jit decorates the kernels below (a clear error without triton)
triton, tl = import_triton()

__all__ = ["flash_attn_forward", "is_interpreter", "use_split_kv", "autotune_warmup", "warmup_shapes",
           "DECODE_MAX_Q"]

_LOG2E = 1.4426950408889634

#: Queries per row up to which the split-K (flash-decoding) path is always used.
DECODE_MAX_Q = 4
# Decode packs all GROUP * Lq rows of a kv head into one tile; beyond this they are spread over row blocks.
_DECODE_MAX_ROWS = 64
# Upper bound on key splits (the reduce kernel holds all partials of one row in registers).
_MAX_SPLITS = 64

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256

# Tile sizes under the interpreter: 16 is the smallest size tl.dot accepts and still produces several key tiles /
# key splits for the small odd-sized test shapes. The interpreter's cost is per executed op, not per element, so
# model-sized inputs (a whole LM under attn=triton on CPU) use 128-wide tiles and 256-key splits: far fewer ops.
_INTERP_BLOCK_M = 16
_INTERP_BLOCK_N = 16
_INTERP_SPLIT_LEN = 16
_INTERP_LARGE_BLOCK = 128
_INTERP_LARGE_SPLIT_LEN = 256
_INTERP_LARGE_ABOVE = 128  # sequence length above which the large tiles are used


def _interp_tiles(Lq: int, Lk: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, split length) for the interpreter."""
    if max(Lq, Lk) > _INTERP_LARGE_ABOVE:
        return _INTERP_LARGE_BLOCK, _INTERP_LARGE_BLOCK, _INTERP_LARGE_SPLIT_LEN
    return _INTERP_BLOCK_M, _INTERP_BLOCK_N, _INTERP_SPLIT_LEN


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _attn_fwd_inner(
    acc, m_i, l_i, q, qpos,
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_n_base, offs_d, d_mask,
    lo, hi, kv_lo, kv_hi, qk_scale,
    CAUSAL: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) with the key tiles starting at lo, lo + BLOCK_N, ... < hi.

    MASKED=False is only used for tiles in which every key is valid for every (stored) query row, so the tile can
    be loaded and used without any key/causal mask.  With MASKED=True a key j is valid iff kv_lo <= j < kv_hi
    (and, if CAUSAL, j <= qpos of the row).
    """
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n_base
        # K is loaded transposed ([BLOCK_D, BLOCK_N]) so that q @ k is a plain tl.dot.
        k_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
        v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if MASKED:
            n_valid = (offs_n >= kv_lo) & (offs_n < kv_hi)
            # Invalid keys load as 0 (they may lie outside the tensor); their scores are set to -inf below.
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
            valid = n_valid[None, :]
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= qpos[:, None])
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
def _attn_fwd_range(
    acc, m_i, l_i, q, qpos, row_valid,
    k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
    offs_n_base, offs_d, d_mask,
    kv_lo, kv_hi, Lk, qk_scale,
    CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr,
):
    """Attend the rows of one tile to the valid keys ``kv_lo <= j < kv_hi`` (a row's padding window, or its
    intersection with one key split), causally limited by each row's ``qpos``.

    Rows with ``row_valid = False`` (tile rows past the end) do not widen the key range.  The range is walked in
    ``BLOCK_N`` tiles aligned to multiples of ``BLOCK_N`` and split into [start, full_lo) masked (left edge),
    [full_lo, full_end) unmasked, [full_end, end) masked (right edge / causal diagonal / Lk tail).
    """
    if CAUSAL:
        # Causal block skipping: no stored row of this tile looks past its largest position ...
        end = tl.minimum(kv_hi, tl.max(tl.where(row_valid, qpos, -1), 0) + 1)
        # ... and every stored row sees every key up to its smallest position (tiles below need no mask).
        full_hi = tl.minimum(end, tl.min(tl.where(row_valid, qpos, Lk), 0) + 1)
    else:
        end = kv_hi
        full_hi = kv_hi

    start = (kv_lo // BLOCK_N) * BLOCK_N
    full_lo = tl.cdiv(kv_lo, BLOCK_N) * BLOCK_N
    full_end = tl.maximum((full_hi // BLOCK_N) * BLOCK_N, full_lo)

    acc, m_i, l_i = _attn_fwd_inner(
        acc, m_i, l_i, q, qpos, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_n_base, offs_d, d_mask, start, tl.minimum(full_lo, end), kv_lo, kv_hi, qk_scale,
        CAUSAL, True, EVEN_D, BLOCK_N, DOT_PREC, DOT_F32)
    acc, m_i, l_i = _attn_fwd_inner(
        acc, m_i, l_i, q, qpos, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_n_base, offs_d, d_mask, full_lo, full_end, kv_lo, kv_hi, qk_scale,
        CAUSAL, False, EVEN_D, BLOCK_N, DOT_PREC, DOT_F32)
    acc, m_i, l_i = _attn_fwd_inner(
        acc, m_i, l_i, q, qpos, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_n_base, offs_d, d_mask, full_end, end, kv_lo, kv_hi, qk_scale,
        CAUSAL, True, EVEN_D, BLOCK_N, DOT_PREC, DOT_F32)
    return acc, m_i, l_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, QPos, KVStart, KVLen,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_pb, stride_pm,
    H_Q, Lq, Lk, qk_scale,
    LQ_BUCKET, LK_BUCKET,  # only used as autotuning keys
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_KV_LEN: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, INT64_IDX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One-pass prefill kernel: one program per (query block, batch * q-head)."""
    # Causal work grows with the query block index; launching the heaviest blocks first shortens the tail.
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H_Q
    h = pid_bh % H_Q
    kvh = h // GROUP  # GQA: the kv head is indexed, never materialised per q head
    b64 = b.to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n_base = tl.arange(0, BLOCK_N)
    if INT64_IDX:  # position * stride may overflow int32 for very long sequences with wide strides
        offs_m = offs_m.to(tl.int64)
        offs_n_base = offs_n_base.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m_valid = offs_m < Lq

    q_base = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b64 * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + kvh.to(tl.int64) * stride_vh
    o_base = Out + b64 * stride_ob + h.to(tl.int64) * stride_oh

    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=m_valid[:, None] & d_mask[None, :], other=0.0)

    # Valid key window of this batch row (already clamped to [0, Lk] by the wrapper).
    kv_lo = 0
    kv_hi = Lk
    if HAS_KV_START:
        kv_lo = tl.load(KVStart + b)
    if HAS_KV_LEN:
        kv_hi = tl.load(KVLen + b)

    if HAS_QPOS:
        # Rows past Lq get position -1: no key, and they are excluded from the loop bounds.
        qpos = tl.load(QPos + b64 * stride_pb + offs_m * stride_pm, mask=m_valid, other=-1)
    else:
        qpos = Lk - Lq + offs_m  # bottom-right aligned causal mask

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, m_i, l_i = _attn_fwd_range(
        acc, m_i, l_i, q, qpos, m_valid, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_n_base, offs_d, d_mask, kv_lo, kv_hi, Lk, qk_scale,
        CAUSAL, BLOCK_D == HEAD_DIM, BLOCK_N, DOT_PREC, DOT_F32)

    # No valid key -> l = 0 and acc = 0: divide by 1 to output zeros.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
             out.to(Out.dtype.element_ty), mask=m_valid[:, None] & d_mask[None, :])


@triton.jit
def _attn_split_kv_kernel(
    Q, K, V, Out, QPos, KVStart, KVLen, PartAcc, PartM, PartL,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_pb, stride_pm,
    H_KV, Lq, Lk, qk_scale, split_len, NUM_SPLITS,
    ROWS_BUCKET, LK_BUCKET,  # only used as autotuning keys
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_KV_START: tl.constexpr, HAS_KV_LEN: tl.constexpr,
    DOT_PREC: tl.constexpr, DOT_F32: tl.constexpr, INT64_IDX: tl.constexpr, DIRECT_OUT: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Split-KV kernel: one program per (row block, key split, batch * kv-head).

    The GROUP * Lq rows of one kv head are the (query, head-in-group) pairs, query-major: row r is query
    r // GROUP of q-head kvh * GROUP + r % GROUP, so each K/V tile is read once for the whole GQA group and a row
    block spans a contiguous range of queries.  The program attends its rows to the keys of split ``pid_s``
    (intersected with the row's window) and writes the unnormalised partial accumulator and its (m, l) per row,
    or, with ``DIRECT_OUT`` (a single split), the normalised output.
    """
    pid_r = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_bkv = tl.program_id(2)
    b = pid_bkv // H_KV
    kvh = pid_bkv % H_KV
    b64 = b.to(tl.int64)

    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_n_base = tl.arange(0, BLOCK_N)
    if INT64_IDX:
        offs_r = offs_r.to(tl.int64)
        offs_n_base = offs_n_base.to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    r_valid = offs_r < GROUP * Lq
    qi = offs_r // GROUP
    h = kvh * GROUP + offs_r % GROUP
    h64 = h.to(tl.int64)

    q_ptrs = Q + b64 * stride_qb + h64[:, None] * stride_qh + qi[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=r_valid[:, None] & d_mask[None, :], other=0.0)

    kv_lo = 0
    kv_hi = Lk
    if HAS_KV_START:
        kv_lo = tl.load(KVStart + b)
    if HAS_KV_LEN:
        kv_hi = tl.load(KVLen + b)
    if HAS_QPOS:
        qpos = tl.load(QPos + b64 * stride_pb + qi * stride_pm, mask=r_valid, other=-1)
    else:
        qpos = Lk - Lq + qi

    # Keys of this split, intersected with the row's valid window (the causal limit is applied per row inside).
    s_lo = tl.maximum(pid_s * split_len, kv_lo)
    s_hi = tl.minimum(pid_s * split_len + split_len, kv_hi)

    k_base = K + b64 * stride_kb + kvh.to(tl.int64) * stride_kh
    v_base = V + b64 * stride_vb + kvh.to(tl.int64) * stride_vh

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    # An empty split (s_hi <= s_lo) runs no tile: m = -inf, l = 0, acc = 0, which the reduce weighs as zero.
    acc, m_i, l_i = _attn_fwd_range(
        acc, m_i, l_i, q, qpos, r_valid, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
        offs_n_base, offs_d, d_mask, s_lo, s_hi, Lk, qk_scale,
        CAUSAL, BLOCK_D == HEAD_DIM, BLOCK_N, DOT_PREC, DOT_F32)

    if DIRECT_OUT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        o_ptrs = (Out + b64 * stride_ob + h64[:, None] * stride_oh + qi[:, None] * stride_om
                  + offs_d[None, :] * stride_od)
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=r_valid[:, None] & d_mask[None, :])
    else:
        # Partials are laid out [row, split(, d)] with row = (b * H_Q + h) * Lq + qi, the reduce kernel's order.
        row = (b64 * (H_KV * GROUP) + h64) * Lq + qi
        part = row * NUM_SPLITS + pid_s
        tl.store(PartM + part, m_i, mask=r_valid)
        tl.store(PartL + part, l_i, mask=r_valid)
        tl.store(PartAcc + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=r_valid[:, None] & d_mask[None, :])


@triton.jit
def _attn_split_kv_reduce_kernel(
    PartAcc, PartM, PartL, Out,
    stride_ob, stride_oh, stride_om, stride_od,
    H_Q, Lq, NUM_SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Split-KV reduce kernel: one program per output row; merges the per-split partials (log-sum-exp)."""
    row = tl.program_id(0).to(tl.int64)
    qi = row % Lq
    h = (row // Lq) % H_Q
    b = row // (Lq * H_Q)

    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM

    m = tl.load(PartM + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))
    l = tl.load(PartL + row * NUM_SPLITS + offs_s, mask=s_mask, other=0.0)
    m_max = tl.max(m, 0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)  # all splits empty -> weights 0, output 0
    w = tl.math.exp2(m - m_ref)  # m is in the base-2 domain of the split kernel
    l_tot = tl.sum(l * w, 0)
    acc = tl.load(PartAcc + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(l_tot > 0.0, l_tot, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + qi * stride_om + offs_d * stride_od,
             out.to(Out.dtype.element_ty), mask=d_mask)


# ----------------------------------------------------------------------------------------------------------------
# Autotuning (GPU only; the interpreter uses the plain kernels with fixed tiles)
# ----------------------------------------------------------------------------------------------------------------

_FWD_CONFIGS = [
    # (BLOCK_M, BLOCK_N, num_warps, num_stages)
    (128, 128, 8, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (128, 32, 4, 2),  # big head dims (fp32 / D = 256) that do not fit the larger tiles in shared memory
    (64, 64, 4, 3),
    (64, 64, 4, 4),
    (64, 32, 4, 2),
]
_DECODE_CONFIGS = [
    # (BLOCK_N, num_warps, num_stages); BLOCK_R is fixed by the group size (one row block)
    (64, 4, 3),
    (64, 4, 4),
    (128, 4, 3),
    (128, 8, 3),
    (32, 4, 2),
]
_SPLIT_KV_CONFIGS = [
    # (BLOCK_R, BLOCK_N, num_warps, num_stages): split-KV prefill, rows = (query, head-in-group) pairs
    (128, 128, 8, 3),
    (128, 64, 8, 3),
    (128, 64, 4, 3),
    (64, 128, 4, 3),
    (64, 64, 4, 3),
    (128, 32, 4, 2),  # big head dims
    (64, 32, 4, 2),
]
# Split lengths are multiples of this (the largest BLOCK_N of every config list), so that split edges fall on
# tile edges and only the causal diagonal / padding tiles of a split are masked.
_GPU_SPLIT_ALIGN = 128
# Below this many keys per split, the partial-write + reduce overhead outweighs the extra parallelism. A decode
# row is cheap per key (bandwidth bound), a prefill row block is not (its partials are BLOCK_R x D floats).
_GPU_MIN_SPLIT_LEN = 256
_GPU_MIN_PREFILL_SPLIT_LEN = 512
# Programs the split path aims for, in waves over the SMs (2: the tail of the last wave costs at most ~1/4).
_SPLIT_TARGET_WAVES = 2
# Cap on the fp32 partials of one call; beyond it fewer splits are used.
_MAX_PARTIAL_BYTES = 256 * 2**20

# use_split_kv: keys below which the one-pass kernel is always used (each program's key loop is then short), and
# the row tile used to size the split grid (the autotuner may pick 64; 128 is the more common pick at these sizes).
SPLIT_KV_MIN_KEYS = 2048
_SPLIT_NOMINAL_ROWS = 128


def _prune_fwd_configs(configs, named_args, **kwargs):
    """Drop query tiles much taller than the query length (they would mostly compute masked rows)."""
    lq = named_args["LQ_BUCKET"]
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(64, lq)]
    return kept or configs


def _prune_split_configs(configs, named_args, **kwargs):
    """Same for the split-KV row tiles (rows = GROUP * Lq)."""
    rows = named_args["ROWS_BUCKET"]
    kept = [c for c in configs if c.kwargs["BLOCK_R"] <= max(64, rows)]
    return kept or configs


# Timing of one config while tuning (ms of warm-up and of repetitions, triton.testing.do_bench). Triton's default
# (25 + 100 ms) makes a warm-up over every length bucket take many minutes; medians over 25 ms are enough to rank
# tile configs whose run times differ by tens of percent.
_TUNE_WARMUP_MS = 5
_TUNE_REP_MS = 25

_autotuned: dict = {}


def _tune_bench(kernel_call, quantiles):
    return triton.testing.do_bench(kernel_call, warmup=_TUNE_WARMUP_MS, rep=_TUNE_REP_MS, quantiles=quantiles)


def _autotune(configs, key, fn, **kwargs):
    try:
        return triton.autotune(configs=configs, key=key, do_bench=_tune_bench, **kwargs)(fn)
    except TypeError:  # a Triton without the do_bench hook: its default timing
        return triton.autotune(configs=configs, key=key, **kwargs)(fn)


def _get_autotuned(name: str):
    """Build the autotuned wrappers lazily, so importing this module never touches a GPU.

    Keys: the head dim, the GQA group, the mask flags, power-of-two buckets of the lengths (the split kernel:
    of its rows GROUP * Lq). Padding flags (HAS_KV_START/LEN), INT64_IDX and DIRECT_OUT only select another
    compiled variant of the tuned config.
    """
    if name not in _autotuned:
        if name == "fwd":
            configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s)
                       for bm, bn, w, s in _FWD_CONFIGS]
            _autotuned[name] = _autotune(
                configs, ["LQ_BUCKET", "LK_BUCKET", "HEAD_DIM", "GROUP", "CAUSAL", "HAS_QPOS"], _attn_fwd_kernel,
                prune_configs_by={"early_config_prune": _prune_fwd_configs},
            )
        elif name == "decode":
            configs = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=s) for bn, w, s in _DECODE_CONFIGS]
            _autotuned[name] = _autotune(configs, ["LK_BUCKET", "HEAD_DIM", "BLOCK_R", "CAUSAL"], _attn_split_kv_kernel)
        elif name == "split":
            configs = [triton.Config({"BLOCK_R": br, "BLOCK_N": bn}, num_warps=w, num_stages=s)
                       for br, bn, w, s in _SPLIT_KV_CONFIGS]
            _autotuned[name] = _autotune(
                configs, ["ROWS_BUCKET", "LK_BUCKET", "HEAD_DIM", "GROUP", "CAUSAL", "HAS_QPOS"],
                _attn_split_kv_kernel, prune_configs_by={"early_config_prune": _prune_split_configs},
            )
        else:  # pragma: no cover - internal misuse
            raise KeyError(name)
    return _autotuned[name]


# ----------------------------------------------------------------------------------------------------------------
# Path choice
# ----------------------------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def use_split_kv(batch: int, q_heads: int, kv_heads: int, q_len: int, kv_len: int, num_sms: int) -> bool:
    """Whether a prefill of ``q_len`` queries over ``kv_len`` keys should run the split-KV kernel.

    The one-pass kernel launches one program per (query tile, batch, q-head), each walking all its keys.  When
    that grid has fewer programs than the GPU has SMs, most of the GPU idles while a few programs walk long key
    ranges: a short suffix (or a few recomputed tokens) over a long reused cache is exactly that shape, e.g.
    100 queries x 32 heads over 16k keys is 32 programs on a 132-SM H100.  The split kernel then packs each
    GQA group into one tile and splits the keys until there are about ``_SPLIT_TARGET_WAVES`` waves of programs.

    Rule: split iff ``kv_len >= SPLIT_KV_MIN_KEYS`` and ``cdiv(q_len, block_m) * batch * q_heads < num_sms``,
    with ``block_m`` the tallest query tile the autotuner keeps for this length (64 up to 64 queries, else 128).
    A square prefill of 4k tokens with 32 heads has 1024 programs and never splits.  (``kv_heads`` is part of
    the signature because the split grid's size depends on it; the decision itself does not need it.)

    Args:
        num_sms: the GPU's streaming-multiprocessor count (``multi_processor_count``); 1 on CPU.
    """
    del kv_heads
    if q_len <= 0 or kv_len < SPLIT_KV_MIN_KEYS:
        return False
    block_m = 64 if q_len <= 64 else 128
    return _cdiv(q_len, block_m) * batch * q_heads < num_sms


def _split_len(base_programs: int, rows: int, Lk: int, D: int, min_split_len: int, Lq: int,
               device: torch.device) -> int:
    """Keys per split for the split-KV kernel.

    On a GPU: enough splits for about ``_SPLIT_TARGET_WAVES`` waves of programs over the SMs
    (``base_programs`` = programs of one split), but no split shorter than ``min_split_len``, at most
    ``_MAX_SPLITS`` splits, and fp32 partials (``rows`` x splits x D) within ``_MAX_PARTIAL_BYTES``; a multiple
    of ``_GPU_SPLIT_ALIGN``.  Under the interpreter a tiny fixed split length, so that small test shapes exercise
    several splits and the reduce kernel.
    """
    if is_interpreter():
        split_len = _interp_tiles(Lq, Lk)[2]
        align = split_len
    else:
        want = _cdiv(_SPLIT_TARGET_WAVES * _num_sms(device), max(1, base_programs))
        want = min(want, _cdiv(Lk, min_split_len), max(1, _MAX_PARTIAL_BYTES // max(1, rows * (D + 2) * 4)))
        split_len = _cdiv(Lk, max(1, want))
        align = _GPU_SPLIT_ALIGN
    split_len = max(split_len, _cdiv(Lk, _MAX_SPLITS))
    return _cdiv(split_len, align) * align


def _decode_split_len(B: int, Hkv: int, Lk: int, device: torch.device) -> int:
    """Keys per split for the decode path (one row block per batch * kv-head)."""
    return _split_len(B * Hkv, 0, Lk, 1, _GPU_MIN_SPLIT_LEN, 1, device)


def _uses_decode_path(Lq: int, group: int) -> bool:
    """Decode: few queries, all GROUP * Lq rows of a kv head in one tile; always run split-KV."""
    return Lq <= DECODE_MAX_Q and group * Lq <= _DECODE_MAX_ROWS


# ----------------------------------------------------------------------------------------------------------------
# Python wrapper
# ----------------------------------------------------------------------------------------------------------------


def is_interpreter() -> bool:
    """Return True when the kernels of this module run under the Triton CPU interpreter (``TRITON_INTERPRET=1``).

    Triton decides at decoration time (i.e. when this module is imported) whether ``@triton.jit`` produces an
    interpreted function, so the answer is read from the kernel object itself; this stays correct even if the
    environment variable is changed after import.
    """
    if type(_attn_fwd_kernel).__name__ == "InterpretedFunction":
        return True
    if isinstance(_attn_fwd_kernel, triton.runtime.JITFunction):
        return False
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _as_index_tensor(name: str, value, device: torch.device) -> torch.Tensor:
    """Convert an index argument to a tensor, rejecting non-integer dtypes and device mismatches."""
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value, device=device)
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        raise ValueError(f"{name} must be an integer tensor, got dtype {value.dtype}")
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but q is on {device}")
    return value


def _validate(q, k, v, sm_scale, q_positions, kv_start, kv_len, out):
    """Check the arguments against the contract; returns the normalised index tensors and the scale."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, L, D], got shape {tuple(t.shape)}")
    if q.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"q dtype must be one of float16, bfloat16, float32; got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share a dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}")
    B, Hq, Lq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape; got {tuple(k.shape)} and {tuple(v.shape)}")
    Bk, Hkv, Lk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"batch mismatch: q has {B}, k/v have {Bk}")
    if Dk != D:
        raise ValueError(f"head dim mismatch: q has {D}, k/v have {Dk}")
    if not 1 <= D <= _MAX_HEAD_DIM:
        raise ValueError(f"head dim must be in [1, {_MAX_HEAD_DIM}], got {D}")
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"number of q heads ({Hq}) must be a multiple of the number of kv heads ({Hkv})")
    if not is_interpreter() and q.device.type != "cuda":
        raise ValueError(f"compiled Triton kernels need CUDA tensors (got {q.device}); "
                         "set TRITON_INTERPRET=1 before importing triton to run on CPU")

    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(D)
    sm_scale = float(sm_scale)
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale must be finite, got {sm_scale}")

    # Index tensors are clamped into [-1, Lk] / [0, Lk] (same semantics, safe int32 range) and made int32.
    if q_positions is None:
        if Lq > Lk:
            raise ValueError(f"q_len ({Lq}) > kv_len ({Lk}) needs explicit q_positions "
                             "(the default positions Lk - Lq + i would be negative)")
    else:
        q_positions = _as_index_tensor("q_positions", q_positions, q.device)
        if q_positions.shape == (Lq,):
            q_positions = q_positions.unsqueeze(0).expand(B, Lq)  # batch stride 0: no copy per row
        elif q_positions.shape != (B, Lq):
            raise ValueError(f"q_positions must have shape [{B}, {Lq}] or [{Lq}], got {tuple(q_positions.shape)}")
        q_positions = q_positions.clamp(-1, Lk).to(torch.int32)
    if kv_start is not None:
        kv_start = _as_index_tensor("kv_start", kv_start, q.device)
        if kv_start.shape != (B,):
            raise ValueError(f"kv_start must have shape [{B}], got {tuple(kv_start.shape)}")
        kv_start = kv_start.clamp(0, Lk).to(torch.int32).contiguous()
    if kv_len is not None:
        kv_len = _as_index_tensor("kv_len", kv_len, q.device)
        if kv_len.shape != (B,):
            raise ValueError(f"kv_len must have shape [{B}], got {tuple(kv_len.shape)}")
        kv_len = kv_len.clamp(0, Lk).to(torch.int32).contiguous()

    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise ValueError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must be a {tuple(q.shape)} {q.dtype} tensor on {q.device}; "
                             f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    return sm_scale, q_positions, kv_start, kv_len


_SM_COUNT: dict = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


_DUMMY: dict = {}


def _dummy_index(device: torch.device) -> torch.Tensor:
    if device not in _DUMMY:
        _DUMMY[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return _DUMMY[device]


def _needs_int64_index(*tensors: torch.Tensor) -> bool:
    """True if some element offset inside one (batch, head) slice does not fit in int32."""
    return any(sum((n - 1) * abs(st) for n, st in zip(t.shape[2:], t.stride()[2:])) >= 2**31 for t in tensors)




_DUMMY_F32: dict = {}


def _dummy_partials(device: torch.device) -> torch.Tensor:
    if device not in _DUMMY_F32:
        _DUMMY_F32[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return _DUMMY_F32[device]


def flash_attn_forward(
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
    """FlashAttention-2 forward, following the attention contract of :mod:`kvboost.kernels_triton`.

    Args:
        q: ``[B, Hq, Lq, D]`` fp16 / bf16 / fp32, any strides.
        k, v: ``[B, Hkv, Lk, D]``, same dtype and device as ``q``; ``Hq % Hkv == 0`` (GQA, never repeated).
        causal: if True, query ``i`` of row ``b`` attends keys ``j <= q_positions[b, i]``.
        sm_scale: softmax scale, default ``1 / sqrt(D)``.
        q_positions: ``[B, Lq]`` or ``[Lq]`` integer key index of each query (any order); default
            ``Lk - Lq + i`` (bottom-right aligned; then ``Lq <= Lk`` is required).
        kv_start, kv_len: ``[B]`` integer window ``kv_start[b] <= j < kv_len[b]`` of valid keys per row.
        out: optional preallocated ``[B, Hq, Lq, D]`` output of q's dtype (any strides, e.g. the transposed view
            of a ``[B, Lq, Hq, D]`` buffer); fully overwritten.
        split_kv: None (default) chooses the path: ``Lq <= DECODE_MAX_Q`` runs the split-KV (flash-decoding)
            kernel, longer queries run it when :func:`use_split_kv` says so for this GPU's SM count and the
            one-pass kernel otherwise.  True / False force the split-KV / one-pass kernel for any ``Lq``.

    Returns:
        ``out`` (or a new tensor) ``[B, Hq, Lq, D]`` in q's dtype.  Queries without any valid key get zeros.

    Raises:
        ValueError: on inconsistent shapes, dtypes, devices, head counts, or ``Lq > Lk`` with default positions.
    """
    sm_scale, q_positions, kv_start, kv_len = _validate(q, k, v, sm_scale, q_positions, kv_start, kv_len, out)
    B, Hq, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if out.numel() == 0:
        return out
    if Lk == 0:  # no key at all: every query has an empty window
        return out.zero_()
    if split_kv is None:
        split = _uses_decode_path(Lq, Hq // Hkv) or use_split_kv(B, Hq, Hkv, Lq, Lk, _num_sms(q.device))
    else:
        split = bool(split_kv)
    _launch(q, k, v, out, bool(causal), sm_scale, q_positions, kv_start, kv_len, split)
    return out


def _launch(q, k, v, out, causal, sm_scale, q_positions, kv_start, kv_len, split, num_splits=None):
    """Launch one path on validated arguments (``num_splits`` overrides the split count: warm-up only)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    interp = is_interpreter()
    qk_scale = sm_scale * _LOG2E
    block_d = max(16, _next_pow2(D))  # tl.dot needs >= 16; padded lanes are masked
    # fp32 inputs: full-precision dot products (TF32 would lose ~3 decimal digits); fp16/bf16 use tensor cores.
    dot_prec = "ieee" if q.dtype == torch.float32 else "tf32"
    # Absent optional tensors are passed as a dummy pointer, never dereferenced (the HAS_* flag is False).
    dummy = _dummy_index(q.device)
    qpos_t = q_positions if q_positions is not None else dummy
    p_strides = (q_positions.stride(0), q_positions.stride(1)) if q_positions is not None else (0, 0)
    kvs_t = kv_start if kv_start is not None else dummy
    kvl_t = kv_len if kv_len is not None else dummy
    flags = dict(GROUP=group, HEAD_DIM=D, CAUSAL=causal, HAS_QPOS=q_positions is not None,
                 HAS_KV_START=kv_start is not None, HAS_KV_LEN=kv_len is not None, DOT_PREC=dot_prec,
                 DOT_F32=interp and q.dtype == torch.bfloat16, INT64_IDX=_needs_int64_index(q, k, v, out))

    if not split:
        args = (q, k, v, out, qpos_t, kvs_t, kvl_t,
                *q.stride(), *k.stride(), *v.stride(), *out.stride(), *p_strides,
                Hq, Lq, Lk, qk_scale, _next_pow2(Lq), _next_pow2(Lk))
        if interp:
            block_m, block_n, _ = _interp_tiles(Lq, Lk)
            grid = (triton.cdiv(Lq, block_m), B * Hq)
            _attn_fwd_kernel[grid](*args, **flags, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d)
        else:
            def grid(meta):
                return (triton.cdiv(Lq, meta["BLOCK_M"]), B * Hq)

            _get_autotuned("fwd")[grid](*args, **flags, BLOCK_D=block_d)
        return

    # Split-KV: rows are the (query, head-in-group) pairs of one kv head.
    rows = group * Lq
    decode = _uses_decode_path(Lq, group)
    if num_splits is None:
        if decode:
            split_len = _split_len(B * Hkv, B * Hq * Lq, Lk, D, _GPU_MIN_SPLIT_LEN, Lq, q.device)
        else:
            base_programs = triton.cdiv(rows, _SPLIT_NOMINAL_ROWS) * B * Hkv
            split_len = _split_len(base_programs, B * Hq * Lq, Lk, D, _GPU_MIN_PREFILL_SPLIT_LEN, Lq, q.device)
    else:
        split_len = triton.cdiv(Lk, num_splits)
        if not interp:
            split_len = triton.cdiv(split_len, _GPU_SPLIT_ALIGN) * _GPU_SPLIT_ALIGN
    num_splits = triton.cdiv(Lk, split_len)
    direct = num_splits == 1
    if direct:  # the program normalises and writes the output itself; no partials
        part_acc = part_m = part_l = _dummy_partials(q.device)
    else:
        part_acc = torch.empty((B * Hq * Lq, num_splits, D), device=q.device, dtype=torch.float32)
        part_m = torch.empty((B * Hq * Lq, num_splits), device=q.device, dtype=torch.float32)
        part_l = torch.empty((B * Hq * Lq, num_splits), device=q.device, dtype=torch.float32)
    args = (q, k, v, out, qpos_t, kvs_t, kvl_t, part_acc, part_m, part_l,
            *q.stride(), *k.stride(), *v.stride(), *out.stride(), *p_strides,
            Hkv, Lq, Lk, qk_scale, split_len, num_splits, _next_pow2(rows), _next_pow2(Lk))
    flags["DIRECT_OUT"] = direct
    if decode:
        block_r = max(16, _next_pow2(rows))
        grid = (1, num_splits, B * Hkv)
        if interp:
            _attn_split_kv_kernel[grid](*args, **flags, BLOCK_R=block_r, BLOCK_N=_interp_tiles(Lq, Lk)[1],
                                        BLOCK_D=block_d)
        else:
            _get_autotuned("decode")[grid](*args, **flags, BLOCK_R=block_r, BLOCK_D=block_d)
    elif interp:
        block_r, block_n, _ = _interp_tiles(Lq, Lk)
        grid = (triton.cdiv(rows, block_r), num_splits, B * Hkv)
        _attn_split_kv_kernel[grid](*args, **flags, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_D=block_d)
    else:
        def grid(meta):
            return (triton.cdiv(rows, meta["BLOCK_R"]), num_splits, B * Hkv)

        _get_autotuned("split")[grid](*args, **flags, BLOCK_D=block_d)
    if not direct:
        _attn_split_kv_reduce_kernel[(B * Hq * Lq,)](
            part_acc, part_m, part_l, out, *out.stride(), Hq, Lq, num_splits,
            HEAD_DIM=D, BLOCK_S=max(2, _next_pow2(num_splits)), BLOCK_D=block_d)


# ----------------------------------------------------------------------------------------------------------------
# Warm-up: autotuning outside measurements
# ----------------------------------------------------------------------------------------------------------------


def warmup_shapes(max_len: int) -> list[tuple[int, int, Optional[bool]]]:
    """``(q_len, kv_len, split_kv)`` triples covering every power-of-two autotuning bucket up to ``max_len``.

    Per key bucket ``kv`` (1, 2, 4, ... up to ``next_pow2(max_len)``): decode with 1..``DECODE_MAX_Q`` queries
    (``split_kv=None``: the decode path), then every query bucket ``8 <= q <= kv`` -- a square prefill when
    ``q == kv``, a suffix over a longer cache otherwise -- on both paths, since which one the heuristic picks at
    run time depends on the batch size.
    """
    shapes: list[tuple[int, int, Optional[bool]]] = []
    top = _next_pow2(max(1, max_len))
    kv = 1
    while kv <= top:
        shapes.extend((q, kv, None) for q in range(1, min(DECODE_MAX_Q, kv) + 1))
        q = _next_pow2(DECODE_MAX_Q + 1)
        while q <= kv:
            shapes.extend([(q, kv, False), (q, kv, True)])
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
    padding_variants: bool = True,
) -> int:
    """Run every kernel variant an engine will hit up to ``max_len`` once, so that Triton's autotuning (and
    compilation) happens here and not inside a measured request.  Returns the number of kernel calls made.

    Covers :func:`warmup_shapes` (batch 1, causal, contract-default positions), each with a forced single key
    split too where the split path runs (large batches need no partials: another compiled variant), and with
    ``padding_variants`` the ``kv_start`` / ``kv_len`` variants (padded batches; another compilation, the tuned
    config is shared).  Not covered, tuned at first use: explicit ``q_positions`` (CacheBlend's selected
    queries) and ``causal=False``.  A no-op (returns 0) under the interpreter or for a non-CUDA device.
    """
    device = torch.device(device)
    if is_interpreter() or device.type != "cuda":
        return 0
    top = _next_pow2(max(1, max_len))
    gen = torch.Generator(device=device).manual_seed(0)
    q_all = torch.randn(1, num_q_heads, top, head_dim, device=device, dtype=dtype, generator=gen)
    k_all = torch.randn(1, num_kv_heads, top, head_dim, device=device, dtype=dtype, generator=gen)
    v_all = torch.randn(1, num_kv_heads, top, head_dim, device=device, dtype=dtype, generator=gen)
    calls = _run_warmup(q_all, k_all, v_all, max_len, padding_variants)
    torch.cuda.synchronize(device)
    return calls


def _run_warmup(q_all, k_all, v_all, max_len: int, padding_variants: bool) -> int:
    """The loop of :func:`autotune_warmup` over slices of ``[1, H, >= next_pow2(max_len), D]`` inputs."""
    device = q_all.device
    group = q_all.shape[1] // k_all.shape[1]
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    calls = 0
    for q_len, kv_len, split_kv in warmup_shapes(max_len):
        q, k, v = q_all[:, :, :q_len], k_all[:, :, :kv_len], v_all[:, :, :kv_len]
        out = torch.empty_like(q)
        full = torch.full((1,), kv_len, dtype=torch.int32, device=device)
        windows = [(None, None)]
        if padding_variants:
            windows += [(zero, None), (None, full), (zero, full)]
        split = _uses_decode_path(q_len, group) if split_kv is None else split_kv
        for kv_start, kv_end in windows:
            # The split path once as planned and once with a single split (its direct-output variant).
            for forced in ([None, 1] if split else [None]):
                sm_scale, qpos, ks, kl = _validate(q, k, v, None, None, kv_start, kv_end, out)
                _launch(q, k, v, out, True, sm_scale, qpos, ks, kl, split, num_splits=forced)
                calls += 1
    return calls
