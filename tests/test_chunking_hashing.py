"""Chunkers and hashers: spans, segments, determinism across processes, fingerprints."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kvboost_testkit.tiny import ToyTokenizer

from kvboost.chunking.boundary_window import BoundaryWindowChunker
from kvboost.chunking.fixed import FixedChunker
from kvboost.chunking.separator import SeparatorChunker
from kvboost.hashing.sha256 import Sha256Hasher
from kvboost.types import ChunkSpan


class PairTokenizer(ToyTokenizer):
    """A toy tokenizer whose ids depend on context, like BPE: it merges characters in pairs from the start of the
    text it is given ("abc" -> "ab", "c"), so text tokenized on its own gets other ids than the same text inside a
    longer string that puts it at an odd offset. Ids stay below the tiny models' vocabulary."""

    def __call__(self, text, add_special_tokens: bool = False):
        if isinstance(text, list):
            return {"input_ids": [self(t)["input_ids"] for t in text]}
        pairs = [text[i : i + 2] for i in range(0, len(text), 2)]
        return {"input_ids": [3 + (sum(ord(c) * 131**j for j, c in enumerate(p)) % 125) for p in pairs]}


def test_fixed_chunker_spans():
    spans = FixedChunker(4).split(list(range(10)))
    assert [(s.start, s.end, s.segment_start) for s in spans] == [(0, 4, 0), (4, 8, 0), (8, 10, 0)]
    assert FixedChunker(4).split([]) == []


@pytest.mark.parametrize("bad", [0, -3, 2.5, "8", True])
def test_chunkers_reject_bad_sizes(bad):
    for cls in (FixedChunker, SeparatorChunker, BoundaryWindowChunker):
        with pytest.raises(ValueError, match="chunk_size"):
            cls(chunk_size=bad)


def test_separator_chunker_tokenizes_each_segment_on_its_own():
    tok = ToyTokenizer()
    chunker = SeparatorChunker("\n\n", chunk_size=4)
    ids, spans = chunker.tokenize(tok, "abcdef\n\nxy\n\n\n\nz")
    # pieces "abcdef", "xy", "", "z" and three separators, each its own segment
    assert ids == tok("abcdef\n\nxy\n\n\n\nz")["input_ids"]  # the toy tokenizer is per character
    assert [(s.start, s.end, s.segment_start) for s in spans] == [
        (0, 4, 0), (4, 6, 0), (6, 8, 6), (8, 10, 8), (10, 12, 10), (12, 14, 12), (14, 15, 14),
    ]
    assert chunker.tokenize(tok, "\n\n") == (tok("\n\n")["input_ids"], [ChunkSpan(0, 2, 0)])
    # The per-character tokenizer cannot tell a whole-text tokenization from a per-segment one: a merging one can.
    pair = PairTokenizer()
    text = "abc\n\nxyz\n\nq"
    ids, spans = chunker.tokenize(pair, text)
    pieces = ["abc", "\n\n", "xyz", "\n\n", "q"]
    want = [t for piece in pieces for t in pair(piece)["input_ids"]]
    assert want != pair(text)["input_ids"]  # the tokenizer merges across the boundaries of this text
    assert ids == want
    lengths = [len(pair(piece)["input_ids"]) for piece in pieces]  # 2, 1, 2, 1, 1
    starts = [sum(lengths[:i]) for i in range(len(pieces))]
    assert [(s.start, s.end, s.segment_start) for s in spans] == [
        (a, a + n, a) for a, n in zip(starts, lengths, strict=True)
    ]


def test_separator_chunker_extends_the_last_segment_for_generated_tokens():
    chunker = SeparatorChunker("\n\n", chunk_size=4)
    ids, spans = chunker.tokenize(ToyTokenizer(), "abcdef\n\nxyz")
    longer = ids + [5, 6, 7, 8, 9]
    ext = chunker.extend(longer, spans)
    assert ext[:-2] == spans[:-1]
    assert [(s.start, s.end, s.segment_start) for s in ext[-2:]] == [(8, 12, 8), (12, 16, 8)]


def test_boundary_window_cuts_at_sentence_ends():
    tok = ToyTokenizer()
    chunker = BoundaryWindowChunker(chunk_size=10, window=3)
    chunker.bind_tokenizer(tok)
    text = "aaaaaaaa. bbbbbbbbbbbbb! cccccccccccccccccccccc"
    ids = tok(text)["input_ids"]
    spans = chunker.split(ids)
    # the first cut moves from 10 to 9 (after "."); the "!" at 23 is outside the next windows ([16, 22] around
    # 19, [26, 32] around 29), so those cuts stay at their targets; the last 8 tokens are the last span
    assert [(s.start, s.end) for s in spans] == [(0, 9), (9, 19), (19, 29), (29, 39), (39, 47)]
    assert text[spans[0].end - 1] == "."
    without = BoundaryWindowChunker(chunk_size=10, window=3)  # no tokenizer bound: behaves like fixed
    assert without.split(ids)[0] == ChunkSpan(0, 10)


def test_boundary_window_rejects_a_window_as_large_as_the_chunk():
    with pytest.raises(ValueError, match="window"):
        BoundaryWindowChunker(chunk_size=8, window=8)


def test_prefix_keys_chain_and_segment_keys_restart_at_segments():
    hasher = Sha256Hasher()
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [9, 9, 9, 9, 5, 6, 7, 8]  # same second chunk after another first chunk
    one_segment = [ChunkSpan(0, 4, 0), ChunkSpan(4, 8, 0)]
    two_segments = [ChunkSpan(0, 4, 0), ChunkSpan(4, 8, 4)]
    ka, kb = hasher.chunk_keys(a, one_segment, "fp"), hasher.chunk_keys(b, one_segment, "fp")
    assert ka[1].prefix_key != kb[1].prefix_key and ka[1].segment_key != kb[1].segment_key
    assert ka[1].parent_key == ka[0].prefix_key
    sa, sb = hasher.chunk_keys(a, two_segments, "fp"), hasher.chunk_keys(b, two_segments, "fp")
    assert sa[1].segment_key == sb[1].segment_key  # same segment text, other history
    assert sa[1].prefix_key != sb[1].prefix_key


def test_fingerprint_and_salt_change_every_key():
    hasher, chunker = Sha256Hasher(), FixedChunker(4)
    ids = list(range(12))
    k1 = hasher.chunk_keys(ids, chunker.split(ids), "model-a")
    for k2 in (hasher.chunk_keys(ids, chunker.split(ids), "model-b"), hasher.chunk_keys(ids, chunker.split(ids), "model-a", "t1")):
        for x, y in zip(k1, k2):
            assert x.prefix_key != y.prefix_key and x.segment_key != y.segment_key and x.parent_key != y.parent_key


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
