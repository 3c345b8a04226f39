"""Plain-torch reference for :mod:`kvboost.kernels_triton.kivi` (KIVI quantize / dequantize of stacked KV).

KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024) quantizes

* **keys per channel**: each channel of a head gets its own scale/zero per group of ``group_size`` consecutive
  *tokens* (keys have outlier channels: a per-token group would let one channel's range swamp the others);
* **values per token**: each token gets a scale/zero per group of ``group_size`` consecutive *channels*;

both asymmetric min-max: ``scale = (max - min) / (2**bits - 1)``, ``zero = min``, ``q = round((x - zero) / scale)``
clamped to ``[0, 2**bits - 1]``, ``x_hat = q * scale + zero``.  The last group is partial when the token count
(keys) or the head dim (values) is not a multiple of ``group_size``: its min/max run over the elements it has.

Storage layout (stacked ``[layers, kv_heads, tokens, head_dim]`` input, ``T`` tokens, ``D`` head dim)::

    k_packed  uint8        [L, H, T, ceil(D / per_byte)]     codes packed along the head dim
    k_scale   scale_dtype  [L, H, ceil(T / G), D]            one per (token group, channel)
    k_zero    scale_dtype  [L, H, ceil(T / G), D]
    v_packed  uint8        [L, H, T, ceil(D / per_byte)]
    v_scale   scale_dtype  [L, H, T, ceil(D / G)]            one per (token, channel group)
    v_zero    scale_dtype  [L, H, T, ceil(D / G)]

``per_byte = 8 // bits`` codes share a byte, the element of lowest channel index in the lowest bits (int8 codes
are stored one per byte, unpacked).  A padded tail of the last byte holds zeros.

Arithmetic, identical in the Triton kernels (so the two agree bit for bit, see tests/test_kivi.py):

* min/max exact; ``scale = fl32(fl32(max - min) / L)`` rounded to ``scale_dtype``; ``zero = min`` rounded to
  ``scale_dtype``; the codes are computed from the *stored* (rounded) scale and zero, so the dequantized value
  is the nearest grid point of the grid actually stored;
* ``q = floor(fl32((x - zero) / scale) + 0.5)`` with IEEE round-to-nearest division (Triton: ``div_rn``);
  ``q = 0`` where the stored scale is 0 (a constant group, or a scale below the storage dtype's range);
* ``x_hat = fl32(q * scale + zero)``, then rounded to the output dtype.  ``scale_dtype`` is restricted to
  float16 / bfloat16 (<= 11 significant bits) so that ``q * scale`` (q < 256) is exact in float32: a fused
  multiply-add (GPU) and a multiply then add (CPU) then round the same way.

The functions here are the torch path of the ``kivi`` quantizer (``kvboost/quant/kivi.py``) on CPU, and the
reference the kernels are tested against.  :func:`kivi_error_bound` is the elementwise float64 bound the
conformance tests hold the quantizer to.
"""

from __future__ import annotations

import torch

__all__ = [
    "SCALE_DTYPES",
    "per_byte",
    "packed_width",
    "pack_codes",
    "unpack_codes",
    "quantize_keys_reference",
    "quantize_values_reference",
    "dequantize_keys_reference",
    "dequantize_values_reference",
    "kivi_error_bound",
]

#: Storage dtypes of scale and zero (both keep ``q * scale`` exact in float32; see the module docstring).
SCALE_DTYPES: dict[str, torch.dtype] = {"float16": torch.float16, "bfloat16": torch.bfloat16}

_U32 = 2.0**-24  # unit roundoff of float32


def per_byte(bits: int) -> int:
    """Codes per stored byte (1 for int8, 2 for int4, 4 for int2)."""
    if bits not in (2, 4, 8):
        raise ValueError(f"KIVI supports 2, 4 or 8 bits, got {bits}")
    return 8 // bits


def packed_width(head_dim: int, bits: int) -> int:
    """Bytes per packed row of ``head_dim`` codes."""
    return -(-head_dim // per_byte(bits))


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(per_byte(bits), device=device, dtype=torch.int32) * bits


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes ``[..., D]`` (each < 2**bits) -> packed uint8 ``[..., ceil(D / per_byte)]`` (lowest index in
    the lowest bits; the padded tail of the last byte is 0)."""
    per = per_byte(bits)
    d = codes.shape[-1]
    nb = packed_width(d, bits)
    if per == 1:
        return codes.to(torch.uint8).contiguous()
    padded = torch.nn.functional.pad(codes.to(torch.int32), (0, nb * per - d))
    grouped = padded.view(*codes.shape[:-1], nb, per)
    return (grouped << _shifts(bits, codes.device)).sum(-1).to(torch.uint8)


def unpack_codes(packed: torch.Tensor, bits: int, head_dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 ``[..., nb]`` -> uint8 codes ``[..., head_dim]``."""
    per = per_byte(bits)
    if per == 1:
        return packed[..., :head_dim]
    mask = (1 << bits) - 1
    codes = (packed.to(torch.int32).unsqueeze(-1) >> _shifts(bits, packed.device)) & mask
    return codes.flatten(-2)[..., :head_dim].to(torch.uint8)


# ---------------------------------------------------------------------------------------------- group statistics
def _key_minmax(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token group, channel) min and max of ``[L, H, T, D]`` -> ``[L, H, ceil(T / G), D]`` each."""
    L, H, T, D = x.shape
    ng = -(-T // group_size)
    pad = ng * group_size - T
    lo = torch.nn.functional.pad(x, (0, 0, 0, pad), value=float("inf")).view(L, H, ng, group_size, D)
    hi = torch.nn.functional.pad(x, (0, 0, 0, pad), value=float("-inf")).view(L, H, ng, group_size, D)
    return lo.amin(3), hi.amax(3)


def _value_minmax(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token, channel group) min and max of ``[L, H, T, D]`` -> ``[L, H, T, ceil(D / G)]`` each."""
    L, H, T, D = x.shape
    ng = -(-D // group_size)
    pad = ng * group_size - D
    lo = torch.nn.functional.pad(x, (0, pad), value=float("inf")).view(L, H, T, ng, group_size)
    hi = torch.nn.functional.pad(x, (0, pad), value=float("-inf")).view(L, H, T, ng, group_size)
    return lo.amin(4), hi.amax(4)


def _scale_zero(mn: torch.Tensor, mx: torch.Tensor, bits: int, scale_dtype: torch.dtype):
    """Stored (scale, zero) from float32 min/max."""
    levels = float(2**bits - 1)
    return ((mx - mn) / levels).to(scale_dtype), mn.to(scale_dtype)


def _codes(x32: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes of float32 ``x32`` on the grid of the stored ``scale``/``zero`` (broadcast to ``x32``)."""
    s = scale.float()
    z = zero.float()
    live = s > 0
    q = torch.floor((x32 - z) / torch.where(live, s, torch.ones_like(s)) + 0.5)
    q = torch.where(live, q, torch.zeros_like(q)).clamp_(0, 2**bits - 1)
    return q.to(torch.uint8)


def _check_inputs(x: torch.Tensor, bits: int, group_size: int) -> None:
    if x.dim() != 4:
        raise ValueError(f"KIVI quantizes stacked KV [layers, kv_heads, tokens, head_dim], got shape {tuple(x.shape)}")
    per_byte(bits)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")


# ---------------------------------------------------------------------------------------------- quantize
def quantize_keys_reference(
    keys: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-channel quantization of ``keys`` ``[L, H, T, D]`` -> (packed, scale, zero) (module docstring layout)."""
    _check_inputs(keys, bits, group_size)
    x = keys.float()
    mn, mx = _key_minmax(x, group_size)
    scale, zero = _scale_zero(mn, mx, bits, scale_dtype)
    T = x.shape[2]
    expand = lambda t: t.repeat_interleave(group_size, dim=2)[:, :, :T]  # noqa: E731
    return pack_codes(_codes(x, expand(scale), expand(zero), bits), bits), scale, zero


def quantize_values_reference(
    values: torch.Tensor, bits: int, group_size: int, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token quantization of ``values`` ``[L, H, T, D]`` -> (packed, scale, zero) (module docstring layout)."""
    _check_inputs(values, bits, group_size)
    x = values.float()
    mn, mx = _value_minmax(x, group_size)
    scale, zero = _scale_zero(mn, mx, bits, scale_dtype)
    D = x.shape[3]
    expand = lambda t: t.repeat_interleave(group_size, dim=3)[..., :D]  # noqa: E731
    return pack_codes(_codes(x, expand(scale), expand(zero), bits), bits), scale, zero


# ---------------------------------------------------------------------------------------------- dequantize
def _write(out: torch.Tensor | None, y: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if out is None:
        return y.to(dtype or torch.float32)
    out.copy_(y)  # rounds float32 -> out.dtype (round to nearest even), as the kernel's store does
    return out


def dequantize_keys_reference(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    head_dim: int,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Keys ``[L, H, t, D]`` from a per-channel payload.  With ``out`` (any strides, ``t <= T`` rows: e.g. a slice of
    a request's cache) the first ``t`` tokens are written into it; else a new tensor of ``dtype`` (all T tokens)."""
    t = packed.shape[2] if out is None else out.shape[2]
    codes = unpack_codes(packed[:, :, :t], bits, head_dim).float()
    s = scale.float().repeat_interleave(group_size, dim=2)[:, :, :t]
    z = zero.float().repeat_interleave(group_size, dim=2)[:, :, :t]
    return _write(out, codes * s + z, dtype)


def dequantize_values_reference(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    head_dim: int,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Values ``[L, H, t, D]`` from a per-token payload (``out`` as in :func:`dequantize_keys_reference`)."""
    t = packed.shape[2] if out is None else out.shape[2]
    codes = unpack_codes(packed[:, :, :t], bits, head_dim).float()
    s = scale[:, :, :t].float().repeat_interleave(group_size, dim=3)[..., :head_dim]
    z = zero[:, :, :t].float().repeat_interleave(group_size, dim=3)[..., :head_dim]
    return _write(out, codes * s + z, dtype)


# ---------------------------------------------------------------------------------------------- error bound
def kivi_error_bound(
    x: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    per_channel: bool,
    scale_dtype: torch.dtype = torch.float16,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Elementwise float64 bound on ``|dequantize(quantize(x)) - x|`` for keys (``per_channel``) or values.

    With ``s``/``z`` the stored scale/zero of the element's group, ``s_e = (max - min) / L`` the exact step and
    ``L = 2**bits - 1``: an element inside the stored grid is off by at most half a step, ``s / 2``; an element
    clamped at either end by at most ``|z - min| + L * |s - s_e|`` (the storage rounding of zero and scale).
    On top: the float32 arithmetic of the code (``8 u32 (L + 1) s``: the quotient's rounding can move a code by
    one near a half) and the rounding of ``q * s + z`` to float32 and then to the output dtype (relative to the
    dequantized magnitude, plus half the output dtype's subnormal spacing).
    """
    out_dtype = out_dtype or x.dtype
    levels = 2**bits - 1
    x32 = x.float()
    mn32, mx32 = (_key_minmax if per_channel else _value_minmax)(x32, group_size)
    s, z = _scale_zero(mn32, mx32, bits, scale_dtype)
    s, z, mn, mx = s.double(), z.double(), mn32.double(), mx32.double()
    s_exact = (mx - mn) / levels
    group = s / 2 + (z - mn).abs() + levels * (s - s_exact).abs() + 8 * _U32 * (levels + 1) * s
    if per_channel:
        group = group.repeat_interleave(group_size, dim=2)[:, :, : x.shape[2]]
    else:
        group = group.repeat_interleave(group_size, dim=3)[..., : x.shape[3]]
    info = torch.finfo(out_dtype)
    u_out = info.eps / 2
    magnitude = x.double().abs() + group
    return group + (_U32 + u_out) * magnitude * 1.01 + info.smallest_normal * info.eps
