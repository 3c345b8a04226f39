"""The memory tier that is the KV pool: cache entries as runs of the pool's blocks (``BlockRun``).

One KV memory and one reference count (``kvboost.kv.pool``): a request's block table holds references to its
blocks; storing its chunks registers them here (the pool counts each block's *cached* users; an entry holds no
reference), so when the request lets its blocks go, the cached ones stay, idle, with their rows. A later prompt
with the same prefix takes references on them again (a hit). When ``alloc`` runs short of free blocks, the pool
asks the store to evict idle entries (:meth:`PoolTier.evict_one`), in the eviction policy's order.

- Only an entry with an idle block is evicted: evicting one whose every block a running request (or a pin)
  holds would free nothing and throw away a live prefix.
- The evictable entries are kept apart, in the policy's order (the idea of vLLM v1's ``FreeKVCacheBlockQueue``,
  at the granularity of this tier's entries and with the configured policy's order instead of LRU only): the
  pool tells the tier when a cached block turns idle or referenced (``blocks_idle`` / ``blocks_referenced``), the
  store tells it when an entry gains or loses its last cached child (``children_changed``), and the tier tells
  the policy (``EvictionPolicy.set_evictable``). An eviction then takes the policy's first evictable entry
  without walking over the entries that requests, pins or cached children hold (before, every eviction
  skipped them one by one, and checked each one's blocks). A policy without ``tracks_evictable`` (a
  third-party plugin) gets those keys in ``protected`` instead, as before.
- A pin is a reference: a pinned entry's blocks are held by this tier, so they are never idle.
- ``capacity`` bounds the cached blocks (``used_bytes``), as a memory tier's byte budget does: ``put`` makes room for
  the entry's blocks not cached yet by evicting idle entries in policy order (never the entry itself, nor its
  parent, under leaves-first), and refuses the entry, evicting nothing, when that cannot free enough (the store
  then offers it to the next tier). The pool's own size bounds everything else (running requests' blocks).
- The tier holds only ``BlockRun`` payloads of its pool; ``put`` refuses anything else.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kvboost.cache.block_run import BlockRun, standalone
from kvboost.cache.entry import SEGMENT_ONLY_PREFIX, KVEntry
from kvboost.cache.tier_base import DictTier, EvictionGuard, OrSet, choose_victims
from kvboost.kv.pool import KVPool
from kvboost.registry import EVICTION

_NO_KEY = SEGMENT_ONLY_PREFIX + "<pool pressure>"


class _Unevictable:
    """The keys an eviction must pass over: pinned entries, and entries every block of which a request holds
    (evicting one would free nothing, and drop a prefix in use)."""

    __slots__ = ("_tier",)

    def __init__(self, tier: PoolTier) -> None:
        self._tier = tier

    def __contains__(self, key: object) -> bool:
        return key in self._tier._pins or self._tier.busy(key)  # type: ignore[arg-type]


class PoolTier(DictTier):
    """Entries over the blocks of ``pool``, evicted by ``eviction`` when the pool needs blocks.

    Args:
        pool: the engine's KV pool.
        eviction: the eviction policy (a name, a config mapping or an instance; default ``lru``).
        capacity: bytes of cached blocks kept at most (default: the pool's size).
    """

    registry_name = "memory"
    holds_blocks = True

    def __init__(self, pool: KVPool, eviction: Any = "lru", *, capacity: int | None = None) -> None:
        self.pool = pool
        self.eviction = EVICTION.build("lru" if eviction is None else eviction)
        self.capacity_bytes = pool.num_blocks * pool.block_bytes if capacity is None else int(capacity)
        self._entries: dict[str, KVEntry] = {}
        self._pins: dict[str, tuple[int, ...]] = {}  # key -> the blocks its pin references
        self._unevictable = _Unevictable(self)
        # The evictable queue's books (policies with ``tracks_evictable``; see the module docstring).
        self._tracking = bool(getattr(self.eviction, "tracks_evictable", False))
        self._entries_of: dict[int, list[str]] = {}  # block -> the keys of the entries indexing it
        self._referenced: dict[str, int] = {}  # key -> how many of its blocks have a reference
        self._evictable: set[str] = set()  # the keys the policy may name now

    # ------------------------------------------------------------------ sizes
    @property
    def used_bytes(self) -> int:
        """Bytes of the cached blocks (each counted once, however many entries index it)."""
        return self.pool.num_cached * self.pool.block_bytes

    # ------------------------------------------------------------------ entries
    def put(self, entry: KVEntry) -> list[KVEntry]:
        payload = entry.payload
        if not isinstance(payload, BlockRun) or payload.pool is not self.pool:
            return [entry]  # not rows of this pool: the next tier takes it
        victims = [] if entry.key in self._entries else self._room_for(entry)
        if victims is None:
            return [entry]  # everything that could go is protected: refused, nothing evicted
        self.pool.mark_cached(payload.blocks)  # refuses blocks no request holds; before the old run is unmarked
        evicted = [self._evict(key) for key in victims]
        if entry.key in self._entries:
            self.remove(entry.key)
        self._entries[entry.key] = entry
        self.eviction.on_insert(entry.key)
        self._track(entry)
        if entry.pinned:
            self._pin(entry)
            self._update(entry.key)
        return evicted

    def _room_for(self, entry: KVEntry) -> list[str] | None:
        """The idle entries to evict, in policy order, so that ``entry``'s blocks not cached yet fit the capacity;
        None when the unprotected ones cannot free enough. Counted in blocks: a victim frees the blocks no other
        entry indexes."""
        pool, block = self.pool, self.pool.block_bytes
        new = {b for b in entry.payload.blocks if not pool.is_cached(b)}
        over = (pool.num_cached + len(new)) * block - self.capacity_bytes
        if over <= 0:
            return []
        if len(new) * block > self.capacity_bytes:
            return None  # it could never fit
        if self._tracking:
            return self._room_tracked(entry, over)
        guard = EvictionGuard(self, self._unevictable, getattr(self.eviction, "leaves_first", True), entry)
        chosen = OrSet(guard, {entry.key})
        victims: list[str] = []
        indexed: dict[int, int] = {}  # block -> entries still indexing it if the victims so far go
        while over > 0:
            key = self.eviction.victim(protected=chosen)
            if key is None:
                return None
            victim = self._entries[key]
            victims.append(key)
            chosen.extra.add(key)
            guard.evicted(victim)
            for b in victim.payload.blocks:
                indexed[b] = indexed.get(b, pool.cached_count(b)) - 1
                if indexed[b] == 0 and not pool.refcount(b):
                    over -= block
        return victims

    def remove(self, key: str) -> KVEntry | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.eviction.on_remove(key)
        self._untrack(key, entry.payload.blocks)
        pinned = self._pins.pop(key, None)
        self.pool.unmark_cached(entry.payload.blocks)
        if pinned is not None:
            self.pool.decref(pinned)
        return entry

    def evict_one(self) -> KVEntry | None:
        """Remove the policy's next evictable victim (an idle block, unpinned, leaves first) and return it
        (:meth:`_evict`); None when there is none. ``O(log n)`` for a policy that tracks evictable keys."""
        if not self._entries:
            return None
        if self._tracking:
            key = self.eviction.victim()
            if key is None:
                return None
            if key not in self._evictable:
                raise RuntimeError(f"eviction policy {self.eviction.registry_name!r} named {key[:16]}..., which "
                                   "the pool tier holds (not evictable now): it missed a set_evictable")
            return self._evict(key)
        incoming = KVEntry(key=_NO_KEY, segment_key=_NO_KEY, parent_key=None, token_ids=(), start=0, payload=None,
                           exact=False)  # fmt: skip
        victims = choose_victims(self, self.eviction, self._unevictable, incoming, 1, self._entries.get)
        if not victims:
            return None
        return self._evict(victims[0])

    def _evict(self, key: str) -> KVEntry:
        """Remove an idle, unpinned entry; with a tier below (``last_in_store`` False) its rows are copied out first
        (``BlockRun.detached``), before its blocks can go back to the pool."""
        entry = self._entries.pop(key)
        self.eviction.on_remove(key)
        blocks = entry.payload.blocks
        self._untrack(key, blocks)
        if not self.last_in_store:
            entry = standalone(entry)
        self.pool.unmark_cached(blocks)  # a victim is never pinned; its blocks a request holds stay with it
        return entry

    def busy(self, key: str) -> bool:
        """Whether requests (or pins) hold every block of ``key``'s entry: evicting it would free nothing. An entry
        that shares only some blocks with a running request (its first block, a common system prompt) can go: its
        other blocks are freed."""
        entry = self._entries.get(key)
        return entry is not None and all(self.pool.refcount(b) for b in entry.payload.blocks)

    # ------------------------------------------------------------------ pins
    def set_pinned(self, key: str, pinned: bool) -> list[KVEntry] | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if pinned and key not in self._pins:
            self._pin(entry)
        elif not pinned and key in self._pins:
            self.pool.decref(self._pins.pop(key))
        entry.pinned = pinned
        self._update(key)
        return []

    def _pin(self, entry: KVEntry) -> None:
        blocks = entry.payload.blocks
        self.pool.incref(blocks)
        self._pins[entry.key] = blocks
        entry.pinned = True

    # ------------------------------------------------------------------ the evictable queue
    def evictable(self, key: str) -> bool:
        """Whether ``key``'s entry may be evicted now: in this tier, unpinned, some block idle and (leaves first)
        no child cached in this tier."""
        entry = self._entries.get(key)
        if entry is None or key in self._pins or self._referenced[key] >= len(entry.payload.blocks):
            return False
        return not (self.eviction.leaves_first and self.resident_children(key) > 0)

    def blocks_referenced(self, ids: list[int]) -> None:
        """The pool's ``watcher`` call: these cached blocks were idle and have a reference now."""
        self._count_referenced(ids, 1)

    def blocks_idle(self, ids: list[int]) -> None:
        """The pool's ``watcher`` call: these cached blocks lost their last reference."""
        self._count_referenced(ids, -1)

    def children_changed(self, key: str) -> None:
        """The store's call: ``key`` gained its first or lost its last child booked in this tier."""
        if key in self._entries:
            self._update(key)

    def _count_referenced(self, ids: list[int], step: int) -> None:
        # On every hit and every release, per cached block: only a count crossing "every block referenced" can
        # change an entry's evictability, so the rest costs a dict update.
        entries_of, referenced, entries = self._entries_of, self._referenced, self._entries
        for b in ids:
            keys = entries_of.get(b)
            if keys is None:
                continue
            for key in keys:
                count = referenced[key] + step
                referenced[key] = count
                full = len(entries[key].payload.blocks)
                if count == full or count == full - 1 and step < 0:
                    self._update(key)

    def _track(self, entry: KVEntry) -> None:
        """Index a new entry's blocks and tell the policy whether it is evictable (``on_insert`` made it so)."""
        key, blocks, pool = entry.key, entry.payload.blocks, self.pool
        for b in blocks:
            self._entries_of.setdefault(b, []).append(key)
        self._referenced[key] = sum(1 for b in blocks if pool.refcount(b))
        self._evictable.add(key)  # what on_insert told the policy
        self._update(key)

    def _untrack(self, key: str, blocks: tuple[int, ...]) -> None:
        for b in blocks:
            keys = self._entries_of[b]
            keys.remove(key)
            if not keys:
                del self._entries_of[b]
        del self._referenced[key]
        self._evictable.discard(key)

    def _update(self, key: str) -> None:
        """Tell the policy when ``key``'s evictability changed."""
        if not self._tracking:
            return
        now = self.evictable(key)
        if now != (key in self._evictable):
            if now:
                self._evictable.add(key)
            else:
                self._evictable.discard(key)
            self.eviction.set_evictable(key, now)

    def _room_tracked(self, entry: KVEntry, over: int) -> list[str] | None:
        """``_room_for`` with a tracking policy: the victims, in its order, that free ``over`` bytes of cached
        blocks. Chosen victims count as gone for leaves first: a parent whose cached children were all chosen is
        released in the policy for the rest of this choice (and held again after it; the real evictions, if the
        put goes ahead, release it for good through the store's books)."""
        pool, block = self.pool, self.pool.block_bytes
        chosen = {entry.key}
        leaves_first = self.eviction.leaves_first
        if leaves_first and entry.exact and entry.parent_key is not None:
            chosen.add(entry.parent_key)  # evicting it would strand the new entry at once
        victims: list[str] = []
        indexed: dict[int, int] = {}  # block -> entries still indexing it if the victims so far go
        gone: Counter[str] = Counter()  # parent -> its children among the victims
        released: list[str] = []
        try:
            while over > 0:
                key = self.eviction.victim(protected=chosen)
                if key is None:
                    return None
                victim = self._entries[key]
                victims.append(key)
                chosen.add(key)
                for b in victim.payload.blocks:
                    indexed[b] = indexed.get(b, pool.cached_count(b)) - 1
                    if indexed[b] == 0 and not pool.refcount(b):
                        over -= block
                parent = victim.parent_key if victim.exact else None
                if leaves_first and parent in self._entries and parent not in self._evictable:
                    gone[parent] += 1
                    if (self.resident_children(parent) <= gone[parent] and parent not in self._pins
                            and self._referenced[parent] < len(self._entries[parent].payload.blocks)):  # fmt: skip
                        self.eviction.set_evictable(parent, True)
                        released.append(parent)
            return victims
        finally:
            for parent in released:
                self.eviction.set_evictable(parent, False)

    def verify(self) -> None:
        """Check the evictable queue's books against the pool and the entries (AssertionError); for tests."""
        pool = self.pool
        entries_of: dict[int, list[str]] = {}
        for key, entry in self._entries.items():
            for b in entry.payload.blocks:
                entries_of.setdefault(b, []).append(key)
            assert self._referenced[key] == sum(1 for b in entry.payload.blocks if pool.refcount(b)), key
        assert {b: sorted(k) for b, k in entries_of.items()} == {b: sorted(k) for b, k in self._entries_of.items()}
        assert self._referenced.keys() == self._entries.keys()
        if self._tracking:
            assert self._evictable == {k for k in self._entries if self.evictable(k)}, "stale evictable set"

    # ------------------------------------------------------------------ listing
    def pinned_keys(self) -> list[str]:
        return list(self._pins)

    def stats(self) -> dict[str, object]:
        return {"cached_blocks": self.pool.num_cached, "idle_blocks": self.pool.num_idle, "pinned": len(self._pins)}
