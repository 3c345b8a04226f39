"""Cache lookup: which leading tokens of a prompt have exact KV in the store, and that KV assembled.

Exact reuse walks the prompt's chunks from the start under prefix-chained keys: an entry found under
chunk i's key was computed after exactly the same tokens, so its KV is what a cold prefill would
compute (up to matmul rounding). The walk stops at the first miss. At that *frontier* the store may
still hold a chunk with the same parent whose tokens only partly match (a previous prompt ended, or
its answer diverged, inside this chunk): the longest common token prefix of that entry is exact too,
because attention is causal. This recovers the tail that chunk granularity would otherwise lose, so
reuse reaches the token-level longest common prefix, like a radix tree, at chunk-level hashing cost.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvboost.cache.store import KVStore
from kvboost.chunking.base import Chunker
from kvboost.hashing.base import Hasher
from kvboost.quant.base import KVQuantizer
from kvboost.recompute.base import ReusePlan
from kvboost.types import ChunkKey, ChunkRef, ChunkSpan


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def chunk_prompt(ids: Sequence[int], chunker: Chunker, hasher: Hasher, fingerprint: str) -> tuple[list[ChunkSpan], list[ChunkKey]]:
    spans = chunker.split(ids)
    return spans, hasher.chunk_keys(ids, spans, fingerprint)


def plan_exact_reuse(
    ids: list[int],
    spans: list[ChunkSpan],
    keys: list[ChunkKey],
    store: KVStore,
    quantizer: KVQuantizer,
    *,
    max_reuse: int | None = None,
) -> ReusePlan:
    """Assemble the exact KV of the longest cached prefix of ``ids`` (at most ``max_reuse`` tokens)."""
    limit = len(ids) if max_reuse is None else max(0, min(max_reuse, len(ids)))
    refs: list[ChunkRef] = []
    segments: list[tuple[torch.Tensor, torch.Tensor]] = []
    hit_keys: list[str] = []
    reused = 0
    frontier_open = True
    for span, key in zip(spans, keys):
        if not frontier_open or reused >= limit:
            refs.append(ChunkRef(span, key, "miss"))
            continue
        entry = store.get(key.prefix_key)
        take = 0
        entry_key = None
        if entry is not None and entry.num_tokens == len(span):
            take = len(span)
            entry_key = entry.key
            store.stats.exact_hits += 1
        else:
            # Frontier: the best partially matching sibling stored after the same history.
            chunk_tokens = ids[span.start : span.end]
            best, best_len = None, 0
            for child_key in store.children(key.parent_key):
                child = store.peek(child_key)
                if child is None:
                    continue
                n = common_prefix_length(child.token_ids, chunk_tokens)
                if n > best_len:
                    best, best_len = child, n
            if best is not None:
                entry = store.get(best.key)  # counts the access
                take, entry_key = best_len, best.key
                store.stats.partial_hits += 1
            else:
                store.stats.misses += 1
            frontier_open = False
        take = min(take, limit - reused)
        if take > 0 and entry is not None:
            k, v = quantizer.dequantize(entry.payload)
            if take < k.shape[2]:
                k, v = k[:, :, :take], v[:, :, :take]
            segments.append((k, v))
            hit_keys.append(entry_key)  # type: ignore[arg-type]
            reused += take
            refs.append(ChunkRef(span, key, "exact", reused_tokens=take, entry_key=entry_key))
        else:
            refs.append(ChunkRef(span, key, "miss"))
        if take < len(span):
            frontier_open = False
    store.touch_chain(hit_keys)
    store.stats.hit_tokens += reused
    return ReusePlan(ids, refs, reused, segments, exact_hit_tokens=reused)
