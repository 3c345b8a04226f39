"""No repair: cached KV is used as served."""

from __future__ import annotations

from typing import Any

from kvboost.recompute.base import RecomputeStrategy, RepairOutcome, ReusePlan
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("none")
class NoRecompute(RecomputeStrategy):
    """Exact hits are reused as they are; nothing is recomputed."""

    def repair(self, plan: ReusePlan, adapter: Any) -> RepairOutcome:
        return RepairOutcome(plan=plan, recomputed_token_layers=0)
