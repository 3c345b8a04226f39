"""The KV store: tiers stacked fastest-first, plus the indexes the engine's lookup needs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from functools import partial, wraps
from typing import Any

from kvboost.cache.block_run import is_pooled, standalone
from kvboost.cache.entry import KVEntry, segment_only_key
from kvboost.cache.tier_base import CacheTier


@dataclass
class StoreStats:
    """Counters since the last reset (chunks, not tokens, unless named so).

    The engine's lookup counts the lookups: ``exact_hits`` (whole chunks matched by prefix key),
    ``partial_hits`` (frontier chunks matched token by token), ``content_hits`` (chunks matched by segment
    key), ``misses``, ``hit_tokens`` (all reused tokens) and ``content_hit_tokens``. The store counts the
    movements: ``stored`` (puts that some tier took), ``rejected`` (puts that no tier took), ``evicted``
    (resident entries dropped by the last tier), ``demoted`` (resident entries moved down a tier),
    ``promoted`` (hits in a lower tier moved to the first), ``written_through`` (copies put into write-through
    tiers) and ``per_tier_hits`` (``get``/``find_segment`` hits by tier name).
    """

    exact_hits: int = 0
    partial_hits: int = 0
    content_hits: int = 0
    misses: int = 0
    stored: int = 0
    rejected: int = 0
    evicted: int = 0
    demoted: int = 0
    promoted: int = 0
    written_through: int = 0
    hit_tokens: int = 0
    content_hit_tokens: int = 0
    per_tier_hits: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Node:
    """The store's books on one entry (no tensors)."""

    parent: str | None  # exact entries only
    first: int | None
    segment: str
    exact: bool
    tier: int | None = None  # the tier holding it (or, while it moves, the tier it is headed for)
    copies: set[int] | None = None  # write-through tiers below ``tier`` holding a copy
    key: str = ""


def _publishes(method: Any) -> Any:
    """A store operation after which, with KV events on (``attach_events``), the entries it moved are published:
    per key, the tiers it left and the tiers it reached, between the outermost operation's start and end (what a
    key went through in between is not published)."""

    @wraps(method)
    def wrapper(self: KVStore, *args: Any, **kwargs: Any) -> Any:
        if self.events is None:
            return method(self, *args, **kwargs)
        self._op_depth += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            self._op_depth -= 1
            if self._op_depth == 0:
                self._publish_moves()

    return wrapper


class KVStore:
    """Entries across tiers, with a prefix-tree index (children by parent and first token) and a segment index.

    ``tiers`` are ordered fastest first. New entries and hits in a lower tier go to the first tier; an entry a
    tier evicts moves to the next tier (write-back), and leaves the store (and its indexes) only when the last
    tier evicts it. Tensors move only inside the tiers; this class keeps the books.

    Write-through (``write_through[i]`` for a tier below the first): every new entry is also put into tier
    ``i`` at once, as a copy; an entry evicted from a faster tier then needs no write (its copy becomes where it
    lives), a hit served from tier ``i`` keeps its copy there when promoted, and ``close`` has nothing to spill
    for it. A copy the write-through tier evicts is simply dropped (the entry still lives above).

    Invariants (``verify`` checks them):

    - every key lives in exactly one tier (its primary) plus write-through tiers below it holding copies, and
      the indexes describe exactly the entries resident in the tiers: tiers must only be changed through the
      store (a tier belongs to one store);
    - the child index holds exact entries only, under ``(parent_key, first token id)``; segment-only
      entries (``exact=False``, key ``"seg:" + segment_key``) have no parent and no children;
    - every entry is in the segment index under its ``segment_key``;
    - leaves first: a tier never evicts a pinned entry, nor (unless its eviction policy has
      ``leaves_first=False``) an exact entry with a child resident in that tier or a faster one, nor the
      parent of the entry it is taking. An entry with a resident child thus never leaves the store before
      the child, and prefix lookup (which walks from the prompt start and stops at the first miss) can
      reach every resident exact entry whose chain was complete when stored. A parent may be demoted
      below its children (not stranding: a lower tier is still searched).

    ``remove`` does not cascade: removing a parent with resident children strands them (the engine only
    removes leaves).
    """

    def __init__(self, tiers: Sequence[CacheTier], *, write_through: Sequence[bool] | None = None) -> None:
        if not tiers:
            raise ValueError("the KV store needs at least one cache tier")
        self.tiers = list(tiers)
        flags = [False] * len(self.tiers) if write_through is None else [bool(w) for w in write_through]
        if len(flags) != len(self.tiers):
            raise ValueError(f"write_through names {len(flags)} tiers, the store has {len(self.tiers)}")
        if flags[0]:
            raise ValueError("write_through applies to tiers below the first (every put already goes to the first)")
        self.write_through = flags
        names = [getattr(t, "registry_name", "?") for t in self.tiers]
        self._tier_names = [n if names.count(n) == 1 else f"{n}#{i}" for i, n in enumerate(names)]
        self._nodes: dict[str, _Node] = {}
        # parent key -> first token id -> child keys (dicts as ordered sets: deterministic iteration)
        self._children: dict[str, dict[int | None, dict[str, None]]] = {}
        # parent key -> number of its children resident in each tier
        self._child_tiers: dict[str, list[int]] = {}
        self._segment_exact: dict[str, dict[str, None]] = {}  # segment key -> exact entries' keys
        self._segment_only = 0  # how many entries are segment-only
        self.stats = StoreStats()
        #: the KV-event sink (``kvboost.cache.events.KVEventSink``), None when events are off
        self.events: Any = None
        self._moved: dict[str, frozenset[int]] = {}  # key -> its tiers before the operation in progress
        self._op_depth = 0
        if any(t.holds_blocks for t in self.tiers[1:]):
            raise ValueError("the pool tier (runs of KV pool blocks) can only be the first tier")
        #: the KV pool whose blocks the first tier indexes (None: no pool tier); ``alloc`` asks :meth:`reclaim`
        self.pool = getattr(self.tiers[0], "pool", None) if self.tiers[0].holds_blocks else None
        if self.pool is not None:
            self.pool.cache = self
            self.pool.watcher = self.tiers[0]  # the pool tier keeps its evictable entries apart (pool_tier)
        for i, tier in enumerate(self.tiers):
            tier.bind_store(partial(self._resident_children, i), partial(self._is_copy, i))
            tier.last_in_store = i + 1 == len(self.tiers)
            for key in list(tier.keys()):  # a tier handed over with entries in it (a disk tier's records)
                entry = tier.peek_meta(key)
                if entry is None:
                    continue
                if key in self._nodes:
                    if not flags[i]:
                        raise ValueError(f"entry {key[:16]}... is in two tiers")
                    self._add_copy(self._nodes[key], i)  # a write-through tier's copy of an entry above
                    continue
                self._index(entry)
                self._book(key, i)

    @_publishes
    def refresh(self) -> int:
        """Add to the books the entries other processes wrote to shared tiers (those with a ``refresh()``, e.g.
        ``redis``) since they last looked, as construction does for the entries present then; an entry a faster
        tier of this store already holds keeps that copy. Returns the number added."""
        added = 0
        for i, tier in enumerate(self.tiers):
            refresh = getattr(tier, "refresh", None)
            if refresh is None:
                continue
            for entry in refresh():
                if entry.key in self:
                    tier.forget(entry.key)
                    continue
                self._index(entry)
                self._book(entry.key, i)
                added += 1
        return added

    # ------------------------------------------------------------------ reads
    @_publishes
    def get(self, key: str, *, access: bool = True) -> KVEntry | None:
        """The entry under ``key``, or None; promotes a lower-tier hit to the first tier.

        ``access=False``: the eviction policy is not told (the caller reports the access itself, as the lookup
        does for a chain of exact hits with ``touch_chain``: one access per hit, so frequency-based policies
        count each hit once)."""
        node = self._nodes.get(key)
        if node is None or node.tier is None:
            return None
        tier_idx = node.tier
        tier = self.tiers[tier_idx]
        entry = tier.get(key) if access else tier.peek(key)
        if entry is None:
            if tier.may_lose_entries:  # a damaged or vanished record: the tier dropped it; a miss
                self._unindex(key)
                return None
            raise RuntimeError(f"tier {self._tier_names[tier_idx]} lost {key[:16]}... behind the store's back")
        name = self._tier_names[tier_idx]
        self.stats.per_tier_hits[name] = self.stats.per_tier_hits.get(name, 0) + 1
        if tier_idx > 0 and self.pool is not None:
            # The pool tier holds runs of blocks: the request loads these rows into its own blocks, and storing
            # its chunks when it finishes moves the entry up (``put`` of a run replaces it wherever it is).
            return entry
        if tier_idx > 0 and self.write_through[tier_idx]:  # promote, keeping the record as the copy
            self._promote_over_copy(entry, tier_idx)
        elif tier_idx > 0:
            tier.remove(key)
            self._book(key, 0)
            self.stats.promoted += 1
            if self._put_into(0, entry) is None:  # no tier took it back (everything protected)
                self.stats.evicted += 1
                self._unindex(key)
        return entry

    @_publishes
    def peek(self, key: str) -> KVEntry | None:
        """The entry under ``key``, or None; no access counted, nothing moves."""
        node = self._nodes.get(key)
        if node is None or node.tier is None:
            return None
        tier = self.tiers[node.tier]
        entry = tier.peek(key)
        if entry is None and tier.may_lose_entries:  # a damaged or vanished record: the tier dropped it
            self._unindex(key)
        return entry

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def in_first_tier(self, key: str) -> bool:
        """Whether ``key`` lives in the first (fastest) tier."""
        node = self._nodes.get(key)
        return node is not None and node.tier == 0

    def __len__(self) -> int:
        return len(self._nodes)

    def children(self, parent_key: str) -> list[str]:
        """Keys of the exact entries whose parent is ``parent_key`` (a chunk key, or a root key: prompt start)."""
        by_first = self._children.get(parent_key)
        return [k for keys in by_first.values() for k in keys] if by_first else []

    def children_with_first_token(self, parent_key: str, token_id: int) -> list[str]:
        """``children(parent_key)`` restricted to those whose first token id is ``token_id``; O(matches)."""
        by_first = self._children.get(parent_key)
        if not by_first:
            return []
        return list(by_first.get(token_id, ()))

    def has_children(self, key: str) -> bool:
        """Whether some exact entry in the store (any tier) has ``key`` as its parent."""
        return key in self._children

    def segment_entry_key(self, segment_key: str) -> str | None:
        """The key ``find_segment`` serves for this segment key: the earliest-stored exact entry with it if any
        (O(1)), else the segment-only one; None if neither is stored."""
        exact = self._segment_exact.get(segment_key)
        if exact:
            return next(iter(exact))
        key = segment_only_key(segment_key)
        return key if key in self._nodes else None

    @_publishes
    def find_segment(self, segment_key: str) -> KVEntry | None:
        """The entry under ``segment_entry_key(segment_key)``, or None. Counts an access, a per-tier hit, and
        promotes, like ``get``."""
        key = self.segment_entry_key(segment_key)
        return self.get(key) if key is not None else None

    def peek_meta(self, key: str) -> KVEntry | None:
        """The books of ``key`` (token ids, links, size), or None; a tier below memory does not load the payload."""
        node = self._nodes.get(key)
        if node is None or node.tier is None:
            return None
        return self.tiers[node.tier].peek_meta(key)

    def prefetch(self, keys: Iterable[str]) -> int:
        """Start loading, in the background, the entries of ``keys`` (in this order) held by tiers that can
        (``prefetch_async``: disk, redis; memory has nothing to load); a later ``get`` of each then waits for
        that read instead of starting its own. The lookup calls it with a prompt's chain before walking it, so
        the read of chunk ``i + 1`` overlaps the work on chunk ``i``. Returns the number of reads queued."""
        by_tier: dict[int, list[str]] = {}
        for key in keys:
            node = self._nodes.get(key)
            if node is not None and node.tier is not None:
                by_tier.setdefault(node.tier, []).append(key)
        queued = 0
        for tier_idx, tier_keys in by_tier.items():
            start = getattr(self.tiers[tier_idx], "prefetch_async", None)
            if start is not None:
                queued += start(tier_keys)
        return queued

    def has_segment(self, segment_key: str) -> bool:
        """Whether an entry (exact or segment-only) has this segment key; no access counted."""
        return segment_key in self._segment_exact or segment_only_key(segment_key) in self._nodes

    def touch_chain(self, keys: Iterable[str]) -> None:
        """Mark a chain of hits as used, deepest first, so its root ends up most recent."""
        for key in reversed(list(keys)):
            node = self._nodes.get(key)
            if node is not None and node.tier is not None:
                self.tiers[node.tier].touch(key)

    # ------------------------------------------------------------------ writes
    @_publishes
    def put(self, entry: KVEntry) -> bool:
        """Store ``entry`` in the first tier that takes it (replacing an entry with the same key, wherever it
        is); returns False, with the entry not stored, if no tier could hold it."""
        node = self._nodes.get(entry.key)
        promoted = node is not None and node.tier not in (None, 0)
        if node is not None and self.pool is not None and is_pooled(entry.payload):
            if node.tier == 0:
                self.tiers[0].put(entry)  # the pool tier replaces it in place (the new run is marked first)
                return True
            if promoted and self.write_through[node.tier]:  # the record below stays, as the entry's copy
                self._promote_over_copy(entry, node.tier)
                return True
        if node is not None:
            self.remove(entry.key)
        self._index(entry)
        self._book(entry.key, 0)
        placed = self._put_into(0, entry)
        if placed is None:
            self.stats.rejected += 1
            self._unindex(entry.key)
            return False
        self.stats.stored += 1
        if promoted and placed == 0:
            self.stats.promoted += 1
        for tier_idx in range(placed + 1, len(self.tiers)):
            if self.write_through[tier_idx] and entry.key in self._nodes:
                self._copy_into(tier_idx, entry)
        return True

    def _promote_over_copy(self, entry: KVEntry, below: int) -> None:
        """Move ``entry`` (booked in write-through tier ``below``) up to the first tier, keeping the record below as
        its copy. If the first tier refuses it, it stays booked below; what the first tier evicted to take it moves
        down (or onto its copy) like any eviction, so the books always follow the tier's answer."""
        node = self._nodes[entry.key]
        self._book(entry.key, 0)
        self._add_copy(node, below)
        overflow = self.tiers[0].put(entry)
        if any(out.key == entry.key for out in overflow):
            self._drop_copy(node, below)
            self._book(entry.key, below)
        else:
            self.stats.promoted += 1
        self._evicted_from(0, [out for out in overflow if out.key != entry.key])

    def _copy_into(self, tier_idx: int, entry: KVEntry) -> None:
        """Put a write-through copy of ``entry`` (booked in a faster tier) into tier ``tier_idx``."""
        node = self._nodes[entry.key]
        self._add_copy(node, tier_idx)
        if not self.tiers[tier_idx].holds_blocks:
            entry = standalone(entry)  # a copy of the rows
        overflow = self.tiers[tier_idx].put(entry)
        if any(out.key == entry.key for out in overflow):  # refused (too large, or everything protected)
            self._drop_copy(node, tier_idx)
        else:
            self.stats.written_through += 1
        self._evicted_from(tier_idx, [out for out in overflow if out.key != entry.key])

    def _put_into(self, tier_idx: int, entry: KVEntry) -> int | None:
        """Put ``entry`` (indexed, booked at ``tier_idx`` but in no tier) into that tier or, if refused, a later
        one; cascade what the tier evicts down the tiers. Returns the index of the tier that holds it, or None
        (then it is booked nowhere; the caller unindexes it).

        Entries in flight are booked at the tier they are headed for before any of them moves on, so the
        parent of each is protected while the others are put (the tiers only see the store's counts)."""
        if not self.tiers[tier_idx].holds_blocks:
            entry = standalone(entry)  # a copy of the rows
        overflow = self.tiers[tier_idx].put(entry)
        placed = all(out.key != entry.key for out in overflow)
        last = tier_idx + 1 == len(self.tiers)
        if not placed:
            self._book(entry.key, None if last else tier_idx + 1)
        self._evicted_from(tier_idx, [out for out in overflow if out.key != entry.key])
        if placed:
            return tier_idx
        return None if last else self._put_into(tier_idx + 1, entry)

    def _evicted_from(self, tier_idx: int, evicted: list[KVEntry]) -> None:
        """Settle what tier ``tier_idx`` evicted during a put: a write-through copy is just dropped; an entry with
        a copy below now lives there (nothing to write); any other moves down a tier (or leaves the store from
        the last one)."""
        last = tier_idx + 1 == len(self.tiers)
        moving = []
        for out in evicted:
            node = self._nodes[out.key]
            if node.tier != tier_idx:  # a copy (the entry lives in a faster tier)
                self._drop_copy(node, tier_idx)
            elif node.copies:  # its copy below is the entry now
                below = min(node.copies)
                self._drop_copy(node, below)
                self._book(out.key, below)
                self.stats.demoted += 1
            else:
                moving.append(out)
        for out in moving:  # booked where they are headed before any moves, so each protects its parent
            self._book(out.key, None if last else tier_idx + 1)
        for out in moving:
            if not last:
                self.stats.demoted += 1
            if last or self._put_into(tier_idx + 1, out) is None:
                self.stats.evicted += 1
                self._unindex(out.key)

    def _add_copy(self, node: _Node, tier_idx: int) -> None:
        self._note(node.key)
        if node.copies is None:
            node.copies = set()
        node.copies.add(tier_idx)

    def _drop_copy(self, node: _Node, tier_idx: int) -> None:
        self._note(node.key)
        if node.copies:
            node.copies.discard(tier_idx)
            if not node.copies:
                node.copies = None

    @_publishes
    def remove(self, key: str) -> KVEntry | None:
        """Drop ``key`` from the store; returns its entry, or None if it was not stored. Its children stay."""
        node = self._nodes.get(key)
        if node is None:
            return None
        entry = self.tiers[node.tier].remove(key) if node.tier is not None else None
        self._book(key, None)
        self._unindex(key)  # removes the copies too
        return entry

    @_publishes
    def reclaim(self, free_blocks: int) -> int:
        """Evict idle entries of the pool tier, in its eviction order (pinned, busy and, leaves first, parents of
        resident children stay), until the pool has ``free_blocks`` free blocks or nothing more can go; returns
        the entries evicted. An evicted entry moves down a tier (a copy of its rows) or leaves the store."""
        evicted = 0
        if self.pool is None:
            return 0
        while self.pool.num_free < free_blocks:
            victim = self.tiers[0].evict_one()
            if victim is None:
                break
            evicted += 1
            self._evicted_from(0, [victim])
        return evicted

    def pinned_keys(self) -> list[str]:
        """Keys pinned in the pool tier (their blocks are held)."""
        return self.tiers[0].pinned_keys() if self.pool is not None else []

    @_publishes
    def set_pinned(self, key: str, pinned: bool) -> bool:
        """Pin (never evicted; in the pool tier a pin is a reference to the entry's blocks) or unpin ``key``;
        False when the store does not hold it."""
        node = self._nodes.get(key)
        if node is None or node.tier is None:
            return False
        overflow = self.tiers[node.tier].set_pinned(key, pinned)
        if overflow is None:
            return False
        self._evicted_from(node.tier, overflow)
        return True

    # ------------------------------------------------------------------ lifecycle (tiers below memory)
    def bind_context(self, *, fingerprint: Any = None, quantizer_settings: dict[str, Any] | None = None) -> None:
        """Hand the engine's fingerprint (a string or a callable) and quantizer settings to every tier."""
        for tier in self.tiers:
            tier.bind_context(fingerprint=fingerprint, quantizer_settings=quantizer_settings)

    def flush(self) -> None:
        """Wait until every tier's accepted writes are durable."""
        for tier in self.tiers:
            tier.flush()

    @_publishes
    def close(self, *, spill: bool = True) -> None:
        """Close every tier; first (``spill``) move the entries of each non-persistent tier down into the
        persistent tiers below it (a memory tier's entries into a disk tier), so that a next process finds them.
        Spilled entries are demoted like evicted ones (the lower tier may evict, or refuse, to make room)."""
        last_persistent = max((i for i, t in enumerate(self.tiers) if t.persistent), default=-1)
        for i in range(last_persistent) if spill else ():
            tier = self.tiers[i]
            if tier.persistent:
                continue
            for key in list(tier.keys()):  # oldest first in a memory tier
                node = self._nodes.get(key)
                if node is not None and node.tier == i and node.copies:  # already written through below
                    tier.remove(key)
                    below = min(node.copies)
                    self._drop_copy(node, below)
                    self._book(key, below)
                    continue
                entry = tier.peek(key)
                if entry is None or key not in self._nodes:
                    continue
                entry = standalone(entry)  # its rows, copied before its blocks can go back to the pool
                tier.remove(key)
                self._book(key, i + 1)
                self.stats.demoted += 1
                if self._put_into(i + 1, entry) is None:
                    self.stats.evicted += 1
                    self._unindex(key)
        if self.events is not None:
            self._publish_moves()  # the spill's events, while the tiers can still describe the entries
        for tier in self.tiers:
            tier.close()

    @_publishes
    def drop_pool_entries(self) -> None:
        """Drop the pool tier's entries (their pins go back to the pool); tiers below are left as they are (call
        after ``close`` spilled what should persist)."""
        if self.pool is None:
            return
        tier = self.tiers[0]
        for key in list(tier.keys()):
            node = self._nodes.get(key)
            tier.remove(key)
            if node is not None and node.tier == 0:
                self._unindex(key)

    @_publishes
    def clear(self) -> None:
        """Drop every entry (the stats are kept); with KV events on, publishes a ``BlockRemoved`` for every block held
        (for consumers that ignore the next event), then ``AllBlocksCleared``."""
        for tier in self.tiers:
            tier.clear()
        self._nodes.clear()
        self._children.clear()
        self._child_tiers.clear()
        self._segment_exact.clear()
        self._segment_only = 0
        if self.events is not None:
            self._moved.clear()
            self.events.emit(self.events.clear_events())

    # ------------------------------------------------------------------ KV events (kvboost.cache.events)
    @property
    def tier_names(self) -> list[str]:
        """The tiers' names (``memory``, ``disk``, ``redis``; ``name#i`` when two tiers share one); the events'
        ``medium`` of each is ``kvboost.cache.events.tier_medium`` of it."""
        return list(self._tier_names)

    def attach_events(self, sink: Any) -> None:
        """Publish this store's movements through ``sink`` (a ``KVEventSink``; None detaches). Attaching publishes
        ``AllBlocksCleared`` and then every entry the tiers already hold (a disk tier's records after a restart)."""
        self.events = sink
        self._moved.clear()
        if sink is not None:
            if hasattr(sink, "bind_store"):
                sink.bind_store(self)
            self._publish_snapshot()

    def _publish_snapshot(self, resync: bool = False) -> None:
        """``AllBlocksCleared`` and every entry the tiers hold; after lost batches (``resync``) opened by the removals
        a consumer that ignores ``AllBlocksCleared`` needs (``KVEventSink.clear_events``)."""
        events: list[Any] = self.events.clear_events(lost=resync)
        for i, tier in enumerate(self.tiers):
            for key in tier.keys():  # noqa: SIM118 (a tier, not a dict)
                entry = tier.peek_meta(key)
                stored = self.events.stored_event(entry, self._tier_names[i]) if entry is not None else None
                if stored is not None:
                    events.append(stored)
        self.events.emit(events)

    def _locations(self, key: str) -> frozenset[int]:
        node = self._nodes.get(key)
        if node is None or node.tier is None:
            return frozenset(node.copies or ()) if node is not None else frozenset()
        return frozenset({node.tier, *(node.copies or ())})

    def _note(self, key: str) -> None:
        """Remember where ``key`` was before the operation in progress moves it (KV events only)."""
        if self.events is not None and key not in self._moved:
            self._moved[key] = self._locations(key)

    def _publish_moves(self) -> None:
        """Publish the operation's net movements: ``BlockRemoved`` per tier left, ``BlockStored`` per tier reached."""
        resync = self.events.needs_resync()
        if not self._moved and not resync:
            return
        moved, self._moved = self._moved, {}
        if resync:  # the publisher dropped batches: subscribers start over from a snapshot
            self._publish_snapshot(resync=True)
            return
        removed: dict[int, list[str]] = {}
        stored: dict[int, list[str]] = {}
        for key, before in moved.items():
            after = self._locations(key)
            for t in before - after:
                removed.setdefault(t, []).append(key)
            for t in after - before:
                stored.setdefault(t, []).append(key)
        events: list[Any] = []
        for t in sorted(removed):
            gone = self.events.removed_event(removed[t], self._tier_names[t])
            if gone is not None:
                events.append(gone)
        for t in sorted(stored):
            for key in stored[t]:
                entry = self.tiers[t].peek_meta(key)
                arrived = self.events.stored_event(entry, self._tier_names[t]) if entry is not None else None
                if arrived is not None:
                    events.append(arrived)
        self.events.emit(events)

    # ------------------------------------------------------------------ bookkeeping (no tensors)
    def _index(self, entry: KVEntry) -> None:
        node = _Node(entry.parent_key if entry.exact else None, entry.first_token, entry.segment_key, entry.exact,
                     key=entry.key)
        self._nodes[entry.key] = node
        if node.exact:
            assert node.parent is not None
            self._children.setdefault(node.parent, {}).setdefault(node.first, {})[entry.key] = None
            self._segment_exact.setdefault(node.segment, {})[entry.key] = None
        else:
            self._segment_only += 1

    def _unindex(self, key: str) -> None:
        if key not in self._nodes:
            return
        self._note(key)
        self._book(key, None)
        node = self._nodes.pop(key)
        for tier_idx in node.copies or ():  # the entry leaves the store: its copies too
            self.tiers[tier_idx].discard(key)
        if not node.exact:
            self._segment_only -= 1
            return
        assert node.parent is not None
        by_first = self._children[node.parent]
        keys = by_first[node.first]
        del keys[key]
        if not keys:
            del by_first[node.first]
            if not by_first:
                del self._children[node.parent]
        seg = self._segment_exact[node.segment]
        del seg[key]
        if not seg:
            del self._segment_exact[node.segment]

    def _book(self, key: str, tier_idx: int | None) -> None:
        """Book ``key`` at tier ``tier_idx`` (None: nowhere), keeping its parent's per-tier child counts."""
        node = self._nodes[key]
        if node.tier == tier_idx:
            return
        self._note(key)
        before = node.tier
        node.tier = tier_idx
        if node.parent is not None:
            counts = self._child_tiers.get(node.parent)
            if counts is None:
                counts = self._child_tiers[node.parent] = [0] * len(self.tiers)
            if before is not None:
                counts[before] -= 1
            if tier_idx is not None:
                counts[tier_idx] += 1
            first = counts[0]
            if not any(counts):
                del self._child_tiers[node.parent]
            # the pool tier's evictable queue follows its entries' cached children (leaves first)
            if self.pool is not None and (before == 0) != (tier_idx == 0) and first == (tier_idx == 0):
                self.tiers[0].children_changed(node.parent)

    def _is_copy(self, tier_idx: int, key: str) -> bool:
        """Whether tier ``tier_idx`` holds ``key`` as a write-through copy."""
        node = self._nodes.get(key)
        return node is not None and node.tier != tier_idx and bool(node.copies) and tier_idx in node.copies

    def _resident_children(self, tier_idx: int, key: str) -> int:
        """Children of ``key`` resident in tier ``tier_idx`` or a faster one (what tier ``tier_idx`` protects)."""
        counts = self._child_tiers.get(key)
        return sum(counts[: tier_idx + 1]) if counts else 0

    def verify(self) -> None:
        """Check the books against the tiers (raises AssertionError); for tests and debugging, O(entries)."""
        where: dict[str, set[int]] = {}
        for i, tier in enumerate(self.tiers):
            assert tier.used_bytes <= tier.capacity_bytes, f"tier {i} over budget"
            for key in tier.keys():
                where.setdefault(key, set()).add(i)
        assert where.keys() == self._nodes.keys(), "index and tiers disagree on the keys"
        counts: dict[str, list[int]] = {}
        for key, node in self._nodes.items():
            copies = node.copies or set()
            assert node.copies is None or node.copies, f"{key}: empty copy set"
            assert where[key] == {node.tier} | copies, f"{key}: booked in {node.tier} + copies {copies}, found in {where[key]}"
            assert all(c > node.tier and self.write_through[c] for c in copies), f"{key}: copy outside write-through"
            entry = self.tiers[node.tier].peek_meta(key)
            assert entry is not None and entry.key == key and entry.segment_key == node.segment
            assert entry.exact == node.exact and entry.first_token == node.first
            if node.exact:
                assert node.parent == entry.parent_key
                assert key in self._children[node.parent][node.first]
                assert key in self._segment_exact[node.segment]
                counts.setdefault(node.parent, [0] * len(self.tiers))[node.tier] += 1
            else:
                assert node.parent is None and key == segment_only_key(node.segment)
        assert counts == self._child_tiers, "resident-children counts are stale"
        indexed = sum(len(keys) for by_first in self._children.values() for keys in by_first.values())
        assert indexed == len(self._nodes) - self._segment_only, "child index holds extra keys"
        assert sum(len(keys) for keys in self._segment_exact.values()) == indexed, "segment index holds extra keys"

    # ------------------------------------------------------------------ stats
    def summary(self) -> dict[str, object]:
        """Occupancy (per tier: entries, used_bytes, capacity_bytes) and every ``StoreStats`` counter."""
        out: dict[str, object] = {
            "entries": len(self),
            "exact_entries": len(self) - self._segment_only,
            "segment_only_entries": self._segment_only,
            "tiers": [
                {"tier": name, "entries": len(t), "used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes,
                 **t.stats()}
                for name, t in zip(self._tier_names, self.tiers)
            ],
        }
        for f in fields(self.stats):
            value = getattr(self.stats, f.name)
            out[f.name] = dict(value) if isinstance(value, dict) else value
        out["per_tier"] = self._per_tier(out["tiers"])  # type: ignore[arg-type]
        return out

    def _per_tier(self, tiers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Per tier: hits served, and for tiers below memory the loads, their cost (ms per MiB of record, mean ms
        per load) and how many came from a background read (``prefetch``), from the tiers' own counters."""
        out: dict[str, dict[str, Any]] = {}
        for row in tiers:
            name = row["tier"]
            cell: dict[str, Any] = {"hits": self.stats.per_tier_hits.get(name, 0), "entries": row["entries"],
                                    "used_bytes": row["used_bytes"]}  # fmt: skip
            if "reads" in row:
                loads, ms, mib = row["reads"], row.get("read_ms", 0.0), row.get("read_bytes", 0) / 2**20
                cell.update(loads=loads, load_ms=ms, load_mib=mib,
                            load_ms_per_mib=ms / mib if mib else None, load_ms_mean=ms / loads if loads else None,
                            background_used=row.get("background_used", 0),
                            background_wait_ms=row.get("background_wait_ms", 0.0))  # fmt: skip
            out[name] = cell
        return out
