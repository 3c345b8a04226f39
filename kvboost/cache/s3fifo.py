"""S3-FIFO eviction: a small probationary FIFO, a main FIFO with 2-bit reinsertion, and a ghost FIFO."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvboost.cache.eviction_base import EvictionPolicy
from kvboost.registry import EVICTION

#: Access counts saturate here (two bits, as in the paper).
MAX_FREQ = 3


@EVICTION.register("s3fifo")
class S3FIFOEviction(EvictionPolicy):
    """S3-FIFO (Juncheng Yang, Yazhuo Zhang, Ziyue Qiu, Yao Yue, Rashmi Vinayak: "FIFO queues are all you need
    for cache eviction", SOSP 2023, https://doi.org/10.1145/3600006.3613147), adapted to this interface.

    The algorithm: new keys enter a small FIFO ``S`` (about 10% of the cache); a key found in the ghost FIFO
    ``G`` (keys recently evicted from ``S``, no data) enters the main FIFO ``M`` instead. Hits only bump a
    2-bit counter (no queue movement). To evict, while ``S`` holds at least ``small_ratio`` of the entries, the
    head of ``S`` is examined: accessed at least ``move_to_main_threshold`` times -> moved to the tail of ``M``
    with its counter cleared; otherwise evicted, its key remembered in ``G``. Otherwise the head of ``M`` is
    examined: counter > 0 -> reinserted at the tail of ``M`` with the counter decremented (FIFO-reinsertion /
    2-bit CLOCK); 0 -> evicted. ``G`` is a FIFO holding up to ``ghost_ratio`` times as many keys as the cache
    holds entries (the paper: as many as ``M``; libCacheSim's default 0.9).

    Adaptations (the interface counts entries, ``victim`` is a query, some keys are protected):

    - Sizes are entry counts, not bytes: the policy never sees bytes, and the tier's byte budget decides how
      many entries fit. "``S`` is over its target" means ``len(S) >= small_ratio * (len(S) + len(M))``, i.e.
      measured against the entries resident now, which is the cache's capacity in entries once it is full.
      With chunks of a fixed token count (the ``fixed`` chunker) entries are nearly equal-sized, so counts
      track bytes closely.
    - ``victim`` performs the algorithm's *lazy* moves (``S`` -> ``M`` promotions, ``M`` reinsertions with the
      counter decremented) while it searches, but never drops a key: the key it names stays tracked, at the
      head of its queue, until the tier calls ``on_remove``; calling ``victim`` again names it again. So a
      ``victim`` call whose eviction does not happen (a rejected put) has still aged the keys it passed,
      which is what the algorithm would have done on its way to that victim anyway.
    - A key joins ``G`` only when it leaves ``S`` as a victim named by ``victim`` (an eviction); explicit
      removals (``KVStore.remove``, a replaced entry) and evictions from ``M`` do not enter ``G``.
    - Protected keys (pinned, or with resident children under ``leaves_first``) are passed over: one at the
      head of ``S`` (not promoted) is moved to the tail of ``S``, still on probation; one at the head of ``M``
      is moved to the tail of ``M`` with its counter unchanged. Moving them keeps each search amortised
      ``O(1)`` instead of rescanning the same protected chain prefixes at every eviction. A chain's internal
      nodes are touched with its leaves whenever the chain is hit (``KVStore.touch_chain``), so a hit chain
      still gets promoted as a whole and a never-hit chain still leaves from ``S``, tail first.
    - Keys the tier cannot evict now (``set_evictable(key, False)``: the pool tier's busy, pinned and parent
      entries) leave their queue, keeping their counter, and return to its tail when released -- where a search
      passing over them as protected would have moved them -- so a search never walks over them. They still
      count in the sizes (``S``'s share, the ghost's length): they are resident.
    - If the preferred queue has nothing evictable the other one is searched, so ``victim`` returns None only
      when every tracked key is protected (the ``EvictionPolicy`` contract).
    - A new key always enters ``S`` (the paper's original version; libCacheSim's later variant puts keys in
      ``M`` while the cache fills, which needs to know when the cache is full).

    ``move_to_main_threshold``: the paper's text says an object accessed while in ``S`` moves to ``M``
    (threshold 1, the default here); libCacheSim's ``S3FIFO.c`` defaults to 2. The store's lookup counts one
    prefix hit as two accesses (``get`` while walking the chain, then ``touch_chain``), so in the engine one
    hit reaches both thresholds, and a once-hit entry in ``M`` survives two reinsertion passes, not one.

    Args:
        leaves_first: see ``EvictionPolicy``.
        small_ratio: target share of the entries in the small FIFO (0 < small_ratio < 1; paper: 0.1).
        ghost_ratio: ghost FIFO length as a share of the resident entries (>= 0; 0 disables the ghost).
        move_to_main_threshold: accesses while in ``S`` that promote a key to ``M`` (>= 1).
    """

    def __init__(
        self,
        leaves_first: bool = True,
        small_ratio: float = 0.1,
        ghost_ratio: float = 0.9,
        move_to_main_threshold: int = 1,
    ) -> None:
        super().__init__(leaves_first=leaves_first)
        if not 0.0 < float(small_ratio) < 1.0:
            raise ValueError(f"s3fifo: small_ratio must be in (0, 1), got {small_ratio!r}")
        if float(ghost_ratio) < 0.0:
            raise ValueError(f"s3fifo: ghost_ratio must be >= 0, got {ghost_ratio!r}")
        if isinstance(move_to_main_threshold, bool) or not isinstance(move_to_main_threshold, int) or not (
            1 <= move_to_main_threshold <= MAX_FREQ
        ):
            raise ValueError(f"s3fifo: move_to_main_threshold must be an integer in [1, {MAX_FREQ}], "
                             f"got {move_to_main_threshold!r}")  # fmt: skip
        self.small_ratio = float(small_ratio)
        self.ghost_ratio = float(ghost_ratio)
        self.move_to_main_threshold = move_to_main_threshold
        self._small: OrderedDict[str, None] = OrderedDict()  # head (first) = oldest
        self._main: OrderedDict[str, None] = OrderedDict()
        self._ghost: OrderedDict[str, None] = OrderedDict()
        self._freq: dict[str, int] = {}  # resident keys only
        self._named_small: set[str] = set()  # keys victim() named from S and that have not moved since
        self._held: dict[str, bool] = {}  # keys out of their queue (set_evictable): key -> it belongs to S
        self._held_small = 0  # how many of them belong to S

    # ------------------------------------------------------------------ introspection (tests, reports)
    def queue_of(self, key: str) -> str | None:
        """``"small"``, ``"main"``, ``"ghost"`` or None (a held key: the queue it returns to)."""
        if key in self._held:
            return "small" if self._held[key] else "main"
        if key in self._small:
            return "small"
        if key in self._main:
            return "main"
        if key in self._ghost:
            return "ghost"
        return None

    def tracked(self) -> int:
        """How many keys are tracked (small + main; not the ghosts). Not ``__len__``: an empty policy is truthy."""
        return len(self._small) + len(self._main) + len(self._held)

    # ------------------------------------------------------------------ policy
    def on_insert(self, key: str) -> None:
        if key in self._freq:  # a re-insert replaces the entry: it starts again (not as a ghost hit)
            self._drop(key)
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None
        self._freq[key] = 0

    def on_access(self, key: str) -> None:
        freq = self._freq.get(key)
        if freq is not None:
            if freq < MAX_FREQ:
                self._freq[key] = freq + 1
            self._named_small.discard(key)

    def on_remove(self, key: str) -> None:
        if key not in self._freq:
            return
        evicted_from_small = key in self._named_small and key in self._small
        self._drop(key)
        if evicted_from_small:
            self._remember(key)

    tracks_evictable = True

    def set_evictable(self, key: str, evictable: bool) -> None:
        if key not in self._freq:
            return
        if not evictable and key not in self._held:
            small = key in self._small
            (self._small if small else self._main).pop(key, None)
            self._held[key] = small
            self._held_small += small
            self._named_small.discard(key)
        elif evictable and key in self._held:
            small = self._held.pop(key)
            self._held_small -= small
            (self._small if small else self._main)[key] = None

    def victim(self, protected: Container[str] = ()) -> str | None:
        total = len(self._small) + len(self._main) + len(self._held)
        if total == 0:
            return None
        if self._small and len(self._small) + self._held_small >= self.small_ratio * total:
            key = self._search_small(protected)
            return key if key is not None else self._search_main(protected)
        key = self._search_main(protected)
        if key is not None:
            return key
        key = self._search_small(protected)  # its promotions may give M an evictable key
        return key if key is not None else self._search_main(protected)

    # ------------------------------------------------------------------ internals
    def _drop(self, key: str) -> None:
        self._freq.pop(key, None)
        self._held_small -= self._held.pop(key, False)
        self._small.pop(key, None)
        self._main.pop(key, None)
        self._named_small.discard(key)

    def _remember(self, key: str) -> None:
        """Put an evicted key at the tail of the ghost FIFO, trimming it to its share of the resident entries."""
        limit = int(self.ghost_ratio * max(self.tracked(), 1))
        if limit <= 0:
            self._ghost.clear()
            return
        self._ghost[key] = None
        self._ghost.move_to_end(key)
        while len(self._ghost) > limit:
            self._ghost.popitem(last=False)

    def _search_small(self, protected: Container[str]) -> str | None:
        """Examine each key of S once from the head: promote the accessed ones to M, pass over the protected
        ones (to the tail of S), name the first other one (left at the head)."""
        for _ in range(len(self._small)):
            key = next(iter(self._small))
            if self._freq[key] >= self.move_to_main_threshold:
                del self._small[key]
                self._main[key] = None
                self._freq[key] = 0
                self._named_small.discard(key)
            elif key in protected:
                self._small.move_to_end(key)
            else:
                self._named_small.add(key)
                return key
        return None

    def _search_main(self, protected: Container[str]) -> str | None:
        """FIFO-reinsertion over M: pass over protected keys (to the tail, counter kept), reinsert accessed keys
        with the counter decremented, name the first unprotected key whose counter is 0 (left at the head).
        Every counter is at most ``MAX_FREQ``, so ``MAX_FREQ + 1`` passes always reach one if any exists."""
        size = len(self._main)
        unprotected = False
        for step in range((MAX_FREQ + 1) * size):
            if step == size and not unprotected:
                return None  # a whole pass found only protected keys
            key = next(iter(self._main))
            if key in protected:
                self._main.move_to_end(key)
                continue
            unprotected = True
            freq = self._freq[key]
            if freq > 0:
                self._freq[key] = freq - 1
                self._main.move_to_end(key)
                continue
            return key
        return None
