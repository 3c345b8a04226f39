"""``sdpa``: transformers' own SDPA attention (torch ``scaled_dot_product_attention``), counted.

The reference backend: every other backend is tested against it. Installing it (rather than leaving the
model on plain ``attn_implementation="sdpa"``) only adds the call counter.
"""

from __future__ import annotations

from typing import Any

import torch

from kvboost.attention.base import AttentionBackend
from kvboost.registry import ATTENTION


@ATTENTION.register("sdpa")
class SdpaBackend(AttentionBackend):
    """Delegates to ``transformers.integrations.sdpa_attention.sdpa_attention_forward``."""

    name = "sdpa"
    mask_kind = "sdpa"

    def check_available(self) -> None:
        """SDPA ships with torch >= 2.0; always available."""
        if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
            raise RuntimeError("attention backend 'sdpa' needs torch >= 2.0 (scaled_dot_product_attention)")

    def attention_forward(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        out = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
        self.kernel_calls += 1
        return out
