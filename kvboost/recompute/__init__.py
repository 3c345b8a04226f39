"""Recompute strategies (``RECOMPUTE`` registry). Every module of this package is a strategy (or a helper) and is
imported on the registry's first lookup (``kvboost.registry``: ``kvboost.recompute.*``), so an in-tree strategy is
one module plus one yaml (``kvboost/configs/recompute/<name>.yaml``) and nothing here names it.

The contract is :mod:`kvboost.recompute.base` (``RecomputeStrategy.score`` over a ``LayerView``). A strategy class
is importable from here by its class name (``from kvboost.recompute import CacheBlend``), found among the
registered ones.
"""

from __future__ import annotations

from typing import Any

from kvboost.recompute.base import LayerView, RecomputeStrategy


def __getattr__(name: str) -> Any:
    """A registered strategy class by its class name (the registry imports every module of this package)."""
    from kvboost.registry import RECOMPUTE

    for registered in RECOMPUTE.names():
        factory = RECOMPUTE.get(registered)
        if getattr(factory, "__name__", None) == name:
            return factory
    raise AttributeError(f"module 'kvboost.recompute' has no attribute {name!r}")


__all__ = ["LayerView", "RecomputeStrategy"]
