"""Chunker interface: token ids -> contiguous chunk spans covering the whole prompt."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvboost.types import ChunkSpan


class Chunker(ABC):
    """Splits a prompt's token ids into chunks, the unit of caching.

    Contract (checked by ``tests/test_plugin_conformance.py`` for every registered chunker):
    - the spans are contiguous, non-empty, start at 0 and end at ``len(token_ids)``;
    - the result depends only on the token ids (deterministic);
    - the spans of a prefix of a sequence are the spans of the sequence, cut at the prefix's end
      (``prefix-stable``): this is what lets a later prompt that extends an earlier one find the
      earlier prompt's chunks under the same prefix-chained keys. Only the last span may differ.
    """

    registry_name: str = "?"

    @abstractmethod
    def split(self, token_ids: Sequence[int]) -> list[ChunkSpan]:
        """Spans covering ``token_ids``; empty list for an empty sequence."""

    def fingerprint(self) -> str:
        """Identity of this chunker and its settings; part of every cache key's model fingerprint."""
        return self.registry_name
