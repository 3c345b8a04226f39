"""Recompute every content hit at every layer: the quality reference (equals a cold prefill)."""

from __future__ import annotations

import torch

from kvboost.plan import ReusePlan
from kvboost.recompute.base import ScoredStrategy
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("full")
class FullRecompute(ScoredStrategy):
    """Everything that is not an exact hit is computed at every layer (a budget of 1).

    Exact hits are kept (they are what a cold prefill computes), so the result equals a cold prefill up to
    matmul rounding, and the cost is a prefill of everything after the exact frontier.
    """

    ratio = 1.0

    def score(self, plan: ReusePlan, candidates: torch.Tensor, deviation: dict[str, torch.Tensor] | None = None
              ) -> torch.Tensor:  # fmt: skip
        return torch.zeros(candidates.numel())

    def token_scores(self, plan: ReusePlan, check: object = None) -> torch.Tensor | None:
        return None  # no ranking
