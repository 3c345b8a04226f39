"""Recompute strategies (``RECOMPUTE`` registry): none, selective, cacheblend, query_aware, full, oracle."""

from kvboost.recompute.base import RecomputeStrategy
from kvboost.recompute.cacheblend import CacheBlend
from kvboost.recompute.full import FullRecompute
from kvboost.recompute.none import NoRecompute
from kvboost.recompute.oracle import OracleRecompute
from kvboost.recompute.query_aware import QueryAware
from kvboost.recompute.selective import SelectiveRecompute

__all__ = ["CacheBlend", "FullRecompute", "NoRecompute", "OracleRecompute", "QueryAware", "RecomputeStrategy", "SelectiveRecompute"]
