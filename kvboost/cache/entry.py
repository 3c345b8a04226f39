"""One cached chunk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class KVEntry:
    """The KV of one chunk, computed in a real forward with the full history before it.

    ``key`` is the chunk's prefix-chained key; ``parent_key`` the key of the chunk before it (the
    store's tree edges); ``start`` the position the KV was computed at (DESIGN.md invariant 2: a
    content hit re-rotates from here). ``token_ids`` let the engine match a partially equal chunk at
    the frontier of a prompt token by token.
    """

    key: str
    content_key: str
    parent_key: str
    token_ids: tuple[int, ...]
    start: int
    payload: Any  # what the KV quantizer produced; has .nbytes and .num_tokens
    pinned: bool = False
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def nbytes(self) -> int:
        return int(self.payload.nbytes)
