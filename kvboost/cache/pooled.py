"""A cache payload that is a reference to KV pool blocks: what the memory tier holds for an exact chunk.

When the engine stores a finished sequence with the ``none`` quantizer, each new chunk's entry references the
blocks that already hold its rows (one more reference per block, nothing copied). A later prompt with the same
prefix puts those block ids into its own block table (``kvboost.reuse.assemble``): an exact hit costs no copy but
the partial last block (copy on write).

The payload lives only in memory tiers. The store turns it into a standalone :class:`~kvboost.quant.none.RawKV`
(:meth:`PooledKV.detached`, a copy of its rows) when the entry moves to a tier that serialises it (disk, Redis),
and gives its block references back (:meth:`PooledKV.release`) when the entry leaves the memory tier.
"""

from __future__ import annotations

from typing import Any

import torch

from kvboost.kv.pool import KVPool


class PooledKV:
    """Rows ``[start, start + num_tokens)`` of a sequence, held as references to the pool blocks covering them.

    Args:
        pool: the pool.
        blocks: the block ids covering the rows, in order; ``blocks[0]`` holds row ``start`` at offset
            ``start % block_size``.
        start: the chunk's first logical row (the position it was computed at).
        num_tokens: rows held.
        incref: take one reference to each block now (False when the caller hands its own over).
    """

    #: Memory tiers keep this payload as it is; the store detaches it for any other tier.
    pooled = True

    def __init__(self, pool: KVPool, blocks: list[int], start: int, num_tokens: int, *, incref: bool = True) -> None:
        need = pool.blocks_for(start % pool.block_size + num_tokens)
        if len(blocks) != need:
            raise ValueError(f"rows {start}:{start + num_tokens} span {need} blocks, {len(blocks)} given")
        self.pool = pool
        self.blocks = tuple(blocks)
        self.start = start
        self._num_tokens = num_tokens
        self._released = False
        if incref:
            pool.incref(self.blocks)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def nbytes(self) -> int:
        """The bytes of its rows (what a copy would take): the memory tier's budget counts entries as before.
        Blocks shared with a neighbouring chunk or a running sequence are counted by every holder."""
        return self._num_tokens * self.pool.row_bytes

    @property
    def offset(self) -> int:
        """Row of ``blocks[0]`` holding the chunk's first token."""
        return self.start % self.pool.block_size

    def slots(self, count: int | None = None) -> torch.Tensor:
        """Slots of the first ``count`` rows (default all)."""
        count = self._num_tokens if count is None else count
        return self.pool.slots(self.blocks, self.offset, self.offset + count)

    def block_for_row(self, row: int) -> int:
        """The block holding logical row ``row`` (``start <= row < start + num_tokens``)."""
        if not self.start <= row < self.start + self._num_tokens:
            raise ValueError(f"row {row} is outside {self.start}:{self.start + self._num_tokens}")
        return self.blocks[(row - self.start + self.offset) // self.pool.block_size]

    def materialize(self, count: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the first ``count`` rows (default all): ``[layers, kv_heads, count, head_dim]`` each."""
        self._check_live()
        return self.pool.read(self.slots(count))

    def detached(self) -> Any:
        """A standalone copy (``RawKV``) for tiers that serialise entries."""
        from kvboost.quant.none import RawKV

        keys, values = self.materialize()
        return RawKV(keys, values)

    def release(self) -> None:
        """Give the block references back (idempotent)."""
        if not self._released:
            self._released = True
            self.pool.decref(self.blocks)

    @property
    def released(self) -> bool:
        return self._released

    def _check_live(self) -> None:
        if self._released:
            raise RuntimeError("this pooled KV payload was released (its entry left the memory tier)")

    def __repr__(self) -> str:
        return f"PooledKV(start={self.start}, tokens={self._num_tokens}, blocks={list(self.blocks)})"


def is_pooled(payload: Any) -> bool:
    """Whether ``payload`` references pool blocks (and so must be detached before a non-memory tier takes it)."""
    return bool(getattr(payload, "pooled", False))
