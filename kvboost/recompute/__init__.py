"""Recompute strategies (seam repair). ``RECOMPUTE.build("none")``."""

from kvboost.recompute.base import RecomputeStrategy, RepairOutcome, ReusePlan
from kvboost.recompute.full import FullRecompute
from kvboost.recompute.none import NoRecompute

__all__ = ["FullRecompute", "NoRecompute", "RecomputeStrategy", "RepairOutcome", "ReusePlan"]
