"""``eager``: transformers' eager attention (explicit matmul + softmax), counted.

The only backend that returns attention weights. transformers defines ``eager_attention_forward`` once per
model file (they are copies of one another); the calling layer's own module's copy is used, so a model whose
eager path differs (e.g. attention sinks, soft-capping) keeps its own behaviour.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from kvboost.attention.base import AttentionBackend, Capabilities
from kvboost.registry import ATTENTION


def _eager_fn_for(module: torch.nn.Module) -> Callable[..., Any]:
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as fn
    return fn


@ATTENTION.register("eager")
class EagerBackend(AttentionBackend):
    """Delegates to the calling model's ``eager_attention_forward``; the mask is transformers' additive one."""

    name = "eager"
    mask_kind = "eager"
    capabilities = Capabilities(exact=True)

    def __init__(self) -> None:
        super().__init__()
        self._fn_cache: dict[type, Callable[..., Any]] = {}

    def check_available(self) -> None:
        """Plain torch ops; always available."""

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
        fn = self._fn_cache.get(type(module))
        if fn is None:
            fn = self._fn_cache[type(module)] = _eager_fn_for(module)
        if scaling is None:
            scaling = query.shape[-1] ** -0.5
        out = fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
        self.kernel_calls += 1
        return out
