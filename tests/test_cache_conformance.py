"""Conformance: every registered cache tier and eviction policy meets its family's contract.

The parametrization reads ``CACHE_TIERS.names()`` and ``EVICTION.names()`` at collection time, so a new
plugin (a module in ``kvboost/cache/`` or a third-party ``kvboost.plugins`` entry point) runs these tests
unchanged. A tier is built as ``CACHE_TIERS.build({"name": ..., "capacity": ..., "eviction": ...})``; a
policy as ``EVICTION.build(name)`` or ``{"name": ..., "leaves_first": ...}``. The contracts are written in
``kvboost/cache/tier_base.py`` (``CacheTier``) and ``kvboost/cache/eviction_base.py`` (``EvictionPolicy``).
"""

from __future__ import annotations

import random

import pytest
import torch

from kvboost.cache import CacheTier, EvictionPolicy, KVEntry, KVStore, segment_only_key
from kvboost.quant.none import RawKV
from kvboost.registry import CACHE_TIERS, EVICTION
from kvboost_testkit.redis_server import new_namespace, redis_server  # noqa: F401  (a fixture: the redis tier needs a server)

TIERS = CACHE_TIERS.names()
POLICIES = EVICTION.names()
ROOT = "root"


def _entry(key: str, tokens: int = 4, parent: str | None = ROOT, pinned: bool = False, first: int = 0,
           exact: bool = True, segment: str | None = None) -> KVEntry:  # fmt: skip
    k = torch.randn(2, 1, tokens, 8)
    segment = segment or "s-" + key
    if not exact:
        key, parent = segment_only_key(segment), None
    return KVEntry(key, segment, parent, (first, *range(1, tokens)), 0, RawKV(k, torch.randn_like(k)),
                   pinned=pinned, exact=exact)  # fmt: skip


SIZE = _entry("x").nbytes


#: Tiers that need a server: name -> options for each tier built (set per test by ``_server_backed_tiers``).
_SERVER_OPTIONS: dict[str, object] = {}


def _tier(name: str, capacity: int, eviction: object = "lru") -> CacheTier:
    extra = _SERVER_OPTIONS[name]() if name in _SERVER_OPTIONS else {}  # type: ignore[operator]
    tier = CACHE_TIERS.build({"name": name, "capacity": capacity, "eviction": eviction, **extra})
    assert isinstance(tier, CacheTier)
    return tier


@pytest.fixture(autouse=True)
def _in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # tiers that write files write them here


@pytest.fixture(autouse=True)
def _server_backed_tiers(request):
    """The redis tier runs against a real redis-server started for this module (skipped, with the reason, where
    there is none); each tier built gets its own namespace. Other tiers are built as they are."""
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    if params.get("name") == "redis" and "redis" in TIERS:
        server = request.getfixturevalue("redis_server")
        _SERVER_OPTIONS["redis"] = lambda: {"url": server.url, "namespace": new_namespace("conf")}
    yield
    _SERVER_OPTIONS.clear()


class _LazyContainer:
    """Membership only, like the tier's guard: a policy that iterates ``protected`` fails here."""

    def __init__(self, keys: set[str]) -> None:
        self.keys = keys

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def __iter__(self):
        raise AssertionError("an eviction policy must not iterate `protected`")

    def __len__(self):
        raise AssertionError("an eviction policy must not size `protected`")


# ---------------------------------------------------------------------------------------------- tiers
@pytest.mark.parametrize("name", TIERS)
def test_tier_get_peek_remove(name):
    tier = _tier(name, 4 * SIZE)
    e = _entry("a")
    assert tier.put(e) == [] and "a" in tier and len(tier) == 1 and tier.used_bytes == SIZE
    got = tier.get("a")
    assert got is not None and got.key == "a" and torch.equal(got.payload.keys, e.payload.keys)
    assert torch.equal(got.payload.values, e.payload.values) and got.token_ids == e.token_ids
    assert tier.peek("a") is not None and tier.get("missing") is None and tier.peek("missing") is None
    assert tier.put(_entry("a")) == [] and len(tier) == 1 and tier.used_bytes == SIZE  # replaced
    tier.put(_entry("b"))
    assert sorted(tier.keys()) == ["a", "b"]
    removed = tier.remove("a")
    assert removed is not None and removed.key == "a"
    assert "a" not in tier and tier.get("a") is None and tier.peek("a") is None and tier.remove("a") is None
    assert list(tier.keys()) == ["b"] and tier.used_bytes == SIZE
    tier.clear()
    assert len(tier) == 0 and tier.used_bytes == 0


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", TIERS)
def test_tier_budget_pinning_and_what_put_returns(name, policy):
    tier = _tier(name, 3 * SIZE, policy)
    tier.put(_entry("p", pinned=True))
    rng = random.Random(0)
    for i in range(20):
        before = set(tier.keys())
        e = _entry(f"n{i}", tokens=rng.choice((2, 4, 6)))
        out = tier.put(e)
        assert tier.used_bytes <= tier.capacity_bytes
        assert sum(tier.peek(k).nbytes for k in tier.keys()) == tier.used_bytes
        returned = {x.key for x in out}
        assert "p" in tier and "p" not in returned  # pinned survives
        assert not returned & set(tier.keys())  # what is returned is gone
        stored = e.key in tier
        assert stored != (e.key in returned)
        assert set(tier.keys()) == (before - returned) | ({e.key} if stored else set())  # nothing else left
        if rng.random() < 0.3:
            tier.get(rng.choice(sorted(tier.keys())))


@pytest.mark.parametrize("name", TIERS)
def test_tier_rejects_an_oversized_entry_and_keeps_the_rest(name):
    tier = _tier(name, 3 * SIZE)
    tier.put(_entry("a"))
    big = _entry("big", tokens=64)
    assert big.nbytes > tier.capacity_bytes
    out = tier.put(big)
    assert [x.key for x in out] == ["big"] and "big" not in tier and tier.get("big") is None
    assert list(tier.keys()) == ["a"] and tier.used_bytes == SIZE


@pytest.mark.parametrize("name", TIERS)
def test_tier_rejects_when_everything_is_pinned(name):
    tier = _tier(name, 2 * SIZE)
    tier.put(_entry("p", pinned=True))
    tier.put(_entry("q", pinned=True))
    out = tier.put(_entry("x"))
    assert [x.key for x in out] == ["x"] and sorted(tier.keys()) == ["p", "q"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", TIERS)
def test_tier_honours_the_store_predicate(name, policy):
    """A tier told that ``p`` has a resident child (in a faster tier) never evicts it, unless leaves_first is
    off; the parent of the entry being put is protected too."""
    for leaves_first in (True, False):
        tier = _tier(name, 3 * SIZE, {"name": policy, "leaves_first": leaves_first})
        tier.bind_store(lambda key: 1 if key == "p" else 0)
        tier.put(_entry("p"))  # the oldest
        gone = set()
        for i in range(6):
            gone |= {x.key for x in tier.put(_entry(f"n{i}"))}
        assert ("p" in tier) == leaves_first and ("p" in gone) != leaves_first
    tier = _tier(name, 2 * SIZE, policy)
    tier.put(_entry("q"))  # the oldest
    tier.put(_entry("other"))
    out = tier.put(_entry("child", parent="q"))
    assert "q" in tier and "child" in tier and [x.key for x in out] == ["other"]


def _random_workload(store: KVStore, seed: int, steps: int, check_tree: bool) -> None:
    """Random puts (children of resident entries only), gets, segment lookups, leaf removals, touches."""
    rng = random.Random(seed)
    n = 0
    for _ in range(steps):
        resident = sorted(k for tier in store.tiers for k in tier.keys())
        exact = [k for k in resident if not k.startswith("seg:")]
        op = rng.random()
        if op < 0.55:
            parent = rng.choice(exact) if exact and rng.random() < 0.8 else ROOT
            n += 1
            e = _entry(f"k{n}", tokens=rng.choice((2, 4, 6)), parent=parent, first=rng.randrange(3),
                       pinned=rng.random() < 0.03, segment=f"s{rng.randrange(40)}")  # fmt: skip
            ok = store.put(e)
            assert ok == (e.key in store)
            if check_tree:
                assert parent == ROOT or parent in store, "evicted the parent of the entry being put"
            if ok:
                assert e.key in store.children_with_first_token(parent, e.first_token)
        elif op < 0.65:
            seg = f"s{rng.randrange(40)}"
            if not store.has_segment(seg):
                store.put(_entry("", exact=False, segment=seg, tokens=rng.choice((2, 4))))
        elif op < 0.75 and resident:
            key = rng.choice(resident)
            assert store.get(key).key == key
        elif op < 0.82:
            seg = f"s{rng.randrange(40)}"
            holders = [store.peek(k) for k in resident if store.peek(k).segment_key == seg]
            found = store.find_segment(seg)  # (its promotion may drop other entries)
            assert (found is not None) == bool(holders)
            if found is not None:
                assert found.segment_key == seg
                assert found.exact or not any(e.exact for e in holders), "an exact entry is preferred"
        elif op < 0.9 and resident:
            leaves = [k for k in resident if not store.has_children(k)]
            if leaves:
                key = rng.choice(leaves)
                assert store.remove(key).key == key and key not in store
        elif exact:
            path, key = [], rng.choice(exact)
            while key in store:
                path.append(key)
                key = store.peek(key).parent_key
            store.touch_chain(list(reversed(path)))
        store.verify()  # books == tiers; every tier within its budget
        for tier in store.tiers:
            assert tier.used_bytes <= tier.capacity_bytes
            for key in tier.keys():
                e = tier.peek(key)
                assert store.children_with_first_token(e.parent_key, e.first_token).count(key) == (1 if e.exact else 0)
                if check_tree and e.exact:
                    assert e.parent_key == ROOT or e.parent_key in store, f"{key} stranded"


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", TIERS)
@pytest.mark.parametrize("levels", [1, 2, 3])
def test_tiers_in_a_store_evict_leaves_first(name, policy, levels):
    """No exact entry ever outlives its parent (the store's books stay exact) under a random workload."""
    for seed in range(3):
        tiers = [_tier(name, (6 + 4 * i) * SIZE, policy) for i in range(levels)]
        _random_workload(KVStore(tiers), seed=10 * levels + seed, steps=400, check_tree=True)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", TIERS)
def test_tiers_in_a_store_keep_the_books_without_leaves_first(name, policy):
    tiers = [_tier(name, (5 + 3 * i) * SIZE, {"name": policy, "leaves_first": False}) for i in range(2)]
    _random_workload(KVStore(tiers), seed=7, steps=300, check_tree=False)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", TIERS)
@pytest.mark.parametrize("levels", [2, 3])
def test_write_through_tiers_keep_the_books_and_the_tree(name, policy, levels):
    """Every tier below the first written through: copies, rebooking on eviction, promotion keeping the copy."""
    tiers = [_tier(name, (6 + 4 * i) * SIZE, policy) for i in range(levels)]
    store = KVStore(tiers, write_through=[False] + [True] * (levels - 1))
    _random_workload(store, seed=100 + levels, steps=300, check_tree=True)
    assert store.stats.written_through > 0


# ---------------------------------------------------------------------------------------------- eviction
@pytest.mark.parametrize("name", POLICIES)
def test_eviction_contract(name):
    policy = EVICTION.build(name)
    assert isinstance(policy, EvictionPolicy)
    assert policy.victim() is None
    for k in ("a", "b", "c"):
        policy.on_insert(k)
    assert policy.victim() in {"a", "b", "c"}
    assert policy.victim() is not None  # a query: naming a victim does not forget it
    seen = set()
    for _ in range(3):
        v = policy.victim(protected=_LazyContainer(seen))
        assert v in {"a", "b", "c"} and v not in seen
        seen.add(v)
    assert policy.victim(protected=seen) is None
    policy.on_remove("a")
    policy.on_access("b")
    assert policy.victim(protected={"b", "c"}) is None
    policy.on_access("never-inserted")  # unknown keys are ignored
    policy.on_remove("never-inserted")
    assert policy.victim(protected={"b", "c"}) is None
    policy.on_insert("a")  # re-inserted: evictable again
    assert policy.victim(protected={"b", "c"}) == "a"


@pytest.mark.parametrize("name", POLICIES)
def test_eviction_leaves_first_flag(name):
    assert EVICTION.build(name).leaves_first is True
    assert EVICTION.build({"name": name, "leaves_first": False}).leaves_first is False
    EVICTION.validate({"name": name, "description": "x", "leaves_first": True})


@pytest.mark.parametrize("name", POLICIES)
def test_eviction_random_sequence_against_a_model(name):
    """victim() is None exactly when every tracked key is protected, and never a removed or protected key."""
    policy = EVICTION.build(name)
    rng = random.Random(3)
    tracked: set[str] = set()
    for step in range(2000):
        op = rng.random()
        key = f"k{rng.randrange(30)}"
        if op < 0.4:
            policy.on_insert(key)
            tracked.add(key)
        elif op < 0.6:
            policy.on_access(key)
        elif op < 0.8:
            policy.on_remove(key)
            tracked.discard(key)
        else:
            protected = {k for k in tracked if rng.random() < 0.7} | {f"k{rng.randrange(30)}"}
            v = policy.victim(protected=_LazyContainer(protected))
            if tracked <= protected:
                assert v is None, f"step {step}: {v} returned though everything tracked is protected"
            else:
                assert v in tracked and v not in protected, f"step {step}: {v} is removed or protected"
                if rng.random() < 0.5:  # evict it, as a tier would
                    policy.on_remove(v)
                    tracked.discard(v)
                    assert policy.victim(protected=_LazyContainer(set(tracked))) is None  # v is gone
