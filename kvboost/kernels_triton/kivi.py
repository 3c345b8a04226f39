"""KIVI quantize and dequantize-into-destination kernels in Triton (layout and arithmetic: :mod:`.kivi_reference`).

Three kernels:

* ``_kivi_quant_keys_kernel``: one program per (layer * head, token group, block of packed bytes).  It loads a
  ``[BLOCK_G tokens, BLOCK_B bytes, PER codes]`` tile (the channels of each byte on the last axis), reduces min/max
  over the tokens (per channel), writes scale/zero, and packs the codes of each byte with shifts and a sum over
  the last axis.
* ``_kivi_quant_values_kernel``: one program per (layer * head, block of tokens, channel group).  The tile is
  ``[BLOCK_T tokens, BLOCK_GB bytes of the group, PER codes]``; min/max reduce over the group's channels.
* ``_kivi_dequant_kernel`` (both layouts, ``PER_CHANNEL`` picks the scale indexing): one program per
  (layer * head, block of tokens, block of bytes); unpacks, dequantizes in float32 and stores in the output's
  dtype at the output's strides.  The output is any ``[L, H, t, D]`` view -- typically rows ``[start, start + t)``
  of a request's preallocated cache -- so a cached chunk lands in the cache with no full-size temporary.

Scale and zero are stored in float16 or bfloat16 (``SCALE_BF16``); the codes are computed from the stored values
with IEEE division (``div_rn``), and ``q * scale`` is exact in float32, so the results equal the torch
reference bit for bit, compiled or interpreted (tests/test_kivi.py).  Under ``TRITON_INTERPRET=1`` (CPU) the
kernels run on CPU tensors, slowly: the quantizer uses the torch reference on CPU unless told otherwise.

The group size must be a multiple of the codes per byte (``8 // bits``), so no byte straddles two value groups.
"""

from __future__ import annotations

import torch

from kvboost.kernels_triton import import_triton
from kvboost.kernels_triton.kivi_reference import packed_width, per_byte

# at load time: @triton.jit decorates the kernels below (a clear error without triton)
triton, tl = import_triton()

__all__ = [
    "kivi_quantize_keys",
    "kivi_quantize_values",
    "kivi_dequantize_keys",
    "kivi_dequantize_values",
    "is_interpreter",
]

_BLOCK_B = 16  # packed bytes per program (keys quantize, dequantize)
_BLOCK_T = 16  # tokens per program (values quantize, dequantize)


# ----------------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------------


@triton.jit
def _to_bf16_rne(x):
    """float32 -> bfloat16 rounded to nearest even, by integer ops: the same bits compiled and interpreted (the
    interpreter's own float32 -> bfloat16 cast does not round to nearest even). Inputs are finite."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + (((bits >> 16) & 1) + 0x7FFF)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _codes(x, s, z, LEVELS: tl.constexpr):
    """float32 codes of ``x`` on the stored grid (``s``, ``z`` broadcast to ``x``); 0 where the scale is 0."""
    live = s > 0.0
    diff = x - z
    den = tl.where(live, s, 1.0) + tl.zeros_like(diff)  # broadcast: div_rn takes equal shapes
    r = tl.math.div_rn(diff, den)
    q = tl.floor(r + 0.5)
    q = tl.where(live, q, 0.0)
    return tl.minimum(tl.maximum(q, 0.0), LEVELS)


@triton.jit
def _kivi_quant_keys_kernel(
    X, Packed, Scale, Zero,
    stride_xl, stride_xh, stride_xt, stride_xd,
    H, T, D, NB, NG,
    BITS: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr, LEVELS: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_B: tl.constexpr, SCALE_BF16: tl.constexpr,
):
    pid_lh = tl.program_id(0).to(tl.int64)
    pid_g = tl.program_id(1)
    pid_b = tl.program_id(2)
    layer = pid_lh // H
    head = pid_lh % H

    offs_g = tl.arange(0, BLOCK_G)
    offs_t = pid_g * GROUP + offs_g
    t_mask = (offs_g < GROUP) & (offs_t < T)
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    offs_i = tl.arange(0, PER)
    offs_d = offs_b[:, None] * PER + offs_i[None, :]  # [BLOCK_B, PER] channels
    d_mask = offs_d < D
    mask = t_mask[:, None, None] & d_mask[None, :, :]

    x_ptrs = (X + layer * stride_xl + head * stride_xh
              + offs_t[:, None, None].to(tl.int64) * stride_xt + offs_d[None, :, :] * stride_xd)
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)

    mn = tl.min(tl.where(mask, x, float("inf")), axis=0)  # [BLOCK_B, PER]: per channel over the group's tokens
    mx = tl.max(tl.where(mask, x, float("-inf")), axis=0)
    mn = tl.where(d_mask, mn, 0.0)
    mx = tl.where(d_mask, mx, 0.0)
    scale = tl.math.div_rn(mx - mn, tl.zeros_like(mn) + LEVELS)
    if SCALE_BF16:
        scale_st = _to_bf16_rne(scale)
        zero_st = _to_bf16_rne(mn)
    else:
        scale_st = scale.to(tl.float16)
        zero_st = mn.to(tl.float16)
    sz_off = (pid_lh * NG + pid_g) * D + offs_d
    tl.store(Scale + sz_off, scale_st, mask=d_mask)
    tl.store(Zero + sz_off, zero_st, mask=d_mask)

    q = _codes(x, scale_st.to(tl.float32)[None, :, :], zero_st.to(tl.float32)[None, :, :], LEVELS)
    qi = tl.where(mask, q.to(tl.int32), 0)
    packed = tl.sum(qi << (offs_i * BITS)[None, None, :], axis=2)  # [BLOCK_G, BLOCK_B]
    p_ptrs = Packed + (pid_lh * T + offs_t[:, None]) * NB + offs_b[None, :]
    tl.store(p_ptrs, packed.to(tl.uint8), mask=t_mask[:, None] & (offs_b < NB)[None, :])


@triton.jit
def _kivi_quant_values_kernel(
    X, Packed, Scale, Zero,
    stride_xl, stride_xh, stride_xt, stride_xd,
    H, T, D, NB, NGD,
    BITS: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr, LEVELS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_GB: tl.constexpr, SCALE_BF16: tl.constexpr,
):
    pid_lh = tl.program_id(0).to(tl.int64)
    pid_t = tl.program_id(1)
    pid_g = tl.program_id(2)
    layer = pid_lh // H
    head = pid_lh % H
    GROUP_BYTES: tl.constexpr = GROUP // PER

    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_gb = tl.arange(0, BLOCK_GB)
    offs_b = pid_g * GROUP_BYTES + offs_gb  # bytes of this channel group
    b_mask = (offs_gb < GROUP_BYTES) & (offs_b < NB)
    offs_i = tl.arange(0, PER)
    offs_d = offs_b[:, None] * PER + offs_i[None, :]  # [BLOCK_GB, PER]
    d_mask = b_mask[:, None] & (offs_d < D)
    mask = t_mask[:, None, None] & d_mask[None, :, :]

    x_ptrs = (X + layer * stride_xl + head * stride_xh
              + offs_t[:, None, None].to(tl.int64) * stride_xt + offs_d[None, :, :] * stride_xd)
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)

    mn = tl.min(tl.min(tl.where(mask, x, float("inf")), axis=2), axis=1)  # [BLOCK_T]: per token over the group
    mx = tl.max(tl.max(tl.where(mask, x, float("-inf")), axis=2), axis=1)
    mn = tl.where(t_mask, mn, 0.0)
    mx = tl.where(t_mask, mx, 0.0)
    scale = tl.math.div_rn(mx - mn, tl.zeros_like(mn) + LEVELS)
    if SCALE_BF16:
        scale_st = _to_bf16_rne(scale)
        zero_st = _to_bf16_rne(mn)
    else:
        scale_st = scale.to(tl.float16)
        zero_st = mn.to(tl.float16)
    sz_off = (pid_lh * T + offs_t) * NGD + pid_g
    tl.store(Scale + sz_off, scale_st, mask=t_mask)
    tl.store(Zero + sz_off, zero_st, mask=t_mask)

    q = _codes(x, scale_st.to(tl.float32)[:, None, None], zero_st.to(tl.float32)[:, None, None], LEVELS)
    qi = tl.where(mask, q.to(tl.int32), 0)
    packed = tl.sum(qi << (offs_i * BITS)[None, None, :], axis=2)  # [BLOCK_T, BLOCK_GB]
    p_ptrs = Packed + (pid_lh * T + offs_t[:, None]) * NB + offs_b[None, :]
    tl.store(p_ptrs, packed.to(tl.uint8), mask=t_mask[:, None] & b_mask[None, :])


@triton.jit
def _kivi_dequant_kernel(
    Packed, Scale, Zero, Out,
    stride_ol, stride_oh, stride_ot, stride_od,
    H, T_SRC, T_OUT, D, NB, S_ROWS, S_COLS,
    BITS: tl.constexpr, PER: tl.constexpr, GROUP: tl.constexpr, PER_CHANNEL: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_B: tl.constexpr, OUT_BF16: tl.constexpr,
):
    """Rows ``[0, T_OUT)`` of a payload of ``T_SRC`` rows into ``Out``.  Scale/zero are ``[L * H, S_ROWS, S_COLS]``:
    per channel (keys) ``S_ROWS = ceil(T / G)``, ``S_COLS = D``; per token (values) ``S_ROWS = T``,
    ``S_COLS = ceil(D / G)``."""
    pid_lh = tl.program_id(0).to(tl.int64)
    pid_t = tl.program_id(1)
    pid_b = tl.program_id(2)
    layer = pid_lh // H
    head = pid_lh % H

    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T_OUT
    offs_b = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    b_mask = offs_b < NB
    offs_i = tl.arange(0, PER)
    offs_d = offs_b[:, None] * PER + offs_i[None, :]  # [BLOCK_B, PER]
    mask = t_mask[:, None, None] & (offs_d < D)[None, :, :]

    p = tl.load(Packed + (pid_lh * T_SRC + offs_t[:, None]) * NB + offs_b[None, :],
                mask=t_mask[:, None] & b_mask[None, :], other=0)
    q = (p.to(tl.int32)[:, :, None] >> (offs_i * BITS)[None, None, :]) & ((1 << BITS) - 1)

    if PER_CHANNEL:
        s_idx = (pid_lh * S_ROWS + offs_t[:, None, None] // GROUP) * S_COLS + offs_d[None, :, :]
    else:
        s_idx = (pid_lh * S_ROWS + offs_t[:, None, None]) * S_COLS + offs_d[None, :, :] // GROUP
    s = tl.load(Scale + s_idx, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(Zero + s_idx, mask=mask, other=0.0).to(tl.float32)
    y = q.to(tl.float32) * s + z  # q * s is exact (see the module docstring): fused or not, one rounding

    o_ptrs = (Out + layer * stride_ol + head * stride_oh
              + offs_t[:, None, None].to(tl.int64) * stride_ot + offs_d[None, :, :] * stride_od)
    if OUT_BF16:
        tl.store(o_ptrs, _to_bf16_rne(y), mask=mask)
    else:
        tl.store(o_ptrs, y.to(Out.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------------------------------------
# Wrappers
# ----------------------------------------------------------------------------------------------------------------


def is_interpreter() -> bool:
    """True when these kernels run under the Triton CPU interpreter (decided when triton decorated them)."""
    return type(_kivi_dequant_kernel).__name__ == "InterpretedFunction"


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _scale_flag(scale_dtype: torch.dtype) -> bool:
    if scale_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"KIVI stores scale/zero in float16 or bfloat16, got {scale_dtype}")
    return scale_dtype == torch.bfloat16


def _check(x: torch.Tensor, bits: int, group_size: int) -> int:
    if x.dim() != 4:
        raise ValueError(f"KIVI quantizes stacked KV [layers, kv_heads, tokens, head_dim], got shape {tuple(x.shape)}")
    per = per_byte(bits)
    if group_size < 1 or group_size % per:
        raise ValueError(
            f"group_size must be a positive multiple of {per} (codes per byte) for {bits} bits, got {group_size}"
        )
    return per


def kivi_quantize_keys(
    keys: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel KIVI quantization of ``keys`` ``[L, H, T, D]`` (any strides) -> (packed, scale, zero)."""
    per = _check(keys, bits, group_size)
    L, H, T, D = keys.shape
    nb, ng = packed_width(D, bits), -(-T // group_size)
    packed = torch.empty((L, H, T, nb), dtype=torch.uint8, device=keys.device)
    scale = torch.empty((L, H, ng, D), dtype=scale_dtype, device=keys.device)
    zero = torch.empty_like(scale)
    if keys.numel() == 0:
        return packed, scale, zero
    block_b = min(_BLOCK_B, _next_pow2(nb))
    grid = (L * H, ng, triton.cdiv(nb, block_b))
    _kivi_quant_keys_kernel[grid](
        keys, packed, scale, zero, *keys.stride(), H, T, D, nb, ng,
        BITS=bits, PER=per, GROUP=group_size, LEVELS=2**bits - 1,
        BLOCK_G=_next_pow2(group_size), BLOCK_B=block_b, SCALE_BF16=_scale_flag(scale_dtype),
    )  # fmt: skip
    return packed, scale, zero


def kivi_quantize_values(
    values: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token KIVI quantization of ``values`` ``[L, H, T, D]`` (any strides) -> (packed, scale, zero)."""
    per = _check(values, bits, group_size)
    L, H, T, D = values.shape
    nb, ngd = packed_width(D, bits), -(-D // group_size)
    packed = torch.empty((L, H, T, nb), dtype=torch.uint8, device=values.device)
    scale = torch.empty((L, H, T, ngd), dtype=scale_dtype, device=values.device)
    zero = torch.empty_like(scale)
    if values.numel() == 0:
        return packed, scale, zero
    block_t = min(_BLOCK_T, _next_pow2(T))
    grid = (L * H, triton.cdiv(T, block_t), ngd)
    _kivi_quant_values_kernel[grid](
        values, packed, scale, zero, *values.stride(), H, T, D, nb, ngd,
        BITS=bits, PER=per, GROUP=group_size, LEVELS=2**bits - 1,
        BLOCK_T=block_t, BLOCK_GB=_next_pow2(group_size // per), SCALE_BF16=_scale_flag(scale_dtype),
    )  # fmt: skip
    return packed, scale, zero


def _dequant(packed, scale, zero, out, *, bits, group_size, head_dim, per_channel):
    per = per_byte(bits)
    L, H, t_src, nb = packed.shape
    if out.dim() != 4 or out.shape[0] != L or out.shape[1] != H or out.shape[3] != head_dim or out.shape[2] > t_src:
        raise ValueError(
            f"KIVI dequantize: output {tuple(out.shape)} does not fit a payload of {L} layers, {H} heads, "
            f"{t_src} tokens, head dim {head_dim}"
        )
    if packed.device != out.device:
        raise ValueError(f"KIVI dequantize: payload on {packed.device}, output on {out.device}")
    t_out = out.shape[2]
    if t_out == 0:
        return out
    packed, scale, zero = packed.contiguous(), scale.contiguous(), zero.contiguous()
    block_t = min(_BLOCK_T, _next_pow2(t_out))
    block_b = min(_BLOCK_B, _next_pow2(nb))
    grid = (L * H, triton.cdiv(t_out, block_t), triton.cdiv(nb, block_b))
    _kivi_dequant_kernel[grid](
        packed, scale, zero, out, *out.stride(), H, t_src, t_out, head_dim, nb, scale.shape[2], scale.shape[3],
        BITS=bits, PER=per, GROUP=group_size, PER_CHANNEL=per_channel, BLOCK_T=block_t, BLOCK_B=block_b,
        OUT_BF16=out.dtype == torch.bfloat16,
    )  # fmt: skip
    return out


def kivi_dequantize_keys(packed, scale, zero, *, bits: int, group_size: int, head_dim: int, out: torch.Tensor):
    """Write the first ``out.shape[2]`` tokens of per-channel quantized keys into ``out`` ``[L, H, t, D]`` (any
    strides, any float dtype: e.g. a slice of the request's preallocated cache); returns ``out``."""
    return _dequant(packed, scale, zero, out, bits=bits, group_size=group_size, head_dim=head_dim, per_channel=True)


def kivi_dequantize_values(packed, scale, zero, *, bits: int, group_size: int, head_dim: int, out: torch.Tensor):
    """Write the first ``out.shape[2]`` tokens of per-token quantized values into ``out`` (see
    :func:`kivi_dequantize_keys`); returns ``out``."""
    return _dequant(packed, scale, zero, out, bits=bits, group_size=group_size, head_dim=head_dim, per_channel=False)
