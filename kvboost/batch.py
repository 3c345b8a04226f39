"""Batch helpers of the original KVBoost API (``kvboost.batch``): shared-prefix detection, KV broadcast, grouping.

``generate_batch`` and ``generate_many`` do not need them (the engine batches through its scheduler and groups with
:func:`kvboost.runtime.grouping.group_by_prefix`, whose shared prefixes are computed once and shared by block
reference); they are kept for code written against the original project::

    from kvboost.batch import find_common_chunk_prefix, broadcast_kv, group_by_prefix
    n = find_common_chunk_prefix([ids_a, ids_b], chunk_size=128)   # tokens in whole chunks shared by all
    kv_b = broadcast_kv(kv, batch_size=4)                            # [1, H, S, D] -> [4, H, S, D], no copy
    groups = group_by_prefix(prompts, ids, chunk_size=128)           # {prefix key: [prompt indices]}
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from kvboost.cache.sequence_store import common_prefix_length
from kvboost.hashing.base import token_bytes


def find_common_chunk_prefix(all_token_ids: Sequence[Sequence[int]], chunk_size: int) -> int:
    """Length of the longest chunk-aligned prefix every prompt shares: whole chunks of ``chunk_size`` tokens,
    stopping at the first chunk where any prompt differs (or that any prompt does not fill). As in the original, a
    single prompt returns its own length and no prompt returns 0."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if len(all_token_ids) < 2:
        return len(all_token_ids[0]) if all_token_ids else 0
    first = all_token_ids[0]
    shared = min(common_prefix_length(first, ids) for ids in all_token_ids[1:])
    return shared // chunk_size * chunk_size


def broadcast_kv(kv: Sequence[tuple[Any, Any]], batch_size: int) -> tuple[tuple[Any, Any], ...]:
    """Expand a one-row KV (per layer ``(keys, values)`` of shape ``[1, heads, seq, head_dim]``, HF's legacy
    ``past_key_values``) to ``batch_size`` rows with ``expand``: no copy, the rows share storage (do not write
    into them)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    out = []
    for keys, values in kv:
        if keys.shape[0] != 1 or values.shape[0] != 1:
            raise ValueError(f"broadcast_kv expands one row; got batch {keys.shape[0]} (keys {tuple(keys.shape)})")
        out.append((keys.expand(batch_size, -1, -1, -1), values.expand(batch_size, -1, -1, -1)))
    return tuple(out)


def group_by_prefix(prompts: Sequence[Any], token_ids_list: Sequence[Sequence[int]], chunk_size: int,
                    n_prefix_chunks: int = 3) -> dict[str, list[int]]:  # fmt: skip
    """Prompt indices grouped by their first ``n_prefix_chunks`` chunks (``chunk_size`` tokens each; a shorter
    prompt by all its tokens): ``{sha256 of those token ids: [indices in order]}``, ``"empty"`` for empty prompts.
    ``prompts`` is accepted for the original signature (only its length is checked)."""
    if len(prompts) != len(token_ids_list):
        raise ValueError(f"{len(prompts)} prompts but {len(token_ids_list)} token id lists")
    for name, value in (("chunk_size", chunk_size), ("n_prefix_chunks", n_prefix_chunks)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    groups: dict[str, list[int]] = {}
    for i, ids in enumerate(token_ids_list):
        prefix = list(ids[: n_prefix_chunks * chunk_size])
        key = hashlib.sha256(token_bytes(prefix)).hexdigest() if prefix else "empty"
        groups.setdefault(key, []).append(i)
    return groups


__all__ = ["broadcast_kv", "find_common_chunk_prefix", "group_by_prefix"]
