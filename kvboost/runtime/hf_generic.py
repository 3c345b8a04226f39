"""The runner of every other supported architecture: HF's own modeling code over the KV pool.

For families :class:`~kvboost.runtime.llama.LlamaRunner` does not cover (Phi-3, Gemma, Qwen3, OLMo... and models
with forward hooks, such as a layer streamer's), the model's modules compute and the pool holds the K/V:

- a :class:`PoolCache` (a transformers ``Cache`` whose layers write each new row into the sequence's blocks and
  hand the layer its rows ``[0, kv_len)``: a view when the blocks are consecutive, else a gather) is passed to HF's
  forward, so attention runs through kvboost's backend via transformers' ``AttentionInterface``;
- rows at arbitrary positions (content repair), hooks and probes drive the model's parts layer by layer (embeddings,
  rotary embedding, each decoder layer, final norm, LM head) with the backend's selected-query inputs, as
  layer-wise execution needs: query ``i`` attends keys ``j <= position(i)``, never a bottom-right aligned mask
  (LMCache#1152).

Sequences of a batch run one after the other (HF's batched forward would pad them); decoder layers must take
``position_embeddings`` (transformers 5's layers do). Sliding-window layers are served while a prompt fits the
window.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvboost.runtime.batch import ForwardBatch, hook_after_layer


class HFGenericUnsupportedError(RuntimeError):
    """The model cannot be run layer by layer over the pool (content reuse needs it); the message says why."""


def cache_kwarg(fn: Any) -> str:
    """The name a transformers forward takes its cache under: ``cache`` (transformers >= 5.24) or
    ``past_key_values`` (earlier 5.x, where the new name does not exist yet)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out: Any) -> Any:
    """The cache a transformers forward returned: ``out.cache`` (transformers >= 5.24, where reading
    ``out.past_key_values`` warns that the name goes away) or ``out.past_key_values`` (earlier 5.x)."""
    cache = out.get("cache") if hasattr(out, "get") else getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


class PoolLayer(DynamicLayer):
    """One layer of a :class:`PoolCache`: ``update`` writes the new rows into the sequence's slots and returns its
    rows ``[0, kv_len)`` of this layer, ``[1, Hkv, kv_len, D]``."""

    def __init__(self, batch: ForwardBatch, b: int, layer_idx: int, past: int) -> None:
        super().__init__()
        self.batch, self.b, self.layer_idx, self.past = batch, b, layer_idx, past
        self.is_initialized = True
        pool = batch.pool
        self.dtype, self.device = pool.dtype, pool.device
        self.keys = self.values = None

    def get_seq_length(self) -> int:
        return self.past

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        batch, pool, i = self.batch, self.batch.pool, self.layer_idx
        slots = batch.slot_mapping[batch.rows_of(self.b)]
        pool.keys[i].index_copy_(1, slots, key_states[0])
        pool.values[i].index_copy_(1, slots, value_states[0])
        self.keys, self.values = batch.layer_kv(self.b, i)
        return self.keys, self.values


class PoolCache(DynamicCache):
    """A transformers cache over one sequence ``b`` of a batch, every layer a :class:`PoolLayer`."""

    def __init__(self, batch: ForwardBatch, b: int, num_layers: int, past: int) -> None:
        super().__init__()
        self.layers = [PoolLayer(batch, b, i, past) for i in range(num_layers)]


class HFGenericRunner:
    """``run(batch) -> logits [R, vocab]`` (fp32) through the model's own modules.

    Args:
        model: a loaded ``*ForCausalLM`` whose attention runs through ``attention`` (an installed kvboost backend).
        pool: the engine's KV pool.
        attention: the installed backend (selected-query inputs for layer-wise forwards; its observer for probes).
    """

    exact = True
    decode = "hf"

    def __init__(self, model: Any, pool: Any, attention: Any) -> None:
        self.model, self.pool, self.attention = model, pool, attention
        base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
        self.base = base
        cfg = model.config.get_text_config(decoder=True)
        self.num_layers = int(cfg.num_hidden_layers)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        layer_types = getattr(cfg, "layer_types", None) or []
        window = getattr(cfg, "sliding_window", None)
        uses_window = any("sliding" in str(t) for t in layer_types) or (
            window is not None and getattr(cfg, "use_sliding_window", True) and not layer_types
        )
        self.sliding_window: int | None = int(window) if uses_window and window else None
        missing = [name for name in ("embed_tokens", "rotary_emb", "layers", "norm") if not hasattr(base, name)]
        self.layerwise_reason = (
            f"{type(model).__name__} does not expose the parts layer-wise execution needs "
            f"(missing: {', '.join(missing or ['lm_head'])})"
            if base is None or missing or not hasattr(model, "lm_head") else None
        )  # fmt: skip
        self._model_cache_kw = cache_kwarg(model.forward)
        self._layer_cache_kw = cache_kwarg(base.layers[0].forward) if base is not None and hasattr(base, "layers") \
            else "past_key_values"  # fmt: skip
        self.forwards = {"hf": 0, "layerwise": 0}
        self.compile_seconds = 0.0
        self.fallback_reason = None

    def bind_pool(self, pool: Any) -> None:
        """Run over ``pool`` from now on (the engine sizes a GPU pool once the runner exists)."""
        self.pool = pool

    def check_layerwise(self, n: int) -> None:
        """Raise :class:`HFGenericUnsupportedError` when a ``n``-token prompt cannot run layer by layer."""
        if self.layerwise_reason is not None:
            raise HFGenericUnsupportedError(self.layerwise_reason + "; content reuse is not available for it")
        if self.sliding_window is not None and n > self.sliding_window:
            raise HFGenericUnsupportedError(
                f"prompt of {n} tokens exceeds the model's sliding window ({self.sliding_window}); layer-wise "
                "execution (content reuse) only serves prompts within the window"
            )

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        outs = []
        for b in range(batch.num_seqs):
            rows = batch.rows_of(b)
            if rows.start == rows.stop:
                continue
            wanted = batch.logits_rows[(batch.logits_rows >= rows.start) & (batch.logits_rows < rows.stop)]
            if batch.hook is None and batch.num_layers is None and batch.contiguous[b]:
                outs.append(self._hf_forward(batch, b, wanted - rows.start))
            else:
                out = self._layerwise(batch, b, wanted - rows.start)
                if out is None:
                    return None
                outs.append(out)
        return torch.cat(outs) if outs else None

    def warmup(self, max_tokens: int | None = None) -> float:
        return 0.0

    def describe(self) -> dict[str, Any]:
        return {"runner": "hf_generic", "decode": "hf", "exact": True, "forwards": dict(self.forwards)}

    # ------------------------------------------------------------------ HF's forward
    def _hf_forward(self, batch: ForwardBatch, b: int, wanted: torch.Tensor) -> torch.Tensor:
        self.forwards["hf"] += 1
        rows = batch.rows_of(b)
        t = rows.stop - rows.start
        past = batch.kv_lens[b] - t
        cache = PoolCache(batch, b, self.num_layers, past)
        keep = t - int(wanted.min())  # logits of the last `keep` rows (HF's logits_to_keep)
        out = self.model(input_ids=batch.input_ids[rows][None], use_cache=True, logits_to_keep=keep,
                         **{self._model_cache_kw: cache})  # fmt: skip
        return out.logits[0, wanted - (t - keep)].float()

    # ------------------------------------------------------------------ layer by layer
    def _layerwise(self, batch: ForwardBatch, b: int, wanted: torch.Tensor) -> torch.Tensor | None:
        """Rows of sequence ``b`` at their positions, layer by layer (subset queries, hooks, layer limits)."""
        self.forwards["layerwise"] += 1
        n = batch.kv_lens[b]
        self.check_layerwise(n)
        if batch.num_seqs != 1 and batch.hook is not None:
            raise ValueError("a hook narrows a one-sequence batch only")
        rows = batch.rows_of(b)
        base, hook = self.base, batch.hook
        hidden = base.embed_tokens(batch.input_ids[rows][None])
        dtype = hidden.dtype

        def inputs_for(current: ForwardBatch) -> tuple[Any, Any, dict[str, Any]]:
            positions = current.positions[current.rows_of(b)] if current is batch else current.positions
            pos_ids = positions[None]
            mask, extra = self.attention.paged_inputs(current, b if current is batch else 0, dtype)
            return pos_ids, base.rotary_emb(hidden, pos_ids), {"attention_mask": mask, **extra}

        pos_ids, cos_sin, attn_inputs = inputs_for(batch)
        current = batch
        layers = self.num_layers if batch.num_layers is None else batch.num_layers
        observer = None
        if hook is not None:
            observer = self._observer(hook, current_ref := [current])
        for layer_idx in range(layers):
            layer = base.layers[layer_idx]
            if hook is not None:
                hook.before_layer(layer_idx, current)
            cache = PoolCache(current, b if current is batch else 0, self.num_layers, n)
            if observer is not None:
                self.attention.query_observer = observer
            try:
                out = layer(hidden, position_ids=pos_ids, use_cache=True, position_embeddings=cos_sin,
                            **{self._layer_cache_kw: cache}, **attn_inputs)  # fmt: skip
            finally:
                if observer is not None:
                    self.attention.query_observer = None
            hidden = out[0] if isinstance(out, tuple) else out
            if hook is not None:
                stop, keep, current = hook_after_layer(hook, layer_idx, current, hidden[0])
                if stop:
                    return None
                if keep is not None:
                    current_ref[0] = current
                    hidden = hidden[:, keep]
                    pos_ids, cos_sin, attn_inputs = inputs_for(current)
        last = base.norm(hidden[:, current.logits_rows if current is not batch else wanted])
        logits = self.model.lm_head(last)[0].float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    @staticmethod
    def _observer(hook: Any, current_ref: list[ForwardBatch]) -> Any:
        """The backend's query observer, forwarding a layer's queries (``[T, Hq, D]``) to the hook."""

        def observe(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
            layer = getattr(module, "layer_idx", None)
            if layer is not None:
                hook.on_query(int(layer), query[0].transpose(0, 1), current_ref[0])

        return observe
