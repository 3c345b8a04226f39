"""In-memory tier (device or host memory, wherever the tensors live) with a byte budget."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from kvboost.cache.entry import KVEntry
from kvboost.cache.tier_base import CacheTier
from kvboost.registry import CACHE_TIERS, EVICTION


def parse_bytes(value: int | float | str) -> int:
    """``1024``, ``"512MB"``, ``"2GiB"``, ``"1.5G"`` -> bytes."""
    if isinstance(value, (int, float)):
        out = int(value)
    else:
        text = str(value).strip().upper().replace(" ", "")
        units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "KB": 10**3, "MB": 10**6, "GB": 10**9,
                 "TB": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40, "B": 1}  # fmt: skip
        for suffix, mult in units.items():
            if text.endswith(suffix):
                try:
                    out = int(float(text[: -len(suffix)]) * mult)
                except ValueError:
                    raise ValueError(f"cannot read a byte size from {value!r}") from None
                break
        else:
            try:
                out = int(float(text))
            except ValueError:
                raise ValueError(f"cannot read a byte size from {value!r} (try '512MB' or '2GiB')") from None
    if out <= 0:
        raise ValueError(f"a byte budget must be positive, got {value!r}")
    return out


@CACHE_TIERS.register("memory")
class MemoryTier(CacheTier):
    """A dict of entries under a byte budget, evicting by the given policy.

    Args:
        capacity: byte budget (int or a string such as ``"2GiB"``).
        eviction: eviction policy name or config (default ``lru``).
    """

    def __init__(self, capacity: int | str = "2GiB", eviction: Any = "lru") -> None:
        self.capacity_bytes = parse_bytes(capacity)
        self.eviction = EVICTION.build(eviction)
        self._entries: dict[str, KVEntry] = {}
        self._used = 0
        self._pinned: set[str] = set()

    def put(self, entry: KVEntry) -> list[KVEntry]:
        if entry.nbytes > self.capacity_bytes:
            return [entry]  # rejected: it could never fit
        old = self._entries.pop(entry.key, None)
        if old is not None:
            self._used -= old.nbytes
            self.eviction.on_remove(entry.key)
            self._pinned.discard(entry.key)
        evicted: list[KVEntry] = []
        while self._used + entry.nbytes > self.capacity_bytes:
            victim = self.eviction.victim(protected=self._pinned)
            if victim is None:  # everything left is pinned
                return evicted + [entry]
            removed = self.remove(victim)
            if removed is not None:
                evicted.append(removed)
        self._entries[entry.key] = entry
        self._used += entry.nbytes
        if entry.pinned:
            self._pinned.add(entry.key)
        self.eviction.on_insert(entry.key)
        return evicted

    def get(self, key: str) -> KVEntry | None:
        entry = self._entries.get(key)
        if entry is not None:
            self.eviction.on_access(key)
        return entry

    def peek(self, key: str) -> KVEntry | None:
        return self._entries.get(key)

    def remove(self, key: str) -> KVEntry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._used -= entry.nbytes
            self._pinned.discard(key)
            self.eviction.on_remove(key)
        return entry

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> Iterator[str]:
        return iter(list(self._entries))

    @property
    def used_bytes(self) -> int:
        return self._used
