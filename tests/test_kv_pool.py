"""The paged KV memory (kvboost.kv): the pool's books and rows, block tables, and reuse by reference in the engine.

Pool conformance: reference counts and cached marks (a block is free iff it has neither; an unreferenced cached
block is idle and can be referenced again), double frees refused, exhaustion refused with the sizes after asking
the cache to evict idle blocks, the allocator's preference for consecutive ids, slot arithmetic, row movement counted
in ``stats``. Block tables: reserve, copy on write of a shared or cached partial block (and of nothing else),
truncate, fork; a seeded random walk over all of it checks the books and every holder's rows against an independent
model. Engine level: an exact hit shares the cached blocks and copies only the partial block's rows, the pool's cache
never evicts an entry a sequence uses, a disk tier below memory gets standalone copies that load back into fresh
blocks, a pool too small is a clear error, and ``close`` gives every block back.
"""

from __future__ import annotations

import random

import pytest
import torch
from kvboost_testkit.tiny import make_engine, random_ids

from kvboost.cache.block_run import BlockRun
from kvboost.kv import BlockTable, KVPool, PoolExhausted
from kvboost.prompts import PromptError
from kvboost.quant.none import RawKV


def small_pool(num_blocks: int = 8, block_size: int = 4, **shape) -> KVPool:
    """A small pool filled with finite garbage (torch.empty may hold NaN, which no comparison survives)."""
    shape = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 3, **shape}
    pool = KVPool(num_blocks=num_blocks, block_size=block_size, **shape)
    gen = torch.Generator().manual_seed(99)
    pool.keys.normal_(generator=gen)
    pool.values.normal_(generator=gen)
    return pool


def rows(pool: KVPool, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (pool.num_layers, pool.num_kv_heads, n, pool.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


# ---------------------------------------------------------------------------------------------- the pool's books
def test_references_are_counted_and_a_block_is_free_at_zero():
    pool = small_pool()
    ids = pool.alloc(3)
    assert len(set(ids)) == 3 and [pool.refcount(b) for b in ids] == [1, 1, 1]
    assert pool.num_free == 5 and pool.num_used == 3
    pool.incref(ids[:2])
    assert [pool.refcount(b) for b in ids] == [2, 2, 1]
    pool.decref(ids)
    assert [pool.refcount(b) for b in ids] == [1, 1, 0] and pool.num_free == 6  # ids[2] is free again
    assert ids[2] in pool.alloc(6)  # ... and handed out again
    pool.decref(ids[:2])
    assert pool.stats.allocated_blocks == 9 and pool.stats.freed_blocks == 3
    pool.verify()


def test_a_double_free_or_a_reference_to_a_free_block_is_an_error():
    pool = small_pool()
    a, b = pool.alloc(2)
    pool.decref([a])
    with pytest.raises(RuntimeError, match="double free"):
        pool.decref([a])
    with pytest.raises(RuntimeError, match="incref of free block"):
        pool.incref([a])
    assert pool.refcount(a) == 0 and pool.refcount(b) == 1 and pool.num_free == 7
    pool.verify()  # the refused calls left the books as they were


class _Cache:
    """A stand-in for the store: ``reclaim`` records the ask and unmarks the idle cached blocks it was given."""

    def __init__(self, pool: KVPool, idle: list[int]) -> None:
        self.pool, self.idle, self.asked = pool, idle, []

    def reclaim(self, free_blocks: int) -> None:
        self.asked.append(free_blocks)
        while self.pool.num_free < free_blocks and self.idle:
            self.pool.unmark_cached([self.idle.pop(0)])


def test_an_exhausted_pool_asks_its_cache_to_evict_idle_blocks_then_refuses_with_the_sizes():
    pool = small_pool(num_blocks=4, block_size=4)
    held = pool.alloc(3)
    with pytest.raises(PoolExhausted) as refused:
        pool.alloc(3)
    assert pool.stats.pressure_calls == 0  # nothing cached: nothing to ask
    message = str(refused.value)
    assert "1 free blocks of 4 tokens, 3 are needed" in message and "4 blocks in all, 16 tokens" in message
    assert "3 held by requests and pins" in message and "kv.pool_bytes" in message
    assert isinstance(refused.value, RuntimeError) and pool.num_free == 1  # nothing was taken
    pool.mark_cached(held[:2])  # two blocks become cached, then idle when their holder lets go
    pool.decref(held[:2])
    assert pool.num_idle == 2 and pool.num_free == 1 and pool.num_available == 3 and pool.num_referenced == 1
    pool.cache = _Cache(pool, list(held[:2]))
    got = pool.alloc(3)
    assert len(got) == 3 and pool.cache.asked == [3] and pool.stats.pressure_calls == 1
    assert pool.stats.reclaimed_blocks == 2 and pool.num_free == 0 and pool.num_idle == 0
    assert pool.alloc(0) == [] and pool.stats.pressure_calls == 1  # nothing to ask for
    with pytest.raises(ValueError, match="cannot allocate"):
        pool.alloc(-1)
    pool.verify()


def test_cached_blocks_are_idle_not_free_and_never_written_in_place():
    """Only a referenced block becomes cached; at no reference it is idle (its rows stay, a hit references it
    again), free once no entry indexes it; a table copies a cached block before writing it, even as its only
    holder."""
    pool = small_pool(num_blocks=4, block_size=4)
    a, b = pool.alloc(2)
    pool.decref([b])
    with pytest.raises(RuntimeError, match="only a block a request holds can be cached"):
        pool.mark_cached([b])
    pool.mark_cached([a])
    pool.mark_cached([a])  # two entries index it (a chunk boundary inside the block)
    assert pool.is_cached(a) and not pool.writable(a)
    pool.decref([a])
    assert pool.refcount(a) == 0 and pool.num_idle == 1 and pool.num_free == 3
    pool.incref([a])  # a hit on an idle block
    assert pool.num_idle == 0 and pool.num_referenced == 1
    table = BlockTable(pool)
    table.share([a], 2)
    pool.decref([a])  # the table is its only holder now
    assert pool.refcount(a) == 1 and not pool.writable(a)
    table.prepare_write(2, 4)
    assert table.blocks[0] != a and pool.stats.copy_on_write == 1  # copied: the cached rows stay as they were
    pool.unmark_cached([a])
    assert pool.num_idle == 1  # one entry still indexes it
    pool.unmark_cached([a])
    assert pool.num_idle == 0 and pool.is_cached(a) is False and pool.num_free == 3
    with pytest.raises(RuntimeError, match="not cached"):
        pool.unmark_cached([a])
    with pytest.raises(RuntimeError, match="incref of free block"):
        pool.incref([a])
    table.release()
    assert pool.num_free == pool.num_blocks
    pool.verify()


def test_the_allocator_prefers_consecutive_ids():
    """``after=``: the block after a sequence's last one first; then the lowest run of the size asked (first fit:
    freed blocks are reused before untouched memory); then any free blocks, lowest first (a fragmented pool still
    serves)."""
    pool = small_pool(num_blocks=10)
    a = pool.alloc(2)
    b = pool.alloc(3)
    assert a == [0, 1] and b == [2, 3, 4]
    assert pool.alloc(2, after=4) == [5, 6]  # right after the last block
    pool.decref([0])
    assert pool.alloc(1, after=1) == [0]  # block 2 is taken: the lowest free run instead (the freed block 0)
    assert pool.alloc(2, after=9) == [7, 8]  # past the end: the lowest run of two
    assert pool.alloc(1) == [9]  # whatever is free
    pool.decref([1, 3, 5])
    assert pool.num_free == 3 and pool.alloc(3) == [1, 3, 5]  # no run of 3: the free blocks, lowest first
    pool.verify()


def test_slots_and_run_start():
    pool = small_pool(num_blocks=8, block_size=4)
    assert pool.slots([3, 1], 0, 6).tolist() == [12, 13, 14, 15, 4, 5]
    assert pool.slots([3, 1], 5, 7).tolist() == [5, 6]
    assert pool.slots([3, 1], 2, 2).numel() == 0
    with pytest.raises(ValueError, match="need 3 blocks"):
        pool.slots([3, 1], 4, 9)
    assert pool.run_start([2, 3, 4], 9) == 8  # consecutive: one strided view
    assert pool.run_start([2, 4], 5) is None
    assert pool.run_start([2, 4], 4) == 8  # only the first block holds rows
    assert pool.run_start([], 0) == 0
    table = BlockTable(pool)
    table.reserve(9)  # a growing table asks for the block after its last one
    assert table.blocks == [0, 1, 2] and table.capacity == 12 and table.run_start(9) == 0
    assert table.slots(3, 6).tolist() == [3, 4, 5]


def test_rows_written_are_read_back_and_movements_are_counted():
    pool = small_pool(num_blocks=8, block_size=4)
    assert pool.row_bytes == 2 * 2 * 2 * 3 * 4 and pool.block_bytes == 4 * pool.row_bytes
    slots = pool.slots([5, 2], 1, 7)  # across two non-consecutive blocks
    keys, values = rows(pool, 6, seed=1)
    pool.write(slots, keys, values)
    got_k, got_v = pool.read(slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    assert pool.stats.written_bytes == pool.stats.read_bytes == 6 * pool.row_bytes
    with pytest.raises(ValueError, match="6 rows for 5 slots"):
        pool.write(slots[:5], keys, values)
    before = pool.keys[:, :, 3 * 4 + 3].clone()
    pool.copy_rows(5, 3, 3)  # rows 0..2 of block 5 (logical rows 0..2: row 0 was never written, it is copied too)
    assert torch.equal(pool.keys[:, :, 12:15], pool.keys[:, :, 20:23])
    assert torch.equal(pool.values[:, :, 12:15], pool.values[:, :, 20:23])
    assert torch.equal(pool.keys[:, :, 15], before)  # the fourth row of the destination is untouched
    assert pool.stats.copied_bytes == 3 * pool.row_bytes and pool.stats.copy_on_write == 1
    assert pool.describe()["copied_bytes"] == 3 * pool.row_bytes
    pool.reset_stats()
    assert pool.stats.copied_bytes == 0


# ---------------------------------------------------------------------------------------------- block tables
def test_prepare_write_copies_a_shared_partial_block_and_only_that():
    pool = small_pool(num_blocks=8, block_size=4)
    parent = BlockTable(pool)
    parent.prepare_write(0, 6)  # 6 rows: a full block and a partial one
    parent.length = 6
    keys, values = rows(pool, 6, seed=2)
    pool.write(parent.slots(0, 6), keys, values)
    child = parent.fork()
    assert child.blocks == parent.blocks and child.length == 6
    assert [pool.refcount(b) for b in parent.blocks] == [2, 2]
    pool.reset_stats()
    child.prepare_write(6, 9)  # rows 6..8: the rest of the shared partial block, and a new one
    assert child.blocks[0] == parent.blocks[0] and pool.refcount(parent.blocks[0]) == 2  # the full block stays shared
    assert child.blocks[1] != parent.blocks[1] and pool.refcount(parent.blocks[1]) == 1
    assert len(child.blocks) == 3 and pool.refcount(child.blocks[2]) == 1
    assert pool.stats.copied_bytes == 2 * pool.row_bytes and pool.stats.copy_on_write == 1  # the 2 partial rows
    got_k, got_v = pool.read(child.slots(0, 6))
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)  # the child's prefix rows are the parent's
    child.length = 9
    pool.write(child.slots(6, 9), *rows(pool, 3, seed=3))
    got_k, _ = pool.read(parent.slots(0, 6))
    assert torch.equal(got_k, keys)  # the parent never sees the child's writes
    child.prepare_write(9, 12)  # own blocks: nothing copied
    assert pool.stats.copy_on_write == 1
    for table in (child, parent):
        table.release()
    assert pool.num_free == pool.num_blocks
    pool.verify()


def test_reserve_share_truncate_release():
    pool = small_pool(num_blocks=8, block_size=4)
    table = BlockTable(pool)
    table.reserve(9)
    assert len(table.blocks) == 3 and pool.num_free == 5
    table.reserve(5)  # already holds that many rows: nothing allocated
    assert len(table.blocks) == 3 and pool.stats.allocated_blocks == 3
    table.length = 9
    with pytest.raises(ValueError, match="cannot truncate"):
        table.truncate(10)
    kept = table.blocks[:2]
    table.truncate(5)  # speculative rollback: the third block goes back
    assert table.blocks == kept and table.length == 5 and pool.num_free == 6
    other = BlockTable(pool)
    other.share(table.blocks, 3)  # a holder's first 3 rows: one block, one more reference
    assert other.blocks == kept[:1] and pool.refcount(kept[0]) == 2
    with pytest.raises(RuntimeError, match="empty block table"):
        other.share(table.blocks, 3)
    with pytest.raises(ValueError, match="need 2 blocks"):
        BlockTable(pool).share(kept[:1], 5)
    table.release()
    table.release()  # idempotent
    assert pool.refcount(kept[0]) == 1 and pool.refcount(kept[1]) == 0
    other.release()
    assert pool.num_free == pool.num_blocks and len(table) == 0
    pool.verify()


def test_random_operations_keep_the_books_and_every_holders_rows():
    """A seeded random walk over tables (create, grow with writes, fork, truncate, release) and stray blocks:
    after every step the pool's own check holds, every block's reference count is the number of holders an
    independent model counts, and every table reads back exactly the rows it wrote (copy on write never lets one
    holder's write reach another)."""
    rng = random.Random(0)
    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=24, block_size=4)
    tables: list[tuple[BlockTable, list[float]]] = []  # each with the values of its rows
    strays: list[int] = []
    cached: dict[int, list[float]] = {}  # cached blocks (one entry each here) and the rows they held when cached
    counter = 0.0
    copies = 0
    for _ in range(400):
        op = rng.choice(["new", "grow", "grow", "fork", "truncate", "release", "stray", "unstray", "cache", "uncache"])
        try:
            if op == "new" or not tables:
                tables.append((BlockTable(pool), []))
            elif op == "grow":
                table, content = rng.choice(tables)
                n = rng.randint(1, 7)
                start = table.length
                before = pool.stats.copy_on_write
                table.prepare_write(start, start + n)
                copies += pool.stats.copy_on_write - before
                values = [counter + i for i in range(n)]
                counter += n
                pool.write(table.slots(start, start + n), torch.tensor(values).view(1, 1, n, 1),
                           torch.tensor(values).view(1, 1, n, 1))  # fmt: skip
                table.length = start + n
                content.extend(values)
            elif op == "fork":
                table, content = rng.choice(tables)
                tables.append((table.fork(), list(content)))
            elif op == "truncate":
                table, content = rng.choice(tables)
                keep = rng.randint(0, table.length)
                table.truncate(keep)
                del content[keep:]
            elif op == "release":
                table, _ = tables.pop(rng.randrange(len(tables)))
                table.release()
            elif op == "stray":
                strays += pool.alloc(1)
            elif op == "unstray" and strays:
                pool.decref([strays.pop(rng.randrange(len(strays)))])
            elif op == "cache":  # a table's full block becomes a cache entry's (its rows are final)
                table, _ = rng.choice(tables)
                full = [b for b in table.blocks[: table.length // 4] if b not in cached]
                if full:
                    block = rng.choice(full)
                    pool.mark_cached([block])
                    cached[block] = pool.read(pool.slots([block], 0, 4))[0].flatten().tolist()
            elif op == "uncache" and cached:
                block = rng.choice(list(cached))
                del cached[block]
                pool.unmark_cached([block])
        except PoolExhausted:
            while strays:  # make room and go on
                pool.decref([strays.pop()])
            if len(tables) > 2:
                tables.pop(0)[0].release()
            for block in list(cached):  # the cache gives back what no one references
                if pool.refcount(block) == 0:
                    pool.unmark_cached([block])
                    del cached[block]
        pool.verify()
        expected = [0] * pool.num_blocks
        for table, _ in tables:
            for b in table.blocks:
                expected[b] += 1
        for b in strays:
            expected[b] += 1
        assert [pool.refcount(b) for b in range(pool.num_blocks)] == expected
        for table, content in tables:
            assert table.length == len(content)
            if content:
                keys, values = pool.read(table.slots(0, table.length))
                assert keys.flatten().tolist() == content and values.flatten().tolist() == content
        for block, content in cached.items():  # a cached block's rows never change
            assert pool.read(pool.slots([block], 0, 4))[0].flatten().tolist() == content
        assert sum(pool.is_cached(b) for b in range(pool.num_blocks)) == len(cached)
    assert copies > 0  # the walk did exercise copy on write
    for table, _ in tables:
        table.release()
    pool.decref(strays)
    pool.unmark_cached(list(cached))
    assert pool.num_free == pool.num_blocks


# ---------------------------------------------------------------------------------------------- the engine
#: One 16-token chunk of the tiny fp32 llama's KV: 16 rows x 2 layers x 2 KV heads x 16 dims x (K, V) x 4 bytes.
CHUNK_BYTES = 16 * 512


def _spy_forwards(engine, monkeypatch, watch: tuple[int, ...] = ()) -> list:
    """Record each forward's tables (block ids and their reference counts at that moment), and the reference
    counts of the ``watch`` blocks then."""
    seen = []
    real = engine.runner.run

    def run(batch):
        refcount = engine.pool.refcount
        seen.append([(list(t.blocks), [refcount(b) for b in t.blocks]) for t in batch.tables]
                    + [[refcount(b) for b in watch]])  # fmt: skip
        return real(batch)

    monkeypatch.setattr(engine.runner, "run", run)
    return seen


def _pooled_entries(engine) -> dict[int, BlockRun]:
    """The pool tier's runs of blocks by chunk start."""
    tier = engine.store.tiers[0]
    entries = [tier.peek(key) for key in list(tier.keys())]
    return {e.start: e.payload for e in entries if isinstance(e.payload, BlockRun)}


def test_an_exact_hit_shares_the_cached_blocks_and_copies_only_the_partial_rows(monkeypatch):
    """A warmed 40-token prefix (not a multiple of the 16-token block): the request's table takes the cached
    entries' blocks for rows 0..31 (more than one reference each), copies the 8 rows of the partial block once,
    and answers what a cold prefill answers (fp32)."""
    engine = make_engine("llama", decode="eager")
    pool, bs = engine.pool, engine.pool.block_size
    prompt = random_ids(70, seed=21)
    engine.warm(prompt[:40])
    entries = _pooled_entries(engine)
    assert sorted(entries) == [0, 16, 32]
    partial = entries[32].block_for_row(39)
    seen = _spy_forwards(engine, monkeypatch, watch=(partial,))
    copied = pool.stats.copied_bytes
    hit = engine.generate(prompt, 6)
    assert hit.cached_tokens == 40
    assert pool.stats.copied_bytes - copied == (40 % bs) * pool.row_bytes
    (blocks, refs), watched = seen[0]  # the suffix prefill (rows 40..69), after the copy on write
    assert blocks[0] == entries[0].blocks[0] and blocks[1] == entries[16].blocks[0]
    assert refs[:2] == [1, 1] and pool.is_cached(blocks[0]) and pool.is_cached(blocks[1])  # shared, not copied
    assert blocks[2] != partial and refs[2] == 1  # the private copy of the partial block
    assert watched == [0]  # idle (still cached): the sequence let go of it, the entry holds no reference
    cold = engine.generate(prompt, 6, mode="cold")
    assert hit.output_ids == cold.output_ids
    assert torch.allclose(hit.first_token_logits, cold.first_token_logits, atol=1e-4, rtol=0)
    pool.verify()
    engine.close()


def test_the_cache_never_evicts_an_entry_a_sequence_uses(monkeypatch):
    """Under pool pressure while a request holds the cached blocks, nothing is evicted (evicting them would free
    nothing and drop a live prefix, issue 42 D7): the entries, their rows and the books stay; once the request let go
    they are idle and go first. The answer is a cold run's."""
    engine = make_engine("llama", decode="eager", cache={"name": "memory", "capacity": 3 * CHUNK_BYTES})
    pool = engine.pool
    assert pool.block_bytes == CHUNK_BYTES
    prompt = random_ids(60, seed=22)
    engine.warm(prompt[:48])
    shared = sorted({b for p in _pooled_entries(engine).values() for b in p.blocks})
    assert len(shared) == 3
    before = pool.read(pool.slots(shared, 0, 48))
    checked = []
    real = engine.runner.run

    def run(batch):
        if not checked:  # the suffix prefill: the table shares the entries' blocks; pressure now
            assert engine.store.reclaim(pool.num_blocks) == 0
            assert len(engine.store) == 3
            assert [pool.refcount(b) for b in shared] == [1, 1, 1]  # the sequence's references only
            after = pool.read(pool.slots(shared, 0, 48))
            assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
            pool.verify()
            checked.append(True)
        return real(batch)

    monkeypatch.setattr(engine.runner, "run", run)
    hit = engine.generate(prompt, 6)
    assert checked and hit.cached_tokens == 48
    monkeypatch.setattr(engine.runner, "run", real)
    assert hit.output_ids == engine.generate(prompt, 6, mode="cold").output_ids
    entries = len(engine.store)
    assert engine.store.reclaim(pool.num_blocks) == entries  # every entry idle now: all go
    assert len(engine.store) == 0 and pool.num_free == pool.num_blocks
    pool.verify()
    engine.close()


def test_a_disk_tier_below_memory_gets_standalone_copies_that_load_into_fresh_blocks(tmp_path, monkeypatch):
    """Entries the pool evicts reach the disk tier as standalone RawKV copies (never runs of pool blocks) and
    their blocks return to the pool; a later exact hit served from disk writes the rows, once, into fresh blocks
    no one else holds, and answers what a cold prefill answers."""
    engine = make_engine("llama", decode="eager", kv={"pool_bytes": 4 * CHUNK_BYTES}, cache=[
        {"name": "memory"}, {"name": "disk", "path": str(tmp_path), "capacity": "64MiB"}])  # fmt: skip
    pool, disk = engine.pool, engine.store.tiers[1]
    received = []
    real_put = disk.put
    monkeypatch.setattr(disk, "put", lambda entry: received.append(type(entry.payload)) or real_put(entry))
    a, b, c = random_ids(32, seed=23), random_ids(32, seed=24), random_ids(32, seed=19)
    engine.warm(a)
    engine.warm(b)
    engine.warm(c)  # two blocks more than are free: the least recently used idle entries (a's) go down to disk
    stats = engine.cache_stats()
    assert stats["demoted"] >= 2 and received and set(received) == {RawKV}
    tier = engine.store.tiers[0]
    memory_blocks = {blk for key in tier.keys() for blk in tier.peek(key).payload.blocks}
    assert pool.num_used == len(memory_blocks)  # the demoted entries' blocks went back to the pool
    seen = _spy_forwards(engine, monkeypatch)
    written = pool.stats.written_bytes
    prompt = a + random_ids(10, seed=25)
    hit = engine.generate(prompt, 6)
    assert hit.cached_tokens == 32 and engine.cache_stats()["per_tier_hits"].get("disk", 0) >= 1
    assert pool.stats.written_bytes - written == 32 * pool.row_bytes  # loaded into the pool, once
    (blocks, refs), _ = seen[0]
    assert refs[:2] == [1, 1]  # its own blocks (the rows were written into them: written_bytes above)
    assert hit.output_ids == engine.generate(prompt, 6, mode="cold").output_ids
    pool.verify()
    engine.close()


def test_a_host_tier_keeps_what_the_pool_evicts_on_the_cpu_and_serves_it_exactly():
    """``kv.host_bytes``: a memory tier on the CPU right below the pool. Entries the pool evicts land there as
    standalone copies on the CPU (the GPU case: out of device memory), their blocks go back to the pool, and a hit
    from it is loaded into fresh blocks and answers what a cold prefill answers."""
    engine = make_engine("llama", decode="eager", kv={"pool_bytes": 4 * CHUNK_BYTES, "host_bytes": "64MiB"})
    pool, host = engine.pool, engine.store.tiers[1]
    assert len(engine.store.tiers) == 2 and host.device == torch.device("cpu")
    a, b, c = random_ids(32, seed=23), random_ids(32, seed=24), random_ids(32, seed=19)
    for prompt in (a, b, c):  # c needs blocks a's idle entries hold: they go down to the host tier
        engine.warm(prompt)
    assert len(host) >= 2 and all(type(host.peek(k).payload) is RawKV for k in host.keys())
    assert all(host.peek(k).payload.keys.device.type == "cpu" for k in host.keys())
    prompt = a + random_ids(10, seed=25)
    hit = engine.generate(prompt, 6)
    cold = engine.generate(prompt, 6, mode="cold")
    assert hit.cached_tokens == 32 and engine.cache_stats()["per_tier_hits"].get("memory#1", 0) >= 1
    assert float((hit.first_token_logits - cold.first_token_logits).abs().max()) <= 1e-4
    assert hit.output_ids == cold.output_ids
    pool.verify()
    engine.close()


def test_a_host_tier_needs_the_pool_as_memory_tier():
    with pytest.raises(ValueError, match="host_bytes"):
        make_engine("llama", quant="kivi8", kv={"host_bytes": "64MiB"})


def test_a_pool_too_small_is_a_clear_error():
    """A request that can never fit is refused before any compute (PromptError, with the sizes); requests that
    fit alone but not together are scheduled as the blocks allow (the cache gives back what it holds first; a
    row waits or is preempted and recomputed), each giving its single-run tokens; their blocks come back."""
    engine = make_engine("llama", decode="eager", kv={"pool_bytes": 6 * CHUNK_BYTES})
    pool = engine.pool
    assert pool.num_blocks == 6
    forwards = dict(engine.runner.forwards)
    with pytest.raises(PromptError, match="more than the KV pool holds"):
        engine.generate(random_ids(80, seed=26), 8)
    assert engine.runner.forwards == forwards  # nothing ran
    engine.warm(random_ids(32, seed=27))  # the cache holds 2 blocks
    assert pool.num_used == 2
    calls = pool.stats.pressure_calls
    prompts = [random_ids(40, seed=s) for s in (28, 29, 30)]
    rows = engine.generate_batch(prompts, 8, store=False)
    assert pool.stats.pressure_calls > calls and len(engine.store) == 0  # the cache gave its blocks first
    assert pool.num_free == pool.num_blocks  # the batch's tables were released
    pool.verify()
    assert [r.output_ids for r in rows] == [engine.generate(p, 8, mode="cold").output_ids for p in prompts]
    engine.close()


def test_close_gives_every_block_back():
    """An engine that owned its pool leaves it empty when closed: the cache's references go back."""
    engine = make_engine("llama", decode="eager")
    for seed in (31, 32):
        engine.generate(random_ids(50, seed=seed), 4)
    assert engine.pool.num_used > 0 and engine.pool.num_referenced == 0  # idle cached blocks
    engine.close()
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.pool.verify()


def test_an_auto_pool_leaves_the_reserve_free(monkeypatch):
    """``kv.pool_bytes: auto`` takes a share of the free memory once what a forward needs is set aside (on a GPU
    the engine sizes the pool after its runner exists, with the activations of a full step as the reserve)."""
    from kvboost.kv import sizing

    monkeypatch.setattr(sizing, "free_memory_bytes", lambda device: 10 * 2**30)
    cuda = torch.device("cuda")
    full = sizing.pool_bytes_for("auto", row_bytes=1024, max_positions=2**22, cache_bytes=0, device=cuda)
    kept = sizing.pool_bytes_for("auto", row_bytes=1024, max_positions=2**22, cache_bytes=0, device=cuda,
                                 reserve=4 * 2**30)  # fmt: skip
    assert full == int(10 * 2**30 * 0.9) and kept == int(6 * 2**30 * 0.9)
    assert sizing.pool_bytes_for("1GiB", row_bytes=1024, max_positions=None, cache_bytes=0, device=cuda,
                                 reserve=4 * 2**30) == 2**30  # an explicit size is taken as given
    engine = make_engine("llama", decode="eager")
    try:
        assert sizing.activation_bytes(engine.adapter, 16384) > 16384 * engine.model.config.hidden_size * 4
    finally:
        engine.close()


def test_a_runner_moves_to_another_pool():
    """``bind_pool``: the runner computes over the new pool exactly as over the old one."""
    from kvboost.runtime.batch import ForwardBatch, SeqInput

    engine = make_engine("llama", decode="eager")
    try:
        ids = random_ids(30, seed=5)
        old = BlockTable(engine.pool)
        before = engine.runner.run(ForwardBatch.build([SeqInput(old, ids)]))
        old.release()
        other = KVPool(num_layers=2, num_kv_heads=2, head_dim=16, num_blocks=8)
        engine.runner.bind_pool(other)
        table = BlockTable(other)
        after = engine.runner.run(ForwardBatch.build([SeqInput(table, ids)]))
        assert torch.equal(before, after) and other.num_used == 2
        with pytest.raises(ValueError, match="shape does not match"):
            engine.runner.bind_pool(KVPool(num_layers=3, num_kv_heads=2, head_dim=16, num_blocks=8))
        table.release()
        engine.runner.bind_pool(engine.pool)
    finally:
        engine.close()
