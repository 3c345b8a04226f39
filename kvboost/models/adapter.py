"""Model adapter: the few model-specific operations the engine needs, behind one small interface.

- shapes of the KV cache (layers, KV heads, head dim) and the context limit;
- a forward over new tokens with an existing ``DynamicCache`` as past;
- preallocated KV buffers ``[layers, kv_heads, tokens, head_dim]`` (the layout the KV store keeps), reused
  between requests up to a byte cap;
- the model fingerprint that goes into every cache key (DESIGN.md invariant 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvboost.models.fingerprint import ModelFingerprint
from kvboost.models.prealloc_cache import PreallocatedKV, allocate_kv

#: The fewest rows a new CPU KV buffer gets (see :meth:`ModelAdapter.allocate`).
MIN_KV_ROWS = 256


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
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None

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

    # ------------------------------------------------------------------ forward
    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, cache: DynamicCache, logits_to_keep: int = 1) -> torch.Tensor:
        """Run ``input_ids`` ([1, n] or [n]) after the tokens already in ``cache``; returns the last logits.

        ``logits_to_keep=1`` skips the LM head on all but the last position (what HF generate does on a
        prefill too), so baseline and reuse paths pay the same head cost.
        """
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        out = self.model(
            input_ids=input_ids.to(self.device), past_key_values=cache, use_cache=True, logits_to_keep=logits_to_keep
        )
        return out.logits[0, -logits_to_keep:].float()

    # ------------------------------------------------------------------ cache conversion
    @staticmethod
    def new_cache() -> DynamicCache:
        """An empty cache of full (non-sliding) layers: every token's KV is kept so it can be stored."""
        return DynamicCache()

    def allocate(self, capacity: int, *, keep_bytes: int | None = None, exact: bool = False) -> PreallocatedKV:
        """An empty preallocated KV of at least ``capacity`` rows for one request.

        The buffers are recycled from the previous call (one slot): the engine stores copies of what it
        keeps, so a request's KV is dead once ``generate`` returns. Hence one engine serves one request
        at a time (not thread-safe). Buffers larger than ``keep_bytes`` are not kept for the next request
        (one very long request must not pin its memory for the rest of the process).

        On CPU a new buffer gets the next power of two of rows (at least :data:`MIN_KV_ROWS`) when that size is
        still kept: a chat grows turn by turn, and a buffer that must grow is fresh memory whose pages fault in
        on first touch (copying 1,256 fp32 rows of SmolLM2: 13-14 ms into a fresh buffer, 5 ms into a reused one,
        2 threads). Doubling bounds those allocations to a few per process. ``exact=True``: exactly ``capacity``
        rows when a new buffer is needed.
        """
        s = self.kv_shape
        rows = capacity
        if not exact and self.device.type == "cpu":
            rounded = max(MIN_KV_ROWS, 1 << (max(capacity, 1) - 1).bit_length())
            row_bytes = (
                2 * s.num_layers * s.num_kv_heads * s.head_dim * torch.empty((), dtype=self.dtype).element_size()
            )
            rows = rounded if keep_bytes is None or rounded * row_bytes <= keep_bytes else capacity
        kv = allocate_kv(
            s.num_layers, s.num_kv_heads, s.head_dim, capacity,
            dtype=self.dtype, device=self.device, buffers=self._buffers, new_capacity=rows,
        )  # fmt: skip
        nbytes = 2 * kv.keys.numel() * kv.keys.element_size()
        self._buffers = (kv.keys, kv.values) if keep_bytes is None or nbytes <= keep_bytes else None
        return kv

    def release_buffers(self) -> None:
        """Drop the recycled buffers."""
        self._buffers = None

    @staticmethod
    def cache_length(cache: DynamicCache) -> int:
        return cache.get_seq_length() if len(cache.layers) else 0

    @staticmethod
    def truncated(cache: DynamicCache, length: int) -> DynamicCache:
        """A new cache viewing the first ``length`` tokens of ``cache`` (no copy)."""
        out = DynamicCache()
        for src in cache.layers:
            layer = DynamicLayer()
            layer.dtype, layer.device = src.keys.dtype, src.keys.device
            layer.keys = src.keys[:, :, :length]
            layer.values = src.values[:, :, :length]
            layer.is_initialized = True
            out.layers.append(layer)
        return out
