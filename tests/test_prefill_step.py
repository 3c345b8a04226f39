"""The fused prefill (kvboost.models.prefill_step) against HF's forward, dense AWQ prefill, and the engine's choice."""

from __future__ import annotations

import pytest
import torch
from tiny import make_engine, random_ids, tiny_model

from kvboost.models.adapter import ModelAdapter
from kvboost.models.awq import (
    DENSE_MIN_ROWS,
    AWQConfig,
    AWQLinear,
    enable_dense_prefill,
    quantize_model_rtn,
    set_awq_prefill,
)
from kvboost.models.decode_step import FusedDecodeStep
from kvboost.models.prefill_step import StepPrefill, choose_prefill


def _awq_tiny(arch: str, dtype: torch.dtype):
    model = tiny_model(arch)
    quantize_model_rtn(model, AWQConfig(group_size=32))
    return model.to(dtype)


def _both(model, start: int, new: int):
    """(HF's logits and K/V, the fused prefill's) for ``new`` tokens after a ``start``-token prefix."""
    ids = random_ids(start + new, seed=start + new)
    adapter = ModelAdapter(model, "tiny")
    prefill = StepPrefill(FusedDecodeStep(model, compile=False))
    out = []
    for fused in (False, True):
        with torch.inference_mode():
            kv = adapter.allocate(start + new + 2)
            kv.keys.zero_(), kv.values.zero_()
            if start:
                adapter.forward(torch.tensor(ids[:start]), kv.cache)
            kv.set_length(start)
            if fused:
                logits = prefill(torch.tensor(ids[start:]), start, kv)
                kv.set_length(start + new)
            else:
                logits = adapter.forward(torch.tensor(ids[start:]), kv.cache)[-1]
            out.append((logits, kv.keys[:, :, : start + new].clone(), kv.values[:, :, : start + new].clone()))
    return out


def _assert_equal(ref, got, atol: float = 0.0) -> None:
    for a, b in zip(ref, got, strict=True):
        assert a.shape == b.shape
        assert torch.allclose(a.float(), b.float(), atol=atol, rtol=0), (a.float() - b.float()).abs().max()


@pytest.mark.parametrize("start,new", [(0, 29), (23, 17), (40, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_fused_prefill_is_hf_forward_to_the_bit(arch, dtype, start, new):
    """Logits and every K/V row equal HF's forward exactly: cold, after a cached prefix, one token."""
    ref, got = _both(tiny_model(arch).to(dtype), start, new)
    _assert_equal(ref, got)


def test_fused_prefill_with_an_int8_head_is_hf_forward_to_the_bit():
    from kvboost.models.int8_head import quantize_lm_head

    ref, got = _both(quantize_lm_head(tiny_model("llama").to(torch.bfloat16), "int8"), 11, 20)
    _assert_equal(ref, got)


@pytest.mark.parametrize("new", [3, 20])  # fp32: 3+ rows leave the int4 kernel for dequantize + F.linear
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_prefill_with_awq_int4_projections_is_hf_forward_to_the_bit(arch, dtype, new):
    model = _awq_tiny(arch, dtype)
    assert FusedDecodeStep(model, compile=False).int4_fused
    ref, got = _both(model, 9, new)
    _assert_equal(ref, got)


def test_dense_prefill_multiplies_dequantized_copies_from_the_threshold():
    torch.manual_seed(0)
    module = AWQLinear.from_linear(torch.nn.Linear(64, 96), group_size=32).to(torch.bfloat16)
    small = torch.randn(DENSE_MIN_ROWS - 1, 64, dtype=torch.bfloat16)
    large = torch.randn(DENSE_MIN_ROWS, 64, dtype=torch.bfloat16)
    int4_small, int4_large = module(small), module(large)
    holder = torch.nn.Sequential(module)
    assert enable_dense_prefill(holder) == 1
    dense = module.dequantized_weight(torch.bfloat16)
    assert torch.equal(module(small), int4_small)  # below the threshold: still the int4 kernel
    expected = torch.nn.functional.linear(large, dense) + module.bias.to(torch.bfloat16)
    assert torch.equal(module(large), expected)
    assert not torch.equal(expected, int4_large)  # really another path (another rounding)
    assert torch.allclose(expected.float(), int4_large.float(), atol=0.1, rtol=0.05)  # of the same weights
    module.qweight.add_(1)  # an edited buffer rebuilds the copy
    assert not torch.equal(module.dense_weight(torch.bfloat16), dense)
    enable_dense_prefill(holder, None)
    assert module.dense_min_rows is None and module._dense is None
    with pytest.raises(ValueError, match="min_rows"):
        enable_dense_prefill(holder, 0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dense_fused_prefill_equals_the_dense_modules_and_shares_their_copies(arch):
    """With dense prefill the fused loop multiplies q/k/v and gate/up as one dense matrix each: the modules hold
    views of those copies (no second copy) and HF's forward through the modules agrees closely (another
    product shape, so not to the bit); below the threshold the fused int4 path is HF's to the bit."""
    model = _awq_tiny(arch, torch.float32)
    set_awq_prefill(model, "dense")
    prefill = StepPrefill(FusedDecodeStep(model, compile=False))
    assert prefill.dense_min_rows == DENSE_MIN_ROWS
    layer = model.model.layers[0]
    fused_qkv = prefill._dense_layers[0][1]
    for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
        assert proj.dense_weight(torch.float32).untyped_storage().data_ptr() == fused_qkv.untyped_storage().data_ptr()
    ref, got = _both(model, 9, 20)
    _assert_equal(ref, got, atol=1e-4)
    ref, got = _both(model, 9, DENSE_MIN_ROWS - 1)
    _assert_equal(ref, got)


def test_awq_prefill_option_is_checked():
    with pytest.raises(ValueError, match="no AWQ linears"):
        set_awq_prefill(tiny_model("llama"), "dense")
    with pytest.raises(ValueError, match="awq_prefill must be"):
        set_awq_prefill(_awq_tiny("llama", torch.float32), "int2")
    model = tiny_model("llama")
    assert set_awq_prefill(model, None) is model and set_awq_prefill(model, "int4") is model


def test_prefill_choice_follows_the_model_the_backend_and_hooks():
    model = tiny_model("llama")
    assert choose_prefill("auto", model, "sdpa") == ("fused", "auto")
    assert choose_prefill("hf", model, "sdpa") == ("hf", "requested")
    mode, reason = choose_prefill("auto", model, "triton")
    assert mode == "hf" and "triton" in reason
    with pytest.raises(ValueError, match="prefill='fused' cannot run here"):
        choose_prefill("fused", model, "eager")
    with pytest.raises(ValueError, match="prefill must be"):
        choose_prefill("fast", model, "sdpa")
    assert choose_prefill("auto", tiny_model("phi3"), "sdpa")[0] == "hf"
    handle = model.model.layers[1].register_forward_pre_hook(lambda *a: None)
    mode, reason = choose_prefill("auto", model, "sdpa")
    assert mode == "hf" and "hooks" in reason
    handle.remove()

    class Padded:
        name, key_tile = "sdpa", 16

    assert choose_prefill("auto", model, Padded())[0] == "hf"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engine_prefill_paths_give_the_same_bits(dtype):
    """The same requests through prefill=hf and prefill=fused: identical first-token logits and tokens, cold and
    with a prefix hit, and the same attention-call count."""
    results, calls = {}, {}
    for prefill in ("hf", "fused"):
        engine = make_engine("llama", prefill=prefill, decode="eager")
        engine.model.to(dtype)
        assert engine.decode_info()["prefill"] == prefill
        prompt = random_ids(70, seed=5)
        engine.warm(prompt[:40])
        runs = [engine.generate(prompt, 6), engine.generate(prompt, 6, mode="cold")]
        assert runs[0].cached_tokens == 40  # the partial last chunk is a stored chunk too
        results[prefill] = [(r.output_ids, r.first_token_logits) for r in runs]
        calls[prefill] = engine.attention.stats()["kernel_calls"]
        engine.close()
    for (ids_hf, logits_hf), (ids_fused, logits_fused) in zip(results["hf"], results["fused"], strict=True):
        assert ids_hf == ids_fused and torch.equal(logits_hf, logits_fused)
    assert calls["hf"] == calls["fused"]


def test_engine_reports_why_it_keeps_hf_prefill():
    engine = make_engine("llama", attn="eager")
    info = engine.decode_info()
    assert info["prefill"] == "hf" and "eager" in info["prefill_reason"] and info["awq_prefill"] is None
    engine.close()


def test_engine_with_dense_awq_prefill_reuses_exactly_in_fp32():
    """Dense prefill is a property of the model: warm, prefix hit and cold prefill all run through it, so a
    prefix hit still equals a cold prefill (fp32, 1e-4) and the engine reports it."""
    from tiny import ToyTokenizer

    from kvboost import KVBoost

    model = set_awq_prefill(_awq_tiny("llama", torch.float32), "dense")
    engine = KVBoost(model, ToyTokenizer(), model_identity="tiny-awq", chunker={"name": "fixed", "chunk_size": 16})
    assert engine.decode_info()["awq_prefill"] == "dense" and engine.decode_info()["prefill"] == "fused"
    prompt = random_ids(60, seed=9)
    engine.warm(prompt[:32])
    warm, cold = engine.generate(prompt, 6), engine.generate(prompt, 6, mode="cold")
    assert warm.cached_tokens == 32 and warm.output_ids == cold.output_ids
    assert torch.allclose(warm.first_token_logits, cold.first_token_logits, atol=1e-4, rtol=0)
    engine.close()
