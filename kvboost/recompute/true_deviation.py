"""The true-deviation selector (research only): recompute the tokens whose cached K/V truly deviate most from a
full prefill's. Named ``oracle`` before issue 59: it is not an upper bound on quality (issue 59, from the first
leaderboard's records on SmolLM2: EPIC's 2.8% of first tokens cut first-token KL 26-fold while every selector's rank
correlation with this one was 0.01-0.08), so it is a reference for the *deviation* proxies (CacheBlend's check-layer
deviation), not for answers. An upper bound in fact (selection by each token's measured effect on the answer's KL)
is not built.

The engine runs a full prefill first, measures each content token's K/V deviation from it (squared error summed
over all layers, ``view.reference_deviation``), and the top ``ratio`` are recomputed at every layer. It costs more
than a full prefill and is reported as costing one (``recompute_ratio`` counts every reused token at every layer).
"""

from __future__ import annotations

import torch

from kvboost.recompute.base import LayerView, RecomputeStrategy, check_fraction
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("true_deviation")
class TrueDeviation(RecomputeStrategy):
    """Top ``ratio`` of content tokens by their true K/V deviation from a full prefill.

    Args:
        ratio: fraction of content-hit tokens recomputed (at every layer).
    """

    needs_reference = True
    full_prefill_cost = True

    def __init__(self, ratio: float = 0.15) -> None:
        self.ratio = check_fraction("true_deviation", "ratio", ratio)

    def score(self, view: LayerView) -> torch.Tensor:
        """The true K/V deviation from a full prefill, per candidate."""
        if view.reference_deviation is None or view.reference_deviation.numel() != view.candidates.numel():
            raise ValueError("recompute strategy 'true_deviation' needs the reference deviation of every candidate")
        return view.reference_deviation

    def fingerprint(self) -> str:
        return f"true_deviation:{self.ratio}"
