"""Content (non-prefix) reuse: segments, content hits, re-rotation in the engine, layer-wise execution,
recompute strategies and what gets stored (DESIGN.md invariant 2, issue "Reuse beyond the prefix")."""

from __future__ import annotations

import pytest
import torch
from test_chunking_hashing import PairTokenizer
from kvboost_testkit.tiny import ToyTokenizer, make_engine, tiny_model

from kvboost import KVBoost
from kvboost.plan import ComputeSchedule, ScheduleError
from kvboost.recompute.base import RecomputeStrategy
from kvboost.registry import RECOMPUTE

SEP = "\n\n"
DOCS = [
    "Alpha document: the red fox lives in the northern forest and eats berries in the summer. " * 2,
    "Beta document: copper wires carry current; resistance grows with length and temperature. " * 2,
    "Gamma document: the old lighthouse keeper wrote letters to his sister every single week. " * 2,
]
QUESTION = "Question: who wrote letters every week?"


def rag_prompt(order: list[int], question: str = QUESTION) -> str:
    return SEP.join(["System: answer from the documents."] + [DOCS[i] for i in order] + [question])


def blend_engine(arch: str = "llama", recompute="none", attn="sdpa", chunk_size: int = 16, tokenizer=None,
                 **options) -> KVBoost:  # fmt: skip
    model = tiny_model(arch, max_position_embeddings=1024, num_hidden_layers=4)
    return KVBoost(
        model, tokenizer or ToyTokenizer(), model_identity=f"tiny-{arch}",
        chunker={"name": "separator", "separator": SEP, "chunk_size": chunk_size},
        recompute=recompute, attn=attn, **options,
    )  # fmt: skip


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_a_document_has_the_same_ids_anywhere():
    # A tokenizer that merges across boundaries (like BPE): with the per-character one, tokenizing the whole
    # prompt at once would give a document the same ids anywhere too, and the test could not tell.
    engine = blend_engine(tokenizer=PairTokenizer())
    doc_ids, doc_spans = engine.chunker.tokenize(engine.tokenizer, DOCS[2])
    odd = SEP.join(["System: answer briefly.", DOCS[0], DOCS[2], QUESTION])  # the document at an odd offset
    whole = engine.tokenizer(odd)["input_ids"]
    assert not any(whole[p : p + len(doc_ids)] == doc_ids for p in range(len(whole)))  # so other ids in one piece
    for prompt in [rag_prompt(order) for order in ([2, 0, 1], [0, 1, 2], [1, 2])] + [odd]:
        ids, spans = engine.tokenize_with_spans(prompt)
        starts = {s.segment_start for s in spans}
        found = [p for p in starts if ids[p : p + len(doc_ids)] == doc_ids]
        assert found, prompt[:40]
        # the document's chunks are exactly its standalone chunks, shifted
        p = found[0]
        inside = [(s.start - p, s.end - p) for s in spans if s.segment_start == p]
        assert inside == [(s.start, s.end) for s in doc_spans]


def test_warmed_documents_become_content_hits_in_any_order():
    engine = blend_engine()
    for doc in DOCS:
        engine.warm(doc)
    r = engine.generate(rag_prompt([2, 0, 1]), max_new_tokens=4)
    doc_tokens = sum(len(engine.chunker.tokenize(engine.tokenizer, d)[0]) for d in DOCS)
    # every document token is served (documents are not at position 0, so not exact); separators too
    assert r.content_hit_tokens >= doc_tokens
    assert r.content_ratio > 0.8
    assert r.exact_hit_tokens == 0  # the prompt starts with the (unwarmed) system text
    assert 0 < r.kv_reuse_ratio < 1


def test_content_hit_under_full_recompute_equals_cold_prefill(arch):
    engine = blend_engine(arch, recompute="full")
    for doc in DOCS:
        engine.warm(doc)
    prompt = rag_prompt([1, 2, 0])
    cold = engine.generate(prompt, max_new_tokens=6, mode="cold")
    r = engine.generate(prompt, max_new_tokens=6)
    assert r.content_hit_tokens > 0
    assert _max_diff(cold.first_token_logits, r.first_token_logits) <= 1e-4
    assert r.output_ids == cold.output_ids
    # every content token recomputed at every layer, measured
    assert r.recompute_ratio == pytest.approx(r.content_hit_tokens / r.prompt_tokens)


def test_reuse_without_repair_differs_from_cold_prefill():
    """The workload can detect degradation: standalone KV is not what the full context computes."""
    engine = blend_engine(recompute="none")
    for doc in DOCS:
        engine.warm(doc)
    prompt = rag_prompt([1, 2, 0])
    cold = engine.generate(prompt, max_new_tokens=2, mode="cold")
    r = engine.generate(prompt, max_new_tokens=2)
    assert r.recompute_ratio == 0.0
    assert _max_diff(cold.first_token_logits, r.first_token_logits) > 1e-3


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_cacheblend_with_ratio_one_equals_full(attn):
    results = {}
    for name, spec in (("full", "full"), ("blend", {"name": "cacheblend", "ratio": 1.0})):
        engine = blend_engine(recompute=spec, attn=attn)
        for doc in DOCS:
            engine.warm(doc)
        results[name] = engine.generate(rag_prompt([2, 1, 0]), max_new_tokens=5)
    assert _max_diff(results["full"].first_token_logits, results["blend"].first_token_logits) <= 1e-4
    assert results["full"].output_ids == results["blend"].output_ids


def test_cacheblend_cost_scales_with_its_ratio():
    ratios = {}
    for ratio in (0.1, 0.3, 0.6):
        engine = blend_engine(recompute={"name": "cacheblend", "ratio": ratio}, chunk_size=64)
        for doc in DOCS:
            engine.warm(doc)
        r = engine.generate(rag_prompt([2, 0, 1]), max_new_tokens=2)
        assert r.extra["layerwise"]
        # the fraction of content tokens recomputed after the check layer is the configured ratio (rounding)
        assert abs(r.extra["content_recompute_fraction"] - ratio) < 0.02
        ratios[ratio] = r.recompute_ratio
    assert ratios[0.1] < ratios[0.3] < ratios[0.6] < 1.0


def test_selective_recomputes_the_start_of_each_document():
    engine = blend_engine(recompute={"name": "selective", "r": 4})
    for doc in DOCS:
        engine.warm(doc)
    prompt = rag_prompt([0, 2])
    ids, spans = engine.tokenize_with_spans(prompt)
    from kvboost.lookup import lookup

    keys = engine.hasher.chunk_keys(ids, spans, engine.fingerprint)
    plan = lookup(ids, spans, keys, engine.store, engine.quantizer, max_reuse=len(ids) - 1)
    chosen = set(engine.recompute.schedule(plan, engine.adapter.num_layers).initial.tolist())
    runs = []
    kinds = plan.kinds.tolist()
    for p in range(len(ids)):
        if kinds[p] == 1 and (p == 0 or kinds[p - 1] != 1):
            runs.append(p)
    assert runs
    for start in runs:
        assert set(range(start, start + 4)) <= chosen
    assert not any(kinds[p] == 0 for p in chosen)
    assert all(p in chosen for p in range(len(ids)) if kinds[p] == 2)


def test_repaired_kv_is_never_stored_as_exact():
    engine = blend_engine(recompute="none", store_generated=False)
    for doc in DOCS:
        engine.warm(doc)
    entries_before = set(engine.store.tiers[0].keys())
    prompt = rag_prompt([1, 0])
    cold = engine.generate(prompt, max_new_tokens=3, mode="cold")
    engine.generate(prompt, max_new_tokens=3)
    new = [engine.store.peek(k) for k in engine.store.tiers[0].keys() if k not in entries_before]
    ids, spans = engine.tokenize_with_spans(prompt)
    first_content = engine.tokenize_with_spans(prompt)[0].index(engine.chunker.tokenize(engine.tokenizer, DOCS[1])[0][0])
    assert first_content > 0
    assert any(e.exact for e in new) and any(not e.exact for e in new)
    for e in new:
        if e.exact:
            # exact entries only cover KV before the first content hit (the system text and a separator)
            assert e.start + e.num_tokens <= first_content
        else:
            assert e.key.startswith("seg:") and e.parent_key is None and e.start >= first_content
    # the same prompt again: exact hits only up to where the first one ended, never through repaired KV
    again = engine.generate(prompt, max_new_tokens=3)
    assert again.exact_hit_tokens < len(ids) / 2
    assert again.output_ids == engine.generate(prompt, max_new_tokens=3).output_ids
    del cold


class _Broken(RecomputeStrategy):
    """A strategy that overrides the base's engine-facing half (which no strategy should) to break the contract:
    the engine must refuse what it returns."""

    def score(self, view):
        return torch.zeros(view.candidates.numel())


class _SkipsNewTokens(_Broken):
    def schedule(self, plan, num_layers):
        return ComputeSchedule(plan.positions("new")[:-1])


class _RecomputesExact(_Broken):
    def schedule(self, plan, num_layers):
        return ComputeSchedule(torch.arange(len(plan)))


class _GrowsSelection(_Broken):
    check_layers = (0,)

    def select(self, view):
        # adds new positions, which were not candidates: must be refused
        return torch.cat([view.candidates[:1], view.plan.positions("new")]).unique()


@pytest.mark.parametrize("cls", [_SkipsNewTokens, _RecomputesExact, _GrowsSelection])
def test_the_engine_validates_every_schedule(cls):
    RECOMPUTE.register("test_broken", override=True)(cls)
    try:
        engine = blend_engine(recompute="test_broken")
        engine.warm(DOCS[0])
        engine.warm("System: answer from the documents.")
        with pytest.raises(ScheduleError):
            engine.generate(rag_prompt([0]), max_new_tokens=2)
    finally:
        RECOMPUTE.unregister("test_broken")


def test_true_deviation_reports_a_full_prefill_and_beats_none():
    kls = {}
    for name in ("none", "true_deviation"):
        engine = blend_engine(recompute={"name": name, "ratio": 0.3} if name == "true_deviation" else name)
        for doc in DOCS:
            engine.warm(doc)
        prompt = rag_prompt([2, 1, 0])
        cold = engine.generate(prompt, max_new_tokens=2, mode="cold")
        r = engine.generate(prompt, max_new_tokens=2)
        from kvboost.quality import first_token_kl

        kls[name] = first_token_kl(cold.first_token_logits, r.first_token_logits)[0]
        if name == "true_deviation":
            assert r.recompute_ratio == pytest.approx(r.kv_reuse_ratio)
    assert kls["true_deviation"] < kls["none"]


def test_salted_requests_share_nothing():
    engine = make_engine("llama")
    prompt = list(range(5, 60))
    engine.generate(prompt, max_new_tokens=2, cache_salt="tenant-a")
    assert engine.generate(prompt, max_new_tokens=2, cache_salt="tenant-b").cached_tokens == 0
    assert engine.generate(prompt, max_new_tokens=2, cache_salt="tenant-a").cached_tokens > 0
