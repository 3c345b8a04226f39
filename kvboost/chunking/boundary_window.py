"""Fixed-size chunks whose cuts move up to +-``window`` tokens to the nearest sentence end.

Cutting in the middle of a sentence splits what a later prompt may reuse in pieces that only match together;
cutting at sentence ends makes chunk boundaries follow the text. Which ids end a sentence is read from the
tokenizer (``bind_tokenizer``): a token whose text, stripped of trailing spaces, ends with ``.``, ``!``, ``?``
or contains a newline. Without a tokenizer (ids only) the chunker cuts like ``fixed``.

Prefix stability (the chunker contract): a cut near ``target`` looks at tokens up to ``target + window``; when
the sequence ends before that, the rest becomes the last span instead of guessing, so the spans of a prefix
are the spans of any longer sequence, cut at the prefix's end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvboost.chunking.base import Chunker
from kvboost.chunking.fixed import check_chunk_size
from kvboost.registry import CHUNKERS
from kvboost.types import ChunkSpan

SENTENCE_END_CHARS = (".", "!", "?")


def sentence_end_ids(tokenizer: Any) -> frozenset[int]:
    """Ids whose decoded text ends a sentence (``.``, ``!``, ``?`` at its end, or a newline anywhere)."""
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else int(getattr(tokenizer, "vocab_size", 0))
    texts = tokenizer.batch_decode([[i] for i in range(size)]) if hasattr(tokenizer, "batch_decode") else [
        tokenizer.decode([i]) for i in range(size)
    ]
    return frozenset(i for i, t in enumerate(texts) if "\n" in t or t.rstrip().endswith(SENTENCE_END_CHARS))


@CHUNKERS.register("boundary_window")
class BoundaryWindowChunker(Chunker):
    """Chunks of about ``chunk_size`` tokens, each cut moved by at most ``window`` tokens to a sentence end.

    Args:
        chunk_size: target chunk length in tokens.
        window: how far (tokens) a cut may move; 0 behaves like ``fixed``.
    """

    def __init__(self, chunk_size: int = 64, window: int = 8) -> None:
        self.chunk_size = check_chunk_size("boundary_window", chunk_size)
        if not isinstance(window, int) or isinstance(window, bool) or not 0 <= window < chunk_size:
            raise ValueError(f"boundary_window chunker: window must be an integer in [0, chunk_size), got {window!r}")
        self.window = window
        self._ends: frozenset[int] = frozenset()

    def bind_tokenizer(self, tokenizer: Any) -> None:
        self._ends = sentence_end_ids(tokenizer)

    def split(self, token_ids: Sequence[int]) -> list[ChunkSpan]:
        n, size, w, ends = len(token_ids), self.chunk_size, self.window, self._ends
        spans: list[ChunkSpan] = []
        pos = 0
        while n - pos > size:
            target = pos + size
            if target + w > n:  # the window is not fully visible: decide nothing (prefix stability)
                break
            # A cut at c falls after token c - 1; prefer the nearest to target, then the earlier one.
            candidates = [c for c in range(target - w, target + w + 1) if c > pos and token_ids[c - 1] in ends]
            cut = min(candidates, key=lambda c: (abs(c - target), c)) if candidates else target
            spans.append(ChunkSpan(pos, cut))
            pos = cut
        if pos < n:
            spans.append(ChunkSpan(pos, n))
        return spans

    def fingerprint(self) -> str:
        return f"boundary_window:{self.chunk_size}:{self.window}"
