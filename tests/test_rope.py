"""kvboost.rope: re-rotating cached keys to new positions, and refusing length-dependent RoPE."""

from __future__ import annotations

import pytest
import torch
from kvboost_testkit.tiny import VOCAB, random_ids, tiny_model
from transformers import AutoModelForCausalLM

from kvboost.models.compat import UnsupportedArchitectureError
from kvboost.runtime.hf_generic import output_cache
from kvboost.rope import (
    LengthDependentRopeError,
    RopeLayoutError,
    RopeRotator,
    check_rope_reusable,
)

ROPE_TYPES = {
    "default": {},
    "linear": {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    "llama3": {
        "rope_parameters": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128, "rope_theta": 500000.0,
        }
    },
    "yarn": {
        "rope_parameters": {
            "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0,
        }
    },
}  # fmt: skip

N = 24  # segment length


def _build(config) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()


def _common(**overrides):
    out = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    out.update(overrides)
    return out


@torch.no_grad()
def segment_kv(model, ids: list[int], start, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """The segment's stacked KV [layers, kv_heads, n, head_dim], computed alone at positions start.. (or given)."""
    pos = torch.as_tensor(start)[None] if not isinstance(start, int) else torch.arange(start, start + len(ids))[None]
    out = model(input_ids=torch.tensor([ids]), position_ids=pos, use_cache=True, **kwargs)
    layers = output_cache(out).layers
    return torch.stack([layer.keys[0] for layer in layers]), torch.stack([layer.values[0] for layer in layers])


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ---------------------------------------------------------------------------------------------- (a) round trip
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("rotary_dim", [16, 8])
def test_rotate_forward_then_back_is_identity(layout, rotary_dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    rotator = RopeRotator(inv_freq, 16, layout=layout)
    keys = torch.randn(3, 2, 37, 16)
    for delta in (1, 300, 123_457):
        there = rotator.rotate(keys, delta)
        assert _max_diff(there, keys) > 1e-2  # it did rotate
        assert _max_diff(rotator.rotate(there, -delta), keys) <= 1e-5
    per_token = torch.randint(-5000, 5000, (37,))
    assert _max_diff(rotator.rotate(rotator.rotate(keys, per_token), -per_token), keys) <= 1e-5
    if rotary_dim < 16:  # partial rotary: the pass-through channels are untouched
        assert torch.equal(rotator.rotate(keys, 300)[..., rotary_dim:], keys[..., rotary_dim:])


def test_rotation_preserves_norm_and_variants_agree():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    rotator = RopeRotator(inv_freq, 16)
    keys = torch.randn(4, 2, 19, 16)
    ref = rotator.rotate(keys, 777)
    assert torch.allclose(ref.norm(dim=-1), keys.norm(dim=-1), atol=1e-5)  # a pure rotation: no scaling
    assert torch.equal(rotator.rotate(keys, torch.full((19,), 777)), ref)  # one delta per token, all equal
    inplace = keys.clone()
    assert rotator.rotate_(inplace, 777) is inplace and torch.equal(inplace, ref)
    out = torch.empty_like(keys)
    assert rotator.rotate(keys, 777, out=out) is out and torch.equal(out, ref)
    assert torch.equal(rotator.rotate(keys, 0), keys)
    # half precision keys: rotated in float32 and rounded once
    bf16 = rotator.rotate(keys.bfloat16(), 777)
    assert bf16.dtype == torch.bfloat16 and _max_diff(bf16, ref) <= 3e-2
    half_inplace = keys.bfloat16()
    rotator.rotate_(half_inplace, 777)
    assert torch.equal(half_inplace, bf16)
    with pytest.raises(ValueError, match="per-token delta"):
        rotator.rotate(keys, torch.arange(5))
    with pytest.raises(ValueError, match="channels"):
        rotator.rotate(torch.randn(2, 3, 8), 1)


def test_large_delta_accuracy():
    """Angles are built in float64: a delta of 10^6 still composes with its inverse and with smaller steps."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    rotator = RopeRotator(inv_freq, 64)
    keys = torch.randn(2, 3, 11, 64, dtype=torch.float64)
    once = rotator.rotate(keys, 1_000_003)
    steps = rotator.rotate(rotator.rotate(keys, 1_000_000), 3)
    assert _max_diff(once, steps) <= 1e-9


# ---------------------------------------------------------------------------------------------- (b) vs the model
MODELS = [(arch, rope) for rope in ROPE_TYPES for arch in ("llama",)] + [("qwen2", "default"), ("mistral", "yarn")]


@pytest.mark.parametrize(("arch", "rope"), MODELS, ids=[f"{a}-{r}" for a, r in MODELS])
def test_rotated_segment_equals_segment_computed_at_new_position(arch, rope):
    model = tiny_model(arch, max_position_embeddings=1024, **ROPE_TYPES[rope])
    assert model.config.rope_parameters["rope_type"] == rope
    rotator = RopeRotator.from_model(model)
    ids = random_ids(N, seed=3)
    keys0, values0 = segment_kv(model, ids, 0)
    for p in (5, 300):
        keys_p, values_p = segment_kv(model, ids, p)
        assert _max_diff(keys0, keys_p) > 1e-2  # positions do change the keys
        moved = rotator.rotate(keys0, p)
        per_layer = (moved - keys_p).abs().amax(dim=(1, 2, 3))
        assert per_layer.shape[0] == model.config.num_hidden_layers
        assert float(per_layer.max()) <= 1e-4, f"{rope} p={p}: per-layer key error {per_layer.tolist()}"
        assert _max_diff(values0, values_p) <= 1e-4  # values carry no position


def test_per_token_delta_matches_model_at_scattered_positions():
    """At layer 0 the raw keys depend on the token alone, so any new positions (not contiguous) can be checked."""
    model = tiny_model("llama", max_position_embeddings=1024, **ROPE_TYPES["yarn"])
    rotator = RopeRotator.from_model(model)
    ids = random_ids(N, seed=4)
    keys0, _ = segment_kv(model, ids, 0)
    new_positions = torch.arange(N) * 7 + 40
    keys_new, _ = segment_kv(model, ids, new_positions)
    moved = rotator.rotate(keys0, new_positions - torch.arange(N))
    assert _max_diff(moved[0], keys_new[0]) <= 1e-4


# ---------------------------------------------------------------------------------------------- (c) no scaling twice
def _naive_rotate(model, keys: torch.Tensor, delta: int) -> torch.Tensor:
    """The tempting mistake: re-rotate with the model's own rotary_emb cos/sin (they carry attention_scaling)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    n = keys.shape[-2]
    cos, sin = model.model.rotary_emb(keys, torch.full((1, n), delta))
    _, rotated = apply_rotary_pos_emb(keys, keys, cos, sin)  # cos/sin [1, n, d] broadcast over [L, H, n, d]
    return rotated


def test_yarn_rotation_applies_no_attention_scaling():
    model = tiny_model("llama", max_position_embeddings=1024, **ROPE_TYPES["yarn"])
    assert model.model.rotary_emb.attention_scaling > 1.1  # YaRN factor 4: cos/sin are scaled by ~1.14
    rotator = RopeRotator.from_model(model)
    ids = random_ids(N, seed=5)
    keys0, _ = segment_kv(model, ids, 0)
    keys_p, _ = segment_kv(model, ids, 300)
    assert _max_diff(rotator.rotate(keys0, 300), keys_p) <= 1e-4
    naive = _naive_rotate(model, keys0, 300)
    assert _max_diff(naive, keys_p) > 1e-2  # scaled twice: wrong by ~14% of the key
    # the naive rotation is only wrong because of the scaling: undo it and it matches
    assert _max_diff(naive / model.model.rotary_emb.attention_scaling, keys_p) <= 1e-4
    # and with default RoPE (scaling 1.0) the naive one would have passed: the test above is what tells them apart
    plain = tiny_model("llama", max_position_embeddings=1024)
    k0, _ = segment_kv(plain, ids, 0)
    kp, _ = segment_kv(plain, ids, 300)
    assert _max_diff(_naive_rotate(plain, k0, 300), kp) <= 1e-4


def test_verify_rejects_a_scaled_rotation():
    """from_model's self-check catches a rotator that does not match the model (here: YaRN scaling applied)."""
    model = tiny_model("llama", max_position_embeddings=1024, **ROPE_TYPES["yarn"])
    rotator = RopeRotator.from_model(model)
    assert rotator.verify(model) <= 1e-5

    class Scaled(RopeRotator):
        def rotate(self, keys, delta, **kw):
            return super().rotate(keys, delta, **kw) * model.model.rotary_emb.attention_scaling

    with pytest.raises(RopeLayoutError, match=r"own key at layer \d \(relative error 1\.\d+e-01"):
        Scaled(rotator.inv_freq, rotator.head_dim).verify(model)


# ---------------------------------------------------------------------------------------------- other layouts
def test_other_families_partial_per_layer_nope_interleaved():
    from transformers import CohereConfig, Gemma3TextConfig, SmolLM3Config

    ids = random_ids(N, seed=6)
    cases = {
        "phi3-partial": (tiny_model("phi3", partial_rotary_factor=0.5), 8),
        "gemma3-per-layer-type": (
            _build(Gemma3TextConfig(
                **_common(head_dim=16), sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 2,
                rope_parameters={
                    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                },
            )),
            16,
        ),
        "smollm3-nope": (_build(SmolLM3Config(**_common(), no_rope_layer_interval=2)), 16),
        "cohere-interleaved": (_build(CohereConfig(**_common())), 16),
    }  # fmt: skip
    for name, (model, rotary_dim) in cases.items():
        rotator = RopeRotator.from_model(model)
        assert rotator.rotary_dim == rotary_dim, name
        keys0, _ = segment_kv(model, ids, 0)
        keys_p, _ = segment_kv(model, ids, 100)
        assert _max_diff(rotator.rotate(keys0, 100), keys_p) <= 1e-4, name
        if name.startswith("gemma3") or name.startswith("smollm3"):
            assert rotator.per_layer
            layer = 1
            assert _max_diff(rotator.rotate(keys0[layer], 100, layer=layer), keys_p[layer]) <= 1e-4
            with pytest.raises(ValueError, match="differ per layer"):
                rotator.rotate(keys0[layer], 100)
        if name.startswith("smollm3"):  # NoPE layers (every 2nd) carry no position: left as they are
            assert torch.equal(rotator.rotate(keys0, 100)[1], keys0[1])
            with pytest.raises(RopeLayoutError, match=r"own key at layer [13] "):  # ignoring NoPE is caught
                RopeRotator(rotator.inv_freq[0], rotator.head_dim).verify(model)
        if name.startswith("cohere"):  # the rotate_half layout is wrong for Cohere, and the self-check says so
            assert rotator.layout == "interleaved"
            with pytest.raises(RopeLayoutError, match="differs from the model's own key"):
                RopeRotator(rotator.inv_freq, rotator.head_dim, layout="half").verify(model)


# ---------------------------------------------------------------------------------------------- (d) refusals
def _longrope_phi3(original_max: int = 32):
    half = 8  # rotary_dim / 2 (head_dim 16)
    rope = {
        "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": original_max,
        "short_factor": [1.0 + 0.1 * i for i in range(half)], "long_factor": [2.0 + 0.5 * i for i in range(half)],
    }  # fmt: skip
    return tiny_model("phi3", rope_parameters=rope, original_max_position_embeddings=original_max)


def _dynamic_llama(max_positions: int = 32):
    return tiny_model(
        "llama", max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    )  # fmt: skip


@pytest.mark.parametrize(("build", "rope_type"), [(_longrope_phi3, "longrope"), (_dynamic_llama, "dynamic")])
def test_length_dependent_rope_is_refused(build, rope_type):
    model = build()
    assert model.model.rotary_emb.rope_type == rope_type
    checks = [(model.config, check_rope_reusable), (model, check_rope_reusable), (model, RopeRotator.from_model)]
    for target, check in checks:
        with pytest.raises(LengthDependentRopeError, match=rf"rope type '{rope_type}'") as info:
            check(target)
        assert isinstance(info.value, UnsupportedArchitectureError)
        assert "reuse is valid" in str(info.value)
    check_rope_reusable(tiny_model("phi3").config)  # the same family with default RoPE is accepted


def test_unknown_rope_type_is_refused():
    from types import SimpleNamespace

    config = SimpleNamespace(model_type="future", rope_parameters={"rope_type": "fancy", "rope_theta": 1e4})
    with pytest.raises(LengthDependentRopeError, match="'fancy'.*not know"):
        check_rope_reusable(config)
    nested = SimpleNamespace(
        model_type="future2",
        rope_parameters={"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "dynamic"}},
    )
    with pytest.raises(LengthDependentRopeError, match="'dynamic'"):
        check_rope_reusable(nested)
    check_rope_reusable(SimpleNamespace(model_type="old", rope_scaling={"type": "linear", "factor": 2.0}))


def test_longrope_prefix_kv_depends_on_forward_length():
    """Why longrope is refused even for exact prefix reuse: crossing original_max_position_embeddings (32) in a
    forward switches every position to the long factors, so the same prefix gets other K/V."""
    model = _longrope_phi3(original_max=32)
    ids = random_ids(48, seed=7)
    short_keys, short_values = segment_kv(model, ids[:16], 0)  # forward of 16 <= 32: short factors
    long_keys, long_values = segment_kv(model, ids, 0)  # forward of 48 > 32: long factors for ALL positions
    assert _max_diff(short_keys, long_keys[:, :, :16]) > 1e-2
    assert _max_diff(short_values, long_values[:, :, :16]) > 1e-3  # and hence attention, hence later values
    # control: a forward that stays below the threshold gives the prefix the same K/V (it is the threshold)
    mid_keys, _ = segment_kv(model, ids[:30], 0)
    assert _max_diff(short_keys, mid_keys[:, :, :16]) <= 1e-4


def test_dynamic_prefix_kv_depends_on_forward_length():
    model = _dynamic_llama(max_positions=32)
    ids = random_ids(48, seed=8)
    short_keys, _ = segment_kv(model, ids[:16], 0)
    model_long = _dynamic_llama(max_positions=32)  # a fresh model: dynamic caches its grown frequencies
    long_keys, _ = segment_kv(model_long, ids, 0)
    assert _max_diff(short_keys, long_keys[:, :, :16]) > 1e-2
