"""Recompute strategies (``RECOMPUTE`` registry): none, selective, cacheblend, query_aware, full, oracle, and the
family of issue 45: epic, ape, relevance, and the ``compose`` wrapper. Every one but ``ape`` is a
:class:`~kvboost.recompute.base.ScoredStrategy` (it scores tokens; the base keeps the top of the budget)."""

from kvboost.recompute.ape import AdaptiveParallelEncoding
from kvboost.recompute.base import RecomputeStrategy, ScoredStrategy
from kvboost.recompute.cacheblend import CacheBlend
from kvboost.recompute.compose import Compose
from kvboost.recompute.epic import EpicRecompute
from kvboost.recompute.full import FullRecompute
from kvboost.recompute.none import NoRecompute
from kvboost.recompute.oracle import OracleRecompute
from kvboost.recompute.query_aware import QueryAware
from kvboost.recompute.relevance import RelevanceRecompute
from kvboost.recompute.selective import SelectiveRecompute

__all__ = ["AdaptiveParallelEncoding", "CacheBlend", "Compose", "EpicRecompute", "FullRecompute", "NoRecompute",
           "OracleRecompute", "QueryAware", "RecomputeStrategy", "RelevanceRecompute", "ScoredStrategy",
           "SelectiveRecompute"]  # fmt: skip
