"""The fused prefill (kvboost.models.prefill_step) against HF's forward, dense AWQ prefill, and the engine's choice."""

from __future__ import annotations

import pytest
import torch
from tiny import make_engine, random_ids, tiny_model

from kvboost.attention.cpu_ext import cpu_extension_unavailable_reason
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
from kvboost.models.prefill_step import StepPrefill, causal_additive_mask, choose_prefill
from kvboost.models.prepack import PrepackedLinear, choose_prefill_weights, unavailable_reason
from kvboost.registry import ATTENTION


def _awq_tiny(arch: str, dtype: torch.dtype):
    model = tiny_model(arch)
    quantize_model_rtn(model, AWQConfig(group_size=32))
    return model.to(dtype)


def _both(model, start: int, new: int, *, prepacked: bool = False, attention=None):
    """(HF's logits and K/V, the fused prefill's) for ``new`` tokens after a ``start``-token prefix; ``attention``:
    a backend whose ``prefill_attention`` the fused prefill calls instead of SDPA."""
    ids = random_ids(start + new, seed=start + new)
    adapter = ModelAdapter(model, "tiny")
    prefill = StepPrefill(FusedDecodeStep(model, compile=False), prepacked=prepacked, attention=attention)
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_causal_additive_mask_is_what_sdpa_makes_of_the_bool_mask(dtype):
    """The mask built once per forward: 0 where query i (position start + i) sees key j <= start + i, -inf
    elsewhere, and SDPA gives the same bits with it as with the bool mask it replaces."""
    mask = causal_additive_mask(5, 4, dtype, torch.device("cpu"))
    assert mask.shape == (4, 9) and mask.dtype == dtype
    allowed = torch.arange(9)[None, :] <= torch.arange(5, 9)[:, None]
    assert torch.equal(mask == 0, allowed) and bool(torch.isneginf(mask[~allowed]).all())
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 6, 4, 16, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, 9, 16, generator=gen).to(dtype) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert torch.equal(
        sdpa(q, k, v, attn_mask=mask, enable_gqa=True), sdpa(q, k, v, attn_mask=allowed, enable_gqa=True)
    )


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
        engine = make_engine("llama", prefill=prefill, decode="eager", prefill_weights="plain")
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


# ---------------------------------------------------------------------- prepacked weights (bf16 on CPU)
needs_onednn_bf16 = pytest.mark.skipif(
    unavailable_reason(torch.bfloat16, torch.device("cpu")) is not None, reason="no oneDNN bf16 linear in this torch"
)


@needs_onednn_bf16
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v carry a bias the packed linear applies
def test_prepacked_prefill_is_close_to_hf_forward_in_bf16(arch):
    """Prepacked weights change only the kernel: logits and every K/V row stay within bf16 rounding of HF's
    forward, cold and after a cached prefix."""
    model = tiny_model(arch).to(torch.bfloat16)
    for start in (0, 31):
        hf, packed = _both(model, start, 22, prepacked=True)
        _assert_equal(hf, packed, atol=0.1)


@needs_onednn_bf16
def test_prepacked_linear_applies_weight_and_bias():
    gen = torch.Generator().manual_seed(2)
    w, b = (torch.randn(24, 40, generator=gen) * 0.1).bfloat16(), torch.randn(24, generator=gen).bfloat16()
    x = torch.randn(7, 40, generator=gen).bfloat16()
    linear = PrepackedLinear(w, b)
    assert linear.nbytes == 24 * 40 * 2
    assert torch.allclose(linear(x).float(), torch.nn.functional.linear(x, w, b).float(), atol=0.05, rtol=0.02)
    with pytest.raises(ValueError, match="takes 40"):
        linear(torch.randn(7, 41).bfloat16())


def test_prefill_weights_choice(monkeypatch):
    """auto packs only for the fused prefill with plain projections, bf16 on CPU with native bf16 and copies
    within the memory share; asking for prepacked where it cannot run is an error."""
    from kvboost.models import prepack

    cpu = torch.device("cpu")
    ok = {"fused_prefill": True, "plain_projections": True, "dtype": torch.bfloat16, "device": cpu,
          "weight_bytes": 10, "memory_bytes": 1000}  # fmt: skip
    monkeypatch.setattr(prepack, "native_bf16_cpu", lambda: True)
    if unavailable_reason(torch.bfloat16, cpu) is None:
        assert choose_prefill_weights("auto", **ok) == ("prepacked", "auto")
        assert choose_prefill_weights("prepacked", **ok) == ("prepacked", "requested")
        mode, reason = choose_prefill_weights("auto", **{**ok, "weight_bytes": 51})
        assert mode == "plain" and "5%" in reason
        monkeypatch.setattr(prepack, "native_bf16_cpu", lambda: False)
        mode, reason = choose_prefill_weights("auto", **ok)
        assert mode == "plain" and "native bf16" in reason
    assert choose_prefill_weights("plain", **ok) == ("plain", "requested")
    mode, reason = choose_prefill_weights("auto", **{**ok, "dtype": torch.float32})
    assert mode == "plain" and ("keeps HF's bits" in reason or "MKL" in reason)
    if unavailable_reason(torch.float32, cpu) is None:  # fp32 packs for MKL when asked
        assert choose_prefill_weights("prepacked", **{**ok, "dtype": torch.float32}) == ("prepacked", "requested")
    for field, value, words in [("dtype", torch.float16, "serve bf16 and fp32"), ("fused_prefill", False, "fused prefill"),
                                ("plain_projections", False, "AWQ")]:  # fmt: skip
        mode, reason = choose_prefill_weights("auto", **{**ok, field: value})
        assert mode == "plain" and words in reason
        with pytest.raises(ValueError, match="prefill_weights='prepacked' cannot run here"):
            choose_prefill_weights("prepacked", **{**ok, field: value})
    with pytest.raises(ValueError, match="prefill_weights must be"):
        choose_prefill_weights("packed", **ok)


@needs_onednn_bf16
def test_engine_prepacked_prefill_in_bf16():
    """An engine built on a bf16 model packs (when asked) and reports it; its reuse stays close to a cold prefill
    and to the plain engine's; fp32 engines never pack, and AWQ models refuse it."""
    from tiny import ToyTokenizer

    from kvboost import KVBoost

    prompt = random_ids(70, seed=8)
    logits = {}
    for weights in ("plain", "prepacked"):
        model = tiny_model("llama").to(torch.bfloat16)
        engine = KVBoost(model, ToyTokenizer(), model_identity="tiny-llama", prefill_weights=weights,
                         chunker={"name": "fixed", "chunk_size": 16}, decode="eager")  # fmt: skip
        info = engine.decode_info()
        assert info["prefill"] == "fused" and info["prefill_weights"] == weights
        engine.warm(prompt[:40])
        hit, cold = engine.generate(prompt, 4), engine.generate(prompt, 4, mode="cold")
        assert hit.cached_tokens == 40
        assert torch.allclose(hit.first_token_logits, cold.first_token_logits, atol=0.1, rtol=0)
        logits[weights] = hit.first_token_logits
        assert ("prefill_weights=prepacked" in engine.fingerprint) == (weights == "prepacked")
        engine.close()
        assert engine._prefill_step is None  # the packed copies go with the engine
    assert torch.allclose(logits["plain"], logits["prepacked"], atol=0.1, rtol=0)
    engine = make_engine("llama")  # fp32
    assert engine.decode_info()["prefill_weights"] == "plain"
    engine.close()
    model = _awq_tiny("llama", torch.bfloat16)
    with pytest.raises(ValueError, match="not AWQ int4|AWQ"):
        KVBoost(model, ToyTokenizer(), model_identity="tiny-awq", prefill_weights="prepacked")


needs_mkl_pack = pytest.mark.skipif(
    unavailable_reason(torch.float32, torch.device("cpu")) is not None, reason="no MKL packed GEMM in this torch"
)


@needs_mkl_pack
def test_mkl_packed_linear_matches_f_linear():
    """MKL's packed product of any row count equals F.linear within fp32 rounding (the bias added after)."""
    from kvboost.models.mkl_pack import MklPackedLinear

    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(48, 80, generator=gen), torch.randn(48, generator=gen)
    for bias in (None, b):
        linear = MklPackedLinear(w, bias)
        for rows in (1, 3, 17, 64, 130):
            x = torch.randn(rows, 80, generator=gen)
            assert torch.allclose(linear(x), torch.nn.functional.linear(x, w, bias), atol=1e-5, rtol=1e-5)
        assert linear(torch.randn(0, 80)).shape == (0, 48)
        assert linear(torch.randn(6, 160)[:, ::2]).shape == (6, 48)  # a strided input is made contiguous
    with pytest.raises(ValueError, match="takes \\[rows, 80\\]"):
        linear(torch.randn(3, 81))
    with pytest.raises(ValueError, match="fp32 CPU inputs"):
        linear(torch.randn(3, 80).bfloat16())
    with pytest.raises(ValueError, match="2-D fp32"):
        MklPackedLinear(w.bfloat16(), None)


@needs_mkl_pack
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mkl_prepacked_prefill_is_close_to_hf_forward_in_fp32(arch):
    """fp32 with MKL-packed weights: logits and K/V within 1e-4 of HF's forward, cold and after a cached prefix
    (what exact reuse promises in fp32)."""
    model = tiny_model(arch)
    for start in (0, 31):
        hf, packed = _both(model, start, 22, prepacked=True)
        _assert_equal(hf, packed, atol=1e-4)
    adapter, ids = ModelAdapter(model, "tiny"), random_ids(5)
    prefill = StepPrefill(FusedDecodeStep(model, compile=False), prepacked=True)
    model.to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="converted after the engine was built"), torch.inference_mode():
        prefill(torch.tensor(ids[:5]), 0, adapter.allocate(8))


@needs_mkl_pack
def test_engine_with_mkl_prepacked_weights_reuses_within_1e4_in_fp32():
    """fp32 packs only when asked; then a prefix hit still equals a cold prefill within 1e-4, same greedy tokens."""
    engine = make_engine("llama", prefill_weights="prepacked", decode="eager")
    info = engine.decode_info()
    assert info["prefill_weights"] == "prepacked" and info["prefill_weights_reason"] == "requested"
    # The packed copies are reported: MKL's layout of every projection weight, at least their fp32 bytes.
    weights = sum(p.numel() * 4 for layer in engine.model.model.layers for name, p in layer.named_parameters()
                  if name.endswith("proj.weight"))  # fmt: skip
    assert info["packed_weight_bytes"] >= weights
    prompt = random_ids(70, seed=9)
    engine.warm(prompt[:40])
    hit, cold = engine.generate(prompt, 6), engine.generate(prompt, 6, mode="cold")
    assert hit.cached_tokens == 40
    assert torch.allclose(hit.first_token_logits, cold.first_token_logits, atol=1e-4, rtol=0)
    assert hit.output_ids == cold.output_ids
    engine.close()


@pytest.mark.skipif(cpu_extension_unavailable_reason() is not None, reason="attn=cpu_kernel cannot be built here")
@pytest.mark.parametrize(("start", "new"), [(0, 23), (37, 19), (40, 1)])
def test_fused_prefill_with_the_cpu_kernel_is_close_to_hf_forward_in_fp32(start, new):
    """Logits and every K/V row of the fused prefill calling attn=cpu_kernel's kernel, against HF's forward (SDPA)."""
    model = tiny_model("llama")
    backend = ATTENTION.build({"name": "cpu_kernel", "tile": 8})
    ref, got = _both(model, start, new, attention=backend)
    assert backend.kernel_calls == model.config.num_hidden_layers
    _assert_equal(ref, got, atol=1e-5)
