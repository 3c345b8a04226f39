"""Paged KV memory: the pool of fixed-size blocks (:class:`KVPool`) and each sequence's block table."""

from kvboost.kv.block_table import BlockTable
from kvboost.kv.pool import DEFAULT_BLOCK_SIZE, KVPool, PoolExhausted

__all__ = ["DEFAULT_BLOCK_SIZE", "BlockTable", "KVPool", "PoolExhausted"]
