"""kvboost's memory tier without a model: the engine's own pool, cache and request book-keeping, tensor-free.

Since issue 42 the engine's memory tier *is* its KV pool (``kvboost.kv.pool``, ``kvboost.cache.pool_tier``): a
cached chunk is a run of the pool's blocks (``BlockRun``) that a finished request left behind; a later prompt
with the same prefix takes references on those blocks; ``capacity`` bounds the cached blocks: storing a chunk
evicts idle entries (no request holds them) in the eviction policy's order to make room for its blocks not cached
yet, or the chunk is refused. Budgets are therefore whole blocks: a partial last block costs a whole block, and
a block shared by a chunk and its successor is counted once.

:class:`PoolModel` runs that very code: a real ``KVPool`` on ``device="meta"`` (torch meta tensors: shapes and
byte counts are real, no memory is used, ``write`` / ``read`` / ``copy_rows`` only check shapes), a real
``PoolTier`` with the capacity in blocks and the eviction policy under test, a real ``KVStore`` over it, and per
request (:meth:`PoolModel.serve`) exactly the engine core's sequence of book operations
(``kvboost.engine.core.EngineCore._start_planned`` then ``_finish`` / ``_complete``):

1. ``lookup`` (``max_reuse = n - 1``: the last prompt token is always computed; its exact pool hits are
   referenced at once, the plan holds them);
2. ``pool.reclaim(need)``, ``need`` = the blocks of the prompt's rows and of the first decoded token's row, less
   the full blocks of the exact prefix (its partial last block is copied on write, so it counts);
3. ``assemble_exact`` into an empty ``BlockTable`` (shared blocks by reference; the plan's references released);
4. the prefill's writes: ``BlockTable.prepare_write`` of rows ``[exact_prefix, n)`` as ``ForwardBatch.build``
   does (in chunks of the scheduler's idle-prefill budget; a plan with content hits: ``assemble_content``'s one
   ``prepare_write``, the recompute strategy ``none``: the rows after the first content hit are approximate);
5. one row per token in ``generated`` (the decode steps: every generated token but the last has a row);
6. what ``pipeline.store_rows`` does: ``store_sequence`` (the engine's own) over the table's rows, with
   ``BlockRun.of_table`` payloads (nothing copied, entries hold no reference);
   (the pool tier makes room for each chunk it takes by evicting idle entries in policy order, or refuses it);
7. ``table.release()``.

One request at a time (no batching; nothing is pinned), so the pool's working set beyond the capacity (by default
``kvboost.kv.sizing.MIN_WORKING_ROWS`` rows, the engine's minimum) never has to evict: only the tier's capacity
evicts. Used by
``experiments/sims/cache_sim.py`` and ``experiments/sims/simulate_peers.py`` (``KVBoostStore``);
``tests/test_simulate_peers.py`` checks it against ``InferenceEngine.generate`` request by request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvboost.cache.block_run import BlockRun
from kvboost.cache.pool_tier import PoolTier
from kvboost.cache.sequence_store import store_sequence
from kvboost.cache.store import KVStore
from kvboost.engine.scheduler import DEFAULT_IDLE_PREFILL_TOKENS
from kvboost.kv.block_table import BlockTable
from kvboost.kv.pool import DEFAULT_BLOCK_SIZE, KVPool, PoolExhausted
from kvboost.kv.sizing import MIN_WORKING_ROWS
from kvboost.lookup import lookup
from kvboost.registry import CHUNKERS, EVICTION, HASHERS, KV_QUANT, RECOMPUTE
from kvboost.reuse.assemble import assemble_exact


@dataclass(frozen=True)
class KVShape:
    """The per-token KV layout of a model (what one cached token, and so one block, costs)."""

    layers: int = 1
    kv_heads: int = 1
    head_dim: int = 1
    dtype: torch.dtype = torch.float32

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Served:
    """What one request got from the cache and what it left there."""

    prompt_tokens: int
    exact_tokens: int  # exact hits (prefix-chained): KV equal to a cold prefill's
    content_tokens: int  # content hits (another position or history): re-rotated, approximate
    exact_prefix: int  # leading exact tokens (the assembled prefix)
    shared_blocks: int  # blocks taken by reference at assembly
    copied_blocks: int  # blocks copied on write (the partial last block of a shared prefix)
    new_blocks: int  # blocks allocated for the request's own rows
    stored_chunks: int  # chunks registered in the cache at its end

    @property
    def reused_tokens(self) -> int:
        return self.exact_tokens + self.content_tokens


def blocks_to_hold(lengths: Iterable[int], block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Blocks that hold every row of requests of these lengths (each with its decoded row and one block copied on
    write): a pool this size never evicts, whatever is cached (an unbounded tier)."""
    return sum(-(-(n + 1) // block_size) + 1 for n in lengths)


class PoolModel:
    """A ``KVPool`` (meta tensors) + ``PoolTier`` + ``KVStore`` serving one request at a time as the engine core does.

    Args:
        capacity_blocks: idle cached blocks kept at most (the pool tier's ``capacity`` / the pool's block bytes);
            None: unbounded (the pool's size; pass ``num_blocks``, e.g. :func:`blocks_to_hold` of the trace).
        block_size: tokens per block (the engine's ``kv.block_size``, default 16).
        num_blocks: blocks in the pool (default: ``capacity_blocks`` plus ``working_rows`` rows for the request
            being served, as the engine's ``kv.pool_bytes="auto"`` sizes it).
        working_rows: rows beyond the capacity for running requests (default the engine's minimum, 16384).
        kv_shape: the model's KV layout (only byte figures depend on it; default 1 layer x 1 head x 1 dim fp32).
        chunker, hasher, eviction, recompute: plugin specs as ``InferenceEngine`` takes them (default ``fixed``
            64, ``sha256``, ``lru`` leaves first, ``none``).
        content: look up content hits after the exact frontier (the engine does for a RoPE model, ``mode=reuse``).
        salt: the tenant salt of every key.
        prefill_tokens: tokens per prefill step of a request alone (the scheduler's idle-prefill budget).
    """

    def __init__(
        self,
        capacity_blocks: int | None,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        num_blocks: int | None = None,
        working_rows: int = MIN_WORKING_ROWS,
        kv_shape: KVShape | None = None,
        chunker: Any = None,
        hasher: Any = "sha256",
        eviction: Any = None,
        recompute: Any = "none",
        content: bool = True,
        salt: str = "",
        prefill_tokens: int = DEFAULT_IDLE_PREFILL_TOKENS,
        fingerprint: str | None = None,
    ) -> None:
        if capacity_blocks is not None and (not isinstance(capacity_blocks, int) or isinstance(capacity_blocks, bool)
                                            or capacity_blocks < 0):  # fmt: skip
            raise ValueError(f"capacity_blocks must be a non-negative integer or None, got {capacity_blocks!r}")
        if capacity_blocks is None and num_blocks is None:
            raise ValueError("an unbounded tier (capacity_blocks=None) needs num_blocks: the pool's size bounds it")
        if not isinstance(prefill_tokens, int) or prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be a positive integer, got {prefill_tokens!r}")
        shape = kv_shape or KVShape()
        if num_blocks is None:
            num_blocks = capacity_blocks + -(-working_rows // block_size)  # type: ignore[operator]
        self.pool = KVPool(num_layers=shape.layers, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                           num_blocks=num_blocks, block_size=block_size, dtype=shape.dtype,
                           device="meta")  # fmt: skip
        self.kv_shape = shape
        self.capacity_blocks = num_blocks if capacity_blocks is None else capacity_blocks
        self.chunker = CHUNKERS.build(chunker if chunker is not None else {"name": "fixed", "chunk_size": 64})
        self.hasher = HASHERS.build(hasher)
        self.eviction = EVICTION.build(eviction if eviction is not None else {"name": "lru", "leaves_first": True})
        self.quantizer = KV_QUANT.build("none")
        self.recompute = RECOMPUTE.build(recompute)
        self.tier = PoolTier(self.pool, self.eviction, capacity=self.capacity_blocks * self.pool.block_bytes)
        self.store = KVStore([self.tier])
        self.content = content
        self.salt = salt
        self.prefill_tokens = prefill_tokens
        parts = [f"kvq={self.quantizer.fingerprint()}", f"chunk={self.chunker.fingerprint()}",
                 f"hash={self.hasher.fingerprint()}", f"block={block_size}"]  # fmt: skip
        self.fingerprint = fingerprint if fingerprint is not None else "|".join(["pool_model", *parts])
        self.approx_tag = self.recompute.fingerprint()

    # ------------------------------------------------------------------ sizes
    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def used_blocks(self) -> int:
        """Idle cached blocks: what the capacity bounds (between requests, every cached block is idle)."""
        return self.pool.num_idle

    @property
    def cached_blocks(self) -> int:
        return self.pool.num_cached

    @property
    def used_bytes(self) -> int:
        """``used_blocks`` in the model's bytes (``kv_shape``)."""
        return self.tier.used_bytes

    def cached_tokens(self) -> int:
        """Tokens the cache's entries hold (a token of two entries, e.g. a chunk and a redundant sibling, twice)."""
        return sum(self.tier.peek(k).num_tokens for k in self.tier.keys())  # noqa: SIM118 (a tier is not iterable)

    # ------------------------------------------------------------------ one request
    def serve(self, token_ids: Sequence[int], generated: Sequence[int] = (), *, store_generated: bool = True) -> Served:
        """One request through the engine core's book operations (see the module docstring).

        ``generated``: the tokens the request decoded that have a row (``tokens[:-1]`` of a request that generated
        ``tokens``: the last one is never fed); stored after the prompt when ``store_generated`` (the engine's
        ``store_generated``). Raises ``PoolExhausted`` when the request cannot fit the pool (the engine refuses it).
        """
        ids = [int(t) for t in token_ids]
        n = len(ids)
        if n < 1:
            raise ValueError("a request needs at least one token")
        pool, store, bs = self.pool, self.store, self.pool.block_size
        stats = pool.stats
        allocated, copied = stats.allocated_blocks, stats.copy_on_write
        spans = self.chunker.split(ids)
        keys = self.hasher.chunk_keys(ids, spans, self.fingerprint, self.salt)
        plan = lookup(ids, spans, keys, store, self.quantizer, max_reuse=n - 1, content=self.content,
                      approx_tag=self.approx_tag)  # fmt: skip
        table = BlockTable(pool)
        try:
            frontier = plan.exact_prefix
            need = pool.blocks_for(n + 1) - frontier // bs + bool(frontier % bs)
            if pool.reclaim(need) < need:
                raise PoolExhausted(f"a {n}-token request needs {need} free blocks; the pool has {pool.num_free} "
                                    f"free of {pool.num_blocks}")  # fmt: skip
            assembly = assemble_exact(plan, table, self.quantizer)  # releases the plan's references
            if plan.content_tokens:  # assemble_content: the whole rest at once, then the strategy's forward
                table.prepare_write(frontier, n)
                table.length = n
                approx_from = next(p.start for p in plan.placements if p.kind == "content")  # recompute none
            else:  # the prefill's steps (ForwardBatch.build)
                for lo in range(frontier, n, self.prefill_tokens):
                    hi = min(lo + self.prefill_tokens, n)
                    table.prepare_write(lo, hi)
                    table.length = hi
                approx_from = None
            for _ in generated:  # one decode step per row
                table.prepare_write(table.length, table.length + 1)
                table.length += 1
            seq = (ids + [int(t) for t in generated] if store_generated else ids)[: table.length]
            stored = store_sequence(store, chunker=self.chunker, hasher=self.hasher, fingerprint=self.fingerprint,
                                    seq=seq, spans=spans, payload_of=lambda a, b: BlockRun.of_table(table, a, b),
                                    approx_from=approx_from, salt=self.salt, approx_tag=self.approx_tag)  # fmt: skip
        finally:
            plan.release()  # idempotent
            table.release()
        return Served(prompt_tokens=n, exact_tokens=plan.exact_tokens, content_tokens=plan.content_tokens,
                      exact_prefix=plan.exact_prefix, shared_blocks=assembly.shared_blocks,
                      copied_blocks=stats.copy_on_write - copied,
                      new_blocks=stats.allocated_blocks - allocated - (stats.copy_on_write - copied),
                      stored_chunks=stored)  # fmt: skip

    # ------------------------------------------------------------------ checks
    def verify(self) -> None:
        """The pool's and the store's books (AssertionError on a mismatch), and nothing held between requests."""
        self.pool.verify()
        self.store.verify()
        assert self.pool.num_referenced == 0, f"{self.pool.num_referenced} blocks still referenced between requests"
        assert self.pool.num_idle == self.pool.num_cached, "a cached block is held between requests"
        assert self.pool.num_idle <= self.capacity_blocks, "the tier is over its capacity"
