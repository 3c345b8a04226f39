"""Cache tier interface: a key -> KVEntry store with a byte budget."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

from kvboost.cache.entry import KVEntry


class CacheTier(ABC):
    """One level of the KV store (memory, disk, ...).

    Contract (conformance tests run it on every registered tier):
    - ``put`` stores the entry and returns the entries it had to evict to stay within
      ``capacity_bytes`` (never the entry just put, unless it alone exceeds the budget: then it
      is returned as rejected and not stored);
    - ``get`` returns the stored entry or None and counts as an access for eviction;
    - ``used_bytes`` never exceeds ``capacity_bytes`` after ``put`` returns;
    - pinned entries are never evicted.
    """

    registry_name: str = "?"
    capacity_bytes: int

    @abstractmethod
    def put(self, entry: KVEntry) -> list[KVEntry]: ...

    @abstractmethod
    def get(self, key: str) -> KVEntry | None: ...

    @abstractmethod
    def peek(self, key: str) -> KVEntry | None:
        """Like get, without counting an access."""

    @abstractmethod
    def remove(self, key: str) -> KVEntry | None: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def keys(self) -> Iterator[str]: ...

    @property
    @abstractmethod
    def used_bytes(self) -> int: ...

    def touch(self, key: str) -> None:
        """Mark ``key`` as used now (for eviction order) without returning it."""
        self.get(key)

    def clear(self) -> None:
        for key in list(self.keys()):
            self.remove(key)
