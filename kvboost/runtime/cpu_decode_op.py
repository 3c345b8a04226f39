"""The C++ paged attention kernel (``kvboost/csrc/cpu_attention.cpp``'s ``paged_forward``) as a torch custom op, so that
the compiled CPU decode forward can call it from inside its graph.

Why: inductor's own decode attention (:func:`kvboost.runtime.llama.gathered_decode_attention`, a fused gather and
reduction) reads a sequence's keys about half as fast as the C++ kernel does, and in fp32 it is slower than the
BLAS products over contiguous rows that the decode step used before the KV pool (measured on a 2-core AMD Zen 4:
see ``experiments/results/README.md``, "The runtime"). The op reads the pool's blocks in place; inductor treats
it as an opaque call after the rows' K/V are written.
"""

from __future__ import annotations

import functools

import torch


@torch.library.custom_op("kvboost::cpu_paged_decode", mutates_args=())
def cpu_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     kv_lens: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:  # fmt: skip
    """One query per sequence: ``q`` ``[B, Hq, D]`` over one pool layer ``[Hkv, S, D]``; ``block_tables``
    ``[B, M]`` and ``kv_lens`` ``[B]`` int32; returns ``[B, Hq, D]`` (the paged contract with query ``b`` at
    position ``kv_lens[b] - 1``)."""
    from kvboost.attention.cpu_ext import load_cpu_extension

    batch = q.shape[0]
    out = torch.empty_like(q)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    load_cpu_extension().paged_forward(q.contiguous(), k_cache, v_cache, block_tables.contiguous(),
                                       kv_lens.contiguous(), starts, kv_lens - 1, block_size, scale, out, 32)  # fmt: skip
    return out


@cpu_paged_decode.register_fake
def _(q, k_cache, v_cache, block_tables, kv_lens, block_size, scale):
    return torch.empty_like(q)


@functools.cache
def cpu_paged_decode_unavailable_reason() -> str | None:
    """Why the compiled CPU decode cannot call the C++ kernel here (it is not buildable, or building it failed),
    or None. Builds the extension on first call (torch caches the binary)."""
    from kvboost.attention.cpu_ext import cpu_extension_unavailable_reason, load_cpu_extension

    reason = cpu_extension_unavailable_reason()
    if reason is not None:
        return reason
    try:
        load_cpu_extension()
    except RuntimeError as exc:
        return str(exc)
    return None
