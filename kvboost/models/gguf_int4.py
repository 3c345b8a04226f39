"""GGUF's 4-bit block formats (Q4_0, Q4_1, Q4_K) as the group-wise int4 weights torch's int4 CPU kernel runs.

kvboost's AWQ path multiplies with ``aten._weight_int4pack_mm_for_cpu`` (:func:`kvboost.models.awq.int4pack_mm`).
That kernel takes 4-bit codes ``q`` in 0..15 for a weight ``[out, in]`` and, per group of ``group`` input
channels and output row, a (scale, zero) pair, and represents::

    w = (q - 8) * scale + zero

With group 32 the three GGUF formats below map onto it with GGUF's own codes (no requantization: ``q`` is the
stored nibble) and per-group (scale, zero) pairs; how exact the resulting weights are is stated below.
Layouts as in llama.cpp (``ggml-common.h`` block structs, ``ggml-quants.c`` ``dequantize_row_*``) and
gguf-py (``gguf/quants.py``, ``Q4_0/Q4_1/Q4_K.dequantize_blocks``); a GGUF linear weight has ggml shape
``[in, out]`` (``ne0`` = in, contiguous), i.e. numpy rows = output features, one row = ``in`` values in blocks:

- **Q4_0**, 32 values in 18 bytes: ``d`` (fp16), then 16 bytes ``qs``. Value ``i < 16`` is the low nibble of
  ``qs[i]``, value ``16 + i`` its high nibble. gguf: ``w = d * (q - 8)``. Mapping: ``scale = d``,
  ``zero = -0.0`` (negative zero: adding it changes no fp32 value, not even the sign of a zero).
- **Q4_1**, 32 values in 20 bytes: ``d`` (fp16), ``m`` (fp16), 16 bytes ``qs`` (nibble order as Q4_0). gguf:
  ``w = d * q + m``. Mapping: ``scale = d``, ``zero = 8 * d + m``.
- **Q4_K**, a super-block of 256 values in 144 bytes: ``d`` (fp16), ``dmin`` (fp16), 12 bytes of 6-bit scales
  and mins for the 8 sub-blocks of 32 values, 128 bytes ``qs``. Bytes ``0..3`` hold the low 6 bits of ``sc[0..3]``
  (top 2 bits: bits 4..5 of ``sc[4..7]``), bytes ``4..7`` the low 6 bits of ``m[0..3]`` (top 2 bits: bits 4..5 of
  ``m[4..7]``), bytes ``8..11`` the low 4 bits of ``sc[4..7]`` (low nibble) and ``m[4..7]`` (high nibble)
  (llama.cpp ``get_scale_min_k4``). ``qs`` is 4 chunks of 32 bytes; chunk ``c``'s low nibbles are sub-block
  ``2c``, its high nibbles sub-block ``2c + 1``. gguf: ``w = (d * sc_j) * q - (dmin * m_j)``. Mapping, per
  sub-block: ``scale = d * sc_j``, ``zero = 8 * (d * sc_j) - dmin * m_j``.

Exactness of the fp32 weights (:func:`dequantize_q4`: the weight the fp32 kernel is given), against
``gguf.quants.dequantize`` (gguf-py 0.19, whose arithmetic is llama.cpp's ``dequantize_row_q4_*``): every product
involved is exact in fp32 (an fp16 ``d`` has 11 significant bits, ``sc_j``/``m_j`` 6, ``q`` and ``q - 8`` 4:
at most 21 bits; so an FMA gives the same result as a multiply-then-add). gguf's value is therefore the exact
``(q - 8) * scale + Z`` rounded once, where ``Z`` is the exact ``8 d + m`` (Q4_1) or ``8 d sc_j - dmin m_j``
(Q4_K), and ours is ``(q - 8) * scale + fl32(Z)`` rounded once. Hence:

- Q4_0: bit-equal, for every finite ``d`` (any sign, subnormals, signed zeros included).
- Q4_1 and Q4_K: equal in value wherever ``Z`` is exactly representable in fp32 (:func:`zeros_exact` tells, per
  group), and bit-equal there too when the fp16 fields are >= 0 (as llama.cpp writes Q4_K's ``d``/``dmin`` and
  Q4_1's ``d``); with a negative field only the sign of a zero result can differ. ``Z`` is exact whenever, for
  normal fp16 fields with binary exponents ``e(.)``: Q4_1 ``-9 <= e(m) - e(d) <= 15`` (any signs); Q4_K, with
  ``d, dmin >= 0``, ``-4 <= e(dmin) - e(d) <= 10`` (or ``dmin * m_j == 0``). Real files are well inside: every
  Q4_1 group of the bundled SmolLM2 GGUF is exact, and so are the blocks ``gguf.quants.quantize`` writes for
  Q4_0/Q4_1 and llama.cpp-style Q4_K blocks (``d = max scale / 63``, ``dmin = max min / 63``).
- Where ``Z`` is not exact (fields whose exponents are far apart: uniformly random fp16 bit patterns hit this in
  ~28% of Q4_1 groups and ~40-50% of Q4_K groups) the weight differs from gguf's by at most
  ``ulp(fl32(Z)) / 2 + ulp(w)`` (absolute; relative error can be large where ``w`` is small).

bf16/fp16 activations run the kernel with scale and zero rounded to that dtype (the kernel requires it), so those
products are within a tolerance of the fp32 weight's, not bit-equal.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kvboost.models.awq import (
    AWQLinear,
    Int4PackedLinear,
    _int4pack_supported,
    int4pack_from_parts,
    int4pack_mm,
)

GROUP_SIZE = 32  # the kernel's group: one Q4_0/Q4_1 block, one Q4_K sub-block
# name -> (values per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES / ggml's type traits.
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144)}
SUPPORTED_TYPES = tuple(BLOCKS)

__all__ = [
    "BLOCKS",
    "GROUP_SIZE",
    "SUPPORTED_TYPES",
    "GGUFInt4Linear",
    "dequantize_q4",
    "gguf_int4_linear",
    "int4pack_from_q4",
    "int4pack_gguf",
    "matmul",
    "quant_type_name",
    "unpack_q4",
    "unpack_q4_scale_min",
    "zeros_exact",
]  # fmt: skip


def quant_type_name(tensor_type: Any) -> str:
    """The GGUF type name (``"Q4_K"``) of a ``gguf.GGMLQuantizationType``, its int value, or a name; raises a
    ``ValueError`` naming the supported types for anything else."""
    if isinstance(tensor_type, str):
        name = tensor_type.upper()
    elif hasattr(tensor_type, "name"):  # an enum member (gguf.GGMLQuantizationType)
        name = str(tensor_type.name)
    elif isinstance(tensor_type, (int, np.integer)) and not isinstance(tensor_type, bool):
        try:
            from gguf import GGMLQuantizationType

            name = GGMLQuantizationType(int(tensor_type)).name
        except (ImportError, ValueError):
            name = f"type id {int(tensor_type)}"
    else:
        name = repr(tensor_type)
    if name not in BLOCKS:
        raise ValueError(f"GGUF int4: unsupported tensor type {name}; supported: {', '.join(SUPPORTED_TYPES)}")
    return name


def _blocks(name: str, raw: np.ndarray, shape: tuple[int, int] | None) -> np.ndarray:
    """``raw`` as uint8 ``[rows, blocks per row, bytes per block]``, with the shape checks."""
    block, size = BLOCKS[name]
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise TypeError(f"GGUF int4: raw must be a uint8 array of {name} blocks, got {raw.dtype}")
    if shape is not None:
        rows, cols = (int(n) for n in shape)
        if rows <= 0 or cols <= 0 or cols % block:
            raise ValueError(f"GGUF int4: {name} needs a row length divisible by its block size {block}; "
                             f"shape {tuple(shape)}")  # fmt: skip
        if raw.size != rows * cols // block * size:
            raise ValueError(f"GGUF int4: {raw.size} bytes do not hold a {rows}x{cols} {name} tensor "
                             f"({rows * cols // block * size} bytes)")  # fmt: skip
        raw = raw.reshape(rows, cols // block * size)
    if raw.ndim != 2:
        raise ValueError(f"GGUF int4: raw must be 2-D [rows, bytes per row] (or give shape=), got {raw.shape}")
    rows, nbytes = raw.shape
    if rows == 0 or nbytes == 0 or nbytes % size:
        raise ValueError(f"GGUF int4: a {name} row must be a whole number of {size}-byte blocks ({block} values "
                         f"each); got rows of {nbytes} bytes")  # fmt: skip
    return np.ascontiguousarray(raw).reshape(rows, nbytes // size, size)


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes (last axis) as an fp16 value -> fp32 (exact), the last axis dropped."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """``qs`` [..., 16] -> codes [..., 32]: low nibbles are values 0..15, high nibbles 16..31."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 scale bytes [..., 12] -> (sc, m) uint8 [..., 8] (llama.cpp ``get_scale_min_k4``)."""
    lo_sc, lo_m, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([lo_sc & 0x3F, (hi & 0x0F) | ((lo_sc >> 2) & 0x30)], axis=-1)
    m = np.concatenate([lo_m & 0x3F, (hi >> 4) | ((lo_m >> 2) & 0x30)], axis=-1)
    return sc, m


def _unpack(name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(codes [rows, cols] uint8, scale, zero (fp32 [rows, groups]), the exact zero in fp64 [rows, groups])."""
    rows = blocks.shape[0]
    if name == "Q4_K":
        d, dmin = _f16(blocks[..., 0:2])[..., None], _f16(blocks[..., 2:4])[..., None]  # [rows, nb, 1]
        sc, m = _scale_min_k4(blocks[..., 4:16])  # [rows, nb, 8]
        qs = blocks[..., 16:].reshape(rows, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        codes = (qs & np.uint8(0x0F)).reshape(rows, -1)  # sub-blocks 2c (low nibbles), 2c + 1 (high), c = 0..3
        scale = d * sc.astype(np.float32)  # gguf's ``d * sc``: exact (11 x 6 significant bits)
        dm = dmin * m.astype(np.float32)  # gguf's ``dmin * m``: exact
        zero = np.float32(8) * scale - dm  # one rounding of the exact 8 d sc - dmin m
        exact = np.float64(8) * scale.astype(np.float64) - dm.astype(np.float64)  # exact in fp64 (< 53 bits)
    else:
        d = _f16(blocks[..., 0:2])
        if name == "Q4_0":
            codes = _nibbles_32(blocks[..., 2:18]).reshape(rows, -1)
            scale, zero = d, np.full_like(d, -0.0)
            exact = zero.astype(np.float64)
        else:  # Q4_1
            m = _f16(blocks[..., 2:4])
            codes = _nibbles_32(blocks[..., 4:20]).reshape(rows, -1)
            scale, zero = d, np.float32(8) * d + m
            exact = np.float64(8) * d.astype(np.float64) + m.astype(np.float64)
    return codes, scale.reshape(rows, -1), zero.reshape(rows, -1), exact.reshape(rows, -1)


def unpack_q4(
    tensor_type: Any, raw: np.ndarray, shape: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_0 / Q4_1 / Q4_K blocks -> (q, scales, zeros) for torch's int4 CPU kernel, group size 32.

    ``tensor_type``: a ``gguf.GGMLQuantizationType``, its int value or its name. ``raw``: the tensor's bytes as
    uint8 ``[rows, bytes per row]`` (what ``gguf.GGUFReader`` gives as ``tensor.data`` for a 2-D tensor), or
    any uint8 array with ``shape=(rows, cols)`` in values. For a linear weight rows = out features and
    cols = in features.

    Returns ``q`` uint8 ``[rows, cols]`` (codes 0..15), ``scales`` and ``zeros`` fp32 ``[cols / 32, rows]``: the
    ``[in / group, out]`` layout of :func:`kvboost.models.awq.int4pack_parts`'s scale-and-zero (stack them on a
    last axis, or use :func:`int4pack_from_q4`). The weight is ``(q - 8) * scale + zero`` per group (module
    docstring: the mapping and its exactness). Vectorised over all blocks.
    """
    name = quant_type_name(tensor_type)
    codes, scale, zero, _ = _unpack(name, _blocks(name, raw, shape))
    return (torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scale.T)),
            torch.from_numpy(np.ascontiguousarray(zero.T)))  # fmt: skip


def unpack_q4_scale_min(
    tensor_type: Any, raw: np.ndarray, shape: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_0 / Q4_1 / Q4_K blocks -> (q uint8 ``[rows, cols]`` codes 0..15, scale, min fp32 ``[rows, cols / 32]``)
    with ``w = q * scale + min`` per group of 32: gguf's own form (Q4_1 ``d * q + m``; Q4_0 ``min = -8 d``; Q4_K
    ``min = -dmin * m_j``), every field exact in fp32, so ``q * scale + min`` in fp32 is gguf's dequantization bit
    for bit. What kvboost's quantized CPU step (``kvboost/csrc/cpu_quant.cpp``) multiplies."""
    name = quant_type_name(tensor_type)
    codes, scale, _, exact = _unpack(name, _blocks(name, raw, shape))
    minv = exact - np.float64(8) * scale.astype(np.float64)  # exact: m, -8 d or -dmin m_j (all fit fp32)
    minv32 = minv.astype(np.float32)
    if not np.array_equal(minv32.astype(np.float64), minv):
        raise ValueError(f"GGUF int4: a {name} group's min is not exact in fp32 (corrupt fields?)")
    return torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scale)), torch.from_numpy(minv32)


def zeros_exact(tensor_type: Any, raw: np.ndarray, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """bool ``[cols / 32, rows]``: where the fp32 ``zero`` of :func:`unpack_q4` is the exact ``8 d + m`` (Q4_1)
    or ``8 d sc - dmin m`` (Q4_K) (always true for Q4_0). Where true, :func:`dequantize_q4` equals gguf's
    dequantization bit for bit; elsewhere it is within ``ulp(zero) / 2 + ulp(w)``."""
    name = quant_type_name(tensor_type)
    _, _, zero, exact = _unpack(name, _blocks(name, raw, shape))
    return torch.from_numpy(np.ascontiguousarray((zero.astype(np.float64) == exact).T))


def dequantize_q4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """fp32 ``[rows, cols]`` weight ``(q - 8) * scale + zero`` from :func:`unpack_q4`'s layout (``scales``,
    ``zeros`` ``[cols / 32, rows]``; cast to fp32 first if given in another dtype). ``(q - 8) * scale`` is exact,
    so this is one rounding per value, as in gguf (module docstring), and is the weight the fp32 kernel runs."""
    rows, cols = q.shape
    groups = cols // GROUP_SIZE
    if cols % GROUP_SIZE or tuple(scales.shape) != (groups, rows) or tuple(zeros.shape) != (groups, rows):
        raise ValueError(f"GGUF int4: q {tuple(q.shape)} needs scales and zeros of shape ({groups}, {rows}); got "
                         f"{tuple(scales.shape)} and {tuple(zeros.shape)}")  # fmt: skip
    s = scales.to(torch.float32).t().unsqueeze(-1)  # [rows, groups, 1]: broadcast over each group's 32 values
    z = zeros.to(torch.float32).t().unsqueeze(-1)
    return ((q.reshape(rows, groups, GROUP_SIZE).to(torch.float32) - 8) * s + z).reshape(rows, cols)


def int4pack_from_q4(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed weight uint8 ``[rows, cols / 2]``, scale-and-zero ``[cols / 32, rows, 2]`` in ``dtype``): what
    :func:`kvboost.models.awq.int4pack_mm` (``aten._weight_int4pack_mm_for_cpu``, group size 32) multiplies
    ``x [..., cols]`` with. Packed by :func:`kvboost.models.awq.int4pack_from_parts`, as every int4 CPU path.
    ``dtype`` must be the activations' dtype (the kernel requires it); bf16/fp16 round the scales and zeros."""
    rows, cols = q.shape
    if not _int4pack_supported(cols, rows, GROUP_SIZE):
        raise ValueError(f"torch's int4 CPU kernel does not take a {rows}x{cols} weight (out features % 16 and "
                         "in features % 2 must be 0, and the op must exist)")  # fmt: skip
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"GGUF int4: the int4 CPU kernel runs fp32, bf16 or fp16 activations, not {dtype}")
    return int4pack_from_parts(q, torch.stack([scales.to(torch.float32), zeros.to(torch.float32)], dim=-1), dtype)


def int4pack_gguf(
    tensor_type: Any, raw: np.ndarray, dtype: torch.dtype, shape: tuple[int, int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q4_0 / Q4_1 / Q4_K weight -> (packed weight, scale-and-zero in ``dtype``) for
    :func:`kvboost.models.awq.int4pack_mm` with group size 32: :func:`unpack_q4` then :func:`int4pack_from_q4`."""
    return int4pack_from_q4(*unpack_q4(tensor_type, raw, shape), dtype)


def gguf_int4_linear(
    tensor_type: Any, raw: np.ndarray, *, dtype: torch.dtype = torch.bfloat16, bias: torch.Tensor | None = None,
    shape: tuple[int, int] | None = None,
) -> Int4PackedLinear:  # fmt: skip
    """An :class:`kvboost.models.awq.Int4PackedLinear` (group size 32, for ``dtype`` activations on CPU) holding
    a GGUF Q4_0 / Q4_1 / Q4_K weight ``[out, in]``. ``bias`` goes into that module's bias buffer, which is fp16
    (its format): an fp32 GGUF bias is rounded to fp16 there."""
    packed, scale_zero = int4pack_gguf(tensor_type, raw, dtype, shape)
    out_features, in_features = packed.shape[0], scale_zero.shape[0] * GROUP_SIZE
    module = Int4PackedLinear(in_features, out_features, bias is not None, group_size=GROUP_SIZE, dtype=dtype)
    with torch.no_grad():
        module.int4pack_weight.copy_(packed)
        module.int4pack_scale_zero.copy_(scale_zero)
        if bias is not None:
            if tuple(bias.shape) != (out_features,):
                raise ValueError(f"GGUF int4: bias shape {tuple(bias.shape)}, expected ({out_features},)")
            module.bias.copy_(bias)
    return module


def matmul(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    """``x [..., in]`` times a packed GGUF weight (:func:`int4pack_gguf`): :func:`kvboost.models.awq.int4pack_mm`
    with group size 32."""
    return int4pack_mm(x, packed, GROUP_SIZE, scale_zero)


class GGUFInt4Linear(AWQLinear):
    """A linear whose weight is a GGUF Q4_0 / Q4_1 / Q4_K tensor kept as shipped: the raw blocks, rows in the
    model's output order (``weights="gguf_int4"``: :mod:`kvboost.models.gguf_weights`).

    Buffers: ``gguf_blocks`` uint8 ``[out, bytes per row]`` (the GGUF tensor's bytes, nothing decoded) and
    ``bias`` (the model's own, in its dtype; ``.to(dtype)`` casts it like an ``nn.Linear``'s). It is an
    :class:`kvboost.models.awq.AWQLinear` to everything that runs int4 linears: its forward (int4 kernel, dense
    prefill, dequantize + ``F.linear`` where the kernel is slow) and the runtime's fused q/k/v and gate/up packs
    (:func:`kvboost.models.awq.fuse_int4pack`, ``Int4Projections``) are AWQLinear's, fed by
    :meth:`int4pack_parts`: the stored nibbles as codes and GGUF's per-32 (scale, zero) (module docstring), packed
    on first use by the same aten op. As with AWQ the codes are then held twice (blocks + the kernel's packed
    form, ~1.2 bytes per weight with the fp32 scales). Off the CPU the weight is dequantized per call.
    """

    weight_buffers = ("gguf_blocks",)
    dtype_kept_buffers = ()  # the bias follows .to(dtype) like an nn.Linear's; the uint8 blocks never cast

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, tensor_type: Any = "Q4_0",
        device: torch.device | str | None = None, bias_dtype: torch.dtype = torch.float32,
    ) -> None:  # fmt: skip
        nn.Module.__init__(self)  # not AWQLinear's: no AutoAWQ buffers
        name = quant_type_name(tensor_type)
        block, size = BLOCKS[name]
        if in_features <= 0 or out_features <= 0 or in_features % block:
            raise ValueError(f"GGUF int4: a {name} linear needs in_features divisible by {block}; got "
                             f"{in_features}x{out_features}")  # fmt: skip
        self.in_features, self.out_features = in_features, out_features
        self.w_bit, self.group_size, self.tensor_type = 4, GROUP_SIZE, name
        self.register_buffer("gguf_blocks", torch.zeros(out_features, in_features // block * size, dtype=torch.uint8,
                                                        device=device))  # fmt: skip
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=bias_dtype, device=device))
        else:
            self.bias = None
        self._init_derived_forms()

    @classmethod
    def from_gguf(
        cls, tensor_type: Any, raw: np.ndarray, *, bias: torch.Tensor | None = None, rows: np.ndarray | None = None,
    ) -> GGUFInt4Linear:  # fmt: skip
        """From a GGUF tensor's bytes ``raw`` (uint8 ``[out, bytes per row]``, as ``gguf.GGUFReader`` gives a
        2-D weight). ``rows``: an order of the output rows (``raw[rows]``; blocks never span rows, so this
        reorders codes, scales and zeros together). ``bias`` is kept as given (same storage)."""
        name = quant_type_name(tensor_type)
        blocks = _blocks(name, raw, None)  # [out, blocks per row, bytes per block], checked
        out_features, per_row = blocks.shape[0], blocks.shape[1]
        if rows is not None:
            rows = np.asarray(rows)
            if sorted(rows.tolist()) != list(range(out_features)):
                raise ValueError(f"GGUF int4: rows must be a permutation of range({out_features})")
            blocks = blocks[rows]
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"GGUF int4: bias shape {tuple(bias.shape)}, expected ({out_features},)")
        with torch.device("meta"):  # placeholders, replaced below (no zeros allocated)
            module = cls(per_row * BLOCKS[name][0], out_features, bias is not None, tensor_type=name,
                         bias_dtype=bias.dtype if bias is not None else torch.float32)  # fmt: skip
        # a copy in memory (a GGUFReader's arrays are read-only maps of the file)
        module.gguf_blocks = torch.from_numpy(np.array(blocks.reshape(out_features, -1), dtype=np.uint8, copy=True))
        if bias is not None:
            module.bias = bias.detach()
        return module

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"gguf {self.tensor_type}, group_size={self.group_size}")  # fmt: skip

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes uint8 ``[out, in]``, scales, zeros fp32 ``[in / 32, out]``): :func:`unpack_q4` of the blocks."""
        return unpack_q4(self.tensor_type, self.gguf_blocks.detach().cpu().numpy())

    def int4pack_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int32 ``[out, in]``, scale-and-zero fp32 ``[in / 32, out, 2]``): what the int4 kernel's packing
        takes (:func:`kvboost.models.awq.fuse_int4pack` concatenates these for the fused packs)."""
        q, scales, zeros = self.unpacked()
        return q.to(torch.int32), torch.stack([scales, zeros], dim=-1)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight ``[out, in]``: fp32 :func:`dequantize_q4` (gguf's dequantization to the bit where
        :func:`zeros_exact`), then cast to ``dtype``."""
        return dequantize_q4(*self.unpacked()).to(device=self.gguf_blocks.device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":  # no GGUF kernel off the CPU: dequantize per call
            out = F.linear(x, self.dequantized_weight(x.dtype).to(x.device))
            return out if self.bias is None else out + self.bias.to(device=out.device, dtype=out.dtype)
        return super().forward(x)
