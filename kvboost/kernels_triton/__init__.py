"""Triton kernels for kvboost, one file per kernel, each with a plain-torch reference beside it.

Attention contract shared by every attention kernel in the project (Triton here, CUDA in ``kvboost/csrc/``)::

    out = flash_attn_forward(
        q,                      # [B, Hq,  Lq, D]   fp16 / bf16 / fp32 (fp64 for the reference only)
        k,                      # [B, Hkv, Lk, D]   Hq % Hkv == 0 (grouped-query attention, K/V never repeated)
        v,                      # [B, Hkv, Lk, D]
        causal=True,            # False: every query sees every valid key
        sm_scale=None,          # default 1 / sqrt(D)
        q_positions=None,       # [B, Lq] or [Lq] int: the key index each query sits at; with causal=True a query
                                # attends keys j <= q_positions[b, i].  Default: Lk - Lq + i (bottom-right aligned,
                                # i.e. the queries are the last Lq tokens of the key sequence: cached prefix + new).
                                # Arbitrary (sorted or not) positions serve CacheBlend's selected-token recompute.
        kv_start=None,          # [B] int: first valid key of each row (left padding); default 0
        kv_len=None,            # [B] int: one past the last valid key of each row (right padding); default Lk
        out=None,               # [B, Hq, Lq, D] of q's dtype, any strides (e.g. the transposed view of a
                                # [B, Lq, Hq, D] buffer, transformers' layout): written in place and returned
        split_kv=None,          # None: the kernel picks its path; True / False force the split-KV (flash-decoding)
                                # / one-pass path. Results are the same either way (up to rounding).
    ) -> out                    # [B, Hq, Lq, D], dtype of q; a query with no valid key gets zeros

Valid keys of row b for query i: ``kv_start[b] <= j < kv_len[b]`` and (if causal) ``j <= q_positions[b, i]``.

The CUDA kernel (``kvboost.attention.cuda_ext.cuda_flash_attn_forward``) implements the same contract without
``q_positions`` (fp16/bf16, head dim 64/128). Both have a split-KV path for decode and for short suffixes over long
caches, where one program per (query tile, head) would leave most of the GPU idle.

Paged contract (attention over one layer of a block-table KV pool, written out in ``paged_attention_reference.py``,
whose ``paged_attention_reference`` is the plain-torch reference)::

    out = paged_attention(
        q,                      # [T, Hq, D]    the queries of B sequences, flattened
        k_cache, v_cache,       # [Hkv, S, D]   one layer of the pool, S = num_blocks * block_size slots
        block_tables=...,       # [B, M] int32  block ids per sequence, logical order
        kv_lens=...,            # [B] int32     keys per sequence
        query_start=...,        # [B + 1] int32 sequence b owns rows query_start[b]:query_start[b + 1] of q
        q_positions=...,        # [T] int32     query t sees key j iff j <= q_positions[t] and j < kv_lens[b]
        block_size=16, sm_scale=None, out=None,
    ) -> out                    # [T, Hq, D]; a query that sees no key gets zeros

``kvboost.kernels_triton.paged_attention.paged_attention`` (Triton: varlen prefill and split-K decode kernels) adds
``max_q_len`` / ``max_kv_len`` (upper bounds; with both given the call never synchronises, so it can be captured
in a CUDA graph) and ``decode`` (force the split-K or the prefill kernel).
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: the extra that installs triton (pyproject.toml): only GPUs need it; CPU installs go without
TRITON_EXTRA = "gpu"
TRITON_MISSING = (
    "the Triton kernels (kvboost.kernels_triton) need the `triton` package, which a CPU install of kvboost leaves "
    f"out: pip install 'kvboost[{TRITON_EXTRA}]' (or pip install triton), or choose a backend that needs no Triton "
    "(attn=sdpa or attn=cpu_kernel; kernel='torch' for KIVI)"
)


def import_triton() -> tuple[ModuleType, ModuleType]:
    """``(triton, triton.language)`` for the kernel modules, which import it at load time (``@triton.jit`` runs
    then); without triton a ModuleNotFoundError whose message names the extra that installs it."""
    try:
        return importlib.import_module("triton"), importlib.import_module("triton.language")
    except ModuleNotFoundError as exc:
        if exc.name is not None and exc.name != "triton" and not exc.name.startswith("triton."):
            raise  # triton is there but one of its own dependencies is not: its message says which
        raise ModuleNotFoundError(TRITON_MISSING, name="triton") from exc
