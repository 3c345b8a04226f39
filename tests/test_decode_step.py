"""The fused decode step (kvboost.models.decode_step) against HF's forward, and how the engine picks it."""

from __future__ import annotations

import pytest
import torch
from tiny import ToyTokenizer, hf_greedy_reference, make_engine, random_ids, tiny_model

from kvboost.models.adapter import ModelAdapter
from kvboost.models.compute import auto_dtype, describe
from kvboost.models.decode_step import FusedDecodeStep, choose_decode, inductor_unavailable_reason, unsupported_reason
from kvboost.models.loading import resolve_dtype

needs_inductor = pytest.mark.skipif(inductor_unavailable_reason() is not None, reason=str(inductor_unavailable_reason()))


def _fused_run(model, prompt: list[int], fed: list[int], compile: bool):
    adapter = ModelAdapter(model, "tiny")
    with torch.inference_mode():
        kv = adapter.allocate(len(prompt) + len(fed) + 3)
        adapter.forward(torch.tensor(prompt), kv.cache)
    step = FusedDecodeStep(model, compile=compile)
    step.begin(kv, len(prompt))
    logits = [step(t) for t in fed]
    kv.set_length(step.length)
    return logits, kv


def _check_against_hf(model, *, compile: bool, atol: float) -> None:
    prompt = random_ids(37, seed=3)
    fed, ref_logits, ref_cache = hf_greedy_reference(model, prompt, steps=9)
    logits, kv = _fused_run(model, prompt, fed, compile)
    for ref, got in zip(ref_logits, logits, strict=True):
        assert got.shape == ref.shape
        assert torch.allclose(got, ref, atol=atol, rtol=0), (got - ref).abs().max()
        assert int(got.argmax()) == int(ref.argmax())
    n = len(prompt) + len(fed)
    assert kv.length() == n
    for layer, ref_layer in zip(kv.layers, ref_cache.layers, strict=True):  # the rows the step wrote
        assert torch.allclose(layer.keys, ref_layer.keys, atol=atol, rtol=0)
        assert torch.allclose(layer.values, ref_layer.values, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_eager_step_is_hf_forward_to_the_bit(arch, dtype):
    """decode=eager is the exact choice: logits and K/V rows bit-equal to HF's, in bf16 as well."""
    _check_against_hf(tiny_model(arch).to(dtype), compile=False, atol=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_eager_step_with_an_int8_head_is_hf_forward_to_the_bit(dtype):
    from kvboost.models.int8_head import quantize_lm_head

    _check_against_hf(quantize_lm_head(tiny_model("llama").to(dtype), "int8"), compile=False, atol=0.0)


@needs_inductor
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # without and with projection biases
def test_compiled_step_equals_hf_forward(arch):
    _check_against_hf(tiny_model(arch), compile=True, atol=1e-4)


@needs_inductor
def test_compiled_step_does_not_recompile_for_new_positions_or_buffers():
    from torch._dynamo.utils import counters

    model = tiny_model("llama")
    step = FusedDecodeStep(model, compile=True)
    step.warmup()
    before = counters["stats"]["unique_graphs"]
    for n, extra in ((20, 5), (64, 9), (130, 40)):  # 64: a buffer size equal to a model dimension
        prompt = random_ids(n, seed=n)
        adapter = ModelAdapter(model, "tiny")
        with torch.inference_mode():
            kv = adapter.allocate(n + extra)
            adapter.forward(torch.tensor(prompt), kv.cache)
        step.begin(kv, n)
        for t in random_ids(4, seed=n + 1):
            step(t)
    assert counters["stats"]["unique_graphs"] == before
    assert step.compile_seconds > 0 and step.fallback_reason is None


def test_a_failing_compiler_falls_back_to_the_eager_step(monkeypatch):
    model = tiny_model("llama")
    prompt = random_ids(20, seed=5)
    fed, ref_logits, _ = hf_greedy_reference(model, prompt, steps=3)
    step = FusedDecodeStep(model, compile=False)
    step.compiled = True  # pretend it was compiled, with a compiler that fails

    def broken(*args, **kwargs):
        raise RuntimeError("inductor: no compiler\nmore lines")

    step._layer_fn = broken
    adapter = ModelAdapter(model, "tiny")
    with torch.inference_mode():
        kv = adapter.allocate(30)
        adapter.forward(torch.tensor(prompt), kv.cache)
    step.begin(kv, len(prompt))
    logits = [step(t) for t in fed]
    assert step.fallback_reason == "RuntimeError: inductor: no compiler" and not step.compiled
    for ref, got in zip(ref_logits, logits, strict=True):
        assert torch.allclose(got, ref, atol=1e-5, rtol=0)


def test_unsupported_models_keep_hf_decode():
    for arch in ("phi3", "gemma"):
        model = tiny_model(arch)
        assert unsupported_reason(model) is not None
        mode, reason = choose_decode("auto", model, "sdpa")
        assert mode == "hf" and "unsupported" in reason
        with pytest.raises(ValueError, match="does not support"):
            choose_decode("eager", model, "sdpa")
        with pytest.raises(ValueError, match="does not support"):
            FusedDecodeStep(model)


def test_decode_choice_follows_the_attention_backend_and_the_environment(monkeypatch):
    model = tiny_model("llama")
    monkeypatch.delenv("KVBOOST_DECODE", raising=False)
    assert choose_decode("auto", model, "triton")[0] == "hf"  # other backends keep their own decode attention
    with pytest.raises(ValueError, match="attn='triton'"):
        choose_decode("compiled", model, "triton")
    with pytest.raises(ValueError, match="decode must be"):
        choose_decode("fast", model, "sdpa")
    monkeypatch.setenv("KVBOOST_DECODE", "eager")
    assert choose_decode("auto", model, "sdpa") == ("eager", "KVBOOST_DECODE")
    assert choose_decode("auto", model, "triton")[0] == "hf"  # the override never forces an impossible mode
    assert choose_decode("hf", model, "sdpa") == ("hf", "requested")  # explicit beats the environment
    monkeypatch.setenv("KVBOOST_DECODE", "turbo")
    with pytest.raises(ValueError, match="KVBOOST_DECODE"):
        choose_decode("auto", model, "sdpa")
    monkeypatch.delenv("KVBOOST_DECODE")
    monkeypatch.setattr("kvboost.models.decode_step.inductor_unavailable_reason", lambda: "no C++ compiler")
    assert choose_decode("auto", model, "sdpa") == ("eager", "not compiled: no C++ compiler")
    with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
        choose_decode("compiled", model, "sdpa")


@pytest.mark.parametrize("decode", ["hf", "eager"])
def test_engine_answers_and_stored_answers_do_not_depend_on_the_decode_path(decode):
    """Cold and reuse agree, and the KV the step wrote for generated tokens is what a cold prefill computes:
    the next turn reuses it (store_generated) and still equals a cold prefill within 1e-4."""
    engine = make_engine("llama", decode=decode, layers=3)
    assert engine.decode_info()["decode"] == decode
    prompt = random_ids(48, seed=11)
    first = engine.generate(prompt, 12)
    assert engine.generate(prompt, 12, mode="cold").output_ids == first.output_ids
    follow = prompt + first.output_ids + random_ids(9, seed=12)
    cold = engine.generate(follow, 8, mode="cold")
    warm = engine.generate(follow, 8)
    assert warm.cached_tokens > len(prompt)  # generated tokens' KV came from the store
    assert warm.output_ids == cold.output_ids
    assert torch.allclose(warm.first_token_logits, cold.first_token_logits, atol=1e-4, rtol=0)
    engine.close()


def test_engine_decode_paths_give_the_same_tokens():
    outputs = {}
    for decode in ("hf", "eager"):
        engine = make_engine("qwen2", decode=decode)
        outputs[decode] = [engine.generate(random_ids(30 + i, seed=i), 10).output_ids for i in range(3)]
        engine.close()
    assert outputs["hf"] == outputs["eager"]


def test_engine_warmup_reports_the_decode_path():
    engine = make_engine("llama", decode="eager")
    info = engine.warmup()
    assert info["decode"] == "eager" and info["decode_compile_s"] >= 0
    assert engine.warmup() == engine.decode_info()  # a second warm-up does nothing more
    engine.close()
    phi = make_engine("phi3")
    assert phi.warmup()["decode"] == "hf"
    phi.close()


def test_auto_dtype_follows_the_hardware(monkeypatch):
    monkeypatch.setattr("kvboost.models.compute.cpu_bf16_isa", lambda: None)
    assert auto_dtype("cpu")[0] == torch.float32
    assert resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr("kvboost.models.compute.cpu_bf16_isa", lambda: "amx")
    assert auto_dtype("cpu") == (torch.bfloat16, "CPU with amx")
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32  # explicit dtypes are never changed
    info = describe(torch.bfloat16, "cpu", "auto")
    assert info["dtype"] == "bfloat16" and "amx" in info["matmul_path"] and info["dtype_reason"] == "CPU with amx"
    assert describe(torch.float32, "cpu", "float32")["matmul_path"].endswith("fp32 BLAS")
    with pytest.raises(ValueError, match="auto"):
        resolve_dtype("fp8")


def test_the_environment_chooses_the_default_decode_path(monkeypatch):
    monkeypatch.setenv("KVBOOST_DECODE", "hf")
    engine = make_engine("llama")
    info = engine.decode_info()
    assert {k: info[k] for k in ("decode", "decode_reason", "decode_compile_s")} == {
        "decode": "hf", "decode_reason": "KVBOOST_DECODE", "decode_compile_s": 0.0,
    }  # fmt: skip
    engine.close()


def _awq_tiny(arch: str, dtype: torch.dtype):
    from kvboost.models.awq import AWQConfig, quantize_model_rtn

    model = tiny_model(arch)
    quantize_model_rtn(model, AWQConfig(group_size=32))
    return model.to(dtype)


@pytest.mark.parametrize("cpu_kernel", ["auto", "dequant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # without and with projection biases (kept in the int4 linear)
def test_eager_step_with_awq_int4_projections_is_hf_forward_to_the_bit(monkeypatch, arch, dtype, cpu_kernel):
    """AWQ int4 projections in the eager step: fused per input where the int4 CPU kernel serves one-row calls
    (cpu_kernel auto), through their own modules otherwise (dequant); HF's bits either way."""
    from kvboost.models.awq import AWQLinear

    monkeypatch.setattr(AWQLinear, "cpu_kernel", cpu_kernel)
    model = _awq_tiny(arch, dtype)
    assert isinstance(model.model.layers[0].self_attn.q_proj, AWQLinear)
    assert FusedDecodeStep(model, compile=False).int4_fused == (cpu_kernel == "auto")
    _check_against_hf(model, compile=False, atol=0.0)


@needs_inductor
def test_compiled_step_with_fused_int4_projections_equals_hf_forward():
    model = _awq_tiny("qwen2", torch.float32)
    assert FusedDecodeStep(model, compile=True).int4_fused
    _check_against_hf(model, compile=True, atol=1e-4)


def test_fused_int4_step_shares_the_modules_codes():
    """The fused matrices are the modules' own derived form (views of the same storage), not a second copy,
    where a module's rows start on a packing block (the tiny model's q_proj: 64 rows)."""
    model = _awq_tiny("llama", torch.bfloat16)
    step = FusedDecodeStep(model, compile=False)
    layer = model.model.layers[0]
    qkv, gate_up = step._layer_weights[0][1], step._layer_weights[0][8]
    attn = layer.self_attn
    assert qkv.shape[0] == attn.q_proj.out_features + attn.k_proj.out_features + attn.v_proj.out_features
    for proj, fused in ((attn.q_proj, qkv), (layer.mlp.gate_proj, gate_up), (layer.mlp.up_proj, gate_up)):
        packed, _ = proj.int4pack(torch.bfloat16)
        assert packed.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()


def test_decode_choice_for_awq_models(monkeypatch):
    from kvboost.models.awq import AWQLinear

    monkeypatch.delenv("KVBOOST_DECODE", raising=False)
    model = _awq_tiny("llama", torch.bfloat16)
    assert unsupported_reason(model) is None
    mode, reason = choose_decode("auto", model, "sdpa")
    assert mode == "eager" and "int4" in reason and "fused" in reason
    assert choose_decode("eager", model, "sdpa") == ("eager", "requested")
    monkeypatch.setattr(AWQLinear, "cpu_kernel", "dequant")  # no one-row int4 kernel: nothing to fuse
    mode, reason = choose_decode("auto", model, "sdpa")
    assert mode == "eager" and "own modules" in reason
    with pytest.raises(ValueError, match="int4"):
        choose_decode("compiled", model, "sdpa")
    with pytest.raises(ValueError, match="int4"):
        FusedDecodeStep(model, compile=True)
    monkeypatch.setattr(AWQLinear, "cpu_kernel", "auto")
    from kvboost import KVBoost

    def engine(**options):
        return KVBoost(model, ToyTokenizer(), model_identity="tiny-awq", chunker={"name": "fixed", "chunk_size": 16},
                       share_model=True, **options)  # fmt: skip

    fused_engine = engine()
    assert fused_engine.decode_info()["decode"] == "eager"
    assert fused_engine._decode_step.int4_fused
    ids = random_ids(20, seed=5)
    fused = fused_engine.generate(ids, max_new_tokens=6, mode="cold").output_ids
    hf = engine(decode="hf").generate(ids, max_new_tokens=6, mode="cold").output_ids
    assert fused == hf
