"""No quantization: the chunk's KV is stored as computed."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvboost.quant.base import KVQuantizer
from kvboost.registry import KV_QUANT


@dataclass
class RawKV:
    """Full-precision stacked keys and values ``[layers, kv_heads, tokens, head_dim]``."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[2]


@KV_QUANT.register("none")
class NoQuantizer(KVQuantizer):
    """Identity quantizer (lossless)."""

    lossless = True

    def quantize(self, keys: torch.Tensor, values: torch.Tensor) -> RawKV:
        return RawKV(keys, values)

    def dequantize(self, payload: RawKV) -> tuple[torch.Tensor, torch.Tensor]:
        return payload.keys, payload.values
