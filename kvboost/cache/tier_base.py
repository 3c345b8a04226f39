"""Cache tier interface: a key -> KVEntry store with a byte budget, and the guard its eviction honours."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Container, Iterator
from typing import Any

from kvboost.cache.entry import KVEntry

#: ``resident_children(key)``: how many exact entries whose parent is ``key`` are resident in this tier or a
#: faster one, per the store's books when the current ``put`` began.
ResidentChildren = Callable[[str], int]


class CacheTier(ABC):
    """One level of the KV store (memory, disk, ...). It moves entries; the store keeps the indexes.

    Contract (tests/test_cache_conformance.py runs it on every registered tier, built as
    ``CACHE_TIERS.build({"name": ..., "capacity": ...})``):

    - ``put`` stores the entry (replacing one with the same key) and returns the entries it evicted to stay
      within ``capacity_bytes``; the entry just put is returned too, as rejected and not stored, when it
      alone exceeds the budget or when everything else is protected. The returned entries are no longer in
      the tier; nothing else leaves the tier during a put.
    - ``used_bytes <= capacity_bytes`` after every ``put``.
    - ``put`` never evicts a protected entry (see ``EvictionGuard``): pinned entries; and, unless the
      eviction policy has ``leaves_first=False``, entries that still have children resident in this tier
      or a faster one (``bind_store``), and the parent of the entry being put. A tier never given a
      ``resident_children`` callable (used alone, outside a store) treats every entry as a leaf.
    - ``get`` returns the stored entry or None and counts as an access for eviction; ``peek`` does not
      count; ``remove`` returns the removed entry or None; a removed key is never returned again.
    """

    registry_name: str = "?"
    capacity_bytes: int
    _resident_children: ResidentChildren | None = None
    #: Set by the owning store: True when no tier is below this one (what it evicts leaves the store, and only
    #: the evicted entries' keys and books are used), so a tier below memory may return them without payload.
    last_in_store: bool = False
    #: True for a tier that may lose an entry on its own (a damaged or vanished file): ``get``/``peek`` then
    #: return None for a key it still listed, and the store forgets the entry (a miss).
    may_lose_entries: bool = False
    #: True when the entries outlive the process (``KVStore.close`` spills the faster tiers into it).
    persistent: bool = False
    #: True for the tier whose entries are runs of KV pool blocks (``kvboost.cache.pool_tier``); the store gives
    #: every other tier a standalone copy of the rows.
    holds_blocks: bool = False

    def bind_store(self, resident_children: ResidentChildren | None,
                   is_copy: Callable[[str], bool] | None = None) -> None:  # fmt: skip
        """Called by the ``KVStore`` that owns this tier (a tier belongs to one store). ``is_copy(key)``: whether
        the tier holds ``key`` as a write-through copy of an entry that lives in a faster tier."""
        self._resident_children = resident_children
        self._is_copy = is_copy

    def is_copy(self, key: str) -> bool:
        """Whether ``key`` is a write-through copy here (its entry lives in a faster tier); False if unbound."""
        fn = getattr(self, "_is_copy", None)
        return fn(key) if fn is not None else False

    def resident_children(self, key: str) -> int:
        """The bound store's count of children of ``key`` in this tier or a faster one (0 if unbound)."""
        fn = self._resident_children
        return fn(key) if fn is not None else 0

    @abstractmethod
    def put(self, entry: KVEntry) -> list[KVEntry]: ...

    @abstractmethod
    def get(self, key: str) -> KVEntry | None: ...

    @abstractmethod
    def peek(self, key: str) -> KVEntry | None:
        """Like get, without counting an access."""

    @abstractmethod
    def remove(self, key: str) -> KVEntry | None: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def keys(self) -> Iterator[str]: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    def peek_meta(self, key: str) -> KVEntry | None:
        """Like peek, but only the entry's books (key, parent, segment, token ids, start, flags, nbytes) are
        needed: a tier below memory may return it with a payload that is not loaded."""
        return self.peek(key)

    def bind_context(self, *, fingerprint: str | Callable[[], str] | None = None,
                     quantizer_settings: dict[str, object] | None = None) -> None:  # fmt: skip
        """The engine's fingerprint (or a callable giving the current one) and quantizer settings, for tiers
        that serialise entries (a record carries them; a record of another fingerprint is never served)."""

    def flush(self) -> None:
        """Wait until every write this tier has accepted is durable (no-op for memory)."""

    def close(self) -> None:
        """Flush and release the tier's resources (threads, files); no-op for memory."""
        self.flush()

    def stats(self) -> dict[str, object]:
        """Tier-specific counters for ``KVStore.summary`` (none for memory)."""
        return {}

    def discard(self, key: str) -> None:
        """Remove ``key`` when its entry is not needed (a tier below memory need not load it first)."""
        self.remove(key)

    def touch(self, key: str) -> None:
        """Mark ``key`` as used now (for eviction order) without returning it."""
        self.get(key)

    def clear(self) -> None:
        for key in list(self.keys()):
            self.remove(key)

    def evict_one(self) -> KVEntry | None:
        """Remove and return the entry the eviction policy would evict next (protected entries stay); None when
        there is none. The pool tier implements it: the store calls it when the pool runs short of free blocks."""
        return None

    def set_pinned(self, key: str, pinned: bool) -> list[KVEntry] | None:
        """Pin (protect from eviction) or unpin ``key``; returns what the tier evicted doing so (a record tier
        rewrites the record with the flag), or None when it does not hold ``key``."""
        entry = self.peek(key)
        if entry is None:
            return None
        if entry.pinned == pinned:
            return []
        return [out for out in self.put(dataclasses.replace(entry, pinned=pinned)) if out.key != key]


class DictTier(CacheTier):
    """A tier whose entries are Python objects in a dict (memory, the pool): lookups and listing, with accesses told
    to ``self.eviction``. Subclasses put and remove."""

    eviction: Any
    _entries: dict[str, KVEntry]

    def get(self, key: str) -> KVEntry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self.eviction.on_access(key)
        return entry

    def peek(self, key: str) -> KVEntry | None:
        return self._entries.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> Iterator[str]:
        return iter(list(self._entries))


class EvictionGuard:
    """The lazy ``protected`` container a tier passes to ``EvictionPolicy.victim`` during one ``put``.

    A write-through copy is never protected (its entry lives in a faster tier). Another key is protected if it
    is pinned, or, with ``leaves_first``: if it is the parent of the entry being put (evicting it would strand the new entry at once), or if it still has a resident child. The
    store's count (``tier.resident_children``) was taken before the put; the tier reports each entry it
    evicts with ``evicted`` so that a parent whose last child was just evicted becomes a leaf for the
    next victim of the same put. Membership tests only; it cannot be iterated.
    """

    __slots__ = ("_evicted_children", "_incoming_parent", "_pinned", "_tier", "leaves_first")

    def __init__(self, tier: CacheTier, pinned: Container[str], leaves_first: bool, incoming: KVEntry) -> None:
        self._tier = tier
        self._pinned = pinned
        self.leaves_first = leaves_first
        self._incoming_parent = incoming.parent_key if incoming.exact else None
        self._evicted_children: Counter[str] = Counter()

    def evicted(self, entry: KVEntry) -> None:
        """``entry`` left the tier during this put: one resident child less for its parent (unless it was a
        write-through copy: the child still lives in a faster tier)."""
        if entry.exact and entry.parent_key is not None and not self._tier.is_copy(entry.key):
            self._evicted_children[entry.parent_key] += 1

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str) and self._tier.is_copy(key):
            return False  # a write-through copy: its entry lives above, dropping the copy loses nothing
        if key in self._pinned:
            return True
        if not self.leaves_first or not isinstance(key, str):
            return False
        if key == self._incoming_parent:
            return True
        return self._tier.resident_children(key) > self._evicted_children.get(key, 0)


class OrSet:
    """``key in guard or key in extra`` (the guard plus the victims already chosen in this put)."""

    __slots__ = ("extra", "guard")

    def __init__(self, guard: EvictionGuard, extra: set[str]) -> None:
        self.guard, self.extra = guard, extra

    def __contains__(self, key: object) -> bool:
        return key in self.extra or key in self.guard


def choose_victims(
    tier: CacheTier, policy: Any, pinned: Container[str], incoming: KVEntry, need: int,
    books: Callable[[str], KVEntry | None],
) -> list[str] | None:  # fmt: skip
    """The keys ``tier`` must evict, in ``policy``'s order, to free ``need`` bytes for ``incoming``; None when
    everything left is protected (the put is then rejected and nothing is evicted).

    Shared by every tier's ``put``. ``books(key)`` gives the tier's entry (a payload-less one is enough: only
    its size and chain links are read); a key the policy names that the tier does not hold is a policy bug.
    """
    guard = EvictionGuard(tier, pinned, getattr(policy, "leaves_first", True), incoming)
    chosen = OrSet(guard, {incoming.key})
    victims: list[str] = []
    while need > 0:
        key = policy.victim(protected=chosen)
        if key is None:
            return None
        entry = books(key)
        if entry is None:
            raise RuntimeError(
                f"eviction policy {getattr(policy, 'registry_name', policy)!r} named a key this tier does not hold "
                f"({key[:16]}...): it missed an on_remove"
            )
        victims.append(key)
        chosen.extra.add(key)
        guard.evicted(entry)
        need -= entry.nbytes
    return victims
