"""Fixed-size chunks: ``[0, n), [n, 2n), ...``; the last chunk holds the remainder."""

from __future__ import annotations

from collections.abc import Sequence

from kvboost.chunking.base import Chunker
from kvboost.registry import CHUNKERS
from kvboost.types import ChunkSpan


@CHUNKERS.register("fixed")
class FixedChunker(Chunker):
    """Chunks of ``chunk_size`` tokens.

    Smaller chunks lose less at the frontier but cost more entries and hashes; the engine's
    frontier matching recovers partial chunks anyway, so the size mostly trades lookup overhead
    against how finely content hits can be placed.
    """

    def __init__(self, chunk_size: int = 64) -> None:
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"fixed chunker: chunk_size must be a positive integer, got {chunk_size!r}")
        self.chunk_size = chunk_size

    def split(self, token_ids: Sequence[int]) -> list[ChunkSpan]:
        n, size = len(token_ids), self.chunk_size
        return [ChunkSpan(start, min(start + size, n)) for start in range(0, n, size)]

    def fingerprint(self) -> str:
        return f"fixed:{self.chunk_size}"
