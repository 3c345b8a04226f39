"""Chunkers and hashers: spans, determinism across processes, fingerprints."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvboost.chunking.fixed import FixedChunker
from kvboost.hashing.sha256 import Sha256Hasher


def test_fixed_chunker_spans():
    spans = FixedChunker(4).split(list(range(10)))
    assert [(s.start, s.end) for s in spans] == [(0, 4), (4, 8), (8, 10)]
    assert FixedChunker(4).split([]) == []


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8"])
def test_fixed_chunker_rejects_bad_sizes(bad):
    with pytest.raises(ValueError, match="chunk_size"):
        FixedChunker(bad)


def test_prefix_keys_chain_and_content_keys_do_not():
    hasher, chunker = Sha256Hasher(), FixedChunker(4)
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [9, 9, 9, 9, 5, 6, 7, 8]  # same second chunk after another first chunk
    ka = hasher.chunk_keys(a, chunker.split(a), "fp")
    kb = hasher.chunk_keys(b, chunker.split(b), "fp")
    assert ka[1].content_key == kb[1].content_key
    assert ka[1].prefix_key != kb[1].prefix_key
    assert ka[1].parent_key == ka[0].prefix_key


def test_fingerprint_changes_every_key():
    hasher, chunker = Sha256Hasher(), FixedChunker(4)
    ids = list(range(12))
    k1 = hasher.chunk_keys(ids, chunker.split(ids), "model-a")
    k2 = hasher.chunk_keys(ids, chunker.split(ids), "model-b")
    for x, y in zip(k1, k2):
        assert x.prefix_key != y.prefix_key and x.content_key != y.content_key and x.parent_key != y.parent_key


def test_hashes_are_deterministic_across_processes():
    code = (
        "from kvboost.hashing.sha256 import Sha256Hasher; from kvboost.chunking.fixed import FixedChunker;"
        "ids=list(range(100, 170)); print([k.prefix_key for k in Sha256Hasher().chunk_keys(ids, FixedChunker(16).split(ids), 'fp')])"
    )
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout  # fmt: skip
        for seed in (1, 2)
    }
    assert len(outs) == 1
    ids = list(range(100, 170))
    here = [k.prefix_key for k in Sha256Hasher().chunk_keys(ids, FixedChunker(16).split(ids), "fp")]
    assert outs.pop().strip() == str(here)
