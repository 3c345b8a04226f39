"""experiments/bench/random_weights.py: a model folder with another's architecture and small files, random weights."""

from __future__ import annotations

import pytest
import torch
from kvboost_testkit.tiny import tiny_model

from experiments.bench.random_weights import copy_description, main, write_random_model


def test_random_copy_has_the_architecture_and_files_but_not_the_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    like = tmp_path / "like"
    original = tiny_model("qwen2")
    original.save_pretrained(like)
    (like / "chat_template.jinja").write_text("{{ messages }}")
    out = write_random_model(like, tmp_path / "random", dtype="float32", seed=3)
    assert (out / "chat_template.jinja").read_text() == "{{ messages }}"
    copy = AutoModelForCausalLM.from_pretrained(out)
    assert copy.config.to_dict()["num_hidden_layers"] == original.config.num_hidden_layers
    params = dict(original.named_parameters())
    for name, p in copy.named_parameters():
        assert p.shape == params[name].shape
    weight = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(dict(copy.named_parameters())[weight], params[weight])
    again = AutoModelForCausalLM.from_pretrained(write_random_model(like, tmp_path / "again", dtype="float32", seed=3))
    assert torch.equal(dict(again.named_parameters())[weight], dict(copy.named_parameters())[weight])  # seeded


def test_config_only_copies_the_small_files(tmp_path, capsys):
    like = tmp_path / "like"
    tiny_model("llama").save_pretrained(like)
    assert main(["--config-only", "--like", str(like), "--out", str(tmp_path / "desc")]) == 0
    assert sorted(p.name for p in (tmp_path / "desc").iterdir()) == ["config.json", "generation_config.json"]
    assert "copied config.json" in capsys.readouterr().out


def test_a_folder_without_config_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        copy_description(tmp_path, tmp_path / "out")
