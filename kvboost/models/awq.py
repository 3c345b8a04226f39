"""AWQ int4 weights in AutoAWQ's GEMM format: packing, the int4 linear, and AWQ folders (save / load).

The format (AutoAWQ ``version: gemm``, ``w_bit 4``, ``zero_point True``), for a linear ``y = x W^T + b`` with
``W: [out, in]`` and ``group`` input channels per quantization group:

- ``qweight`` int32 ``[in, out / 8]``: the 4-bit codes of ``W^T``, 8 output columns per int32;
- ``qzeros``  int32 ``[in / group, out / 8]``: the 4-bit zero points, packed the same way;
- ``scales``  fp16  ``[in / group, out]``;
- ``bias``    fp16  ``[out]`` (when the linear has one).

Dequantization: ``W^T[i, j] = (q[i, j] - z[i // group, j]) * s[i // group, j]``. Within one int32 the nibble at bits
``4k .. 4k+3`` holds column ``8c + AWQ_ORDER[k]`` with ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]`` (AutoAWQ's
interleaving, made for its CUDA kernel's unpacking), i.e. column ``8c + j`` lives at nibble ``AWQ_REVERSE_ORDER[j]``.

:class:`AWQLinear` keeps exactly those tensors as plain named buffers, so its ``state_dict`` names equal the
checkpoint's tensor names (a layer streamer can load a checkpoint's tensors straight into it). Its forward:

- CUDA: the Triton dequant-GEMM (``kvboost.kernels_triton.awq_gemm``): codes unpacked in the kernel, fp32 accumulation;
- CPU, ``cpu_kernel="int4pack"`` (what ``"auto"`` picks where it applies, except fp32 calls of more than
  ``INT4PACK_FP32_MAX_ROWS`` rows, where that kernel is slow): torch's native int4 CPU matmul
  (``aten._weight_int4pack_mm_for_cpu``). Its packed weight is derived from the buffers on first use and kept
  beside them (same 4 bits per weight, plus fp32/bf16 scale-and-zero pairs): the int4 weights are held twice,
  ~1.1 bytes per weight in all against 4 in fp32 and 2 in bf16. It is rebuilt when a buffer is replaced or
  edited (a streamer that swaps tensors pays the repack per swap: use ``"dequant"`` there);
- CPU, ``cpu_kernel="dequant"``: the weight is dequantized per forward into a temporary of the input's dtype and
  multiplied with ``F.linear``; nothing is cached, so memory stays at the int4 size between forwards.
- CPU, dense prefill (off by default; :func:`enable_dense_prefill`, ``model.awq_prefill: dense``): calls of at
  least ``dense_min_rows`` rows multiply with a dequantized copy of the weight in the activation dtype, kept
  beside the int4 codes (2 more bytes per weight in bf16). torch's int4 CPU kernel does not use the matrix units:
  its time grows with the rows (576x1536, 2 threads, bf16: 40 us at 1 row, 182 at 16, 662 at 64) while a bf16
  ``F.linear`` on AMX stays near 100 us up to 32 rows. Decoding (one row) keeps the int4 kernel and its bytes;
  prefill runs at the dense rate. The copy is the dequantized AWQ weight rounded to the activation dtype, so it
  computes the same quantized model, in another rounding than the int4 kernel's.

Only the GEMM version with 4 bits and zero points is read; anything else is refused with the reason.

:class:`kvboost.models.gguf_int4.GGUFInt4Linear` (``weights="gguf_int4"``) is an :class:`AWQLinear` holding a GGUF
tensor's 4-bit blocks instead of AutoAWQ's buffers: it overrides where the codes, scales and zeros come from
(:meth:`AWQLinear.int4pack_parts`, :meth:`AWQLinear.dequantized_weight`), and shares everything else here (the CPU
forward, dense prefill, the fused packs).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an int32 holds column 8c + AWQ_ORDER[k]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column 8c + j lives at nibble AWQ_REVERSE_ORDER[j]
PACK = 8  # 4-bit codes per int32
MAX_CODE = 15
CPU_KERNELS = ("auto", "int4pack", "dequant")
# torch's int4 CPU kernel is fast with bf16/fp16 activations at every row count, but with fp32 activations its
# time grows ~linearly with the rows (576x1536, one thread: 1.7 ms at 1 row, 0.93 s at 512 rows, against 6 and
# 24 ms for dequantize + F.linear): ``auto`` sends fp32 calls with more rows than this to dequantize + F.linear.
INT4PACK_FP32_MAX_ROWS = 2
# Dense prefill: from this many rows a dequantized bf16 copy through F.linear beats the int4 kernel (measured on
# 576x1536, 1536x576 and 576x960 with 2 threads: a tie at 8 rows, the dense product 1.6-2.2x faster at 16).
DENSE_MIN_ROWS = 12
AWQ_TENSORS = ("qweight", "qzeros", "scales")


# ---------------------------------------------------------------------------------------------- config
@dataclass
class AWQConfig:
    """``quantization_config`` of an AutoAWQ GEMM checkpoint (the fields kvboost reads and writes)."""

    bits: int = 4
    group_size: int = 128
    zero_point: bool = True
    version: str = "gemm"
    modules_to_not_convert: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.bits != 4:
            raise ValueError(f"AWQ: only 4-bit weights are supported (w_bit/bits = {self.bits})")
        if str(self.version).lower() != "gemm":
            raise ValueError(f"AWQ: only AutoAWQ's 'gemm' layout is supported (version = {self.version!r})")
        if not self.zero_point:
            raise ValueError("AWQ: only zero_point=True checkpoints are supported")
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ValueError(f"AWQ: group_size must be a positive int (got {self.group_size!r}; -1 is not supported)")
        self.version = str(self.version).lower()
        self.modules_to_not_convert = list(self.modules_to_not_convert or [])

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AWQConfig:
        """From a config.json ``quantization_config`` (AutoAWQ spells bits ``bits`` or ``w_bit``, group
        ``group_size`` or ``q_group_size``)."""
        method = str(d.get("quant_method", "awq")).lower()
        if method != "awq":
            raise ValueError(f"not an AWQ quantization_config (quant_method = {method!r})")
        return cls(
            bits=int(d.get("bits", d.get("w_bit", 4))),
            group_size=int(d.get("group_size", d.get("q_group_size", 128))),
            zero_point=bool(d.get("zero_point", True)),
            version=str(getattr(d.get("version", "gemm"), "value", d.get("version", "gemm"))),
            modules_to_not_convert=list(d.get("modules_to_not_convert") or []),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "quant_method": "awq", "bits": self.bits, "group_size": self.group_size, "zero_point": self.zero_point,
            "version": self.version, "modules_to_not_convert": list(self.modules_to_not_convert) or None,
        }  # fmt: skip

    def skips(self, module_name: str) -> bool:
        """AutoAWQ's rule: a module is left in float when any entry of ``modules_to_not_convert`` is in its name."""
        return any(key in module_name for key in self.modules_to_not_convert)


def awq_config_of(config: Any) -> AWQConfig | None:
    """The :class:`AWQConfig` of an HF config (or config.json dict) whose ``quantization_config`` says awq, else None."""
    qc = config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    if str(qc.get("quant_method", "")).lower() != "awq":
        return None
    return AWQConfig.from_dict(qc)


# ---------------------------------------------------------------------------------------------- packing
def _check_shapes(in_features: int, out_features: int, group_size: int) -> None:
    if in_features % group_size:
        raise ValueError(f"AWQ: in_features {in_features} is not divisible by group_size {group_size}")
    if out_features % PACK:
        raise ValueError(f"AWQ: out_features {out_features} is not divisible by {PACK} (8 codes per int32)")


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Integer codes in [0, 15], ``[rows, cols]`` (cols % 8 == 0) -> int32 ``[rows, cols / 8]`` in AWQ's order."""
    rows, cols = codes.shape
    if cols % PACK:
        raise ValueError(f"AWQ: cannot pack {cols} columns (not a multiple of {PACK})")
    c = codes.to(torch.int64)
    if c.numel() and (int(c.min()) < 0 or int(c.max()) > MAX_CODE):
        raise ValueError("AWQ: codes must lie in [0, 15]")
    c = c.view(rows, cols // PACK, PACK)[:, :, list(AWQ_ORDER)]  # nibble k <- column AWQ_ORDER[k]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=codes.device)
    packed = (c << shifts).sum(-1)  # < 2**32: fits int64, reinterpreted below as int32 two's complement
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _logical_shifts(device: torch.device) -> torch.Tensor:
    # Column 8c + j sits at nibble AWQ_REVERSE_ORDER[j]: shifting by 4 * that reads the columns in logical order
    # directly (no gather afterwards).
    return torch.tensor([4 * k for k in AWQ_REVERSE_ORDER], dtype=torch.int32, device=device)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[rows, n]`` in AWQ's order -> int32 codes ``[rows, 8 n]`` in logical column order."""
    nibbles = (packed.unsqueeze(-1) >> _logical_shifts(packed.device)) & MAX_CODE  # [rows, n, 8] (masked shift)
    return nibbles.reshape(packed.shape[0], -1)


def rtn_quantize(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric 4-bit quantization of an ``nn.Linear`` weight ``[out, in]``, per group of
    ``group_size`` input channels (min-max, zero point), as AutoAWQ's quantizer does.

    Returns (codes int32 ``[in, out]``, zeros int32 ``[in / group, out]``, scales fp16 ``[in / group, out]``). The
    codes are computed against the fp16-rounded scales, so ``(codes - zeros) * scales`` is the weight the
    checkpoint represents.
    """
    out_f, in_f = weight.shape
    _check_shapes(in_f, out_f, group_size)
    w = weight.detach().to(torch.float32).t().reshape(in_f // group_size, group_size, out_f)  # [G, g, out]
    wmax, wmin = w.amax(dim=1), w.amin(dim=1)  # [G, out]
    scales = ((wmax - wmin).clamp(min=1e-5) / MAX_CODE).to(torch.float16)
    s = scales.to(torch.float32)
    zeros = (-torch.round(wmin / s)).clamp(0, MAX_CODE)
    codes = (torch.round(w / s.unsqueeze(1)) + zeros.unsqueeze(1)).clamp(0, MAX_CODE)
    return codes.reshape(in_f, out_f).to(torch.int32), zeros.to(torch.int32), scales


def pack_awq(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """Codes ``[in, out]``, zeros ``[in/g, out]``, scales ``[in/g, out]`` -> AutoAWQ tensors (qweight, qzeros, scales)."""
    return {"qweight": pack_int4(codes), "qzeros": pack_int4(zeros), "scales": scales.to(torch.float16).contiguous()}


def quantize_weight(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """RTN-quantize and pack an ``[out, in]`` weight: AutoAWQ's ``qweight``, ``qzeros``, ``scales``."""
    return pack_awq(*rtn_quantize(weight, group_size))


def unpack_awq(qweight: torch.Tensor, qzeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ tensors -> (codes int32 ``[in, out]``, zeros int32 ``[in / group, out]``)."""
    return unpack_int4(qweight), unpack_int4(qzeros)


def dequantize_awq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The float weight ``[out, in]`` (nn.Linear layout) an AWQ triple represents, computed in fp32 then cast."""
    codes, zeros = unpack_awq(qweight, qzeros)
    group_size = codes.shape[0] // scales.shape[0]
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=0)
    z = zeros.repeat_interleave(group_size, dim=0)
    return ((codes - z).to(torch.float32) * s).t().to(dtype)


# ---------------------------------------------------------------------------------------------- the int4 linear
def int4pack_parts(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ tensors -> (codes int32 ``[out, in]``, scale-and-zero fp32 ``[in / group, out, 2]``): what torch's
    int4 CPU kernel takes, before packing. tinygemm dequantizes ``(q - 8) * s + m``; AWQ's ``(q - z) * s`` is
    ``m = (8 - z) * s``."""
    codes, zeros = unpack_awq(qweight, qzeros)
    s = scales.to(torch.float32)
    return codes.t().contiguous(), torch.stack([s, (8 - zeros).to(torch.float32) * s], dim=-1)


def int4pack_from_parts(
    codes: torch.Tensor, scale_zero: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes ``[out, in]`` in 0..15, scale-and-zero ``[in / group, out, 2]``) -> (packed weight uint8
    ``[out, in / 2]``, scale-and-zero in ``dtype``, contiguous): the form ``aten._weight_int4pack_mm_for_cpu``
    multiplies with. The one packing call of every int4 CPU path (AWQ, GGUF, the fused packs)."""
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    return packed, scale_zero.to(dtype).contiguous()


def int4pack_tensors(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ tensors -> (packed weight uint8 ``[out, in / 2]``, scale-and-zero ``[in / group, out, 2]`` in
    ``dtype``): :func:`int4pack_from_parts` of :func:`int4pack_parts`."""
    return int4pack_from_parts(*int4pack_parts(qweight, qzeros, scales), dtype)


def int4pack_mm(x: torch.Tensor, packed: torch.Tensor, group_size: int, scale_zero: torch.Tensor) -> torch.Tensor:
    """``x [..., in]`` times a packed int4 weight (:func:`int4pack_tensors`) -> ``[..., out]``: torch's int4 CPU
    kernel over the rows of ``x``. The one call every int4 CPU path makes (modules and the fused decode step), so
    they give the same bits."""
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, x.shape[-1]).contiguous(), packed, group_size,
                                                      scale_zero)  # fmt: skip
    return out.reshape(*x.shape[:-1], packed.shape[0])


def _int4pack_supported(in_features: int, out_features: int, group_size: int) -> bool:
    op = getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None)
    return op is not None and group_size in (32, 64, 128, 256) and out_features % 16 == 0 and in_features % 2 == 0


class AWQLinear(nn.Module):
    """An int4 linear holding AutoAWQ GEMM tensors as buffers (``qweight``, ``qzeros``, ``scales``, ``bias``).

    Not an ``nn.Linear`` subclass on purpose: code that reads ``.weight`` of a plain linear (the fused decode step)
    sees that it does not apply. ``cpu_kernel`` picks the CPU path (module docstring); the class attribute is the
    default for every instance.
    """

    cpu_kernel: str = "auto"
    #: The buffers that hold the weight: their identity and version key the derived forms (a swapped or edited
    #: buffer invalidates them). A subclass storing the weight otherwise (GGUF blocks) names its own.
    weight_buffers: tuple[str, ...] = ("qweight", "qzeros", "scales")
    #: Buffers ``.to(dtype)`` leaves in their stored dtype (fp16 scales and bias, as in the checkpoint: a cast to
    #: bf16 would round the scales); the others follow ``nn.Module``'s rules.
    dtype_kept_buffers: tuple[str, ...] = ("scales", "bias")

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, w_bit: int = 4, group_size: int = 128,
        device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        if w_bit != 4:
            raise ValueError(f"AWQLinear: only 4-bit weights are supported (w_bit = {w_bit})")
        _check_shapes(in_features, out_features, group_size)
        self.in_features, self.out_features = in_features, out_features
        self.w_bit, self.group_size = w_bit, group_size
        groups = in_features // group_size
        self.register_buffer(
            "qweight", torch.zeros(in_features, out_features // PACK, dtype=torch.int32, device=device)
        )
        self.register_buffer("qzeros", torch.zeros(groups, out_features // PACK, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.zeros(groups, out_features, dtype=torch.float16, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float16, device=device))
        else:
            self.bias = None
        self._init_derived_forms()

    def _init_derived_forms(self) -> None:
        self._int4pack: tuple[Any, torch.Tensor, torch.Tensor] | None = None  # (key, packed weight, scale&zero)
        # Dense prefill (module docstring): off when None; else calls of this many rows or more on CPU use
        # a dequantized copy, ``_dense`` = (key, weight [out, in] in the activation dtype).
        self.dense_min_rows: int | None = None
        self._dense: tuple[Any, torch.Tensor] | None = None

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        group_size: int = 128,
        *,
        codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> AWQLinear:
        """Quantize ``linear`` (RTN min-max per group unless ``codes`` = (codes, zeros, scales) are given)."""
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size=group_size,
                     device=linear.weight.device)  # fmt: skip
        tensors = pack_awq(*(codes if codes is not None else rtn_quantize(linear.weight, group_size)))
        for name, t in tensors.items():
            getattr(module, name).copy_(t)
        if linear.bias is not None:
            module.bias.copy_(linear.bias.detach())
        return module

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[out, in]`` these buffers represent."""
        return dequantize_awq(self.qweight, self.qzeros, self.scales, dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"w_bit={self.w_bit}, group_size={self.group_size}")  # fmt: skip

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from kvboost.kernels_triton.awq_gemm import awq_gemm

            out = awq_gemm(x.reshape(-1, self.in_features), self.qweight, self.qzeros, self.scales, self.group_size)
            out = out.reshape(*x.shape[:-1], self.out_features)
        elif self.dense_min_rows is not None and x.numel() // self.in_features >= self.dense_min_rows:
            out = F.linear(x, self.dense_weight(x.dtype))
        elif self._use_int4pack(x):
            out = self._int4pack_forward(x)
        else:
            out = F.linear(x, self.dequantized_weight(x.dtype))
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out

    def _use_int4pack(self, x: torch.Tensor) -> bool:
        kernel = self.cpu_kernel
        if kernel not in CPU_KERNELS:
            raise ValueError(f"AWQLinear.cpu_kernel must be one of {CPU_KERNELS} (got {kernel!r})")
        if kernel == "dequant" or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False
        if not _int4pack_supported(self.in_features, self.out_features, self.group_size):
            return False
        rows = x.numel() // self.in_features
        return not (kernel == "auto" and x.dtype == torch.float32 and rows > INT4PACK_FP32_MAX_ROWS)

    def _int4pack_key(self, dtype: torch.dtype) -> tuple:
        tensors = (getattr(self, name) for name in self.weight_buffers)
        return (dtype, *((id(t), t.data_ptr(), t._version) for t in tensors))

    def int4pack_parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int32 ``[out, in]``, scale-and-zero fp32 ``[in / group, out, 2]``): see :func:`int4pack_parts`."""
        return int4pack_parts(self.qweight, self.qzeros, self.scales)

    def int4pack(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed weight, scale-and-zero in ``dtype``) for ``aten._weight_int4pack_mm_for_cpu``, built on first
        use (from :meth:`int4pack_parts`) and kept until a buffer changes."""
        key = self._int4pack_key(dtype)
        if self._int4pack is None or self._int4pack[0] != key:
            self._int4pack = (key, *int4pack_from_parts(*self.int4pack_parts(), dtype))
        return self._int4pack[1], self._int4pack[2]

    @property
    def weight_device(self) -> torch.device:
        """The device of the stored int4 weight."""
        return getattr(self, self.weight_buffers[0]).device

    def adopt_int4pack(self, dtype: torch.dtype, packed: torch.Tensor, scale_zero: torch.Tensor) -> None:
        """Use ``packed`` (rows of a larger packed matrix: see :func:`fuse_int4pack`) as this module's derived
        form for ``dtype``, so the int4 codes are held once."""
        self._int4pack = (self._int4pack_key(dtype), packed, scale_zero)

    def dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight ``[out, in]`` in ``dtype`` that dense prefill multiplies with, built on first
        use and kept until a buffer changes."""
        key = self._int4pack_key(dtype)
        if self._dense is None or self._dense[0] != key:
            self._dense = (key, self.dequantized_weight(dtype))
        return self._dense[1]

    def adopt_dense(self, dtype: torch.dtype, weight: torch.Tensor) -> None:
        """Use ``weight`` (rows of a larger dense matrix: see :func:`fuse_dense`) as this module's dense copy for
        ``dtype``, so the dequantized weights are held once."""
        self._dense = (self._int4pack_key(dtype), weight)

    def _int4pack_forward(self, x: torch.Tensor) -> torch.Tensor:
        packed, scale_zero = self.int4pack(x.dtype)
        return int4pack_mm(x, packed, self.group_size, scale_zero)

    def _apply(self, fn, recurse=True):
        """``.to(device)`` moves every buffer; ``.to(dtype)`` leaves :attr:`dtype_kept_buffers` as stored. The
        derived forms are rebuilt on next use."""
        self._int4pack = self._dense = None
        kept = {name: getattr(self, name) for name in self.dtype_kept_buffers if getattr(self, name) is not None}
        super()._apply(fn, recurse)
        device = self.weight_device
        for name, t in kept.items():
            if getattr(self, name).dtype != t.dtype:
                setattr(self, name, t.to(device))
        return self


class Int4PackedLinear(nn.Module):
    """An AWQ linear stored in the layout torch's int4 CPU kernel multiplies with (what :class:`AWQLinear` derives
    from its AutoAWQ buffers on first use), as persistent buffers: ``int4pack_weight`` uint8 ``[out, in / 2]``,
    ``int4pack_scale_zero`` ``[in / group, out, 2]`` in the activation dtype, ``bias`` fp16 ``[out]``.

    For layer streaming on CPU (``kvboost.streaming.int4pack_sidecar``): a streamed layer's weights arrive in a
    staging slot for every forward, and an :class:`AWQLinear` would repack them each time; this module reads the
    packed form as it arrives. Its products are :class:`AWQLinear`'s int4-kernel products to the bit. CPU only,
    and only for the dtype it was packed for.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, group_size: int = 128,
        dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        _check_shapes(in_features, out_features, group_size)
        if not _int4pack_supported(in_features, out_features, group_size):
            raise ValueError(f"torch's int4 CPU kernel does not take a {in_features}x{out_features} linear with "
                             f"group size {group_size}")  # fmt: skip
        self.in_features, self.out_features, self.group_size, self.w_bit = in_features, out_features, group_size, 4
        groups = in_features // group_size
        self.register_buffer("int4pack_weight",
                             torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("int4pack_scale_zero", torch.zeros(groups, out_features, 2, dtype=dtype, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=torch.float16, device=device))
        else:
            self.bias = None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"group_size={self.group_size}, int4pack {self.int4pack_scale_zero.dtype}")  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != self.int4pack_scale_zero.dtype:
            raise ValueError(f"Int4PackedLinear was packed for {self.int4pack_scale_zero.dtype} on CPU; got "
                             f"{x.dtype} on {x.device.type}")  # fmt: skip
        out = int4pack_mm(x, self.int4pack_weight, self.group_size, self.int4pack_scale_zero)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out


@dataclass(frozen=True)
class Int4Pack:
    """Linears that read the same input (q/k/v, gate/up) as one matrix for torch's int4 CPU kernel.

    ``weight`` is the packed ``[sum(out), in / 2]`` matrix, ``scale_zero`` ``[in / group, sum(out), 2]`` in the
    activation dtype, ``bias`` ``[sum(out)]`` in that dtype (zeros for members without one) or ``None``;
    ``splits`` are the members' output sizes, in order. One call instead of one per member: the kernel computes
    every output column on its own, so the fused result equals the members' results to the bit (tested).
    """

    weight: torch.Tensor
    scale_zero: torch.Tensor
    bias: torch.Tensor | None
    group_size: int
    splits: tuple[int, ...]


def fused_int4pack_unsupported(modules: Iterable[nn.Module], dtype: torch.dtype) -> str | None:
    """Why :func:`fuse_int4pack` cannot fuse ``modules`` for ``dtype`` activations (``None`` when it can): they
    must be CPU AWQ linears over the same input and group size whose one-row forward is torch's int4 kernel."""
    modules = list(modules)
    if not modules or not all(isinstance(m, AWQLinear) for m in modules):
        return "not all int4 linears (AWQ, or GGUF's: kvboost.models.gguf_int4.GGUFInt4Linear)"
    first = modules[0]
    if any(m.in_features != first.in_features or m.group_size != first.group_size for m in modules):
        return "different input sizes or group sizes"
    if first.weight_device.type != "cpu":
        return f"weights on {first.weight_device.type}, not the CPU"
    probe = torch.empty(1, first.in_features, dtype=dtype)
    if not all(m._use_int4pack(probe) for m in modules):
        return f"a one-row {dtype} forward does not use the int4 CPU kernel (cpu_kernel {AWQLinear.cpu_kernel!r})"
    return None


def fuse_int4pack(modules: Iterable[AWQLinear], dtype: torch.dtype) -> Int4Pack:
    """Pack ``modules`` (same input) as one :class:`Int4Pack` for ``dtype`` activations. Each module then adopts
    its rows of the fused matrix as its own derived form where those rows are a valid packed matrix by themselves
    (they start on a packing block), so the codes are not held twice."""
    modules = list(modules)
    reason = fused_int4pack_unsupported(modules, dtype)
    if reason is not None:
        raise ValueError(f"cannot fuse these int4 linears: {reason}")
    parts = [m.int4pack_parts() for m in modules]
    codes = torch.cat([c for c, _ in parts])
    packed, scale_zero = int4pack_from_parts(codes, torch.cat([sz for _, sz in parts], dim=1), dtype)
    bias = fused_bias(modules, dtype)
    start = 0
    for m, (member_codes, member_scale_zero) in zip(modules, parts, strict=True):
        # The packed layout is blocked (64 rows per block in torch 2.13): a member's rows are its own packed
        # matrix only when they start on a block. Checked on the bytes, not assumed; otherwise the member keeps
        # its own copy.
        own, own_scale_zero = int4pack_from_parts(member_codes, member_scale_zero, dtype)
        rows_packed = packed[start : start + m.out_features]
        m.adopt_int4pack(dtype, rows_packed if torch.equal(rows_packed, own) else own, own_scale_zero)
        start += m.out_features
    return Int4Pack(packed, scale_zero, bias, modules[0].group_size, tuple(m.out_features for m in modules))


def fused_bias(modules: Iterable[Any], dtype: torch.dtype) -> torch.Tensor | None:
    """The biases of linears (AWQ int4 or ``nn.Linear``) fused along their outputs, as one ``[sum(out)]`` vector in
    ``dtype`` (zeros, on the biases' device, for members without one), or ``None`` when none has a bias."""
    modules = list(modules)
    present = [m.bias for m in modules if m.bias is not None]
    if not present:
        return None
    zeros = present[0].new_zeros
    return torch.cat([m.bias if m.bias is not None else zeros(m.out_features) for m in modules]).to(dtype)


def fuse_dense(modules: Iterable[AWQLinear], dtype: torch.dtype) -> torch.Tensor:
    """The dense copies of ``modules`` (same input) as one ``[sum(out), in]`` matrix in ``dtype``; each module
    adopts its rows (a view) as its own dense copy, so the dequantized weights are held once."""
    modules = list(modules)
    if not modules or not all(isinstance(m, AWQLinear) for m in modules):
        raise ValueError("fuse_dense takes AWQ int4 linears")
    if any(m.in_features != modules[0].in_features for m in modules):
        raise ValueError("fuse_dense: the linears read inputs of different sizes")
    fused = torch.cat([m.dequantized_weight(dtype) for m in modules]).contiguous()
    start = 0
    for m in modules:
        m.adopt_dense(dtype, fused[start : start + m.out_features])
        start += m.out_features
    return fused


def enable_dense_prefill(model: nn.Module, min_rows: int | None = DENSE_MIN_ROWS) -> int:
    """Turn dense prefill on (``min_rows`` rows and more; ``None`` turns it off) for every :class:`AWQLinear` of
    ``model``; returns how many there are. The copies are built on first use (or by :func:`fuse_dense`)."""
    if min_rows is not None and (isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 1):
        raise ValueError(f"dense prefill: min_rows must be a positive integer or None, got {min_rows!r}")
    modules = [m for m in model.modules() if isinstance(m, AWQLinear)]
    for m in modules:
        m.dense_min_rows = min_rows
        if min_rows is None:
            m._dense = None
    return len(modules)


AWQ_PREFILL_CHOICES = ("int4", "dense")


def set_awq_prefill(model: nn.Module, kind: str | None) -> nn.Module:
    """``model.awq_prefill``: ``None``/``"int4"`` leaves every row count on the int4 kernel; ``"dense"`` turns
    dense prefill on (:func:`enable_dense_prefill`). Refuses ``"dense"`` for a model without AWQ linears."""
    if kind is None or kind == "int4":
        return model
    if kind not in AWQ_PREFILL_CHOICES:
        raise ValueError(f"awq_prefill must be one of {list(AWQ_PREFILL_CHOICES)} or null, got {kind!r}")
    if enable_dense_prefill(model) == 0:
        raise ValueError("awq_prefill='dense' applies to int4 models (AWQ, or weights='gguf_int4'); this model has "
                         "no AWQ linears (nor GGUF int4 ones)")
    model._kvboost_awq_prefill = kind  # recorded for summaries
    return model


# ---------------------------------------------------------------------------------------------- whole models
def linear_named(model: nn.Module, name: str, source: str) -> nn.Linear:
    """The ``nn.Linear`` called ``name`` in ``model``, which ``source`` (a quantized file's entry) replaces; a clear
    error where the model has no such module or it is not a Linear."""
    try:
        linear = model.get_submodule(name)
    except AttributeError:
        raise ValueError(f"{source}, but the model has no module {name!r}") from None
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"{source}, but the model's {name!r} is a {type(linear).__name__}, not an nn.Linear")
    return linear


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def default_quantized_linears(model: nn.Module, config: AWQConfig) -> list[str]:
    """The linears AutoAWQ quantizes: every ``nn.Linear`` of the decoder layers (not the LM head, not the
    embeddings), less ``modules_to_not_convert``."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".layers." in f".{name}" and not config.skips(name):
            names.append(name)
    return names


def quantize_model_rtn(model: nn.Module, config: AWQConfig, names: Iterable[str] | None = None) -> list[str]:
    """Replace the linears ``names`` (default: :func:`default_quantized_linears`) by RTN-quantized AWQLinears,
    in place. Returns the names replaced."""
    names = list(names) if names is not None else default_quantized_linears(model, config)
    for name in names:
        linear = model.get_submodule(name)
        _set_submodule(model, name, AWQLinear.from_linear(linear, config.group_size))
    model.config.quantization_config = config.to_dict()
    return names


def dequantize_model(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """Replace every AWQLinear of ``model`` by an ``nn.Linear`` holding its dequantized weight, in place."""
    for name, module in list(model.named_modules()):
        if isinstance(module, AWQLinear):
            dt = dtype or torch.float32
            linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                               device=module.weight_device, dtype=dt)  # fmt: skip
            with torch.no_grad():
                linear.weight.copy_(module.dequantized_weight(dt))
                if module.bias is not None:
                    linear.bias.copy_(module.bias)
            _set_submodule(model, name, linear)
    return model


def save_awq_folder(model: nn.Module, folder: str | os.PathLike[str], tokenizer: Any = None) -> Path:
    """Write ``model`` (with AWQLinear layers) as an AutoAWQ-format folder: config.json carrying
    ``quantization_config``, ``model.safetensors`` (tied tensors stored once), and the tokenizer files."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    qc = getattr(model.config, "quantization_config", None)
    if qc is None or awq_config_of(model.config) is None:
        raise ValueError("save_awq_folder: model.config.quantization_config is not an AWQ config")
    tensors, seen = {}, set()
    for name, t in model.state_dict().items():
        key = (t.data_ptr(), t.dtype, tuple(t.shape))
        if key in seen and t.numel():
            continue  # a tied tensor (lm_head = embeddings): stored once, re-tied at load
        seen.add(key)
        tensors[name] = t.detach().contiguous().cpu()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = awq_config_of(model.config).to_dict()
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True, default=str))
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(str(folder))
    return folder


def _read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"AWQ: no *.safetensors file in {folder}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def load_awq_model(
    folder: str | os.PathLike[str], config: Any, *, dtype: torch.dtype = torch.float32, device: Any = "cpu",
    attn_implementation: str | None = "sdpa",
) -> nn.Module:  # fmt: skip
    """Build ``config``'s causal LM with an :class:`AWQLinear` for every linear the checkpoint in ``folder``
    quantized (those with ``<name>.qweight``; ``modules_to_not_convert`` stay float) and load its tensors.

    The model is built on the meta device (no float copy of the quantized weights is ever allocated), then
    materialised from the checkpoint; rotary embeddings (derived, not stored) are rebuilt from the config.
    Float weights are cast to ``dtype``; int4 buffers and fp16 scales stay as stored.
    """
    import copy

    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    awq = awq_config_of(config)
    if awq is None:
        raise ValueError(f"AWQ: {folder}/config.json has no quantization_config with quant_method 'awq'")
    tensors = _read_checkpoint(folder)
    plain_config = copy.deepcopy(config)
    del plain_config.quantization_config
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(plain_config, dtype=dtype, **kwargs)
    quantized = sorted(n[: -len(".qweight")] for n in tensors if n.endswith(".qweight"))
    if not quantized:
        raise ValueError(f"AWQ: the checkpoint in {folder} holds no '*.qweight' tensor")
    for name in quantized:
        if awq.skips(name):
            raise ValueError(f"AWQ: {name} is quantized in the checkpoint but listed in modules_to_not_convert")
        linear = linear_named(model, name, f"AWQ: the checkpoint quantizes {name!r}")
        with torch.device("meta"):
            module = AWQLinear(linear.in_features, linear.out_features, linear.bias is not None,
                               group_size=awq.group_size)  # fmt: skip
        for part in AWQ_TENSORS:
            t = tensors.get(f"{name}.{part}")
            if t is None:
                raise ValueError(f"AWQ: the checkpoint has {name}.qweight but not {name}.{part}")
            want = getattr(module, part)
            if tuple(t.shape) != tuple(want.shape):
                raise ValueError(
                    f"AWQ: {name}.{part} has shape {tuple(t.shape)}, expected {tuple(want.shape)} for in={linear.in_features}, "
                    f"out={linear.out_features}, group_size={awq.group_size}"
                )
        _set_submodule(model, name, module)
    model.to_empty(device="cpu")
    expected = model.state_dict()
    tied = {k for k in expected if k not in tensors and _is_tied(model, k)}
    missing = [k for k in expected if k not in tensors and k not in tied]
    unexpected = [k for k in tensors if k not in expected]
    if missing or unexpected:
        raise ValueError(
            f"AWQ: checkpoint {folder} does not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}"
        )
    with torch.no_grad():
        for k, t in tensors.items():
            target = expected[k]
            target.copy_(t if not target.is_floating_point() or target.dtype == t.dtype else t.to(target.dtype))
    _rebuild_rotary(model)
    if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "tie_weights"):
        model.tie_weights()
    model.config.quantization_config = awq.to_dict()
    return model.to(device).eval()


def _is_tied(model: nn.Module, key: str) -> bool:
    return key.endswith("lm_head.weight") and bool(getattr(model.config, "tie_word_embeddings", False))


def _rebuild_rotary(model: nn.Module) -> None:
    """Rotary embeddings hold derived, non-persistent buffers (``inv_freq``): rebuild them on CPU from the config.
    Any other non-persistent buffer would be left uninitialised by the meta-device build: refused."""
    for name, module in list(model.named_modules()):
        if type(module).__name__.endswith("RotaryEmbedding") and hasattr(module, "inv_freq"):
            cfg = getattr(module, "config", None) or model.config
            with torch.device("cpu"):
                _set_submodule(model, name, type(module)(config=cfg))
    for name, module in model.named_modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            continue
        derived = [b for b in module._non_persistent_buffers_set if getattr(module, b, None) is not None]
        if derived:
            raise NotImplementedError(
                f"AWQ loading: {name or type(model).__name__} has derived buffers {derived} that kvboost cannot "
                "rebuild after a meta-device build"
            )


def is_awq_model(model: nn.Module) -> bool:
    return any(isinstance(m, AWQLinear) for m in model.modules())
