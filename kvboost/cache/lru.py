"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvboost.cache.eviction_base import EvictionPolicy
from kvboost.registry import EVICTION


@EVICTION.register("lru")
class LRUEviction(EvictionPolicy):
    """Evicts the entry touched longest ago.

    The engine touches a prompt's chain of hits deepest-first, so a chain's root is the most recent:
    LRU then drops the tails of old conversations before their shared prefixes (a child without its
    parent is unreachable by prefix lookup).
    """

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def on_insert(self, key: str) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victim(self, protected: Container[str] = ()) -> str | None:
        for key in self._order:
            if key not in protected:
                return key
        return None
