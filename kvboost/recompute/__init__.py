"""Recompute strategies (``RECOMPUTE`` registry): none, selective, cacheblend, full, oracle."""

from kvboost.recompute.base import RecomputeStrategy
from kvboost.recompute.cacheblend import CacheBlend
from kvboost.recompute.full import FullRecompute
from kvboost.recompute.none import NoRecompute
from kvboost.recompute.oracle import OracleRecompute
from kvboost.recompute.selective import SelectiveRecompute

__all__ = ["CacheBlend", "FullRecompute", "NoRecompute", "OracleRecompute", "RecomputeStrategy", "SelectiveRecompute"]
