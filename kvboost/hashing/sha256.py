"""SHA-256 chunk keys (hashlib: fast C implementation, collision-safe)."""

from __future__ import annotations

import hashlib

from kvboost.hashing.base import Hasher
from kvboost.registry import HASHERS


@HASHERS.register("sha256")
class Sha256Hasher(Hasher):
    """Hex SHA-256; 64 characters per key."""

    def digest(self, data: bytes) -> str:
        return hashlib.sha256(data).hexdigest()
