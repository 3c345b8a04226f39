"""attn=cpu_kernel: the C++ CPU attention kernel against a float64 reference, its contract and errors, and the
engine on it (reuse within 1e-4 of a cold prefill in fp32, HF's greedy tokens, one kernel call per layer).

The backend's conformance with the other backends (prefill, cached prefix + decode, left-padded batches) is in
tests/kernel_tests/test_attention_backends.py; the runner calling the kernel against HF's forward in
tests/test_model_runner.py.
"""

import pytest
import torch
from kvboost_testkit.tiny import hf_greedy_reference, make_engine, random_ids, tiny_model

from kvboost.kernels_triton.flash_attn_reference import flash_attn_reference
from kvboost.attention import cpu_ext
from kvboost.attention.cpu_ext import cpu_attention_forward, cpu_extension_unavailable_reason
from kvboost.registry import ATTENTION
from kvboost.runtime.config import choose_runner

pytestmark = pytest.mark.skipif(
    cpu_extension_unavailable_reason() is not None,
    reason=f"cpu_kernel unavailable: {cpu_extension_unavailable_reason()}",
)


def reference(q, k, v, **contract):
    """The contract's plain-torch reference, computed in float64 (rows that see no key are 0)."""
    return flash_attn_reference(q.double(), k.double(), v.double(), **contract)


def rand(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_len", "k_len", "heads", "kv_heads", "tile"),
                         [(19, 50, 4, 2, 32), (19, 50, 4, 2, 4), (1, 37, 6, 2, 32), (40, 40, 3, 3, 8),
                          (7, 300, 9, 3, 2)])  # fmt: skip
def test_kernel_matches_float64_attention(dtype, q_len, k_len, heads, kv_heads, tile):
    q = rand(2, heads, q_len, 16, dtype=dtype, seed=1)
    k, v = rand(2, kv_heads, k_len, 16, dtype=dtype, seed=2), rand(2, kv_heads, k_len, 16, dtype=dtype, seed=3)
    for causal in (True, False):
        got = cpu_attention_forward(q, k, v, causal=causal, tile=tile)
        assert got.dtype == dtype and got.shape == q.shape
        err = (got.double() - reference(q, k, v, causal=causal)).abs().max().item()
        assert err < TOL[dtype], (causal, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_positions_padding_strides_and_empty_rows(dtype):
    """Unsorted per-query positions, left padding (kv_start), a shorter row (kv_len), a query before its row's
    first key (sees nothing: zeros), inputs that are views with other strides, and ``out`` a transposed view."""
    q_len, k_len, d = 11, 29, 32
    q = rand(2, q_len, 6, d, dtype=dtype, seed=4).transpose(1, 2)  # [B, H, L, D] view of [B, L, H, D]
    kv = rand(2, 2, k_len, 2 * d, dtype=dtype, seed=5)
    k, v = kv[..., :d], kv[..., d:]  # row stride 2 * d
    positions = torch.tensor([[28, 3, 17, 9, 0, 12, 27, 5, 20, 14, 1], [2, 10, 4, 28, 6, 8, 1, 22, 0, 15, 11]],
                             dtype=torch.int32)  # fmt: skip
    kv_start, kv_len = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([29, 25], dtype=torch.int32)
    out = torch.full((2, q_len, 6, d), float("nan"), dtype=dtype)
    got = cpu_attention_forward(q, k, v, q_positions=positions, kv_start=kv_start, kv_len=kv_len,
                                out=out.transpose(1, 2), tile=4, sm_scale=0.3)  # fmt: skip
    assert got.data_ptr() == out.data_ptr()
    expected = reference(q, k, v, q_positions=positions, kv_start=kv_start, kv_len=kv_len, sm_scale=0.3)
    assert (got.double() - expected).abs().max().item() < TOL[dtype]
    # Row 1 starts at key 3: its queries at positions 2, 1 and 0 see no key and get exact zeros.
    for i in (0, 6, 8):
        assert torch.count_nonzero(got[1, :, i]) == 0


def test_kernel_rejects_bad_inputs():
    q, k = rand(1, 4, 5, 8), rand(1, 2, 9, 8)
    with pytest.raises(TypeError, match="float32 or all bfloat16"):
        cpu_attention_forward(q.half(), k.half(), k.half())
    with pytest.raises(ValueError, match="shapes do not match"):
        cpu_attention_forward(rand(1, 3, 5, 8), k, k)
    with pytest.raises(ValueError, match="4-D"):
        cpu_attention_forward(q[0], k, k)
    with pytest.raises(ValueError, match="tile"):
        cpu_attention_forward(q, k, k, tile=0)
    with pytest.raises(ValueError, match="q_positions must have shape"):
        cpu_attention_forward(q, k, k, q_positions=torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="integers"):
        cpu_attention_forward(q, k, k, kv_len=torch.tensor([9.0]))
    with pytest.raises(ValueError, match="out must"):
        cpu_attention_forward(q, k, k, out=torch.empty(1, 4, 5, 9))
    with pytest.raises(ValueError, match="positive integer"):
        ATTENTION.build({"name": "cpu_kernel", "tile": -1})


def test_unavailable_reasons_are_clear(monkeypatch):
    monkeypatch.setattr(cpu_ext.platform, "machine", lambda: "aarch64")
    assert "x86" in cpu_extension_unavailable_reason()
    with pytest.raises(RuntimeError, match=r"unavailable: .*x86.*attn=sdpa"):
        cpu_ext.load_cpu_extension.__wrapped__()
    monkeypatch.setattr(cpu_ext.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_ext.shutil, "which", lambda name: None)
    assert "compiler" in cpu_extension_unavailable_reason()


def test_the_runner_decodes_with_its_own_attention_under_cpu_kernel():
    """The kernel serves prefill-shaped calls; a decode step's one query per head is the runner's (compiled)."""
    model = tiny_model("llama")
    backend = ATTENTION.build("cpu_kernel")
    assert backend.capabilities.runner_decode
    config = choose_runner(model, backend)
    assert config.runner == "llama" and config.decode in ("compiled", "eager")
    assert choose_runner(model, backend, decode="eager").decode == "eager"


def test_engine_on_cpu_kernel_reuses_within_1e4_and_decodes_hf_tokens():
    engine = make_engine("llama", attn="cpu_kernel", decode="eager")
    info = engine.decode_info()
    assert info["runner"] == "llama" and info["prefill"] == "fused" and info["decode"] == "eager"
    prompt = random_ids(70, seed=11)
    engine.warm(prompt[:40])
    calls = engine.attention.stats()["kernel_calls"]
    hit = engine.generate(prompt, 1, store=False)
    # one kernel call per layer for the one-sequence suffix prefill: counted once (not by the engine and the backend)
    assert engine.attention.stats()["kernel_calls"] - calls == engine.model.config.num_hidden_layers
    hit, cold = engine.generate(prompt, 6, store=False), engine.generate(prompt, 6, mode="cold")
    assert hit.cached_tokens == 40
    assert torch.allclose(hit.first_token_logits, cold.first_token_logits, atol=1e-4, rtol=0)
    plain = tiny_model("llama")  # the same seeded weights on transformers' own SDPA
    assert torch.equal(plain.lm_head.weight, engine.model.lm_head.weight)
    fed, _, _ = hf_greedy_reference(plain, prompt, 6)
    assert hit.output_ids == cold.output_ids == fed
    engine.close()
