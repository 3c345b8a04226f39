"""No repair: content hits are used as re-rotated (CacheBlend's "full KV reuse" point)."""

from __future__ import annotations

import torch

from kvboost.recompute.base import LayerView, RecomputeStrategy
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("none")
class NoRecompute(RecomputeStrategy):
    """Only new tokens are computed; exact and content hits are reused as served (a budget of 0)."""

    ratio = 0.0

    def score(self, view: LayerView) -> torch.Tensor:
        return torch.zeros(view.candidates.numel())

    def token_scores(self, plan, num_layers, check=None):  # type: ignore[no-untyped-def]
        return None  # no ranking
