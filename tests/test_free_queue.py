"""The pool tier's evictable queue (issue 61): ``alloc`` takes the eviction policy's first evictable entry without
walking over the entries requests, pins or cached children hold, in the configured policy's order; evicted entries
reach the tier below through its writer thread (bounded queue, backpressure), never written on the allocating
thread.

Examples first, then a hypothesis state machine over a pool, its pool tier (each built-in policy) and a disk tier
below, checking after every step: each block is exactly one of free, idle-cached (indexed by an entry) or
referenced; the evictable set is what the entries' blocks, pins and children say; the policy's next victim is the
one an independent model of its order picks; no pinned entry is ever evicted; and every entry evicted to the disk
tier reads back with its rows once the writer drained.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Container

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kvboost.cache.block_run import BlockRun
from kvboost.cache.disk import DiskTier, _DiskWriter
from kvboost.cache.entry import KVEntry
from kvboost.cache.eviction_base import EvictionPolicy
from kvboost.cache.pool_tier import PoolTier
from kvboost.cache.store import KVStore
from kvboost.kv import KVPool, PoolExhausted
from kvboost.registry import EVICTION

BS = 4  # tokens per block


def make_pool(blocks: int) -> KVPool:
    return KVPool(num_layers=1, num_kv_heads=1, head_dim=2, num_blocks=blocks, block_size=BS)


def write_marker(pool: KVPool, block: int, value: float) -> None:
    """Rows of ``block`` all equal to ``value`` (so a copy read back elsewhere can be told apart)."""
    rows = torch.full((1, 1, BS, 2), float(value))
    pool.write(pool.slots([block], 0, BS), rows, -rows)


def entry(pool: KVPool, key: str, block: int, parent: str = "root", pinned: bool = False) -> KVEntry:
    return KVEntry(key, "s" + key, parent, tuple(range(BS)), 0, BlockRun(pool, [block], 0, BS), pinned=pinned)


def cached_pool(blocks: int, policy: object = "lru", *, held: int = 0) -> tuple[KVPool, KVStore, list[int]]:
    """Every block cached as one flat entry ``k<i>`` (inserted in block order); the first ``held`` stay
    referenced (a running request), the others idle. Returns the held blocks."""
    pool = make_pool(blocks)
    store = KVStore([PoolTier(pool, policy)])
    ids = pool.alloc(blocks)
    for i, b in enumerate(ids):
        store.put(entry(pool, f"k{i}", b))
    pool.decref(ids[held:])
    return pool, store, ids[:held]


# ---------------------------------------------------------------------------------------------- the queue
def test_alloc_does_not_walk_over_entries_requests_hold(monkeypatch):
    """The victim search's work does not grow with the number of held entries ahead of the victim. Before the
    queue, every eviction checked each held entry's blocks (``PoolTier.busy`` -> ``KVPool.refcount``): this
    count grew with ``held`` (10 vs 200 here)."""
    counts = {}
    for held in (10, 200):
        pool, store, _ = cached_pool(256, held=held)
        calls = 0
        real = KVPool.refcount

        def counting(self, block, real=real):
            nonlocal calls
            calls += 1
            return real(self, block)

        monkeypatch.setattr(KVPool, "refcount", counting)
        pool.alloc(1)
        monkeypatch.setattr(KVPool, "refcount", real)
        counts[held] = calls
        assert f"k{held}" not in store  # the oldest idle entry went
        assert all(f"k{i}" in store for i in range(held))  # no held one did
    assert counts[10] == counts[200], counts


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_released_entry_goes_back_to_its_place_in_the_policys_order(policy):
    """Holding a key takes it out of the victim search, not out of the order: released, it is the victim again
    if it still ranks first (LRU: last use; LFU: uses, then last use)."""
    pool, store, _ = cached_pool(4, policy)
    tier = store.tiers[0]
    assert tier.eviction.victim() == "k0"
    pool.incref([0])  # a request takes k0's block (as a hit would, without counting an access)
    assert tier.eviction.victim() == "k1" and not tier.evictable("k0")
    pool.decref([0])
    assert tier.eviction.victim() == "k0"  # its place, not the most recent one
    store.get("k0")  # a use: k0 is now the most recent (and, LFU, the most used)
    assert tier.eviction.victim() == "k1"
    tier.verify()


def test_leaves_first_evicts_a_chain_from_its_tail_and_never_a_pin():
    pool = make_pool(4)
    store = KVStore([PoolTier(pool, "lru")])
    ids = pool.alloc(4)
    store.put(entry(pool, "a", ids[0]))
    store.put(entry(pool, "b", ids[1], parent="a"))
    store.put(entry(pool, "c", ids[2], parent="b"))
    store.put(entry(pool, "pin", ids[3], pinned=True))
    pool.decref(ids)
    tier = store.tiers[0]
    assert tier.eviction.victim() == "c"  # a and b have cached children; pin is referenced by its pin
    gone: list[str] = []
    for _ in range(3):
        pool.alloc(1)  # kept (referenced): each call must evict
        gone += [k for k in "abc" if k not in store and k not in gone]
    assert gone == ["c", "b", "a"] and "pin" in store
    with pytest.raises(PoolExhausted):
        pool.alloc(1)
    assert "pin" in store
    tier.verify()
    pool.verify()


def test_a_policy_that_does_not_track_evictable_keys_still_works():
    """A third-party policy without ``set_evictable`` gets the held keys in ``protected``, as before."""

    class Fifo(EvictionPolicy):
        registry_name = "test-fifo"

        def __init__(self) -> None:
            super().__init__()
            self.keys: dict[str, None] = {}

        def on_insert(self, key: str) -> None:
            self.keys[key] = None

        def on_access(self, key: str) -> None:
            pass

        def on_remove(self, key: str) -> None:
            self.keys.pop(key, None)

        def victim(self, protected: Container[str] = ()) -> str | None:
            return next((k for k in self.keys if k not in protected), None)

    pool, store, _ = cached_pool(8, Fifo(), held=3)
    pool.alloc(2)
    assert [k for k in (f"k{i}" for i in range(8)) if k not in store] == ["k3", "k4"]
    store.tiers[0].verify()


@pytest.mark.parametrize("name", EVICTION.names())
def test_every_tracking_policy_never_names_a_held_key_and_names_it_again_once_released(name):
    """``set_evictable`` conformance for each registered policy that declares ``tracks_evictable``: evicting all
    keys one by one never names a held key; released, it is named (and the policy ends empty)."""
    policy = EVICTION.build(name)
    if not getattr(policy, "tracks_evictable", False):
        pytest.skip(f"{name} does not track evictable keys")
    keys = [f"k{i}" for i in range(8)]
    for key in keys:
        policy.on_insert(key)
    policy.on_access("k3")
    held = {"k0", "k3", "k5"}
    for key in held:
        policy.set_evictable(key, False)
    named = []
    while (key := policy.victim()) is not None:
        assert key not in held
        named.append(key)
        policy.on_remove(key)
    assert sorted(named) == sorted(set(keys) - held)
    for key in held:
        policy.set_evictable(key, True)
    while (key := policy.victim()) is not None:
        named.append(key)
        policy.on_remove(key)
    assert sorted(named) == keys
    policy.set_evictable("gone", True)  # unknown keys are ignored


# ---------------------------------------------------------------------------------------------- spills
def spill_scene(tmp_path, blocks: int = 8, **disk) -> tuple[KVPool, KVStore, DiskTier]:
    pool = make_pool(blocks)
    tier = DiskTier(tmp_path / "kv", fsync=False, background_bytes=0, **disk)
    store = KVStore([PoolTier(pool, "lru"), tier])
    ids = pool.alloc(blocks)
    for i, b in enumerate(ids):
        write_marker(pool, b, i + 1)
        store.put(entry(pool, f"k{i}", b))
    pool.decref(ids)
    return pool, store, tier


def test_evicted_entries_are_written_by_the_writer_thread_and_read_back(tmp_path, monkeypatch):
    stored_on = []
    real = _DiskWriter._store

    def spy(self, job, header, data):
        stored_on.append(threading.current_thread().name)
        return real(self, job, header, data)

    monkeypatch.setattr(_DiskWriter, "_store", spy)
    pool, store, disk = spill_scene(tmp_path)
    main = threading.current_thread().name
    pool.alloc(3)  # evicts k0..k2 to the disk tier
    store.flush()
    assert len(stored_on) == 3 and main not in stored_on and set(stored_on) == {"kvboost-disk-writer"}
    for i in range(3):
        assert store.in_first_tier(f"k{i}") is False and f"k{i}" in disk
        got = store.peek(f"k{i}").payload
        assert torch.equal(got.keys, torch.full_like(got.keys, i + 1))


def test_a_full_write_queue_makes_the_eviction_wait_for_the_writer(tmp_path, monkeypatch):
    """Backpressure: with the queue full, the eviction's put waits until the writer has made room (counted in
    ``write_stalls`` and ``write_stall_ms``); nothing is dropped."""
    gate = threading.Event()
    real = _DiskWriter._store

    def slow(self, job, header, data):
        gate.wait(10)
        return real(self, job, header, data)

    monkeypatch.setattr(_DiskWriter, "_store", slow)
    one = make_pool(1).row_bytes * BS  # one entry's payload bytes
    pool, store, disk = spill_scene(tmp_path, max_pending_bytes=one)
    threading.Timer(0.2, gate.set).start()
    pool.alloc(3)
    stats = disk.stats()
    assert stats["write_stalls"] >= 1 and stats["write_stall_ms"] >= 100
    store.flush()
    assert all(f"k{i}" in disk and store.peek(f"k{i}") is not None for i in range(3))


def test_a_failed_write_is_logged_and_counted_and_the_entry_becomes_a_miss(tmp_path, monkeypatch, caplog):
    def broken(self, job, header, data):
        raise OSError("disk full")

    monkeypatch.setattr(_DiskWriter, "_store", broken)
    pool, store, disk = spill_scene(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvboost"):
        pool.alloc(2)
        store.flush()
    assert disk.stats()["write_errors"] == 2
    assert any("disk full" in r.getMessage() for r in caplog.records)
    assert store.get("k0") is None and "k0" not in store  # a miss: the store forgets it


def test_close_drains_the_queue_and_a_reopened_tier_finds_the_spills(tmp_path):
    pool, store, disk = spill_scene(tmp_path)
    pool.alloc(2)
    store.close(spill=False)  # only what was evicted
    assert disk.stats()["pending_writes"] == 0
    again = DiskTier(tmp_path / "kv", fsync=False, background_bytes=0)
    assert sorted(again.keys()) == ["k0", "k1"]
    again.close()


# ---------------------------------------------------------------------------------------------- state machine
class _OrderModel:
    """An independent model of the LRU / LFU order: rank = (uses, last use) for LFU, (last use,) for LRU."""

    def __init__(self, policy: str) -> None:
        self.lfu = policy == "lfu"
        self.clock = 0
        self.rank: dict[str, tuple[int, ...]] = {}

    def insert(self, key: str) -> None:
        self.clock += 1
        self.rank[key] = (1, self.clock) if self.lfu else (self.clock,)

    def access(self, key: str) -> None:
        if key in self.rank:
            self.clock += 1
            self.rank[key] = (self.rank[key][0] + 1, self.clock) if self.lfu else (self.clock,)

    def remove(self, key: str) -> None:
        self.rank.pop(key, None)


class FreeQueueMachine(RuleBasedStateMachine):
    """Requests allocate, cache and release chains of blocks; hits, pins, unpins and allocations under pressure
    interleave; a disk tier takes what the pool evicts."""

    BLOCKS = 12

    def __init__(self) -> None:
        super().__init__()
        self.store: KVStore | None = None

    @initialize(policy=st.sampled_from(["lru", "lfu", "s3fifo"]), leaves_first=st.booleans(),
                capacity=st.sampled_from([None, 8]))  # fmt: skip
    def start(self, policy, leaves_first, capacity):
        """``capacity``: cached blocks the pool tier keeps at most (8 of 12: puts evict to make room)."""
        import tempfile

        self.tmp = tempfile.TemporaryDirectory()
        self.policy = policy
        self.pool = make_pool(self.BLOCKS)
        self.disk = DiskTier(self.tmp.name, fsync=False, background_bytes=0)
        self.tier = PoolTier(self.pool, {"name": policy, "leaves_first": leaves_first},
                             capacity=None if capacity is None else capacity * self.pool.block_bytes)
        self.store = KVStore([self.tier, self.disk])
        self.model = _OrderModel(policy)
        self.serial = 0
        self.holders: list[list[int]] = []  # running requests and readers: the blocks each references
        self.marker: dict[str, float] = {}  # key -> its rows' value
        self.pinned: set[str] = set()
        self.chains: list[str] = []  # last key of each chain stored (a later request may extend it)

    def teardown(self):
        if self.store is not None:
            self.store.close(spill=False)
            self.tmp.cleanup()

    # ---------------------------------------------------------------- rules
    @rule(n=st.integers(1, 4), extend=st.booleans(), pin=st.booleans())
    def request(self, n, extend, pin):
        """A request allocates ``n`` blocks, computes them and stores one entry per block, as a chain (extending
        a stored chain's tail, or from the root); it keeps running (its references stay)."""
        try:
            ids = self.pool.alloc(n)
        except PoolExhausted:
            return
        self._settle()
        parent = self.chains[-1] if extend and self.chains and self.chains[-1] in self.store else "root"
        for b in ids:
            self.serial += 1
            key = f"e{self.serial}"
            write_marker(self.pool, b, self.serial)
            self.marker[key] = self.serial
            if self.store.put(entry(self.pool, key, b, parent=parent)) and self.store.in_first_tier(key):
                self.model.insert(key)
                parent = key
            self._settle()  # the put may have evicted others to make room
        self.chains.append(parent)
        if pin and parent != "root" and self.store.in_first_tier(parent):
            assert self.store.set_pinned(parent, True)
            self.pinned.add(parent)
        self.holders.append(ids)

    @precondition(lambda self: self.holders)
    @rule(i=st.integers(0, 100))
    def finish(self, i):
        self.pool.decref(self.holders.pop(i % len(self.holders)))

    @precondition(lambda self: self.tier._entries)
    @rule(i=st.integers(0, 100), access=st.booleans())
    def hit(self, i, access):
        """A lookup takes references on a cached entry's blocks (and, ``access``, counts a use)."""
        keys = sorted(self.tier._entries)
        key = keys[i % len(keys)]
        blocks = list(self.tier._entries[key].payload.blocks)
        self.pool.incref(blocks)
        if access:
            self.store.get(key)
            self.model.access(key)
        self.holders.append(blocks)

    @precondition(lambda self: self.pinned)
    @rule(i=st.integers(0, 100))
    def unpin(self, i):
        key = sorted(self.pinned)[i % len(self.pinned)]
        self.pinned.discard(key)
        assert self.store.set_pinned(key, False)

    @rule(n=st.integers(1, 6))
    def pressure(self, n):
        """An allocation that must evict; handed back at once."""
        try:
            ids = self.pool.alloc(n)
        except PoolExhausted:  # reclaim evicted until nothing evictable was left
            assert self.pool.num_free < n
            assert not [k for k in self.tier._entries if self._evictable(k)]
            return
        self._settle()
        self.pool.decref(ids)

    @rule()
    def drain(self):
        """Once the writer drained, every entry the pool evicted to the disk tier reads back with its rows."""
        self.store.flush()
        for key in list(self.disk.keys()):
            got = self.store.peek(key)
            assert got is not None, key
            assert torch.equal(got.payload.keys, torch.full_like(got.payload.keys, self.marker[key]))

    # ---------------------------------------------------------------- invariants
    def _settle(self) -> None:
        """Forget in the order model the entries that left the pool tier."""
        for key in list(self.model.rank):
            if key not in self.tier._entries:
                self.model.remove(key)

    def _evictable(self, key: str) -> bool:
        e = self.tier._entries[key]
        if key in self.tier._pins or all(self.pool.refcount(b) for b in e.payload.blocks):
            return False
        if not self.tier.eviction.leaves_first:
            return True
        return not any(c.parent_key == key for c in self.tier._entries.values())

    @invariant()
    def books(self):
        if self.store is None:
            return
        self.pool.verify()
        self.tier.verify()
        self.store.verify()

    @invariant()
    def every_block_is_in_one_state(self):
        if self.store is None:
            return
        indexed = {b for e in self.tier._entries.values() for b in e.payload.blocks}
        held = [b for blocks in self.holders for b in blocks]
        pins = [b for blocks in self.tier._pins.values() for b in blocks]
        for b in range(self.BLOCKS):
            refs = self.pool.refcount(b)
            assert refs == held.count(b) + pins.count(b), b  # a block's count is its holders
            free, idle, used = refs == 0 and b not in indexed, refs == 0 and b in indexed, refs > 0
            assert free + idle + used == 1, b
            assert self.pool.is_cached(b) == (b in indexed), b

    @invariant()
    def the_queue_is_the_policys_order(self):
        if self.store is None:
            return
        self._settle()
        evictable = {k for k in self.tier._entries if self._evictable(k)}
        assert self.tier._evictable == evictable
        victim = self.tier.eviction.victim()
        if self.policy == "s3fifo":
            assert (victim is None) == (not evictable) and (victim is None or victim in evictable)
        else:
            expected = min(evictable, key=self.model.rank.__getitem__, default=None)
            assert victim == expected

    @invariant()
    def pins_stay(self):
        if self.store is None:
            return
        for key in self.pinned:
            assert self.store.in_first_tier(key), key


def test_free_queue_state_machine():
    run_state_machine_as_test(FreeQueueMachine, settings=settings(
        max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)))
