"""Memory tier byte budget, LRU order, pinning, leaves-first eviction, and the store's indexes and stats.

Chains in these tests: ``ROOT`` stands for a per-model root key (the parent of a prompt's first chunk, never
an entry itself); ``chain("x", 3)`` stores ``x0 -> x1 -> x2`` under it.
"""

from __future__ import annotations

import pytest
import torch

from kvboost.cache import KVEntry, KVStore, LRUEviction, MemoryTier, segment_only_key
from kvboost.kv.sizing import parse_bytes
from kvboost.quant.none import RawKV

ROOT = "root"


def entry(
    key: str,
    tokens: int = 4,
    parent: str | None = ROOT,
    pinned: bool = False,
    first: int = 0,
    segment: str | None = None,
    exact: bool = True,
) -> KVEntry:
    k = torch.zeros(2, 1, tokens, 8)
    ids = (first, *range(1, tokens))
    segment = segment or "s-" + key
    if not exact:
        key, parent = segment_only_key(segment), None
    return KVEntry(key, segment, parent, ids, 0, RawKV(k, k.clone()), pinned=pinned, exact=exact)


BYTES = entry("x").nbytes  # 512 bytes per 4-token entry


def chain(store: KVStore, name: str, length: int = 3) -> list[str]:
    keys = [f"{name}{i}" for i in range(length)]
    for i, key in enumerate(keys):
        assert store.put(entry(key, parent=keys[i - 1] if i else ROOT))
    return keys


def assert_no_stranded(store: KVStore) -> None:
    """Every resident exact entry's parent is resident, or is the root key."""
    for tier in store.tiers:
        for key in tier.keys():
            e = tier.peek(key)
            if e.exact:
                assert e.parent_key == ROOT or e.parent_key in store, f"{key} stranded: parent {e.parent_key} gone"


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes(1024) == 1024
    for bad in ("lots", "-1", 0):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_a_memory_tier_with_a_device_moves_payloads_there():
    """``MemoryTier(device=...)`` (the host tier below a GPU's pool, ``kv.host_bytes``) keeps its payloads on its
    device, whatever device they came from; the byte budget counts them the same."""
    tier = MemoryTier(capacity=4 * BYTES, device="meta")
    tier.put(entry("a"))
    stored = tier.peek("a").payload
    assert stored.keys.device.type == "meta" and stored.values.device.type == "meta"
    assert tier.used_bytes == BYTES


def test_budget_is_never_exceeded_and_lru_goes_first():
    tier = MemoryTier(capacity=3 * BYTES)
    for name in "abc":
        assert tier.put(entry(name)) == []
    tier.get("a")  # a is now the most recent; b the least
    evicted = tier.put(entry("d"))
    assert [e.key for e in evicted] == ["b"]
    assert tier.used_bytes <= tier.capacity_bytes
    assert set(tier.keys()) == {"a", "c", "d"}


def test_pinned_entries_survive_and_oversized_entries_are_rejected():
    tier = MemoryTier(capacity=2 * BYTES)
    tier.put(entry("pinned", pinned=True))
    tier.put(entry("b"))
    evicted = tier.put(entry("c"))
    assert [e.key for e in evicted] == ["b"] and "pinned" in tier
    big = entry("big", tokens=64)
    assert tier.put(big) == [big] and "big" not in tier


def test_a_rejected_put_evicts_nothing():
    """The old tier evicted what it could, then found the rest pinned and rejected the entry anyway."""
    tier = MemoryTier(capacity=2 * BYTES)
    tier.put(entry("pinned", pinned=True))
    tier.put(entry("b"))
    double = entry("double", tokens=8)
    assert double.nbytes == 2 * BYTES
    assert tier.put(double) == [double]
    assert set(tier.keys()) == {"pinned", "b"} and tier.used_bytes == 2 * BYTES


def test_replacing_an_entry_does_not_evict_others():
    tier = MemoryTier(capacity=2 * BYTES)
    tier.put(entry("a"))
    tier.put(entry("b"))
    assert tier.put(entry("a")) == [] and set(tier.keys()) == {"a", "b"} and tier.used_bytes == 2 * BYTES


def test_lru_victim_skips_protected():
    lru = LRUEviction()
    for k in "xyz":
        lru.on_insert(k)
    assert lru.victim() == "x"
    assert lru.victim(protected={"x"}) == "y"
    lru.on_remove("y")
    assert lru.victim(protected={"x"}) == "z"
    assert LRUEviction().leaves_first and not LRUEviction(leaves_first=False).leaves_first


def test_memory_tier_builds_its_policy_from_a_name_a_config_or_an_instance():
    assert MemoryTier(BYTES).eviction.leaves_first
    assert not MemoryTier(BYTES, eviction={"name": "lru", "leaves_first": False}).eviction.leaves_first
    policy = LRUEviction(leaves_first=False)
    assert MemoryTier(BYTES, eviction=policy).eviction is policy


# ---------------------------------------------------------------------------------------------- leaves first
def test_leaves_first_never_strands_a_chain():
    """Three unrelated conversations of 3 chunks in a 5-chunk budget: the old LRU evicted each chain from its
    root (inserted first), leaving descendants that prefix lookup can never reach."""
    store = KVStore([MemoryTier(capacity=5 * BYTES)])
    chains = [chain(store, name) for name in "abc"]
    store.verify()
    assert store.stats.evicted == 4
    resident = set(store.tiers[0].keys())
    assert set(chains[2]) <= resident  # the newest chain is complete
    assert resident == {"b0", "b1", "c0", "c1", "c2"}  # a2, a1, a0, then b2: always a leaf
    assert_no_stranded(store)


def test_leaves_first_evicts_leaves_only_at_every_step():
    store = KVStore([MemoryTier(capacity=4 * BYTES)])
    evicted_order = []
    for name in "abcd":
        before = set(store.tiers[0].keys())
        chain(store, name)
        gone = before - set(store.tiers[0].keys())
        evicted_order += sorted(gone)
        for key in gone:  # each evicted key had no resident child when it went
            assert not store.has_children(key)
        assert_no_stranded(store)
    assert evicted_order  # the budget was exceeded
    assert {"d0", "d1", "d2"} <= set(store.tiers[0].keys())  # the newest chain is complete


def test_plain_lru_without_leaves_first_strands_descendants():
    store = KVStore([MemoryTier(capacity=5 * BYTES, eviction={"name": "lru", "leaves_first": False})])
    for name in "abc":
        chain(store, name)
    resident = set(store.tiers[0].keys())
    assert resident == {"b1", "b2", "c0", "c1", "c2"}  # insertion order: a0, a1, a2, b0 went first
    assert "b0" not in store and store.peek("b1").parent_key == "b0"  # b1, b2: unreachable from the root
    with pytest.raises(AssertionError, match="stranded"):
        assert_no_stranded(store)


def test_a_parent_with_a_pinned_child_is_never_evicted():
    store = KVStore([MemoryTier(capacity=3 * BYTES)])
    store.put(entry("p"))
    store.put(entry("child", parent="p", pinned=True))
    for i in range(5):
        store.put(entry(f"n{i}"))
    assert "p" in store and "child" in store
    assert set(store.tiers[0].keys()) == {"p", "child", "n4"}
    # once the pinned child is gone, the parent is a leaf like any other
    store.remove("child")
    store.put(entry("m"))
    store.put(entry("m2"))
    assert "p" not in store and {"n4", "m", "m2"} == set(store.tiers[0].keys())


def test_the_parent_of_the_entry_being_put_is_not_evicted_for_it():
    """Storing a child by evicting its parent would strand the child at once; the old tier did it."""
    store = KVStore([MemoryTier(capacity=BYTES)])
    store.put(entry("p"))
    assert not store.put(entry("c", parent="p"))
    assert "p" in store and "c" not in store and store.stats.rejected == 1
    assert store.put(entry("q"))  # an unrelated entry may evict p
    assert "p" not in store


def test_when_everything_is_protected_the_new_entry_is_rejected():
    store = KVStore([MemoryTier(capacity=3 * BYTES)])
    chain(store, "a")  # a0 and a1 have children; a2 is a leaf
    store.put(entry("a2", parent="a1", pinned=True))  # now the only leaf is pinned
    assert not store.put(entry("x"))
    assert set(store.tiers[0].keys()) == {"a0", "a1", "a2"}
    store.verify()


def test_one_put_can_evict_a_whole_chain_leaf_first():
    """Each victim chosen during a put counts as gone, so its parent becomes a leaf for the next victim."""
    store = KVStore([MemoryTier(capacity=2 * BYTES)])
    store.put(entry("p"))
    store.put(entry("c", parent="p"))
    assert store.put(entry("double", tokens=8))
    assert set(store.tiers[0].keys()) == {"double"} and store.stats.evicted == 2
    store.verify()


def test_two_tiers_never_drop_a_parent_before_its_children():
    fast, slow = MemoryTier(capacity=2 * BYTES), MemoryTier(capacity=3 * BYTES)
    store = KVStore([fast, slow])
    for name in "abc":
        chain(store, name)
        store.verify()
        assert_no_stranded(store)
        assert len(store) <= 5
    # a full fast tier holding c0 -> c1 keeps both (c0 has a child there, c1 is c2's parent): c2 goes to the
    # slow tier, whose leaves (a2, a1, a0, b2) were dropped; parents were demoted below their children
    assert {"c0", "c1"} == set(fast.keys()) and {"b0", "b1", "c2"} == set(slow.keys())
    assert store.stats.demoted > 0 and store.stats.evicted == 9 - 5


def test_promotion_keeps_the_books():
    fast, slow = MemoryTier(capacity=BYTES), MemoryTier(capacity=4 * BYTES)
    store = KVStore([fast, slow])
    store.put(entry("a"))
    store.put(entry("b"))  # a demoted
    assert "a" in slow and "b" in fast and store.stats.demoted == 1
    assert store.get("a") is not None  # promoted; b demoted
    assert "a" in fast and "b" in slow
    assert store.stats.promoted == 1 and store.stats.demoted == 2
    assert store.stats.per_tier_hits == {"memory#1": 1}
    store.get("a")
    assert store.stats.per_tier_hits == {"memory#1": 1, "memory#0": 1}
    store.verify()


class CountingTier(MemoryTier):
    """A memory tier that counts the puts it receives."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity=capacity)
        self.puts = 0

    def put(self, e: KVEntry) -> list[KVEntry]:
        self.puts += 1
        return super().put(e)


def test_write_through_copies_every_put_and_eviction_then_writes_nothing():
    fast, slow = MemoryTier(capacity=2 * BYTES), CountingTier(capacity=4 * BYTES)
    store = KVStore([fast, slow], write_through=[False, True])
    store.put(entry("a"))
    assert "a" in fast and "a" in slow and slow.puts == 1 and store.stats.written_through == 1
    store.put(entry("b"))
    store.put(entry("c"))  # fast evicts a: its copy in slow is where it lives now, no write
    assert "a" not in fast and "a" in slow and slow.puts == 3 and store.stats.demoted == 1
    store.verify()
    assert store.get("a") is not None  # promoted; the copy stays in slow (no second write, nothing removed)
    assert "a" in fast and "a" in slow and slow.puts == 3 and store.stats.promoted == 1
    store.verify()
    store.remove("a")  # the entry and its copy
    assert "a" not in fast and "a" not in slow and "a" not in store
    store.verify()


def test_a_copy_the_write_through_tier_evicts_is_dropped_and_the_entry_stays():
    fast, slow = MemoryTier(capacity=4 * BYTES), MemoryTier(capacity=2 * BYTES)
    store = KVStore([fast, slow], write_through=[False, True])
    for key in "abc":
        store.put(entry(key))
    assert set(fast.keys()) == {"a", "b", "c"} and set(slow.keys()) == {"b", "c"}  # a's copy made room
    assert store.stats.evicted == 0 and len(store) == 3
    store.verify()


def test_write_through_settings_are_checked():
    with pytest.raises(ValueError, match="below the first"):
        KVStore([MemoryTier(capacity=BYTES), MemoryTier(capacity=BYTES)], write_through=[True, False])
    with pytest.raises(ValueError, match="names 1 tiers"):
        KVStore([MemoryTier(capacity=BYTES), MemoryTier(capacity=BYTES)], write_through=[False])


# ---------------------------------------------------------------------------------------------- indexes
def test_store_indexes_follow_evictions():
    store = KVStore([MemoryTier(capacity=2 * BYTES)])
    store.put(entry("a", parent=ROOT))
    store.put(entry("b", parent="a"))
    assert store.children(ROOT) == ["a"] and store.children("a") == ["b"]
    assert store.has_children("a") and not store.has_children("b")
    assert store.has_segment("s-b") and store.find_segment("s-b").key == "b"
    store.put(entry("c", parent=ROOT))  # evicts the leaf b, not a (a has a child)
    assert "b" not in store and "a" in store and store.children("a") == [] and not store.has_children("a")
    assert not store.has_segment("s-b") and store.find_segment("s-b") is None
    assert sorted(store.children(ROOT)) == ["a", "c"]
    assert store.summary()["evicted"] == 1
    store.verify()


def test_store_rejects_what_no_tier_holds():
    store = KVStore([MemoryTier(capacity=BYTES)])
    assert not store.put(entry("huge", tokens=16))
    assert "huge" not in store and store.children(ROOT) == [] and not store.has_segment("s-huge")
    assert store.stats.rejected == 1 and store.stats.stored == 0


def test_children_with_first_token_is_exact_and_follows_evictions_and_removals():
    store = KVStore([MemoryTier(capacity=6 * BYTES)])
    store.put(entry("sys"))
    for i in range(4):  # conversations after a shared system prompt: first tokens 7, 8, 7, 9
        store.put(entry(f"conv{i}", parent="sys", first=(7, 8, 7, 9)[i]))
    store.put(entry("other", parent="elsewhere", first=7))
    assert store.children_with_first_token("sys", 7) == ["conv0", "conv2"]  # in insertion order
    assert store.children_with_first_token("sys", 8) == ["conv1"]
    assert store.children_with_first_token("sys", 5) == []
    assert store.children_with_first_token("nobody", 7) == []
    assert sorted(store.children("sys")) == ["conv0", "conv1", "conv2", "conv3"]
    store.remove("conv0")
    assert store.children_with_first_token("sys", 7) == ["conv2"]
    store.put(entry("new", parent=ROOT))
    store.put(entry("new2", parent=ROOT))  # full: the oldest leaf (conv1) goes, not sys (the oldest)
    assert "sys" in store and store.children_with_first_token("sys", 8) == []
    store.put(entry("conv2b", parent="sys", first=7))  # evicts conv2, now the oldest leaf
    store.put(entry("conv2b", parent="sys", first=7))  # a replace-put does not duplicate the key
    assert store.children_with_first_token("sys", 7) == ["conv2b"] and len(store) == 6
    store.clear()
    assert store.children_with_first_token("sys", 7) == [] and len(store) == 0
    store.verify()


def test_segment_only_entries_are_leaves_outside_the_tree():
    store = KVStore([MemoryTier(capacity=4 * BYTES)])
    seg = entry("doc", exact=False, segment="s-doc")
    assert seg.key == "seg:s-doc" and store.put(seg)
    assert store.children(ROOT) == [] and store.has_segment("s-doc")
    assert store.summary()["segment_only_entries"] == 1 and store.summary()["exact_entries"] == 0
    store.verify()


def test_find_segment_prefers_exact_counts_an_access_and_follows_removals():
    store = KVStore([MemoryTier(capacity=3 * BYTES)])
    store.put(entry("doc", exact=False, segment="s-doc"))
    store.put(entry("exact-doc", segment="s-doc"))
    store.put(entry("filler"))
    assert store.find_segment("s-doc").key == "exact-doc"
    assert store.stats.per_tier_hits == {"memory": 1}
    # the access made exact-doc recent: the next eviction takes the segment-only entry, then filler
    store.put(entry("n1"))
    assert "seg:s-doc" not in store and "exact-doc" in store and store.has_segment("s-doc")
    store.remove("exact-doc")
    assert not store.has_segment("s-doc") and store.find_segment("s-doc") is None
    store.put(entry("doc", exact=False, segment="s-doc"))
    assert store.find_segment("s-doc").key == "seg:s-doc"
    assert not store.has_segment("s-missing") and store.find_segment("s-missing") is None
    store.verify()


def test_has_segment_does_not_count_an_access():
    store = KVStore([MemoryTier(capacity=2 * BYTES)])
    store.put(entry("a"))
    store.put(entry("b"))
    assert store.has_segment("s-a")
    store.put(entry("c"))  # a is still the least recent
    assert "a" not in store and store.stats.per_tier_hits == {}


def test_touch_chain_makes_the_root_most_recent():
    store = KVStore([MemoryTier(capacity=3 * BYTES, eviction={"name": "lru", "leaves_first": False})])
    for key in ("x", "y", "z"):
        store.put(entry(key))
    store.touch_chain(["x", "y"])  # y touched first, then x
    store.put(entry("w"))
    assert "z" not in store
    store.put(entry("v"))
    assert "y" not in store and "x" in store


def test_stats_counters_and_summary():
    fast, slow = MemoryTier(capacity=2 * BYTES), MemoryTier(capacity=2 * BYTES)
    store = KVStore([fast, slow])
    for key in "abcde":
        store.put(entry(key))
    assert not store.put(entry("huge", tokens=64))
    s = store.stats
    assert (s.stored, s.rejected, s.demoted, s.evicted) == (5, 1, 3, 1)
    assert set(fast.keys()) == {"d", "e"} and set(slow.keys()) == {"b", "c"}  # a was dropped
    store.get("b")  # in the slow tier: promoted, and d (least recent in fast) demoted into b's room
    assert (s.promoted, s.demoted, s.evicted) == (1, 4, 1)
    assert set(fast.keys()) == {"e", "b"} and set(slow.keys()) == {"c", "d"}
    assert store.get("missing") is None and s.per_tier_hits == {"memory#1": 1}
    summary = store.summary()
    for name in ("exact_hits", "partial_hits", "content_hits", "misses", "stored", "rejected", "evicted",
                 "demoted", "promoted", "hit_tokens", "content_hit_tokens", "per_tier_hits"):  # fmt: skip
        assert name in summary
    assert summary["entries"] == 4 == len(store)
    assert summary["tiers"] == [
        {"tier": "memory#0", "entries": 2, "used_bytes": 2 * BYTES, "capacity_bytes": 2 * BYTES},
        {"tier": "memory#1", "entries": 2, "used_bytes": 2 * BYTES, "capacity_bytes": 2 * BYTES},
    ]
    summary["per_tier_hits"]["memory#1"] = 99  # a copy
    assert s.per_tier_hits == {"memory#1": 1}
    store.verify()


def test_put_replaces_an_entry_in_any_tier():
    fast, slow = MemoryTier(capacity=BYTES), MemoryTier(capacity=2 * BYTES)
    store = KVStore([fast, slow])
    store.put(entry("a"))
    store.put(entry("b"))  # a demoted
    pinned = entry("a", pinned=True)
    assert store.put(pinned)  # replaces the slow-tier copy
    assert store.peek("a") is pinned and len(store) == 2 and "a" not in slow
    store.verify()


def test_a_store_adopts_entries_already_in_its_tiers():
    tier = MemoryTier(capacity=3 * BYTES)
    tier.put(entry("a"))
    tier.put(entry("b", parent="a"))
    store = KVStore([tier])
    assert store.children("a") == ["b"] and "a" in store and len(store) == 2
    store.put(entry("c"))
    store.put(entry("d"))  # a has a resident child: b goes first
    assert "a" in store and "b" not in store
    store.verify()
