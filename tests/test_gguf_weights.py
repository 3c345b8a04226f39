"""``weights="gguf_int4"`` (kvboost.models.gguf_weights): a GGUF model's Q4_0/Q4_1/Q4_K linears run as shipped in
torch's int4 CPU kernel. On the bundled SmolLM2 GGUF (all 210 decoder linears Q4_1, llama: q/k rows permuted by
llama.cpp) and on small GGUF files written here from tiny llama / qwen2 models (biases, mixed tensor types, an
untied int4 head)."""

from __future__ import annotations

import copy
import os
import time

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T
from kvboost_testkit.tiny import ToyTokenizer, random_ids, tiny_model, write_gguf

from kvboost.models.gguf_int4 import GGUFInt4Linear
from kvboost.models.gguf_weights import (
    apply_gguf_int4,
    gguf_reader,
    hf_linear_name,
    llama_row_order,
    weight_format_counts,
    weight_formats,
)
from kvboost.models.options import LoadOptions, load_for_engine


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous().view(torch.int32)


def _bundled_path():
    from kvboost.models.loading import bundled_gguf_path

    try:
        return bundled_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def bundled_pair():
    """(dense fp32 model, gguf_int4 fp32 model, tokenizer) of the bundled SmolLM2 GGUF."""
    _bundled_path()
    dense, tokenizer, _, _ = load_for_engine(None, dtype="float32", device="cpu", options=LoadOptions())
    int4, _, _, _ = load_for_engine(None, dtype="float32", device="cpu", options=LoadOptions(weights="gguf_int4"))
    return dense, int4, tokenizer


# ---------------------------------------------------------------------------------------------- the bundled model
@pytest.mark.integration
def test_every_replaced_linear_is_the_dense_weight_bit_for_bit(bundled_pair):
    """All 210 decoder linears are Q4_1 and replaced; each dequantizes (fp32) to the weight transformers loaded for
    it, bit for bit, q/k included (their rows un-permuted); the head (tied to the Q8_0 embedding) stays dense."""
    dense, int4, _ = bundled_pair
    replaced = {n: m for n, m in int4.named_modules() if isinstance(m, GGUFInt4Linear)}
    assert len(replaced) == 210 and {m.tensor_type for m in replaced.values()} == {"Q4_1"}
    assert weight_formats(int4)["gguf_int4:Q4_1"] == sorted(replaced, key=list(replaced).index)
    assert weight_format_counts(int4) == {"gguf_int4:Q4_1": 210, "dense:float32": 1}
    assert type(int4.lm_head) is torch.nn.Linear and int4.lm_head.weight is int4.model.embed_tokens.weight
    for name, module in replaced.items():
        ref = dense.get_submodule(name).weight
        assert torch.equal(_bits(module.dequantized_weight(torch.float32)), _bits(ref)), name
        assert module.bias is None
    # the permutation is real: q/k rows as stored in the file are not HF's
    reader = gguf.GGUFReader(_bundled_path())
    raw_q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    unpermuted = GGUFInt4Linear.from_gguf(raw_q.tensor_type, raw_q.data)
    assert not torch.equal(unpermuted.dequantized_weight(), dense.model.layers[0].self_attn.q_proj.weight)
    # no dense copy kept: the int4 model holds no float weight of the replaced linears
    assert all(not any(p.dim() == 2 for p in m.parameters()) for m in replaced.values())


@pytest.mark.integration
def test_forward_logits_against_the_dense_model(bundled_pair):
    """fp32: a forward of many rows dequantizes (the int4 kernel is slow in fp32 beyond 2 rows) and equals the dense
    model to the bit; one-row forwards run torch's int4 kernel: max |logit diff| within 1e-4 of the logit scale
    (measured ~1e-6 relative; another summation order)."""
    dense, int4, tokenizer = bundled_pair
    ids = tokenizer("The capital of France is Paris. The capital of Italy is", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(int4(ids).logits, dense(ids).logits)
        scale = 0.0
        for i in range(4):  # one token per forward (no cache): the int4 kernel's rows
            a, b = int4(ids[:, i : i + 1]).logits, dense(ids[:, i : i + 1]).logits
            scale = max(scale, float(b.abs().max()))
            diff = float((a - b).abs().max())
            assert 0 < diff <= 1e-4 * scale, (i, diff, scale)


@pytest.mark.integration
def test_engine_generates_reuses_and_fuses():
    """InferenceEngine.from_pretrained(None, weights="gguf_int4"): the runner fuses q/k/v and gate/up into int4
    packs whose rows the members adopt (codes held once), the fused packs serve the decode steps, greedy reuse
    gives the cold tokens, and the fingerprint differs from the dense model's."""
    from kvboost.engine import InferenceEngine
    from kvboost.models.fingerprint import ModelFingerprint
    from kvboost.runtime.projections import Int4Projections

    _bundled_path()
    engine = InferenceEngine.from_pretrained(None, weights="gguf_int4", dtype="float32")
    info = engine.decode_info()
    assert (info["runner"], info["decode"], info["prefill_weights"]) == ("llama", "eager", "int4")
    projections = engine.runner.projections
    assert len(projections) == 30 and all(isinstance(p, Int4Projections) for p in projections)
    for proj, layer in zip(projections, engine.model.model.layers, strict=True):
        assert proj.qkv_pack.splits == (576, 192, 192) and proj.gate_up_pack.splits == (1536, 1536)
        assert proj.o_pack is not None and proj.down_pack is not None
        q = layer.self_attn.q_proj
        assert (
            q.int4pack(torch.float32)[0].untyped_storage().data_ptr()
            == proj.qkv_pack.weight.untyped_storage().data_ptr()
        )
    used = []
    real = Int4Projections._mm

    def spy(x, pack):
        used.append(pack.splits)
        return real(x, pack)

    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    try:
        Int4Projections._mm = staticmethod(spy)
        cold = engine.generate(msgs, max_new_tokens=8, mode="cold")
    finally:
        Int4Projections._mm = staticmethod(real)
    assert (576, 192, 192) in used and (1536, 1536) in used  # the fused packs ran (decode steps: one row)
    assert "Paris" in cold.output_text
    first = engine.generate(msgs, max_new_tokens=8)
    again = engine.generate(msgs, max_new_tokens=8)
    assert first.output_ids == cold.output_ids == again.output_ids and again.kv_reuse_ratio > 0.5
    assert ModelFingerprint(engine.model, "bundled").describe()["weights_format"] == "gguf_int4"
    dense, _, identity, _ = load_for_engine(None, dtype="float32", device="cpu", options=LoadOptions())
    assert "weights_format" not in ModelFingerprint(dense, identity).describe()
    assert ModelFingerprint(dense, identity).current() != ModelFingerprint(engine.model, identity).current()
    engine.close()


@pytest.mark.integration
def test_int8_head_and_dense_prefill_apply():
    """lm_head="int8" quantizes the (dense) head and awq_prefill="dense" turns on dense prefill of the int4
    linears, as for AWQ models."""
    from kvboost.models.int8_head import Int8Linear

    _bundled_path()
    options = LoadOptions(weights="gguf_int4", lm_head="int8", awq_prefill="dense")
    model, _, _, _ = load_for_engine(None, dtype="bfloat16", device="cpu", options=options)
    assert isinstance(model.lm_head, Int8Linear)
    assert model._kvboost_awq_prefill == "dense"
    assert all(m.dense_min_rows is not None for m in model.modules() if isinstance(m, GGUFInt4Linear))
    assert weight_format_counts(model) == {"gguf_int4:Q4_1": 210, "int8": 1}


# ---------------------------------------------------------------------------------------------- refusals
def test_weights_on_a_model_not_from_gguf_is_refused_before_loading(monkeypatch, tmp_path):
    from kvboost.engine import InferenceEngine
    from kvboost.models import loading

    def no_load(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(loading, "load_model_and_tokenizer", no_load)
    folder = tmp_path / "tiny"
    tiny_model("llama").save_pretrained(folder)
    with pytest.raises(ValueError, match="not loaded from a GGUF file"):
        InferenceEngine.from_pretrained(str(folder), weights="gguf_int4", dtype="float32")
    with pytest.raises(ValueError, match="does not stream"):
        InferenceEngine.from_pretrained(None, weights="gguf_int4", streaming={"resident_layers": 1})


def test_unknown_weights_value_names_the_accepted_ones():
    from kvboost.engine import InferenceEngine

    with pytest.raises(ValueError, match=r"weights must be one of \['dense', 'gguf_int4'\], got 'int4'"):
        InferenceEngine.from_pretrained(None, weights="int4")
    assert LoadOptions(weights=None).weights == "dense" and LoadOptions().weights == "dense"


def test_config_check_knows_model_weights():
    from kvboost.build import engine_options
    from kvboost.lab.config_check import check_config

    base = {"model": {"name_or_path": None, "weights": "gguf_int4"}}
    check_config(base)
    assert engine_options(base)["weights"] == "gguf_int4"
    assert "weights" not in engine_options({"model": {"weights": "dense"}})
    refused = (
        ({"weights": "gguf_int5"}, "weights must be one of"),
        ({"weights": "gguf_int4", "random_init": {"num_hidden_layers": 2}}, "random_init"),
        ({"weights": "gguf_int4", "name_or_path": "Qwen/Qwen2.5-0.5B"}, "not a GGUF model"),
    )
    for model, message in refused:
        with pytest.raises(ValueError, match=message):
            check_config({"model": model})


def test_names_and_row_order():
    assert hf_linear_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj"
    assert hf_linear_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj"
    assert hf_linear_name("output.weight") == "lm_head"
    assert hf_linear_name("token_embd.weight") is None and hf_linear_name("blk.0.attn_norm.weight") is None
    # transformers' reverse permutation, on row indices
    rows, heads = 24, 3
    w = np.arange(rows)[:, None].repeat(2, axis=1)
    expected = w.reshape(heads, rows // heads // 2, 2, 2).swapaxes(2, 1).reshape(w.shape)
    assert np.array_equal(w[llama_row_order(rows, heads)], expected)


# ---------------------------------------------------------------------------------------------- written GGUF files
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_written_gguf_mixed_types_biases_and_untied_head(tmp_path, arch):
    """A tiny model written as GGUF (Q4_0 / Q4_1, v of layer 0 and down of layer 1 in Q8_0, an untied Q4_0 head;
    qwen2: q/k/v biases): the int4 linears are the dense weights bit for bit, biases kept, Q8_0 left dense; the
    engine runs the llama runner with fused packs where a group is all int4 and the modules where it is mixed,
    and its greedy tokens and first-token logits match the dense model's HF forward (fp32)."""
    from kvboost import KVBoost
    from kvboost.runtime.projections import Int4Projections

    dense = tiny_model(arch)
    with torch.no_grad():
        for m in dense.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.5)
    types = {"blk.0.attn_v.weight": T.Q8_0, "blk.1.ffn_down.weight": T.Q8_0, "output.weight": T.Q4_0,
             "blk.1.attn_q.weight": T.Q4_0}  # fmt: skip
    path = tmp_path / "tiny.gguf"
    write_gguf(dense, path, arch, types)
    model = copy.deepcopy(dense)
    formats = apply_gguf_int4(model, path)
    assert {k: len(v) for k, v in formats.items()} == {
        "gguf_int4:Q4_1": 11, "gguf_int4:Q4_0": 2, "dense:float32 (gguf Q8_0)": 2,
    }  # fmt: skip
    assert set(formats["dense:float32 (gguf Q8_0)"]) == {
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.mlp.down_proj",
    }
    for name, module in model.named_modules():
        if isinstance(module, GGUFInt4Linear):
            ref = dense.get_submodule(name)
            assert torch.equal(_bits(module.dequantized_weight()), _bits(ref.weight)), name
            if ref.bias is not None:
                assert module.bias is not None and torch.equal(module.bias, ref.bias), name
    assert (model.model.layers[0].self_attn.q_proj.bias is not None) == (arch == "qwen2")

    engine = KVBoost(model, ToyTokenizer(), model_identity=f"tiny-gguf-{arch}",
                     chunker={"name": "fixed", "chunk_size": 16})  # fmt: skip
    info = engine.decode_info()
    assert (info["runner"], info["decode"], info["prefill_weights"]) == ("llama", "eager", "int4")
    p0, p1 = engine.runner.projections
    assert isinstance(p0, Int4Projections) and isinstance(p1, Int4Projections)
    assert p0.qkv_pack is None and p0.down_pack is not None  # v is Q8_0: q/k/v run member by member
    assert p1.qkv_pack is not None and p1.down_pack is None  # down is Q8_0
    ids = random_ids(40, seed=3)
    cold = engine.generate(ids, 6, mode="cold")
    with torch.no_grad():
        ref_logits = dense(torch.tensor([ids])).logits[0, -1]
        tokens, seq = [], list(ids)
        for _ in range(6):
            nxt = int(dense(torch.tensor([seq])).logits[0, -1].argmax())
            tokens.append(nxt)
            seq.append(nxt)
    assert cold.output_ids == tokens
    # prefill of 40 rows in fp32: dequantize + F.linear (HF's product; the int4 head too)
    assert torch.allclose(cold.first_token_logits.float(), ref_logits, atol=1e-5, rtol=0)
    engine.warm(ids[:32])
    warm = engine.generate(ids, 6)
    assert warm.cached_tokens == 32 and warm.output_ids == cold.output_ids
    engine.close()


def test_a_wrong_row_order_fails_the_load(tmp_path):
    """The load's check: a llama file whose q/k rows were not permuted (as if written by another converter) is
    refused instead of running a scrambled attention."""
    dense = tiny_model("llama")
    path = tmp_path / "tiny.gguf"
    write_gguf(dense, path, "qwen2", {})  # stored unpermuted, architecture says qwen2 ...
    reader_arch = "llama"
    raw = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp_path / "as_llama.gguf"), reader_arch)  # ... rewritten as llama
    for t in raw.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(RuntimeError, match="row order"):
        apply_gguf_int4(copy.deepcopy(dense), tmp_path / "as_llama.gguf")
    apply_gguf_int4(copy.deepcopy(dense), path)  # the same tensors under their own architecture: accepted


# ---------------------------------------------------------------------------------------------- the second model
@pytest.mark.integration
def test_qwen_q4_k_m_linears_are_the_converted_weights():
    """Qwen2.5-Coder-0.5B Q4_K_M (when installed): 12 ffn_down tensors are Q4_K and run int4 (bit-equal to the
    converted fp32 folder's weights); the Q5_0 / Q6_K / Q8_0 linears stay dense; q/k/v biases kept."""
    from safetensors import safe_open

    from kvboost.models import catalog
    from kvboost.models.loading import resolve_model_path

    try:
        catalog.installed_path("qwen_coder_0_5b")
    except Exception as e:  # noqa: BLE001 - not installed
        pytest.skip(str(e))
    model, _, _, _ = load_for_engine("gguf:qwen_coder_0_5b", dtype="bfloat16", device="cpu",
                                     options=LoadOptions(weights="gguf_int4"))  # fmt: skip
    counts = weight_format_counts(model)
    assert counts["gguf_int4:Q4_K"] == 12 and counts["dense:bfloat16 (gguf Q5_0)"] == 132
    assert counts["dense:bfloat16 (gguf Q6_K)"] == 12 and counts["dense:bfloat16 (gguf Q8_0)"] == 13
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    folder = resolve_model_path("gguf:qwen_coder_0_5b")
    from pathlib import Path

    files = sorted(Path(folder).glob("*.safetensors"))
    for name, module in model.named_modules():
        if isinstance(module, GGUFInt4Linear):
            key = f"{name}.weight"
            for f in files:
                with safe_open(str(f), "pt") as handle:
                    if key in handle.keys():  # noqa: SIM118 - a safetensors handle, not a dict
                        ref = handle.get_tensor(key)
                        break
            assert torch.equal(_bits(module.dequantized_weight()), _bits(ref)), name


def test_a_gguf_file_is_parsed_once_per_version(tmp_path):
    """An engine's set-up asks for the same file's reader three times (which runner, the quantized step, its
    weights); each parse of the bundled file's metadata took ~2.8 s. The same file gives the same reader (also by
    another spelling of its path); a rewritten file is parsed again and shows its new contents."""
    path = tmp_path / "m.gguf"
    write_gguf(tiny_model("llama"), path, "llama")
    first = gguf_reader(path)
    assert gguf_reader(str(tmp_path / "." / "m.gguf")) is first
    before = {t.name for t in first.tensors}
    model = tiny_model("llama", num_hidden_layers=1)
    write_gguf(model, path, "llama")
    os.utime(path, ns=(time.time_ns(), time.time_ns() + 10**9))  # a new mtime even on a coarse clock
    again = gguf_reader(path)
    assert again is not first
    assert {t.name for t in again.tensors} < before  # one layer's tensors now
