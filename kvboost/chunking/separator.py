"""Segments cut at a separator string, each tokenized on its own: a document has the same ids anywhere.

A RAG prompt is system text, documents and a question. Tokenizing the prompt as a whole merges tokens across
document boundaries and makes a document's ids depend on what precedes it; then no cache can recognise it at
another position. This chunker cuts the prompt *text* at ``separator`` (default a blank line) and tokenizes
every piece, and every separator, on its own. Each piece and each separator is one *segment*; a segment longer
than ``chunk_size`` tokens is cut further into fixed-size chunks. The hasher chains every chunk's segment key
from its segment's start, so a document is one content-addressable chain wherever it appears.

Because the chunker owns tokenization, the ids differ (slightly, at the cuts) from tokenizing the whole text:
the engine tokenizes every prompt through it and the runner gives every mode the same ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvboost.chunking.base import Chunker, fixed_spans
from kvboost.chunking.fixed import check_chunk_size
from kvboost.registry import CHUNKERS
from kvboost.types import ChunkSpan


@CHUNKERS.register("separator")
class SeparatorChunker(Chunker):
    """Text segments between ``separator`` strings, tokenized one by one, cut into ``chunk_size`` chunks.

    Args:
        separator: the string between segments (documents); it is its own (short) segment.
        chunk_size: longest chunk in tokens; longer segments are cut into fixed-size pieces.

    Token ids given directly (not text) are one segment cut into fixed-size chunks: the separator can only
    be found in text.
    """

    owns_tokenization = True

    def __init__(self, separator: str = "\n\n", chunk_size: int = 64) -> None:
        if not isinstance(separator, str) or not separator:
            raise ValueError(f"separator chunker: separator must be a non-empty string, got {separator!r}")
        self.separator = separator
        self.chunk_size = check_chunk_size("separator", chunk_size)

    def split(self, token_ids: Sequence[int]) -> list[ChunkSpan]:
        return fixed_spans(0, len(token_ids), self.chunk_size, 0)

    def tokenize(self, tokenizer: Any, text: str) -> tuple[list[int], list[ChunkSpan]]:
        pieces = text.split(self.separator)
        # One batched tokenizer call for all pieces (and the separator once): the fast tokenizers parallelise
        # and amortise the per-call overhead.
        parts: list[str] = []
        for i, piece in enumerate(pieces):
            if i:
                parts.append(self.separator)
            if piece:
                parts.append(piece)
        encoded = tokenizer(parts, add_special_tokens=False)["input_ids"] if parts else []
        ids: list[int] = []
        spans: list[ChunkSpan] = []
        for tokens in encoded:
            if not tokens:
                continue
            start = len(ids)
            ids.extend(int(t) for t in tokens)
            spans.extend(fixed_spans(start, len(ids), self.chunk_size, start))
        return ids, spans

    def extend(self, token_ids: Sequence[int], spans: Sequence[ChunkSpan]) -> list[ChunkSpan]:
        """Appended (generated) tokens continue the last segment, in fixed-size chunks after its last full one."""
        if not spans:
            return self.split(token_ids)
        last = spans[-1]
        return list(spans[:-1]) + fixed_spans(last.start, len(token_ids), self.chunk_size, last.segment_start)

    def fingerprint(self) -> str:
        return f"separator:{self.separator!r}:{self.chunk_size}"
