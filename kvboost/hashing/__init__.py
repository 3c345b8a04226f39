"""Hashers: chunk spans -> prefix-chained and content keys. ``HASHERS.build("sha256")``."""

from kvboost.hashing.base import Hasher, token_bytes
from kvboost.hashing.sha256 import Sha256Hasher

__all__ = ["Hasher", "Sha256Hasher", "token_bytes"]
