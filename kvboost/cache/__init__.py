"""KV store: tiers (``CACHE_TIERS``), eviction policies (``EVICTION``), the store that composes them."""

from kvboost.cache.disk import DiskTier
from kvboost.cache.entry import SEGMENT_ONLY_PREFIX, KVEntry, segment_only_key
from kvboost.cache.eviction_base import EvictionPolicy
from kvboost.cache.lfu import LFUEviction
from kvboost.cache.lru import LRUEviction
from kvboost.cache.memory import MemoryTier
from kvboost.cache.redis_tier import RedisTier
from kvboost.cache.s3fifo import S3FIFOEviction
from kvboost.cache.store import KVStore, StoreStats
from kvboost.cache.tier_base import CacheTier, EvictionGuard, ResidentChildren

__all__ = [
    "SEGMENT_ONLY_PREFIX",
    "CacheTier",
    "DiskTier",
    "EvictionGuard",
    "EvictionPolicy",
    "KVEntry",
    "KVStore",
    "LFUEviction",
    "LRUEviction",
    "MemoryTier",
    "RedisTier",
    "ResidentChildren",
    "S3FIFOEviction",
    "StoreStats",
    "segment_only_key",
]  # fmt: skip
