"""Exact reuse (DESIGN.md invariant 1): logits and greedy tokens from cache hits equal a cold prefill."""

from __future__ import annotations

import pytest
import torch
from tiny import make_engine, random_ids, tiny_model

from kvboost.recompute.base import RecomputeStrategy, RepairOutcome, ReusePlan
from kvboost.registry import RECOMPUTE


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_exact_hit_logits_match_cold_prefill(arch):
    engine = make_engine(arch)
    prefix = random_ids(70, seed=1)
    prompt = prefix + random_ids(23, seed=2)
    cold = engine.generate(prompt, max_new_tokens=8, mode="baseline")
    engine.warm(prefix)
    warm = engine.generate(prompt, max_new_tokens=8)
    assert warm.cached_tokens == 70  # 4 full chunks of 16 + a 6-token frontier match
    assert warm.exact_hit_tokens == 70
    assert _max_diff(cold.first_token_logits, warm.first_token_logits) <= 1e-4
    assert warm.output_ids == cold.output_ids


def test_logits_match_along_the_whole_suffix(arch):
    """Not only the last position: every suffix position's logits match the one-pass prefill."""
    engine = make_engine(arch)
    ids = random_ids(90, seed=3)
    engine.warm(ids[:50])
    with torch.inference_mode():
        ref = engine.model(input_ids=torch.tensor([ids])).logits[0, 50:]
        from kvboost.lookup import chunk_prompt, plan_exact_reuse

        spans, keys = chunk_prompt(ids, engine.chunker, engine.hasher, engine.fingerprint)
        plan = plan_exact_reuse(ids, spans, keys, engine.store, engine.quantizer)
        assert plan.reused_tokens == 50
        cache = engine.adapter.cache_for(plan.segments, capacity=len(ids))
        out = engine.adapter.forward(torch.tensor(ids[50:]), cache, logits_to_keep=40)
    assert _max_diff(ref, out) <= 1e-4


def test_multi_turn_reuses_previous_prompt_and_answer():
    engine = make_engine("llama")
    turn1 = random_ids(40, seed=4)
    r1 = engine.generate(turn1, max_new_tokens=12)
    assert r1.cached_tokens == 0
    # The next turn continues the same token ids: prompt, the answer, and a new message.
    turn2 = turn1 + r1.output_ids + random_ids(17, seed=5)
    cold = engine.generate(turn2, max_new_tokens=12, mode="baseline")
    r2 = engine.generate(turn2, max_new_tokens=12)
    # Everything but the answer's last token (its KV was never computed) comes from the cache.
    assert r2.cached_tokens == len(turn1) + len(r1.output_ids) - 1
    assert r2.output_ids == cold.output_ids
    assert _max_diff(cold.first_token_logits, r2.first_token_logits) <= 1e-4


def test_generated_tokens_are_stored_only_when_asked():
    with_gen = make_engine("llama", store_generated=True)
    without = make_engine("llama", store_generated=False)
    prompt = random_ids(30, seed=6)
    for engine in (with_gen, without):
        r1 = engine.generate(prompt, max_new_tokens=20)
        r2 = engine.generate(prompt + r1.output_ids + [5, 6, 7], max_new_tokens=4)
        engine.last = r2
    assert with_gen.last.cached_tokens == 30 + 19
    assert without.last.cached_tokens == 30


def test_repeated_prompt_leaves_one_token_to_run():
    engine = make_engine("qwen2")
    prompt = random_ids(48, seed=7)  # exactly 3 chunks
    cold = engine.generate(prompt, max_new_tokens=6, mode="baseline")
    engine.generate(prompt, max_new_tokens=6)
    again = engine.generate(prompt, max_new_tokens=6)
    assert again.cached_tokens == 47
    assert again.output_ids == cold.output_ids


def test_divergent_history_is_not_reused():
    """Same later tokens after a different first chunk: prefix-chained keys must miss."""
    engine = make_engine("llama")
    shared_tail = random_ids(48, seed=8)
    engine.generate(random_ids(16, seed=9) + shared_tail, max_new_tokens=2)
    other = engine.generate(random_ids(16, seed=10) + shared_tail, max_new_tokens=2)
    assert other.cached_tokens == 0


def test_baseline_mode_neither_reads_nor_writes_the_cache():
    engine = make_engine("llama")
    prompt = random_ids(40, seed=11)
    engine.generate(prompt, max_new_tokens=3, mode="baseline")
    assert engine.cache_stats()["entries"] == 0
    engine.generate(prompt, max_new_tokens=3)
    r = engine.generate(prompt, max_new_tokens=3, mode="baseline")
    assert r.cached_tokens == 0 and r.kv_reuse_ratio == 0.0


def test_ttft_and_store_are_reported_separately():
    engine = make_engine("llama")
    r = engine.generate(random_ids(64, seed=12), max_new_tokens=4)
    assert 0 < r.ttft_ms <= r.total_ms
    assert r.store_ms > 0
    assert r.ttft_ms + r.store_ms <= r.total_ms + 1e-6
    assert r.extra["prefill_tokens"] == 64


def test_verify_correctness_passes_and_leaves_the_cache_alone():
    engine = make_engine("mistral")
    engine.generate(random_ids(20, seed=13), max_new_tokens=2)
    before = engine.cache_stats()["entries"]
    report = engine.verify_correctness([random_ids(60, seed=14), random_ids(45, seed=15)], max_new_tokens=6)
    assert report.passed, report.to_dict()
    assert all(c.reuse_ratio > 0.5 for c in report.checks)
    assert engine.cache_stats()["entries"] == before


class _CorruptingStrategy(RecomputeStrategy):
    """Deliberately broken: perturbs reused values (a bug such as a wrong position or stale KV)."""

    def repair(self, plan: ReusePlan, adapter) -> RepairOutcome:
        if plan.values is not None:
            plan.values = plan.values + 0.5 * torch.randn_like(plan.values)
        return RepairOutcome(plan, 0)


def test_verify_correctness_fails_with_a_broken_strategy():
    RECOMPUTE.register("test_corrupting", override=True)(_CorruptingStrategy)
    try:
        engine = make_engine("llama", recompute="test_corrupting")
        report = engine.verify_correctness([random_ids(60, seed=16), random_ids(50, seed=17)], max_new_tokens=6)
    finally:
        RECOMPUTE.unregister("test_corrupting")
    assert not report.passed
    assert max(c.first_token_kl for c in report.checks) > report.kl_tolerance


def test_full_recompute_is_cold_and_reports_its_ratio():
    engine = make_engine("llama", recompute="full")
    prompt = random_ids(64, seed=18)
    cold = engine.generate(prompt, max_new_tokens=4, mode="baseline")
    engine.generate(prompt, max_new_tokens=4)
    r = engine.generate(prompt, max_new_tokens=4)
    assert r.cached_tokens == 0
    assert r.recompute_ratio == pytest.approx(63 / 64)  # every token the cache held was recomputed
    assert r.output_ids == cold.output_ids


def test_cache_keys_carry_the_model_fingerprint():
    a = make_engine("llama")
    from kvboost import KVBoost
    from tiny import ToyTokenizer

    b = KVBoost(tiny_model("llama", seed=1), ToyTokenizer(), model_identity="tiny-llama", chunker={"name": "fixed", "chunk_size": 16})
    assert a.fingerprint != b.fingerprint  # same config and name, other weights
    c = make_engine("llama", chunker={"name": "fixed", "chunk_size": 32})
    assert a.fingerprint != c.fingerprint
    # An entry written by one engine is not found by the other, even with a shared store.
    prompt = random_ids(40, seed=19)
    a.generate(prompt, max_new_tokens=2)
    b.store = a.store
    assert b.generate(prompt, max_new_tokens=2).cached_tokens == 0


def test_sampling_is_seeded():
    e1, e2 = make_engine("llama", seed=3), make_engine("llama", seed=3)
    prompt = random_ids(20, seed=20)
    r1 = e1.generate(prompt, max_new_tokens=8, do_sample=True, temperature=1.5)
    r2 = e2.generate(prompt, max_new_tokens=8, do_sample=True, temperature=1.5)
    assert r1.output_ids == r2.output_ids


def test_cache_budget_evicts_old_conversations():
    engine = make_engine("llama", cache={"name": "memory", "capacity": 40_000})
    for seed in range(6):
        engine.generate(random_ids(64, seed=100 + seed), max_new_tokens=2)
    stats = engine.cache_stats()
    assert stats["tiers"][0]["used_bytes"] <= 40_000
    assert stats["evicted"] > 0


def test_preallocated_cache_grows_and_matches_dynamic_cache():
    """The engine's in-place cache gives HF's numbers, also past its capacity and after crop."""
    from transformers import DynamicCache

    from kvboost.models.prealloc_cache import PreallocatedLayer

    engine = make_engine("qwen2")
    ids = torch.tensor(random_ids(30, seed=21))
    with torch.inference_mode():
        ref_cache = DynamicCache()
        ref = [engine.adapter.forward(ids[:20], ref_cache)]
        cache = engine.adapter.cache_for([], capacity=22)  # too small on purpose: must grow
        out = [engine.adapter.forward(ids[:20], cache)]
        for t in range(20, 30):
            ref.append(engine.adapter.forward(ids[t : t + 1], ref_cache))
            out.append(engine.adapter.forward(ids[t : t + 1], cache))
    assert all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)
    assert cache.get_seq_length() == ref_cache.get_seq_length() == 30
    for a, b in zip(ref, out):
        assert _max_diff(a, b) <= 1e-5
    for la, lb in zip(ref_cache.layers, cache.layers):
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
