"""Fixed-size chunks: ``[0, n), [n, 2n), ...``; the last chunk holds the remainder."""

from __future__ import annotations

from collections.abc import Sequence

from kvboost.chunking.base import Chunker, fixed_spans
from kvboost.registry import CHUNKERS
from kvboost.types import ChunkSpan


def check_chunk_size(owner: str, chunk_size: object) -> int:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"{owner} chunker: chunk_size must be a positive integer, got {chunk_size!r}")
    return chunk_size


@CHUNKERS.register("fixed")
class FixedChunker(Chunker):
    """Chunks of ``chunk_size`` tokens; the whole prompt is one segment.

    Smaller chunks lose less at the frontier but cost more entries and hashes; the engine's
    frontier matching recovers partial chunks anyway, so the size mostly trades lookup overhead
    against how finely hits can be placed.
    """

    def __init__(self, chunk_size: int = 64) -> None:
        self.chunk_size = check_chunk_size("fixed", chunk_size)

    def split(self, token_ids: Sequence[int]) -> list[ChunkSpan]:
        return fixed_spans(0, len(token_ids), self.chunk_size, 0)

    def fingerprint(self) -> str:
        return f"fixed:{self.chunk_size}"
