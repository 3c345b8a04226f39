"""Bad input gets a clear error and loses nothing (DESIGN.md invariant 8)."""

from __future__ import annotations

import pytest
from kvboost_testkit.tiny import ToyTokenizer, make_engine, random_ids, tiny_model

from kvboost import KVBoost, UnknownPluginError
from kvboost.models.compat import UnsupportedArchitectureError
from kvboost.prompts import PromptError


@pytest.fixture(scope="module")
def engine():
    e = make_engine("llama")
    e.generate(random_ids(40, seed=1), max_new_tokens=2)
    return e


@pytest.mark.parametrize("prompt", ["", "   \n", [], ()])
def test_empty_prompt(engine, prompt):
    before = engine.cache_stats()["entries"]
    with pytest.raises(PromptError, match="empty prompt"):
        engine.generate(prompt)
    assert engine.cache_stats()["entries"] == before


def test_prompt_over_the_context(engine):
    before = engine.cache_stats()["entries"]
    with pytest.raises(PromptError, match="does not fit the model's context of 512"):
        engine.generate(random_ids(600, seed=2))
    assert engine.cache_stats()["entries"] == before


def test_out_of_vocabulary_ids(engine):
    with pytest.raises(PromptError, match="out of the vocabulary"):
        engine.generate([1, 2, 100000])


def test_bad_generation_arguments(engine):
    with pytest.raises(ValueError, match="unknown mode 'turbo'"):
        engine.generate([5, 6, 7], mode="turbo")
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.generate([5, 6, 7], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([5, 6, 7], do_sample=True, temperature=0.0)
    with pytest.raises(PromptError, match="unsupported prompt type"):
        engine.generate(3.14)  # type: ignore[arg-type]


def test_unknown_plugin_lists_registered_names():
    with pytest.raises(UnknownPluginError, match="registered recompute plugins: .*full.*none"):
        make_engine("llama", recompute="nope")
    with pytest.raises(UnknownPluginError, match="registered chunker plugins: .*fixed"):
        make_engine("llama", chunker={"name": "sentence"})


@pytest.mark.parametrize(
    "config_name, why",
    [("GPT2Config", "absolute position"), ("BloomConfig", "ALiBi"), ("GPTNeoConfig", "absolute position"),
     ("MptConfig", "ALiBi"), ("FalconConfig", "ALiBi")],  # fmt: skip
)
def test_unsupported_architectures_are_refused_before_loading(tmp_path, config_name, why):
    import transformers

    config = getattr(transformers, config_name)()
    config.save_pretrained(tmp_path)  # a folder with a config and no weights: refused before weights are read
    with pytest.raises(UnsupportedArchitectureError, match=why):
        KVBoost.from_pretrained(str(tmp_path))


def test_unsupported_model_object_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(UnsupportedArchitectureError, match="RoPE"):
        KVBoost(model, ToyTokenizer())


def test_missing_model_folder_is_a_clear_error(tmp_path):
    missing = tmp_path / "does-not-exist"
    with pytest.raises((OSError, ValueError), match="does-not-exist"):
        KVBoost.from_pretrained(str(missing))


def test_supported_architectures_are_accepted(arch):
    engine = KVBoost(tiny_model(arch), ToyTokenizer())
    assert engine.model.config._attn_implementation == "kvboost_sdpa"
    r = engine.generate(random_ids(20, seed=3), max_new_tokens=2)
    assert r.generated_tokens == 2 and engine.attention.kernel_calls > 0


# ------------------------------------------------------------------ token ids (one validation everywhere)
@pytest.mark.parametrize("bad", [[5, -1, 7], [5, 10**6], [3.0, 4.0]])
def test_warm_validates_token_ids_like_generate(engine, bad):
    before = engine.cache_stats()["entries"]
    with pytest.raises(PromptError):
        engine.warm(bad)
    with pytest.raises(PromptError):
        engine.generate(bad)
    assert engine.cache_stats()["entries"] == before


@pytest.mark.parametrize("bad", [b"hello", bytearray(b"hi")])
def test_bytes_are_not_token_ids(engine, bad):
    with pytest.raises(PromptError, match="not a prompt"):
        engine.generate(bad)
    with pytest.raises(PromptError, match="not a prompt"):
        engine.warm(bad)


def test_numpy_and_tensor_token_ids_are_accepted(engine):
    import numpy as np
    import torch

    ids = random_ids(30, seed=8)
    a = engine.generate(np.array(ids, dtype=np.int64), max_new_tokens=3, mode="cold")
    b = engine.generate([np.int32(t) for t in ids], max_new_tokens=3, mode="cold")
    c = engine.generate(torch.tensor(ids), max_new_tokens=3, mode="cold")
    assert a.prompt_ids == b.prompt_ids == c.prompt_ids == ids
    assert engine.warm(np.array(ids[:20])).prompt_tokens == 20
    with pytest.raises(PromptError, match="integers"):
        engine.generate(np.array([1.5, 2.5]))


# ------------------------------------------------------------------ construction does not half-change a model
def test_a_failing_constructor_leaves_the_model_untouched():
    model = tiny_model("llama")
    before = model.config._attn_implementation
    for bad in ({"recompute": "nope"}, {"cache": {"name": "memory", "capacity": "lots"}},
                {"chunker": {"name": "fixed", "chunk_size": 0}}, {"attn": "cuda"}):  # fmt: skip
        with pytest.raises((ValueError, RuntimeError, KeyError)):
            KVBoost(model, ToyTokenizer(), **bad)
        assert model.config._attn_implementation == before, bad
        assert not hasattr(model, "_kvboost_engine")


def test_a_second_engine_on_an_installed_model_is_refused_until_closed():
    model = tiny_model("llama")
    first = KVBoost(model, ToyTokenizer())
    with pytest.raises(RuntimeError, match="already served by another KVBoost engine"):
        KVBoost(model, ToyTokenizer(), attn="eager")
    shared = KVBoost(model, ToyTokenizer(), share_model=True)
    assert shared.attention is first.attention
    with pytest.raises(RuntimeError, match="share_model=True: the model runs attention backend 'sdpa'"):
        KVBoost(model, ToyTokenizer(), attn="eager", share_model=True)
    first.close()
    assert model.config._attn_implementation != "kvboost_sdpa"
    with KVBoost(model, ToyTokenizer(), attn="eager") as third:
        assert model.config._attn_implementation == "kvboost_eager"
        third.generate(random_ids(10, seed=1), max_new_tokens=2)
    assert model.config._attn_implementation != "kvboost_eager"


# ------------------------------------------------------------------ memory
def test_max_new_tokens_is_clamped_to_the_context(engine):
    free = engine.pool.num_free
    r = engine.generate(random_ids(30, seed=9), max_new_tokens=10**6, mode="cold")
    assert r.generated_tokens <= 512 - 30
    assert engine.pool.num_free == free  # a cold request holds no block after it returns


def test_a_kv_buffer_that_cannot_fit_is_refused_before_allocating():
    engine = make_engine("llama", max_kv_bytes=100_000)  # 512 B/token: ~195 tokens
    before = engine.cache_stats()["entries"]
    with pytest.raises(PromptError, match=r"needs [\d.]+ MiB.*lower max_new_tokens"):
        engine.generate(random_ids(100, seed=10), max_new_tokens=200)
    assert engine.cache_stats()["entries"] == before
    assert engine.generate(random_ids(100, seed=10), max_new_tokens=50).generated_tokens > 0


def test_a_pool_too_small_for_a_request_is_refused_before_compute():
    """A request whose KV needs more blocks than the whole pool has is refused up front, naming the setting."""
    engine = make_engine("llama", kv={"pool_bytes": 20 * 512 * 16})  # 20 blocks of 16 tokens (512 B/token)
    with pytest.raises(PromptError, match="kv.pool_bytes"):
        engine.generate(random_ids(300, seed=12), max_new_tokens=400)
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.generate(random_ids(200, seed=12), max_new_tokens=4).generated_tokens > 0


def test_unknown_kv_options_are_refused_with_the_accepted_ones():
    with pytest.raises(ValueError, match=r"unknown kv option.*block_sise.*accepted.*block_size"):
        make_engine("llama", kv={"block_sise": 32})


def test_the_sampling_generator_lives_on_the_models_device(engine):
    assert engine.generator.device == engine.adapter.device


def test_a_recompute_strategy_that_cannot_fit_the_model_fails_at_construction():
    from kvboost import KVBoost

    model = tiny_model("llama")  # 2 layers: check layer 1 leaves nothing to save
    with pytest.raises(ValueError, match="check layer 1 leaves no later layer"):
        KVBoost(model, ToyTokenizer(), recompute="cacheblend")
    assert not hasattr(model, "_kvboost_engine") and model.config._attn_implementation == "sdpa"
