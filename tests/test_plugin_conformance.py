"""Conformance: every registered plugin of every family meets its family's contract.

The parametrization reads the registries at collection time, so a new plugin (a module in
``kvboost/<family>/`` or a third-party ``kvboost.plugins`` entry point) runs these tests unchanged.
Plugins are built with their default arguments. Cache tiers and eviction policies: tests/test_cache_conformance.py;
attention backends: tests/kernel_tests/test_attention_backends.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from kvboost_testkit.tiny import ToyTokenizer, make_engine, random_ids, tiny_model

from kvboost import KVBoost
from kvboost.lookup import lookup
from kvboost.plan import validate_schedule
from kvboost.registry import CACHE_TIERS, CHUNKERS, EVICTION, HASHERS, KV_QUANT, RECOMPUTE

TEXT = (
    "System: you answer questions.\n\nThe first document is about rivers. They flow to the sea!\n\n"
    "Another document: mountains rise. Snow falls on them.\n\nQuestion: which one is wet?"
)


def _check_spans(spans, n):
    assert spans[0].start == 0 and spans[-1].end == n
    assert all(len(s) > 0 for s in spans)
    assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
    starts = {s.start for s in spans}
    assert all(s.segment_start in starts and s.segment_start <= s.start for s in spans)
    # spans of one segment are contiguous: once a segment is left it never comes back
    seen, current = set(), None
    for s in spans:
        if s.segment_start != current:
            assert s.segment_start not in seen
            seen.add(s.segment_start)
            current = s.segment_start


# ---------------------------------------------------------------------------------------------- chunkers
@pytest.mark.parametrize("name", CHUNKERS.names())
def test_chunker_split_contract(name):
    chunker = CHUNKERS.build(name)
    chunker.bind_tokenizer(ToyTokenizer())
    for n in (0, 1, 5, 63, 64, 65, 300):
        ids = random_ids(n, seed=n) if n else []
        spans = chunker.split(ids)
        if n == 0:
            assert spans == []
            continue
        _check_spans(spans, n)
        assert chunker.split(ids) == spans  # deterministic
        # prefix-stable: a prefix's spans are the full sequence's spans cut at the prefix end
        for cut in (1, n // 2, n - 1):
            if cut <= 0:
                continue
            prefix_spans = chunker.split(ids[:cut])
            full_inside = [s for s in spans if s.end <= cut]
            assert prefix_spans[: len(full_inside)] == full_inside
            # extend() keeps every span of the prefix but its last one
            extended = chunker.extend(ids, prefix_spans)
            _check_spans(extended, n)
            assert extended[: len(prefix_spans) - 1] == prefix_spans[:-1]
    assert isinstance(chunker.fingerprint(), str) and chunker.fingerprint()


@pytest.mark.parametrize("name", CHUNKERS.names())
def test_chunker_text_contract(name):
    chunker = CHUNKERS.build(name)
    tokenizer = ToyTokenizer()
    chunker.bind_tokenizer(tokenizer)
    ids, spans = chunker.tokenize(tokenizer, TEXT)
    assert ids and ids == chunker.tokenize(tokenizer, TEXT)[0]
    _check_spans(spans, len(ids))
    if not chunker.owns_tokenization:
        assert ids == tokenizer(TEXT)["input_ids"]
        assert spans == chunker.split(ids)
    else:
        # a segmenting chunker gives a piece of text the same ids wherever it appears
        piece = "Another document: mountains rise. Snow falls on them."
        piece_ids = chunker.tokenize(tokenizer, piece)[0]
        for text in (TEXT, piece + "\n\n" + TEXT):
            other_ids, other_spans = chunker.tokenize(tokenizer, text)
            starts = [s.segment_start for s in other_spans]
            assert any(other_ids[p : p + len(piece_ids)] == piece_ids for p in starts)


# ---------------------------------------------------------------------------------------------- hashers
@pytest.mark.parametrize("name", HASHERS.names())
def test_hasher_contract(name):
    from kvboost.types import ChunkSpan

    hasher = HASHERS.build(name)
    ids = random_ids(40, seed=1)
    # two segments: [0, 16) and [16, 40)
    spans = [ChunkSpan(0, 8, 0), ChunkSpan(8, 16, 0), ChunkSpan(16, 24, 16), ChunkSpan(24, 32, 16), ChunkSpan(32, 40, 16)]
    keys = hasher.chunk_keys(ids, spans, "fp")
    assert keys == hasher.chunk_keys(ids, spans, "fp")
    assert len({k.prefix_key for k in keys}) == len(keys)
    assert all(b.parent_key == a.prefix_key for a, b in zip(keys, keys[1:]))
    changed = list(ids)
    changed[3] += 1  # a change in the first segment changes every later prefix key, no key of the second segment
    keys2 = hasher.chunk_keys(changed, spans, "fp")
    assert all(a.prefix_key != b.prefix_key for a, b in zip(keys, keys2))
    assert [a.segment_key for a in keys[2:]] == [b.segment_key for b in keys2[2:]]
    assert keys[1].segment_key != keys2[1].segment_key
    # the second segment elsewhere, after other text, keeps its segment keys
    moved = random_ids(12, seed=9) + ids[16:]
    moved_spans = [ChunkSpan(0, 12, 0)] + [ChunkSpan(s.start - 4, s.end - 4, 12) for s in spans[2:]]
    moved_keys = hasher.chunk_keys(moved, moved_spans, "fp")
    assert [k.segment_key for k in moved_keys[1:]] == [k.segment_key for k in keys[2:]]
    for other in (hasher.chunk_keys(ids, spans, "fp2"), hasher.chunk_keys(ids, spans, "fp", salt="tenant")):
        assert all(a.prefix_key != b.prefix_key and a.segment_key != b.segment_key for a, b in zip(keys, other))
    code = (
        f"from kvboost.registry import HASHERS; from kvboost.types import ChunkSpan; h=HASHERS.build({name!r});"
        f"spans={spans!r}; print([k.prefix_key + k.segment_key for k in h.chunk_keys({ids!r}, spans, 'fp')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == str([k.prefix_key + k.segment_key for k in keys])  # deterministic across processes


# ---------------------------------------------------------------------------------------------- quantizers
@pytest.mark.parametrize("name", KV_QUANT.names())
def test_quantizer_contract(name):
    q = KV_QUANT.build(name)
    for dtype in (torch.float32, torch.bfloat16):
        k, v = torch.randn(3, 2, 37, 16).to(dtype), (3 * torch.randn(3, 2, 37, 16)).to(dtype)
        payload = q.quantize(k, v)
        k2, v2 = q.dequantize(payload)
        assert k2.shape == k.shape and v2.shape == v.shape and k2.dtype == k.dtype and v2.dtype == v.dtype
        assert payload.nbytes > 0 and payload.num_tokens == 37
        bound_k, bound_v = q.error_bound(k, v)
        err_k = (k2.double() - k.double()).abs()
        err_v = (v2.double() - v.double()).abs()
        assert bool((err_k <= bound_k.double() + 1e-12).all()), f"{name}: key error above its bound"
        assert bool((err_v <= bound_v.double() + 1e-12).all()), f"{name}: value error above its bound"
        if q.lossless:
            assert torch.equal(k2, k) and torch.equal(v2, v)
    assert q.fingerprint()


# ---------------------------------------------------------------------------------------------- recompute
# Llama and Qwen2 (q/k/v biases, another RoPE base): a strategy must hold on both families of the real models.
FAMILIES = ("llama", "qwen2")


def _content_engine(name: str, arch: str = "llama") -> KVBoost:
    model = tiny_model(arch, num_hidden_layers=4, max_position_embeddings=1024)
    engine = KVBoost(model, ToyTokenizer(), recompute=name, chunker={"name": "separator", "chunk_size": 16})
    for doc in TEXT.split("\n\n")[1:3]:
        engine.warm(doc)
    return engine


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("name", RECOMPUTE.names())
def test_recompute_keeps_exact_reuse_exact(name, arch):
    """On exact hits, any strategy must reproduce the cold prefill (nothing to repair)."""
    engine = make_engine(arch, layers=4, recompute=name)  # 4 layers: room for check layers
    report = engine.verify_correctness([random_ids(60, seed=2), random_ids(41, seed=3)], max_new_tokens=6)
    assert report.passed, report.to_dict()
    prompt = random_ids(50, seed=4)
    engine.generate(prompt, max_new_tokens=2)
    r = engine.generate(prompt, max_new_tokens=2)
    assert r.recompute_ratio == 0.0
    assert r.cached_tokens + r.extra["prefill_tokens"] == r.prompt_tokens


@pytest.mark.parametrize("arch", FAMILIES)
@pytest.mark.parametrize("name", RECOMPUTE.names())
def test_recompute_schedule_contract_on_content_hits(name, arch):
    engine = _content_engine(name, arch)
    ids, spans = engine.tokenize_with_spans(TEXT)
    keys = engine.hasher.chunk_keys(ids, spans, engine.fingerprint)
    plan = lookup(ids, spans, keys, engine.store, engine.quantizer, max_reuse=len(ids) - 1)
    assert plan.content_tokens > 0
    if engine.recompute.needs_reference:
        plan.reference_deviation = torch.rand(plan.content_tokens)
    if engine.recompute.needs_reader_attention:
        layers = engine.recompute.reader_layers(engine.adapter.num_layers)
        assert layers and all(0 <= layer < engine.adapter.num_layers for layer in layers)
        plan.reader_attention = torch.rand(len(layers), 2, plan.content_tokens)
    schedule = engine.recompute.schedule(plan, engine.adapter.num_layers)
    initial = validate_schedule(schedule, plan, engine.adapter.num_layers, name)  # raises on a contract breach
    assert set(plan.positions("new").tolist()) <= set(initial.tolist())
    cold = engine.generate(TEXT, max_new_tokens=3, mode="cold")
    r = engine.generate(TEXT, max_new_tokens=3)
    assert r.content_hit_tokens == plan.content_tokens
    assert 0.0 <= r.recompute_ratio <= 1.0
    # the budget is the base's: a ratio keeps round(ratio * content) (measured from the layers that ran), a
    # threshold reports the fraction it used
    fraction = r.extra["content_recompute_fraction"]
    assert 0.0 <= fraction <= 1.0
    strategy = engine.recompute
    if strategy.ratio is not None and not strategy.full_prefill_cost and 0 < strategy.ratio < 1:
        assert fraction == pytest.approx(round(strategy.ratio * plan.content_tokens) / plan.content_tokens)
    assert torch.isfinite(r.first_token_logits).all()
    assert r.prompt_ids == cold.prompt_ids


def test_conformance_sees_every_family():
    assert all(reg.names() for reg in (CHUNKERS, HASHERS, CACHE_TIERS, EVICTION, KV_QUANT, RECOMPUTE))
    assert {"none", "selective", "cacheblend", "query_aware", "full", "true_deviation", "key_norm"} <= set(RECOMPUTE.names())
    assert {"fixed", "separator", "boundary_window"} <= set(CHUNKERS.names())
