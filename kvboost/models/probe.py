"""Reader attention: how much the prompt's closing tokens (the question) attend to each earlier position.

A recompute strategy such as ``query_aware`` needs to know which content-hit tokens the request actually reads.
The engine runs a cheap probe pass (only the new tokens computed, every content hit reused as re-rotated, as
``recompute=none`` would) and, through the attention backend's ``query_observer``, records at chosen layers the
softmax attention of the *reader* queries (the positions after the last content hit) over the prompt's keys.
It works with every backend (the probabilities are computed here from the layer's own query and key tensors,
after RoPE), at the cost of ``readers x keys x heads`` scores per probed layer.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class ReaderAttentionProbe:
    """Collects ``[len(layers), heads, n]`` attention of the last ``num_readers`` queries over keys ``[0, n)``.

    Args:
        layers: decoder layers (0-based) to record.
        n: the prompt length (keys beyond it, the preallocated buffer's tail, are ignored).
        reader_positions: absolute positions of the reader queries (sorted; the last rows of every probed
            layer call); each sees key j iff j <= its position.
    """

    def __init__(self, layers: tuple[int, ...], n: int, reader_positions: torch.Tensor) -> None:
        self.layers = tuple(layers)
        self.n = n
        self.reader_positions = reader_positions
        self._rows: dict[int, torch.Tensor] = {}

    def observe(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        layer = getattr(module, "layer_idx", None)
        if layer not in self.layers or query.shape[2] < self.reader_positions.numel():
            return
        readers = self.reader_positions.to(query.device)
        q = query[0, :, -readers.numel() :].float()  # [Hq, R, D]
        k = key[0, :, : self.n].float()  # [Hkv, n, D]
        if k.shape[0] != q.shape[0]:
            k = k.repeat_interleave(q.shape[0] // k.shape[0], dim=0)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        scores = torch.einsum("hrd,hkd->hrk", q, k) * scale
        visible = torch.arange(self.n, device=q.device)[None, :] <= readers[:, None]
        scores.masked_fill_(~visible[None], float("-inf"))
        # Mean over the reader queries: how much the question as a whole reads each position, per head.
        self._rows[int(layer)] = torch.softmax(scores, dim=-1).mean(dim=1).cpu()

    def result(self) -> torch.Tensor:
        """``[len(layers), heads, n]`` (float32, cpu); raises if a layer was never observed."""
        missing = [layer for layer in self.layers if layer not in self._rows]
        if missing:
            raise RuntimeError(
                f"reader attention probe saw no attention call for layers {missing}: the model's attention modules "
                "need a layer_idx attribute (transformers' decoder layers have one)"
            )
        return torch.stack([self._rows[layer] for layer in self.layers])


@contextmanager
def observing(backend: Any, probe: ReaderAttentionProbe) -> Iterator[ReaderAttentionProbe]:
    """Install ``probe`` as ``backend``'s query observer for the duration of the block."""
    if getattr(backend, "query_observer", None) is not None:
        raise RuntimeError("the attention backend already has a query observer (nested probes are not supported)")
    backend.query_observer = probe.observe
    try:
        yield probe
    finally:
        backend.query_observer = None
