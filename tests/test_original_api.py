"""The original KVBoost API (kvboost.original_api, kvboost.compat, kvboost.batch, kvboost.kv_quantize,
kvboost.streaming.demo_speculative): keywords mapped onto plugin configs and checked before any weight loads,
GenerationMode semantics, and the helper modules, on tiny random models."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from kvboost_testkit.tiny import ToyTokenizer, make_engine, random_ids, tiny_model

import kvboost.models.options as loading_options
from kvboost import KVBoost
from kvboost.engine import GenerationMode, RecomputeStrategy
from kvboost.original_api import kv_bytes_per_token
from kvboost.paths import CONFIG_DIR

CONFIGS = CONFIG_DIR
SEP = "\n\n"
DOCS = [
    "Alpha document: the red fox lives in the northern forest and eats berries in the summer. " * 2,
    "Beta document: copper wires carry current; resistance grows with length and temperature. " * 2,
]


class LoadedTooEarly(AssertionError):
    pass


@pytest.fixture
def no_load(monkeypatch):
    """from_pretrained's loader raises if anything reaches it: a keyword error must come first."""

    def refuse(*args, **kwargs):
        raise LoadedTooEarly("the model was loaded before the keywords were checked")

    monkeypatch.setattr(loading_options, "load_for_engine", refuse)


@pytest.fixture
def tiny_load(monkeypatch):
    """from_pretrained's loader returns a tiny random 4-layer llama; records the name it was asked for."""
    asked: list = []

    def load(name, **kwargs):
        asked.append(name)
        return tiny_model("llama", num_hidden_layers=4), ToyTokenizer(), "tiny-llama", {}

    monkeypatch.setattr(loading_options, "load_for_engine", load)
    return asked


# ---------------------------------------------------------------------------------------------- keyword mapping
def test_original_keywords_map_onto_plugin_configs(tiny_load, tmp_path):
    engine = KVBoost.from_pretrained("some/model", recompute_strategy="cacheblend", chunk_size=32, kv_cache_bits=8,
                                     disk_cache_dir=str(tmp_path / "kv"), max_chunks=4, recompute_ratio=0.3,
                                     device="cpu")  # fmt: skip
    try:
        assert tiny_load == ["some/model"]
        assert engine.recompute.registry_name == "cacheblend" and engine.recompute.ratio == pytest.approx(0.3)
        assert engine.chunker.registry_name == "fixed" and engine.chunker.chunk_size == 32
        assert engine.quantizer.registry_name == "kivi8"
        tiers = engine.cache_stats()["tiers"]
        assert [t["tier"] for t in tiers] == ["memory", "disk"]
        assert Path(engine.store.tiers[1].location) == tmp_path / "kv"
        # max_chunks full chunks of the model's (unquantized) KV
        assert tiers[0]["capacity_bytes"] == 4 * 32 * kv_bytes_per_token(engine.model)
    finally:
        engine.close()


@pytest.mark.parametrize("bits, plugin", [(16, "none"), (8, "kivi8"), (4, "kivi4")])
def test_kv_cache_bits_selects_the_quantizer(tiny_load, bits, plugin):
    engine = KVBoost.from_pretrained(kv_cache_bits=bits)
    assert engine.quantizer.registry_name == plugin
    engine.close()


def test_recompute_overlap_is_selective_r_and_selective_is_the_original_default(tiny_load):
    engine = KVBoost.from_pretrained(recompute_overlap=8)
    assert engine.recompute.registry_name == "selective" and engine.recompute.r == 8
    engine.close()
    engine = KVBoost.from_pretrained(recompute_strategy=RecomputeStrategy.CACHEBLEND_SPARSE, recompute_ratio=0.5)
    assert engine.recompute.registry_name == "cacheblend" and engine.recompute.ratio == pytest.approx(0.5)
    engine.close()


def test_no_original_keyword_changes_nothing(tiny_load):
    engine = KVBoost.from_pretrained()
    assert engine.recompute.registry_name == "none" and engine.quantizer.registry_name == "none"
    assert engine.chunker.chunk_size == 64 and len(engine.store.tiers) == 1
    engine.close()


def test_model_name_keyword_is_the_first_argument(tiny_load):
    KVBoost.from_pretrained(model_name="org/name").close()
    assert tiny_load == ["org/name"]


def test_recompute_strategy_enum_covers_every_recompute_config():
    """Every recompute config is a value of the enum without being listed in it (issue 59: an in-tree strategy is
    one module plus one yaml); the listed members are the original's values."""
    plugins = {p.stem for p in (CONFIGS / "recompute").glob("*.yaml")}
    assert {RecomputeStrategy(name).plugin for name in plugins} == plugins
    assert {s.value for s in RecomputeStrategy} == {"selective", "cacheblend", "cacheblend_sparse", "none", "full"}
    assert RecomputeStrategy("cacheblend") is RecomputeStrategy.CACHEBLEND  # the original's values
    assert {"SELECTIVE", "CACHEBLEND", "NONE"} <= set(RecomputeStrategy.__members__)


def test_the_plugin_interface_keeps_its_name():
    from kvboost.recompute.base import RecomputeStrategy as Interface

    assert Interface is not RecomputeStrategy and inspect.isabstract(Interface)


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"recompute_strategy": "nope"}, "cacheblend"),
        ({"recompute_strategy": "cacheblend", "recompute_ratio": 1.5}, "recompute_ratio"),
        ({"recompute_ratio": 0}, "recompute_ratio"),
        ({"recompute_overlap": -1}, "recompute_overlap"),
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": 16.5}, "chunk_size"),
        ({"kv_cache_bits": 3}, "kv_cache_bits"),
        ({"kv_cache_bits": 8, "quant": "kivi4"}, "not both"),
        ({"max_chunks": 0}, "max_chunks"),
        ({"disk_cache_dir": 7}, "disk_cache_dir"),
        ({"disk_cache_dir": "/tmp/x", "cache": "memory"}, "not both"),
        ({"strict": False}, "strict"),
        ({"chunk_sise": 128}, "chunk_size"),  # a typo: the accepted keywords are listed
        ({"compile_model": True}, "decode='compiled'"),  # renamed: the new name is given
        ({"attn_implementation": "sdpa"}, "attn="),
    ],
)
def test_bad_keywords_fail_before_the_model_loads(no_load, kwargs, says):
    with pytest.raises((ValueError, TypeError)) as info:
        KVBoost.from_pretrained("any/model", **kwargs)
    assert not isinstance(info.value, LoadedTooEarly)
    assert says in str(info.value)


def test_an_unknown_keyword_lists_the_accepted_ones(no_load):
    with pytest.raises(TypeError) as info:
        KVBoost.from_pretrained(recompute_stratgy="cacheblend")
    for name in ("recompute_strategy", "kv_cache_bits", "disk_cache_dir", "recompute", "chunker", "quant"):
        assert name in str(info.value)


# ---------------------------------------------------------------------------------------------- GenerationMode
def _rag_engine() -> KVBoost:
    model = tiny_model("llama", max_position_embeddings=1024, num_hidden_layers=4)
    return KVBoost(model, ToyTokenizer(), model_identity="tiny-llama", chat=False,
                   chunker={"name": "separator", "separator": SEP, "chunk_size": 16})  # fmt: skip


def _rag_prompt() -> str:
    return SEP.join(["System: answer from the documents.", DOCS[1], DOCS[0], "Question: what do foxes eat?"])


def test_modes_baseline_prefix_cache_chunk_kv_reuse():
    engine = _rag_engine()
    for doc in DOCS:
        engine.warm(doc)
    prompt = _rag_prompt()
    entries = engine.cache_stats()["entries"]

    base = engine.generate(prompt, max_new_tokens=4, mode=GenerationMode.BASELINE)
    assert base.cached_tokens == 0 and base.mode == "cold"
    assert engine.cache_stats()["entries"] == entries  # the cold path writes nothing

    prefix = engine.generate(prompt, max_new_tokens=4, mode=GenerationMode.PREFIX_CACHE, store=False)
    assert prefix.content_hit_tokens == 0 and prefix.exact_hit_tokens == 0  # the documents are not at position 0

    reuse = engine.generate(prompt, max_new_tokens=4, mode=GenerationMode.CHUNK_KV_REUSE, store=False)
    assert reuse.content_hit_tokens > 0

    # exact hits are what PREFIX_CACHE serves: a prompt starting with a warmed document
    doc_first = engine.generate(SEP.join([DOCS[0], "Question?"]), max_new_tokens=2, mode=GenerationMode.PREFIX_CACHE)
    assert doc_first.exact_hit_tokens > 0 and doc_first.content_hit_tokens == 0
    engine.close()


def test_prefix_cache_stores_what_it_computed():
    engine = make_engine()
    ids = random_ids(70, seed=3)
    first = engine.generate(ids, max_new_tokens=2, mode=GenerationMode.PREFIX_CACHE)
    again = engine.generate(ids, max_new_tokens=2, mode=GenerationMode.PREFIX_CACHE)
    assert first.cached_tokens == 0 and again.exact_hit_tokens >= 64
    assert again.output_ids == first.output_ids
    engine.close()


def test_baseline_equals_the_cold_mode_and_reuse_is_the_default():
    engine = make_engine()
    ids = random_ids(40, seed=5)
    engine.generate(ids, max_new_tokens=2)
    cold = engine.generate(ids, max_new_tokens=3, mode="cold")
    base = engine.generate(ids, max_new_tokens=3, mode="baseline")  # the enum's value works too
    assert base.cached_tokens == 0 and base.output_ids == cold.output_ids
    assert torch.equal(base.first_token_logits, cold.first_token_logits)
    default = engine.generate(ids, max_new_tokens=3)
    explicit = engine.generate(ids, max_new_tokens=3, mode=GenerationMode.CHUNK_KV_REUSE)
    assert default.cached_tokens == explicit.cached_tokens > 0
    rows = engine.generate_batch([ids, ids[:20]], max_new_tokens=2, mode=GenerationMode.BASELINE)
    assert [r.cached_tokens for r in rows] == [0, 0]
    assert len(engine.generate_many([ids, ids], max_new_tokens=2, mode=GenerationMode.PREFIX_CACHE)) == 2
    with pytest.raises(ValueError, match="CHUNK_KV_REUSE"):
        engine.generate(ids, max_new_tokens=2, mode="warm")
    engine.close()


# ---------------------------------------------------------------------------------------------- kv_quantize
def _legacy_kv(batch=2, layers=3, heads=2, tokens=37, dim=16, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return tuple((torch.randn(batch, heads, tokens, dim, generator=g, dtype=dtype),
                  torch.randn(batch, heads, tokens, dim, generator=g, dtype=dtype)) for _ in range(layers))  # fmt: skip


@pytest.mark.parametrize("bits", [8, 4, 2])
def test_quantize_kv_round_trip_within_kivi_bound(bits):
    from kvboost.kv_quantize import dequantize_kv, quantize_kv

    kv = _legacy_kv()
    qkv = quantize_kv(kv, bits=bits)
    out = dequantize_kv(qkv)
    assert len(out) == len(kv)
    for b in range(2):
        keys = torch.stack([k[b] for k, _ in kv])
        values = torch.stack([v[b] for _, v in kv])
        kb, vb = qkv.quantizer.error_bound(keys, values)
        k_err = (torch.stack([k[b] for k, _ in out]).double() - keys.double()).abs()
        v_err = (torch.stack([v[b] for _, v in out]).double() - values.double()).abs()
        assert bool((k_err <= kb).all()) and bool((v_err <= vb).all())
        assert float(k_err.max()) > 0  # lossy: really quantized
    assert all(k.shape == kv[0][0].shape and k.dtype == torch.float32 for k, _ in out)
    raw = sum(k.numel() * k.element_size() * 2 for k, _ in kv)
    assert qkv.memory_bytes() < raw


def test_quantize_kv_16_bits_is_lossless_and_takes_hf_caches():
    from transformers import DynamicCache

    from kvboost.kv_quantize import dequantize_kv, quantize_kv

    kv = _legacy_kv(dtype=torch.bfloat16)
    out = dequantize_kv(quantize_kv(kv, bits=16))
    assert all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(kv, out))
    cache = DynamicCache()
    for layer, (k, v) in enumerate(kv):
        cache.update(k, v, layer)
    out8 = dequantize_kv(quantize_kv(cache, bits=8))
    assert out8[0][0].dtype == torch.bfloat16 and out8[2][1].shape == kv[2][1].shape
    with pytest.raises(ValueError, match="bits"):
        quantize_kv(kv, bits=3)


# ---------------------------------------------------------------------------------------------- batch helpers
def test_find_common_chunk_prefix():
    from kvboost.batch import find_common_chunk_prefix

    a = list(range(100))
    b = list(range(70)) + [999] * 30
    c = list(range(50))
    assert find_common_chunk_prefix([a, b], 16) == 64
    assert find_common_chunk_prefix([a, b, c], 16) == 48  # c ends inside the fourth chunk
    assert find_common_chunk_prefix([a, [5] + a[1:]], 16) == 0
    assert find_common_chunk_prefix([a, list(a)], 16) == 96
    assert find_common_chunk_prefix([a], 16) == 100 and find_common_chunk_prefix([], 16) == 0
    with pytest.raises(ValueError):
        find_common_chunk_prefix([a, b], 0)


def test_broadcast_kv_expands_without_copying():
    from kvboost.batch import broadcast_kv

    kv = _legacy_kv(batch=1)
    out = broadcast_kv(kv, 4)
    assert out[1][0].shape == (4, *kv[1][0].shape[1:])
    assert out[1][0].data_ptr() == kv[1][0].data_ptr() and out[1][0].stride(0) == 0
    assert torch.equal(out[2][1][3], kv[2][1][0])
    with pytest.raises(ValueError):
        broadcast_kv(_legacy_kv(batch=2), 4)


def test_group_by_prefix_groups_by_the_first_chunks():
    from kvboost.batch import group_by_prefix

    shared = list(range(40))
    ids = [shared + [1, 2], list(range(100, 140)), shared + [3], [], list(range(100, 140)) + [7]]
    groups = group_by_prefix(["p"] * 5, ids, chunk_size=8, n_prefix_chunks=4)  # first 32 tokens
    assert sorted(groups.values()) == [[0, 2], [1, 4], [3]]
    assert groups["empty"] == [3]


# ---------------------------------------------------------------------------------------------- compat
def test_check_model_compatibility():
    from transformers import GPT2Config

    from kvboost.compat import (
        SUPPORTED_ARCHITECTURES,
        SUPPORTED_MODEL_TYPES,
        UNSUPPORTED_ARCHITECTURES,
        UNSUPPORTED_MODEL_TYPES,
        UnsupportedArchitectureError,
        check_model_compatibility,
    )

    # as the original project documented them: class names, and a dict of reasons
    assert {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"} <= SUPPORTED_ARCHITECTURES
    assert "llama" not in SUPPORTED_ARCHITECTURES and "llama" in SUPPORTED_MODEL_TYPES
    assert UNSUPPORTED_ARCHITECTURES["GPT2LMHeadModel"].startswith("learned absolute positional embeddings")
    assert "ALiBi" in UNSUPPORTED_ARCHITECTURES["BloomForCausalLM"]
    assert UNSUPPORTED_MODEL_TYPES["gpt2"] == UNSUPPORTED_ARCHITECTURES["GPT2LMHeadModel"]
    assert len(SUPPORTED_ARCHITECTURES) == len(SUPPORTED_MODEL_TYPES)
    assert not SUPPORTED_ARCHITECTURES & set(UNSUPPORTED_ARCHITECTURES)
    for arch in ("llama", "qwen2", "mistral", "phi3", "gemma"):  # the tiny models' classes are the listed names
        model = tiny_model(arch)
        assert type(model).__name__ in SUPPORTED_ARCHITECTURES and model.config.model_type in SUPPORTED_MODEL_TYPES
    check_model_compatibility(tiny_model("llama"))
    with pytest.raises(UnsupportedArchitectureError, match="absolute position"):
        check_model_compatibility(GPT2Config())
    with pytest.warns(UserWarning, match="gpt2"):
        check_model_compatibility(GPT2Config(), strict=False)
    # a family known only by its class name in config.architectures is refused by that name
    with pytest.raises(UnsupportedArchitectureError, match="GPTNeoForCausalLM"):
        check_model_compatibility(type("Cfg", (), {"model_type": "custom", "architectures": ["GPTNeoForCausalLM"]})())


def test_compat_class_names_are_transformers_own():
    """Each listed class name is the class transformers maps the family's model_type to (where it ships it)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal_lm

    from kvboost.models.compat import REJECTED_FAMILIES, SUPPORTED_FAMILIES

    families = {**SUPPORTED_FAMILIES, **{t: cls for t, (cls, _) in REJECTED_FAMILIES.items()}}
    shipped = {t: cls for t, cls in families.items() if t in causal_lm}
    assert len(shipped) >= len(families) - 1  # internlm2 is remote code
    assert {t: causal_lm[t] for t in shipped} == shipped


# ---------------------------------------------------------------------------------------------- demo_speculative
def test_demo_speculative_runs_and_outputs_match(monkeypatch, capsys):
    from kvboost.streaming import demo_speculative

    monkeypatch.setattr(KVBoost, "from_pretrained", classmethod(lambda cls, *a, **k: make_engine(layers=4)))
    assert demo_speculative.main(["--max-new-tokens", "12", "--draft", "layer_skip"]) == 0
    out = capsys.readouterr().out
    assert "outputs match: True" in out and "tokens/s" in out


def test_chunk_size_joins_a_named_chunker_and_the_boundary_window():
    from kvboost.original_api import translate_options

    _, options, _ = translate_options(KVBoost, None, {"chunk_size": 32, "chunker": {"name": "separator"}})
    assert options["chunker"] == {"name": "separator", "chunk_size": 32}
    _, options, _ = translate_options(KVBoost, None, {"chunk_size": 32, "chunk_boundary_window": 8})
    assert options["chunker"] == {"name": "boundary_window", "window": 8, "chunk_size": 32}
    with pytest.raises(ValueError, match="window"):
        translate_options(KVBoost, None, {"chunk_size": 8, "chunk_boundary_window": 8})  # window < chunk_size
