"""The kernel backends (``cuda``, ``triton``) inside a whole tiny model on a GPU, against ``attn=sdpa``.

Runs only where CUDA is available (skipped otherwise): a tiny random Llama (GQA 4:1, head dim 64, the dtypes the
CUDA extension supports) in bf16 and fp16, installed with the backend, against the same weights on transformers'
SDPA in the same dtype:

* a plain prefill;
* a cached prefix, then a suffix over it, then decode steps (DynamicCache): the reuse path of the engine; the
  prefix is long enough (>= 2048 keys, a handful of programs) that both kernels take their split-KV path for
  the suffix, and the decode steps take the split path by construction;
* a left-padded batch (``kv_start`` per row), prefill and one decode step.

bf16/fp16 attention differs between implementations by rounding (P is rounded to the input dtype before P V,
accumulation order differs), so logits are compared relative to their scale, and the kernel's error against an
fp32 SDPA run of the same weights must stay comparable to SDPA's own low-precision error.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.skip("needs a CUDA GPU: runs the kernel backends inside a whole model", allow_module_level=True)

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvboost.registry import ATTENTION

NUM_LAYERS = 2
PREFIX, SUFFIX, DECODE = 2200, 40, 3
# Relative to max |logit| of the SDPA run in the same dtype.
REL_TOL = {torch.bfloat16: 5e-2, torch.float16: 2e-2}


def _backend_or_skip(name: str):
    backend = ATTENTION.build(name)
    if name == "cuda":
        from kvboost.attention import cuda_ext

        if not cuda_ext.cuda_extension_available():
            pytest.skip("the cuda backend needs a GPU of compute capability >= 8.0")
    return backend


def make_models(dtype: torch.dtype):
    """(fp32 SDPA truth, SDPA in ``dtype``, candidate in ``dtype``): identical random weights, separate configs."""
    config = LlamaConfig(
        num_hidden_layers=NUM_LAYERS,
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=256,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    truth = LlamaForCausalLM(copy.deepcopy(config)).eval().to("cuda")
    reference = LlamaForCausalLM(copy.deepcopy(config)).eval()
    reference.load_state_dict(truth.state_dict())
    candidate = LlamaForCausalLM(copy.deepcopy(config)).eval()
    candidate.load_state_dict(truth.state_dict())
    return truth, reference.to("cuda", dtype), candidate.to("cuda", dtype)


def assert_close(got: torch.Tensor, expected: torch.Tensor, truth: torch.Tensor, dtype: torch.dtype, what: str):
    got, expected, truth = (t.float() for t in (got, expected, truth))
    assert torch.isfinite(got).all(), what
    scale = expected.abs().max().item()
    diff = (got - expected).abs().max().item()
    assert diff <= REL_TOL[dtype] * scale, f"{what}: max |kernel - sdpa| {diff:.3e} vs scale {scale:.3e}"
    # The kernel is about as accurate as SDPA in the same dtype, measured against fp32.
    err_kernel = (got - truth).abs().max().item()
    err_sdpa = (expected - truth).abs().max().item()
    assert err_kernel <= 3 * err_sdpa + 1e-3 * scale, f"{what}: error vs fp32 {err_kernel:.3e} (sdpa {err_sdpa:.3e})"


@pytest.fixture(params=["cuda", "triton"])
def backend_name(request):
    return request.param


@pytest.fixture(params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def dtype(request):
    return request.param


@torch.no_grad()
def test_prefill_matches_sdpa(backend_name, dtype):
    backend = _backend_or_skip(backend_name)
    truth, reference, model = make_models(dtype)
    backend.install(model)
    ids = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1)).cuda()
    assert_close(model(ids).logits, reference(ids).logits, truth(ids).logits, dtype, "prefill")
    assert backend.kernel_calls == NUM_LAYERS and backend.fallback_calls == 0


@torch.no_grad()
def test_cached_prefix_suffix_decode_matches_sdpa(backend_name, dtype):
    """Prefix in a DynamicCache, a short suffix over it (split-KV path), then decode steps."""
    backend = _backend_or_skip(backend_name)
    truth, reference, model = make_models(dtype)
    backend.install(model)
    total = PREFIX + SUFFIX + DECODE
    ids = torch.randint(0, 256, (1, total), generator=torch.Generator().manual_seed(2)).cuda()
    caches = [DynamicCache(config=m.config) for m in (truth, reference, model)]
    steps = [(0, PREFIX), (PREFIX, PREFIX + SUFFIX)] + [(i, i + 1) for i in range(PREFIX + SUFFIX, total)]
    for lo, hi in steps:
        outs = [m(ids[:, lo:hi], past_key_values=c, use_cache=True).logits for m, c in zip((truth, reference, model),
                                                                                           caches)]
        assert_close(outs[2], outs[1], outs[0], dtype, f"tokens [{lo}, {hi})")
    assert backend.kernel_calls == NUM_LAYERS * len(steps)
    assert backend.fallback_calls == 0
    assert caches[2].get_seq_length() == total


@torch.no_grad()
def test_left_padded_batch_matches_sdpa(backend_name, dtype):
    """Two prompts left-padded into one batch (kv_start per row), then one decode step for both."""
    backend = _backend_or_skip(backend_name)
    truth, reference, model = make_models(dtype)
    backend.install(model)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (2, 150), generator=gen).cuda()
    mask = torch.ones(2, 150, dtype=torch.long, device="cuda")
    mask[1, :37] = 0
    models = (truth, reference, model)
    caches = [DynamicCache(config=m.config) for m in models]
    outs = [m(ids, attention_mask=mask, past_key_values=c).logits for m, c in zip(models, caches)]
    valid = mask.bool()
    assert_close(outs[2][valid], outs[1][valid], outs[0][valid], dtype, "padded prefill")
    nxt = torch.randint(0, 256, (2, 1), generator=gen).cuda()
    mask2 = torch.cat([mask, torch.ones(2, 1, dtype=torch.long, device="cuda")], dim=1)
    outs = [m(nxt, attention_mask=mask2, past_key_values=c).logits for m, c in zip(models, caches)]
    assert_close(outs[2], outs[1], outs[0], dtype, "padded decode")
    assert backend.kernel_calls == 2 * NUM_LAYERS and backend.fallback_calls == 0


def test_triton_warmup_tunes_on_gpu():
    """TritonBackend.warmup runs kernels for every bucket (here up to 32 tokens) and fills the autotune caches."""
    import kvboost.kernels_triton.flash_attn as fa

    backend = _backend_or_skip("triton")
    backend.warmup(num_q_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, device=torch.device("cuda"),
                   max_len=32)
    assert backend.warmup_calls > 0
    assert fa._get_autotuned("fwd").cache and fa._get_autotuned("decode").cache and fa._get_autotuned("split").cache
