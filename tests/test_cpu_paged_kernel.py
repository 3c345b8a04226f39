"""The C++ CPU kernel's paged entry point (``cpu_paged_attention_forward``) against the paged contract's plain-torch
reference (``kvboost/kernels_triton/paged_attention_reference.py``), its errors, and the dense ``forward`` next to it.

Batches mix what a paged engine sends in one call: a cold prefill, a suffix prefill over cached blocks, decode
rows, a sequence with no query, a sequence with no key, subsets of positions in any order (CacheBlend's selected
rows). Block tables are random permutations of the pool, some blocks shared between sequences; every pool slot no
sequence owns is NaN and table entries past a sequence's blocks are garbage, so a read outside the contract shows
up as NaN or an error. Both code paths run: the direct (streaming) path for units of <= 48 rows (G heads x tile
queries), split in parts of 512 keys past that many keys, and the GEMM path over a gathered copy for larger
units (tile sizes pick which).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvboost.kernels_triton.flash_attn_reference import flash_attn_reference
from kvboost.kernels_triton.paged_attention_reference import paged_attention_reference, slots_of
from kvboost.attention.cpu_ext import (
    cpu_attention_forward,
    cpu_extension_unavailable_reason,
    cpu_paged_attention_forward,
)

pytestmark = pytest.mark.skipif(
    cpu_extension_unavailable_reason() is not None,
    reason=f"cpu_kernel unavailable: {cpu_extension_unavailable_reason()}",
)

#: Largest error allowed, relative to the largest output magnitude of the reference.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}

#: A mixed batch: (kv_len, positions of its queries). Lengths are not multiples of 16 or 32.
MIXED = [
    (57, list(range(57))),  # cold prefill: every position, causal
    (70, list(range(45, 70))),  # suffix prefill over 45 cached keys
    (45, [44]),  # decode
    (20, []),  # no query this step
    (83, [82]),  # decode over several blocks
    (61, [60, 3, 40, 12, 0, 33, 59, 7, 100]),  # a subset, unsorted; position 100 > kv_len sees every key
    (0, [5]),  # no key yet: zeros
    (1, [0]),  # one key
]


def make_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, seed=0, share=True, pool_layout="hsd"):
    """Inputs of the paged contract for ``seqs`` [(kv_len, positions)], as a dict of keyword arguments.

    Blocks are drawn from a shuffled pool with spare blocks; with ``share`` sequence 1 starts with sequence 0's
    first block (a shared prefix block). Pool slots that no sequence owns are NaN and block-table entries past
    a sequence's blocks are -1 (never read by the contract). ``pool_layout`` "shd" makes k_cache / v_cache
    [Hkv, S, D] views of [S, Hkv, D] storage (slot stride Hkv * D: a block's rows are not one run in memory).
    """
    gen = torch.Generator().manual_seed(seed)
    need = [math.ceil(n / block_size) for n, _ in seqs]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need + [1]) + 2
    tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    taken = 0
    for b, count in enumerate(need):
        ids = perm[taken : taken + count]
        taken += count
        if share and b == 1 and need[0] and count:
            ids[0] = tables[0, 0].item()  # a prefix block both sequences read
        tables[b, :count] = torch.tensor(ids, dtype=torch.int32)
    slots = num_blocks * block_size
    if pool_layout == "shd":
        k = torch.randn(slots, kv_heads, head_dim, generator=gen).transpose(0, 1)
        v = torch.randn(slots, kv_heads, 2 * head_dim, generator=gen)[..., head_dim:].transpose(0, 1)
    else:
        k = torch.randn(kv_heads, slots, head_dim, generator=gen)
        v = torch.randn(kv_heads, slots, head_dim, generator=gen)
    owned = torch.zeros(slots, dtype=torch.bool)
    for b, (n, _) in enumerate(seqs):
        owned[slots_of(tables[b].clamp(min=0), n, block_size)] = True
    k[:, ~owned], v[:, ~owned] = float("nan"), float("nan")
    positions = [p for _, ps in seqs for p in ps]
    starts = [0]
    for _, ps in seqs:
        starts.append(starts[-1] + len(ps))
    q = torch.randn(len(positions), heads, head_dim, generator=gen)
    return {
        "q": q.to(dtype),
        "k_cache": k.to(dtype) if pool_layout != "shd" else _same_layout(k, dtype),
        "v_cache": v.to(dtype) if pool_layout != "shd" else _same_layout(v, dtype),
        "block_tables": tables,
        "kv_lens": torch.tensor([n for n, _ in seqs], dtype=torch.int32),
        "query_start": torch.tensor(starts, dtype=torch.int32),
        "q_positions": torch.tensor(positions, dtype=torch.int32),
        "block_size": block_size,
    }


def _same_layout(view: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``view`` in ``dtype`` keeping its strides ([Hkv, S, D] over [S, Hkv, D'] storage)."""
    converted = torch.empty_strided(view.shape, view.stride(), dtype=dtype)
    converted.copy_(view)
    return converted


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.float().abs().max().item()
    return (got.float() - expected.float()).abs().max().item() / max(scale, 1e-6)


def reference(inputs, sm_scale=None) -> torch.Tensor:
    """The contract's reference, one sequence at a time; a sequence without keys gets zeros here (the reference's
    masked softmax has no key to reduce over when ``kv_lens[b] == 0``)."""
    q = inputs["q"]
    expected = torch.zeros(q.shape, dtype=torch.float32)
    starts = inputs["query_start"].tolist()
    for b, n in enumerate(inputs["kv_lens"].tolist()):
        a, e = starts[b], starts[b + 1]
        if n == 0 or e == a:
            continue
        expected[a:e] = paged_attention_reference(
            q[a:e], inputs["k_cache"], inputs["v_cache"], block_tables=inputs["block_tables"][b : b + 1],
            kv_lens=inputs["kv_lens"][b : b + 1], query_start=torch.tensor([0, e - a], dtype=torch.int32),
            q_positions=inputs["q_positions"][a:e], block_size=inputs["block_size"], sm_scale=sm_scale,
        ).float()  # fmt: skip
    return expected


def run_and_check(inputs, dtype, **kwargs):
    """The kernel on ``inputs`` (into a NaN-poisoned ``out``) against the reference; returns the output."""
    q = inputs["q"]
    out = kwargs.pop("out", None)
    if out is None:
        out = torch.full(q.shape, float("nan"), dtype=dtype)
    got = cpu_paged_attention_forward(**inputs, out=out, **kwargs)
    assert got is out and got.dtype == dtype and got.shape == q.shape
    assert not torch.isnan(got).any()
    expected = reference(inputs, kwargs.get("sm_scale"))
    err = relative_error(got, expected)
    assert err < TOL[dtype], err
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (4, 1), (2, 2)])
@pytest.mark.parametrize("head_dim", [64, 48])
def test_mixed_batch_matches_reference(dtype, block_size, heads, kv_heads, head_dim):
    inputs = make_batch(MIXED, heads, kv_heads, head_dim, block_size, dtype, seed=heads + head_dim)
    # tile 64: the prefills' units run on the GEMM path (57 x G > 48 rows), decode rows on the direct path;
    # tile 2: every unit (<= 8 rows) on the direct path.
    for tile in (64, 2):
        got = run_and_check(inputs, dtype, tile=tile)
        # The query of the sequence with no key gets exact zeros.
        empty_row = sum(len(ps) for _, ps in MIXED[:6])
        assert torch.count_nonzero(got[empty_row]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_odd_head_dim_strided_pool_q_and_out(dtype):
    """D = 20 (a scalar tail after the vector lanes), a pool laid out [S, Hkv, D] viewed as [Hkv, S, D], q a
    view with a row stride wider than Hq * D, ``out`` a transposed view, and an explicit sm_scale."""
    inputs = make_batch(MIXED, 6, 2, 20, 16, dtype, seed=5, pool_layout="shd")
    assert inputs["k_cache"].stride(1) == 2 * 20
    q = inputs["q"]
    wide = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2]).to(dtype)
    wide[..., :20] = q
    inputs["q"] = wide[..., :20]
    storage = torch.full((q.shape[1], q.shape[0], q.shape[2]), float("nan"), dtype=dtype)
    out = storage.transpose(0, 1)
    for tile in (32, 1):
        storage.fill_(float("nan"))
        got = run_and_check(inputs, dtype, out=out, tile=tile, sm_scale=0.3)
        assert got.data_ptr() == storage.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_batch_over_many_blocks(dtype):
    """Decode-shaped: one query per sequence over hundreds of keys (the direct path across many blocks; 517 and
    1100 keys: in 2 and 3 parts), and a GQA group of 64 heads (64 rows > 48: the GEMM path)."""
    seqs = [(n, [n - 1]) for n in (300, 129, 517, 64, 1, 1100)]
    for heads, kv_heads in ((9, 3), (8, 1), (64, 1)):
        run_and_check(make_batch(seqs, heads, kv_heads, 64, 16, dtype, seed=heads), dtype)


def test_long_prefill_in_many_tiles_and_a_small_tile():
    """A 300-query cold prefill and a 150-query suffix over 400 keys: many GEMM-path units of different cost
    (scheduled largest first); the same batch with tile 3 (9-row units: the direct path) and tiles 1000 and
    2**30 (one unit per sequence and KV head; scratch sized by the queries, not the tile)."""
    seqs = [(300, list(range(300))), (400, list(range(250, 400))), (90, [89])]
    inputs = make_batch(seqs, 9, 3, 64, 16, torch.float32, seed=7)
    for tile in (32, 3, 1000, 1 << 30):
        run_and_check(inputs, torch.float32, tile=tile)


def test_a_sequence_gives_the_same_rows_alone_and_batched():
    """Every unit runs alone on one thread, so a sequence's output does not depend on the rest of the batch."""
    inputs = make_batch(MIXED, 9, 3, 64, 16, torch.float32, seed=3)
    batched = cpu_paged_attention_forward(**inputs)
    starts = inputs["query_start"].tolist()
    for b in (1, 4, 5):
        a, e = starts[b], starts[b + 1]
        alone = cpu_paged_attention_forward(
            inputs["q"][a:e], inputs["k_cache"], inputs["v_cache"],
            block_tables=inputs["block_tables"][b : b + 1], kv_lens=inputs["kv_lens"][b : b + 1],
            query_start=torch.tensor([0, e - a], dtype=torch.int32), q_positions=inputs["q_positions"][a:e],
            block_size=16,
        )  # fmt: skip
        assert torch.equal(alone, batched[a:e]), b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_units_and_row_invariance(dtype):
    """Direct-path units over more than 512 keys run in parts merged at the end: long decodes, and short tiles
    whose rows see different numbers of parts (position 5 sees one, 1799 four). A row's bits do not depend on
    the other rows of its tile: each query computed alone gives the same output, bit for bit."""
    seqs = [(1300, [1299]), (1800, [5, 1799, 600, 1023, 1024]), (513, [512]), (40, [39])]
    inputs = make_batch(seqs, 9, 3, 64, 16, dtype, seed=11)
    for tile in (32, 2):
        got = run_and_check(inputs, dtype, tile=tile)
        for row, position in ((1, 5), (2, 1799), (3, 600), (5, 1024)):
            alone = cpu_paged_attention_forward(
                inputs["q"][row : row + 1], inputs["k_cache"], inputs["v_cache"],
                block_tables=inputs["block_tables"][1:2], kv_lens=inputs["kv_lens"][1:2],
                query_start=torch.tensor([0, 1], dtype=torch.int32),
                q_positions=torch.tensor([position], dtype=torch.int32), block_size=16,
            )  # fmt: skip
            assert torch.equal(alone[0], got[row]), (tile, position)


def test_no_queries_at_all():
    inputs = make_batch([(20, []), (5, [])], 4, 2, 16, 16, torch.float32)
    assert cpu_paged_attention_forward(**inputs).shape == (0, 4, 16)


def _bad(**changes):
    inputs = make_batch([(40, [39]), (20, list(range(10, 20)))], 4, 2, 16, 16, torch.float32, share=False)
    inputs.update(changes)
    return inputs


def test_rejects_bad_inputs():
    ok = _bad()
    q, k, tables = ok["q"], ok["k_cache"], ok["block_tables"]
    cases = [
        (TypeError, "float32 or all bfloat16", {"q": q.half(), "k_cache": k.half(), "v_cache": k.half()}),
        (TypeError, "float32 or all bfloat16", {"k_cache": k.bfloat16()}),
        (ValueError, "3-D", {"q": q[0]}),
        (TypeError, "q must be a tensor", {"q": q.tolist()}),
        (ValueError, "q is on meta; this kernel runs on the CPU", {"q": q.to("meta")}),
        (ValueError, "v_cache is on meta", {"v_cache": k.to("meta")}),
        (ValueError, "kv_lens is on meta", {"kv_lens": ok["kv_lens"].to("meta")}),
        (ValueError, "shapes do not match", {"q": torch.randn(q.shape[0], 3, 16)}),  # 3 heads over 2 KV heads
        (ValueError, "shapes do not match", {"v_cache": torch.randn(2, k.shape[1], 8)}),
        (ValueError, "contiguous last dimension", {"k_cache": torch.randn(2, 16, k.shape[1]).transpose(1, 2)}),
        (ValueError, "block_size", {"block_size": 0}),
        (ValueError, "block_size", {"block_size": 7}),  # does not divide the pool's slots
        (TypeError, "block_tables must be int32", {"block_tables": tables.long()}),
        (TypeError, "kv_lens must be an int32 tensor, got list", {"kv_lens": [40, 20]}),
        (TypeError, "q_positions must be int32", {"q_positions": ok["q_positions"].float()}),
        (ValueError, r"block_tables must have shape 2-D", {"block_tables": tables[0]}),
        (ValueError, r"kv_lens must have shape \[2\]", {"kv_lens": torch.tensor([40], dtype=torch.int32)}),
        (ValueError, r"query_start must have shape \[3\]", {"query_start": torch.tensor([0, 11], dtype=torch.int32)}),
        (ValueError, r"q_positions must have shape \[11\]", {"q_positions": torch.zeros(10, dtype=torch.int32)}),
        # Index values, checked by the extension before it reads anything.
        (ValueError, "query_start must run from 0 to T = 11", {"query_start": torch.tensor([0, 1, 10], dtype=torch.int32)}),
        (ValueError, "non-decreasing", {"query_start": torch.tensor([0, 12, 11], dtype=torch.int32)}),
        (ValueError, r"kv_lens\[0\] = 90 is outside", {"kv_lens": torch.tensor([90, 20], dtype=torch.int32)}),
        (ValueError, r"kv_lens\[1\] = -1 is outside", {"kv_lens": torch.tensor([40, -1], dtype=torch.int32)}),
        (ValueError, r"block_tables\[1, 0\] = 99 is not a block", {"block_tables": _with(tables, (1, 0), 99)}),
        (ValueError, r"block_tables\[0, 2\] = -1 is not a block", {"block_tables": _with(tables, (0, 2), -1)}),
    ]  # fmt: skip
    for error, match, changes in cases:
        with pytest.raises(error, match=match):
            cpu_paged_attention_forward(**_bad(**changes))
    with pytest.raises(ValueError, match="tile"):
        cpu_paged_attention_forward(**ok, tile=0)
    with pytest.raises(ValueError, match="out must be"):
        cpu_paged_attention_forward(**ok, out=torch.empty(q.shape[0], 4, 17))
    with pytest.raises(ValueError, match="out must be"):
        cpu_paged_attention_forward(**ok, out=torch.empty(q.shape, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous last dimension"):
        cpu_paged_attention_forward(**ok, out=torch.empty(16, 4, q.shape[0]).permute(2, 1, 0))
    # Entries past a sequence's blocks are not checked (never read): -1 there is fine.
    assert tables[0, 3] == -1
    cpu_paged_attention_forward(**ok)


def _with(t: torch.Tensor, index: tuple[int, int], value: int) -> torch.Tensor:
    t = t.clone()
    t[index] = value
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_forward_still_matches_its_reference(dtype):
    """The dense entry point in the same module (unchanged) against the dense contract's reference."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 9, 13, 64, generator=gen).to(dtype)
    k, v = (torch.randn(2, 3, 77, 64, generator=gen).to(dtype) for _ in range(2))
    kv_len = torch.tensor([77, 50], dtype=torch.int32)
    got = cpu_attention_forward(q, k, v, causal=True, kv_len=kv_len, tile=8)
    expected = flash_attn_reference(q.double(), k.double(), v.double(), causal=True, kv_len=kv_len)
    assert relative_error(got, expected) < TOL[dtype]


def test_benchmark_quick_run(tmp_path):
    """experiments/bench/bench_cpu_paged_attention.py --quick: every row runs, the outputs agree, the report is written."""
    from experiments.bench.bench_cpu_paged_attention import main

    result = main(["--quick", "--threads", str(torch.get_num_threads()), "--out", str(tmp_path)])
    for rows in result["dtypes"].values():
        for row in rows:
            assert max(row["max_rel_error_vs_fp64"].values()) < 2e-2, row
    assert "| batch | keys |" in (tmp_path / "cpu_paged_attention.md").read_text()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_decode_custom_op_follows_the_contract(dtype, compiled):
    """``kvboost::cpu_paged_decode`` (what the compiled CPU decode forward calls): one query per sequence at its
    last position, lengths that differ, a shared prefix block, NaN in every slot no sequence owns; eager and from
    inside a ``torch.compile`` graph that first writes a row into the pool (the op must read the written row)."""
    from kvboost.runtime.cpu_decode_op import cpu_paged_decode  # noqa: F401  (registers the op)

    seqs = [(45, [44]), (83, [82]), (1, [0]), (130, [129])]
    inputs = make_batch(seqs, heads=8, kv_heads=2, head_dim=32, block_size=16, dtype=dtype)
    tables = inputs["block_tables"].clamp(min=0)
    new_key = torch.randn(2, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    slot = int(tables[1, 82 // 16]) * 16 + 82 % 16

    def decode(q, k_cache, v_cache, block_tables, kv_lens):
        k_cache.index_copy_(1, torch.tensor([slot]), new_key[:, None])
        return torch.ops.kvboost.cpu_paged_decode(q, k_cache, v_cache, block_tables, kv_lens, 16, 0.125)

    fn = torch.compile(decode, dynamic=True, fullgraph=True) if compiled else decode
    with torch.inference_mode():
        got = fn(inputs["q"], inputs["k_cache"], inputs["v_cache"], tables, inputs["kv_lens"])
    assert inputs["k_cache"][:, slot].equal(new_key)
    want = reference(inputs, sm_scale=0.125)
    assert relative_error(got, want) < TOL[dtype]
