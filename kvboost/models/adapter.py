"""Model adapter: what the engine needs to know about a model, behind one small interface.

- shapes of the KV cache (layers, KV heads, head dim), its dtype and device, and the context limit;
- the model fingerprint that goes into every cache key (DESIGN.md invariant 3).

Forwards are the runners' (``kvboost.runtime``); KV memory is the pool's (``kvboost.kv``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvboost.models.fingerprint import ModelFingerprint


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int


class ModelAdapter:
    """Wraps a HuggingFace causal LM for the engine.

    Args:
        model: a loaded ``*ForCausalLM`` (eval mode).
        identity: a string naming the weights (path or hub id); part of the fingerprint.
    """

    def __init__(self, model: Any, identity: str) -> None:
        self.model = model
        self.identity = identity
        cfg = model.config.get_text_config(decoder=True)
        self.config = cfg
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.kv_shape = KVShape(cfg.num_hidden_layers, kv_heads, head_dim)
        self.max_positions = int(getattr(cfg, "max_position_embeddings", 0) or 0) or None
        self._fingerprint = ModelFingerprint(model, identity)

    # ------------------------------------------------------------------ properties
    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def num_layers(self) -> int:
        return self.kv_shape.num_layers

    def kv_bytes_per_token(self) -> int:
        s = self.kv_shape
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * torch.finfo(self.dtype).bits // 8

    # ------------------------------------------------------------------ fingerprint
    def fingerprint(self) -> str:
        """The model's fingerprint as it is now: identity, config, dtype, library versions and a digest of all
        weights (:class:`kvboost.models.fingerprint.ModelFingerprint`). Re-checked cheaply on every call, so a
        ``model.to(...)``, an in-place weight edit or a merged adapter changes it."""
        return self._fingerprint.current()

    def invalidate_fingerprint(self) -> None:
        """Forget the cached fingerprint after an edit the parameter signature cannot see (``param.data``
        writes, config edits)."""
        self._fingerprint.invalidate()
