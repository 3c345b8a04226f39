"""A tiny random llama engine whose KV pool holds an exact number of blocks: the regression tests of the pool's
edges (``tests/test_seam_defects.py``, ``tests/test_engine_defects.py``) size their pools with it."""

from __future__ import annotations

import pytest
import torch

from kvboost_testkit.tiny import make_engine

BLOCK = 16  # tokens per block (the pool's default) and per chunk (make_engine's fixed chunker)


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: one intra-op thread (two spin on barriers when the machine is loaded, 10-40x slower).
    Autouse in every test module that imports it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def block_bytes(layers: int = 2) -> int:
    """Bytes of one pool block of the tiny llama (K and V, 2 KV heads of 16 dims, fp32, 16 tokens)."""
    return 2 * layers * 2 * BLOCK * 16 * 4


def pool_engine(blocks: int, layers: int = 2, *, eos: bool = True, **options):
    """An eager engine on the tiny llama whose KV pool holds exactly ``blocks`` blocks. ``eos=False``: no token
    ends a request early (a random model may sample EOS), so every request decodes its ``max_new_tokens``."""
    options.setdefault("decode", "eager")
    engine = make_engine("llama", layers=layers, kv={"pool_bytes": block_bytes(layers) * blocks}, **options)
    assert engine.pool.block_bytes == block_bytes(layers) and engine.pool.num_blocks == blocks
    if not eos:
        engine.eos_ids = set()
    return engine
