"""Eviction policy interface: which entry a full tier gives up first."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container


class EvictionPolicy(ABC):
    """Tracks a tier's keys and names victims; knows nothing of entries, bytes or the prefix tree.

    Contract (tests/test_cache_conformance.py runs it on every registered policy): after ``on_insert(k)``
    and until ``on_remove(k)``, ``victim()`` may return ``k``; it never returns a key in ``protected`` nor a
    key that was never inserted or was removed, and returns ``None`` when nothing is evictable. ``victim``
    is a query: it does not forget the key it names (the tier calls ``on_remove`` when it really evicts).

    The tier decides what is protected: pinned entries always, and, when ``leaves_first`` is true (the
    default), every entry that still has children resident in the store, so that a prefix chain is
    dropped from its tail (like a radix tree) and no cached descendant is stranded behind a missing
    ancestor. ``protected`` may be a lazy container: test membership only, never iterate it.

    Args:
        leaves_first: protect entries with resident children (False: the policy's order alone decides,
            which can strand the descendants of an evicted entry).
    """

    registry_name: str = "?"
    #: Class default, for subclasses that do not call ``super().__init__``.
    leaves_first: bool = True
    #: True when the policy implements ``set_evictable`` (every built-in policy does): a tier that knows which of
    #: its keys cannot be evicted now (the pool tier: entries whose blocks requests hold, pinned ones, parents
    #: of cached children) tells the policy as that changes, so ``victim`` never walks over them. A policy that
    #: leaves it False still works: such a tier then passes those keys in ``protected``, and ``victim`` skips
    #: them one by one, as before.
    tracks_evictable: bool = False

    def __init__(self, leaves_first: bool = True) -> None:
        self.leaves_first = bool(leaves_first)

    @abstractmethod
    def on_insert(self, key: str) -> None:
        """``key`` entered the tier (as the most recent)."""

    @abstractmethod
    def on_access(self, key: str) -> None:
        """``key`` was used (a hit, or a touch of a chain of hits); unknown keys are ignored."""

    @abstractmethod
    def on_remove(self, key: str) -> None:
        """``key`` left the tier (evicted, demoted, promoted or removed); unknown keys are ignored."""

    @abstractmethod
    def victim(self, protected: Container[str] = ()) -> str | None:
        """The key to evict next (tracked, not in ``protected``, not held by ``set_evictable``), or None when there
        is none."""

    def set_evictable(self, key: str, evictable: bool) -> None:
        """Whether ``victim`` may name ``key`` (tracked keys start evictable; ``on_insert`` makes a key evictable
        again). A held key keeps its place in the policy's order (its recency, its count) and returns to it when
        released. Unknown keys are ignored. Only for policies with ``tracks_evictable``."""
        raise NotImplementedError(f"eviction policy {self.registry_name!r} does not track evictable keys")
