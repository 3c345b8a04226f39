"""The memory tier that is the KV pool: cache entries as runs of the pool's blocks (``BlockRun``).

One KV memory and one reference count (``kvboost.kv.pool``): a request's block table holds references to its
blocks; storing its chunks registers them here (the pool counts each block's *cached* users; an entry holds no
reference), so when the request lets its blocks go, the cached ones stay, idle, with their rows. A later prompt
with the same prefix takes references on them again (a hit). When ``alloc`` runs short of free blocks, the pool
asks the store to evict idle entries (:meth:`PoolTier.evict_one`), in the eviction policy's order.

- Only an idle entry is evicted (every block unreferenced): evicting one a running request shares would free
  nothing and throw away a live prefix.
- A pin is a reference: a pinned entry's blocks are held by this tier, so they are never idle.
- ``capacity`` bounds the cached blocks (``used_bytes``), as a memory tier's byte budget does: ``put`` makes room for
  the entry's blocks not cached yet by evicting idle entries in policy order (never the entry itself, nor its
  parent, under leaves-first), and refuses the entry, evicting nothing, when that cannot free enough (the store
  then offers it to the next tier). The pool's own size bounds everything else (running requests' blocks).
- The tier holds only ``BlockRun`` payloads of its pool; ``put`` refuses anything else.
"""

from __future__ import annotations

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
        if entry.pinned:
            self._pin(entry)
        self.eviction.on_insert(entry.key)
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
        pinned = self._pins.pop(key, None)
        self.pool.unmark_cached(entry.payload.blocks)
        if pinned is not None:
            self.pool.decref(pinned)
        return entry

    def evict_one(self) -> KVEntry | None:
        """Remove the policy's next idle, unpinned victim (leaves first) and return it (:meth:`_evict`); None when
        there is none."""
        if not self._entries:
            return None
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
        return []

    def _pin(self, entry: KVEntry) -> None:
        blocks = entry.payload.blocks
        self.pool.incref(blocks)
        self._pins[entry.key] = blocks
        entry.pinned = True

    # ------------------------------------------------------------------ listing
    def pinned_keys(self) -> list[str]:
        return list(self._pins)

    def stats(self) -> dict[str, object]:
        return {"cached_blocks": self.pool.num_cached, "idle_blocks": self.pool.num_idle, "pinned": len(self._pins)}
