"""Memory tier byte budget, LRU order, pinning, and the store's indexes."""

from __future__ import annotations

import pytest
import torch

from kvboost.cache import KVEntry, KVStore, LRUEviction, MemoryTier, parse_bytes
from kvboost.quant.none import RawKV


def entry(key: str, tokens: int = 4, parent: str = "root", pinned: bool = False) -> KVEntry:
    k = torch.zeros(2, 1, tokens, 8)
    return KVEntry(key, "c-" + key, parent, tuple(range(tokens)), 0, RawKV(k, k.clone()), pinned=pinned)


BYTES = entry("x").nbytes  # 512 bytes per 4-token entry


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes(1024) == 1024
    for bad in ("lots", "-1", 0):
        with pytest.raises(ValueError):
            parse_bytes(bad)


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


def test_lru_victim_skips_protected():
    lru = LRUEviction()
    for k in "xyz":
        lru.on_insert(k)
    assert lru.victim() == "x"
    assert lru.victim(protected={"x"}) == "y"
    lru.on_remove("y")
    assert lru.victim(protected={"x"}) == "z"


def test_store_indexes_follow_evictions():
    store = KVStore([MemoryTier(capacity=2 * BYTES)])
    store.put(entry("a", parent="root"))
    store.put(entry("b", parent="a"))
    assert store.children("root") == ["a"] and store.with_content("c-b") == ["b"]
    store.touch_chain(["a", "b"])  # root of the chain ends most recent
    store.put(entry("c", parent="root"))
    assert "b" not in store and store.children("a") == []
    assert store.summary()["evicted"] == 1


def test_store_rejects_what_no_tier_holds():
    store = KVStore([MemoryTier(capacity=BYTES)])
    assert not store.put(entry("huge", tokens=16))
    assert "huge" not in store and store.children("root") == []
