"""The int8 LM head (kvboost.models.int8_head): rounding bound, kernel vs reference, what it replaces and what not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvboost_testkit.tiny import ToyTokenizer, random_ids, tiny_model

from kvboost.models.int8_head import Int8Linear, quantize_lm_head


def test_rounding_error_is_within_half_a_step_per_row():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=False)
    with torch.no_grad():
        linear.weight[3] *= 50  # rows of very different ranges get their own scales
        linear.weight[7] = 0  # an all-zero row stays zero (no division by zero)
    head = Int8Linear.from_linear(linear)
    err = (head.dequantized_weight() - linear.weight).abs()
    assert bool((err <= head.scales[:, None] / 2 + 1e-7).all())
    assert torch.equal(head.dequantized_weight()[7], torch.zeros(96))
    assert head.qweight.dtype == torch.int8 and int(head.qweight.abs().max()) == 127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_equals_the_dequantized_linear(dtype):
    torch.manual_seed(1)
    head = Int8Linear.from_linear(torch.nn.Linear(64, 48, bias=False))
    x = torch.randn(2, 5, 64).to(dtype)
    got = head(x)
    want = F.linear(x.float(), head.dequantized_weight()).to(dtype)
    assert got.shape == (2, 5, 48) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 0.05
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)


def test_dtype_casts_keep_the_codes():
    head = Int8Linear.from_linear(torch.nn.Linear(32, 16, bias=False))
    codes, scales = head.qweight.clone(), head.scales.clone()
    head.to(torch.bfloat16)
    assert torch.equal(head.qweight, codes) and torch.equal(head.scales, scales)


def test_quantize_lm_head_replaces_only_the_output_projection():
    model = tiny_model("llama")
    embed = model.model.embed_tokens.weight.detach().clone()
    ids = torch.tensor([random_ids(12, seed=2)])
    with torch.inference_mode():
        ref = model(input_ids=ids, use_cache=True)
    quantize_lm_head(model, "int8")
    assert isinstance(model.lm_head, Int8Linear) and model._kvboost_lm_head == "int8"
    assert torch.equal(model.model.embed_tokens.weight, embed)  # a tied embedding keeps its float weights
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
    for a, b in zip(ref.past_key_values.layers, out.past_key_values.layers, strict=True):  # K/V untouched
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert not torch.equal(out.logits, ref.logits)  # the logits moved, a little
    assert torch.allclose(out.logits, ref.logits, atol=0.05)
    assert quantize_lm_head(model, "int8") is model and isinstance(model.lm_head, Int8Linear)  # idempotent


def test_bad_choices_are_refused_with_the_reason():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="lm_head must be one of"):
        quantize_lm_head(model, "int4")
    with pytest.raises(ValueError, match="bias"):
        Int8Linear.from_linear(torch.nn.Linear(8, 8, bias=True))
    assert quantize_lm_head(model, None) is model and isinstance(model.lm_head, torch.nn.Linear)


def test_engine_decodes_with_an_int8_head_like_hf():
    from kvboost import KVBoost

    model = quantize_lm_head(tiny_model("llama").to(torch.bfloat16), "int8")

    def engine(**options):
        return KVBoost(model, ToyTokenizer(), model_identity="tiny-int8-head",
                       chunker={"name": "fixed", "chunk_size": 16}, share_model=True, **options)  # fmt: skip

    fused = engine(decode="eager")
    assert fused.decode_info()["decode"] == "eager"
    ids = random_ids(30, seed=4)
    assert fused.generate(ids, max_new_tokens=8, mode="cold").output_ids == engine(decode="hf").generate(
        ids, max_new_tokens=8, mode="cold"
    ).output_ids
