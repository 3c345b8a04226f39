"""Assembly: a :class:`~kvboost.plan.ReusePlan` turned into a sequence's block table.

- **Exact hits by reference.** Each logical block of the exact prefix is, where it can be, the pool block a cached
  entry indexes (:class:`~kvboost.cache.block_run.BlockRun`): the table takes one more reference and nothing is
  copied (the lookup referenced those blocks already, so no allocation in between can have evicted them; the
  plan's own references go back at the end). A block covering rows of two chunks takes the block of the chunk holding its last row: that block was
  written by a sequence that had the same (exact, prefix-chained) rows before it, so its earlier rows are the
  earlier chunk's too. The partial last block of the prefix stays shared until the sequence writes its next row
  there, when it is copied (copy on write, in ``BlockTable.prepare_write``): the one copy an exact hit costs.
- **Loaded hits.** Entries a lower tier served (disk, Redis) or a quantizer stored (KIVI) are written, dequantized,
  into fresh blocks (straight into the pool when the rows are one strided run).
- **Content hits.** Copied into fresh blocks, keys re-rotated from their stored position to their new one
  (:class:`~kvboost.rope.RopeRotator`); the recompute strategy then decides what to refresh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvboost.cache.block_run import is_pooled
from kvboost.kv.block_table import BlockTable
from kvboost.plan import Placement, ReusePlan


@dataclass
class AssemblyStats:
    """What an assembly moved: blocks taken by reference, rows written from payloads or copied inside the pool."""

    shared_blocks: int = 0
    fresh_blocks: int = 0
    loaded_rows: int = 0
    copied_rows: int = 0


def assemble_exact(plan: ReusePlan, table: BlockTable, quantizer: Any) -> AssemblyStats:
    """Fill the empty ``table`` with the plan's exact prefix ``[0, plan.exact_prefix)``; ``table.length`` becomes
    the prefix length. The plan's references are released whatever happens; each block the table takes is in
    ``table.blocks`` from the moment its reference is taken, so a failed allocation (``PoolExhausted``) leaves
    nothing without an owner: the caller releases the table."""
    try:
        return _assemble(plan, table, quantizer)
    finally:
        plan.release()


def _assemble(plan: ReusePlan, table: BlockTable, quantizer: Any) -> AssemblyStats:
    pool = table.pool
    bs = pool.block_size
    frontier = plan.exact_prefix
    stats = AssemblyStats()
    if frontier == 0:
        return stats
    if table.blocks:
        raise RuntimeError("assemble_exact fills an empty block table")
    exact = [p for p in plan.placements if p.kind == "exact"]
    fresh: list[int] = []
    for index in range(pool.blocks_for(frontier)):
        last_row = min((index + 1) * bs, frontier) - 1
        owner = next(p for p in exact if p.start <= last_row < p.end)  # holds the block's last row of the prefix
        if is_pooled(owner.payload):
            table.append_shared(owner.payload.block_for_row(last_row))
            stats.shared_blocks += 1
        else:
            table.append_fresh()
            fresh.append(index)
            stats.fresh_blocks += 1
    table.length = frontier
    for index in fresh:  # rows of fresh blocks: from cached blocks or from payloads
        lo, hi = index * bs, min((index + 1) * bs, frontier)
        for p in exact:
            a, b = max(lo, p.start), min(hi, p.end)
            if a >= b:
                continue
            if is_pooled(p.payload):
                keys, values = p.payload.pool.read(p.payload.slots(b - p.start)[a - p.start :])
                pool.write(table.slots(a, b), keys, values)
                stats.copied_rows += b - a
            else:
                _write_payload(table, p, a, b, quantizer)
                stats.loaded_rows += b - a
    return stats


def _write_payload(table: BlockTable, p: Placement, a: int, b: int, quantizer: Any) -> None:
    """Rows ``[a, b)`` of placement ``p`` (dequantized KV or a quantized payload) into the table's slots."""
    pool = table.pool
    if p.payload is not None:  # lossy: decode the needed prefix of the payload, keep rows a..b
        keys = torch.empty(pool.num_layers, pool.num_kv_heads, b - p.start, pool.head_dim, dtype=pool.dtype,
                           device=pool.device)  # fmt: skip
        values = torch.empty_like(keys)
        quantizer.dequantize_into(p.payload, keys, values)
        keys, values = keys[:, :, a - p.start :], values[:, :, a - p.start :]
    else:
        keys, values = p.keys[:, :, a - p.start : b - p.start], p.values[:, :, a - p.start : b - p.start]
    pool.write(table.slots(a, b), keys, values)


def assemble_content(plan: ReusePlan, table: BlockTable, rotator: Any, strategy: Any = None) -> int:
    """Write every content hit into fresh blocks of ``table`` (rows after the exact prefix), keys re-rotated to
    their new positions; the table then spans the whole prompt (``length = len(plan)``: rows of new tokens are
    written by the forward before any query reads them). ``strategy``: the recompute strategy, whose
    ``content_kv`` gives the K/V each content placement is assembled from. Returns the rows written."""
    pool = table.pool
    n = len(plan)
    table.prepare_write(plan.exact_prefix, n)
    written = 0
    for p in plan.placements:
        if p.kind != "content":
            continue
        keys, values = (p.keys, p.values) if strategy is None else strategy.content_kv(plan, p)
        keys = keys.to(device=pool.device, dtype=pool.dtype)
        keys = rotator.rotate(keys, p.shift) if p.shift else keys
        pool.write(table.slots(p.start, p.end), keys, values)
        written += p.end - p.start
    table.length = n
    return written
