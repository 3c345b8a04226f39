"""Chunkers: token ids -> chunk spans. ``CHUNKERS.build({"name": "fixed", "chunk_size": 64})``."""

from kvboost.chunking.base import Chunker
from kvboost.chunking.fixed import FixedChunker

__all__ = ["Chunker", "FixedChunker"]
