"""The oracle (research only): recompute the tokens that truly deviate most, known from a full prefill.

It shows how good a selection at a given ratio can be, so CacheBlend's layer-1 proxy can be judged: the engine
runs a full prefill first, measures each content token's K/V deviation from it (summed over all layers), and
the oracle recomputes the top ``ratio`` at every layer. It costs more than a full prefill and is reported as
costing one (``recompute_ratio`` counts every reused token at every layer).
"""

from __future__ import annotations

import torch

from kvboost.plan import ReusePlan
from kvboost.recompute.base import ScoredStrategy, check_fraction
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("oracle")
class OracleRecompute(ScoredStrategy):
    """Top ``ratio`` of content tokens by their true K/V deviation from a full prefill.

    Args:
        ratio: fraction of content-hit tokens recomputed (at every layer).
    """

    needs_reference = True
    full_prefill_cost = True

    def __init__(self, ratio: float = 0.15) -> None:
        self.ratio = check_fraction("oracle", "ratio", ratio)

    def score(self, plan: ReusePlan, candidates: torch.Tensor, deviation: dict[str, torch.Tensor] | None = None
              ) -> torch.Tensor:  # fmt: skip
        """The true K/V deviation from a full prefill (``plan.reference_deviation``), per content position."""
        if plan.reference_deviation is None or plan.reference_deviation.numel() != plan.content_tokens:
            raise ValueError("recompute strategy 'oracle' needs plan.reference_deviation for every content position")
        return plan.reference_deviation

    def token_scores(self, plan: ReusePlan, check: object = None) -> torch.Tensor | None:
        return plan.reference_deviation

    def fingerprint(self) -> str:
        return f"oracle:{self.ratio}"
