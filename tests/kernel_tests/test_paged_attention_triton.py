"""Tests of the Triton paged attention (``kvboost.kernels_triton.paged_attention``) against the float64 reference
(``kvboost.kernels_triton.paged_attention_reference``).

Without a GPU these run under the Triton CPU interpreter (see conftest.py), which is slow, so the shapes are small
and odd and the parametrisation is a covering design: every (head layout, dtype) runs both kernels on one mixed
batch -- a cold prefill (q_len == kv_len), a suffix prefill over cached keys, a decode row, a sequence without
queries, one without keys, kv_len never a multiple of the block size -- and the other features (decode-only
batches, CacheBlend position subsets, block sizes that do not divide the tiles, head dims, strided views, the
int64 variant, the no-sync hinted call, the autotuned launch code) are crossed with a rotated subset.

Every batch uses a pool whose blocks are a random permutation (sequences are never contiguous, and two sequences
share a block), block-table entries past a sequence's blocks point outside the pool, and every pool slot that no
sequence may read holds NaN; every kernel writes into an output poisoned with NaN.  So reading a wrong slot, a
table entry past the sequence, or forgetting to write an element fails the comparison.
"""

import contextlib
import math

import pytest
import torch

import kvboost.kernels_triton.paged_attention as pa
from kvboost.kernels_triton.paged_attention import (
    DECODE_MAX_Q,
    SPLIT_MIN_KEYS,
    autotune_warmup,
    choose_path,
    is_interpreter,
    paged_attention,
    warmup_shapes,
)
from kvboost.kernels_triton.paged_attention_reference import paged_attention_reference, slots_of

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 1e-2}

# (Hq, Hkv, D, block_size): GQA 3 with an odd q-head count and a padded head dim, GQA 4 with 32-slot blocks, MHA.
LAYOUTS = {
    "gqa3_d80_bs16": (9, 3, 80, 16),
    "gqa4_d64_bs32": (8, 2, 64, 32),
    "mha_d64_bs16": (2, 2, 64, 16),
}
# (q_len, kv_len) per sequence: cold prefill, suffix prefill, decode, no queries, no keys, 4-query decode.
MIXED = [(20, 20), (7, 45), (1, 37), (0, 29), (2, 0), (4, 18)]
# Decode-only batch (every q_len <= DECODE_MAX_Q): kv_len 1, q_len == kv_len, an empty sequence.
DECODE = [(1, 37), (3, 50), (1, 5), (0, 20), (4, 4), (1, 1)]


@pytest.fixture(autouse=True)
def _fixed_gpu_tiles(monkeypatch):
    """On a GPU, one fixed config per kernel (autotuning every shape here would compile dozens of variants);
    ``test_autotuned_launch_paths`` covers the autotuned launch."""
    if not is_interpreter():
        monkeypatch.setattr(pa, "AUTOTUNE", False)


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


def make_batch(seqs, Hq, Hkv, D, block_size, dtype, seed, positions=None, pool_layout="heads_first"):
    """A paged batch: ``seqs`` is a list of (q_len, kv_len); ``positions`` a list of per-sequence position lists
    (default: the last q_len positions, i.e. new tokens after the cached ones).

    Returns (q, k_cache, v_cache, kwargs of the contract).  The pool's blocks are a random permutation with two
    spare blocks; sequence 1 shares sequence 0's first block; table entries past a sequence's blocks hold an id
    outside the pool; every slot no sequence may read is NaN.  ``pool_layout="slots_first"`` makes the pool a
    ``[S, Hkv, D]`` tensor seen through a transposed ``[Hkv, S, D]`` view (strides of vLLM's layout).
    """
    g = torch.Generator().manual_seed(seed)
    nblk = [-(-kv // block_size) for _, kv in seqs]
    num_blocks = sum(nblk) + 2
    perm = torch.randperm(num_blocks, generator=g)
    width = max(nblk) + 1
    tables = torch.full((len(seqs), width), num_blocks + 7, dtype=torch.int32)
    used = 0
    for b, n in enumerate(nblk):
        tables[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    if len(seqs) > 1 and nblk[0] and nblk[1]:
        tables[1, 0] = tables[0, 0]  # a shared prefix block

    S = num_blocks * block_size
    if pool_layout == "slots_first":
        k = torch.randn(S, Hkv, D, generator=g).transpose(0, 1)
        v = torch.randn(S, Hkv, D, generator=g).transpose(0, 1)
    else:
        k = torch.randn(Hkv, S, D, generator=g)
        v = torch.randn(Hkv, S, D, generator=g)
    readable = torch.zeros(S, dtype=torch.bool)
    for b, (_, kv) in enumerate(seqs):
        readable[slots_of(tables[b], kv, block_size)] = True
    k[:, ~readable] = float("nan")
    v[:, ~readable] = float("nan")

    if positions is None:
        positions = [list(range(kv - ql, kv)) for ql, kv in seqs]
    assert [len(p) for p in positions] == [ql for ql, _ in seqs]
    q_lens = torch.tensor([ql for ql, _ in seqs])
    total = int(q_lens.sum())
    q = torch.randn(total, Hq, D, generator=g)
    kw = {
        "block_tables": tables.to(DEVICE),
        "kv_lens": torch.tensor([kv for _, kv in seqs], dtype=torch.int32, device=DEVICE),
        "query_start": torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).to(torch.int32).to(DEVICE),
        "q_positions": torch.tensor([p for ps in positions for p in ps], dtype=torch.int32, device=DEVICE),
        "block_size": block_size,
    }
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype), kw


def reference(q, k, v, kw, sm_scale=None):
    """The float64 reference on the same (rounded) inputs, one sequence at a time.

    A sequence with queries but no key (kv_len 0) gets zeros here: the reference itself cannot take it (its
    ``amax`` over zero keys raises).
    """
    q, k, v = q.double(), k.double(), v.double()
    result = torch.zeros_like(q)
    starts, lens = kw["query_start"].tolist(), kw["kv_lens"].tolist()
    for b, n in enumerate(lens):
        a, e = starts[b], starts[b + 1]
        if e > a and n > 0:
            result[a:e] = paged_attention_reference(
                q[a:e],
                k,
                v,
                block_tables=kw["block_tables"][b : b + 1],
                kv_lens=kw["kv_lens"][b : b + 1],
                query_start=torch.tensor([0, e - a], dtype=torch.int32, device=q.device),
                q_positions=kw["q_positions"][a:e],
                block_size=kw["block_size"],
                sm_scale=sm_scale,
            )
    return result


def run_checked(q, k, v, kw, record=None, decode=None, tol=None, out=None, **extra):
    """Run the kernel into a NaN-poisoned ``out``, compare with the float64 reference; return (out, err)."""
    if out is None:
        out = torch.full_like(q, float("nan"))
    res = paged_attention(q, k, v, out=out, decode=decode, **kw, **extra)
    assert res is out
    err = rel_err(out, reference(q, k, v, kw, sm_scale=extra.get("sm_scale")))
    if record is not None:
        record("paged_split" if decode else "paged", q.dtype, err)
    assert err < (tol if tol is not None else TOL[q.dtype]), f"relative error {err:.3e}"
    return out, err


# ----------------------------------------------------------------------------------------------------------------
# accuracy against the reference
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("decode", [False, True], ids=["prefill_kernel", "split_kernel"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mixed_batch(layout, dtype, decode, record_error):
    """Cold prefill, suffix prefill, decode, empty sequences in one batch: every head layout x dtype x kernel."""
    Hq, Hkv, D, bs = LAYOUTS[layout]
    seed = 10 * list(LAYOUTS).index(layout) + DTYPES.index(dtype)
    q, k, v, kw = make_batch(MIXED, Hq, Hkv, D, bs, dtype, seed)
    out, _ = run_checked(q, k, v, kw, record_error, decode=decode)
    assert torch.count_nonzero(out[20 + 7 + 1 : 20 + 7 + 1 + 2]) == 0  # the sequence without keys


@pytest.mark.parametrize("decode", [None, False], ids=["auto", "prefill_kernel"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_decode_batch(dtype, decode, record_error):
    """A decode-only batch (1..4 queries per sequence): the decode path (auto) and the prefill kernel forced."""
    i = DTYPES.index(dtype) + 3 * (decode is None)
    Hq, Hkv, D, bs = LAYOUTS[list(LAYOUTS)[i % 3]]
    q, k, v, kw = make_batch(DECODE, Hq, Hkv, D, bs, dtype, seed=100 + i)
    assert choose_path(len(DECODE), Hq, Hkv, 4, 50, pa._num_sms(DEVICE)) == "decode"
    run_checked(q, k, v, kw, record_error, decode=decode)


def cacheblend_positions(seed):
    """Sequences whose queries are a subset of their positions (CacheBlend's recomputed rows plus new tokens),
    unsorted; one also has a query positioned before every key (-3: zeros) and one past kv_len."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(17, 61), (9, 40), (1, 23)]
    pos0 = torch.cat([torch.randperm(55, generator=g)[:13], torch.arange(57, 61)])  # 13 selected + 4 new tokens
    pos0 = pos0[torch.randperm(17, generator=g)].tolist()
    pos1 = torch.randperm(40, generator=g)[:9].sort().values.tolist()  # a sorted subset
    pos1[0] = -3
    return seqs, [pos0, pos1, [30]]


@pytest.mark.parametrize("decode", [False, True], ids=["prefill_kernel", "split_kernel"])
@pytest.mark.parametrize("layout", ["gqa3_d80_bs16", "gqa4_d64_bs32"])
def test_position_subsets(layout, decode, record_error):
    """Queries at arbitrary (unsorted, sparse, negative, past-the-end) positions: causal block skipping must use
    each tile's largest position and unmasked tiles its smallest."""
    Hq, Hkv, D, bs = LAYOUTS[layout]
    i = 2 * (layout == "gqa4_d64_bs32") + decode
    seqs, positions = cacheblend_positions(seed=i)
    q, k, v, kw = make_batch(seqs, Hq, Hkv, D, bs, DTYPES[i % 3], seed=200 + i, positions=positions)
    out, _ = run_checked(q, k, v, kw, record_error, decode=decode)
    assert torch.count_nonzero(out[17]) == 0  # position -3 sees nothing


@pytest.mark.parametrize("decode", [False, True], ids=["prefill_kernel", "split_kernel"])
@pytest.mark.parametrize("block_size", [8, 24])
def test_key_tiles_spanning_blocks(block_size, decode, record_error):
    """Block sizes smaller than the 16-key tile (one tile = two blocks) and not dividing it (24): the per-key
    block-id gather instead of the one-block tile."""
    q, k, v, kw = make_batch([(13, 50), (1, 33), (6, 6)], 4, 2, 64, block_size, torch.float16, seed=block_size)
    run_checked(q, k, v, kw, record_error, decode=decode)


@pytest.mark.parametrize("D, dtype", [(256, torch.float32), (48, torch.bfloat16), (8, torch.float16)])
def test_head_dims(D, dtype, record_error):
    """The largest head dim, and small ones padded to the 16-lane minimum of tl.dot; both kernels."""
    q, k, v, kw = make_batch([(5, 21), (1, 30)], 4, 2, D, 16, dtype, seed=D)
    run_checked(q, k, v, kw, record_error, decode=False)
    run_checked(q, k, v, kw, record_error, decode=True, sm_scale=0.3)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill_kernel", "split_kernel"])
def test_strided_views(decode, record_error):
    """q as the [T, Hq, D] view of a [Hq, T, D] tensor, a pool in [S, Hkv, D] layout seen transposed, a block
    table that is a column slice, and out a slice of a wider buffer: every stride is honoured."""
    q, k, v, kw = make_batch([(9, 30), (1, 40)], 6, 2, 64, 16, torch.float32, seed=7, pool_layout="slots_first")
    assert not k.is_contiguous()
    q = q.transpose(0, 1).contiguous().transpose(0, 1)
    wide = torch.full((kw["block_tables"].shape[0], 9), 12345, dtype=torch.int32, device=DEVICE)
    wide[:, 2 : 2 + kw["block_tables"].shape[1]] = kw["block_tables"]
    kw["block_tables"] = wide[:, 2:]
    buf = torch.full((q.shape[0], q.shape[1], 80), float("nan"), device=DEVICE)
    _out, _ = run_checked(q, k, v, kw, record_error, decode=decode, out=buf[:, :, 8:72])
    assert torch.isnan(buf[:, :, :8]).all() and torch.isnan(buf[:, :, 72:]).all()  # nothing outside out written


def test_single_split_writes_output_directly(record_error):
    """Decode over at most one split (16 keys under the interpreter): no partials, no reduce kernel."""
    q, k, v, kw = make_batch([(1, 16), (2, 9), (1, 3)], 8, 2, 64, 16, torch.bfloat16, seed=3)
    run_checked(q, k, v, kw, record_error, decode=None)


@pytest.mark.parametrize("decode", [False, True], ids=["prefill_kernel", "split_kernel"])
def test_int64_index_variant(decode, monkeypatch, record_error):
    """The 64-bit slot-offset variant (selected for huge pools) computes the same thing."""
    monkeypatch.setattr(pa, "_needs_int64_index", lambda *tensors: True)
    q, k, v, kw = make_batch([(5, 35), (1, 20)], 4, 2, 64, 16, torch.float16, seed=int(decode))
    run_checked(q, k, v, kw, record_error, decode=decode)


def test_needs_int64_index_from_strides():
    """The int64 decision looks at q/out and at one KV head of the pool (head offsets are always 64-bit)."""
    q = torch.empty(4, 2, 8)
    assert not pa._needs_int64_index(q, torch.empty(2, 16, 8), torch.empty(2, 16, 8), q)
    huge = torch.empty((2, 2**28 + 1, 8), device="meta")  # > 2^31 elements per head (meta: no storage)
    assert pa._needs_int64_index(q, huge, huge, q)
    assert pa._needs_int64_index(torch.empty((2**24 + 1, 16, 8), device="meta"), huge[:, :4], huge[:, :4], q)


# ----------------------------------------------------------------------------------------------------------------
# CUDA-graph safety: the hinted call reads no device value
# ----------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def no_device_reads():
    """Inside, every way of reading a tensor's value on the host raises (as a read would break a CUDA graph
    capture).  The Triton interpreter copies kernel arguments through storages, not through these methods."""

    def forbid(name):
        def raiser(*args, **kwargs):
            raise AssertionError(f"device read: {name}")

        return raiser

    with pytest.MonkeyPatch.context() as mp:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
            mp.setattr(torch.Tensor, name, forbid(f"Tensor.{name}"))
        mp.setattr(torch.cuda, "synchronize", forbid("torch.cuda.synchronize"))
        yield


@pytest.mark.parametrize("decode", [None, False, True], ids=["auto", "prefill_kernel", "split_kernel"])
def test_hinted_call_reads_no_device_value(decode, record_error):
    """With max_q_len / max_kv_len (here loose upper bounds, as an engine's capture sizes are) the launch and
    validation never read a device value, and the result is still right."""
    q, k, v, kw = make_batch([(3, 40), (1, 17), (0, 5)], 6, 2, 64, 16, torch.float16, seed=11)
    out = torch.full_like(q, float("nan"))
    with no_device_reads():
        paged_attention(q, k, v, out=out, decode=decode, max_q_len=4, max_kv_len=64, **kw)
    err = rel_err(out, reference(q, k, v, kw))
    record_error("paged_hinted", q.dtype, err)
    assert err < TOL[q.dtype]
    with no_device_reads(), pytest.raises(AssertionError, match="device read"):  # the guard works
        paged_attention(q, k, v, out=out, decode=decode, **kw)


def record_split_grids(monkeypatch) -> list:
    """The grids the split kernel is launched with from now on (the launches still run)."""
    grids = []
    real_split = pa._paged_split_kernel

    class Recorder:
        def __getitem__(self, grid):
            grids.append(grid)
            return real_split[grid]

    monkeypatch.setattr(pa, "_paged_split_kernel", Recorder())
    return grids


def test_hinted_grid_and_scratch_depend_on_shapes_only(monkeypatch):
    """Two batches of the same shapes and hints but different lengths launch identical grids and scratch sizes."""
    launches = []
    real = pa._launch

    def spy(*args, **kwargs):
        launches.append(args[8:])  # block_size, scale, max_q_len, max_kv_len, path
        return real(*args, **kwargs)

    monkeypatch.setattr(pa, "_launch", spy)
    grids = record_split_grids(monkeypatch)
    for seqs in ([(1, 40), (1, 3)], [(1, 9), (1, 2)]):
        q, k, v, kw = make_batch(seqs, 4, 2, 64, 16, torch.float32, seed=1)
        paged_attention(q, k, v, max_q_len=1, max_kv_len=48, **kw)
    assert grids[0] == grids[1]
    if is_interpreter():
        assert grids[0][1] == 3  # 48 keys in 16-key splits (a GPU uses one split for so few keys)
    assert launches[0] == launches[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_dynamic_splits_spread_each_sequence_over_the_splits(dtype, monkeypatch, record_error):
    """``dynamic_splits=True`` (what CUDA graphs use: the bound is the context window, the sequences far shorter):
    one and two query rows per sequence, lengths from 1 key to past the bound's first split, a bound many times
    the longest; right against the reference, without reading a device value, on a grid of the bound's splits;
    a sequence longer than the splits' count times the minimum split (one tile) is covered by longer splits (the
    split length is the sequence's own: with the minimum for every sequence its keys past 64 tiles would be lost)."""
    seqs = [(1, 1), (1, 17), (2, 70), (1, 33), (1, 130), (1, 1500 if is_interpreter() else 5000)]
    q, k, v, kw = make_batch(seqs, 6, 2, 32, 16, dtype, seed=31)
    grids = record_split_grids(monkeypatch)
    out = torch.full_like(q, float("nan"))
    with no_device_reads():
        paged_attention(q, k, v, out=out, max_q_len=2, max_kv_len=8192, dynamic_splits=True, **kw)
    err = rel_err(out, reference(q, k, v, kw))
    record_error("paged_dynamic", q.dtype, err)
    assert err < TOL[q.dtype]
    assert grids[0][1] == 64  # min(_MAX_SPLITS, bound / one tile): the grid depends on the bound only


@pytest.mark.skipif(not torch.cuda.is_available() or is_interpreter(), reason="needs compiled kernels on CUDA")
@pytest.mark.parametrize("decode", [None, False, True], ids=["auto", "prefill_kernel", "split_kernel"])
def test_cuda_graph_capture_and_replay(decode, record_error):
    """The hinted call captured in a CUDA graph, replayed after new lengths and positions were copied into the
    captured index tensors: the replay computes the new batch."""
    seqs = [(3, 70), (1, 45), (2, 33)]
    q, k, v, kw = make_batch(seqs, 6, 2, 64, 16, torch.bfloat16, seed=21)
    out = torch.empty_like(q)
    hints = {"max_q_len": 3, "max_kv_len": 80, "decode": decode}
    paged_attention(q, k, v, out=out, **hints, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_attention(q, k, v, out=out, **hints, **kw)
    g = torch.Generator().manual_seed(4)
    kw["kv_lens"].copy_(torch.tensor([61, 1, 20], dtype=torch.int32))  # <= the original lengths: finite slots
    kw["q_positions"].copy_(torch.tensor([60, 3, 59, 0, 19, 7], dtype=torch.int32))
    q.copy_(torch.randn(q.shape, generator=g).to(q.dtype))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    err = rel_err(out, reference(q, k, v, kw))
    record_error("paged_graph", q.dtype, err)
    assert err < TOL[q.dtype]


# ----------------------------------------------------------------------------------------------------------------
# path choice, split sizing, warm-up
# ----------------------------------------------------------------------------------------------------------------


def test_choose_path():
    """Decode for <= DECODE_MAX_Q queries; the split kernel for a short prefill over a long cache that would leave
    the GPU idle; the prefill kernel otherwise (and always on CPU, where num_sms is 1)."""
    h100 = 132
    assert choose_path(64, 12, 2, 1, 16384, h100) == "decode"
    assert choose_path(1, 28, 4, DECODE_MAX_Q, 10, 1) == "decode"
    assert choose_path(1, 12, 2, 256, 8448, h100) == "split"  # 24 row tiles of 128 over 8k keys
    assert choose_path(1, 12, 2, 256, SPLIT_MIN_KEYS - 1, h100) == "prefill"  # short keys: no split
    assert choose_path(4, 28, 4, 2048, 10240, h100) == "prefill"  # a full grid
    assert choose_path(1, 12, 2, 256, 8448, 1) == "prefill"


def test_split_plan_on_gpu(monkeypatch):
    """GPU split sizing: aligned to the largest key tile, bounded splits, about two waves of programs, and a
    pure function of its integer arguments."""
    monkeypatch.setattr(pa, "is_interpreter", lambda: False)
    monkeypatch.setattr(pa, "_num_sms", lambda device: 132)
    dev = torch.device("cuda")
    for kv in (1, 100, 1024, 4096, 16384, 10**6):
        for programs in (2, 16, 256, 4096):
            split_len, n = pa._split_plan(64 * 28, programs, kv, 128, True, dev)
            assert split_len % pa._GPU_SPLIT_ALIGN == 0 and 1 <= n <= pa._MAX_SPLITS
            assert (n - 1) * split_len < kv <= n * split_len or kv == 1
    assert pa._split_plan(28, 4, 16384, 128, True, dev)[1] > 16  # batch 1 decode: many splits
    assert pa._split_plan(64 * 28, 64 * 4, 16384, 128, True, dev)[1] == 2  # batch 64 fills the GPU already
    assert pa._split_plan(28, 4, 300, 128, True, dev)[1] == 2  # min split length (256 keys)


def test_warmup_shapes_and_noop_without_gpu():
    shapes = warmup_shapes(100)
    assert {kv for _, kv, _ in shapes} == {2**i for i in range(8)}
    assert {q for q, kv, p in shapes if kv == 64 and p == "decode"} == set(range(1, DECODE_MAX_Q + 1))
    assert (64, 128, "split") in shapes and (8, 8, "prefill") in shapes and all(q <= kv for q, kv, _ in shapes)
    if is_interpreter() or DEVICE.type != "cuda":
        assert (
            autotune_warmup(num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16, device=DEVICE, max_len=64)
            == 0
        )


@pytest.mark.parametrize("path", ["prefill", "decode", "split"])
def test_autotuned_launch_paths(path, monkeypatch, record_error):
    """The GPU launch code with every config of the autotuned kernel's list (fp16, GPU tile sizes): its grid
    functions, config pruning and split alignment.  Under the interpreter, the timer is a CPU clock and
    is_interpreter() answers False for the launch."""
    import time

    benched = []

    def cpu_bench(kernel_call, quantiles):
        benched.append(1)
        start = time.perf_counter()
        kernel_call()
        return [time.perf_counter() - start] * len(quantiles)

    monkeypatch.setattr(pa, "AUTOTUNE", True)
    monkeypatch.setattr(pa, "_tune_bench", cpu_bench)
    monkeypatch.setattr(pa, "_autotuned", {})
    seqs = {"prefill": [(9, 40), (3, 20)], "decode": [(1, 300), (2, 77)], "split": [(9, 300), (3, 20)]}[path]
    q, k, v, kw = make_batch(seqs, 4, 2, 64, 16, torch.float16, seed=5)
    out = torch.full_like(q, float("nan"))
    scale, tables, lens, starts, pos = pa._validate(
        q, k, v, kw["block_tables"], kw["kv_lens"], kw["query_start"], kw["q_positions"], 16, None, out, None, None
    )
    max_q, max_kv = max(s[0] for s in seqs), max(s[1] for s in seqs)
    if is_interpreter():
        monkeypatch.setattr(pa, "is_interpreter", lambda: False)
    pa._launch(
        q,
        k,
        v,
        out,
        tables,
        lens,
        starts,
        pos,
        16,
        scale,
        max_q,
        max_kv,
        path,
        num_splits=3 if path != "prefill" else None,
    )
    name = "prefill" if path == "prefill" else "split"
    assert len(pa._autotuned[name].cache) == 1  # tuned once for this key ...
    assert len(benched) > 1  # ... over several configs
    monkeypatch.undo()
    err = rel_err(out, reference(q, k, v, kw))
    record_error("paged_gpu_cfg", q.dtype, err)
    assert err < TOL[q.dtype]


# ----------------------------------------------------------------------------------------------------------------
# the checks themselves can fail
# ----------------------------------------------------------------------------------------------------------------


def test_error_metric_detects_wrong_output():
    """The metric flags a NaN, a perturbation just above tolerance, and off-by-one masks / a wrong block table
    (these errors are far above the tolerances, so a kernel making them fails the tests above)."""
    seqs = [(7, 45), (1, 37)]
    q, k, v, kw = make_batch(seqs, 4, 2, 64, 16, torch.float32, seed=9)
    out, err = run_checked(q, k, v, kw)
    ref = reference(q, k, v, kw)
    bad = out.clone()
    bad[3, 1, 5] += 2 * TOL[torch.float32] * ref.abs().max()
    assert rel_err(bad, ref) > TOL[torch.float32] > err
    bad[3, 1, 5] = float("nan")
    assert rel_err(bad, ref) == math.inf
    swapped = kw["block_tables"].clone()
    swapped[0, 0] = kw["block_tables"][1, 1]  # another sequence's block
    # Masks off by one: a query seeing one key too few (j < pos), keys cut one short of kv_len, the suffix
    # queries seeing the whole sequence; and reading a wrong block.
    wrongs = [
        {"q_positions": kw["q_positions"] - 1},
        {"kv_lens": kw["kv_lens"] - 1},
        {"q_positions": torch.full_like(kw["q_positions"], 10**6)},
        {"block_tables": swapped},
    ]
    for wrong in wrongs:
        assert rel_err(reference(q, k, v, {**kw, **wrong}), ref) > 1e-2


# ----------------------------------------------------------------------------------------------------------------
# input validation
# ----------------------------------------------------------------------------------------------------------------


def _bad_cases():
    q, k, v, kw = make_batch([(3, 20), (1, 9)], 4, 2, 64, 16, torch.float16, seed=0)
    i32 = {"dtype": torch.int32, "device": DEVICE}
    return {
        # (exception, overrides)
        "q_2d": (ValueError, {"q": q[0]}),
        "k_4d": (ValueError, {"k_cache": k[None]}),
        "kv_shape_mismatch": (ValueError, {"v_cache": v[:, :16]}),
        "head_dim_mismatch": (ValueError, {"k_cache": k[..., :32], "v_cache": v[..., :32]}),
        "head_dim_too_big": (
            ValueError,
            {"q": q.new_zeros(4, 4, 512), "k_cache": k.new_zeros(2, 64, 512), "v_cache": v.new_zeros(2, 64, 512)},
        ),
        "hq_not_multiple": (ValueError, {"q": q[:, :3]}),
        "block_size_not_dividing": (ValueError, {"block_size": 7}),
        "block_size_not_int": (ValueError, {"block_size": 16.0}),
        "dtype_mismatch": (TypeError, {"k_cache": k.float()}),
        "unsupported_dtype": (TypeError, {"q": q.double(), "k_cache": k.double(), "v_cache": v.double()}),
        "not_a_tensor": (TypeError, {"q": q.tolist()}),
        "table_int64": (TypeError, {"block_tables": kw["block_tables"].long()}),
        "positions_float": (TypeError, {"q_positions": kw["q_positions"].float()}),
        "table_1d": (ValueError, {"block_tables": kw["block_tables"][0]}),
        "kv_lens_shape": (ValueError, {"kv_lens": torch.zeros(3, **i32)}),
        "query_start_shape": (ValueError, {"query_start": torch.zeros(2, **i32)}),
        "positions_shape": (ValueError, {"q_positions": torch.zeros(3, **i32)}),
        "out_shape": (ValueError, {"out": q.new_empty(4, 4, 32)}),
        "out_dtype": (TypeError, {"out": q.float()}),
        "sm_scale_nan": (ValueError, {"sm_scale": float("nan")}),
        "hint_negative": (ValueError, {"max_q_len": -1, "max_kv_len": 4}),
        "device_mismatch": (ValueError, {"k_cache": k.to("meta"), "v_cache": v.to("meta")}),
        "index_device_mismatch": (ValueError, {"kv_lens": kw["kv_lens"].to("meta")}),
        # index values: checked only without hints (one device read)
        "query_start_not_ending_at_T": (ValueError, {"query_start": torch.tensor([0, 3, 3], **i32)}),
        "query_start_going_back": (ValueError, {"query_start": torch.tensor([0, 5, 4], **i32)}),
        "kv_len_past_table": (ValueError, {"kv_lens": torch.tensor([20, 9999], **i32)}),
        "block_id_outside_pool": (
            ValueError,
            {"block_tables": torch.where(kw["block_tables"] == kw["block_tables"][0, 0], 10**6, kw["block_tables"])},
        ),
    }


@pytest.mark.parametrize("case", list(_bad_cases()))
def test_invalid_inputs_raise(case):
    q, k, v, kw = make_batch([(3, 20), (1, 9)], 4, 2, 64, 16, torch.float16, seed=0)
    exc, over = _bad_cases()[case]
    args = dict(q=q, k_cache=k, v_cache=v, **kw)
    args.update(over)
    with pytest.raises(exc, match="paged_attention"):
        paged_attention(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), **args)


def test_empty_inputs():
    """No query rows: an empty output; no key anywhere (kv_lens all 0, or max_kv_len = 0): zeros."""
    q, k, v, kw = make_batch([(0, 20), (0, 9)], 4, 2, 64, 16, torch.float32, seed=0)
    assert paged_attention(q, k, v, **kw).shape == (0, 4, 64)
    q, k, v, kw = make_batch([(3, 20), (1, 9)], 4, 2, 64, 16, torch.float32, seed=0)
    kw["kv_lens"] = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out = paged_attention(q, k, v, out=torch.full_like(q, float("nan")), **kw)
    assert torch.count_nonzero(out) == 0
