"""Tests of the Triton FlashAttention-2 forward (``kvboost.kernels_triton.flash_attn``) against the float64 reference.

Without a GPU these run under the Triton CPU interpreter (see conftest.py), which is slow, so the shapes are small
and odd (masked tails in every dimension) and the parametrisation is a covering design rather than a full product:
every mode x dtype x shape combination runs once, with the head dim rotated through 64 / 80 / 96 / 128.

Every kernel run writes into an output buffer poisoned with NaN, so an element the kernel forgets to write fails
the comparison.

The split-KV path (GQA-packed rows, key splits, reduce kernel) is forced with ``split_kv=True`` (under the
interpreter the SM-count heuristic never picks it); the heuristic itself is tested as a function of the SM count.
"""

import math

import pytest
import torch

import kvboost.kernels_triton.flash_attn as fa
from kvboost.kernels_triton.flash_attn import (
    DECODE_MAX_Q,
    _decode_split_len,
    _interp_tiles,
    _uses_decode_path,
    autotune_warmup,
    flash_attn_forward,
    is_interpreter,
    use_split_kv,
    warmup_shapes,
)
from kvboost.kernels_triton.flash_attn_reference import attention_mask, flash_attn_reference

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}
HEAD_DIMS = [64, 80, 96, 128]

# (B, Hq, Hkv, Lq, Lk): prefill with GQA 3, square Lq = Lk with GQA 4, decode with MHA and GQA 4, 3-query decode.
SHAPES = {
    "prefill": (2, 6, 2, 7, 37),
    "square": (2, 4, 1, 33, 33),
    "decode": (3, 2, 2, 1, 53),
    "decode_gqa": (2, 8, 2, 1, 53),
    "multi_q_decode": (3, 6, 2, 3, 45),
}
MODES = ["causal", "noncausal", "qpos", "padding", "qpos_padding"]


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max|out - ref| / max|ref| in float64; +inf if out has a non-finite value (e.g. an unwritten NaN)."""
    out = out.detach().to(torch.float64).cpu()
    ref = ref.detach().to(torch.float64).cpu()
    if not torch.isfinite(out).all():
        return math.inf
    scale = ref.abs().max().item()
    return (out - ref).abs().max().item() / (scale if scale > 0 else 1.0)


def make_qkv(B, Hq, Hkv, Lq, Lk, D, dtype, seed):
    """Fresh random q, k, v (generated on CPU for reproducibility, then moved)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=g)
    k = torch.randn(B, Hkv, Lk, D, generator=g)
    v = torch.randn(B, Hkv, Lk, D, generator=g)
    return (t.to(dtype=dtype, device=DEVICE) for t in (q, k, v))


def mode_kwargs(mode: str, B: int, Lq: int, Lk: int, seed: int) -> dict:
    """Mask arguments for one test mode (see MODES)."""
    g = torch.Generator().manual_seed(seed + 1)
    kw = {}
    if mode == "noncausal":
        kw.update(causal=False, sm_scale=0.37)
    if mode in ("qpos", "qpos_padding"):
        # Per row a different subset of key positions: row 0 sorted (blocks cover disjoint position ranges, so
        # causal block skipping really skips), the other rows unsorted (CacheBlend's selected tokens).
        rows = [torch.randperm(Lk, generator=g)[:Lq] for _ in range(B)]
        rows[0] = rows[0].sort().values
        kw["q_positions"] = torch.stack(rows).to(DEVICE)
    if mode in ("padding", "qpos_padding"):
        # Row 0 unpadded, row 1 left-padded, row 2 (if any) padded on both sides.
        starts = [0, 5, 11][:B]
        stops = [Lk, Lk, Lk - 6][:B]
        kw.update(kv_start=torch.tensor(starts, device=DEVICE), kv_len=torch.tensor(stops, device=DEVICE))
    if mode == "qpos_padding":
        kw["causal"] = bool(seed % 2)
    return kw


def run_checked(q, k, v, record=None, tol=None, split_kv=None, **kw):
    """Run the kernel into a NaN-poisoned ``out``, compare with the float64 reference, return (out, err)."""
    out = torch.full_like(q, float("nan"))
    res = flash_attn_forward(q, k, v, out=out, split_kv=split_kv, **kw)
    assert res is out
    ref = flash_attn_reference(q.double(), k.double(), v.double(), **kw)
    err = rel_err(out, ref)
    if record is not None:
        record("flash_attn_split" if split_kv else "flash_attn", q.dtype, err)
    assert err < (tol if tol is not None else TOL[q.dtype]), f"relative error {err:.3e}"
    return out, err


# ----------------------------------------------------------------------------------------------------------------
# accuracy against the reference
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference(mode, shape_name, dtype, record_error):
    """Every mask mode x shape (prefill / square / decode / GQA) x dtype; head dim rotated over 64/80/96/128."""
    B, Hq, Hkv, Lq, Lk = SHAPES[shape_name]
    mi, si = MODES.index(mode), list(SHAPES).index(shape_name)
    D = HEAD_DIMS[(mi + si) % len(HEAD_DIMS)]
    seed = 100 * mi + 10 * si + DTYPES.index(dtype)
    q, k, v = make_qkv(B, Hq, Hkv, Lq, Lk, D, dtype, seed)
    run_checked(q, k, v, record_error, **mode_kwargs(mode, B, Lq, Lk, seed))


@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("Lq", [1, 19])
def test_head_dims_fp32(D, Lq, record_error):
    """All head dims (80 and 96 are padded to 128 lanes) on both paths, at the tight fp32 tolerance."""
    q, k, v = make_qkv(1, 3, 1, Lq, 41, D, torch.float32, seed=D + Lq)
    run_checked(q, k, v, record_error)


def test_paths_are_exercised():
    """The shapes above really cover both kernels, and decode runs with several key splits (reduce kernel)."""
    assert _uses_decode_path(1, 4) and _uses_decode_path(DECODE_MAX_Q, 2)
    assert not _uses_decode_path(DECODE_MAX_Q + 1, 1)
    assert not _uses_decode_path(7, 3)
    if is_interpreter():
        assert math.ceil(53 / _decode_split_len(2, 2, 53, DEVICE)) > 1
        # The split-KV tests below: several splits and (with GQA 4) several row blocks per kv head.
        for Lq, Lk in [(5, 100), (16, 100), (33, 100), (33, 300)]:
            _, _, split_len = _interp_tiles(Lq, Lk)
            assert math.ceil(Lk / split_len) > 1
        assert math.ceil(4 * 33 / _interp_tiles(33, 100)[0]) > 1


# ----------------------------------------------------------------------------------------------------------------
# split-KV prefill (short queries over long keys)
# ----------------------------------------------------------------------------------------------------------------

SPLIT_MODES = ["causal", "qpos", "window", "noncausal"]


def split_mode_kwargs(mode: str, B: int, Lq: int, Lk: int, seed: int) -> dict:
    """Mask arguments for the split-KV tests: default bottom-right causal; explicit unsorted positions with -1
    rows (queries that see nothing); kv_start/kv_len windows incl. an empty row and a window that ends inside a
    split; non-causal with a window."""
    g = torch.Generator().manual_seed(seed)
    if mode == "causal":
        return {}
    if mode == "qpos":
        pos = torch.stack([torch.randperm(Lk, generator=g)[:Lq] for _ in range(B)])
        pos[0, ::3] = -1
        return {"q_positions": pos.to(DEVICE)}
    starts = torch.tensor([3, Lk // 2][:B])
    stops = torch.tensor([Lk - 7, Lk // 2][:B])  # row 1 (if any): empty window -> zeros
    kw = {"kv_start": starts.to(DEVICE), "kv_len": stops.to(DEVICE)}
    if mode == "noncausal":
        kw.update(causal=False, kv_start=torch.tensor([0, 13][:B], device=DEVICE),
                  kv_len=torch.tensor([Lk, Lk - 20][:B], device=DEVICE))
    return kw


@pytest.mark.parametrize("mode", SPLIT_MODES)
@pytest.mark.parametrize("gqa", [4, 1], ids=["gqa4", "mha"])
@pytest.mark.parametrize("Lk", [100, 300])
@pytest.mark.parametrize("Lq", [5, 16, 33])
def test_split_kv_matches_reference(Lq, Lk, gqa, mode, record_error):
    """Forced split-KV prefill vs the float64 reference: every (Lq, Lk, GQA, mode), dtype and head dim rotated."""
    i = 8 * [5, 16, 33].index(Lq) + 4 * [100, 300].index(Lk) + 2 * (gqa == 1) + SPLIT_MODES.index(mode)
    dtype = DTYPES[i % len(DTYPES)]
    D = [64, 80, 128][(i // 3) % 3]
    B, Hkv = 2, 2
    q, k, v = make_qkv(B, Hkv * gqa, Hkv, Lq, Lk, D, dtype, seed=1000 + i)
    run_checked(q, k, v, record_error, split_kv=True, **split_mode_kwargs(mode, B, Lq, Lk, seed=i))


@pytest.mark.parametrize("split_kv", [True, False])
def test_forced_paths_for_decode(split_kv, record_error):
    """``split_kv`` forces either kernel for a decode step too (the one-pass kernel with Lq = 1)."""
    q, k, v = make_qkv(2, 8, 2, 1, 70, 64, torch.float16, seed=5)
    run_checked(q, k, v, record_error, split_kv=split_kv, kv_start=torch.tensor([0, 9], device=DEVICE))


def test_split_kv_heuristic():
    """The path choice as a function of the SM count: a short suffix over a long cache splits, a square prefill
    or a GPU already full of programs does not; CPU (1 "SM") never splits."""
    h100 = 132
    assert use_split_kv(1, 32, 8, 100, 16384, h100)
    assert use_split_kv(1, 32, 8, 16, 4096, h100)
    assert use_split_kv(1, 32, 8, 512, 4096, h100)  # 4 tiles x 32 heads = 128 programs
    assert not use_split_kv(1, 32, 8, 4096, 4096, h100)  # square 4k prefill: 1024 programs
    assert not use_split_kv(8, 32, 8, 100, 16384, h100)  # batch 8 already fills the GPU
    assert not use_split_kv(1, 32, 8, 100, 1024, h100)  # keys too short to be worth splitting
    assert not use_split_kv(1, 32, 8, 100, 16384, 1)
    assert use_split_kv(1, 32, 8, 100, 16384, 1000)  # a wider GPU splits more shapes


@pytest.mark.parametrize(
    "Lq, Lk, split_kv",
    [(13, 29, False), (1, 53, None), (3, 53, None), (21, 90, True), (9, 14, True)],
    ids=["prefill", "decode", "decode3", "split", "split_single"],
)
def test_transposed_out_all_paths(Lq, Lk, split_kv, record_error):
    """``out`` as FlashKernelBackend passes it: the [B, Hq, Lq, D] view of a NaN-poisoned [B, Lq, Hq, D] buffer.
    Every path (one-pass, decode split + reduce, split-KV prefill + reduce, single split writing directly) must
    fill the whole buffer with the right values."""
    B, Hq, Hkv, D = 2, 8, 2, 64
    q, k, v = make_qkv(B, Hq, Hkv, Lq, Lk, D, torch.float32, seed=Lq + Lk)
    buf = torch.full((B, Lq, Hq, D), float("nan"), device=DEVICE)
    kw = {"kv_start": torch.tensor([0, 4], device=DEVICE)}
    res = flash_attn_forward(q, k, v, out=buf.transpose(1, 2), split_kv=split_kv, **kw)
    assert res.data_ptr() == buf.data_ptr() and torch.isfinite(buf).all()
    err = rel_err(buf.transpose(1, 2), flash_attn_reference(q.double(), k.double(), v.double(), **kw))
    record_error("flash_attn_split" if split_kv else "flash_attn", q.dtype, err)
    assert err < TOL[torch.float32]


def test_warmup_shapes_cover_every_bucket():
    """Warm-up visits every power-of-two (q, kv) bucket the engine can hit, both paths for q > DECODE_MAX_Q."""
    shapes = warmup_shapes(1000)
    kv_buckets = {kv for _, kv, _ in shapes}
    assert kv_buckets == {2**i for i in range(11)}  # 1 .. 1024 = next_pow2(1000)
    for kv in (16, 1024):
        assert {q for q, k, s in shapes if k == kv and s is None} == set(range(1, DECODE_MAX_Q + 1))
        for qb in [2**i for i in range(3, 11) if 2**i <= kv]:
            assert (qb, kv, True) in shapes and (qb, kv, False) in shapes
    assert all(q <= kv for q, kv, _ in shapes)


def test_autotune_warmup_is_a_noop_without_gpu():
    if not is_interpreter() and DEVICE.type == "cuda":
        pytest.skip("checks the CPU / interpreter no-op")
    kw = {"num_q_heads": 4, "num_kv_heads": 2, "head_dim": 64, "dtype": torch.float16, "max_len": 4096}
    assert autotune_warmup(device=DEVICE, **kw) == 0
    from kvboost.attention.triton import TritonBackend

    backend = TritonBackend()
    backend.warmup(device=DEVICE, **kw)
    assert backend.warmup_calls == 0 and backend.kernel_calls == 0


@pytest.fixture
def gpu_launch_code(monkeypatch):
    """Run the GPU launch code (Triton's autotuner over the config lists, grid functions of the tuned tiles)
    under the interpreter: the timer is replaced by a CPU clock and is_interpreter() answers False for the
    launches (input validation, which needs CUDA tensors when compiled, is done before)."""
    if not is_interpreter():
        pytest.skip("the compiled path runs for real on a GPU")
    import time

    benched = []

    def cpu_bench(kernel_call, quantiles):
        benched.append(1)
        start = time.perf_counter()
        kernel_call()
        elapsed = time.perf_counter() - start
        return [elapsed] * len(quantiles)

    monkeypatch.setattr(fa, "_tune_bench", cpu_bench)
    monkeypatch.setattr(fa, "_autotuned", {})
    real_interpreter, real_launch = fa.is_interpreter, fa._launch

    def launch(*args, **kwargs):
        monkeypatch.setattr(fa, "is_interpreter", lambda: False)
        try:
            return real_launch(*args, **kwargs)
        finally:
            monkeypatch.setattr(fa, "is_interpreter", real_interpreter)

    launch.benched = benched

    return launch


@pytest.mark.parametrize(
    "Lq, Lk, split, num_splits",
    [(20, 40, False, None), (1, 300, True, None), (3, 300, True, 3), (20, 300, True, 3), (20, 50, True, 1)],
    ids=["one_pass", "decode_single_split", "decode_splits", "split_prefill", "split_prefill_direct"],
)
def test_autotuned_launch_paths(gpu_launch_code, Lq, Lk, split, num_splits, record_error):
    """Each autotuned kernel (fwd, decode, split) with every config of its list (fp16, GPU tile sizes, transposed
    out): the launch arguments, grid functions and config pruning of the GPU path."""
    B, Hq, Hkv, D = 1, 4, 2, 64
    q, k, v = make_qkv(B, Hq, Hkv, Lq, Lk, D, torch.float16, seed=Lq + Lk)
    buf = torch.full((B, Lq, Hq, D), float("nan"), dtype=q.dtype, device=DEVICE)
    out = buf.transpose(1, 2)
    kv_start = torch.tensor([2], device=DEVICE)
    sm_scale, qpos, ks, kl = fa._validate(q, k, v, None, None, kv_start, None, out)
    gpu_launch_code(q, k, v, out, True, sm_scale, qpos, ks, kl, split, num_splits=num_splits)
    name = "fwd" if not split else ("decode" if _uses_decode_path(Lq, Hq // Hkv) else "split")
    assert len(fa._autotuned[name].cache) == 1  # tuned once for this key ...
    assert len(gpu_launch_code.benched) > 1  # ... over several configs
    err = rel_err(out, flash_attn_reference(q.double(), k.double(), v.double(), kv_start=kv_start))
    record_error("flash_attn_gpu_cfg", q.dtype, err)
    assert err < TOL[q.dtype]


def test_warmup_loop_tunes_every_key(gpu_launch_code, monkeypatch):
    """The warm-up loop (GPU launch code, under the interpreter) makes one tuning key per bucket and path."""
    calls = []
    monkeypatch.setattr(fa, "_launch", lambda *a, **kw: calls.append(kw.get("num_splits")) or gpu_launch_code(*a, **kw))
    q, k, v = make_qkv(1, 4, 2, 8, 8, 64, torch.float16, seed=0)
    n = fa._run_warmup(q, k, v, max_len=8, padding_variants=False)
    assert n == len(calls) > 0 and 1 in calls
    keys = {name: len(a.cache) for name, a in fa._autotuned.items()}
    assert keys["fwd"] >= 1 and keys["split"] >= 1 and keys["decode"] >= 4  # decode: kv buckets 1..8


# ----------------------------------------------------------------------------------------------------------------
# install-time model checks of the triton backend
# ----------------------------------------------------------------------------------------------------------------


def test_triton_model_issues():
    from transformers import Gemma2Config, LlamaConfig, MistralConfig

    from kvboost.attention.triton import triton_model_issues

    assert triton_model_issues(LlamaConfig(head_dim=80), torch.float32) == []
    assert triton_model_issues(MistralConfig(sliding_window=16), torch.bfloat16) == []  # SDPA fallback, counted
    assert "attn=sdpa" in triton_model_issues(LlamaConfig(head_dim=64), torch.float64)[0]
    assert "256" in triton_model_issues(LlamaConfig(head_dim=512), torch.float16)[0]
    issues = triton_model_issues(Gemma2Config(), torch.bfloat16)
    assert len(issues) == 1 and "soft-capping" in issues[0] and "attn=eager" in issues[0]


def test_triton_install_refuses_softcapping_model():
    """Gemma2-style soft-capping is refused when the backend is installed, and the model is left untouched."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from kvboost.registry import ATTENTION

    config = Gemma2Config(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    config._attn_implementation = "eager"
    model = Gemma2ForCausalLM(config)
    with pytest.raises(ValueError, match="soft-capping"):
        ATTENTION.build("triton").install(model)
    assert model.config._attn_implementation == "eager"


def test_multi_query_block_and_long_keys(record_error):
    """Several query blocks and many key tiles: causal diagonal, full tiles, skipped tiles (fp16)."""
    q, k, v = make_qkv(1, 2, 1, 50, 83, 64, torch.float16, seed=7)
    run_checked(q, k, v, record_error)
    run_checked(q, k, v, record_error, kv_start=torch.tensor([20], device=DEVICE),
                kv_len=torch.tensor([70], device=DEVICE))


def test_positions_beyond_lq_gt_lk(record_error):
    """Explicit positions allow Lq > Lk (repeated / out-of-range positions are legal and clamp naturally)."""
    B, Lq, Lk = 2, 20, 9
    q, k, v = make_qkv(B, 2, 1, Lq, Lk, 64, torch.float32, seed=3)
    pos = torch.randint(-2, Lk + 3, (B, Lq), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    run_checked(q, k, v, record_error, q_positions=pos)


@pytest.mark.parametrize("Lq", [2, 21])
def test_int64_index_variant(Lq, monkeypatch, record_error):
    """The 64-bit offset variant (selected for huge strided tensors) computes the same thing."""
    monkeypatch.setattr(fa, "_needs_int64_index", lambda *tensors: True)
    q, k, v = make_qkv(2, 4, 2, Lq, 35, 64, torch.float16, seed=Lq)
    run_checked(q, k, v, record_error, kv_start=torch.tensor([3, 0], device=DEVICE))


def test_positions_1d_broadcast_equals_2d():
    """A [Lq] q_positions is shared by all rows, identical to passing it expanded to [B, Lq]."""
    B, Lq, Lk = 2, 5, 30
    q, k, v = make_qkv(B, 2, 2, Lq, Lk, 64, torch.float32, seed=11)
    pos = torch.tensor([29, 3, 17, 8, 22], device=DEVICE)
    a = flash_attn_forward(q, k, v, q_positions=pos)
    b = flash_attn_forward(q, k, v, q_positions=pos.expand(B, Lq).contiguous())
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------------------------
# edge cases
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Lq", [1, 9])
def test_rows_without_keys_are_zero(Lq, record_error):
    """Empty key windows (kv_len <= kv_start) and queries positioned before their window give exact zeros."""
    B, Lk = 3, 40
    q, k, v = make_qkv(B, 4, 2, Lq, Lk, 64, torch.float16, seed=Lq)
    kv_start = torch.tensor([10, 25, 0], device=DEVICE)
    kv_len = torch.tensor([30, 20, 40], device=DEVICE)  # row 1 is empty
    pos = torch.randint(0, Lk, (B, Lq), generator=torch.Generator().manual_seed(5))
    pos[0, 0] = 4  # before row 0's window -> no key under causal masking
    pos = pos.to(DEVICE)
    out, _ = run_checked(q, k, v, record_error, q_positions=pos, kv_start=kv_start, kv_len=kv_len)
    assert torch.count_nonzero(out[1]) == 0
    assert torch.count_nonzero(out[0, :, 0]) == 0
    assert torch.count_nonzero(out[2]) > 0


def test_zero_length_keys_and_queries():
    """Lk = 0 gives zeros, Lq = 0 an empty output; neither launches a kernel on garbage."""
    q, k, v = make_qkv(1, 2, 1, 3, 0, 64, torch.float32, seed=0)
    out = flash_attn_forward(q, k, v, q_positions=torch.zeros(3, dtype=torch.long, device=DEVICE),
                             out=torch.full_like(q, float("nan")))
    assert torch.count_nonzero(out) == 0
    q, k, v = make_qkv(1, 2, 1, 0, 5, 64, torch.float32, seed=0)
    assert flash_attn_forward(q, k, v).shape == (1, 2, 0, 64)


@pytest.mark.parametrize("Lq", [1, 13])
def test_non_contiguous_inputs_and_output(Lq, record_error):
    """Views as transformers produces them: q from [B, L, H, D].transpose(1, 2), k/v slices of a packed KV
    tensor, and a transposed output buffer (all strides honoured, nothing materialised)."""
    B, Hq, Hkv, Lk, D = 2, 6, 2, 29, 80
    g = torch.Generator().manual_seed(Lq)
    # q is also sliced out of a wider buffer (as from a fused qkv projection), so it is strided even for Lq = 1.
    q = torch.randn(B, Lq, Hq, D + 16, generator=g).to(DEVICE, torch.float16)[..., :D].transpose(1, 2)
    kv = torch.randn(B, Lk, 2, Hkv, D, generator=g).to(DEVICE, torch.float16)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    out = torch.full((B, Lq, Hq, D), float("nan"), dtype=q.dtype, device=DEVICE).transpose(1, 2)
    flash_attn_forward(q, k, v, out=out)
    ref = flash_attn_reference(q.double(), k.double(), v.double())
    err = rel_err(out, ref)
    record_error("flash_attn", q.dtype, err)
    assert err < TOL[q.dtype]


def test_default_output_allocation():
    """Without ``out`` a fresh [B, Hq, Lq, D] tensor of q's dtype is returned."""
    q, k, v = make_qkv(1, 2, 2, 17, 17, 96, torch.bfloat16, seed=1)
    res = flash_attn_forward(q, k, v, causal=False)
    assert res.shape == q.shape and res.dtype == q.dtype and res.device == q.device
    assert rel_err(res, flash_attn_reference(q.double(), k.double(), v.double(), causal=False)) < TOL[q.dtype]


# ----------------------------------------------------------------------------------------------------------------
# the checks themselves can fail
# ----------------------------------------------------------------------------------------------------------------


def test_error_metric_detects_wrong_output():
    """The metric used above flags a perturbation just above tolerance, a NaN, and a masking mistake."""
    q, k, v = make_qkv(1, 2, 1, 7, 37, 64, torch.float32, seed=9)
    out, err = run_checked(q, k, v)
    ref = flash_attn_reference(q.double(), k.double(), v.double())
    bad = out.clone()
    bad[0, 1, 3, 5] += 2 * TOL[torch.float32] * ref.abs().max()
    assert rel_err(bad, ref) > TOL[torch.float32] > err
    bad = out.clone()
    bad[0, 0, 6, 63] = float("nan")
    assert rel_err(bad, ref) == math.inf
    # Forgetting the causal mask is a large, detected error.
    assert rel_err(flash_attn_forward(q, k, v, causal=False), ref) > 1e-2


def test_reference_matches_naive_loop():
    """The reference itself against an independent per-query loop (GQA, positions, padding, empty rows)."""
    B, Hq, Hkv, Lq, Lk, D = 2, 4, 2, 5, 12, 8
    q, k, v = (t.cpu().double() for t in make_qkv(B, Hq, Hkv, Lq, Lk, D, torch.float64, seed=2))
    pos = torch.tensor([[11, 0, 5, 7, 3], [2, 9, 1, 11, 6]])
    kv_start, kv_len = torch.tensor([1, 4]), torch.tensor([12, 8])
    ref = flash_attn_reference(q, k, v, q_positions=pos, kv_start=kv_start, kv_len=kv_len, sm_scale=0.5)
    expect = torch.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            for i in range(Lq):
                keys = [j for j in range(kv_start[b], kv_len[b]) if j <= pos[b, i]]
                if keys:
                    s = torch.stack([q[b, h, i] @ k[b, h // (Hq // Hkv), j] * 0.5 for j in keys])
                    w = torch.softmax(s, 0)
                    expect[b, h, i] = sum(w[n] * v[b, h // (Hq // Hkv), j] for n, j in enumerate(keys))
    assert torch.allclose(ref, expect, atol=1e-12)
    assert torch.count_nonzero(ref[0, :, 1]) == 0  # position 0 < kv_start 1
    mask = attention_mask(B, Lq, Lk, q_positions=pos, kv_start=kv_start, kv_len=kv_len)
    assert mask.shape == (B, Lq, Lk) and not mask[0, 1].any()


# ----------------------------------------------------------------------------------------------------------------
# input validation
# ----------------------------------------------------------------------------------------------------------------


def _base(**over):
    q, k, v = make_qkv(2, 4, 2, 3, 10, 64, torch.float16, seed=0)
    args = dict(q=q, k=k, v=v)
    args.update(over)
    return args


def _bad_cases():
    q, k, v = make_qkv(2, 4, 2, 3, 10, 64, torch.float16, seed=0)
    i64 = dict(dtype=torch.long, device=DEVICE)
    return {
        "q_3d": dict(q=q[0]),
        "k_5d": dict(k=k[None]),
        "kv_shape_mismatch": dict(v=v[:, :, :9]),
        "batch_mismatch": dict(k=k[:1], v=v[:1]),
        "head_dim_mismatch": dict(k=k[..., :32], v=v[..., :32]),
        "head_dim_too_big": dict(q=q.new_zeros(2, 4, 3, 512), k=k.new_zeros(2, 2, 10, 512),
                                 v=v.new_zeros(2, 2, 10, 512)),
        "hq_not_multiple": dict(q=q[:, :3]),
        "dtype_mismatch": dict(k=k.float()),
        "unsupported_dtype": dict(q=q.double(), k=k.double(), v=v.double()),
        "int_dtype": dict(q=q.to(torch.int32), k=k.to(torch.int32), v=v.to(torch.int32)),
        "lq_gt_lk_default_pos": dict(q=q.new_zeros(2, 4, 11, 64)),
        "q_positions_shape": dict(q_positions=torch.zeros(2, 4, **i64)),
        "q_positions_float": dict(q_positions=torch.zeros(2, 3, device=DEVICE)),
        "kv_start_shape": dict(kv_start=torch.zeros(3, **i64)),
        "kv_len_shape": dict(kv_len=torch.zeros(2, 1, **i64)),
        "out_shape": dict(out=q.new_empty(2, 4, 3, 32)),
        "out_dtype": dict(out=q.float()),
        "sm_scale_nan": dict(sm_scale=float("nan")),
        "device_mismatch": dict(k=k.to("meta"), v=v.to("meta")),
        "not_a_tensor": dict(q=q.tolist()),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_invalid_inputs_raise_value_error(case):
    args = _base(**_bad_cases()[case])
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(ValueError):
        flash_attn_forward(q, k, v, **args)


def test_model_sized_inputs_use_large_tiles(record_error):
    """Lengths above the interpreter's small-tile range (the tiles a whole LM under attn=triton uses on CPU)."""
    q, k, v = make_qkv(1, 3, 1, 150, 300, 64, torch.float32, seed=11)
    run_checked(q, k, v, record_error)
    q, k, v = make_qkv(2, 4, 2, 1, 600, 64, torch.float32, seed=12)  # decode: several 256-key splits
    run_checked(q, k, v, record_error, kv_start=torch.tensor([0, 130], device=DEVICE),
                kv_len=torch.tensor([600, 555], device=DEVICE))
