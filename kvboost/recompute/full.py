"""Recompute every content hit at every layer: the quality reference (equals a cold prefill)."""

from __future__ import annotations

import torch

from kvboost.recompute.base import LayerView, RecomputeStrategy
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("full")
class FullRecompute(RecomputeStrategy):
    """Everything that is not an exact hit is computed at every layer (a budget of 1).

    Exact hits are kept (they are what a cold prefill computes), so the result equals a cold prefill up to
    matmul rounding, and the cost is a prefill of everything after the exact frontier.
    """

    ratio = 1.0

    def score(self, view: LayerView) -> torch.Tensor:
        return torch.zeros(view.candidates.numel())

    def token_scores(self, plan, num_layers, check=None):  # type: ignore[no-untyped-def]
        return None  # no ranking
