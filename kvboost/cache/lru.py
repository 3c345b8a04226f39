"""Least-recently-used eviction."""

from __future__ import annotations

import itertools
from collections.abc import Container

from kvboost.cache.eviction_base import EvictionPolicy
from kvboost.cache.ranked_keys import RankedKeys
from kvboost.registry import EVICTION


@EVICTION.register("lru")
class LRUEviction(EvictionPolicy):
    """Evicts the unprotected entry touched longest ago.

    With ``leaves_first`` (the default) the tier protects every entry that has children resident in the
    store, so a chain is evicted from its tail: a cold prefill inserts a chain root first, which would
    otherwise make the root the oldest entry and strand its whole chain.

    Keys are ranked by their last use (a counter bumped by ``on_insert`` and ``on_access``) in a
    ``RankedKeys`` heap. A tier that tracks which keys it cannot evict now (``set_evictable``: the pool tier's
    busy, pinned and parent entries) holds them out of the heap; they keep their rank, so the order is plain
    LRU over the evictable keys, and ``victim`` costs ``O(log n)`` amortised however many keys are held. Keys
    passed in ``protected`` instead (tiers that do not track) are skipped one by one.

    Args:
        leaves_first: see ``EvictionPolicy``; False gives plain LRU.
    """

    tracks_evictable = True

    def __init__(self, leaves_first: bool = True) -> None:
        super().__init__(leaves_first=leaves_first)
        self._keys = RankedKeys()
        self._clock = itertools.count()

    def on_insert(self, key: str) -> None:
        self._keys.discard(key)  # a re-insert replaces the entry: evictable again, most recent
        self._keys.set(key, next(self._clock))

    def on_access(self, key: str) -> None:
        if key in self._keys:
            self._keys.set(key, next(self._clock))

    def on_remove(self, key: str) -> None:
        self._keys.discard(key)

    def set_evictable(self, key: str, evictable: bool) -> None:
        self._keys.hold(key, not evictable)

    def victim(self, protected: Container[str] = ()) -> str | None:
        return self._keys.first(protected)

    def order(self) -> list[str]:
        """The evictable keys, next victim first (for tests and reports; O(n log n))."""
        return self._keys.ordered()
