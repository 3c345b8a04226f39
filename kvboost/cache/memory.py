"""In-memory tier of standalone payloads (wherever their tensors live) with a byte budget.

With a lossless KV quantizer the engine serves ``cache: memory`` from its KV pool instead (``PoolTier``: entries
are runs of pool blocks, the pool is the budget). This tier holds what is not rows of the pool: quantized payloads
(``quant=kivi*``: the pool then caches nothing and hits are dequantized into fresh blocks), a host-memory tier below
the pool on a GPU (``kv.host_bytes``: ``device="cpu"``; a hit is copied into the request's fresh blocks), and the
cache simulators' payloads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvboost.cache.entry import KVEntry
from kvboost.cache.payload import payload_to_device
from kvboost.cache.tier_base import DictTier, choose_victims
from kvboost.kv.sizing import parse_bytes
from kvboost.registry import CACHE_TIERS, EVICTION


@CACHE_TIERS.register("memory")
class MemoryTier(DictTier):
    """A dict of entries (standalone payloads) under a byte budget, evicting by the given policy.

    ``put`` chooses all its victims before evicting any (each chosen victim counts as gone for the
    leaves-first guard, so its parent may be chosen next): if they cannot free enough room, the entry is
    rejected and nothing is evicted.

    Args:
        capacity: byte budget (int or a string such as ``"2GiB"``).
        eviction: eviction policy: a name, a config mapping (``{"name": "lru", "leaves_first": true}``) or
            an ``EvictionPolicy`` instance not shared with another tier (default ``lru``).
        device: where its payloads live (``"cpu"``: a host-memory tier below a GPU's pool); None: where they come.
    """

    def __init__(self, capacity: int | str = "2GiB", eviction: Any = "lru", device: str | None = None) -> None:
        self.capacity_bytes = parse_bytes(capacity)
        self.device = torch.device(device) if device is not None else None
        self.eviction = EVICTION.build("lru" if eviction is None else eviction)
        self._entries: dict[str, KVEntry] = {}
        self._used = 0
        self._pinned: set[str] = set()

    def put(self, entry: KVEntry) -> list[KVEntry]:
        if entry.nbytes > self.capacity_bytes:
            return [entry]  # rejected: it could never fit
        old = self._entries.get(entry.key)
        freed = old.nbytes if old is not None else 0
        need = self._used - freed + entry.nbytes - self.capacity_bytes
        victims: list[str] = []
        if need > 0:
            victims = choose_victims(self, self.eviction, self._pinned, entry, need, self._entries.get)
            if victims is None:  # everything left is protected: reject, evict nothing
                return [entry]
        if self.device is not None:
            entry = dataclasses.replace(entry, payload=payload_to_device(entry.payload, self.device))
        evicted = [e for e in (self.remove(k) for k in victims) if e is not None]
        if old is not None:
            self.remove(entry.key)
        self._entries[entry.key] = entry
        self._used += entry.nbytes
        if entry.pinned:
            self._pinned.add(entry.key)
        self.eviction.on_insert(entry.key)
        return evicted

    def remove(self, key: str) -> KVEntry | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._used -= entry.nbytes
            self._pinned.discard(key)
            self.eviction.on_remove(key)
        return entry

    @property
    def used_bytes(self) -> int:
        return self._used
