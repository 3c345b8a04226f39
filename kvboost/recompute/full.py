"""Recompute every content hit at every layer: the quality reference (equals a cold prefill)."""

from __future__ import annotations

import torch

from kvboost.plan import KIND_CODES, ComputeSchedule, ReusePlan
from kvboost.recompute.base import RecomputeStrategy
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("full")
class FullRecompute(RecomputeStrategy):
    """Everything that is not an exact hit is computed at every layer.

    Exact hits are kept (they are what a cold prefill computes), so the result equals a cold prefill up to
    matmul rounding, and the cost is a prefill of everything after the exact frontier.
    """

    def schedule(self, plan: ReusePlan, num_layers: int) -> ComputeSchedule:
        return ComputeSchedule(torch.nonzero(plan.kinds != KIND_CODES["exact"], as_tuple=False).flatten())
