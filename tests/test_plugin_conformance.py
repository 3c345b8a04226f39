"""Conformance: every registered plugin of every family meets its family's contract.

The parametrization reads the registries at collection time, so a new plugin (a module in
``kvboost/<family>/`` or a third-party ``kvboost.plugins`` entry point) runs these tests unchanged.
Plugins are built with their default arguments.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tiny import make_engine, random_ids

from kvboost.cache import KVEntry, KVStore
from kvboost.quant.none import RawKV
from kvboost.registry import CACHE_TIERS, CHUNKERS, EVICTION, HASHERS, KV_QUANT, RECOMPUTE


# ---------------------------------------------------------------------------------------------- chunkers
@pytest.mark.parametrize("name", CHUNKERS.names())
def test_chunker_contract(name):
    chunker = CHUNKERS.build(name)
    for n in (0, 1, 5, 63, 64, 65, 300):
        ids = random_ids(n, seed=n) if n else []
        spans = chunker.split(ids)
        if n == 0:
            assert spans == []
            continue
        assert spans[0].start == 0 and spans[-1].end == n
        assert all(len(s) > 0 for s in spans)
        assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
        assert chunker.split(ids) == spans  # deterministic
        # prefix-stable: a prefix's spans are the full sequence's spans cut at the prefix end
        for cut in (1, n // 2, n - 1):
            if cut <= 0:
                continue
            prefix_spans = chunker.split(ids[:cut])
            full_inside = [s for s in spans if s.end <= cut]
            assert prefix_spans[: len(full_inside)] == full_inside
    assert isinstance(chunker.fingerprint(), str) and chunker.fingerprint()


# ---------------------------------------------------------------------------------------------- hashers
@pytest.mark.parametrize("name", HASHERS.names())
def test_hasher_contract(name):
    hasher, chunker = HASHERS.build(name), CHUNKERS.build("fixed", chunk_size=8)
    ids = random_ids(40, seed=1)
    keys = hasher.chunk_keys(ids, chunker.split(ids), "fp")
    assert keys == hasher.chunk_keys(ids, chunker.split(ids), "fp")
    assert len({k.prefix_key for k in keys}) == len(keys)
    changed = list(ids)
    changed[3] += 1  # a change in the first chunk changes every later prefix key, no later content key
    keys2 = hasher.chunk_keys(changed, chunker.split(changed), "fp")
    assert all(a.prefix_key != b.prefix_key for a, b in zip(keys, keys2))
    assert [a.content_key for a in keys[1:]] == [b.content_key for b in keys2[1:]]
    other_fp = hasher.chunk_keys(ids, chunker.split(ids), "fp2")
    assert all(a.prefix_key != b.prefix_key and a.content_key != b.content_key for a, b in zip(keys, other_fp))
    code = (
        f"from kvboost.registry import HASHERS, CHUNKERS; h=HASHERS.build({name!r}); c=CHUNKERS.build('fixed', chunk_size=8);"
        f"ids={ids!r}; print([k.prefix_key for k in h.chunk_keys(ids, c.split(ids), 'fp')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == str([k.prefix_key for k in keys])  # deterministic across processes


# ---------------------------------------------------------------------------------------------- tiers / eviction
def _entry(key: str, tokens: int = 4, pinned: bool = False) -> KVEntry:
    k = torch.randn(2, 1, tokens, 8)
    return KVEntry(key, "c" + key, "root", tuple(range(tokens)), 0, RawKV(k, k + 1), pinned=pinned)


@pytest.mark.parametrize("name", CACHE_TIERS.names())
def test_cache_tier_contract(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # tiers that write files write them here
    size = _entry("x").nbytes
    tier = CACHE_TIERS.build({"name": name, "capacity": 3 * size})
    e = _entry("a")
    assert tier.put(e) == [] and "a" in tier and len(tier) == 1
    got = tier.get("a")
    assert got is not None and torch.equal(got.payload.keys, e.payload.keys)
    tier.put(_entry("p", pinned=True))
    for i in range(6):
        tier.put(_entry(f"n{i}"))
        assert tier.used_bytes <= tier.capacity_bytes
    assert "p" in tier  # pinned survives
    assert tier.get("missing") is None
    assert tier.remove("p") is not None and "p" not in tier
    big = _entry("big", tokens=64)
    assert big in tier.put(big) and "big" not in tier


@pytest.mark.parametrize("name", EVICTION.names())
def test_eviction_contract(name):
    policy = EVICTION.build(name)
    assert policy.victim() is None
    for k in ("a", "b", "c"):
        policy.on_insert(k)
    seen = set()
    for _ in range(3):
        v = policy.victim(protected=seen)
        assert v in {"a", "b", "c"} and v not in seen
        seen.add(v)
    assert policy.victim(protected=seen) is None
    policy.on_remove("a")
    policy.on_access("b")
    assert policy.victim(protected={"b", "c"}) is None


# ---------------------------------------------------------------------------------------------- quantizers
@pytest.mark.parametrize("name", KV_QUANT.names())
def test_quantizer_contract(name):
    q = KV_QUANT.build(name)
    k, v = torch.randn(3, 2, 37, 16), torch.randn(3, 2, 37, 16)
    payload = q.quantize(k, v)
    k2, v2 = q.dequantize(payload)
    assert k2.shape == k.shape and v2.shape == v.shape and k2.dtype == k.dtype
    assert payload.nbytes > 0 and payload.num_tokens == 37
    if q.lossless:
        assert torch.equal(k2, k) and torch.equal(v2, v)
    else:
        assert (k2 - k).abs().max() < k.abs().max()  # quantized, not garbage
    assert q.fingerprint()


# ---------------------------------------------------------------------------------------------- recompute
@pytest.mark.parametrize("name", RECOMPUTE.names())
def test_recompute_contract_keeps_exact_reuse_exact(name):
    """On exact hits, any strategy must reproduce the cold prefill, and report what it recomputed."""
    engine = make_engine("llama", recompute=name)
    report = engine.verify_correctness([random_ids(60, seed=2), random_ids(41, seed=3)], max_new_tokens=6)
    assert report.passed, report.to_dict()
    prompt = random_ids(50, seed=4)
    engine.generate(prompt, max_new_tokens=2)
    r = engine.generate(prompt, max_new_tokens=2)
    assert 0.0 <= r.recompute_ratio <= 1.0
    assert r.cached_tokens + r.extra["prefill_tokens"] == r.prompt_tokens


@pytest.mark.parametrize("name", RECOMPUTE.names())
def test_recompute_plan_shapes(name):
    engine = make_engine("llama", recompute=name)
    ids = random_ids(48, seed=5)
    engine.warm(ids[:40])
    from kvboost.lookup import chunk_prompt, plan_exact_reuse

    spans, keys = chunk_prompt(ids, engine.chunker, engine.hasher, engine.fingerprint)
    plan = plan_exact_reuse(ids, spans, keys, engine.store, engine.quantizer, max_reuse=len(ids) - 1)
    outcome = engine.recompute.repair(plan, engine.adapter)
    assert outcome.plan.reused_tokens <= plan.reused_tokens
    if outcome.plan.reused_tokens:
        assert outcome.plan.keys.shape[2] == outcome.plan.reused_tokens
    assert outcome.recomputed_token_layers >= 0


def test_conformance_sees_every_family():
    assert KVStore  # the store composes tiers; its own tests live in test_cache.py
    assert all(reg.names() for reg in (CHUNKERS, HASHERS, CACHE_TIERS, EVICTION, KV_QUANT, RECOMPUTE))
