"""The redis tier (kvboost/cache/redis_tier.py) against a real redis-server on a free loopback port: records and
index, what a second process sees, damage, fingerprints, a server that goes away, pipelined reads, and engines
sharing one Redis (``cache=redis``, ``cache=[memory, redis]``).

The contract every tier meets is in test_cache_conformance.py, which runs on the redis tier against the same kind
of server. Skipped, with the reason, when there is no ``redis-server`` binary or ``redis`` package.
"""

from __future__ import annotations

import time

import pytest
import test_disk_tier as disk_tests
import torch
from kvboost_testkit.redis_server import RedisServer, new_namespace, redis_server, skip_reason  # noqa: F401
from kvboost_testkit.tiny import ToyTokenizer, make_engine, tiny_model

from kvboost import KVBoost
from kvboost.cache import KVEntry, KVStore, MemoryTier, RedisTier
from kvboost.cache import payload as fmt
from kvboost.cache.redis_tier import prefetch_store, refresh_store
from kvboost.lookup import chunk_prompt

if skip_reason():
    pytest.skip(skip_reason(), allow_module_level=True)

import redis  # noqa: E402

entry_for, same = disk_tests.entry_for, disk_tests.same
ROOT = disk_tests.ROOT
SIZE = disk_tests.SIZE


@pytest.fixture
def ns() -> str:
    return new_namespace()


def tier_on(server, ns: str, **options) -> RedisTier:
    options.setdefault("capacity", 100 * SIZE)
    return RedisTier(url=server.url, namespace=ns, **options)


def chain(n: int, prefix: str = "c") -> list[KVEntry]:
    return [entry_for(f"{prefix}{i}", parent=ROOT if i == 0 else f"{prefix}{i - 1}") for i in range(n)]


def stored_chain(server, ns: str, n: int) -> list[KVEntry]:
    """``chain(n)`` written to the namespace by a tier that then closes (another process's work)."""
    entries = chain(n)
    writer = tier_on(server, ns)
    for e in entries:
        writer.put(e)
    writer.close()
    return entries


def corrupt(client, record_key: str, how: str) -> None:
    client.set(record_key, disk_tests.damaged(client.get(record_key), how))


# ---------------------------------------------------------------------------------------------- the tier
def test_round_trip_and_a_new_process_indexes_from_redis(redis_server, ns, monkeypatch):
    tier = tier_on(redis_server, ns)
    entries = [*chain(5), KVEntry("seg:x", "x", None, (5, 6), 3, entry_for("x").payload, exact=False)]
    for e in entries:
        assert tier.put(e) == []
    got = tier.get("c2")  # served from the write queue or from Redis
    assert got is not None and same(got, entries[2])
    tier.flush()
    client = redis_server.client()
    assert client.get(f"{ns}:c3") is not None and client.hlen(f"{ns}#index") == 6 and client.zcard(f"{ns}#log") == 6
    assert same(fmt.decode(client.get(f"{ns}:c3")), entries[3])  # the disk tier's record format, unchanged
    tier.close()

    loads = []
    monkeypatch.setattr(fmt, "decode", lambda *a, **k: loads.append(1) or (_ for _ in ()).throw(AssertionError))
    again = tier_on(redis_server, ns)  # another process: its index comes from Redis, no tensor is read
    assert loads == [] and sorted(again.keys()) == sorted(e.key for e in entries)
    assert again.used_bytes == sum(e.nbytes for e in entries) and again.stats()["scanned"] == 6
    meta = again.peek_meta("c3")
    assert (meta.parent_key, meta.token_ids, meta.start, meta.nbytes) == ("c2", entries[3].token_ids,
                                                                          entries[3].start, SIZE)  # fmt: skip
    monkeypatch.undo()
    store = KVStore([MemoryTier(capacity=2 * SIZE), again])
    assert store.children(ROOT) == ["c0"] and store.children("c2") == ["c3"] and store.has_segment("x")
    assert same(store.get("c4"), entries[4]) and store.stats.promoted == 1 and "c4" in store.tiers[0]
    assert client.exists(f"{ns}:c4")  # a promotion leaves the shared record for the other processes
    store.verify()
    store.close()


def test_a_lost_index_is_rebuilt_from_record_headers(redis_server, ns):
    tier = tier_on(redis_server, ns)
    entries = chain(4)
    for e in entries:
        tier.put(e)
    tier.close()
    client = redis_server.client()
    client.delete(f"{ns}#index", f"{ns}#log")  # as if Redis had evicted them
    corrupt(client, f"{ns}:c3", "flip_header")
    again = tier_on(redis_server, ns)
    stats = again.stats()
    assert sorted(again.keys()) == ["c0", "c1", "c2"] and stats["rebuilt_from_records"] == 3
    assert stats["corrupt_dropped"] == 1 and not client.exists(f"{ns}:c3")
    assert client.hlen(f"{ns}#index") == 3 and same(again.get("c2"), entries[2])


def test_entries_written_after_start_are_added_by_refresh(redis_server, ns):
    writer = tier_on(redis_server, ns)
    writer.put(entry_for("a"))
    writer.flush()
    reader = KVStore([MemoryTier(capacity=10 * SIZE), tier_on(redis_server, ns)])
    assert "a" in reader and "b" not in reader
    writer.put(entry_for("b", parent="a"))
    writer.put(entry_for("c", parent="b"))
    writer.flush()
    assert "b" not in reader  # the store's books are a snapshot...
    assert refresh_store(reader) == 2 and reader.children("a") == ["b"]  # ...until refreshed
    assert same(reader.get("c"), entry_for("c", parent="b")) and refresh_store(reader) == 0
    reader.verify()
    writer.remove("b")  # this process forgets it; the record stays for the others
    assert "b" not in writer and redis_server.client().exists(f"{ns}:b")
    writer.close()
    reader.close()


def test_capacity_evicts_records_for_everyone(redis_server, ns):
    tier = tier_on(redis_server, ns, capacity=4 * SIZE)
    for i in range(10):
        evicted = tier.put(entry_for(f"n{i}"))
        assert tier.used_bytes <= tier.capacity_bytes and all(e.key not in tier for e in evicted)
        assert all(e.payload.keys is not None for e in evicted)  # alone (not last in a store): with payloads
    tier.flush()
    client = redis_server.client()
    assert sorted(k.decode() for k in client.scan_iter(f"{ns}:*")) == sorted(f"{ns}:{k}" for k in tier.keys())
    assert client.hlen(f"{ns}#index") == 4 and tier.stats()["deletes"] == 6
    small = tier_on(redis_server, ns, capacity=2 * SIZE)  # a smaller budget indexes what fits, deletes nothing
    assert len(small) == 2 and small.stats()["skipped_over_capacity"] == 2 and client.hlen(f"{ns}#index") == 4
    tier.close()


def test_damaged_records_are_dropped_counted_and_missed(redis_server, ns):
    tier = tier_on(redis_server, ns)
    hows = ["flip_tensor", "flip_header", "truncate", "garbage"]
    for i in range(len(hows) + 1):
        tier.put(entry_for(f"k{i}"))
    tier.flush()
    client = redis_server.client()
    for i, how in enumerate(hows):
        corrupt(client, f"{ns}:k{i}", how)
    client.set(f"{ns}:k0", b"not a record")  # SET garbage over one, flipped bytes in the others
    store = KVStore([tier])
    for i in range(len(hows)):
        assert store.get(f"k{i}") is None and f"k{i}" not in store and store.get(f"k{i}") is None
    tier.flush()
    assert tier.stats()["corrupt_dropped"] == len(hows)
    assert [client.exists(f"{ns}:k{i}") for i in range(len(hows))] == [0] * len(hows)  # deleted, index too
    assert client.hlen(f"{ns}#index") == 1 and same(store.get(f"k{len(hows)}"), entry_for(f"k{len(hows)}"))
    client.delete(f"{ns}:k4")  # gone (Redis evicted it): a miss, counted, index entry removed
    store.tiers[0]._last = None
    assert store.get("k4") is None and tier.stats()["missing_dropped"] == 1 and client.hlen(f"{ns}#index") == 0
    store.verify()
    tier.close()


def test_another_fingerprint_is_never_served(redis_server, ns):
    writer = tier_on(redis_server, ns)
    writer.bind_context(fingerprint="model-A", quantizer_settings={"name": "none"})
    writer.put(entry_for("a"))
    writer.close()
    header = fmt.decode_header(redis_server.client().get(f"{ns}:a"))
    assert header["fingerprint"] == "model-A" and header["quantizer"] == {"name": "none"}
    reader = tier_on(redis_server, ns)
    reader.bind_context(fingerprint=lambda: "model-B")
    assert "a" in reader and reader.get("a") is None and reader.stats()["foreign_skipped"] == 1
    assert redis_server.client().exists(f"{ns}:a")  # intact, only not ours: left for its owner
    same_fp = tier_on(redis_server, ns)
    same_fp.bind_context(fingerprint="model-A")
    assert same(same_fp.get("a"), entry_for("a"))


class _Sends:
    """Counts the requests the redis client sends (a pipeline is one)."""

    def __init__(self, monkeypatch) -> None:
        self.n = 0
        real = redis.connection.AbstractConnection.send_packed_command

        def counted(conn, command, check_health=True):
            self.n += 1
            return real(conn, command, check_health)

        monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counted)


def _get_calls(client) -> int:
    return int(client.info("commandstats").get("cmdstat_get", {}).get("calls", 0))


def test_prefetch_loads_a_chain_in_one_round_trip(redis_server, ns, monkeypatch):
    entries = stored_chain(redis_server, ns, 8)
    admin = redis_server.client()
    keys = [e.key for e in entries]
    sends = _Sends(monkeypatch)

    plain = tier_on(redis_server, ns, readahead=0)  # one GET per chunk
    admin.config_resetstat()
    sends.n = 0
    assert all(same(plain.get(k), e) for k, e in zip(keys, entries))
    assert sends.n == 8 and _get_calls(admin) == 8 and plain.stats()["round_trips"] == 8

    fetched = tier_on(redis_server, ns, readahead=0)
    store = KVStore([MemoryTier(capacity=100 * SIZE), fetched])
    admin.config_resetstat()
    sends.n = 0
    assert prefetch_store(store, [*keys, "not-stored"]) == 8
    assert all(same(store.get(k), e) for k, e in zip(keys, entries))  # served from the buffer, promoted
    assert sends.n == 1 and _get_calls(admin) == 8  # the same GETs, in one round trip (then INFO: not counted)
    assert fetched.stats()["prefetch_hits"] == 8 and store.stats.promoted == 8
    store.verify()

    ahead = tier_on(redis_server, ns)  # default: a get that goes to Redis reads the chain ahead
    sends.n = 0
    assert all(same(ahead.get(k), e) for k, e in zip(keys, entries))
    assert sends.n == 1 and ahead.stats()["prefetched"] == 7 and ahead.stats()["prefetch_hits"] == 7


def test_a_chain_is_read_in_the_background_in_one_round_trip(redis_server, ns, monkeypatch):
    entries = stored_chain(redis_server, ns, 8)
    keys = [e.key for e in entries]
    sends = _Sends(monkeypatch)
    tier = tier_on(redis_server, ns, readahead=0)
    store = KVStore([MemoryTier(capacity=100 * SIZE), tier])
    sends.n = 0  # after the tier read its index
    assert store.prefetch([*keys, "not-stored"]) == 8
    assert all(same(store.get(k), e) for k, e in zip(keys, entries))
    stats = tier.stats()
    assert sends.n == 1 and stats["round_trips"] == 1 and stats["reads"] == 8
    assert stats["background_used"] == 8 and store.summary()["per_tier"]["redis"]["background_used"] == 8
    store.verify()
    tier.close()


def test_a_background_read_against_a_dead_server_is_a_miss():
    server = RedisServer()
    try:
        ns = new_namespace()
        tier = tier_on(server, ns, retry_after_s=0.2, socket_timeout_s=1.0, readahead=0)
        for e in chain(3):
            tier.put(e)
        tier.flush()
        server.stop()
        store = KVStore([tier])
        assert store.prefetch(["c0", "c1", "c2"]) == 3
        assert store.get("c0") is None and "c0" not in store  # a miss, no exception
        assert tier.stats()["read_errors"] >= 1 and tier.stats()["connection_errors"] >= 1
        store.verify()
        tier.close()
    finally:
        server.close()


def test_a_dead_server_means_misses_and_dropped_writes(monkeypatch):
    server = RedisServer()
    try:
        ns = new_namespace()
        tier = tier_on(server, ns, retry_after_s=0.2, socket_timeout_s=1.0)
        tier.put(entry_for("a"))
        tier.flush()
        server.stop()
        store = KVStore([tier])
        t0 = time.perf_counter()
        assert store.get("a") is None and "a" not in store  # a miss, no exception
        store.put(entry_for("b"))  # dropped by the writer, counted
        tier.flush()
        assert time.perf_counter() - t0 < 5
        stats = tier.stats()
        assert stats["read_errors"] >= 1 and stats["write_errors"] == 1 and stats["connection_errors"] >= 1
        down = RedisTier(url=server.url, namespace=ns)  # built while the server is down: empty, no exception
        assert len(down) == 0 and down.get("a") is None
        server.start()  # back (empty: no persistence)
        time.sleep(0.3)
        assert store.get("b") is None and tier.stats()["missing_dropped"] == 1  # its write had failed
        store.put(entry_for("c"))
        tier.flush()
        assert same(store.get("c"), entry_for("c")) and tier.stats()["writes"] == 2
        store.verify()
        tier.close()
        down.close()
    finally:
        server.close()


# ---------------------------------------------------------------------------------------------- engines
@pytest.fixture(scope="module")
def conversations():
    return disk_tests._conversations()


@pytest.fixture(scope="module")
def cold_outputs(conversations):
    engine = make_engine("llama")
    outs = {(c, t): engine.generate(p, max_new_tokens=6, mode="cold").output_ids
            for c, conv in enumerate(conversations) for t, p in enumerate(conv)}  # fmt: skip
    engine.close()
    return outs


@pytest.fixture(scope="module")
def reference(conversations, cold_outputs):
    """Reuse per (conversation, turn) of one engine serving every turn from one memory tier."""
    engine = make_engine("llama", cache={"name": "memory", "capacity": "64MiB"})
    out = disk_tests._serve(engine, conversations, range(4), cold_outputs)
    engine.close()
    return out


def redis_cache(server, ns: str, **options) -> dict:
    return {"name": "redis", "url": server.url, "namespace": ns, "capacity": "64MiB", **options}


def stacked(server, ns: str, memory_chunks: int = 3) -> list[dict]:
    chunk_bytes = 16 * 512  # 16 tokens x 2 layers x 2 kv heads x 16 dims x (k, v) x fp32
    return [{"name": "memory", "capacity": memory_chunks * chunk_bytes}, redis_cache(server, ns)]


def test_two_engines_share_one_redis(redis_server, ns, conversations, cold_outputs, reference):
    a = make_engine("llama", cache=redis_cache(redis_server, ns))
    late = make_engine("llama", cache=redis_cache(redis_server, ns))  # started before A stores anything
    disk_tests._serve(a, conversations, range(2), cold_outputs)
    a.store.flush()  # A keeps running; its writer has sent every record
    b = make_engine("llama", cache=redis_cache(redis_server, ns))  # another engine, model object and client
    assert len(b.store) >= len(a.store) > 0  # (records A's engine dropped as redundant stay in Redis)
    got = disk_tests._serve(b, conversations, range(2, 4), cold_outputs)  # greedy outputs equal cold (checked)
    assert b.cache_stats()["requests"] == 6 and got[(0, 2)] > 0  # B's first request, (0, 2), reused A's entries
    assert got == {k: v for k, v in reference.items() if k[1] >= 2}  # the reuse of one engine serving it all
    assert b.cache_stats()["per_tier_hits"]["redis"] > 0 and b.cache_stats()["corrupt_entries_dropped"] == 0

    assert late.generate(conversations[1][2], max_new_tokens=6).cached_tokens == 0  # its books predate A's
    assert refresh_store(late.store) > 0  # A's and B's entries
    r = late.generate(conversations[2][3], max_new_tokens=6)  # B served this prompt: reused up to its end
    assert r.cached_tokens == len(conversations[2][3]) - 1 and r.output_ids == cold_outputs[(2, 3)]
    for engine in (a, b, late):
        engine.store.verify()
        engine.close()


def test_another_model_or_salt_gets_no_hits(redis_server, ns, conversations, cold_outputs):
    with make_engine("llama", cache=redis_cache(redis_server, ns)) as first:
        disk_tests._serve(first, conversations, range(2), cold_outputs)
        first_fp = first.fingerprint
    prompt = conversations[0][1]
    other = KVBoost(tiny_model("llama", seed=1), ToyTokenizer(), model_identity="tiny-llama",
                    chunker=disk_tests.CHUNK, cache=redis_cache(redis_server, ns))  # fmt: skip
    assert other.fingerprint != first_fp and len(other.store) > 0  # it sees the index...
    r = other.generate(prompt, max_new_tokens=6)
    assert r.cached_tokens == 0 and other.cache_stats()["per_tier_hits"] == {}  # ...and is served none
    other.close()
    salted = make_engine("llama", cache=redis_cache(redis_server, ns))
    assert salted.generate(prompt, max_new_tokens=6, cache_salt="tenant-2").cached_tokens == 0
    assert salted.generate(prompt, max_new_tokens=6).cached_tokens > 0  # unsalted: the first engine's entries
    salted.close()


def test_damaged_records_are_recomputed_with_cold_outputs(redis_server, ns, conversations, cold_outputs):
    with make_engine("llama", cache=redis_cache(redis_server, ns)) as first:
        disk_tests._serve(first, conversations, range(2), cold_outputs)
        fingerprint, chunker, hasher = first.fingerprint, first.chunker, first.hasher
    client = redis_server.client()
    for c, how in enumerate(("flip_tensor", "truncate", "garbage")):
        _, keys = chunk_prompt(conversations[c][2], chunker, hasher, fingerprint)
        corrupt(client, f"{ns}:{keys[c].prefix_key}", how)  # chunk c of conversation c
    second = make_engine("llama", cache=redis_cache(redis_server, ns))
    exact: dict = {}
    disk_tests._serve(second, conversations, range(2, 4), cold_outputs, exact)  # outputs equal cold (checked)
    assert second.cache_stats()["corrupt_entries_dropped"] == 3
    # conversation 2 lost its third chunk: exact hits up to it (plus, at the frontier, the 7-token tail chunk of its
    # turn-1 prompt: the first engine dropped it as redundant, but remove() leaves records in Redis)
    assert exact[(0, 2)] == 0 and 32 <= exact[(2, 2)] < 48
    again = second.generate(conversations[0][2], max_new_tokens=6)  # the recomputed chunks were stored again
    assert again.cached_tokens == len(conversations[0][2]) - 1 and again.output_ids == cold_outputs[(0, 2)]
    second.store.verify()
    second.close()


def test_memory_over_redis_demotes_promotes_and_spills(redis_server, ns, conversations, cold_outputs, reference):
    engine = make_engine("llama", cache=stacked(redis_server, ns, memory_chunks=2))
    disk_tests._serve(engine, conversations, range(2), cold_outputs)
    stats = engine.cache_stats()
    assert stats["demoted"] > 0 and stats["tiers"][1]["tier"] == "redis" and stats["tiers"][1]["entries"] > 0
    got = disk_tests._serve(engine, conversations, range(2, 4), cold_outputs)
    stats = engine.cache_stats()
    assert stats["promoted"] > 0 and stats["per_tier_hits"].get("redis", 0) > 0
    assert got == {k: v for k, v in reference.items() if k[1] >= 2}
    engine.store.verify()
    in_memory = list(engine.store.tiers[0].keys())
    engine.close()  # spills the memory tier into Redis
    client = redis_server.client()
    assert in_memory and all(client.exists(f"{ns}:{k}") for k in in_memory)
    nxt = make_engine("llama", cache=stacked(redis_server, ns))
    r = nxt.generate(conversations[1][3], max_new_tokens=6)  # served before: reused up to its last token
    assert r.cached_tokens == len(conversations[1][3]) - 1 and r.output_ids == cold_outputs[(1, 3)]
    nxt.close()


def test_payload_tensors_round_trip_bit_exact(redis_server, ns):
    """bf16 and int8 tensors (a quantizer's payload) come back bit for bit."""
    from kvboost.quant.none import RawKV

    k = torch.randn(2, 1, 5, 8).to(torch.bfloat16)
    e = KVEntry("q", "s", ROOT, (1, 2, 3, 4, 5), 7, RawKV(k, (k * 2).to(torch.bfloat16)))
    tier = tier_on(redis_server, ns)
    tier.put(e)
    tier.close()
    back = tier_on(redis_server, ns).get("q")
    assert back.payload.keys.dtype == torch.bfloat16 and torch.equal(back.payload.keys, e.payload.keys)
    assert back.start == 7 and back.token_ids == e.token_ids
