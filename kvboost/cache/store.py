"""The KV store: tiers stacked fastest-first, plus the indexes the engine's lookup needs."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvboost.cache.entry import KVEntry
from kvboost.cache.tier_base import CacheTier


@dataclass
class StoreStats:
    """Counters since the last reset (chunks, not tokens, unless named so)."""

    exact_hits: int = 0
    partial_hits: int = 0
    misses: int = 0
    stored: int = 0
    rejected: int = 0
    evicted: int = 0
    demoted: int = 0
    promoted: int = 0
    hit_tokens: int = 0
    per_tier_hits: dict[str, int] = field(default_factory=dict)


class KVStore:
    """Entries by prefix-chained key across tiers; children-by-parent and content indexes.

    An entry evicted from tier i moves to tier i+1 (if any), and is dropped from the indexes only when
    it leaves the last tier. A hit in a lower tier is promoted to the first.
    """

    def __init__(self, tiers: Sequence[CacheTier]) -> None:
        if not tiers:
            raise ValueError("the KV store needs at least one cache tier")
        self.tiers = list(tiers)
        self._children: dict[str, set[str]] = defaultdict(set)
        self._by_content: dict[str, set[str]] = defaultdict(set)
        self._parent_of: dict[str, tuple[str, str]] = {}  # key -> (parent_key, content_key)
        self.stats = StoreStats()

    # ------------------------------------------------------------------ reads
    def _find(self, key: str, count_access: bool) -> tuple[int, KVEntry] | None:
        for i, tier in enumerate(self.tiers):
            entry = tier.get(key) if count_access else tier.peek(key)
            if entry is not None:
                return i, entry
        return None

    def get(self, key: str) -> KVEntry | None:
        """The entry under ``key`` (promoted to the first tier if it was lower), or None."""
        found = self._find(key, count_access=True)
        if found is None:
            return None
        tier_idx, entry = found
        name = getattr(self.tiers[tier_idx], "registry_name", str(tier_idx))
        self.stats.per_tier_hits[name] = self.stats.per_tier_hits.get(name, 0) + 1
        if tier_idx > 0:
            self.tiers[tier_idx].remove(key)
            self.stats.promoted += 1
            self._put_into(0, entry)
        return entry

    def peek(self, key: str) -> KVEntry | None:
        found = self._find(key, count_access=False)
        return None if found is None else found[1]

    def __contains__(self, key: object) -> bool:
        return any(key in tier for tier in self.tiers)

    def children(self, parent_key: str) -> list[str]:
        """Keys of stored chunks that directly follow the chunk ``parent_key`` (or a root key: prompt start)."""
        return list(self._children.get(parent_key, ()))

    def with_content(self, content_key: str) -> list[str]:
        """Keys of stored chunks with these tokens, at any position/history."""
        return list(self._by_content.get(content_key, ()))

    def touch_chain(self, keys: Iterable[str]) -> None:
        """Mark a chain of hits as used, deepest first, so its root ends up most recent."""
        for key in reversed(list(keys)):
            for tier in self.tiers:
                if key in tier:
                    tier.touch(key)
                    break

    # ------------------------------------------------------------------ writes
    def put(self, entry: KVEntry) -> bool:
        """Store ``entry`` in the first tier; returns False if no tier could hold it."""
        if entry.key in self:
            self.remove(entry.key)
        self._index(entry)
        stored = self._put_into(0, entry)
        if stored:
            self.stats.stored += 1
        return stored

    def _put_into(self, tier_idx: int, entry: KVEntry) -> bool:
        overflow = self.tiers[tier_idx].put(entry)
        stored = True
        for out in overflow:
            if out is entry:
                stored = False
            if tier_idx + 1 < len(self.tiers):
                self.stats.demoted += 1
                if not self._put_into(tier_idx + 1, out) and out is entry:
                    stored = False
                elif out is entry:
                    stored = True
            else:
                if out is entry:
                    self.stats.rejected += 1
                else:
                    self.stats.evicted += 1
                self._unindex(out.key)
        return stored

    def remove(self, key: str) -> KVEntry | None:
        found = None
        for tier in self.tiers:
            entry = tier.remove(key)
            found = found or entry
        self._unindex(key)
        return found

    def clear(self) -> None:
        for tier in self.tiers:
            tier.clear()
        self._children.clear()
        self._by_content.clear()
        self._parent_of.clear()

    def _index(self, entry: KVEntry) -> None:
        self._children[entry.parent_key].add(entry.key)
        self._by_content[entry.content_key].add(entry.key)
        self._parent_of[entry.key] = (entry.parent_key, entry.content_key)

    def _unindex(self, key: str) -> None:
        links = self._parent_of.pop(key, None)
        if links is None:
            return
        parent, content = links
        for index, idx_key in ((self._children, parent), (self._by_content, content)):
            bucket = index.get(idx_key)
            if bucket is not None:
                bucket.discard(key)
                if not bucket:
                    del index[idx_key]

    # ------------------------------------------------------------------ stats
    def __len__(self) -> int:
        return sum(len(t) for t in self.tiers)

    def summary(self) -> dict[str, object]:
        s = self.stats
        return {
            "entries": len(self),
            "tiers": [
                {"tier": getattr(t, "registry_name", "?"), "entries": len(t), "used_bytes": t.used_bytes,
                 "capacity_bytes": t.capacity_bytes}
                for t in self.tiers
            ],  # fmt: skip
            "exact_hits": s.exact_hits,
            "partial_hits": s.partial_hits,
            "misses": s.misses,
            "hit_tokens": s.hit_tokens,
            "stored": s.stored,
            "rejected": s.rejected,
            "evicted": s.evicted,
            "demoted": s.demoted,
            "promoted": s.promoted,
        }
