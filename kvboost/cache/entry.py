"""One cached chunk."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

#: Primary-key prefix of entries stored under their segment key only (KV computed with repair).
SEGMENT_ONLY_PREFIX = "seg:"


@dataclass
class KVEntry:
    """The KV of one chunk and where it came from.

    Two kinds, told apart by ``exact``:

    - ``exact=True``: computed in a real forward with the full true history before it, so it equals what a
      cold prefill computes. ``key`` is the chunk's prefix-chained key and ``parent_key`` the key of the chunk
      before it (the store's tree edges, used by the frontier match and by leaves-first eviction).
    - ``exact=False``: computed with repair (after a content hit, so its history was approximate). It may only
      serve content hits: ``key`` is ``SEGMENT_ONLY_PREFIX + segment_key`` and ``parent_key`` is None.

    ``segment_key`` is chained from the start of the chunk's segment only (not from the prompt start), so the
    same document text has the same segment keys wherever it appears; every entry is indexed by it.
    ``start`` is the position the KV was computed at (DESIGN.md invariant 2: a content hit re-rotates from
    here). ``token_ids`` let the engine match a partially equal chunk at the frontier token by token.
    """

    key: str
    segment_key: str
    parent_key: str | None
    token_ids: tuple[int, ...]
    start: int
    payload: Any  # what the KV quantizer produced; has .nbytes and .num_tokens
    pinned: bool = False
    exact: bool = True

    def __post_init__(self) -> None:
        if self.exact and self.parent_key is None:
            raise ValueError(f"exact entry {self.key[:16]}... needs its parent key")
        if not self.exact and not self.key.startswith(SEGMENT_ONLY_PREFIX):
            raise ValueError(f"a repaired (non-exact) entry is stored under {SEGMENT_ONLY_PREFIX!r} + its segment key")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes)

    @property
    def first_token(self) -> int | None:
        return self.token_ids[0] if self.token_ids else None


def segment_only_key(segment_key: str) -> str:
    """Primary key of a repaired entry stored under its segment key only."""
    return SEGMENT_ONLY_PREFIX + segment_key


def approximate_segment_key(segment_key: str, strategy: str) -> str:
    """The segment key of KV computed with repair by the recompute strategy whose fingerprint is ``strategy``.

    Repaired KV is approximate and depends on the strategy and its settings (a CacheBlend ratio): entries of one
    strategy are never served to another (a ratio sweep sharing a disk tier would otherwise feed one arm's KV into
    the next). Exact entries keep the content segment key: they serve content hits under any strategy."""
    return hashlib.sha256(f"{segment_key}|approx={strategy}".encode()).hexdigest()
