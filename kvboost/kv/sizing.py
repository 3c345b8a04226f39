"""How many blocks the engine's KV pool gets (``kv.pool_bytes``, or a share of free memory).

``pool_bytes="auto"``: room for the first memory tier's byte budget (its entries are references to pool blocks
when the quantizer is ``none``) plus a working set of ``4 * max_positions`` rows (at least 16k) for running
sequences, capped at ``fraction`` of the device's free memory (CPU: 0.5 of the available memory; CUDA: 0.9 of the
free memory, vLLM's ``gpu_memory_utilization`` default). CPU pages are mapped on first write, so an idle pool
costs address space, not memory.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvboost.cache.memory import parse_bytes
from kvboost.kv.pool import DEFAULT_BLOCK_SIZE, KVPool

#: Rows kept for running sequences beyond the cache's budget, as a multiple of the model's context (>= 16k).
WORKING_SET_CONTEXTS = 4
MIN_WORKING_ROWS = 16384


def free_memory_bytes(device: torch.device) -> int | None:
    """Free memory of ``device`` (None when unknown)."""
    try:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free)
        return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None


def pool_bytes_for(
    pool_bytes: Any, *, row_bytes: int, max_positions: int | None, cache_bytes: int, device: torch.device,
    fraction: float | None = None,
) -> int:  # fmt: skip
    """The pool's size in bytes for the ``kv.pool_bytes`` setting (``"auto"``, an int or ``"2GiB"``)."""
    if pool_bytes not in (None, "auto"):
        return parse_bytes(pool_bytes)
    share = fraction if fraction is not None else (0.9 if device.type == "cuda" else 0.5)
    if not 0 < share <= 1:
        raise ValueError(f"kv.memory_fraction must be in (0, 1], got {share}")
    rows = max(WORKING_SET_CONTEXTS * (max_positions or 4096), MIN_WORKING_ROWS)
    wanted = cache_bytes + rows * row_bytes
    free = free_memory_bytes(device)
    if free is not None:
        wanted = min(wanted, int(free * share))
    return wanted


def make_pool(adapter: Any, store: Any, kv: dict[str, Any]) -> KVPool:
    """The engine's pool for the model ``adapter`` describes and the ``kv`` settings (``block_size``,
    ``pool_bytes``, ``memory_fraction``), with room for ``store``'s first tier when it holds block references."""
    s, dtype, device = adapter.kv_shape, adapter.dtype, adapter.device
    block_size = kv.get("block_size", DEFAULT_BLOCK_SIZE)
    row_bytes = 2 * s.num_layers * s.num_kv_heads * s.head_dim * torch.empty((), dtype=dtype).element_size()
    first = store.tiers[0]
    cache_bytes = first.capacity_bytes if first.holds_references else 0
    nbytes = pool_bytes_for(kv.get("pool_bytes"), row_bytes=row_bytes, max_positions=adapter.max_positions,
                            cache_bytes=cache_bytes, device=device, fraction=kv.get("memory_fraction"))  # fmt: skip
    blocks = KVPool.blocks_in(nbytes, num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                              block_size=block_size, dtype=dtype)  # fmt: skip
    if blocks < 2:
        raise ValueError(f"kv.pool_bytes={kv.get('pool_bytes')!r} holds {blocks} blocks of {block_size} tokens; the "
                         "pool needs at least 2")  # fmt: skip
    return KVPool(num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, num_blocks=blocks,
                  block_size=block_size, dtype=dtype, device=device)  # fmt: skip
