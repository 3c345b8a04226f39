"""A cache payload that is a run of KV pool blocks: what the pool-backed memory tier indexes for a chunk.

When a finished (or preempted) sequence is stored and the first tier is the pool (``kvboost.cache.pool_tier``),
each new chunk's entry names the blocks that already hold its rows: nothing is copied, and the entry holds no
reference (the pool counts it as a *cached* user of the blocks: they stay, idle, after the sequence lets them go,
until the pool needs them). A later prompt with the same prefix takes references on those blocks into its own
block table (``kvboost.reuse.assemble``): an exact hit costs no copy but the partial last block (copy on write).

A run lives only in the pool tier. The store copies its rows out (:meth:`BlockRun.detached`, a ``RawKV``) when the
entry moves to a tier that serialises it (disk, Redis, host memory).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvboost.kv.pool import KVPool


class BlockRun:
    """Rows ``[start, start + num_tokens)`` of a sequence, by the pool blocks that cover them.

    Args:
        pool: the pool.
        blocks: the block ids covering the rows, in order; ``blocks[0]`` holds row ``start`` at offset
            ``start % block_size``.
        start: the chunk's first logical row (the position it was computed at).
        num_tokens: rows held.
    """

    #: The store detaches this payload (a copy of its rows) for any tier but the pool's.
    pooled = True

    def __init__(self, pool: KVPool, blocks: list[int] | tuple[int, ...], start: int, num_tokens: int) -> None:
        need = pool.blocks_for(start % pool.block_size + num_tokens)
        if len(blocks) != need:
            raise ValueError(f"rows {start}:{start + num_tokens} span {need} blocks, {len(blocks)} given")
        self.pool = pool
        self.blocks = tuple(blocks)
        self.start = start
        self.num_tokens = num_tokens

    @classmethod
    def of_table(cls, table: Any, start: int, end: int) -> BlockRun:
        """The run of rows ``[start, end)`` of a block table."""
        bs = table.pool.block_size
        return cls(table.pool, table.blocks[start // bs : (end - 1) // bs + 1], start, end - start)

    @property
    def nbytes(self) -> int:
        """The bytes of its rows (what a copy takes; the pool's blocks are the memory tier's real budget)."""
        return self.num_tokens * self.pool.row_bytes

    @property
    def offset(self) -> int:
        """Row of ``blocks[0]`` holding the chunk's first token."""
        return self.start % self.pool.block_size

    def slots(self, count: int | None = None) -> torch.Tensor:
        """Slots of the first ``count`` rows (default all)."""
        count = self.num_tokens if count is None else count
        return self.pool.slots(self.blocks, self.offset, self.offset + count)

    def blocks_for(self, count: int) -> tuple[int, ...]:
        """The blocks holding the first ``count`` rows."""
        return self.blocks[: self.pool.blocks_for(self.offset + count)] if count > 0 else ()

    def block_for_row(self, row: int) -> int:
        """The block holding logical row ``row`` (``start <= row < start + num_tokens``)."""
        if not self.start <= row < self.start + self.num_tokens:
            raise ValueError(f"row {row} is outside {self.start}:{self.start + self.num_tokens}")
        return self.blocks[(row - self.start + self.offset) // self.pool.block_size]

    def materialize(self, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the first ``count`` rows (default all): ``[layers, kv_heads, count, head_dim]`` each."""
        return self.pool.read(self.slots(count))

    def detached(self) -> Any:
        """A standalone copy (``RawKV``) for tiers that serialise entries."""
        from kvboost.quant.none import RawKV

        keys, values = self.materialize()
        return RawKV(keys, values)

    def __repr__(self) -> str:
        return f"BlockRun(start={self.start}, tokens={self.num_tokens}, blocks={list(self.blocks)})"


def is_pooled(payload: Any) -> bool:
    """Whether ``payload`` is a run of pool blocks (and so must be detached before a non-pool tier takes it)."""
    return bool(getattr(payload, "pooled", False))


def standalone(entry: Any) -> Any:
    """``entry`` itself, or, when its payload is a run of pool blocks, a copy of it whose payload is a copy of the
    rows (``BlockRun.detached``): what a tier that does not hold pool blocks takes, made before the blocks can go."""
    if not is_pooled(entry.payload):
        return entry
    return dataclasses.replace(entry, payload=entry.payload.detached())
