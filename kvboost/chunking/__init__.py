"""Chunkers: prompt -> token ids and chunk spans. ``CHUNKERS.build({"name": "fixed", "chunk_size": 64})``."""

from kvboost.chunking.base import Chunker, fixed_spans
from kvboost.chunking.boundary_window import BoundaryWindowChunker
from kvboost.chunking.fixed import FixedChunker
from kvboost.chunking.separator import SeparatorChunker

__all__ = ["BoundaryWindowChunker", "Chunker", "FixedChunker", "SeparatorChunker", "fixed_spans"]
