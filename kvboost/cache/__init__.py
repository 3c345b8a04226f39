"""KV store: tiers (``CACHE_TIERS``), eviction policies (``EVICTION``), the store that composes them."""

from kvboost.cache.entry import KVEntry
from kvboost.cache.eviction_base import EvictionPolicy
from kvboost.cache.lru import LRUEviction
from kvboost.cache.memory import MemoryTier, parse_bytes
from kvboost.cache.store import KVStore, StoreStats
from kvboost.cache.tier_base import CacheTier

__all__ = ["CacheTier", "EvictionPolicy", "KVEntry", "KVStore", "LRUEviction", "MemoryTier", "StoreStats", "parse_bytes"]
