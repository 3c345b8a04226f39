"""GGUF Q4_0 / Q4_1 / Q4_K -> torch's int4 CPU kernel (kvboost.models.gguf_int4), checked against gguf-py's own
dequantization (``gguf.quants.dequantize``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from kvboost.models.awq import Int4PackedLinear
from kvboost.models.gguf_int4 import (
    BLOCKS,
    SUPPORTED_TYPES,
    dequantize_q4,
    gguf_int4_linear,
    int4pack_from_q4,
    int4pack_gguf,
    matmul,
    unpack_q4,
    zeros_exact,
)

N_F16 = {"Q4_0": 1, "Q4_1": 2, "Q4_K": 2}  # fp16 fields at the start of a block (d; d, m; d, dmin)


def _bits(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def _random_finite_f16(rng: np.random.Generator, shape, nonneg: bool = False) -> np.ndarray:
    """Uniformly random fp16 bit patterns (normals, subnormals, signed zeros), inf/nan replaced by 1.0."""
    bits = rng.integers(0, 2**16, size=shape, dtype=np.uint16)
    if nonneg:
        bits &= np.uint16(0x7FFF)
    bits[~np.isfinite(bits.view(np.float16))] = np.uint16(0x3C00)
    return bits.view(np.float16)


def _blocks_with(name: str, fields: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Random bytes (nibbles, Q4_K's 6-bit scales/mins) with the given fp16 fields [rows, blocks, N_F16]."""
    rows, nb, nf = fields.shape
    size = BLOCKS[name][1]
    raw = rng.integers(0, 256, size=(rows, nb, size), dtype=np.uint8)
    raw[..., : 2 * nf] = np.ascontiguousarray(fields.astype(np.float16)).view(np.uint8).reshape(rows, nb, 2 * nf)
    return raw.reshape(rows, nb * size)


def _random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator, nonneg: bool = False) -> np.ndarray:
    nb = cols // BLOCKS[name][0]
    return _blocks_with(name, _random_finite_f16(rng, (rows, nb, N_F16[name]), nonneg), rng)


def _normal_f16(rng: np.random.Generator, exponents: np.ndarray, signed: bool) -> np.ndarray:
    """Normal fp16 values with the given binary exponents and random mantissas (and signs)."""
    mant = 1 + rng.integers(0, 1024, size=exponents.shape) / 1024
    sign = rng.choice([-1.0, 1.0], size=exponents.shape) if signed else 1.0
    out = (sign * mant * np.exp2(exponents)).astype(np.float16)
    assert np.all(out.astype(np.float64) == sign * mant * np.exp2(exponents))  # exact, normal
    return out


def _q4k_llama_style(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks shaped like llama.cpp's quantize_row_q4_K_ref (gguf-py has no Q4_K quantizer): per sub-block a
    min-max scale and min, 6-bit quantized against ``d = max scale / 63``, ``dmin = max min / 63``."""
    rows, cols = x.shape
    nb = cols // 256
    xs = x.reshape(rows, nb, 8, 32)
    lo, hi = np.minimum(xs.min(-1), 0), xs.max(-1)
    scale, mins = (hi - lo) / 15, -lo
    d, dmin = (scale.max(-1) / 63).astype(np.float16), (mins.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.round(scale / d.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / dmin.astype(np.float32)[..., None]), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * m
    q = np.clip(np.round((xs + offset[..., None]) / np.where(step == 0, 1, step)[..., None]), 0, 15).astype(np.uint8)
    packed = np.empty((rows, nb, 12), np.uint8)
    packed[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    packed[..., 4:8] = (m[..., 0:4] & 63) | ((m[..., 4:8] >> 4) << 6)
    packed[..., 8:12] = (sc[..., 4:8] & 15) | ((m[..., 4:8] & 15) << 4)
    qq = q.reshape(rows, nb, 4, 2, 32)  # chunk c: sub-block 2c in the low nibbles, 2c + 1 in the high ones
    qs = (qq[..., 0, :] | (qq[..., 1, :] << 4)).reshape(rows, nb, 128)
    raw = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8), packed, qs], axis=-1)
    return raw.reshape(rows, nb * 144)


def _ours(name: str, raw: np.ndarray) -> np.ndarray:
    return dequantize_q4(*unpack_q4(name, raw)).numpy()


# ---------------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_layout(name):
    rng = np.random.default_rng(1)
    rows, cols = 16, 512
    raw = _random_blocks(name, rows, cols, rng)
    q, scales, zeros = unpack_q4(name, raw)
    assert q.dtype == torch.uint8 and tuple(q.shape) == (rows, cols)
    assert int(q.max()) <= 15
    for t in (scales, zeros):
        assert t.dtype == torch.float32 and tuple(t.shape) == (cols // 32, rows)
    # the same tensor as a flat buffer with its shape, and by enum / int id / lower-case name
    for kind in (T[name], int(T[name]), name.lower()):
        q2, s2, z2 = unpack_q4(kind, raw.reshape(-1), shape=(rows, cols))
        assert torch.equal(q2, q) and torch.equal(s2, scales) and torch.equal(z2, zeros)


def test_q4_0_zero_is_negative_zero():
    raw = _random_blocks("Q4_0", 2, 64, np.random.default_rng(2))
    _, _, zeros = unpack_q4("Q4_0", raw)
    assert np.all(_bits(zeros.numpy()) == 0x80000000)


# ---------------------------------------------------------------------------------------------- fp32 dequant vs gguf
def test_q4_0_random_blocks_bit_equal():
    """Any finite fp16 d (both signs, subnormals, +-0), random nibbles: bit-equal to gguf."""
    raw = _random_blocks("Q4_0", 64, 1024, np.random.default_rng(3))
    ours, ref = _ours("Q4_0", raw), dequantize(raw, T.Q4_0)
    assert torch.equal(torch.from_numpy(ours), torch.from_numpy(ref))
    assert np.array_equal(_bits(ours), _bits(ref))
    assert bool(zeros_exact("Q4_0", raw).all())


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1"])
def test_gguf_quantized_blocks_bit_equal(name):
    """Blocks written by gguf-py's own quantizer."""
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((96, 1024)) * 0.05 + rng.uniform(-0.02, 0.02, size=(96, 1))).astype(np.float32)
    raw = quantize(x, T[name])
    ours, ref = _ours(name, raw), dequantize(raw, T[name])
    assert np.array_equal(_bits(ours), _bits(ref))
    assert bool(zeros_exact(name, raw).all())
    assert np.abs(ref - x).max() < 0.05  # sanity: these are quantized weights of x


def test_q4_k_llama_style_blocks_bit_equal():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((64, 1024)) * 0.02).astype(np.float32)
    raw = _q4k_llama_style(x)
    ours, ref = _ours("Q4_K", raw), dequantize(raw, T.Q4_K)
    assert np.abs(ref - x).max() < 0.01  # sanity: the helper builds valid Q4_K blocks of x
    assert bool(zeros_exact("Q4_K", raw).all())
    assert np.array_equal(_bits(ours), _bits(ref))


@pytest.mark.parametrize(("name", "k_range", "signed"), [("Q4_1", (-9, 15), True), ("Q4_K", (-4, 10), False)])
def test_exact_when_exponents_close(name, k_range, signed):
    """The documented sufficient condition: normal fp16 fields whose exponents differ by k in k_range (both ends
    included) give exact zeros, so gguf's values bit for bit, with random nibbles and 6-bit scales/mins."""
    rng = np.random.default_rng(6)
    rows, cols = 64, 2048
    nb = cols // BLOCKS[name][0]
    k = rng.integers(k_range[0], k_range[1] + 1, size=(rows, nb))
    k[:, :2] = k_range  # the ends, in every row
    e_d = rng.integers(max(-14, -14 - k_range[0]), min(15, 15 - k_range[1]) + 1, size=(rows, nb))
    fields = np.stack([_normal_f16(rng, e_d, signed), _normal_f16(rng, e_d + k, signed)], axis=-1)
    raw = _blocks_with(name, fields, rng)
    assert bool(zeros_exact(name, raw).all())
    ours, ref = _ours(name, raw), dequantize(raw, T[name])
    assert torch.equal(torch.from_numpy(ours), torch.from_numpy(ref))
    if not signed:
        assert np.array_equal(_bits(ours), _bits(ref))


@pytest.mark.parametrize("name", ["Q4_1", "Q4_K"])
@pytest.mark.parametrize("nonneg", [False, True])
def test_random_fields_exact_where_zero_is(name, nonneg):
    """Uniformly random fp16 fields: equal to gguf wherever the zero is exact (bit-equal there when the fields
    are >= 0; otherwise only a zero's sign may differ), and within ulp(zero) / 2 + ulp(w) elsewhere."""
    rng = np.random.default_rng(7)
    rows, cols = 64, 1024
    raw = _random_blocks(name, rows, cols, rng, nonneg=nonneg)
    q, scales, zeros = unpack_q4(name, raw)
    ours, ref = dequantize_q4(q, scales, zeros).numpy(), dequantize(raw, T[name])
    exact = zeros_exact(name, raw).numpy().T.repeat(32, axis=1)  # per value
    assert 0.2 < exact.mean() < 0.95  # both cases are exercised
    assert np.array_equal(ours[exact], ref[exact])
    bit_diff = exact & (_bits(ours) != _bits(ref))
    assert np.all((ours[bit_diff] == 0) & (ref[bit_diff] == 0))
    if nonneg:
        assert not bit_diff.any()
    z = zeros.numpy().T.repeat(32, axis=1)
    bound = np.spacing(np.abs(z)) / 2 + np.maximum(np.spacing(np.abs(ours)), np.spacing(np.abs(ref)))
    diff = np.abs(ours.astype(np.float64) - ref.astype(np.float64))
    assert np.all(diff[~exact] <= bound[~exact])
    assert (diff[~exact] > 0).any()  # inexact zeros do change values: the exactness test above means something


# ---------------------------------------------------------------------------------------------- the int4 kernel
def _realistic_raw(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    x = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    return _q4k_llama_style(x) if name == "Q4_K" else quantize(x, T[name])


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
@pytest.mark.parametrize("n", [1, 7])
def test_int4pack_matmul(name, n):
    """torch's int4 CPU kernel on the packed GGUF weight vs x @ W^T with W = gguf's dequantization (fp64 ref).
    Tolerances relative to |x| @ |W|^T: fp32 1e-5 (measured <= 4.4e-7), bf16 8e-3 (measured <= 2.1e-3); a wrong
    scale, zero, nibble order or layout gives errors of order 1."""
    rng = np.random.default_rng(8)
    rows, cols = 96, 512
    for raw in (_realistic_raw(name, rows, cols, rng), _random_blocks(name, rows, cols, rng)):
        w = torch.from_numpy(dequantize(raw, T[name])).double()
        x = torch.randn(n, cols, generator=torch.Generator().manual_seed(n))
        for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):
            xd = x.to(dtype)
            packed, scale_zero = int4pack_gguf(name, raw, dtype)
            assert packed.dtype == torch.uint8 and tuple(packed.shape) == (rows, cols // 2)
            assert scale_zero.dtype == dtype and tuple(scale_zero.shape) == (cols // 32, rows, 2)
            y = matmul(xd, packed, scale_zero)
            assert y.dtype == dtype and tuple(y.shape) == (n, rows)
            ref = xd.double() @ w.t()
            mag = xd.double().abs() @ w.abs().t()
            err = (y.double() - ref).abs()
            assert torch.all(err <= rtol * mag + 1e-30), f"{name} {dtype}: max err/mag {(err / mag).max():.3g}"


@pytest.mark.parametrize("name", SUPPORTED_TYPES)
def test_linear_module(name):
    rng = np.random.default_rng(9)
    rows, cols = 32, 256
    raw = _realistic_raw(name, rows, cols, rng)
    bias = torch.randn(rows)
    x = torch.randn(3, 2, cols).bfloat16()
    module = gguf_int4_linear(name, raw, dtype=torch.bfloat16, bias=bias)
    assert isinstance(module, Int4PackedLinear) and module.group_size == 32
    packed, scale_zero = int4pack_from_q4(*unpack_q4(name, raw), torch.bfloat16)
    expected = matmul(x, packed, scale_zero) + bias.half().to(torch.bfloat16)
    assert torch.equal(module(x), expected)
    plain = gguf_int4_linear(name, raw, dtype=torch.float32)
    assert plain.bias is None
    assert torch.equal(plain(x.float()), matmul(x.float(), *int4pack_gguf(name, raw, torch.float32)))


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("kind", [T.Q5_0, T.Q8_0, T.Q4_K.value + 1, "Q3_K", "F32", 10_000, 1.5])
def test_unsupported_type(kind):
    with pytest.raises(ValueError, match="unsupported tensor type"):
        unpack_q4(kind, np.zeros((1, 18), np.uint8))


def test_bad_shapes():
    raw = _random_blocks("Q4_0", 4, 64, np.random.default_rng(10))
    with pytest.raises(ValueError, match="whole number of 18-byte blocks"):
        unpack_q4("Q4_0", raw[:, :-1])
    with pytest.raises(ValueError, match="divisible by its block size 256"):
        unpack_q4("Q4_K", np.zeros(9 * 144, np.uint8), shape=(9, 288))
    with pytest.raises(ValueError, match="do not hold"):
        unpack_q4("Q4_0", raw.reshape(-1), shape=(4, 96))
    with pytest.raises(ValueError, match="2-D"):
        unpack_q4("Q4_0", raw.reshape(-1))
    with pytest.raises(TypeError, match="uint8"):
        unpack_q4("Q4_0", raw.astype(np.int16))
    with pytest.raises(ValueError, match="needs scales and zeros"):
        q, s, z = unpack_q4("Q4_0", raw)
        dequantize_q4(q, s.t(), z)
    with pytest.raises(ValueError, match="int4 CPU kernel does not take"):  # 4 output rows: not a multiple of 16
        int4pack_gguf("Q4_0", raw, torch.float32)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        int4pack_gguf("Q4_0", np.tile(raw, (4, 1)), torch.float64)


# ---------------------------------------------------------------------------------------------- the bundled model
@pytest.mark.integration
def test_bundled_gguf_q4_1():
    """Every 4-bit tensor of the bundled SmolLM2 GGUF has exact zeros; one is checked bit for bit and through
    the kernel."""
    from kvboost.models.loading import bundled_gguf_path

    try:
        path = bundled_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    reader = gguf.GGUFReader(path)
    four_bit = [t for t in reader.tensors if t.tensor_type.name in SUPPORTED_TYPES]
    assert four_bit
    for t in four_bit:
        assert bool(zeros_exact(t.tensor_type, t.data).all()), t.name
    t = next(t for t in four_bit if t.name == "blk.0.ffn_down.weight")
    assert t.tensor_type == T.Q4_1
    ref = dequantize(t.data, t.tensor_type)
    q, scales, zeros = unpack_q4(t.tensor_type, t.data)
    ours = dequantize_q4(q, scales, zeros).numpy()
    assert ours.shape == (576, 1536) == tuple(int(n) for n in t.shape[::-1])  # ggml ne = [in, out]
    assert np.array_equal(_bits(ours), _bits(ref))
    x = torch.randn(1, 1536, generator=torch.Generator().manual_seed(0))
    y = matmul(x, *int4pack_from_q4(q, scales, zeros, torch.float32))
    w = torch.from_numpy(ref).double()
    assert torch.all((y.double() - x.double() @ w.t()).abs() <= 1e-5 * (x.double().abs() @ w.abs().t()))
