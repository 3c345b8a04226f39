"""Every attention backend's paged call (``AttentionBackend.paged``) against the paged contract's reference, on
block tables that are not consecutive (gathering backends gather, paged ones read the blocks): cold prefill,
suffix prefill, decode rows and rows at arbitrary positions in one batch; and against the same sequences laid out
in consecutive blocks (a view). Any new backend registered in ``ATTENTION`` runs here unchanged."""

from __future__ import annotations

import math

import pytest
import torch
from kvboost_testkit.tiny import tiny_model

from kvboost.kernels_triton.paged_attention_reference import paged_attention_reference
from kvboost.kv.block_table import BlockTable
from kvboost.kv.pool import KVPool
from kvboost.registry import ATTENTION
from kvboost.runtime.batch import ForwardBatch, SeqInput

HEADS, KV_HEADS, DIM = 4, 2, 16  # the tiny llama's attention shape


def _backend(name: str):
    backend = ATTENTION.build(name)
    try:
        backend.check_available()
    except RuntimeError as exc:
        pytest.skip(f"attention backend {name!r} cannot run here: {exc}")
    model = tiny_model("llama")
    try:
        backend.check_model(model)
    except (ValueError, RuntimeError) as exc:
        pytest.skip(f"attention backend {name!r} refuses the tiny model here: {exc}")
    return backend, model.model.layers[0].self_attn


def _batch(pool: KVPool, scatter: bool) -> ForwardBatch:
    """Three sequences: a cold prefill of 21 rows, a 9-row suffix after 30 cached rows, one decode row after 40;
    their blocks interleaved (``scatter``) or consecutive per sequence."""
    tables = [BlockTable(pool) for _ in range(3)]
    lengths = [21, 39, 41]
    if scatter:  # round-robin block allocation: no sequence's blocks are consecutive
        for step in range(max(pool.blocks_for(n) for n in lengths)):
            for table, n in zip(tables, lengths, strict=True):
                if len(table.blocks) < pool.blocks_for(n):
                    table.blocks += pool.alloc(1)
    else:
        for table, n in zip(tables, lengths, strict=True):
            table.reserve(n)
    gen = torch.Generator().manual_seed(0)
    for table, n in zip(tables, lengths, strict=True):  # every row of every layer holds random K/V
        pool.write(table.slots(0, n), torch.randn(1, KV_HEADS, n, DIM, generator=gen),
                   torch.randn(1, KV_HEADS, n, DIM, generator=gen))  # fmt: skip
    tables[1].length, tables[2].length = 30, 40
    seqs = [SeqInput(tables[0], [1] * 21), SeqInput(tables[1], [1] * 9), SeqInput(tables[2], [1])]
    return ForwardBatch.build(seqs, prepare=False)


def _reference(q: torch.Tensor, pool: KVPool, batch: ForwardBatch, scale: float) -> torch.Tensor:
    args = {k: v for k, v in batch.kernel_args().items() if k not in ("max_q_len", "max_kv_len")}
    return paged_attention_reference(q.double(), pool.keys[0].double(), pool.values[0].double(), sm_scale=scale,
                                     **args).float()  # fmt: skip


@pytest.mark.parametrize("name", sorted(ATTENTION.names()))
@pytest.mark.parametrize("scatter", [True, False], ids=["scattered", "consecutive"])
def test_paged_call_follows_the_contract(name, scatter):
    backend, module = _backend(name)
    pool = KVPool(num_layers=1, num_kv_heads=KV_HEADS, head_dim=DIM, num_blocks=32, block_size=4)
    batch = _batch(pool, scatter)
    assert (batch.pool.run_start(batch.tables[1].blocks, 39) is None) == scatter
    q = torch.randn(batch.num_tokens, HEADS, DIM, generator=torch.Generator().manual_seed(1))
    scale = 1 / math.sqrt(DIM)
    calls = backend.kernel_calls
    with torch.inference_mode():
        out = backend.paged(q, 0, batch, scale, module)
    assert out.shape == (batch.num_tokens, HEADS * DIM)
    want = _reference(q, pool, batch, scale).reshape(batch.num_tokens, -1)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    assert 1 <= backend.kernel_calls - calls <= batch.num_seqs  # each kernel call counted once
    # rows at arbitrary positions (content repair): a subset of the second sequence's prompt, unsorted too
    for positions in ([3, 17, 30, 38], [38, 3, 30, 17]):
        sub = ForwardBatch.build([SeqInput(batch.tables[1], [1] * 4, positions=positions)], prepare=False)
        qs = torch.randn(4, HEADS, DIM, generator=torch.Generator().manual_seed(2))
        with torch.inference_mode():
            got = backend.paged(qs, 0, sub, scale, module)
        torch.testing.assert_close(got, _reference(qs, pool, sub, scale).reshape(4, -1), atol=2e-5, rtol=2e-5)


def test_every_backend_declares_its_capabilities():
    from kvboost.attention.base import Capabilities

    for name in ATTENTION.names():
        caps = ATTENTION.get(name).capabilities
        assert isinstance(caps, Capabilities), name
    assert ATTENTION.get("triton").capabilities.paged and ATTENTION.get("cpu_kernel").capabilities.paged
    assert ATTENTION.get("sdpa").capabilities.exact and ATTENTION.get("sdpa").capabilities.runner_decode
    assert ATTENTION.get("batch_invariant").capabilities.tiled_projections
