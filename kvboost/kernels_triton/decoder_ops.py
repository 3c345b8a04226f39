"""The elementwise work of a Llama-structured decoder layer as three Triton kernels, for the CUDA-graphed forward.

Inside a CUDA graph a small model's step is bound by the number of kernels, not by their arithmetic: the
unfused layer launches ~35 (RMSNorm as cast / normalise / cast / scale, RoPE as slices, negation, concatenation,
two products and a sum for q and again for k, two ``index_copy`` writes into the pool, SiLU, a product, two
residual adds). These three replace all of them:

- :func:`add_rms_norm`: the residual add and the next RMSNorm in one pass over the row (``h = x + delta`` is
  written out: it is the residual stream the layer carries on);
- :func:`rope_write_kv`: RoPE on q and k straight out of the fused q/k/v product, q written as a ``[T, Hq, D]``
  tensor for attention, k (rotated) and v written into one layer of the paged pool at each row's slot;
- :func:`silu_mul`: ``silu(gate) * up`` out of the fused gate/up product.

Each rounds where HF's eager forward rounds (every op of HF's bf16 forward returns a bf16 tensor: the products of
RoPE, its sum, SiLU, the residual add), so the results differ from HF's only by the order of the RMSNorm's sum of
squares and by contraction (FMA) in fp32; the tests compare with the torch ops of :mod:`kvboost.runtime.ops`.
Rows are independent; one program per row (and per head for RoPE), the row held in registers: hidden sizes up to
16k (``MAX_HIDDEN``) and head dims up to 256.
"""

from __future__ import annotations

import torch

from kvboost.kernels_triton import import_triton

# at load time: @triton.jit decorates the kernels below (a clear error without triton)
triton, tl = import_triton()

__all__ = ["MAX_HIDDEN", "add_rms_norm", "rope_write_kv", "silu_mul"]

#: Largest row :func:`add_rms_norm` holds in one program.
MAX_HIDDEN = 16384
_SILU_BLOCK = 1024


# fmt: off
@triton.jit
def _rounded(x, DT: tl.constexpr):
    """fp32 ``x`` rounded to ``DT`` (to nearest, ties to even), returned as fp32. bf16 by integer arithmetic on the
    bits: a ``.to(bf16).to(fp32)`` round trip may be folded away by the compiler (observed on an H200: RoPE one
    bf16 ulp off torch's), and the CPU interpreter's cast truncates instead of rounding. (Finite values only.)"""
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DT).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(
    X, Delta, W, Res, Out,
    stride_x, stride_delta, stride_res, stride_out,
    N, eps,
    HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    h = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(Delta + row * stride_delta + offs, mask=mask, other=0.0)
        hf = _rounded(h.to(tl.float32) + d.to(tl.float32), Res.dtype.element_ty)  # as torch's add rounds
        tl.store(Res + row * stride_res + offs, hf.to(Res.dtype.element_ty), mask=mask)
    else:
        hf = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / N + eps)
    normed = _rounded(hf * inv, Out.dtype.element_ty)  # HF: the statistics in fp32, cast back, then the weight
    w = tl.load(W + offs, mask=mask, other=0.0)
    out = _rounded(w.to(tl.float32) * normed, Out.dtype.element_ty)
    tl.store(Out + row * stride_out + offs, out.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rope_write_kv_kernel(
    QKV, Cos, Sin, QOut, K, V, Slots,
    stride_qkv, stride_cos, stride_sin, stride_qt, stride_qh,
    stride_kh, stride_kn, stride_vh, stride_vn,
    HQ, HKV,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # q heads, then k heads, then v heads: their columns in the q/k/v row, in that order
    offs = tl.arange(0, BLOCK_HALF)
    mask = offs < HALF
    src = QKV + t * stride_qkv + h * (2 * HALF)
    x1 = tl.load(src + offs, mask=mask, other=0.0)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0)
    dt = x1.dtype
    if h < HQ + HKV:
        c1 = tl.load(Cos + t * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(Cos + t * stride_cos + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(Sin + t * stride_sin + offs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(Sin + t * stride_sin + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        a1 = x1.to(tl.float32)
        a2 = x2.to(tl.float32)
        # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1); each product and the sum rounded to x's dtype
        y1 = _rounded(_rounded(a1 * c1, dt) + _rounded(-a2 * s1, dt), dt)
        y2 = _rounded(_rounded(a2 * c2, dt) + _rounded(a1 * s2, dt), dt)
        if h < HQ:
            q_dst = QOut + t * stride_qt + h * stride_qh
            tl.store(q_dst + offs, y1.to(QOut.dtype.element_ty), mask=mask)
            tl.store(q_dst + HALF + offs, y2.to(QOut.dtype.element_ty), mask=mask)
        else:
            slot = tl.load(Slots + t).to(tl.int64)
            k_dst = K + (h - HQ).to(tl.int64) * stride_kh + slot * stride_kn
            tl.store(k_dst + offs, y1.to(K.dtype.element_ty), mask=mask)
            tl.store(k_dst + HALF + offs, y2.to(K.dtype.element_ty), mask=mask)
    else:
        slot = tl.load(Slots + t).to(tl.int64)
        v_dst = V + (h - HQ - HKV).to(tl.int64) * stride_vh + slot * stride_vn
        tl.store(v_dst + offs, x1.to(V.dtype.element_ty), mask=mask)
        tl.store(v_dst + HALF + offs, x2.to(V.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(GU, Out, stride_gu, stride_out, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    g = tl.load(GU + row * stride_gu + offs, mask=mask, other=0.0)
    u = tl.load(GU + row * stride_gu + N + offs, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    act = _rounded(gf / (1.0 + tl.exp(-gf)), GU.dtype.element_ty)  # torch's silu: x / (1 + exp(-x)) in fp32, rounded
    out = _rounded(act * u.to(tl.float32), Out.dtype.element_ty)
    tl.store(Out + row * stride_out + offs, out.to(Out.dtype.element_ty), mask=mask)
# fmt: on


def _rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be a 2-D tensor with contiguous rows, got shape {tuple(x.shape)} "
                         f"and strides {x.stride()}")  # fmt: skip


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, weight * rms_norm(h))`` with ``h = x + delta`` (``h = x`` when ``delta`` is None), rows ``[T, N]``.

    The residual add of a decoder layer and the RMSNorm after it in one kernel; ``h`` is a new tensor (``x`` when
    ``delta`` is None) and the norm's output another, both of ``x``'s dtype."""
    _rows(x, "x")
    n = x.shape[1]
    if n > MAX_HIDDEN:
        raise ValueError(f"add_rms_norm holds a row of at most {MAX_HIDDEN} elements, got {n}")
    if delta is not None:
        _rows(delta, "delta")
        if delta.shape != x.shape:
            raise ValueError(f"delta {tuple(delta.shape)} does not match x {tuple(x.shape)}")
    if weight.shape != (n,) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [{n}] tensor, got {tuple(weight.shape)}")
    res = torch.empty_like(x) if delta is not None else x
    out = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(x.shape[0],)](
        x, delta if delta is not None else x, weight, res, out,
        x.stride(0), (delta if delta is not None else x).stride(0), res.stride(0), out.stride(0),
        n, float(eps), HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(max(block // 256, 1), 16),
    )  # fmt: skip
    return res, out


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
    kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """RoPE of q and k from the fused product ``qkv`` ``[T, (heads + 2 * kv_heads) * head_dim]`` (q heads, then k,
    then v), with tables ``cos``/``sin`` ``[T, head_dim]`` (:func:`kvboost.runtime.ops.rope_tables`); rotated k and
    v are written into one pool layer ``keys``/``values`` ``[kv_heads, S, head_dim]`` at ``slots`` ``[T]``.
    Returns the rotated q, ``[T, heads, head_dim]``."""
    _rows(qkv, "qkv")
    t = qkv.shape[0]
    if qkv.shape[1] != (heads + 2 * kv_heads) * head_dim or head_dim % 2:
        raise ValueError(f"qkv has {qkv.shape[1]} columns, not (heads + 2 * kv_heads) * head_dim = "
                         f"{(heads + 2 * kv_heads) * head_dim} with an even head_dim")  # fmt: skip
    for name, table in (("cos", cos), ("sin", sin)):
        if table.shape != (t, head_dim) or table.stride(-1) != 1:
            raise ValueError(f"{name} must be [{t}, {head_dim}] with contiguous rows, got {tuple(table.shape)}")
    for name, pool in (("keys", keys), ("values", values)):
        if pool.dim() != 3 or pool.shape[0] != kv_heads or pool.shape[2] != head_dim or pool.stride(-1) != 1:
            raise ValueError(f"{name} must be one pool layer [{kv_heads}, slots, {head_dim}], got {tuple(pool.shape)}")
    if slots.shape != (t,):
        raise ValueError(f"slots must be [{t}], got {tuple(slots.shape)}")
    q = qkv.new_empty(t, heads, head_dim)
    half = head_dim // 2
    _rope_write_kv_kernel[(t, heads + 2 * kv_heads)](
        qkv, cos, sin, q, keys, values, slots,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1),
        keys.stride(0), keys.stride(1), values.stride(0), values.stride(1),
        heads, kv_heads, HALF=half, BLOCK_HALF=triton.next_power_of_2(half), num_warps=1,
    )  # fmt: skip
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` from the fused product ``gate_up`` ``[T, 2 * I]`` (gate columns first): ``[T, I]``."""
    _rows(gate_up, "gate_up")
    if gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must have an even number of columns, got {gate_up.shape[1]}")
    n = gate_up.shape[1] // 2
    out = gate_up.new_empty(gate_up.shape[0], n)
    block = min(_SILU_BLOCK, triton.next_power_of_2(n))
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(n, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block, num_warps=4)  # fmt: skip
    return out
