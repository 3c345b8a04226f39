"""Attention backends: every backend reproduces transformers' SDPA logits on tiny random models.

Covers prefill, a DynamicCache prefix + new tokens, a decode step, left-padded batches (prefill and decode),
a StaticCache, the mask -> kernel-contract translation, the SDPA fallback for inexpressible masks, and the
clear errors (cuda on CPU, unknown names, dropout).
"""

import os

import torch

from kvboost.paths import CONFIG_DIR

# Triton reads TRITON_INTERPRET when a kernel is decorated (kvboost.kernels_triton.flash_attn import); without a GPU
# it must be set before that, so before anything below can import the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import copy  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import yaml  # noqa: E402
from kvboost_testkit.tiny import make_engine, random_ids  # noqa: E402  (tests/ is on pytest's pythonpath)
from transformers import (  # noqa: E402
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    StaticCache,
)

from kvboost.attention.masks import mask_to_kernel_params  # noqa: E402
from kvboost.registry import ATTENTION, UnknownPluginError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-4
NUM_LAYERS = 2
BACKENDS = ["sdpa", "eager", "triton", "cpu_kernel", "cpu_kernel_t4", "sdpa_key_tile", "batch_invariant", "batch_invariant_t4"]
#: Backend variants built from a config rather than a bare name; key_tile 8 pads the 13-, 19- and 11-key
#: calls below (6 -> 8 rows padded at most), so every mask kind goes through the padding.
SPECS = {
    "sdpa_key_tile": {"name": "sdpa", "key_tile": 8},
    # tile 4: the 19-, 6- and 11-token calls below span several work units with a ragged last one.
    "cpu_kernel_t4": {"name": "cpu_kernel", "tile": 4},
    # tile 4 / key_block 8: the 13- and 19-token calls below span several tiles and key blocks with ragged ends.
    "batch_invariant_t4": {"name": "batch_invariant", "tile": 4, "key_block": 8},
}

_COMMON = dict(
    num_hidden_layers=NUM_LAYERS,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

ARCHS = {
    "llama": (LlamaForCausalLM, lambda **kw: LlamaConfig(**_COMMON, head_dim=16, **kw)),
    "qwen2": (Qwen2ForCausalLM, lambda **kw: Qwen2Config(**_COMMON, **kw)),  # head_dim 16, qkv bias
    "mistral": (MistralForCausalLM, lambda **kw: MistralConfig(**_COMMON, head_dim=32, **kw)),
}


def make_pair(arch: str, **config_overrides):
    """A tiny random fp32 model on plain SDPA (the reference) and an identical copy with its own config."""
    model_cls, make_config = ARCHS[arch]
    config = make_config(**config_overrides)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    reference = model_cls(copy.deepcopy(config)).eval()
    # Separate config objects: set_attn_implementation mutates the config, which must not reach the reference.
    candidate = model_cls(copy.deepcopy(config)).eval()
    candidate.load_state_dict(reference.state_dict())
    return reference, candidate


def install(name: str, model):
    backend = ATTENTION.build(SPECS.get(name, name))
    backend.install(model)
    assert model.config._attn_implementation == f"kvboost_{backend.name}"
    return backend


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture(params=list(ARCHS))
def arch(request):
    return request.param


@pytest.mark.parametrize("name", BACKENDS)
@torch.no_grad()
def test_prefill_matches_sdpa(arch, name):
    reference, model = make_pair(arch)
    backend = install(name, model)
    ids = torch.randint(0, 128, (1, 19), generator=torch.Generator().manual_seed(1))
    expected = reference(ids).logits
    got = model(ids).logits
    assert max_diff(got, expected) < ATOL
    assert backend.kernel_calls == NUM_LAYERS
    assert backend.stats()["backend"] == SPECS.get(name, {}).get("name", name)
    if hasattr(backend, "fallback_calls"):  # the kernel backends served every call themselves
        assert backend.fallback_calls == 0


@pytest.mark.parametrize("name", BACKENDS)
@torch.no_grad()
def test_cached_prefix_then_decode(arch, name):
    """Prefix (13) in a DynamicCache, then 6 new tokens against it, then a 1-token decode step."""
    reference, model = make_pair(arch)
    backend = install(name, model)
    ids = torch.randint(0, 128, (1, 20), generator=torch.Generator().manual_seed(2))
    ref_cache, cache = DynamicCache(config=reference.config), DynamicCache(config=model.config)
    for step, (lo, hi) in enumerate([(0, 13), (13, 19), (19, 20)], start=1):
        expected = reference(ids[:, lo:hi], past_key_values=ref_cache, use_cache=True).logits
        got = model(ids[:, lo:hi], past_key_values=cache, use_cache=True).logits
        assert max_diff(got, expected) < ATOL, (step, lo, hi)
        assert backend.kernel_calls == NUM_LAYERS * step
    assert cache.get_seq_length() == 20


@pytest.mark.parametrize("name", BACKENDS)
@torch.no_grad()
def test_left_padded_batch_and_decode(arch, name):
    """Two prompts (11 and 7 tokens) left-padded into one batch, then a decode step for both rows."""
    reference, model = make_pair(arch)
    backend = install(name, model)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 128, (2, 11), generator=gen)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :4] = 0
    ref_cache, cache = DynamicCache(config=reference.config), DynamicCache(config=model.config)
    expected = reference(ids, attention_mask=mask, past_key_values=ref_cache).logits
    got = model(ids, attention_mask=mask, past_key_values=cache).logits
    valid = mask.bool()
    assert max_diff(got[valid], expected[valid]) < ATOL
    if name != "eager":  # eager spreads fully masked (pad) query rows uniformly; SDPA and the kernels give 0
        assert max_diff(got, expected) < ATOL

    nxt = torch.randint(0, 128, (2, 1), generator=gen)
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    expected = reference(nxt, attention_mask=mask2, past_key_values=ref_cache).logits
    got = model(nxt, attention_mask=mask2, past_key_values=cache).logits
    assert max_diff(got, expected) < ATOL
    assert backend.kernel_calls == 2 * NUM_LAYERS

    # Row 1 (padded) decodes to the logits its unpadded prompt gives alone (invariant 9).
    solo_cache = DynamicCache(config=reference.config)
    reference(ids[1:, 4:], past_key_values=solo_cache)
    solo_next = reference(nxt[1:], past_key_values=solo_cache).logits
    assert max_diff(got[1:], solo_next) < ATOL


@torch.no_grad()
def test_triton_static_cache():
    """StaticCache: an unmasked prefill (upper-left SDPA alignment), a padded one (explicit positions), decode."""
    reference, model = make_pair("llama")
    backend = install("triton", model)
    gen = torch.Generator().manual_seed(4)
    for pad in (0, 2):
        ids = torch.randint(0, 128, (2, 6), generator=gen)
        mask = torch.ones(2, 6, dtype=torch.long)
        mask[0, :pad] = 0
        caches = [StaticCache(config=m.config, max_cache_len=16) for m in (reference, model)]
        kwargs = {} if pad == 0 else {"attention_mask": mask}
        expected = reference(ids, past_key_values=caches[0], **kwargs).logits
        got = model(ids, past_key_values=caches[1], **kwargs).logits
        valid = mask.bool()
        assert max_diff(got[valid], expected[valid]) < ATOL
        nxt = torch.randint(0, 128, (2, 1), generator=gen)
        mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
        pos = torch.full((1,), 6)
        expected = reference(nxt, attention_mask=mask2, past_key_values=caches[0], cache_position=pos).logits
        got = model(nxt, attention_mask=mask2, past_key_values=caches[1], cache_position=pos).logits
        assert max_diff(got, expected) < ATOL
    assert backend.fallback_calls == 0
    assert backend.kernel_calls == 4 * NUM_LAYERS


@torch.no_grad()
def test_triton_falls_back_for_sliding_window():
    """A sliding window shorter than the prompt is not expressible: SDPA runs it, counted and still exact."""
    reference, model = make_pair("mistral", sliding_window=4)
    backend = install("triton", model)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    assert max_diff(model(ids).logits, reference(ids).logits) < ATOL
    assert backend.fallback_calls == NUM_LAYERS
    assert backend.kernel_calls == 0
    backend.reset_stats()
    assert backend.stats()["fallback_calls"] == 0 and backend.stats()["kernel_calls"] == 0


def _contract_mask(params, batch, q_len, k_len):
    from kvboost.kernels_triton.flash_attn_reference import attention_mask

    k_eff = params.key_len if params.key_len is not None else k_len
    inner = attention_mask(
        batch,
        q_len,
        k_eff,
        causal=params.causal,
        q_positions=params.q_positions,
        kv_start=params.kv_start,
        kv_len=params.kv_len,
    )
    full = torch.zeros(batch, q_len, k_len, dtype=torch.bool)
    full[..., :k_eff] = inner
    return full


def test_mask_translation_reproduces_masks():
    """Random expressible masks translate into parameters whose contract mask is the same mask."""
    gen = torch.Generator().manual_seed(6)
    for trial in range(200):
        batch = int(torch.randint(1, 4, (1,), generator=gen))
        q_len = int(torch.randint(1, 9, (1,), generator=gen))
        k_len = q_len + int(torch.randint(0, 9, (1,), generator=gen))
        kv_start = torch.randint(0, k_len + 1, (batch,), generator=gen)
        kv_len = torch.maximum(kv_start, torch.randint(0, k_len + 1, (batch,), generator=gen))
        kind = trial % 3
        if kind == 0:  # contract default positions (cache prefix + new tokens, left padding)
            q_pos = (k_len - q_len + torch.arange(q_len)).expand(batch, q_len)
        elif kind == 1:  # arbitrary positions (StaticCache slots, CacheBlend selections)
            q_pos = torch.randint(-1, k_len + 1, (batch, q_len), generator=gen)
        else:  # bidirectional
            q_pos = torch.full((batch, q_len), k_len)
        j = torch.arange(k_len)
        allowed = (j >= kv_start[:, None, None]) & (j < kv_len[:, None, None]) & (j <= q_pos[:, :, None])
        for mask in (allowed[:, None], torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[:, None]):
            params = mask_to_kernel_params(mask, batch=batch, q_len=q_len, k_len=k_len)
            assert params is not None, trial
            assert torch.equal(_contract_mask(params, batch, q_len, k_len), allowed), trial
            if kind == 0:
                assert params.q_positions is None  # the simplest form is found
            no_qpos = mask_to_kernel_params(mask, batch=batch, q_len=q_len, k_len=k_len, allow_q_positions=False)
            if no_qpos is not None:
                assert no_qpos.q_positions is None
                assert torch.equal(_contract_mask(no_qpos, batch, q_len, k_len), allowed), trial


def test_mask_translation_rejects_inexpressible_masks():
    j = torch.arange(8)
    i = torch.arange(8)[:, None]
    sliding = ((j <= i) & (j > i - 3))[None, None]
    assert mask_to_kernel_params(sliding, batch=1, q_len=8, k_len=8) is None
    holes = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    holes[..., 3] = False
    assert mask_to_kernel_params(holes, batch=1, q_len=8, k_len=8) is None
    per_head = torch.ones(1, 2, 8, 8, dtype=torch.bool)
    per_head[:, 1] = j <= i
    assert mask_to_kernel_params(per_head, batch=1, q_len=8, k_len=8) is None
    bias = torch.zeros(1, 1, 8, 8)
    bias[..., 0] = -1.0  # an additive bias, not a mask
    assert mask_to_kernel_params(bias, batch=1, q_len=8, k_len=8) is None
    # None masks follow transformers' SDPA semantics
    assert mask_to_kernel_params(None, batch=1, q_len=4, k_len=9).key_len == 4
    assert mask_to_kernel_params(None, batch=1, q_len=1, k_len=9).key_len is None
    assert mask_to_kernel_params(None, batch=1, q_len=4, k_len=9, is_causal=False).causal is False


def test_triton_rejects_dropout():
    backend = ATTENTION.build("triton")
    module = torch.nn.Module()
    module.is_causal = True
    q = torch.randn(1, 4, 3, 16)
    kv = torch.randn(1, 2, 3, 16)
    with pytest.raises(RuntimeError, match="dropout"):
        backend.attention_forward(module, q, kv, kv, None, dropout=0.1)


_INTERPRETER_SCRIPT = """
import os, sys
sys.path.insert(0, {root!r})
os.environ.pop("TRITON_INTERPRET", None)
if {first!r} == "triton":  # what transformers may do before kvboost is imported
    import triton.language
if {first!r} in ("kernels", "triton"):
    import kvboost.kernels_triton.flash_attn
from kvboost.registry import ATTENTION
backend = ATTENTION.build("triton")
try:
    backend.check_available()
except RuntimeError as exc:
    print("ERROR", exc)
else:
    print("OK", os.environ["TRITON_INTERPRET"], backend.stats()["interpreter"])
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter set-up is the CPU-only path")
@pytest.mark.parametrize("first", ["nothing", "kernels", "triton"])
def test_triton_interpreter_setup_on_cpu(first):
    """No GPU: the backend turns the interpreter on itself, or explains why it cannot (triton's kernels compiled
    for a GPU: triton imported before kvboost, then the kernels). Importing the kernels first is no longer that
    trap: they live in kvboost, whose __init__ switches the interpreter on before anything imports triton."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = _INTERPRETER_SCRIPT.format(root=str(ROOT), first=first)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if first == "triton":
        assert proc.stdout.startswith("ERROR") and "TRITON_INTERPRET=1" in proc.stdout, proc.stdout
    else:
        assert proc.stdout.strip() == "OK 1 True", proc.stdout + proc.stderr
        assert "not speed" in proc.stderr  # the one-line warning


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_backend_raises_clear_error_on_cpu():
    _, model = make_pair("llama")
    backend = ATTENTION.build("cuda")
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU"):
        backend.check_available()
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU"):
        backend.install(model)
    assert model.config._attn_implementation == "sdpa"  # untouched


@pytest.mark.parametrize("bad", [-1, 2.5, "8", True])
def test_sdpa_key_tile_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="key_tile"):
        ATTENTION.build({"name": "sdpa", "key_tile": bad})


def test_pad_keys_hides_the_padding():
    """Padded keys carry masked zero rows: the output equals the unpadded call's for every mask kind."""
    import torch.nn.functional as F

    from kvboost.attention.sdpa import pad_keys

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen) for n in (5, 13, 13))
    causal = torch.arange(13)[None, :] <= torch.arange(8, 13)[:, None]
    additive = torch.zeros(5, 13).masked_fill(~causal, torch.finfo(torch.float32).min)
    for mask in (None, causal[None, None], additive[None, None]):
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal[None, None])
        pk, pv, pmask = pad_keys(q, k, v, mask, 8)
        assert pk.shape[2] == pv.shape[2] == pmask.shape[-1] == 16
        got = F.scaled_dot_product_attention(q, pk, pv, attn_mask=pmask)
        assert max_diff(got, expected) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_selected_query_groups_built_once_give_the_same_bits(dtype):
    """Layer-wise selections: groups (and their additive masks) built once by the backend give exactly what the
    per-call bool masks gave, and both equal one dense causal-by-position mask; a plan for another query count
    is refused."""
    import torch.nn.functional as F

    from kvboost.attention.sdpa import QueryGroups, selected_query_attention

    gen = torch.Generator().manual_seed(7)
    positions = torch.tensor(sorted(torch.randperm(300, generator=gen)[:97].tolist()))
    keys = int(positions[-1]) + 1
    q = torch.randn(1, 6, positions.numel(), 16, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, keys, 16, generator=gen).to(dtype) for _ in range(2))
    plan = ATTENTION.build("sdpa").selected_query_inputs(positions, keys, dtype)[1]["kvboost_q_positions"]
    assert isinstance(plan, QueryGroups) and len(plan.groups) == 3  # 97 queries // 32 per group
    once = selected_query_attention(q, k, v, plan, 0.25)
    assert torch.equal(once, selected_query_attention(q, k, v, positions, 0.25))
    per_call = []  # the bool masks each call built before the plan existed
    for a, b, k_end, _ in plan.groups:
        allowed = torch.arange(k_end)[None, :] <= positions[a:b, None]
        part = F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, :k_end], v[:, :, :k_end], attn_mask=allowed,
                                              scale=0.25, enable_gqa=True)  # fmt: skip
        per_call.append(part.transpose(1, 2))
    assert torch.equal(once, torch.cat(per_call, dim=1))
    dense = torch.arange(keys)[None, :] <= positions[:, None]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=0.25, enable_gqa=True)
    assert max_diff(once.transpose(1, 2), expected) < (1e-5 if dtype == torch.float32 else 2e-2)
    with pytest.raises(ValueError, match="query groups cover 97"):
        selected_query_attention(q[:, :, :50], k, v, plan, 0.25)


def test_unknown_backend_lists_registered_names():
    with pytest.raises(UnknownPluginError) as info:
        ATTENTION.build("nope")
    message = str(info.value)
    for name in ("sdpa", "eager", "triton", "cuda"):
        assert name in message


def test_configs_build_their_backends():
    paths = sorted((CONFIG_DIR / "attn").glob("*.yaml"))
    assert {p.stem for p in paths} >= {"sdpa", "eager", "triton", "cuda"}
    for path in paths:
        cfg = yaml.safe_load(path.read_text())
        assert cfg["name"] == path.stem and cfg.get("description")
        backend = ATTENTION.build(cfg)
        assert backend.name == path.stem
        assert backend.stats() == {**backend.stats(), "backend": path.stem, "kernel_calls": 0}


@torch.no_grad()
def test_uninstall_restores_previous_implementation():
    reference, model = make_pair("llama")
    backend = install("sdpa", model)
    backend.uninstall(model)
    assert model.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 128, (1, 5))
    model(ids)
    assert backend.kernel_calls == 0


@pytest.mark.parametrize("backend", ["triton", "eager"])
def test_engine_reuse_path_under_inference_mode(backend):
    """The engine runs under torch.inference_mode with a cached prefix (masks are inference tensors)."""
    engine = make_engine("llama", attn=backend)
    prompt = random_ids(40, seed=1)
    cold = engine.generate(prompt + [7, 8, 9], max_new_tokens=5, mode="cold")
    engine.generate(prompt, max_new_tokens=2)
    warm = engine.generate(prompt + [7, 8, 9], max_new_tokens=5)
    assert warm.cached_tokens == 40
    assert warm.output_ids == cold.output_ids
    assert (warm.first_token_logits - cold.first_token_logits).abs().max() <= 1e-4
    stats = engine.attention.stats()
    assert stats["kernel_calls"] > 0 and stats.get("fallback_calls", 0) == 0
