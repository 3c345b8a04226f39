"""One sequence's view of the KV pool: its block ids in logical order and how many rows are filled.

Logical row ``j`` of the sequence lives in block ``blocks[j // block_size]`` at offset ``j % block_size``. Blocks
may be shared with other sequences (reference counts in the pool) and indexed by cache entries; such a block is
never written: :meth:`BlockTable.prepare_write` copies it before rows are written into it (copy on write; in
practice only the partial last block of a shared or cached prefix, since the rows after a shared prefix are new).

The table owns one reference per block in ``blocks`` from the moment the id is appended: code that builds a table
appends each block as soon as its reference is taken (never through a local list), so an exception between two
allocations leaves every reference with an owner that ``release`` gives back.
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
        for block in blocks[:need]:
            self.append_shared(block)
        self.length = rows

    def reserve(self, rows: int) -> None:
        """Allocate blocks (after the last one when free) until the table holds ``rows`` rows."""
        need = self.pool.blocks_for(rows) - len(self.blocks)
        if need > 0:
            self.blocks += self.pool.alloc(need, after=self.blocks[-1] if self.blocks else None)

    def append_shared(self, block: int) -> None:
        """Append ``block`` (held by a cache entry or another table) with one more reference."""
        self.pool.incref([block])
        self.blocks.append(block)

    def append_fresh(self) -> int:
        """Append a newly allocated block (after the last one when free); returns its id."""
        block = self.pool.alloc(1, after=self.blocks[-1] if self.blocks else None)[0]
        self.blocks.append(block)
        return block

    def prepare_write(self, start: int, end: int) -> None:
        """Make rows ``[start, end)`` writable: blocks reserved, and a shared or cached block among them replaced
        by a private copy of its rows before ``start`` (copy on write)."""
        self.reserve(end)
        bs = self.pool.block_size
        for index in range(start // bs, -(-end // bs)):
            block = self.blocks[index]
            if not self.pool.writable(block):
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
        blocks, self.blocks, self.length = self.blocks, [], 0
        self.pool.decref(blocks)

    def fork(self) -> BlockTable:
        """A new table sharing every block of this one (one more reference each); writes then copy on write."""
        child = BlockTable(self.pool)
        if self.blocks:
            child.share(self.blocks, self.length)
        return child
