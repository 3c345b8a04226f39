"""Every configuration field that can change the bits of stored K/V is in the cache key (issue 42, D9).

Each field of the engine (constructor, ``from_pretrained`` loading options, ``kv`` and ``core`` settings) is listed
here in one of two tables, and a test fails if a field is in neither (a new option must be classified):

- ``KEYED``: it chooses how K/V are computed (weights, dtype, kernels, quantizer, chunking): two engines that differ
  in it get different fingerprints (so no entry of one is served to the other, through a shared disk or Redis tier).
  The recompute strategy keys the approximate (repaired) entries only: exact K/V do not depend on it.
- ``UNKEYED``: it only schedules the same kernels (batch composition, the prefill chunk budget, draft verification
  rows), places entries (tiers, eviction, pool size) or acts before/after the K/V (sampling, tokenization of text,
  storing policy): the fingerprint is the same, and where it changes the shapes of the kernels' calls the stored rows
  are shown to agree within fp32 rounding (what exact reuse promises, DESIGN.md invariant 1), not keyed apart.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from kvboost_testkit.tiny import ToyTokenizer, make_engine, random_ids, tiny_model

from kvboost import KVBoost
from kvboost.engine.inference import CORE_OPTIONS, KV_OPTIONS
from kvboost.models.options import LOADING_OPTIONS

#: field -> the variation a test builds (an engine option) and why it is keyed.
KEYED = {
    "model": "the weights (every tensor's bytes) and config: ModelFingerprint",
    "model_identity": "names the weights",
    "dtype": "the arithmetic's precision (from_pretrained: model dtype)",
    "device": "CPU and CUDA kernels round differently (device kind in the fingerprint)",
    "chunker": "decides what a chunk is (and the chunk boundaries of keys)",
    "hasher": "the key function itself",
    "quant": "stored K/V are the quantizer's round trip",
    "attn": "attention backends compute a layer's output with other kernels: later layers' K/V differ",
    "decode": "the decode step's kernels (eager, compiled by inductor, graphed) write the generated rows",
    "prefill": "fused or graphed prefill kernels",
    "prefill_weights": "plain or prepacked (oneDNN / MKL) projection kernels",
    "decode_activations": "decode=quantized rounds activations to int8 or keeps fp32 (tests/test_quant_step.py)",
    "chunked_prompts": "where decode is quantized, prompt rows on the quantized step instead of the dense prefill "
    "(the resolved prefill path is keyed; tests/test_quant_step.py builds both and compares fingerprints)",
    "kv.block_size": "paged kernels read the pool block by block",
    "weights": "GGUF int4 linears run torch's int4 kernel (weight formats in the fingerprint)",
    "awq_prefill": "AWQ prefill from dense copies or the int4 kernel",
    "lm_head": "int8 head: other weights (the head does not change K/V, but its weights are in the digest)",
    "streaming": "streamed AWQ layers run packed int4 kernels (weight formats in the fingerprint)",
    "recompute": "approximate (repaired) entries only: their keys carry the strategy's fingerprint",
}
UNKEYED = {
    "tokenizer": "text -> ids happens before the cache; keys are of ids",
    "cache": "where entries live, not what they hold",
    "eviction": "which entries stay, not what they hold",
    "store_generated": "whether generated rows are stored, not their bits",
    "store_canonical": "whether the canonical turn is stored (computed as any prefill)",
    "chat": "how text becomes ids (keys are of ids)",
    "seed": "sampling only",
    "share_model": "the weights are the same tensors",
    "max_kv_bytes": "a request size limit",
    "keep_buffer_bytes": "accepted for compatibility, no effect",
    "kv_events": "publishes the store's movements (kvboost.cache.events), changes none",
    "speculative": "verification runs the same kernels on k + 1 rows (rounding of the call's shape: tested below)",
    "kv.pool_bytes": "the pool's size",
    "kv.memory_fraction": "the pool's size",
    "kv.host_bytes": "a tier below the pool: copies of the pool's rows, loaded back as they are",
    "core.max_running": "batch composition (rounding of the call's shape: tested below)",
    "core.max_batch_tokens": "prefill chunking (rounding of the call's shape: tested below)",
    "core.aging_steps": "queue order",
    "core.cache_aware_limit": "queue order",
}


def fields_of_the_engine() -> set[str]:
    params = set(inspect.signature(KVBoost.__init__).parameters) - {"self", "kv", "core"}
    return (params | {"dtype", "device"} | set(LOADING_OPTIONS) | {f"kv.{o}" for o in KV_OPTIONS}
            | {f"core.{o}" for o in CORE_OPTIONS})  # fmt: skip


def test_every_field_is_classified():
    fields = fields_of_the_engine()
    assert not set(KEYED) & set(UNKEYED)
    missing = fields - set(KEYED) - set(UNKEYED)
    assert not missing, f"classify these engine fields in tests/test_cache_keys.py (KEYED or UNKEYED): {missing}"
    stale = (set(KEYED) | set(UNKEYED)) - fields
    assert not stale, f"fields no longer on the engine: {stale}"


def _fp(**options) -> str:
    engine = make_engine("llama", decode=options.pop("decode", "eager"), **options)
    try:
        return engine.fingerprint
    finally:
        engine.close()


@pytest.mark.parametrize("field, a, b", [
    ("chunker", {"chunker": {"name": "fixed", "chunk_size": 16}}, {"chunker": {"name": "fixed", "chunk_size": 32}}),
    ("quant", {"quant": "none"}, {"quant": "kivi8"}),
    ("attn", {"attn": "sdpa"}, {"attn": "eager"}),
    ("attn", {"attn": "sdpa"}, {"attn": "batch_invariant"}),
    ("attn", {"attn": "sdpa"}, {"attn": "triton"}),
    ("decode", {"decode": "eager"}, {"decode": "compiled"}),
    ("prefill", {"prefill": "fused"}, {"prefill": "hf"}),
    ("prefill_weights", {"prefill_weights": "plain"}, {"prefill_weights": "prepacked"}),
    ("kv.block_size", {"kv": {"block_size": 16}}, {"kv": {"block_size": 32}}),
])  # fmt: skip
def test_keyed_fields_change_the_fingerprint(field, a, b):
    assert field in KEYED
    assert _fp(**a) != _fp(**b), f"{field}: {a} and {b} share a fingerprint"


def test_the_weights_the_identity_and_the_dtype_change_the_fingerprint():
    engines = [KVBoost(tiny_model("llama", seed=0), ToyTokenizer(), model_identity="m"),
               KVBoost(tiny_model("llama", seed=1), ToyTokenizer(), model_identity="m"),
               KVBoost(tiny_model("llama", seed=0), ToyTokenizer(), model_identity="n"),
               KVBoost(tiny_model("llama", seed=0).to(torch.bfloat16), ToyTokenizer(), model_identity="m")]  # fmt: skip
    try:
        assert len({e.fingerprint for e in engines}) == len(engines)
        assert "device=cpu" in engines[0].fingerprint  # the device kind (CPU / CUDA kernels round differently)
    finally:
        for engine in engines:
            engine.close()


def test_the_recompute_strategy_keys_approximate_entries_only():
    """Exact keys are the same under every strategy; approximate keys differ by strategy and by ratio."""
    from kvboost.cache.entry import approximate_segment_key

    tags = {}
    for spec in ("none", {"name": "cacheblend", "ratio": 0.15}, {"name": "cacheblend", "ratio": 0.3}, "query_aware"):
        engine = make_engine("llama", layers=4, decode="eager", recompute=spec)
        try:
            tags[str(spec)] = (engine.fingerprint, engine.approx_tag)
        finally:
            engine.close()
    assert len({fp for fp, _ in tags.values()}) == 1  # exact K/V do not depend on the strategy
    approx = {approximate_segment_key("seg", tag) for _, tag in tags.values()}
    assert len(approx) == len(tags)


def _stored_rows(engine, ids: list[int], **generate) -> tuple[torch.Tensor, torch.Tensor]:
    """The K/V rows of every chunk stored for ``ids`` (prompt and generated), in order."""
    engine.generate(ids, **generate)
    tier = engine.store.tiers[0]
    entries = sorted((tier.peek(k) for k in tier.keys()), key=lambda e: e.start)
    keys, values = zip(*(e.payload.materialize() for e in entries), strict=True)
    return torch.cat(keys, dim=2), torch.cat(values, dim=2)


@pytest.mark.parametrize("field, a, b", [
    ("core.max_batch_tokens", {"core": {"max_batch_tokens": 2048}}, {"core": {"max_batch_tokens": 16}}),
    ("speculative", {}, {"speculative": {"name": "prompt_lookup", "num_draft": 4}}),
    ("kv.pool_bytes", {}, {"kv": {"pool_bytes": 2 * 2**20}}),
])  # fmt: skip
def test_unkeyed_fields_keep_the_fingerprint_and_the_rows_up_to_rounding(field, a, b):
    """Same fingerprint, and the stored rows of the same request agree within fp32 rounding of the call shapes."""
    assert field in UNKEYED
    ids = random_ids(70, seed=41)
    ids = ids[:35] + ids[:35]  # a repeat: prompt lookup drafts
    rows = []
    fps = []
    for options in (a, b):
        engine = make_engine("llama", decode="eager", **options)
        if field == "core.max_batch_tokens":
            engine.core.scheduler.idle_prefill_tokens = options["core"]["max_batch_tokens"]
        try:
            fps.append(engine.fingerprint)
            rows.append(_stored_rows(engine, ids, max_new_tokens=12))
        finally:
            engine.close()
    assert fps[0] == fps[1]
    (ka, va), (kb, vb) = rows
    assert ka.shape == kb.shape
    assert float((ka - kb).abs().max()) <= 1e-5 and float((va - vb).abs().max()) <= 1e-5
