"""The query_aware recompute strategy and the reader-attention probe it relies on."""

from __future__ import annotations

import pytest
import torch
from test_content_reuse import DOCS, blend_engine, rag_prompt
from kvboost_testkit.tiny import random_ids, tiny_model

from kvboost.kv.block_table import BlockTable
from kvboost.plan import Placement, ReusePlan
from kvboost.recompute.query_aware import QueryAware
from kvboost.reuse.repair import ReaderProbeHook
from kvboost.runtime.batch import ForwardBatch, SeqInput


def _warmed(recompute, attn="sdpa"):
    engine = blend_engine(recompute=recompute, attn=attn)
    for doc in DOCS:
        engine.warm(doc)
    return engine


@pytest.mark.parametrize("arch,attn", [("llama", "sdpa"), ("qwen2", "sdpa"), ("llama", "eager"), ("phi3", "sdpa")])
def test_the_probe_measures_the_models_own_attention(arch, attn):
    """The probe's probabilities (from the runner's queries and the pool's keys) equal the eager attention weights HF
    returns, for the last queries; the forward stops after the last probed layer."""
    ids = random_ids(40, seed=1)
    readers = torch.arange(33, 40)
    reference = tiny_model(arch, max_position_embeddings=1024, num_hidden_layers=4)  # blend_engine's model
    reference.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = reference(torch.tensor([ids]), output_attentions=True).attentions
    engine = blend_engine(arch, attn=attn)  # same seed, same weights; attention through a kvboost backend
    probe = ReaderProbeHook((0, 3), 40, readers)
    probe.scale = float(engine.model.model.layers[0].self_attn.scaling)
    table = BlockTable(engine.pool)
    with torch.inference_mode():
        out = engine.runner.run(ForwardBatch.build([SeqInput(table, ids)], hook=probe))
    assert out is None  # stopped after layer 3, the last probed one (no logits)
    got = probe.result()
    assert got.shape == (2, attentions[0].shape[1], 40)
    for row, layer in enumerate((0, 3)):
        want = attentions[layer][0, :, 33:40].mean(dim=1)
        assert float((got[row] - want).abs().max()) < 1e-5
    assert engine.attention.query_observer is None  # the HF-generic runner removes its observer after the layer
    table.release()


def test_ratio_one_equals_full_and_ratio_zero_equals_none():
    prompt = rag_prompt([2, 1, 0])
    full = _warmed("full").generate(prompt, max_new_tokens=5)
    none = _warmed("none").generate(prompt, max_new_tokens=5)
    one = _warmed({"name": "query_aware", "ratio": 1.0}).generate(prompt, max_new_tokens=5)
    zero = _warmed({"name": "query_aware", "ratio": 0.0}).generate(prompt, max_new_tokens=5)
    assert one.content_hit_tokens > 0 and "probe_ms" in one.extra
    # the leading new tokens (the system line before the documents) were computed exactly by the probe: the real
    # pass of a partial ratio skips them
    half = _warmed({"name": "query_aware", "ratio": 0.5}).generate(prompt, max_new_tokens=5)
    assert half.extra["probe_kept_tokens"] > 0
    assert float((one.first_token_logits - full.first_token_logits).abs().max()) <= 1e-4
    assert one.output_ids == full.output_ids
    # The probe's writes of the new tokens are computed again by the real pass: nothing of it leaks.
    assert float((zero.first_token_logits - none.first_token_logits).abs().max()) <= 1e-5
    assert zero.recompute_ratio == 0.0


def test_a_probe_that_stops_early_leaks_nothing():
    """to_layer < 1 stops the probe pass after its last probed layer: the new tokens' rows of the later layers are
    never written by it, and the real pass still computes them (ratio 0 equals none, ratio 1 equals full)."""
    prompt = rag_prompt([1, 0, 2])
    full = _warmed("full").generate(prompt, max_new_tokens=5)
    none = _warmed("none").generate(prompt, max_new_tokens=5)
    low = {"name": "query_aware", "from_layer": 0.25, "to_layer": 0.5}  # probes layer 1 of 4, stops after it
    one = _warmed({**low, "ratio": 1.0}).generate(prompt, max_new_tokens=5)
    zero = _warmed({**low, "ratio": 0.0}).generate(prompt, max_new_tokens=5)
    assert float((one.first_token_logits - full.first_token_logits).abs().max()) <= 1e-4
    assert one.output_ids == full.output_ids
    assert float((zero.first_token_logits - none.first_token_logits).abs().max()) <= 1e-5


def test_stop_after_layer_computes_only_the_layers_asked_for():
    """A hook whose ``stop_after`` is set ends the forward after that layer: the later layers' rows are never
    written (the pool's rows stay as they were) and no logits come back."""
    engine = _warmed("none")
    ids = random_ids(30, seed=4)
    with torch.inference_mode():
        full = BlockTable(engine.pool)
        logits = engine.runner.run(ForwardBatch.build([SeqInput(full, ids)]))
        want = engine.pool.read(full.slots(0, 30))[0]
        stopped_table = BlockTable(engine.pool)
        stopped_table.reserve(30)
        engine.pool.keys[:, :, stopped_table.slots(0, 30)] = 0.0
        hook = ReaderProbeHook((1,), 30, torch.arange(25, 30))
        stopped = engine.runner.run(ForwardBatch.build([SeqInput(stopped_table, ids)], hook=hook))
        got = engine.pool.read(stopped_table.slots(0, 30))[0]
    assert logits is not None and stopped is None
    assert torch.equal(got[:2], want[:2]) and not got[2:].any()
    full.release()
    stopped_table.release()


def test_cost_follows_the_ratio():
    fractions = {}
    for ratio in (0.1, 0.4):
        r = _warmed({"name": "query_aware", "ratio": ratio}).generate(rag_prompt([0, 2, 1]), max_new_tokens=2)
        fractions[ratio] = r.recompute_ratio * r.prompt_tokens / r.content_hit_tokens
    # every layer recomputes the same chosen tokens: the measured share of content is the ratio (rounding)
    assert fractions[0.1] == pytest.approx(0.1, abs=0.02)
    assert fractions[0.4] == pytest.approx(0.4, abs=0.02)


def test_the_tokens_read_most_are_the_ones_recomputed():
    plan = ReusePlan(
        list(range(12)),
        [
            Placement(0, 2, "new"),
            Placement(2, 10, "content", stored_start=0, keys=torch.zeros(1, 1, 8, 2), values=torch.zeros(1, 1, 8, 2)),
            Placement(10, 12, "new"),
        ],
    )
    attention = torch.zeros(3, 2, 8)
    attention[1, 0, 5] = 0.9  # content position 7: one head of one layer reads it strongly
    attention[:, :, 1] = 0.2  # content position 3: every head of every layer reads it a little
    mean = QueryAware(ratio=0.125, heads="mean")
    peak = QueryAware(ratio=0.125, heads="max")
    plan.reader_attention = attention
    # mean over heads: position 3 reads 0.2 x 3 layers = 0.6 > position 7's 0.45; max over heads: 0.9 > 0.6
    assert mean.schedule(plan, 3).initial.tolist() == [0, 1, 3, 10, 11]
    assert peak.schedule(plan, 3).initial.tolist() == [0, 1, 7, 10, 11]
    plan.reader_attention = None
    with pytest.raises(ValueError, match="reader_attention"):
        mean.schedule(plan, 3)


def test_probed_layers_and_bad_settings():
    assert QueryAware().reader_layers(30) == tuple(range(15, 30))
    assert QueryAware(from_layer=1.0).reader_layers(4) == (3,)  # at least the last layer
    assert QueryAware(from_layer=0.3, to_layer=0.6).reader_layers(30) == tuple(range(9, 18))
    assert QueryAware(from_layer=0.5, to_layer=0.5).reader_layers(4) == (2,)
    for bad in ({"ratio": 1.5}, {"from_layer": -0.1}, {"heads": "median"}, {"from_layer": 0.6, "to_layer": 0.3}):
        with pytest.raises(ValueError, match="query_aware"):
            QueryAware(**bad)
