"""Bad input gets a clear error and loses nothing (DESIGN.md invariant 8)."""

from __future__ import annotations

import pytest
from tiny import ToyTokenizer, make_engine, random_ids, tiny_model

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
    with pytest.raises(ValueError, match="mode"):
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
    with pytest.raises((OSError, ValueError)):
        KVBoost.from_pretrained(str(tmp_path / "does-not-exist"))


def test_supported_architectures_are_accepted(arch):
    KVBoost(tiny_model(arch), ToyTokenizer())
