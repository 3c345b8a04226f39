"""KV quantization under the original KVBoost API's names (``kvboost.kv_quantize``), over kvboost's KIVI quantizers.

    from kvboost.kv_quantize import quantize_kv, dequantize_kv
    qkv = quantize_kv(past_key_values, bits=8)        # KIVI int8: keys per channel, values per token, asymmetric
    past_key_values = dequantize_kv(qkv)              # same shapes, the input's dtype
    print(qkv.memory_bytes())

``past_key_values`` is HF's legacy form (per layer ``(keys, values)`` of shape ``[batch, kv_heads, seq, head_dim]``)
or an HF ``Cache`` (``DynamicCache``). ``bits``: 8 / 4 / 2 run the ``kivi8`` / ``kivi4`` / ``kivi2`` plugins
(:mod:`kvboost.quant.kivi`, ``kvboost/configs/quant/kivi*.yaml``: the same code the engine's ``quant=kivi8`` stores chunks
with; group size and error bound documented there); 16 stores the tensors as they are (``quant=none``).

Differences from the original: quantization is asymmetric min-max with a zero point per group (the original was
symmetric absmax), keys are grouped per channel over ``group_size`` tokens as KIVI does, and ``dequantize_kv``
returns the input's dtype (the original returned float16).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# ``bits`` -> the KV quantizer plugin (``kvboost/configs/quant``): the one table the constructor's kv_cache_bits uses too.
from kvboost.original_api import KV_CACHE_BITS as BITS_TO_PLUGIN


@dataclass
class QuantizedKV:
    """A quantized KV cache: one payload per batch row (the plugin's, all layers stacked), ``bits`` and the dtype
    :func:`dequantize_kv` returns."""

    payloads: list[Any]
    bits: int
    original_dtype: torch.dtype
    quantizer: Any

    def memory_bytes(self) -> int:
        """Bytes the quantized cache holds (codes, scales, zero points, full-precision residual tokens)."""
        return sum(int(p.nbytes) for p in self.payloads)


def _layers(kv: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer ``(keys, values)`` of a legacy tuple or an HF ``Cache``."""
    if hasattr(kv, "layers") and not isinstance(kv, (tuple, list)):  # transformers >= 4.56 Cache objects
        return [(layer.keys, layer.values) for layer in kv.layers]
    if hasattr(kv, "to_legacy_cache"):
        kv = kv.to_legacy_cache()
    return [(k, v) for k, v in kv]


def quantize_kv(kv: Any, bits: int = 8, *, group_size: int | None = None, residual: int = 0) -> QuantizedKV:
    """Quantize ``kv`` (HF ``past_key_values``: per layer ``(keys, values)`` ``[batch, kv_heads, seq, head_dim]``,
    or an HF ``Cache``) with KIVI at ``bits`` (8, 4, 2; 16: no quantization). ``group_size`` and ``residual`` are the
    quantizer's (default: the plugin's, see ``kvboost/configs/quant``)."""
    from kvboost.registry import KV_QUANT

    if isinstance(bits, bool) or bits not in BITS_TO_PLUGIN:
        raise ValueError(f"unsupported bits={bits!r}; use one of {sorted(BITS_TO_PLUGIN, reverse=True)}")
    spec: dict[str, Any] = {"name": BITS_TO_PLUGIN[bits]}
    if bits != 16:
        spec.update({"residual": residual} | ({"group_size": group_size} if group_size is not None else {}))
    quantizer = KV_QUANT.build(spec)
    layers = _layers(kv)
    if not layers:
        raise ValueError("quantize_kv: the KV cache has no layers")
    keys = torch.stack([k for k, _ in layers], dim=1)  # [batch, layers, kv_heads, seq, head_dim]
    values = torch.stack([v for _, v in layers], dim=1)
    payloads = [quantizer.quantize(keys[b].contiguous(), values[b].contiguous()) for b in range(keys.shape[0])]
    return QuantizedKV(payloads, bits, keys.dtype, quantizer)


def dequantize_kv(qkv: QuantizedKV) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """HF legacy ``past_key_values`` (per layer ``(keys, values)`` ``[batch, kv_heads, seq, head_dim]``) of a
    :class:`QuantizedKV`, in the dtype it was quantized from."""
    rows = [qkv.quantizer.dequantize(p) for p in qkv.payloads]
    keys = torch.stack([k for k, _ in rows]).to(qkv.original_dtype)
    values = torch.stack([v for _, v in rows]).to(qkv.original_dtype)
    return tuple((keys[:, layer], values[:, layer]) for layer in range(keys.shape[1]))


__all__ = ["BITS_TO_PLUGIN", "QuantizedKV", "dequantize_kv", "quantize_kv"]
