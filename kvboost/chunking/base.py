"""Chunker interface: a prompt -> token ids and contiguous chunk spans covering them."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from kvboost.types import ChunkSpan


def fixed_spans(start: int, end: int, size: int, segment_start: int) -> list[ChunkSpan]:
    """``[start, end)`` cut into pieces of ``size`` tokens (the last holds the remainder), all in one segment."""
    return [ChunkSpan(s, min(s + size, end), segment_start) for s in range(start, end, size)]


class Chunker(ABC):
    """Splits a prompt into chunks, the unit of caching.

    Two ways in:

    - ``split(token_ids)``: spans over given ids (prompts passed as ids, and the ids of prompt + generated
      tokens when they are stored). Every chunker implements it.
    - ``tokenize(tokenizer, text)``: ids *and* spans from text. The default tokenizes the whole text and
      calls ``split``; a chunker with ``owns_tokenization = True`` tokenizes the text piece by piece (the
      ``separator`` chunker: each segment on its own, so a document gets the same ids wherever it appears).
      The engine tokenizes every prompt through this method, and the runner gives every mode (baselines
      included) the engine's ids, so all modes of a run see the same ids.

    Contract (checked by ``tests/test_plugin_conformance.py`` for every registered chunker):
    - the spans are contiguous, non-empty, start at 0 and end at ``len(token_ids)``; ``segment_start`` of a
      span is the start of an earlier-or-equal span, and spans of one segment are contiguous;
    - the result depends only on the input (deterministic);
    - ``split`` is prefix-stable: the spans of a prefix of a sequence are the spans of the sequence, cut at
      the prefix's end; only the last span may differ. This is what lets a later prompt that extends an
      earlier one find the earlier prompt's chunks under the same prefix-chained keys;
    - ``extend(ids, spans)`` gives spans for ``ids`` (a prompt with tokens appended) that keep every span of
      the prompt but its last one.
    """

    registry_name: str = "?"
    #: True when ``tokenize`` does more than tokenizing the whole text and splitting the ids.
    owns_tokenization: bool = False

    @abstractmethod
    def split(self, token_ids: Sequence[int]) -> list[ChunkSpan]:
        """Spans covering ``token_ids``; empty list for an empty sequence."""

    def tokenize(self, tokenizer: Any, text: str) -> tuple[list[int], list[ChunkSpan]]:
        """Token ids of ``text`` (no special tokens added) and their spans."""
        ids = [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]
        return ids, self.split(ids)

    def extend(self, token_ids: Sequence[int], spans: Sequence[ChunkSpan]) -> list[ChunkSpan]:
        """Spans for ``token_ids``, whose first ``spans[-1].end`` tokens were chunked into ``spans``.

        Prefix-stable chunkers simply split the longer sequence.
        """
        return self.split(token_ids)

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """Called once by the engine with its tokenizer (chunkers that need token texts override it)."""

    def fingerprint(self) -> str:
        """Identity of this chunker and its settings; part of every cache key's model fingerprint."""
        return self.registry_name
