"""KIVI KV quantization (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache", ICML 2024).

Registered as ``kivi8``, ``kivi4`` and ``kivi2`` (``quant=kivi4``).  Keys are quantized per channel (one
scale/zero per channel per group of ``group_size`` tokens), values per token (one scale/zero per token per group of
``group_size`` channels), asymmetric min-max, codes bit-packed (four int2 or two int4 per byte; int8 one per
byte).  Layout, arithmetic and error bound: ``kvboost/kernels_triton/kivi_reference.py``; kernels:
``kvboost/kernels_triton/kivi.py``.

Settings (``kvboost/configs/quant/kivi{8,4,2}.yaml``):

* ``bits``: fixed by the name (8, 4, 2); given explicitly it must agree with the name.
* ``group_size``: a positive multiple of the codes per byte.  Default 32 (the paper's) for kivi8 and kivi2, 64
  for kivi4: with fp16 scale and zero, group 32 costs one bit per element on top of 4-bit codes (3.2x smaller
  than fp16, below the 3.5x a 4-bit cache should give), group 64 half a bit (3.56x); perplexity figures for
  both are in experiments/results/kv_quant.  Chunks whose token count (keys) or head dim (values) is not a
  multiple of it end in a partial group with its own min/max.
* ``residual`` (default 0): KIVI keeps the most recent ``R`` tokens of a *growing* cache in full precision, and
  quantizes a group of keys only once it is complete.  kvboost stores a chunk once, when it is complete, so the
  streaming window has no direct counterpart; here ``residual`` is the number of **tokens at the tail of every
  stored chunk kept in full precision** (the model's dtype).  With chunks in prompt order those are the tokens
  nearest to what follows them, the part KIVI's window protects.  ``residual >= chunk length`` stores the
  chunk unquantized.  0 quantizes every token (the smallest payload).
* ``scale_dtype`` (default ``float16``, as KIVI's fp16 models store them; or ``bfloat16`` for a wider range):
  storage dtype of scales and zero points, accounted for in ``nbytes``.  Quantizing a chunk whose values exceed
  float16's range under ``float16`` raises (the stored grid would be infinite): use ``bfloat16``.
* ``kernel``: ``auto`` (Triton kernels for CUDA tensors, the torch reference for CPU tensors -- the Triton
  interpreter is far too slow for real runs), ``triton`` (always: on CPU only under ``TRITON_INTERPRET=1``) or
  ``torch``.  The two paths give the same bits (tested), so the kernel is not part of the fingerprint.

Size of a chunk of ``T`` quantized tokens, ``R`` residual tokens, per (layer, kv head), head dim ``D``, group
``G``, ``s`` bytes per scale (2), ``e`` bytes per model element::

    2 * T * ceil(D / (8 / bits))                  packed codes (keys + values)
    + 2 * s * ceil(T / G) * D                     key scales + zeros
    + 2 * s * T * ceil(D / G)                     value scales + zeros
    + 2 * R * D * e                               residual keys + values

e.g. kivi4, G = 32, 64 tokens, D = 64: 4096 + 512 + 512 = 5120 bytes vs 16384 in fp16 (3.2x smaller) and 32768
in fp32 (6.4x); the scales cost one bit per element at G = 32 (4.5 bits per element at G = 64: 3.56x vs fp16).

``dequantize_into(payload, keys_out, values_out)`` writes the first ``keys_out.shape[2]`` tokens straight into
given tensors (e.g. rows of the request's preallocated cache), without a full-size temporary on the Triton path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvboost.kernels_triton import kivi_reference as ref
from kvboost.quant.base import KVQuantizer
from kvboost.registry import KV_QUANT

KERNELS = ("auto", "triton", "torch")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}


@dataclass
class KiviPayload:
    """One chunk's KIVI-quantized keys and values (stacked ``[L, H, T, D]``; layout in kivi_reference.py).

    ``T = k_packed.shape[2]`` quantized tokens followed by ``R = k_residual.shape[2]`` full-precision ones.  A
    dataclass of tensors and JSON fields: the disk tier's record format stores it as is (``payload_type
    "kivi"``).
    """

    k_packed: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_packed: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    k_residual: torch.Tensor
    v_residual: torch.Tensor
    bits: int
    group_size: int
    head_dim: int
    dtype: str  # the model's dtype: what dequantize returns

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.k_packed, self.k_scale, self.k_zero, self.v_packed, self.v_scale, self.v_zero,
                self.k_residual, self.v_residual)  # fmt: skip

    @property
    def nbytes(self) -> int:
        """True footprint: packed codes + scales + zeros + residual tokens."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def num_tokens(self) -> int:
        return self.k_packed.shape[2] + self.k_residual.shape[2]

    @property
    def quantized_tokens(self) -> int:
        return self.k_packed.shape[2]

    @property
    def device(self) -> torch.device:
        return self.k_packed.device

    def to(self, device: torch.device | str) -> KiviPayload:
        moved = [t.to(device) for t in self.tensors]
        return KiviPayload(*moved, bits=self.bits, group_size=self.group_size, head_dim=self.head_dim, dtype=self.dtype)


def _register_payload() -> None:
    from kvboost.cache.payload import register_payload_type

    register_payload_type("kivi", KiviPayload)


_register_payload()


class KiviQuantizer(KVQuantizer):
    """KIVI quantizer; subclasses fix the bit width (``kivi8``, ``kivi4``, ``kivi2``).  Arguments: module docstring."""

    BITS = 4
    DEFAULT_GROUP_SIZE = 32
    lossless = False

    def __init__(
        self,
        bits: int | None = None,
        group_size: int | None = None,
        residual: int = 0,
        scale_dtype: str = "float16",
        kernel: str = "auto",
    ) -> None:
        name = getattr(self, "registry_name", f"kivi{self.BITS}")
        bits = self.BITS if bits is None else int(bits)
        if bits != self.BITS:
            raise ValueError(f"kv quant {name!r} stores {self.BITS}-bit codes, got bits={bits}; use quant=kivi{bits}")
        per = ref.per_byte(bits)
        group_size = self.DEFAULT_GROUP_SIZE if group_size is None else group_size
        if not isinstance(group_size, int) or group_size < 1 or group_size % per:
            raise ValueError(
                f"kv quant {name!r}: group_size must be a positive multiple of {per} (codes per byte), "
                f"got {group_size!r}"
            )
        if not isinstance(residual, int) or residual < 0:
            raise ValueError(
                f"kv quant {name!r}: residual must be an int >= 0 (tokens kept in full precision), got {residual!r}"
            )
        if scale_dtype not in ref.SCALE_DTYPES:
            raise ValueError(
                f"kv quant {name!r}: scale_dtype must be one of {sorted(ref.SCALE_DTYPES)}, got {scale_dtype!r}"
            )
        if kernel not in KERNELS:
            raise ValueError(f"kv quant {name!r}: kernel must be one of {KERNELS}, got {kernel!r}")
        self.bits, self.group_size, self.residual = bits, group_size, residual
        self.scale_dtype_name, self.scale_dtype = scale_dtype, ref.SCALE_DTYPES[scale_dtype]
        self.kernel = kernel

    # ------------------------------------------------------------------ settings
    def fingerprint(self) -> str:
        # ``kernel`` is left out on purpose: the Triton and torch paths store the same bits (tests/test_kivi.py).
        return f"kivi:b{self.bits}:g{self.group_size}:r{self.residual}:s{self.scale_dtype_name}:v1"

    def settings(self) -> dict[str, object]:
        return {"bits": self.bits, "group_size": self.group_size, "residual": self.residual,
                "scale_dtype": self.scale_dtype_name, "kernel": self.kernel}  # fmt: skip

    def _use_triton(self, device: torch.device) -> bool:
        if self.kernel == "torch":
            return False
        if self.kernel == "auto":
            return device.type == "cuda"
        from kvboost.kernels_triton.kivi import is_interpreter

        if device.type != "cuda" and not is_interpreter():
            raise RuntimeError(
                f"kv quant {self.registry_name!r}: kernel='triton' on {device} tensors needs TRITON_INTERPRET=1 "
                "set before triton is imported (or use kernel='auto' / 'torch')"
            )
        return True

    # ------------------------------------------------------------------ quantize
    def quantize(self, keys: torch.Tensor, values: torch.Tensor) -> KiviPayload:
        if keys.dim() != 4 or keys.shape != values.shape:
            raise ValueError(
                f"KIVI quantizes stacked keys/values [layers, kv_heads, tokens, head_dim] of one shape, got "
                f"{tuple(keys.shape)} and {tuple(values.shape)}"
            )
        if keys.dtype not in _DTYPE_NAMES:
            raise TypeError(f"KIVI cannot quantize KV of dtype {keys.dtype}")
        t = keys.shape[2]
        tq = max(0, t - self.residual)
        kq, vq = keys[:, :, :tq], values[:, :, :tq]
        if self._use_triton(keys.device):
            from kvboost.kernels_triton.kivi import kivi_quantize_keys, kivi_quantize_values

            k_parts = kivi_quantize_keys(kq, self.bits, self.group_size, self.scale_dtype)
            v_parts = kivi_quantize_values(vq, self.bits, self.group_size, self.scale_dtype)
        else:
            k_parts = ref.quantize_keys_reference(kq, self.bits, self.group_size, self.scale_dtype)
            v_parts = ref.quantize_values_reference(vq, self.bits, self.group_size, self.scale_dtype)
        grids = (k_parts[1], k_parts[2], v_parts[1], v_parts[2])
        if not all(bool(torch.isfinite(g).all()) for g in grids if g.numel()):
            raise ValueError(
                f"kv quant {self.registry_name!r}: a KV value is not finite or beyond {self.scale_dtype_name}'s range "
                "(scale or zero point overflowed); use scale_dtype=bfloat16"
            )
        # clone: the residual rows must not keep the caller's whole chunk tensor alive
        return KiviPayload(
            *k_parts, *v_parts,
            k_residual=keys[:, :, tq:].clone(), v_residual=values[:, :, tq:].clone(),
            bits=self.bits, group_size=self.group_size, head_dim=keys.shape[3], dtype=_DTYPE_NAMES[keys.dtype],
        )  # fmt: skip

    # ------------------------------------------------------------------ dequantize
    def dequantize(self, payload: KiviPayload) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*payload.k_packed.shape[:2], payload.num_tokens, payload.head_dim)
        dtype = _DTYPES[payload.dtype]
        keys = torch.empty(shape, dtype=dtype, device=payload.device)
        values = torch.empty(shape, dtype=dtype, device=payload.device)
        self.dequantize_into(payload, keys, values)
        return keys, values

    def dequantize_into(self, payload: KiviPayload, keys_out: torch.Tensor, values_out: torch.Tensor) -> None:
        """Write the payload's first ``keys_out.shape[2]`` tokens into ``keys_out``/``values_out``
        (``[L, H, t, D]``, any strides and float dtype: e.g. ``kv.keys[:, :, start:start + t]`` of the request's
        preallocated cache).  A payload on another device is moved to the output's device first (it is the
        small, packed form)."""
        t = keys_out.shape[2]
        if values_out.shape != keys_out.shape or t > payload.num_tokens:
            raise ValueError(
                f"dequantize_into: outputs {tuple(keys_out.shape)} / {tuple(values_out.shape)} for a payload of "
                f"{payload.num_tokens} tokens"
            )
        if payload.device != keys_out.device:
            payload = payload.to(keys_out.device)
        tq = min(t, payload.quantized_tokens)
        args = {"bits": payload.bits, "group_size": payload.group_size, "head_dim": payload.head_dim}
        kq, vq = keys_out[:, :, :tq], values_out[:, :, :tq]
        if self._use_triton(keys_out.device):
            from kvboost.kernels_triton.kivi import kivi_dequantize_keys, kivi_dequantize_values

            kivi_dequantize_keys(payload.k_packed, payload.k_scale, payload.k_zero, out=kq, **args)
            kivi_dequantize_values(payload.v_packed, payload.v_scale, payload.v_zero, out=vq, **args)
        else:
            ref.dequantize_keys_reference(payload.k_packed, payload.k_scale, payload.k_zero, out=kq, **args)
            ref.dequantize_values_reference(payload.v_packed, payload.v_scale, payload.v_zero, out=vq, **args)
        if t > tq:
            keys_out[:, :, tq:].copy_(payload.k_residual[:, :, : t - tq])
            values_out[:, :, tq:].copy_(payload.v_residual[:, :, : t - tq])

    # ------------------------------------------------------------------ error bound
    def error_bound(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Half a step of each element's group plus the storage rounding of scale/zero and the float32 /
        output-dtype rounding (``kivi_reference.kivi_error_bound``); 0 on the residual tokens."""
        tq = max(0, keys.shape[2] - self.residual)
        bounds = []
        for x, per_channel in ((keys, True), (values, False)):
            b = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
            if tq:
                b[:, :, :tq] = ref.kivi_error_bound(
                    x[:, :, :tq], bits=self.bits, group_size=self.group_size, per_channel=per_channel,
                    scale_dtype=self.scale_dtype, out_dtype=x.dtype,
                )  # fmt: skip
            bounds.append(b)
        return bounds[0], bounds[1]


@KV_QUANT.register("kivi8")
class Kivi8Quantizer(KiviQuantizer):
    """KIVI with int8 codes (one per byte)."""

    BITS = 8


@KV_QUANT.register("kivi4")
class Kivi4Quantizer(KiviQuantizer):
    """KIVI with int4 codes (two per byte), groups of 64 by default (3.56x smaller than fp16; module docstring)."""

    BITS = 4
    DEFAULT_GROUP_SIZE = 64


@KV_QUANT.register("kivi2")
class Kivi2Quantizer(KiviQuantizer):
    """KIVI with int2 codes (four per byte)."""

    BITS = 2
