"""Eviction policy interface: which entry a full tier gives up first."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container


class EvictionPolicy(ABC):
    """Tracks a tier's keys and names victims.

    Contract (conformance tests): after ``on_insert(k)`` and until ``on_remove(k)``, ``victim()`` may
    return ``k``; it never returns a key in ``protected`` (pinned entries) nor a removed key, and
    returns ``None`` when nothing is evictable.
    """

    registry_name: str = "?"

    @abstractmethod
    def on_insert(self, key: str) -> None: ...

    @abstractmethod
    def on_access(self, key: str) -> None: ...

    @abstractmethod
    def on_remove(self, key: str) -> None: ...

    @abstractmethod
    def victim(self, protected: Container[str] = ()) -> str | None:
        """The key to evict next, or None."""
