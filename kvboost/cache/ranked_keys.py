"""Keys ordered by a rank, some of them held out of the order: the evictable queue of rank-ordered policies.

``lru`` ranks a key by when it was last used, ``lfu`` by (uses, when last used). Both name the lowest-ranked key
that may be evicted. The pool tier tells the policy which keys cannot be evicted now (their blocks are all held by
requests or a pin, or, leaves first, they have cached children): those keys are *held*. They keep their rank and
return to their place in the order when released, so the order is the policy's own, unchanged; but ``first`` never
walks over them. (Before, the victim search skipped such keys one by one on every eviction: its cost grew with the
number of running requests' prefixes and pinned entries, on the allocating thread.)

A binary heap with lazy deletion: a rank change or a hold leaves a stale item that ``first`` drops when it reaches
the top, and the heap is rebuilt when stale items outnumber the live ones. Every operation is ``O(log n)``
amortised; none scans the keys.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Hashable
from typing import Any

#: Rebuild the heap when it holds more than this many items per live key (plus a constant): bounds its memory.
_STALE_FACTOR = 2


class RankedKeys:
    """Tracked keys with a rank each; ``first`` gives the lowest-ranked key that is not held.

    Ranks must be totally ordered and unique per key (the policies add a monotonic counter to each).
    """

    __slots__ = ("_heap", "_held", "_rank")

    def __init__(self) -> None:
        self._rank: dict[str, Any] = {}
        self._held: set[str] = set()
        self._heap: list[tuple[Any, str]] = []

    def __contains__(self, key: object) -> bool:
        return key in self._rank

    def __len__(self) -> int:
        return len(self._rank)

    def rank(self, key: str) -> Any:
        """The rank of a tracked key (KeyError otherwise)."""
        return self._rank[key]

    def set(self, key: str, rank: Hashable) -> None:
        """Track ``key`` with ``rank`` (a new key is not held; a tracked one keeps its hold)."""
        self._rank[key] = rank
        if key not in self._held:
            self._push(rank, key)

    def discard(self, key: str) -> None:
        """Stop tracking ``key`` (unknown keys are ignored)."""
        if self._rank.pop(key, None) is not None:
            self._held.discard(key)

    def hold(self, key: str, held: bool) -> None:
        """Keep ``key`` out of ``first`` (``held``) or put it back at its rank; unknown keys are ignored."""
        if key not in self._rank:
            return
        if held:
            self._held.add(key)
        elif key in self._held:
            self._held.discard(key)
            self._push(self._rank[key], key)

    def is_held(self, key: str) -> bool:
        return key in self._held

    def first(self, protected: Container[str] = ()) -> str | None:
        """The lowest-ranked key neither held nor in ``protected``, or None. ``protected`` is for the few keys a
        caller excludes for one decision (the victims it already chose): each one ahead costs a pop and a push."""
        heap, skipped, found = self._heap, [], None
        while heap:
            rank, key = heap[0]
            if self._rank.get(key, _MISSING) != rank or key in self._held:
                heapq.heappop(heap)  # stale: re-ranked, held or gone
                continue
            if key in protected:
                skipped.append(heapq.heappop(heap))
                continue
            found = key
            break
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def ordered(self) -> list[str]:
        """The keys that are not held, lowest rank first (O(n log n); for tests and reports)."""
        return [k for k in sorted(self._rank, key=self._rank.__getitem__) if k not in self._held]

    def _push(self, rank: Any, key: str) -> None:
        heap = self._heap
        heapq.heappush(heap, (rank, key))
        if len(heap) > _STALE_FACTOR * len(self._rank) + 64:
            self._heap = [(r, k) for k, r in self._rank.items() if k not in self._held]
            heapq.heapify(self._heap)


_MISSING = object()
