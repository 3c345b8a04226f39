"""Model adapter: the few model-specific operations the engine needs, behind one small interface.

- shapes of the KV cache (layers, KV heads, head dim) and the context limit;
- a forward over new tokens with an existing ``DynamicCache`` as past;
- conversion between a ``DynamicCache`` and stacked tensors ``[layers, kv_heads, tokens, head_dim]``
  (the layout the KV store keeps: one slice/concatenation for all layers at once);
- the model fingerprint that goes into every cache key (DESIGN.md invariant 3).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvboost.models.prealloc_cache import preallocated_cache


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
        self._fingerprint: str | None = None
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
        """Model identity: path, config, dtype, weight quantization and a sample of the weights.

        Two different checkpoints of the same architecture (fine-tunes) differ in their weights, so a
        digest of a few parameter tensors is included, not only the config.
        """
        if self._fingerprint is None:
            h = hashlib.sha256()
            h.update(self.identity.encode())
            cfg = self.model.config.to_dict()
            cfg.pop("_name_or_path", None)
            cfg.pop("transformers_version", None)
            h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
            h.update(str(self.dtype).encode())
            h.update(json.dumps(getattr(self.model.config, "quantization_config", None), sort_keys=True, default=str).encode())
            with torch.no_grad():
                params = list(self.model.parameters())
                for p in (params[0], params[len(params) // 2], params[-1]):
                    sample = p.detach().reshape(-1)[:4096].float().cpu().contiguous()
                    h.update(sample.numpy().tobytes())
            self._fingerprint = h.hexdigest()[:32]
        return self._fingerprint

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

    def cache_for(self, segments: list[tuple[torch.Tensor, torch.Tensor]], capacity: int) -> DynamicCache:
        """A preallocated cache of ``capacity`` tokens holding ``segments`` (stacked [L, H, t, D] each) first.

        The buffers are recycled from the previous call (one slot): the engine stores copies of what it
        keeps, so a request's cache is dead once ``generate`` returns. Hence one engine serves one request
        at a time (not thread-safe).
        """
        s = self.kv_shape
        cache, kbuf, vbuf = preallocated_cache(
            s.num_layers, s.num_kv_heads, s.head_dim, capacity,
            dtype=self.dtype, device=self.device, prefix_segments=segments, buffers=self._buffers,
        )  # fmt: skip
        self._buffers = (kbuf, vbuf)
        return cache

    def cache_from_stacked(self, keys: torch.Tensor, values: torch.Tensor) -> DynamicCache:
        """A DynamicCache holding ``keys``/``values`` of shape [layers, kv_heads, tokens, head_dim] (batch 1).

        The layers are given views of the stacked tensors, not copies: the first forward concatenates
        new tokens onto them (a copy HF makes anyway), so assembly costs one concatenation in total.
        """
        cache = DynamicCache()
        for layer_idx in range(keys.shape[0]):
            layer = DynamicLayer()
            layer.dtype, layer.device = keys.dtype, keys.device
            layer.keys = keys[layer_idx].unsqueeze(0)
            layer.values = values[layer_idx].unsqueeze(0)
            layer.is_initialized = True
            cache.layers.append(layer)
        return cache

    @staticmethod
    def cache_length(cache: DynamicCache) -> int:
        return cache.get_seq_length() if len(cache.layers) else 0

    @staticmethod
    def stacked_slice(cache: DynamicCache, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of tokens [start, end) of every layer, stacked: two [layers, kv_heads, n, head_dim] tensors."""
        keys = torch.stack([layer.keys[0, :, start:end] for layer in cache.layers])
        values = torch.stack([layer.values[0, :, start:end] for layer in cache.layers])
        return keys, values

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
