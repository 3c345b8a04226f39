"""kvboost.models.fingerprint: every weight hashed, versions included, recomputed when weights change,
weights digest cached on disk beside the model folder while the weights are as loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kvboost_testkit.tiny import tiny_model
from transformers import AutoModelForCausalLM

import kvboost.models.fingerprint as fpmod
from kvboost.models.fingerprint import (
    DIGEST_FILE,
    ModelFingerprint,
    digest_tensors,
    library_versions,
    named_tensors,
    parameter_signature,
    record_load,
)

TESTS_DIR = Path(__file__).resolve().parent
REPO = TESTS_DIR.parent


@pytest.fixture
def count_digests(monkeypatch):
    """Counts calls of the weights hashing function."""
    calls = []

    def counting(tensors):
        calls.append(1)
        return digest_tensors(tensors)

    monkeypatch.setattr(fpmod, "digest_tensors", counting)
    return calls


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_CACHE_DIR", str(tmp_path / "kvboost-cache"))


def test_shape_and_determinism():
    a = ModelFingerprint(tiny_model("llama", seed=0), "tiny").current()
    b = ModelFingerprint(tiny_model("llama", seed=0), "tiny").current()
    assert len(a) == 32 and int(a, 16) >= 0
    assert a == b


def test_different_seeds_differ_and_identity_matters():
    a = ModelFingerprint(tiny_model("llama", seed=0), "tiny").current()
    b = ModelFingerprint(tiny_model("llama", seed=1), "tiny").current()
    assert a != b
    assert ModelFingerprint(tiny_model("llama", seed=0), "other-name").current() != a
    # the same weights under another architecture's config differ too
    assert ModelFingerprint(tiny_model("mistral", seed=0), "tiny").current() != a


def test_every_weight_counts():
    """Not a sample: the last element of a middle tensor changes the digest."""
    model = tiny_model("llama", seed=0)
    fp = ModelFingerprint(model, "tiny")
    before = fp.weights_digest()
    names = [name for name, _ in named_tensors(model)]
    assert "lm_head.weight" in names and "model.norm.weight" in names
    assert not any("inv_freq" in name for name in names)  # non-persistent buffers: derived from the config
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.view(-1)[-1] += 1e-3
    assert fp.weights_digest() != before


def test_same_seed_same_fingerprint_in_another_process():
    here = ModelFingerprint(tiny_model("llama", seed=0), "tiny").current()
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from kvboost_testkit.tiny import tiny_model; from kvboost.models.fingerprint import ModelFingerprint;"
        "print(ModelFingerprint(tiny_model('llama', seed=0), 'tiny').current())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # another hash seed: nothing may depend on it
    out = subprocess.run(
        [sys.executable, "-c", code, str(TESTS_DIR)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == here


def test_changes_are_seen(count_digests):
    model = tiny_model("llama", seed=0)
    fp = ModelFingerprint(model, "tiny")
    seen = {fp.current()}
    assert len(count_digests) == 1
    assert fp.current() in seen and len(count_digests) == 1  # unchanged: nothing rehashed

    with torch.no_grad():  # in-place edit of one element (bumps the tensor's version counter)
        model.model.layers[0].self_attn.k_proj.weight[3, 5] += 0.5
    seen.add(fp.current())
    assert len(seen) == 2 and len(count_digests) == 2

    # a new Parameter object with the very same values: rehashed (the signature changed), same fingerprint
    proj = model.model.layers[1].self_attn.v_proj
    proj.weight = torch.nn.Parameter(proj.weight.detach().clone())
    assert fp.current() in seen and len(count_digests) == 3

    # merging an adapter: a new Parameter with other values
    with torch.no_grad():
        lora_a, lora_b = torch.randn(4, proj.in_features), torch.randn(proj.out_features, 4)
        proj.weight = torch.nn.Parameter(proj.weight + 0.01 * lora_b @ lora_a)
    seen.add(fp.current())
    assert len(seen) == 3

    model.to(torch.bfloat16)
    seen.add(fp.current())
    assert len(seen) == 4

    model.to(torch.float32)  # back, but bf16 rounding stays: still another model than any before
    seen.add(fp.current())
    assert len(seen) == 5


def test_data_writes_need_invalidate():
    """Writes through ``param.data`` bypass autograd's version counter: documented, and invalidate() fixes it."""
    model = tiny_model("llama", seed=0)
    fp = ModelFingerprint(model, "tiny")
    before = fp.current()
    model.model.norm.weight.data.mul_(2.0)
    assert fp.current() == before  # the limitation, made visible
    fp.invalidate()
    assert fp.current() != before


def test_bf16_and_tied_weights():
    model = tiny_model("llama", seed=0, tie_word_embeddings=True).to(torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    fp = ModelFingerprint(model, "tiny")
    digest = fp.weights_digest()
    assert len(digest) == 32
    # the tied tensor is hashed once, named as an alias: hashing it twice would give another digest
    tensors = list(named_tensors(model))
    assert sum(t is model.lm_head.weight for _, t in tensors) == 2
    with torch.no_grad():
        model.lm_head.weight[0, 0] += 1.0
    assert fp.weights_digest() != digest


def test_host_slices_give_the_same_bytes():
    """The path GPU tensors take (copied to host through one small reused buffer), run here on CPU."""
    import xxhash

    data = torch.randn(1001, 7).to(torch.bfloat16).reshape(-1).view(torch.uint8)
    h = xxhash.xxh3_128()
    for chunk in fpmod._host_slices(data, slice_bytes=1000):
        assert len(chunk) <= 1000
        h.update(chunk)
    assert h.hexdigest() == xxhash.xxh3_128(data.numpy().tobytes()).hexdigest()


def test_versions_are_hashed(monkeypatch):
    model = tiny_model("llama", seed=0)
    described = ModelFingerprint(model, "tiny").describe()
    import transformers

    import kvboost

    assert described["versions"] == {
        "torch": torch.__version__, "transformers": transformers.__version__, "kvboost": kvboost.__version__,
    }  # fmt: skip
    assert "_name_or_path" not in described["config"] and "transformers_version" not in described["config"]
    assert described["dtype"] == "torch.float32" and described["identity"] == "tiny"
    base = ModelFingerprint(model, "tiny").current()
    for lib in ("torch", "transformers", "kvboost"):
        bumped = {**library_versions(), lib: "999.0"}
        monkeypatch.setattr(fpmod, "library_versions", lambda bumped=bumped: bumped)
        assert ModelFingerprint(model, "tiny").current() != base, lib
        monkeypatch.undo()


def test_config_and_quantization_are_hashed():
    model = tiny_model("llama", seed=0)
    base = ModelFingerprint(model, "tiny").current()
    model.config.quantization_config = {"quant_method": "awq", "bits": 4}
    assert ModelFingerprint(model, "tiny").current() != base
    del model.config.quantization_config
    model.config._name_or_path = "/somewhere/else"  # where it was loaded from is not what it is
    assert ModelFingerprint(model, "tiny").current() == base


# ---------------------------------------------------------------------------------------------- on-disk cache
def _save_tiny(folder: Path, with_tokenizer: bool = True) -> None:
    tiny_model("llama", seed=0).save_pretrained(folder)
    if with_tokenizer:
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "a": 3, "b": 4}
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")))
        tok.save_pretrained(folder)


def test_disk_cache_used_when_loaded_unchanged(tmp_path, count_digests):
    from kvboost.models.loading import load_model_and_tokenizer

    folder = tmp_path / "model"
    _save_tiny(folder)
    model, _, path = load_model_and_tokenizer(str(folder), device="cpu", dtype="float32")
    assert Path(model._kvboost_source_dir) == folder.resolve()
    assert model._kvboost_load_signature == parameter_signature(model)
    first = ModelFingerprint(model, path)
    fp1 = first.current()
    assert first.weights_source == "computed" and len(count_digests) == 1
    entries = json.loads((folder / DIGEST_FILE).read_text())
    assert [e["weights"] for e in entries.values()] == [first.weights_digest()]

    again, _, _ = load_model_and_tokenizer(str(folder), device="cpu", dtype="float32")
    second = ModelFingerprint(again, path)
    assert second.current() == fp1
    assert second.weights_source == "disk" and len(count_digests) == 1  # not rehashed

    # an in-place edit after loading: the cached digest is not used (and not overwritten)
    with torch.no_grad():
        again.model.layers[0].mlp.down_proj.weight[0, 0] += 1.0
    assert second.current() != fp1
    assert second.weights_source == "computed" and len(count_digests) == 2
    assert json.loads((folder / DIGEST_FILE).read_text()) == entries

    # another dtype is another entry; a touched weight file is a new key
    bf16, _, _ = load_model_and_tokenizer(str(folder), device="cpu", dtype="bfloat16")
    assert ModelFingerprint(bf16, path).current() != fp1 and len(count_digests) == 3
    assert len(json.loads((folder / DIGEST_FILE).read_text())) == 2
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    touched, _, _ = load_model_and_tokenizer(str(folder), device="cpu", dtype="float32")
    fp_touched = ModelFingerprint(touched, path)
    assert fp_touched.current() == fp1 and fp_touched.weights_source == "computed"


def test_disk_cache_needs_a_load_signature(tmp_path, count_digests):
    folder = tmp_path / "model"
    _save_tiny(folder, with_tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    # a source folder but no record of the weights as loaded: nothing is read or written
    fp = ModelFingerprint(model, "m", source_dir=folder)
    fp.current()
    assert not (folder / DIGEST_FILE).exists()
    record_load(model, folder)  # what load_model_and_tokenizer does
    other = tmp_path / "other"
    other.mkdir()
    ModelFingerprint(model, "m", source_dir=other).current()  # not the recorded folder: not used either
    assert not list(other.iterdir())
    fp = ModelFingerprint(model, "m")
    fp.current()
    assert (folder / DIGEST_FILE).exists()
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    record_load(reloaded, folder)
    fp2 = ModelFingerprint(reloaded, "m")
    assert fp2.current() == fp.current() and fp2.weights_source == "disk"
    assert len(count_digests) == 3
    assert ModelFingerprint(reloaded, "m", disk_cache=False).current() == fp.current()
    assert len(count_digests) == 4


def test_disk_cache_falls_back_to_the_kvboost_cache_dir(tmp_path, count_digests):
    folder = tmp_path / "model"
    _save_tiny(folder, with_tokenizer=False)
    (folder / DIGEST_FILE).mkdir()  # the folder's digest file cannot be written (works as root too)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    record_load(model, folder)
    fp = ModelFingerprint(model, "m")
    fp.current()
    fallback = list((tmp_path / "kvboost-cache" / "digests").glob("*.json"))
    assert len(fallback) == 1 and fp.weights_digest() in fallback[0].read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    record_load(reloaded, folder)
    again = ModelFingerprint(reloaded, "m")
    assert again.current() == fp.current() and again.weights_source == "disk" and len(count_digests) == 1


# ---------------------------------------------------------------------------------------------- cost
def test_current_is_cheap_when_nothing_changed(count_digests):
    """SmolLM2 has 30 layers (273 tensors); the check costs per tensor, not per byte: same layer count, tiny dims."""
    model = tiny_model("llama", num_hidden_layers=30)
    fp = ModelFingerprint(model, "tiny")
    fp.current()
    n = 200
    start = time.perf_counter()
    for _ in range(n):
        fp.current()
    per_call_ms = (time.perf_counter() - start) / n * 1e3
    tensors = len(parameter_signature(model))
    print(f"\nModelFingerprint.current() unchanged: {per_call_ms:.3f} ms for {tensors} tensors")
    assert len(count_digests) == 1
    assert per_call_ms < 20  # a sanity bound only (shared machine); measured ~0.25 ms
