"""Storing a finished sequence: which of its chunks become cache entries, under which keys, holding what.

Only KV equal to a cold prefill is stored under prefix-chained keys (exact): chunks that end at or before
``approx_from`` (the first row computed after approximate, content-hit KV). Later chunks are stored under their
segment key made approximate with the recompute strategy's fingerprint (``exact=False``,
:func:`~kvboost.cache.entry.approximate_segment_key`), for content hits under that strategy only, unless that key is
stored. An exact chunk no tier takes breaks the chain: its descendants would be unreachable orphans, so they are
not stored either.

What an entry holds is the caller's ``payload_of(start, end)``: the engine gives runs of the sequence's pool blocks
(:class:`~kvboost.cache.block_run.BlockRun`, nothing copied) when the first tier is the pool, else the quantizer's
payload of a copy of the rows. A chunk held only by a tier below the pool is stored again as a run: that moves it
up (the request loaded its rows into its own blocks), pinned if it was pinned there. The simulators of ``experiments/`` run this very function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvboost.cache.block_run import is_pooled
from kvboost.cache.entry import KVEntry, approximate_segment_key, segment_only_key
from kvboost.cache.store import KVStore
from kvboost.types import ChunkSpan


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def store_sequence(
    store: KVStore,
    *,
    chunker: Any,
    hasher: Any,
    fingerprint: str,
    seq: Sequence[int],
    spans: list[ChunkSpan],
    payload_of: Callable[[int, int], Any],
    approx_from: int | None,
    salt: str = "",
    pin: bool = False,
    approx_tag: str = "",
) -> int:
    """Store the chunks of ``seq`` that the store lacks; returns how many were stored.

    ``spans`` are the prompt's (extended over ``seq`` by the chunker when ``seq`` is longer: generated tokens; cut
    to ``seq`` when it is shorter: a request preempted in its prefill, see :func:`cover`).
    ``payload_of(start, end)`` gives the payload of rows ``[start, end)`` (called only for chunks that are stored).
    ``approx_tag``: the recompute strategy's fingerprint, in the key of every approximate chunk.
    """
    spans = cover(chunker, seq, spans)
    keys = hasher.chunk_keys(seq, spans, fingerprint, salt)
    stored = 0
    chain_broken = False  # an exact chunk no tier took: its descendants would be unreachable orphans
    for span, key in zip(spans, keys):
        exact = approx_from is None or span.end <= approx_from
        segment = key.segment_key if exact else approximate_segment_key(key.segment_key, approx_tag)
        primary = key.prefix_key if exact else segment_only_key(segment)
        if exact and chain_broken:
            continue
        if primary in store and not (store.pool is not None and not store.in_first_tier(primary)):
            continue  # stored already (a chunk only a tier below the pool holds is stored again: moved up)
        if not exact and store.has_segment(key.segment_key):
            continue  # an exact entry of the same text serves its content hits
        tokens = tuple(seq[span.start : span.end])
        if exact and primary not in store:
            drop_redundant_sibling(store, key.parent_key, tokens)
        payload = payload_of(span.start, span.end)
        below = store.peek_meta(primary) if primary in store else None
        if below is not None and not is_pooled(payload):
            continue
        # an entry moved up from a tier below keeps its pin (a pin set before a restart, or on an entry the pool
        # refused): re-storing it unpinned would let the pool evict what the user pinned
        pinned = pin or (below is not None and below.pinned)
        entry = KVEntry(key=primary, segment_key=segment, parent_key=key.parent_key if exact else None,
                        token_ids=tokens, start=span.start, payload=payload, pinned=pinned, exact=exact)  # fmt: skip
        if store.put(entry):
            stored += 1
        elif exact:
            chain_broken = True
    return stored


def cover(chunker: Any, seq: Sequence[int], spans: Sequence[ChunkSpan]) -> list[ChunkSpan]:
    """The spans of ``seq`` given the prompt's ``spans``: extended by the chunker over tokens past them (generated
    ones), or, when ``seq`` ends inside them (a prefill cut short), the spans that start before its end, the last
    one cut there. A cut chunk is a frontier chunk, as the partial last chunk of any prompt is: the lookup matches
    it token by token. (A chunker's ``extend`` continues the *last* segment; a cut in an earlier segment of the
    ``separator`` chunker left its spans past the sequence, and storing them raised.)"""
    n = len(seq)
    if not spans or spans[-1].end == n:
        return list(spans)
    if spans[-1].end < n:
        return chunker.extend(seq, spans)
    return [ChunkSpan(span.start, min(span.end, n), span.segment_start) for span in spans if span.start < n]


def drop_redundant_sibling(store: KVStore, parent_key: str, tokens: tuple[int, ...]) -> None:
    """A stored sibling whose tokens are a strict prefix of ``tokens`` (an earlier prompt's partial tail) is
    redundant once the longer chunk is stored: the frontier match finds the longer one. Only a leaf may go: a
    sibling with children (a segment that ended there, followed by more chunks) would strand them."""
    for sibling_key in store.children_with_first_token(parent_key, tokens[0]):
        sibling = store.peek(sibling_key)
        if (
            sibling is not None
            and not sibling.pinned
            and sibling.num_tokens < len(tokens)
            and not store.has_children(sibling_key)
            and common_prefix_length(sibling.token_ids, tokens) == sibling.num_tokens
        ):
            store.remove(sibling_key)
