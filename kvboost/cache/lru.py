"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvboost.cache.eviction_base import EvictionPolicy
from kvboost.registry import EVICTION


@EVICTION.register("lru")
class LRUEviction(EvictionPolicy):
    """Evicts the unprotected entry touched longest ago.

    With ``leaves_first`` (the default) the tier protects every entry that has children resident in the
    store, so a chain is evicted from its tail: a cold prefill inserts a chain root first, which would
    otherwise make the root the oldest entry and strand its whole chain. ``victim`` scans from the oldest
    key and skips protected ones, so its cost is the number of protected keys older than the victim
    (the internal nodes of old chains: a few per chain, plus shared prefixes).

    Args:
        leaves_first: see ``EvictionPolicy``; False gives plain LRU.
    """

    def __init__(self, leaves_first: bool = True) -> None:
        super().__init__(leaves_first=leaves_first)
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
