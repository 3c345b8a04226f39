"""Layer hooks for content repair: CacheBlend-style check layers and the query-aware reader probe.

A prompt with content hits has cached (re-rotated) K/V for most of its rows and needs only some of them computed,
possibly a different subset per layer. The runner runs the subset as a :class:`~kvboost.runtime.batch.ForwardBatch`
of rows at their positions (each attends keys ``j <= `` its own position over the whole prompt: cached rows for the
others, fresh rows for itself); these hooks decide, between layers, what the next layers compute:

- :class:`CheckLayerHook`: at each check layer, what the layer computed for the content rows (queries, fresh keys
  and values, the cached rows they replaced, the layer's output hidden states) goes to the strategy, which keeps
  those it selects (CacheBlend: the top ``ratio`` by K/V deviation); the others keep their cached rows in every
  later layer.
- :class:`ReaderProbeHook`: records, at the layers a strategy asks for, the softmax attention of the prompt's
  reader queries (the rows after the last content hit) over every position, from the layer's own queries and
  keys after RoPE, and stops the forward after the last of those layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvboost.runtime.batch import ForwardBatch

#: on_check(layer, candidate positions, what the layer has for them) -> the candidates to keep. The mapping holds
#: ``queries`` [heads, C, D], ``keys`` / ``values`` / ``cached_keys`` / ``cached_values`` [kv_heads, C, D] and
#: ``hidden_states`` [C, hidden] (the layer's output; None from a runner that does not report it).
CheckCallback = Callable[[int, torch.Tensor, dict[str, torch.Tensor | None]], torch.Tensor]


@dataclass
class CheckLayerHook:
    """Narrows a one-sequence batch at ``check_layers`` by ``on_check``; records what each layer computed.

    Args:
        content_mask: ``[n]`` bool, True at content-hit positions of the prompt.
        check_layers: layers after which the content rows are ranked.
        on_check: the strategy's selection (validated by the caller).
    """

    content_mask: torch.Tensor
    check_layers: tuple[int, ...] = ()
    on_check: CheckCallback | None = None
    stop_after: int | None = None
    computed_per_layer: list[int] = field(default_factory=list)
    content_per_layer: list[int] = field(default_factory=list)
    final_positions: torch.Tensor | None = None
    _old: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _queries: torch.Tensor | None = None
    _hidden: torch.Tensor | None = None

    def _content_rows(self, batch: ForwardBatch) -> torch.Tensor:
        return self.content_mask.to(batch.positions.device)[batch.positions]

    def before_layer(self, layer: int, batch: ForwardBatch) -> None:
        if layer not in self.check_layers:
            return
        rows = torch.nonzero(self._content_rows(batch), as_tuple=False).flatten()
        slots = batch.slot_mapping[rows]
        pool = batch.pool
        self._old = (rows, slots, pool.keys[layer][:, slots].clone(), pool.values[layer][:, slots].clone())

    def on_query(self, layer: int, q: torch.Tensor, batch: ForwardBatch) -> None:
        if layer in self.check_layers and self._old is not None:
            self._queries = q[self._old[0].to(q.device)].transpose(0, 1).detach()

    def on_hidden(self, layer: int, hidden: torch.Tensor, batch: ForwardBatch) -> None:
        if layer in self.check_layers and self._old is not None:
            self._hidden = hidden[self._old[0].to(hidden.device)].detach()

    def after_layer(self, layer: int, batch: ForwardBatch) -> torch.Tensor | None:
        is_content = self._content_rows(batch)
        self.computed_per_layer.append(batch.num_tokens)
        self.content_per_layer.append(int(is_content.sum()))
        self.final_positions = batch.positions.cpu()
        if layer not in self.check_layers or self._old is None:
            return None
        rows, slots, old_k, old_v = self._old
        queries, hidden = self._queries, self._hidden
        self._old = self._queries = self._hidden = None
        if rows.numel() == 0:
            return None
        pool = batch.pool
        seen = {"queries": queries, "keys": pool.keys[layer][:, slots], "values": pool.values[layer][:, slots],
                "cached_keys": old_k, "cached_values": old_v, "hidden_states": hidden}  # fmt: skip
        candidates = batch.positions[rows].cpu()
        keep_content = self.on_check(layer, candidates, seen)  # type: ignore[misc]
        keep = ~is_content | torch.isin(batch.positions, keep_content.to(batch.positions.device))
        kept = torch.nonzero(keep, as_tuple=False).flatten()
        self.final_positions = batch.positions[kept].cpu()
        return kept


class ReaderProbeHook:
    """Collects ``[len(layers), heads, n]`` attention of the reader queries (the batch's last rows, at
    ``reader_positions``) over keys ``[0, n)``, and stops the forward after the last probed layer.

    Args:
        layers: decoder layers (0-based) to record.
        n: the prompt length.
        reader_positions: sorted positions of the reader queries (the last rows of the probe batch); each sees key
            ``j`` iff ``j <= `` its position.
    """

    def __init__(self, layers: tuple[int, ...], n: int, reader_positions: torch.Tensor) -> None:
        self.layers = tuple(layers)
        self.n = n
        self.reader_positions = reader_positions
        self.stop_after = max(self.layers) if self.layers else None
        self._rows: dict[int, torch.Tensor] = {}

    def before_layer(self, layer: int, batch: ForwardBatch) -> None:
        return None

    def after_layer(self, layer: int, batch: ForwardBatch) -> torch.Tensor | None:
        return None

    def on_query(self, layer: int, q: torch.Tensor, batch: ForwardBatch) -> None:
        readers = self.reader_positions.to(q.device)
        if layer not in self.layers or q.shape[0] < readers.numel():
            return
        queries = q[-readers.numel() :].transpose(0, 1).float()  # [Hq, R, D]
        keys = batch.layer_kv(0, layer)[0][0, :, : self.n].float()  # [Hkv, n, D]
        if keys.shape[0] != queries.shape[0]:
            keys = keys.repeat_interleave(queries.shape[0] // keys.shape[0], dim=0)
        scale = queries.shape[-1] ** -0.5 if self.scale is None else self.scale
        scores = torch.einsum("hrd,hkd->hrk", queries, keys) * scale
        visible = torch.arange(self.n, device=q.device)[None, :] <= readers[:, None]
        scores.masked_fill_(~visible[None], float("-inf"))
        # Mean over the reader queries: how much the question as a whole reads each position, per head.
        self._rows[int(layer)] = torch.softmax(scores, dim=-1).mean(dim=1).cpu()

    #: the model's softmax scale (set by the caller; None: 1 / sqrt(head_dim))
    scale: float | None = None

    def result(self) -> torch.Tensor:
        """``[len(layers), heads, n]`` (float32, cpu); raises if a layer was never observed."""
        missing = [layer for layer in self.layers if layer not in self._rows]
        if missing:
            raise RuntimeError(f"reader attention probe saw no attention call for layers {missing}")
        return torch.stack([self._rows[layer] for layer in self.layers])
