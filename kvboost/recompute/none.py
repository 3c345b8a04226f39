"""No repair: content hits are used as re-rotated (CacheBlend's "full KV reuse" point)."""

from __future__ import annotations

from kvboost.plan import ComputeSchedule, ReusePlan
from kvboost.recompute.base import RecomputeStrategy
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("none")
class NoRecompute(RecomputeStrategy):
    """Only new tokens are computed; exact and content hits are reused as served."""

    def schedule(self, plan: ReusePlan, num_layers: int) -> ComputeSchedule:
        return ComputeSchedule(plan.positions("new"))
