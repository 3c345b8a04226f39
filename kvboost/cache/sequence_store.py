"""Storing a finished sequence: which of its chunks become cache entries, under which keys, holding what.

Only KV equal to a cold prefill is stored under prefix-chained keys (exact): chunks that end at or before
``approx_from`` (the first row computed after approximate, content-hit KV). Later chunks are stored under their
segment key only (``exact=False``), for content hits, unless that segment key is stored. An exact chunk no tier
takes breaks the chain: its descendants would be unreachable orphans, so they are not stored either.

What an entry holds is the caller's ``payload_of(start, end)``: the engine gives pool block references
(:class:`~kvboost.cache.pooled.PooledKV`, nothing copied) when the first tier is in memory and the quantizer is
``none``, else the quantizer's payload of a copy of the rows. The simulators of ``experiments/`` run this very
function with payloads of the right size and no tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvboost.cache.entry import KVEntry, segment_only_key
from kvboost.cache.store import KVStore
from kvboost.lookup import common_prefix_length
from kvboost.types import ChunkSpan


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
) -> int:
    """Store the chunks of ``seq`` that the store lacks; returns how many were stored.

    ``spans`` are the prompt's (extended over ``seq`` by the chunker when ``seq`` is longer: generated tokens).
    ``payload_of(start, end)`` gives the payload of rows ``[start, end)`` (called only for chunks that are stored).
    """
    spans = chunker.extend(seq, spans) if spans and spans[-1].end != len(seq) else spans
    keys = hasher.chunk_keys(seq, spans, fingerprint, salt)
    stored = 0
    chain_broken = False  # an exact chunk no tier took: its descendants would be unreachable orphans
    for span, key in zip(spans, keys):
        exact = approx_from is None or span.end <= approx_from
        if exact and (chain_broken or key.prefix_key in store):
            continue
        if not exact and store.has_segment(key.segment_key):
            continue
        tokens = tuple(seq[span.start : span.end])
        if exact:
            drop_redundant_sibling(store, key.parent_key, tokens)
        entry = KVEntry(
            key=key.prefix_key if exact else segment_only_key(key.segment_key),
            segment_key=key.segment_key,
            parent_key=key.parent_key if exact else None,
            token_ids=tokens,
            start=span.start,
            payload=payload_of(span.start, span.end),
            pinned=pin,
            exact=exact,
        )
        if store.put(entry):
            stored += 1
        else:
            release = getattr(entry.payload, "release", None)  # no tier took it: its block references go back
            if release is not None:
                release()
            if exact:
                chain_broken = True
    return stored


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
