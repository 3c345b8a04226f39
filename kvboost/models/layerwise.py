"""Layer-wise execution: run each decoder layer for a subset of prompt positions over a mixed KV.

A prompt with content hits has cached (re-rotated) K/V for most positions and needs only some of them
computed, possibly a different subset per layer (CacheBlend). HF's ``model(...)`` cannot do that: it runs every
given token through every layer and appends. This module drives the model's own parts (embeddings, rotary
embedding, decoder layers, final norm, LM head) directly:

- layer l runs only the positions ``S_l`` (the recomputed tokens plus the new ones); their fresh K/V rows are
  written into the request's preallocated cache at their positions (``PreallocatedLayer.write_at``), then they
  attend over the whole prompt's K/V in that layer: cached rows for the others, fresh rows for ``S_l``;
- each query attends causally by its own absolute position: query i sees key j iff j <= position(i). The
  attention backend's selected-query mode provides that (the Triton kernel takes the positions; sdpa and eager
  get an explicit mask). A bottom-right aligned causal mask, as varlen kernels use when there are fewer
  queries than keys, would let a selected token see later keys (LMCache#1152);
- the decoder layer is the model's own module, so projections, RoPE, norms and MLP are exactly HF's.

Supported: decoder-only families whose base model has ``embed_tokens``, ``rotary_emb``, ``layers`` and ``norm``
and whose decoder layers take ``position_embeddings`` (Llama, Qwen2/3, Mistral, Phi3, Gemma and most others in
transformers 5). Sliding-window layers are served only while the prompt fits the window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvboost.models.prealloc_cache import PreallocatedKV

#: on_check(layer, candidates, deviation) -> the candidates to keep computing (sorted subset).
CheckCallback = Callable[[int, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor]


class LayerwiseUnsupportedError(RuntimeError):
    """The model cannot be run layer by layer (content reuse needs it); the message says why."""


@dataclass
class LayerwiseStats:
    """What one layer-wise prefill computed: per layer, the positions run and how many were content hits."""

    computed_per_layer: list[int] = field(default_factory=list)
    content_per_layer: list[int] = field(default_factory=list)
    final_positions: torch.Tensor | None = None  # positions computed at every layer (the last layer's set)


class LayerwiseModel:
    """A HuggingFace causal LM seen as parts, for subset-of-positions prefills.

    Args:
        model: a loaded ``*ForCausalLM`` whose attention runs through ``attention`` (a kvboost backend).
        attention: the installed kvboost attention backend (provides ``selected_query_inputs``).
    """

    def __init__(self, model: Any, attention: Any) -> None:
        base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
        missing = [name for name in ("embed_tokens", "rotary_emb", "layers", "norm") if not hasattr(base, name)]
        if base is None or missing or not hasattr(model, "lm_head"):
            raise LayerwiseUnsupportedError(
                f"{type(model).__name__} does not expose the parts layer-wise execution needs "
                f"(missing: {', '.join(missing or ['lm_head'])}); content reuse is not available for it"
            )
        self.model = model
        self.base = base
        self.attention = attention
        cfg = model.config.get_text_config(decoder=True)
        self.num_layers = len(base.layers)
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        layer_types = getattr(cfg, "layer_types", None) or []
        window = getattr(cfg, "sliding_window", None)
        uses_window = any("sliding" in str(t) for t in layer_types) or (
            window is not None and getattr(cfg, "use_sliding_window", True) and not layer_types
        )
        self.sliding_window: int | None = int(window) if uses_window and window else None

    def check_length(self, n: int) -> None:
        if self.sliding_window is not None and n > self.sliding_window:
            raise LayerwiseUnsupportedError(
                f"prompt of {n} tokens exceeds the model's sliding window ({self.sliding_window}); layer-wise "
                "execution (content reuse) only serves prompts within the window"
            )

    @torch.inference_mode()
    def prefill(
        self,
        input_ids: torch.Tensor,
        kv: PreallocatedKV,
        positions: torch.Tensor,
        *,
        content_mask: torch.Tensor,
        check_layers: tuple[int, ...] = (),
        on_check: CheckCallback | None = None,
        stop_after_layer: int | None = None,
    ) -> tuple[torch.Tensor | None, LayerwiseStats]:
        """Run the prompt ``input_ids`` ([n], on the model's device) computing ``positions`` from layer 0.

        Every row of ``kv`` below ``n`` not in ``positions`` must already hold its K/V (exact or re-rotated
        content hits). After each layer in ``check_layers``, the content positions just computed are ranked by
        ``on_check`` (given their K/V deviation from the rows they replaced) and the set narrows to the new
        positions plus those it keeps. The last position must be computed (its logits are returned).
        ``stop_after_layer``: stop after that layer (a probe pass that only needs what the layers up to it
        see); the later layers' rows of ``positions`` are left unwritten and the logits are None.

        Returns the last position's logits (float32, [vocab]) and what was computed per layer.
        """
        n = int(input_ids.shape[0])
        self.check_length(n)
        device = input_ids.device
        positions = positions.to(device)
        content_mask = content_mask.to(device)
        if positions.numel() == 0 or int(positions[-1]) != n - 1:
            raise ValueError("layer-wise prefill must compute the prompt's last position (its logits are needed)")
        checks = set(check_layers)
        if checks and on_check is None:
            raise ValueError("check layers need an on_check callback")

        hidden = self.base.embed_tokens(input_ids[positions][None])
        stats = LayerwiseStats()
        dtype = hidden.dtype

        def inputs_for(pos: torch.Tensor) -> tuple[Any, Any, dict[str, Any]]:
            pos_ids = pos[None]
            cos_sin = self.base.rotary_emb(hidden, pos_ids)
            mask, extra = self.attention.selected_query_inputs(pos, n, dtype)
            return pos_ids, cos_sin, {"attention_mask": mask, **extra}

        pos_ids, cos_sin, attn_inputs = inputs_for(positions)
        is_content = content_mask[positions]
        for layer_idx, layer in enumerate(self.base.layers):
            check = layer_idx in checks
            if check:
                cand_rows = torch.nonzero(is_content, as_tuple=False).flatten()
                cand = positions[cand_rows]
                old_k = kv.keys[layer_idx][:, cand].clone()
                old_v = kv.values[layer_idx][:, cand].clone()
            kv.layers[layer_idx].write_at(positions, n)
            out = layer(
                hidden,
                position_ids=pos_ids,
                past_key_values=kv.cache,
                use_cache=True,
                position_embeddings=cos_sin,
                **attn_inputs,
            )
            hidden = out[0] if isinstance(out, tuple) else out
            stats.computed_per_layer.append(int(positions.numel()))
            stats.content_per_layer.append(int(is_content.sum()))
            if check and cand.numel():
                # Mean squared change of each candidate's K and V rows over heads and channels.
                deviation = {
                    "key": (kv.keys[layer_idx][:, cand].float() - old_k.float()).pow(2).mean(dim=(0, 2)),
                    "value": (kv.values[layer_idx][:, cand].float() - old_v.float()).pow(2).mean(dim=(0, 2)),
                }
                keep_content = on_check(layer_idx, cand.cpu(), {k: v.cpu() for k, v in deviation.items()})  # type: ignore[misc]
                keep = ~is_content | torch.isin(positions, keep_content.to(device))
                positions, hidden, is_content = positions[keep], hidden[:, keep], is_content[keep]
                pos_ids, cos_sin, attn_inputs = inputs_for(positions)
            if stop_after_layer is not None and layer_idx >= stop_after_layer:
                kv.set_length(n)
                stats.final_positions = positions.cpu()
                return None, stats
        kv.set_length(n)
        stats.final_positions = positions.cpu()
        last = self.base.norm(hidden[:, -1:])
        logits = self.model.lm_head(last)[0, -1].float()
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits, stats
