"""An 8-bit output projection (LM head): weight-only int8, one scale per output row.

On a small model the LM head is a large share of the bytes a decode step reads: SmolLM2-135M's tied
``[49152, 576]`` head is 56.6 MB in bf16 against 53 MB for all 30 of its AWQ int4 decoder layers, and a decode
step on a CPU is bound by reading weights. llama.cpp's GGUF files keep that tensor in 8 bits (the bundled
``SmolLM2-135M-Instruct.Q4_1.gguf`` stores ``token_embd.weight`` as Q8_0, which its output reuses). This module
does the same for kvboost, as an explicit choice (``lm_head="int8"``, config ``model.lm_head: int8``); the default
keeps the head in the model's dtype.

Only the head is replaced: the embedding table (tied to it in many models) keeps its float weights, so the
prompt's K/V, and every cache key, are unchanged; only the logits move (by the rounding of the weights:
symmetric per-row absmax, error at most half a step of ``max|w_row| / 127``).

CPU: ``aten._weight_int8pack_mm`` (torch's weight-only int8 kernel; activations and scales in the same dtype).
Elsewhere: the weight is dequantized per call into the input's dtype and multiplied with ``F.linear``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

LM_HEAD_CHOICES = (None, "int8")


def int8pack_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``x [..., in]`` times int8 codes ``[out, in]`` with per-row ``scales`` (in ``x``'s dtype) -> ``[..., out]``:
    torch's weight-only int8 CPU kernel, the call :class:`Int8Linear` and the fused decode step both make."""
    out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]).contiguous(), qweight, scales)
    return out.reshape(*x.shape[:-1], qweight.shape[0])


class Int8Linear(nn.Module):
    """``y = x (q * s)^T`` with int8 codes ``q`` ``[out, in]`` and per-row scales ``s`` ``[out]`` (fp32 buffers;
    the kernel receives them in the input's dtype). No bias (LM heads have none)."""

    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
        self.register_buffer("scales", torch.ones(out_features, dtype=torch.float32, device=device))
        self._scales_cast: tuple[torch.dtype, torch.Tensor] | None = None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Quantize ``linear`` (symmetric, per output row, round to nearest)."""
        if linear.bias is not None:
            raise ValueError("Int8Linear quantizes bias-free projections (an LM head); this linear has a bias")
        w = linear.weight.detach().to(torch.float32)
        module = cls(linear.in_features, linear.out_features, device=w.device)
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
        module.qweight.copy_(torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        module.scales.copy_(scales)
        return module

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[out, in]`` these codes represent."""
        return (self.qweight.to(torch.float32) * self.scales[:, None]).to(dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per-row scales"

    def kernel_scales(self, dtype: torch.dtype) -> torch.Tensor:
        """The scales in ``dtype`` (the CPU kernel wants them in the activations' dtype), cast once per dtype."""
        if self._scales_cast is None or self._scales_cast[0] != dtype:
            self._scales_cast = (dtype, self.scales.to(dtype))
        return self._scales_cast[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return int8pack_mm(x, self.qweight, self.kernel_scales(x.dtype))
        return F.linear(x, self.dequantized_weight(x.dtype))

    def _apply(self, fn, recurse=True):
        """``.to(dtype)`` keeps the int8 codes and fp32 scales as they are (a cast would destroy the codes);
        ``.to(device)`` moves them."""
        self._scales_cast = None
        kept = {"qweight": self.qweight, "scales": self.scales}
        super()._apply(fn, recurse)
        for name, t in kept.items():
            if getattr(self, name).dtype != t.dtype:
                setattr(self, name, t.to(getattr(self, name).device))
        return self


def quantize_lm_head(model: Any, kind: str | None) -> Any:
    """Replace ``model.lm_head`` per ``kind`` (``None``: leave it; ``"int8"``: :class:`Int8Linear`). Returns the
    model. A tied embedding keeps its float weights (only the output projection is quantized)."""
    if kind is None or kind == "none":
        return model
    if kind not in LM_HEAD_CHOICES:
        raise ValueError(f"lm_head must be one of {[c for c in LM_HEAD_CHOICES if c]} or null, got {kind!r}")
    head = getattr(model, "lm_head", None)
    if isinstance(head, Int8Linear):
        return model
    if not isinstance(head, nn.Linear):
        raise TypeError(f"lm_head={kind!r}: the model's output projection is a {type(head).__name__}, not an nn.Linear")
    model.lm_head = Int8Linear.from_linear(head)
    # Recorded for whoever describes the model (summary.json, fingerprints of outputs): the head is not the
    # checkpoint's.
    model._kvboost_lm_head = kind
    return model
