"""Hasher interface: per chunk a prefix-chained key and a segment-chained key."""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from array import array
from collections.abc import Sequence

from kvboost.types import ChunkKey, ChunkSpan

#: root keys remembered by ``salt_of_root`` (one per fingerprint and tenant salt seen)
_MAX_ROOTS = 65536


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Little-endian uint32 bytes of token ids: the same on every platform and process."""
    arr = array("I", token_ids)
    if arr.itemsize != 4:  # pragma: no cover - exotic platforms
        arr = array("L", token_ids)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


class Hasher(ABC):
    """Turns chunks into cache keys.

    Contract (checked by the conformance tests for every registered hasher):
    - deterministic across processes (no Python ``hash()``, no random salt);
    - ``prefix_key`` of chunk i depends on the fingerprint, the salt, chunk i's tokens and chunk i-1's
      ``prefix_key`` (so on every token before it);
    - ``segment_key`` of chunk i depends on the fingerprint, the salt, chunk i's tokens and the segment keys
      of the chunks before it *in its segment* only (``span.segment_start``): the same segment text has the
      same segment keys at any position after any history;
    - different fingerprints (model, dtype, KV quantizer, chunker...) or salts (tenants) give different keys.
    """

    registry_name: str = "?"

    @abstractmethod
    def digest(self, data: bytes) -> str:
        """Hex digest of ``data``."""

    def chunk_keys(
        self, token_ids: Sequence[int], spans: Sequence[ChunkSpan], fingerprint: str, salt: str = ""
    ) -> list[ChunkKey]:
        """Keys for each span: prefix keys chained from the prompt start, segment keys from the segment start."""
        fp = fingerprint.encode()
        keys: list[ChunkKey] = []
        # The first chunk's parent is a per-fingerprint (and per-salt) root, not "": the store indexes
        # children by parent, and a shared root would let the frontier match chunks of another model.
        parent = self.root_key(fingerprint, salt)
        segment_root = self.segment_root_key(fingerprint, salt)
        segment_parent = segment_root
        for span in spans:
            tokens = token_bytes(token_ids[span.start : span.end])
            if span.start == span.segment_start:
                segment_parent = segment_root
            prefix = self.digest(b"P" + fp + b"\0" + parent.encode() + b"\0" + tokens)
            segment = self.digest(b"S" + fp + b"\0" + segment_parent.encode() + b"\0" + tokens)
            keys.append(ChunkKey(prefix_key=prefix, segment_key=segment, parent_key=parent))
            parent, segment_parent = prefix, segment
        return keys

    def root_key(self, fingerprint: str, salt: str = "") -> str:
        """The parent key of every prompt's first chunk under ``fingerprint`` (and tenant ``salt``)."""
        root = self.digest(b"R" + fingerprint.encode() + b"\0" + salt.encode())
        roots = self.__dict__.setdefault("_root_salts", {})
        if root not in roots:
            if len(roots) >= _MAX_ROOTS:  # many tenants: forget the oldest
                del roots[next(iter(roots))]
            roots[root] = salt
        return root

    def salt_of_root(self, key: str) -> str | None:
        """The salt of root key ``key`` if this hasher made it (a prompt's first chunk has it as parent), else None.
        KV events use it: a first chunk gets ``parent_block_hash=None`` and its salt as an extra key."""
        return self.__dict__.get("_root_salts", {}).get(key)

    def segment_root_key(self, fingerprint: str, salt: str = "") -> str:
        """The chain start of every segment's first chunk."""
        return self.digest(b"G" + fingerprint.encode() + b"\0" + salt.encode())

    def fingerprint(self) -> str:
        return self.registry_name
