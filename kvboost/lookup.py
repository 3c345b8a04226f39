"""Cache lookup: which prompt tokens have KV in the store, exact or by content, assembled into a plan.

1. Exact walk. The prompt's chunks are looked up from the start under prefix-chained keys: an entry found under
   chunk i's key was computed after exactly the same tokens, so its KV is what a cold prefill computes (up to
   matmul rounding). The walk stops at the first miss.
2. Frontier. At the first miss the store may still hold a chunk with the same parent whose tokens only partly
   match (a previous prompt ended, or its answer diverged, inside this chunk): the longest common token prefix
   of that entry is exact too, because attention is causal. Candidates are indexed by (parent, first token), so
   a parent with thousands of children (a shared system prompt) costs one dictionary lookup. Reuse thus
   reaches the token-level longest common prefix, like a radix tree, at chunk-level hashing cost.
3. Content hits. Every chunk after the frontier is looked up by its segment key: the same segment text stored
   at another position or after another history. Such KV is stale (it attended to another context) and sits at
   another position: the plan records where it was computed (``stored_start``) so the engine can re-rotate its
   keys, and the recompute strategy decides what to refresh. A content hit is never used as if it were exact.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvboost.cache.block_run import is_pooled
from kvboost.cache.entry import approximate_segment_key
from kvboost.cache.sequence_store import common_prefix_length
from kvboost.cache.store import KVStore
from kvboost.chunking.base import Chunker
from kvboost.hashing.base import Hasher
from kvboost.plan import Placement, ReusePlan
from kvboost.quant.base import KVQuantizer
from kvboost.types import ChunkKey, ChunkSpan


def chunk_prompt(
    ids: Sequence[int], chunker: Chunker, hasher: Hasher, fingerprint: str, salt: str = ""
) -> tuple[list[ChunkSpan], list[ChunkKey]]:
    """Spans (``chunker.split``) and keys of token ids (prompts given as ids)."""
    spans = chunker.split(ids)
    return spans, hasher.chunk_keys(ids, spans, fingerprint, salt)


def _append(placements: list[Placement], p: Placement) -> None:
    """Append, merging adjacent new placements (they carry no KV)."""
    if p.kind == "new" and placements and placements[-1].kind == "new" and placements[-1].end == p.start:
        placements[-1].end = p.end
    else:
        placements.append(p)


def lookup(
    ids: list[int],
    spans: list[ChunkSpan],
    keys: list[ChunkKey],
    store: KVStore,
    quantizer: KVQuantizer,
    *,
    max_reuse: int | None = None,
    content: bool = True,
    approx_tag: str = "",
) -> ReusePlan:
    """The reuse plan of ``ids``: exact hits up to the frontier, then content hits (if ``content``; approximate
    entries of the strategy whose fingerprint is ``approx_tag`` only).

    Positions ``>= max_reuse`` are left new: the engine passes ``len(ids) - 1`` so that the last prompt token
    is always computed (its logits give the first token). The plan holds references to the pool blocks of its
    exact hits: hand it to ``assemble_exact`` or call ``release``.
    """
    n = len(ids)
    limit = n if max_reuse is None else max(0, min(max_reuse, n))
    # Start reading, in the background, what lower tiers hold of this prompt (in chain order): each chunk's
    # exact entry, else (content lookup on) the entry its segment key would serve.
    wanted = []
    for span, key in zip(spans, keys):
        if span.start >= limit:
            break
        if key.prefix_key in store:
            wanted.append(key.prefix_key)
        elif content:
            seg_key = store.segment_entry_key(key.segment_key) or store.segment_entry_key(
                approximate_segment_key(key.segment_key, approx_tag))
            if seg_key is not None:
                wanted.append(seg_key)
    store.prefetch(wanted)
    placements: list[Placement] = []
    hit_keys: list[str] = []
    held: list[int] = []  # pool blocks of exact hits, referenced as found
    try:
        _walk(ids, spans, keys, store, quantizer, limit, content, approx_tag, placements, hit_keys, held)
    except BaseException:
        if held:
            store.pool.decref(held)
        raise
    store.touch_chain(hit_keys)
    plan = ReusePlan(ids, placements, spans=spans, keys=keys, held=held, pool=store.pool)
    store.stats.hit_tokens += plan.reused_tokens
    store.stats.content_hit_tokens += plan.content_tokens
    return plan


def _walk(ids: list[int], spans: list[ChunkSpan], keys: list[ChunkKey], store: KVStore, quantizer: KVQuantizer,
          limit: int, content: bool, approx_tag: str, placements: list[Placement], hit_keys: list[str],
          held: list[int]) -> None:  # fmt: skip
    """The lookup's walk over the chunks (see :func:`lookup`), appending to its lists."""
    stats = store.stats
    exact_open = True
    for span, key in zip(spans, keys):
        if span.start >= limit:
            _append(placements, Placement(span.start, span.end, "new"))
            continue
        take, entry, kind = 0, None, "new"
        if exact_open:
            entry = store.get(key.prefix_key, access=False)  # touch_chain counts the hits below
            if entry is not None and entry.exact and entry.num_tokens == len(span):
                take, kind = len(span), "exact"
                stats.exact_hits += 1
            else:
                entry = None
                exact_open = False
                chunk = ids[span.start : span.end]
                best, best_len = None, 0
                for child_key in store.children_with_first_token(key.parent_key, chunk[0]):
                    child = store.peek_meta(child_key)  # token ids only: no payload loaded from a lower tier
                    if child is not None:
                        common = common_prefix_length(child.token_ids, chunk)
                        if common > best_len:
                            best, best_len = child, common
                if best is not None:
                    entry = store.get(best.key, access=False)  # a hit: touch_chain counts it
                if entry is not None:
                    take, kind = best_len, "exact"
                    stats.partial_hits += 1
                else:  # no partial match, or its record turned out damaged (dropped by its tier)
                    stats.misses += 1
        elif content:
            entry = store.find_segment(key.segment_key)
            if entry is None:  # repaired KV, stored under this strategy's key
                entry = store.find_segment(approximate_segment_key(key.segment_key, approx_tag))
            if entry is not None and entry.num_tokens == len(span):
                take, kind = len(span), "content"
                stats.content_hits += 1
            else:
                entry = None
                stats.misses += 1
        take = min(take, limit - span.start)
        if take > 0 and entry is not None:
            if kind == "exact" and (is_pooled(entry.payload) or not getattr(quantizer, "lossless", True)):
                # pool blocks (shared by reference) or a quantized payload (decoded straight into the sequence's
                # blocks): kvboost.reuse.assemble, no temporary
                placement = Placement(span.start, span.start + take, kind, entry_key=entry.key, payload=entry.payload)
                if is_pooled(entry.payload):  # referenced now: nothing can evict these blocks before assembly
                    blocks = entry.payload.blocks_for(take)
                    store.pool.incref(blocks)
                    held.extend(blocks)
            elif is_pooled(entry.payload):  # a content hit: a copy of the rows, re-rotated when assembled
                k, v = entry.payload.materialize(take)
                placement = Placement(span.start, span.start + take, kind, entry_key=entry.key,
                                      stored_start=entry.start, keys=k, values=v)  # fmt: skip
            else:
                k, v = quantizer.dequantize(entry.payload)
                if take < k.shape[2]:
                    k, v = k[:, :, :take], v[:, :, :take]
                placement = Placement(span.start, span.start + take, kind, entry_key=entry.key,
                                      stored_start=entry.start if kind == "content" else None, keys=k, values=v)
            placements.append(placement)
            if kind == "exact":
                hit_keys.append(entry.key)
            if take < len(span):
                _append(placements, Placement(span.start + take, span.end, "new"))
                exact_open = False
        else:
            _append(placements, Placement(span.start, span.end, "new"))
            exact_open = False
