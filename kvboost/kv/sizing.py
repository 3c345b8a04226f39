"""How many blocks the engine's KV pool gets (``kv.pool_bytes``, or a share of free memory).

``pool_bytes="auto"``: room for the memory tier's byte budget (the pool is the memory tier when the quantizer is
lossless: cached chunks are runs of its blocks) plus a working set of ``4 * max_positions`` rows (at least 16k) for
running sequences, capped at ``fraction`` of the device's free memory (CPU: 0.5 of the available memory; CUDA: 0.9
of the free memory, vLLM's ``gpu_memory_utilization`` default, measured once the runner exists). CPU pages are
mapped on first write, so an idle pool costs address space, not memory.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from kvboost.kv.pool import DEFAULT_BLOCK_SIZE, KVPool

#: Rows kept for running sequences beyond the cache's budget, as a multiple of the model's context (>= 16k).
WORKING_SET_CONTEXTS = 4
MIN_WORKING_ROWS = 16384


def parse_bytes(value: float | str, *, allow_zero: bool = False) -> int:
    """``1024``, ``"512MB"``, ``"2GiB"``, ``"1.5G"`` -> bytes (positive, or ``>= 0`` with ``allow_zero``)."""
    if isinstance(value, (int, float)):
        out = int(value)
    else:
        text = str(value).strip().upper().replace(" ", "")
        units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
                 "TB": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "B": 1}  # fmt: skip
        for suffix, mult in units.items():
            if text.endswith(suffix):
                try:
                    out = int(float(text[: -len(suffix)]) * mult)
                except ValueError:
                    raise ValueError(f"cannot read a byte size from {value!r}") from None
                break
        else:
            try:
                out = int(float(text))
            except ValueError:
                raise ValueError(f"cannot read a byte size from {value!r} (try '512MB' or '2GiB')") from None
    if out < 0 or (out == 0 and not allow_zero):
        raise ValueError(f"a byte budget must be {'>= 0' if allow_zero else 'positive'}, got {value!r}")
    return out


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
    fraction: float | None = None, reserve: int = 0,
) -> int:  # fmt: skip
    """The pool's size in bytes for the ``kv.pool_bytes`` setting (``"auto"``, an int or ``"2GiB"``); ``reserve``:
    bytes of the free memory left to what the pool does not hold (a forward's activations)."""
    if pool_bytes not in (None, "auto"):
        return parse_bytes(pool_bytes)
    share = fraction if fraction is not None else (0.9 if device.type == "cuda" else 0.5)
    if not 0 < share <= 1:
        raise ValueError(f"kv.memory_fraction must be in (0, 1], got {share}")
    rows = max(WORKING_SET_CONTEXTS * (max_positions or 4096), MIN_WORKING_ROWS)
    wanted = cache_bytes + rows * row_bytes
    free = free_memory_bytes(device)
    if free is not None:
        wanted = min(wanted, int(max(0, free - reserve) * share))
    return wanted


def row_block_bytes(adapter: Any, kv: dict[str, Any]) -> int:
    """Bytes of one pool block of this model."""
    s = adapter.kv_shape
    element = torch.empty((), dtype=adapter.dtype).element_size()
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * element * kv.get("block_size", DEFAULT_BLOCK_SIZE)


def activation_bytes(adapter: Any, tokens: int) -> int:
    """A bound on the activations of a forward of ``tokens`` rows (hidden states, q/k/v, the gated MLP's two
    intermediates, fp32 attention scratch), kept free when an ``auto`` pool is sized on a GPU."""
    cfg = adapter.model.config.get_text_config(decoder=True)
    element = torch.empty((), dtype=adapter.dtype).element_size()
    hidden, inter = int(cfg.hidden_size), int(getattr(cfg, "intermediate_size", 4 * cfg.hidden_size))
    return tokens * (6 * hidden + 3 * inter) * element + tokens * hidden * 4 * 2


def make_pool(adapter: Any, cache_bytes: int, kv: dict[str, Any], *, reserve: int = 0) -> KVPool:
    """The engine's pool for the model ``adapter`` describes and the ``kv`` settings (``block_size``,
    ``pool_bytes``, ``memory_fraction``), with room for ``cache_bytes`` of cached chunks; ``reserve`` bytes of the
    free memory stay free (``pool_bytes_for``)."""
    s, dtype, device = adapter.kv_shape, adapter.dtype, adapter.device
    block_size = kv.get("block_size", DEFAULT_BLOCK_SIZE)
    row_bytes = 2 * s.num_layers * s.num_kv_heads * s.head_dim * torch.empty((), dtype=dtype).element_size()
    nbytes = pool_bytes_for(kv.get("pool_bytes"), row_bytes=row_bytes, max_positions=adapter.max_positions,
                            cache_bytes=cache_bytes, device=device, fraction=kv.get("memory_fraction"),
                            reserve=reserve)  # fmt: skip
    blocks = KVPool.blocks_in(nbytes, num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                              block_size=block_size, dtype=dtype)  # fmt: skip
    if blocks < 2:
        raise ValueError(f"kv.pool_bytes={kv.get('pool_bytes')!r} holds {blocks} blocks of {block_size} tokens; the "
                         "pool needs at least 2")  # fmt: skip
    return KVPool(num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, num_blocks=blocks,
                  block_size=block_size, dtype=dtype, device=device)  # fmt: skip
