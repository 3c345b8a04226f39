"""Recompute everything: the reference every other strategy is compared to."""

from __future__ import annotations

from typing import Any

from kvboost.recompute.base import RecomputeStrategy, RepairOutcome, ReusePlan
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("full")
class FullRecompute(RecomputeStrategy):
    """Discards every cached token and prefills the whole prompt (a cold prefill with lookup cost)."""

    def repair(self, plan: ReusePlan, adapter: Any) -> RepairOutcome:
        recomputed = plan.reused_tokens * adapter.num_layers
        return RepairOutcome(plan=plan.cold(), recomputed_token_layers=recomputed)
