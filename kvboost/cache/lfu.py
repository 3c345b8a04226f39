"""Least-frequently-used eviction, ties broken by recency."""

from __future__ import annotations

import itertools
from collections.abc import Container

from kvboost.cache.eviction_base import EvictionPolicy
from kvboost.cache.ranked_keys import RankedKeys
from kvboost.registry import EVICTION


@EVICTION.register("lfu")
class LFUEviction(EvictionPolicy):
    """Evicts the unprotected entry used the fewest times; among equals, the one touched longest ago.

    An insert counts as the first use (frequency 1); every ``on_access`` adds one. A removed key forgets its
    count (a re-inserted key starts again at 1). Frequencies never decay: an entry that was hot long ago keeps
    its count, which is LFU's known weakness on shifting workloads (compare ``s3fifo``).

    The store's lookup counts one prefix hit as two accesses (``get`` while walking the chain, then
    ``touch_chain``); every hit is counted the same way, so the order between entries is unaffected.

    Keys are ranked by ``(frequency, last use)`` in a ``RankedKeys`` heap (``O(log n)`` per insert, access and
    victim; the constant-time bucket list of Shah, Mitra and Matani (2010) gives ``O(1)`` updates but cannot take
    a key out of the order and put it back at its place). A tier that tracks which keys it cannot evict now
    (``set_evictable``: the pool tier's busy, pinned and parent entries) holds them out of the heap, keeping
    their rank, so ``victim`` never walks over them.

    Args:
        leaves_first: see ``EvictionPolicy``; False gives plain LFU.
    """

    tracks_evictable = True

    def __init__(self, leaves_first: bool = True) -> None:
        super().__init__(leaves_first=leaves_first)
        self._keys = RankedKeys()
        self._clock = itertools.count()

    def on_insert(self, key: str) -> None:
        self._keys.discard(key)  # a re-insert replaces the entry: its count starts again
        self._keys.set(key, (1, next(self._clock)))

    def on_access(self, key: str) -> None:
        if key in self._keys:
            freq, _ = self._keys.rank(key)
            self._keys.set(key, (freq + 1, next(self._clock)))

    def on_remove(self, key: str) -> None:
        self._keys.discard(key)

    def set_evictable(self, key: str, evictable: bool) -> None:
        self._keys.hold(key, not evictable)

    def victim(self, protected: Container[str] = ()) -> str | None:
        return self._keys.first(protected)

    def frequency(self, key: str) -> int:
        """How many times ``key`` was used since it was inserted (0 if not tracked); for tests and reports."""
        return self._keys.rank(key)[0] if key in self._keys else 0

    def order(self) -> list[str]:
        """The evictable keys, next victim first (for tests and reports; O(n log n))."""
        return self._keys.ordered()
