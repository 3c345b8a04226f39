"""One sequence's view of the KV pool: its block ids in logical order and how many rows are filled.

Logical row ``j`` of the sequence lives in block ``blocks[j // block_size]`` at offset ``j % block_size``. Blocks
may be shared with cache entries and other sequences (reference counts in the pool); a shared block is never
written: :meth:`BlockTable.prepare_write` copies a shared block before rows are written into it (copy on write;
in practice only the partial last block of a shared prefix, since the rows after a shared prefix are new).
"""

from __future__ import annotations

import torch

from kvboost.kv.pool import KVPool


class BlockTable:
    """Blocks and filled length of one sequence.

    Args:
        pool: the pool its blocks come from.
    """

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.blocks: list[int] = []
        self.length = 0  # rows [0, length) hold K/V
        self._released = False

    # ------------------------------------------------------------------ shape
    @property
    def capacity(self) -> int:
        """Rows the table's blocks hold."""
        return len(self.blocks) * self.pool.block_size

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"BlockTable(length={self.length}, blocks={self.blocks})"

    # ------------------------------------------------------------------ building
    def share(self, blocks: list[int], rows: int) -> None:
        """Start the (empty) table with ``blocks`` of another holder (a cache entry, a parent sequence), whose
        first ``rows`` rows are this sequence's: one more reference each, nothing copied."""
        if self.blocks:
            raise RuntimeError("share() starts an empty block table")
        need = self.pool.blocks_for(rows)
        if need > len(blocks):
            raise ValueError(f"{rows} rows need {need} blocks, {len(blocks)} given")
        self.pool.incref(blocks[:need])
        self.blocks = list(blocks[:need])
        self.length = rows

    def reserve(self, rows: int) -> None:
        """Allocate blocks (after the last one when free) until the table holds ``rows`` rows."""
        need = self.pool.blocks_for(rows) - len(self.blocks)
        if need > 0:
            self.blocks += self.pool.alloc(need, after=self.blocks[-1] if self.blocks else None)

    def prepare_write(self, start: int, end: int) -> None:
        """Make rows ``[start, end)`` writable: blocks reserved, and a shared block among them replaced by a
        private copy of its rows before ``start`` (copy on write)."""
        self.reserve(end)
        bs = self.pool.block_size
        for index in range(start // bs, -(-end // bs)):
            block = self.blocks[index]
            if self.pool.refcount(block) > 1:
                fresh = self.pool.alloc(1, after=self.blocks[index - 1] if index else None)[0]
                keep = min(bs, max(0, min(start, self.length) - index * bs))  # rows already the sequence's
                if keep:
                    self.pool.copy_rows(block, fresh, keep)
                self.pool.decref([block])
                self.blocks[index] = fresh

    def slots(self, start: int, end: int) -> torch.Tensor:
        """Slot indices (int64, pool device) of rows ``[start, end)``."""
        return self.pool.slots(self.blocks, start, end)

    def run_start(self, rows: int | None = None) -> int | None:
        """First slot of rows ``[0, rows)`` (default: the filled rows) when their blocks are consecutive ids."""
        return self.pool.run_start(self.blocks, self.length if rows is None else rows)

    # ------------------------------------------------------------------ shrinking
    def truncate(self, rows: int) -> None:
        """Keep rows ``[0, rows)`` (speculative rollback, preemption); blocks past them are given back."""
        if rows > self.length:
            raise ValueError(f"cannot truncate a {self.length}-row sequence to {rows} rows")
        keep = self.pool.blocks_for(rows)
        if keep < len(self.blocks):
            self.pool.decref(self.blocks[keep:])
            del self.blocks[keep:]
        self.length = rows

    def release(self) -> None:
        """Give every block back (idempotent)."""
        if self._released:
            return
        self._released = True
        self.pool.decref(self.blocks)
        self.blocks = []
        self.length = 0

    def fork(self) -> BlockTable:
        """A new table sharing every block of this one (one more reference each); writes then copy on write."""
        child = BlockTable(self.pool)
        if self.blocks:
            child.share(self.blocks, self.length)
        return child
