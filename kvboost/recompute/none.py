"""No repair: content hits are used as re-rotated (CacheBlend's "full KV reuse" point)."""

from __future__ import annotations

import torch

from kvboost.plan import ReusePlan
from kvboost.recompute.base import ScoredStrategy
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("none")
class NoRecompute(ScoredStrategy):
    """Only new tokens are computed; exact and content hits are reused as served (a budget of 0)."""

    ratio = 0.0

    def score(self, plan: ReusePlan, candidates: torch.Tensor, deviation: dict[str, torch.Tensor] | None = None
              ) -> torch.Tensor:  # fmt: skip
        return torch.zeros(candidates.numel())

    def token_scores(self, plan: ReusePlan, check: object = None) -> torch.Tensor | None:
        return None  # no ranking
