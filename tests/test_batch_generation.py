"""generate_batch / generate_many: every row gives the tokens it gives alone; shared prefixes are computed once and
shared by reference; per-row sampling; bad inputs refused clearly."""

from __future__ import annotations

import pytest
import torch
from kvboost_testkit.tiny import ToyTokenizer, make_engine, random_ids, tiny_model

from kvboost import KVBoost


@pytest.mark.parametrize("decode", ["eager", "compiled"])
def test_rows_equal_their_single_runs_with_different_lengths(decode):
    """fp32: prompts of 9, 30, 47 and 80 tokens in one batch (one flat prefill, then batched decode steps, rows
    leaving at different times) give each prompt's single-run greedy tokens."""
    engine = make_engine("llama", decode=decode)
    prompts = [random_ids(n, seed=n) for n in (9, 30, 47, 80)]
    budgets = [6, 11, 3, 8]
    singles = [engine.generate(p, max_new_tokens=m, mode="cold").output_ids for p, m in zip(prompts, budgets)]
    # per-row max_new_tokens is not an option: rows leave when the shortest budget is reached by asking twice
    rows = engine.generate_batch(prompts, max_new_tokens=max(budgets), mode="cold")
    assert [r.output_ids[: len(s)] for r, s in zip(rows, singles)] == singles
    assert engine.decode_info()["forwards"][decode] > 0  # the batched decode ran on the path asked for
    engine.close()


def test_rows_that_finish_leave_the_batch():
    """A row that reaches end-of-sequence stops there while the others go on; the results keep the prompts' order."""
    engine = make_engine("llama", decode="eager")
    engine.eos_ids = set()
    prompts = [random_ids(n, seed=100 + n) for n in (12, 25, 40)]
    alone = [engine.generate(p, max_new_tokens=12, mode="cold").output_ids for p in prompts]
    engine.eos_ids = {alone[1][3]}  # the second row's fourth token ends it (or an earlier equal one)
    rows = engine.generate_batch(prompts, max_new_tokens=12, mode="cold")
    assert len(rows[1].output_ids) <= 4 < len(alone[1])
    for r, a in zip(rows, alone):
        stop = next((i for i, t in enumerate(a) if t in engine.eos_ids), len(a) - 1)
        assert r.output_ids == a[: stop + 1]
    engine.close()


def test_batch_reuse_matches_single_reuse_and_counts_hits():
    """With the cache: rows whose prefix is cached reuse it (exact hits by reference) and still give the cold
    tokens (fp32); the batch's prefill of plain suffixes is one forward."""
    engine = make_engine("llama", decode="eager")
    shared = random_ids(48, seed=7)
    engine.warm(shared)
    prompts = [shared + random_ids(n, seed=n) for n in (5, 17, 30)]
    cold = [engine.generate(p, max_new_tokens=6, mode="cold").output_ids for p in prompts]
    before = engine.decode_info()["forwards"]["eager"]
    rows = engine.generate_batch(prompts, max_new_tokens=6)
    assert [r.output_ids for r in rows] == cold
    assert all(r.cached_tokens == 48 for r in rows)
    assert all(r.extra["batched_prefill"] == 3 for r in rows)
    # one prefill forward for the three rows, then one decode forward per step (5 steps after the first token)
    assert engine.decode_info()["forwards"]["eager"] - before == 1 + 5
    engine.pool.verify()
    engine.close()


def test_rows_with_content_hits_are_repaired_alone_and_join_the_decode():
    """A row whose plan has content hits runs its repair prefill on its own; the batch still decodes together and
    every row equals its single run."""
    from test_content_reuse import DOCS, blend_engine, rag_prompt

    engine = blend_engine(recompute={"name": "cacheblend", "ratio": 0.5})
    for doc in DOCS:
        engine.warm(doc)
    prompts = [rag_prompt([2, 0]), rag_prompt([1, 2, 0]), random_ids(20, seed=3)]
    singles = [engine.generate(p, max_new_tokens=5, store=False) for p in prompts]
    rows = engine.generate_batch(prompts, max_new_tokens=5, store=False)
    assert rows[0].content_hit_tokens > 0 and rows[0].extra["layerwise"]
    assert [r.output_ids for r in rows] == [s.output_ids for s in singles]
    engine.close()


def test_sampling_settings_per_row():
    """temperature / do_sample per row: greedy rows are greedy whatever the others sample; a sampled row samples
    (a fixed seed gives the same tokens twice)."""
    engine = make_engine("llama", decode="eager")
    prompts = [random_ids(20, seed=1), random_ids(30, seed=2)]
    greedy = engine.generate(prompts[0], max_new_tokens=8, mode="cold").output_ids
    engine.reseed(5)
    a = engine.generate_batch(prompts, max_new_tokens=8, mode="cold", temperature=[1.0, 1.5], do_sample=[False, True])
    engine.reseed(5)
    b = engine.generate_batch(prompts, max_new_tokens=8, mode="cold", temperature=[1.0, 1.5], do_sample=[False, True])
    assert a[0].output_ids == greedy and [r.output_ids for r in a] == [r.output_ids for r in b]
    with pytest.raises(ValueError, match="temperature gives 3 values for 2 prompts"):
        engine.generate_batch(prompts, temperature=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="at least one prompt"):
        engine.generate_batch([])
    engine.close()


def test_bf16_rows_are_bit_exact_under_batch_invariant():
    """bf16 under attn=batch_invariant: a row's logits and tokens in a batch equal its single run's, bit for bit
    (projections run per sequence in position-aligned tiles, attention per sequence)."""
    model = tiny_model("llama", hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    engine = KVBoost(model.to(torch.bfloat16), ToyTokenizer(), model_identity="tiny-bf16",
                     chunker={"name": "fixed", "chunk_size": 16},
                     attn={"name": "batch_invariant", "tile": 16, "key_block": 16})  # fmt: skip
    prompts = [random_ids(n, seed=n) for n in (13, 37, 50)]
    singles = [engine.generate(p, max_new_tokens=6, mode="cold") for p in prompts]
    rows = engine.generate_batch(prompts, max_new_tokens=6, mode="cold", keep_logits=True)
    for r, s in zip(rows, singles):
        assert torch.equal(r.first_token_logits, s.first_token_logits)
        assert r.output_ids == s.output_ids
    engine.close()


def test_generate_many_computes_a_shared_prefix_once_and_shares_its_blocks():
    """Prompts sharing a 40-token prefix: the prefix is computed once (warm), every row of the group reuses it
    by reference, a prompt sharing nothing runs apart; results keep the prompts' order and equal cold runs."""
    engine = make_engine("llama", decode="eager")
    head = random_ids(40, seed=9)
    prompts = [head + random_ids(7, seed=1), random_ids(25, seed=2), head + random_ids(12, seed=3)]
    cold = [engine.generate(p, max_new_tokens=5, mode="cold").output_ids for p in prompts]
    results = engine.generate_many(prompts, max_new_tokens=5)
    assert [r.output_ids for r in results] == cold
    assert results[0].cached_tokens == results[2].cached_tokens == 32  # the shared whole chunks (16-token chunks)
    assert results[1].cached_tokens == 0
    engine.close()


def test_grouping_keeps_whole_chunks_and_a_token_to_compute():
    from kvboost.runtime.grouping import group_by_prefix

    engine = make_engine("llama")
    a = random_ids(40, seed=1)
    groups = group_by_prefix([a + [5], random_ids(10, seed=2), a + [6, 7], a[:20]], engine.chunker.split)
    assert groups == [([0, 2, 3], 16), ([1], 0)]  # a[:20] shares one whole chunk with the others
