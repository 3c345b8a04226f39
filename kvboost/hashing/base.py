"""Hasher interface: per chunk a prefix-chained key and a content key."""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array
from collections.abc import Sequence

from kvboost.types import ChunkKey, ChunkSpan


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Little-endian uint32 bytes of token ids: the same on every platform and process."""
    arr = array("I", token_ids)
    if arr.itemsize != 4:  # pragma: no cover - exotic platforms
        arr = array("L", token_ids)
    import sys

    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


class Hasher(ABC):
    """Turns chunks into cache keys.

    Contract (checked by the conformance tests for every registered hasher):
    - deterministic across processes (no Python ``hash()``, no random salt);
    - ``prefix_key`` of chunk i depends on the fingerprint, chunk i's tokens and chunk i-1's
      ``prefix_key`` (so on every token before it); ``content_key`` on the fingerprint and the
      tokens only;
    - different fingerprints (model, dtype, KV quantizer, chunker...) give different keys.
    """

    registry_name: str = "?"

    @abstractmethod
    def digest(self, data: bytes) -> str:
        """Hex digest of ``data``."""

    def chunk_keys(
        self, token_ids: Sequence[int], spans: Sequence[ChunkSpan], fingerprint: str
    ) -> list[ChunkKey]:
        """Keys for each span, chained from the start of the prompt."""
        fp = fingerprint.encode()
        keys: list[ChunkKey] = []
        # The first chunk's parent is a per-fingerprint root, not "": the store indexes children by
        # parent, and a shared root would let the frontier match chunks of another model.
        parent = self.root_key(fingerprint)
        for span in spans:
            tokens = token_bytes(token_ids[span.start : span.end])
            prefix = self.digest(b"P" + fp + b"\0" + parent.encode() + b"\0" + tokens)
            content = self.digest(b"C" + fp + b"\0" + tokens)
            keys.append(ChunkKey(prefix_key=prefix, content_key=content, parent_key=parent))
            parent = prefix
        return keys

    def root_key(self, fingerprint: str) -> str:
        """The parent key of every prompt's first chunk under ``fingerprint``."""
        return self.digest(b"R" + fingerprint.encode())

    def fingerprint(self) -> str:
        return self.registry_name
