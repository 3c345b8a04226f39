"""Layer-wise execution: a subset of positions run through a layer over mixed KV equals the full layer on
those rows, for every tiny architecture and attention backend (sdpa, eager, triton)."""

from __future__ import annotations

import pytest
import torch
from tiny import ARCHS, ToyTokenizer, random_ids, tiny_model

from kvboost import KVBoost
from kvboost.models.layerwise import LayerwiseModel

BACKENDS = ("sdpa", "eager", "triton")


def _engine(arch: str, attn: str) -> KVBoost:
    model = tiny_model(arch, num_hidden_layers=3)
    return KVBoost(model, ToyTokenizer(), model_identity=f"tiny-{arch}", attn=attn)


def _full_kv(engine: KVBoost, ids: list[int]):
    kv = engine.adapter.allocate(len(ids) + 4)
    with torch.inference_mode():
        logits = engine.adapter.forward(torch.tensor(ids), kv.cache)[-1]
    return kv, logits


@pytest.mark.parametrize("attn", BACKENDS)
@pytest.mark.parametrize("arch", ARCHS)
def test_subset_forward_equals_full_layers_on_selected_rows(arch, attn):
    engine = _engine(arch, attn)
    ids = random_ids(41, seed=3)
    full, full_logits = _full_kv(engine, ids)
    reference_k, reference_v = full.keys[:, :, : len(ids)].clone(), full.values[:, :, : len(ids)].clone()

    # A fresh KV holding the full prefill's rows everywhere, with the selected rows garbage: the subset
    # forward must recompute them, at every layer, to exactly the full layer's values.
    selected = torch.tensor(sorted({0, 5, 6, 7, 19, 33, 40}))
    kv = engine.adapter.allocate(len(ids) + 4)
    kv.write(0, reference_k, reference_v)
    kv.keys[:, :, selected] = 1e3
    kv.values[:, :, selected] = -1e3
    layerwise = LayerwiseModel(engine.model, engine.attention)
    calls_before = engine.attention.kernel_calls
    with torch.inference_mode():
        logits, stats = layerwise.prefill(torch.tensor(ids), kv, selected, content_mask=torch.zeros(len(ids), dtype=torch.bool))
    assert engine.attention.kernel_calls - calls_before == engine.adapter.num_layers  # the backend really ran
    assert stats.computed_per_layer == [len(selected)] * engine.adapter.num_layers
    assert float((kv.keys[:, :, : len(ids)] - reference_k).abs().max()) <= 1e-4
    assert float((kv.values[:, :, : len(ids)] - reference_v).abs().max()) <= 1e-4
    assert float((logits - full_logits).abs().max()) <= 1e-4
    assert kv.length() == len(ids)


@pytest.mark.parametrize("arch", ARCHS)
def test_all_positions_layerwise_equals_the_model_forward(arch):
    engine = _engine(arch, "sdpa")
    ids = random_ids(30, seed=4)
    _, full_logits = _full_kv(engine, ids)
    kv = engine.adapter.allocate(len(ids) + 4)
    with torch.inference_mode():
        logits, _ = engine.layerwise.prefill(torch.tensor(ids), kv, torch.arange(len(ids)),
                                             content_mask=torch.zeros(len(ids), dtype=torch.bool))
        # and decoding continues from it like from the model's own prefill
        step = engine.adapter.forward(torch.tensor([7]), kv.cache)[-1]
        ref_kv, _ = _full_kv(engine, ids)
        ref_step = engine.adapter.forward(torch.tensor([7]), ref_kv.cache)[-1]
    assert float((logits - full_logits).abs().max()) <= 1e-4
    assert float((step - ref_step).abs().max()) <= 1e-4


def test_a_selected_query_never_sees_later_keys():
    """Query at position p attends keys <= p only: poisoning every later row must not change its output."""
    engine = _engine("llama", "sdpa")
    ids = random_ids(24, seed=5)
    full, full_logits = _full_kv(engine, ids)
    for attn in BACKENDS:
        eng = _engine("llama", attn)
        eng.model.load_state_dict(engine.model.state_dict())
        kv = eng.adapter.allocate(len(ids))
        kv.write(0, full.keys[:, :, : len(ids)], full.values[:, :, : len(ids)])
        with torch.inference_mode():
            logits, _ = eng.layerwise.prefill(torch.tensor(ids), kv, torch.tensor([10, 23]),
                                              content_mask=torch.zeros(len(ids), dtype=torch.bool))
        assert float((kv.keys[:, :, 10] - full.keys[:, :, 10]).abs().max()) <= 1e-4, attn
        assert float((logits - full_logits).abs().max()) <= 1e-4, attn
