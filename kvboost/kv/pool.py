"""The KV pool: the K and V of every layer in fixed-size blocks, reference-counted; the only KV memory of an engine.

Layout: ``keys``/``values`` ``[layers, kv_heads, num_blocks * block_size, head_dim]``. Block ``b`` is slots
``[b * block_size, (b + 1) * block_size)`` of every layer and head. One layer's pool, ``keys[layer]``
``[kv_heads, slots, head_dim]``, is what the paged attention contract
(``kvboost.kernels_triton.paged_attention_reference``) reads. A sequence whose blocks are consecutive ids is a plain strided view of that layer (see
:meth:`KVPool.run_view`), so the allocator prefers consecutive ids: a sequence that grows asks for the block after
its last one first.

Books and tensors are apart, in the spirit of vLLM's block pool: this class counts references and hands out ids;
tensor movement is a few explicit methods (``write``, ``read``, ``copy_rows``), each counting the bytes it moves in
:attr:`KVPool.stats` (``copied_bytes`` is what a reuse by reference must keep to a partial block).

The pool is also the prefix cache's memory (``kvboost.cache.pool_tier``): one reference count per block, held by
the block tables of running requests and by pins, and beside it a *cached* count, how many cache entries index
rows of the block. Entries hold no references. A block is in one of three states:

- **free**: no reference, not cached; ``alloc`` hands it out first;
- **idle**: no reference, cached: its contents stay (a later hit takes a reference on it again) until ``alloc``
  needs it: then the pool's ``cache`` evicts the entries indexing it, in its eviction policy's order. The pool
  tells its ``watcher`` (the pool tier) each time a cached block turns idle or referenced, so the tier keeps its
  evictable entries apart, in policy order (the idea of vLLM v1's free block queue): ``alloc`` takes the policy's
  first evictable entry, without walking over entries requests or pins hold;
- **in use**: referenced. A cached block is never written again (``BlockTable.prepare_write`` copies it).

Invariants (``verify`` checks them): a block is free iff it has no reference and is not cached; ``alloc`` never
returns a block in use or cached; ``decref`` of an unreferenced block is an error (a double free), never silent;
``incref`` of a free block is an error (its rows are garbage); only a referenced block becomes cached.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

#: Default tokens per block (vLLM's default as well).
DEFAULT_BLOCK_SIZE = 16


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back a CPU tensor's (not yet touched) pages with 2 MiB transparent huge pages, where the kernel
    allows it on request (``/sys/kernel/mm/transparent_hugepage/enabled`` ``madvise`` or ``always``). A sequence's
    blocks are scattered over a pool of gigabytes: with 4 KiB pages every block a decode step reads is a TLB miss
    (one block of one head is 2 KiB in bf16). Returns whether the advice was taken (False elsewhere: harmless)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < 2 * _HUGE_PAGE or not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        start = -(-tensor.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE  # inward to whole huge pages
        end = (tensor.data_ptr() + nbytes) // _HUGE_PAGE * _HUGE_PAGE
        if end <= start:
            return False
        return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


class PoolExhausted(RuntimeError):
    """The pool has too few free blocks for a request, even after the cache gave back what it could."""


class BlockCache(Protocol):
    """What a pool asks of the cache that indexes its idle blocks (``kvboost.cache.store.KVStore``)."""

    def reclaim(self, free_blocks: int) -> None:
        """Evict idle cached entries, in eviction order, until ``free_blocks`` blocks are free or none is left."""


class BlockWatcher(Protocol):
    """Told when cached blocks change between idle and referenced (``kvboost.cache.pool_tier.PoolTier``)."""

    def blocks_referenced(self, ids: list[int]) -> None:
        """These cached blocks were idle and now have a reference."""

    def blocks_idle(self, ids: list[int]) -> None:
        """These cached blocks lost their last reference (they stay cached)."""


@dataclass
class PoolStats:
    """Counters since the pool was made (or ``reset_stats``): blocks handed out and given back, and the bytes
    moved by each kind of copy."""

    allocated_blocks: int = 0
    freed_blocks: int = 0
    written_bytes: int = 0  # rows written from outside (loaded entries, content hits, dequantized payloads)
    read_bytes: int = 0  # rows copied out (stored to a tier below memory, quantized, inspected)
    copied_bytes: int = 0  # rows copied inside the pool (copy on write of a partial block)
    copy_on_write: int = 0  # partial blocks copied
    pressure_calls: int = 0  # times the pool asked the cache to give blocks back
    reclaimed_blocks: int = 0  # idle cached blocks made free by those calls


class KVPool:
    """K/V blocks of every layer, with reference counts.

    Args:
        num_layers, num_kv_heads, head_dim: the model's KV shape.
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        dtype, device: of the tensors.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("num_blocks", num_blocks), ("block_size", block_size)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KV pool: {name} must be a positive integer, got {value!r}")
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.num_blocks, self.block_size = num_blocks, block_size
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_layers, num_kv_heads, num_blocks * block_size, head_dim)
        # torch.empty maps pages lazily: an idle pool costs address space, not memory, until rows are written.
        self.keys = torch.empty(shape, dtype=dtype, device=self.device)
        self.values = torch.empty(shape, dtype=dtype, device=self.device)
        self.huge_pages = self.device.type == "cpu" and all(_advise_huge_pages(t) for t in (self.keys, self.values))
        self._refs = [0] * num_blocks
        self._cached = [0] * num_blocks  # cache entries indexing rows of each block (they hold no reference)
        self._free = bytearray(b"\x01") * num_blocks  # 1 = free; bytes.find gives C-speed run searches
        self._num_free = num_blocks
        self._num_idle = 0  # cached, unreferenced
        self._num_cached = 0  # cached, referenced or not
        self.stats = PoolStats()
        #: The cache whose entries index this pool's blocks (set by ``KVStore.attach_pool``): ``alloc`` asks it
        #: to evict idle entries when free blocks run short. None: the pool caches nothing.
        self.cache: BlockCache | None = None
        #: Told when cached blocks turn idle or referenced (set by ``KVStore`` to its pool tier); None: no one.
        self.watcher: BlockWatcher | None = None

    # ------------------------------------------------------------------ sizes
    @property
    def block_bytes(self) -> int:
        """Bytes of one block, K and V, every layer."""
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * self.keys.element_size()

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K and V, every layer."""
        return self.block_bytes // self.block_size

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        """Blocks that are not free (referenced, or idle and cached)."""
        return self.num_blocks - self._num_free

    @property
    def num_idle(self) -> int:
        """Cached blocks no one references: free to take once the cache evicts their entries."""
        return self._num_idle

    @property
    def num_cached(self) -> int:
        """Blocks some cache entry indexes (referenced or idle)."""
        return self._num_cached

    @property
    def num_referenced(self) -> int:
        """Blocks held by a block table or a pin."""
        return self.num_blocks - self._num_free - self._num_idle

    @property
    def num_available(self) -> int:
        """Free blocks plus idle cached ones: what ``alloc`` can hand out after evicting (an upper bound: an idle
        entry a leaves-first policy protects stays)."""
        return self._num_free + self._num_idle

    def blocks_for(self, rows: int) -> int:
        """Blocks that hold ``rows`` rows."""
        return -(-rows // self.block_size)

    @staticmethod
    def blocks_in(nbytes: int, *, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                  dtype: torch.dtype) -> int:  # fmt: skip
        """How many blocks of this shape fit ``nbytes``."""
        element = torch.empty((), dtype=dtype).element_size()
        return nbytes // (2 * num_layers * num_kv_heads * block_size * head_dim * element)

    # ------------------------------------------------------------------ references
    def alloc(self, count: int, *, after: int | None = None) -> list[int]:
        """``count`` free blocks, each with one reference. ``after``: a block id the new blocks should follow
        (a sequence's last block): consecutive ids are tried first, then any run of ``count``, then any blocks.

        Raises:
            PoolExhausted: fewer than ``count`` blocks are free after the cache evicted what it could.
        """
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count == 0:
            return []
        self.reclaim(count)
        if self._num_free < count:
            raise PoolExhausted(
                f"the KV pool has {self._num_free} free blocks of {self.block_size} tokens, {count} are needed "
                f"({self.num_blocks} blocks in all, {self.num_blocks * self.block_size} tokens, "
                f"{self.num_blocks * self.block_bytes / 2**20:.0f} MiB; {self.num_referenced} held by requests and "
                f"pins, {self._num_idle} cached and not evictable now); raise kv.pool_bytes, lower max_new_tokens "
                "or the batch size, or shorten the prompt"
            )
        ids = self._find(count, after)
        for b in ids:
            self._free[b] = 0
            self._refs[b] = 1
        self._num_free -= count
        self.stats.allocated_blocks += count
        return ids

    def reclaim(self, count: int) -> int:
        """Have the cache evict idle entries until ``count`` blocks are free; returns the free count. A scheduler
        calls it before admitting work, ``alloc`` before failing."""
        if self._num_free < count and self._num_idle and self.cache is not None:
            self.stats.pressure_calls += 1
            before = self._num_free
            self.cache.reclaim(count)
            self.stats.reclaimed_blocks += self._num_free - before
        return self._num_free

    def _find(self, count: int, after: int | None) -> list[int]:
        run = b"\x01" * count
        if after is not None and 0 <= after + 1 and after + 1 + count <= self.num_blocks:
            start = after + 1
            if self._free[start : start + count] == run:
                return list(range(start, start + count))
        # First fit from the lowest id: blocks freed by finished sequences are reused first, so the pool's working
        # set stays in memory already touched (a block in untouched memory costs page faults on first write:
        # with huge pages, zeroing 2 MiB per layer and head; measured 13 ms for one copy on write).
        start = self._free.find(run)
        if start >= 0:
            return list(range(start, start + count))
        ids, pos = [], 0  # fragmented: any free blocks, lowest first
        while len(ids) < count:
            pos = self._free.find(b"\x01", pos)
            ids.append(pos)
            pos += 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """One more reference to each block (a sequence that shares it, a hit on a cached block, a pin)."""
        woken: list[int] = []
        try:
            for b in ids:
                refs = self._refs[b]
                if refs <= 0:
                    if not self._cached[b]:
                        raise RuntimeError(f"KV pool: incref of free block {b}")
                    self._num_idle -= 1  # a hit on an idle cached block
                    woken.append(b)
                self._refs[b] = refs + 1
        finally:  # the watcher hears of every block counted, even when a later one raised
            if woken and self.watcher is not None:
                self.watcher.blocks_referenced(woken)

    def decref(self, ids: Iterable[int]) -> None:
        """One reference fewer to each block; at 0 a cached block is idle, any other free."""
        idle: list[int] = []
        try:
            for b in ids:
                refs = self._refs[b]
                if refs <= 0:
                    raise RuntimeError(f"KV pool: block {b} released more often than it was referenced (double free)")
                self._refs[b] = refs - 1
                if refs == 1:
                    if self._cached[b]:
                        self._num_idle += 1
                        idle.append(b)
                    else:
                        self._release(b)
        finally:
            if idle and self.watcher is not None:
                self.watcher.blocks_idle(idle)

    def mark_cached(self, ids: Iterable[int]) -> None:
        """One more cache entry indexes each block (its rows are final: never written again). Only a referenced
        block can become cached: the entry is registered while a block table still holds its rows."""
        for b in ids:
            cached = self._cached[b]
            if self._refs[b] <= 0 and not cached:
                raise RuntimeError(f"KV pool: block {b} is free; only a block a request holds can be cached")
            self._cached[b] = cached + 1
            self._num_cached += not cached

    def unmark_cached(self, ids: Iterable[int]) -> None:
        """One cache entry fewer indexes each block; a block neither cached nor referenced is free again."""
        for b in ids:
            cached = self._cached[b]
            if cached <= 0:
                raise RuntimeError(f"KV pool: block {b} is not cached")
            self._cached[b] = cached - 1
            if cached == 1:
                self._num_cached -= 1
                if self._refs[b] == 0:
                    self._num_idle -= 1
                    self._release(b)

    def _release(self, b: int) -> None:
        self._free[b] = 1
        self._num_free += 1
        self.stats.freed_blocks += 1

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def cached_count(self, block: int) -> int:
        """How many cache entries index rows of ``block``."""
        return self._cached[block]

    def is_cached(self, block: int) -> bool:
        """Whether a cache entry indexes rows of ``block`` (its rows are read-only)."""
        return self._cached[block] > 0

    def writable(self, block: int) -> bool:
        """Whether one holder may write rows of ``block`` in place: it holds the only reference and no cache
        entry indexes it."""
        return self._refs[block] == 1 and not self._cached[block]

    # ------------------------------------------------------------------ rows
    def slots(self, blocks: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Slot indices (int64, on the pool's device) of logical rows ``[start, end)`` of a sequence whose block
        table is ``blocks``."""
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs if end > start else start // bs
        if end > start and last >= len(blocks):
            raise ValueError(f"rows up to {end} need {last + 1} blocks; the table has {len(blocks)}")
        if end <= start:
            return torch.empty(0, dtype=torch.long, device=self.device)
        table = torch.tensor(blocks[first : last + 1], dtype=torch.long)
        rows = torch.arange(start, end) - first * bs
        return (table[rows // bs] * bs + rows % bs).to(self.device)

    def run_start(self, blocks: Sequence[int], rows: int) -> int | None:
        """The first slot of the sequence when its first ``ceil(rows / block_size)`` blocks are consecutive ids
        (its rows are then one strided view of each layer), else None."""
        n = self.blocks_for(rows)
        if n == 0:
            return 0
        first = blocks[0]
        if n == 1 or blocks[n - 1] - first == n - 1 and all(blocks[i] == first + i for i in range(1, n)):
            return first * self.block_size
        return None

    def write(self, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write stacked rows ``[layers, kv_heads, t, head_dim]`` into ``slots`` (``[t]``) of every layer."""
        if keys.shape[2] != slots.numel():
            raise ValueError(f"{keys.shape[2]} rows for {slots.numel()} slots")
        slots = slots.to(self.device)
        self.keys.index_copy_(2, slots, keys.to(device=self.device, dtype=self.dtype))
        self.values.index_copy_(2, slots, values.to(device=self.device, dtype=self.dtype))
        self.stats.written_bytes += slots.numel() * self.row_bytes

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the rows at ``slots``: ``[layers, kv_heads, t, head_dim]`` each."""
        slots = slots.to(self.device)
        self.stats.read_bytes += slots.numel() * self.row_bytes
        return self.keys.index_select(2, slots), self.values.index_select(2, slots)

    def copy_rows(self, src: int, dst: int, rows: int) -> None:
        """Copy the first ``rows`` rows of block ``src`` into block ``dst`` (copy on write of a partial block)."""
        bs = self.block_size
        s, d = src * bs, dst * bs
        self.keys[:, :, d : d + rows] = self.keys[:, :, s : s + rows]
        self.values[:, :, d : d + rows] = self.values[:, :, s : s + rows]
        self.stats.copied_bytes += rows * self.row_bytes
        self.stats.copy_on_write += 1

    def reset_stats(self) -> None:
        self.stats = PoolStats()

    # ------------------------------------------------------------------ checks
    def verify(self) -> None:
        """Check the books (AssertionError on a mismatch); for tests."""
        free = sum(self._free)
        assert free == self._num_free, f"free count {self._num_free} != {free} free flags"
        idle = cached_blocks = 0
        for b, (refs, cached, flag) in enumerate(zip(self._refs, self._cached, self._free, strict=True)):
            assert refs >= 0 and cached >= 0, f"block {b} has {refs} references and {cached} cache entries"
            assert (refs == 0 and cached == 0) == bool(flag), f"block {b}: {refs} refs, {cached} cached, free {flag}"
            idle += refs == 0 and cached > 0
            cached_blocks += cached > 0
        assert idle == self._num_idle, f"idle count {self._num_idle} != {idle} idle blocks"
        assert cached_blocks == self._num_cached, f"cached count {self._num_cached} != {cached_blocks} cached blocks"

    def describe(self) -> dict[str, object]:
        """Size and occupancy, for results."""
        return {
            "block_size": self.block_size,
            "num_blocks": self.num_blocks,
            "free_blocks": self._num_free,
            "idle_cached_blocks": self._num_idle,
            "referenced_blocks": self.num_referenced,
            "pool_bytes": self.num_blocks * self.block_bytes,
            "dtype": str(self.dtype).replace("torch.", ""),
            "device": str(self.device),
            "huge_pages": self.huge_pages,
            **{k: v for k, v in vars(self.stats).items()},
        }
