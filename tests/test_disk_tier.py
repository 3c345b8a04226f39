"""The disk tier (kvboost/cache/disk.py): writes off the request path, atomic files, restart, damage, crashes,
fingerprints, and ``cache=[memory, disk]`` through the engine.

The contract every tier meets (budget, eviction, the store's books) is in test_cache_conformance.py, which runs on
the disk tier unchanged (built without a path: a private temporary folder).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash
from kvboost_testkit.tiny import ToyTokenizer, make_engine, random_ids, tiny_model

from kvboost import KVBoost
from kvboost.cache import DiskTier, KVEntry, KVStore, MemoryTier
from kvboost.cache import disk as disk_mod
from kvboost.cache import payload as fmt
from kvboost.lookup import chunk_prompt
from kvboost.quant.none import RawKV

ROOT = "root"
CHUNK = {"name": "fixed", "chunk_size": 16}


def entry_for(key: str, tokens: int = 4, parent: str | None = ROOT) -> KVEntry:
    """An entry whose content is a function of its key (so whoever reads it can check it)."""
    seed = xxhash.xxh64_intdigest(key.encode()) % 2**31
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 1, tokens, 8, generator=g)
    ids = tuple(int(x) for x in torch.randint(0, 1000, (tokens,), generator=g))
    return KVEntry(key, "s-" + key, parent, ids, seed % 100, RawKV(k, torch.randn(k.shape, generator=g)))


def same(a: KVEntry, b: KVEntry) -> bool:
    return (a.key, a.segment_key, a.parent_key, a.token_ids, a.start, a.exact) == (
        b.key, b.segment_key, b.parent_key, b.token_ids, b.start, b.exact
    ) and torch.equal(a.payload.keys, b.payload.keys) and torch.equal(a.payload.values, b.payload.values)  # fmt: skip


def files(root: Path, pattern: str = "*.kvr") -> list[Path]:
    return sorted(root.glob(f"*/{pattern}"))


SIZE = entry_for("x").nbytes


# ---------------------------------------------------------------------------------------------- the tier
def test_put_hands_off_and_get_is_served_from_the_queue(tmp_path, monkeypatch):
    gate = threading.Event()
    real = disk_mod.atomic_write

    def slow_write(*args, **kwargs):
        gate.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(disk_mod, "atomic_write", slow_write)
    tier = DiskTier(path=tmp_path, capacity=100 * SIZE)
    e = entry_for("a")
    t0 = time.perf_counter()
    assert tier.put(e) == []
    assert time.perf_counter() - t0 < 1.0  # returned while the writer is blocked
    assert files(tmp_path) == [] and "a" in tier and tier.used_bytes == SIZE
    got = tier.get("a")
    assert got is not None and same(got, e) and tier.stats()["served_from_queue"] == 1
    assert tier.stats()["pending_writes"] == 1
    gate.set()
    tier.flush()
    name = disk_mod.record_name("a")
    assert files(tmp_path) == [tmp_path / name[:2] / name]  # fan-out folder named by the key hash
    assert tier.stats()["pending_writes"] == 0 and tier.stats()["writes"] == 1
    assert same(tier.get("a"), e) and tier.stats()["reads"] == 1
    tier.close()


def test_tensors_are_snapshotted_at_hand_off(tmp_path, monkeypatch):
    """A payload that is a view into a buffer the engine reuses is copied at put: later writes to the buffer
    do not reach the record."""
    gate = threading.Event()
    real = disk_mod.atomic_write
    monkeypatch.setattr(disk_mod, "atomic_write", lambda *a, **k: (gate.wait(10), real(*a, **k))[1])
    buffer = torch.zeros(2, 1, 16, 8)
    buffer[:, :, :4] = 1.0
    e = KVEntry("v", "s", ROOT, (1, 2, 3, 4), 0, RawKV(buffer[:, :, :4], buffer[:, :, 4:8]))
    tier = DiskTier(path=tmp_path, capacity=100 * SIZE)
    tier.put(e)
    buffer.fill_(7.0)  # the engine reuses its buffer for the next request
    gate.set()
    tier.close()
    back = DiskTier(path=tmp_path, capacity=100 * SIZE).get("v")
    assert torch.equal(back.payload.keys, torch.ones(2, 1, 4, 8))
    assert torch.equal(back.payload.values, torch.zeros(2, 1, 4, 8))


def test_a_new_tier_rebuilds_its_index_from_headers_only(tmp_path, monkeypatch):
    tier = DiskTier(path=tmp_path, capacity=100 * SIZE)
    entries = [entry_for(f"k{i}", parent=ROOT if i == 0 else f"k{i - 1}") for i in range(6)]
    entries.append(KVEntry("seg:x", "x", None, (5, 6), 3, entry_for("x").payload, exact=False))
    for e in entries:
        tier.put(e)
    tier.close()
    loads = []
    monkeypatch.setattr(fmt, "decode", lambda *a, **k: loads.append(1) or (_ for _ in ()).throw(AssertionError))
    again = DiskTier(path=tmp_path, capacity=100 * SIZE)
    assert loads == [] and sorted(again.keys()) == sorted(e.key for e in entries)  # no tensor was read
    assert again.used_bytes == sum(e.nbytes for e in entries) and again.stats()["scanned"] == 7
    meta = again.peek_meta("k3")
    assert (meta.parent_key, meta.token_ids, meta.start, meta.nbytes) == ("k2", entries[3].token_ids,
                                                                          entries[3].start, SIZE)  # fmt: skip
    monkeypatch.undo()
    store = KVStore([MemoryTier(capacity=2 * SIZE), again])  # the store indexes what the tier found
    assert store.children(ROOT) == ["k0"] and store.children("k2") == ["k3"] and store.has_segment("x")
    assert same(store.get("k5"), entries[5]) and store.stats.promoted == 1 and "k5" in store.tiers[0]
    store.verify()
    store.close()


def test_removal_and_replacement_are_ordered_behind_writes(tmp_path):
    tier = DiskTier(path=tmp_path, capacity=100 * SIZE)
    tier.put(entry_for("a"))
    assert tier.remove("a").key == "a" and "a" not in tier and tier.get("a") is None
    tier.put(entry_for("b"))
    tier.flush()
    tier.remove("b")
    tier.put(entry_for("b", tokens=6))  # put, remove, put again: the last one wins on disk
    tier.flush()
    assert [p.name for p in files(tmp_path)] == [disk_mod.record_name("b")]
    tier.close()
    again = DiskTier(path=tmp_path, capacity=100 * SIZE)
    assert list(again.keys()) == ["b"] and again.get("b").num_tokens == 6


def test_capacity_evicts_files(tmp_path):
    tier = DiskTier(path=tmp_path, capacity=4 * SIZE)
    for i in range(10):
        evicted = tier.put(entry_for(f"n{i}"))
        assert tier.used_bytes <= tier.capacity_bytes and all(e.key not in tier for e in evicted)
        assert all(e.payload.keys is not None for e in evicted)  # alone (not last in a store): with payloads
    tier.flush()
    assert sorted(p.name for p in files(tmp_path)) == sorted(disk_mod.record_name(k) for k in tier.keys())
    assert len(tier) == 4  # evicted entries' files are deleted


def test_a_smaller_budget_at_start_trims_the_oldest_leaves(tmp_path):
    tier = DiskTier(path=tmp_path, capacity=10 * SIZE)
    for i, key in enumerate(["c0", "c1", "c2", "n0"]):
        tier.put(entry_for(key, parent=ROOT if i in (0, 3) else f"c{i - 1}"))
        tier.flush()
    tier.close()
    small = DiskTier(path=tmp_path, capacity=2 * SIZE)
    # oldest first, leaves first: c2 (c0 and c1 have children), then c1 (a leaf once c2 is gone)
    assert sorted(small.keys()) == ["c0", "n0"] and small.stats()["scan_evicted"] == 2
    assert len(files(tmp_path)) == 2


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_temp_files_of_dead_writers_are_ignored_and_cleaned(tmp_path):
    tier = DiskTier(path=tmp_path, capacity=100 * SIZE)
    tier.put(entry_for("a"))
    tier.close()
    record = files(tmp_path)[0]
    data = record.read_bytes()
    host = disk_mod._HOST
    dead = record.parent / f"{disk_mod.TMP_PREFIX}{host}-{_dead_pid()}-0123456789ab"
    dead.write_bytes(data[: len(data) // 2])  # a killed writer's half-written record
    alive = record.parent / f"{disk_mod.TMP_PREFIX}{host}-{os.getppid()}-0123456789ab"  # a live process's
    alive.write_bytes(data)
    old = record.parent / f"{disk_mod.TMP_PREFIX}otherhost-1-0123456789ab"
    old.write_bytes(data)
    os.utime(old, (time.time() - 2 * disk_mod.STALE_TMP_SECONDS,) * 2)
    again = DiskTier(path=tmp_path, capacity=100 * SIZE)
    assert list(again.keys()) == ["a"] and again.stats()["tmp_cleaned"] == 2 and again.stats()["corrupt_dropped"] == 0
    assert not dead.exists() and not old.exists() and alive.exists()  # a live writer's temp file is kept


def _corrupt(path: Path, how: str) -> None:
    path.write_bytes(damaged(path.read_bytes(), how))


def damaged(record: bytes, how: str) -> bytes:
    """A record damaged one way (the redis tier's tests damage theirs with it too)."""
    data = bytearray(record)
    if how == "flip_tensor":
        data[-40] ^= 0x10  # inside the tensor section: only the full checksum sees it
    elif how == "flip_header":
        data[fmt.PREFIX_SIZE + 3] ^= 0x01
    elif how == "truncate":
        data = data[: len(data) - 7]
    elif how == "garbage":
        data = bytearray(random.Random(0).randbytes(len(data)))
    elif how == "empty":
        data = bytearray()
    return bytes(data)


def test_damaged_records_are_dropped_counted_and_missed(tmp_path):
    tier = DiskTier(path=tmp_path, capacity=100 * SIZE)
    hows = ["flip_tensor", "flip_header", "truncate", "garbage", "empty"]
    for i in range(len(hows) + 1):
        tier.put(entry_for(f"k{i}"))
    tier.close()
    for i, how in enumerate(hows):
        _corrupt(tmp_path / disk_mod.record_name(f"k{i}")[:2] / disk_mod.record_name(f"k{i}"), how)
    stray = tmp_path / "ab" / ("ab" + "0" * 30 + ".kvr")  # a well-formed record under the wrong name
    stray.parent.mkdir(exist_ok=True)
    stray.write_bytes(fmt.encode(entry_for("zz"), fingerprint=""))
    again = DiskTier(path=tmp_path, capacity=100 * SIZE)
    # headers are checked at start (all but the tensor bit flip), the tensor bit flip on read
    assert sorted(again.keys()) == ["k0", "k5"] and again.stats()["corrupt_dropped"] == 5
    store = KVStore([again])
    assert store.get("k0") is None and "k0" not in store and store.get("k0") is None  # a miss, forgotten
    assert again.stats()["corrupt_dropped"] == 6 and same(store.get("k5"), entry_for("k5"))
    assert [p.name for p in files(tmp_path)] == [disk_mod.record_name("k5")]  # every damaged file deleted
    store.verify()


def test_a_record_deleted_by_another_process_is_a_miss(tmp_path):
    mine = DiskTier(path=tmp_path, capacity=100 * SIZE)
    mine.put(entry_for("a"))
    mine.put(entry_for("b", parent="a"))
    mine.flush()
    other = DiskTier(path=tmp_path, capacity=100 * SIZE)  # shares the folder
    other.remove("a")
    other.flush()
    store = KVStore([MemoryTier(capacity=SIZE), mine])
    store.tiers[0].clear()
    assert store.peek("a") is None and "a" not in store and mine.stats()["missing_dropped"] == 1
    assert same(store.get("b"), entry_for("b", parent="a"))  # the rest is still served
    store.verify()


def test_another_fingerprint_is_never_served(tmp_path):
    writer = DiskTier(path=tmp_path, capacity=100 * SIZE)
    writer.bind_context(fingerprint="model-A", quantizer_settings={"name": "none"})
    writer.put(entry_for("a"))
    writer.close()
    header = fmt.decode_header(files(tmp_path)[0].read_bytes())
    assert header["fingerprint"] == "model-A" and header["quantizer"] == {"name": "none"}
    reader = DiskTier(path=tmp_path, capacity=100 * SIZE)
    reader.bind_context(fingerprint=lambda: "model-B")
    assert "a" in reader and reader.get("a") is None and reader.stats()["foreign_skipped"] == 1
    assert len(files(tmp_path)) == 1  # not deleted: it is intact, only not ours
    same_fp = DiskTier(path=tmp_path, capacity=100 * SIZE)
    same_fp.bind_context(fingerprint="model-A")
    assert same(same_fp.get("a"), entry_for("a"))


# ---------------------------------------------------------------------------------------------- background reads
def _chain(n: int, prefix: str = "c") -> list[KVEntry]:
    return [entry_for(f"{prefix}{i}", parent=ROOT if i == 0 else f"{prefix}{i - 1}") for i in range(n)]


def _written(tmp_path: Path, entries: list[KVEntry]) -> None:
    writer = DiskTier(path=tmp_path, capacity=100 * SIZE)
    for e in entries:
        writer.put(e)
    writer.close()


def test_a_chain_is_read_in_order_on_the_background_reader(tmp_path, monkeypatch):
    entries = _chain(8)
    _written(tmp_path, entries)
    seen: list[tuple[str, str]] = []
    real = disk_mod._read_bytes

    def recorded(file):
        seen.append((file.name, threading.current_thread().name))
        return real(file)

    monkeypatch.setattr(disk_mod, "_read_bytes", recorded)
    tier = DiskTier(path=tmp_path, capacity=100 * SIZE)
    store = KVStore([MemoryTier(capacity=100 * SIZE), tier])
    keys = [e.key for e in entries]
    assert store.prefetch([*keys, "not-stored"]) == 8
    assert store.prefetch(keys) == 0  # already queued
    assert all(same(store.get(k), e) for k, e in zip(keys, entries))  # waited for, promoted
    assert [name for name, _ in seen] == [disk_mod.record_name(k) for k in keys]  # chain order, each read once
    assert all(name.startswith("kvboost-disk-read") for _, name in seen)  # not on the caller's thread
    stats = tier.stats()
    assert stats["background_queued"] == 8 and stats["background_used"] == 8 and stats["reads"] == 8
    per_tier = store.summary()["per_tier"]
    assert per_tier["disk"]["hits"] == 8 and per_tier["disk"]["loads"] == 8
    assert per_tier["disk"]["background_used"] == 8 and per_tier["disk"]["load_ms_per_mib"] > 0
    assert per_tier["memory"]["hits"] == 0 and "loads" not in per_tier["memory"]
    store.verify()
    tier.close()


def test_background_reads_of_damaged_replaced_or_foreign_records_are_not_served(tmp_path):
    entries = _chain(4)
    _written(tmp_path, entries + _chain(2, "d"))
    name = disk_mod.record_name("c2")
    _corrupt(tmp_path / name[:2] / name, "flip_tensor")  # passes the header scan, fails the checksum
    tier = DiskTier(path=tmp_path, capacity=100 * SIZE)
    store = KVStore([MemoryTier(capacity=100 * SIZE), tier])
    assert store.prefetch([e.key for e in entries]) == 4
    assert same(store.get("c0"), entries[0]) and same(store.get("c1"), entries[1])
    assert store.get("c2") is None and "c2" not in store  # checked on use: dropped, counted, file deleted
    assert tier.stats()["corrupt_dropped"] == 1 and not (tmp_path / name[:2] / name).exists()
    store.verify()
    tier.close()

    fresh = DiskTier(path=tmp_path, capacity=100 * SIZE)
    assert fresh.prefetch_async(["d0", "d1"]) == 2
    newer = KVEntry("d1", "s-new", "d0", (1, 2, 3, 4), 0, entry_for("other").payload)
    fresh.put(newer)  # replaced after its read was queued: the old read is dropped
    got = fresh.get("d1")
    assert got.segment_key == "s-new" and torch.equal(got.payload.keys, newer.payload.keys)
    fresh.close()

    fingerprint = ["model-A"]
    mine = DiskTier(path=tmp_path, capacity=100 * SIZE)
    mine.bind_context(fingerprint="model-A")
    mine.put(entry_for("fa"))
    mine.close()
    reader = DiskTier(path=tmp_path, capacity=100 * SIZE)
    reader.bind_context(fingerprint=lambda: fingerprint[0])
    assert reader.prefetch_async(["fa"]) == 1
    fingerprint[0] = "model-B"  # the engine's fingerprint changed while the read was queued
    assert reader.get("fa") is None and reader.stats()["foreign_skipped"] == 1  # decoded against the current one
    reader.close()


def test_pending_writes_are_flushed_at_interpreter_exit(tmp_path):
    code = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_disk_tier import entry_for
        from kvboost.cache import disk
        real = disk.atomic_write
        disk.atomic_write = lambda *a, **k: (time.sleep(0.01), real(*a, **k))[1]
        tier = disk.DiskTier(path={str(tmp_path)!r}, capacity="1MiB")
        for i in range(40):
            tier.put(entry_for(f"k{{i}}"))
        print(tier.stats()["pending_writes"])
    """)  # no close(): the atexit hook must write what is queued
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parents[1])  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) > 20  # most were still queued when the script ended
    again = DiskTier(path=tmp_path, capacity="1MiB")
    assert len(again) == 40 and all(same(again.get(f"k{i}"), entry_for(f"k{i}")) for i in range(40))


def _crash_writer(path: str, worker: int, seed: int) -> None:
    """Writes entries in a loop until killed: its own keys and keys every worker shares (same content)."""
    torch.set_num_threads(1)

    def slow_write_all(fd: int, data: bytes) -> None:  # a slow disk: a kill often lands mid-record
        for i in range(0, len(data), 256):
            os.write(fd, data[i : i + 256])
            time.sleep(0.001)

    disk_mod._write_all = slow_write_all
    tier = DiskTier(path=path, capacity="64MiB", max_pending_bytes=8 * SIZE)
    rng = random.Random(seed)
    i = 0
    while True:
        key = f"shared-{rng.randrange(30)}" if rng.random() < 0.3 else f"w{worker}-{i}"
        tier.put(entry_for(key, tokens=rng.choice((2, 4, 8))))
        if rng.random() < 0.1 and len(tier):
            tier.remove(rng.choice(list(tier.keys())))
        i += 1


def test_writers_killed_at_random_moments_leave_no_served_damage(tmp_path):
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    procs = [ctx.Process(target=_crash_writer, args=(str(tmp_path), w, w), daemon=True) for w in range(20)]
    for p in procs:
        p.start()
    deadline = time.monotonic()
    for p in sorted(procs, key=lambda _: rng.random()):
        deadline += rng.uniform(0.02, 0.12)
        time.sleep(max(0.0, deadline - time.monotonic()))
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
    left = len(files(tmp_path, f"{disk_mod.TMP_PREFIX}*"))
    tier = DiskTier(path=tmp_path, capacity="64MiB")
    stats = tier.stats()
    assert stats["corrupt_dropped"] == 0, "a torn record reached its final name"
    assert left > 0, "no writer was killed mid-record: the test would not see a torn write"
    assert stats["tmp_cleaned"] == left
    assert files(tmp_path, f"{disk_mod.TMP_PREFIX}*") == []
    assert len(tier) > 20, "the writers wrote too little to test anything"
    tokens = {}
    for key in list(tier.keys()):
        got = tier.get(key)
        assert got is not None, key
        tokens[key] = got.num_tokens
        expected = entry_for(key, tokens=got.num_tokens)  # content is a function of the key (and its size)
        assert same(got, expected), key
    assert tier.stats()["corrupt_dropped"] == 0 and len(tier) == len(tokens)


# ---------------------------------------------------------------------------------------------- engine level
def _conversations(n_conv: int = 3, turns: int = 4) -> list[list[list[int]]]:
    """Fixed multi-turn prompts (each turn = previous prompt + its cold answer + a new message)."""
    engine = make_engine("llama")
    out = []
    for c in range(n_conv):
        prompts, prompt = [], random_ids(20 + 7 * c, seed=100 + c)
        for t in range(turns):
            prompts.append(prompt)
            answer = engine.generate(prompt, max_new_tokens=6, mode="cold").output_ids
            prompt = prompt + answer + random_ids(11 + 3 * t, seed=1000 * c + t)
        out.append(prompts)
    engine.close()
    return out


@pytest.fixture(scope="module")
def conversations():
    return _conversations()


@pytest.fixture(scope="module")
def cold_outputs(conversations):
    engine = make_engine("llama")
    outs = {(c, t): engine.generate(p, max_new_tokens=6, mode="cold").output_ids
            for c, conv in enumerate(conversations) for t, p in enumerate(conv)}  # fmt: skip
    engine.close()
    return outs


def _tiers(path: Path, memory_chunks: int = 3) -> list[dict]:
    chunk_bytes = 16 * 512  # 16 tokens x 2 layers x 2 kv heads x 16 dims x (k, v) x fp32
    return [{"name": "memory", "capacity": memory_chunks * chunk_bytes}, {"name": "disk", "path": str(path),
                                                                          "capacity": "64MiB"}]  # fmt: skip


def _serve(engine, conversations, turns, cold_outputs, exact: dict | None = None) -> dict[tuple[int, int], int]:
    """Turns ``turns`` of every conversation, turn by turn (interleaved); greedy outputs checked against cold.
    Returns the cached tokens per (conversation, turn) (and fills ``exact`` with the exact-hit tokens)."""
    cached = {}
    for t in turns:
        for c, conv in enumerate(conversations):
            r = engine.generate(conv[t], max_new_tokens=6)
            assert r.output_ids == cold_outputs[(c, t)], (c, t)
            cached[(c, t)] = r.cached_tokens
            if exact is not None:
                exact[(c, t)] = r.exact_hit_tokens
    return cached


def test_memory_over_disk_demotes_and_promotes(tmp_path, conversations, cold_outputs):
    engine = make_engine("llama", cache=_tiers(tmp_path, memory_chunks=2))
    _serve(engine, conversations, range(4), cold_outputs)
    stats = engine.cache_stats()
    assert stats["demoted"] > 0 and stats["promoted"] > 0 and stats["per_tier_hits"].get("disk", 0) > 0
    assert stats["tiers"][1]["tier"] == "disk" and stats["tiers"][1]["entries"] > 0
    assert stats["corrupt_entries_dropped"] == 0
    engine.store.verify()
    engine.close()


def test_restart_reuses_the_previous_process_cache(tmp_path, conversations, cold_outputs):
    single = make_engine("llama", cache={"name": "memory", "capacity": "64MiB"})
    reference = _serve(single, conversations, range(4), cold_outputs)
    single.close()
    assert sum(reference[(c, t)] for c in range(3) for t in (2, 3)) > 0

    with make_engine("llama", cache=_tiers(tmp_path)) as first:  # the context manager closes (and flushes)
        _serve(first, conversations, range(2), cold_outputs)
    assert files(tmp_path)
    second = make_engine("llama", cache=_tiers(tmp_path))  # a new model object and engine: an empty memory tier
    assert len(second.store.tiers[0]) == 0 and len(second.store.tiers[1]) > 0
    got = _serve(second, conversations, range(2, 4), cold_outputs)
    assert got == {k: v for k, v in reference.items() if k[1] >= 2}  # the same reuse, turn by turn
    stats = second.cache_stats()
    assert stats["per_tier_hits"]["disk"] > 0
    disk = stats["per_tier"]["disk"]  # the lookup had the chains read in the background
    assert disk["hits"] == stats["per_tier_hits"]["disk"] and disk["background_used"] > 0 and disk["loads"] > 0
    second.close()


def test_write_through_puts_every_entry_on_disk_at_once(tmp_path, conversations, cold_outputs):
    tiers = _tiers(tmp_path)
    tiers[1]["write_through"] = True
    first = make_engine("llama", cache=tiers)
    _serve(first, conversations, range(2), cold_outputs)
    first.store.flush()
    stats = first.cache_stats()
    assert stats["written_through"] > 0  # (entries the full memory tier refused went to disk directly)
    other = DiskTier(path=tmp_path, capacity="64MiB")  # another process, before this one closes
    assert set(other.keys()) == set(first.store.tiers[0].keys()) | set(first.store.tiers[1].keys())
    other.close()
    records = len(files(tmp_path))
    demoted = stats["demoted"]
    first.close()  # nothing left to spill: every entry is on disk already
    assert len(files(tmp_path)) == records and first.cache_stats()["demoted"] == demoted
    second = make_engine("llama", cache=_tiers(tmp_path))
    got = _serve(second, conversations, range(2, 4), cold_outputs)
    assert sum(got.values()) > 0 and second.cache_stats()["per_tier_hits"]["disk"] > 0
    second.close()
    with pytest.raises(ValueError, match="write_through"):
        make_engine("llama", cache=[{"name": "memory", "write_through": "yes"}])


def test_damaged_files_are_recomputed_with_cold_outputs(tmp_path, conversations, cold_outputs):
    with make_engine("llama", cache=_tiers(tmp_path)) as first:
        _serve(first, conversations, range(2), cold_outputs)
        fingerprint = first.fingerprint
        chunker, hasher = first.chunker, first.hasher
    damaged = 0
    for c, how in enumerate(("flip_tensor", "truncate", "garbage")):
        _, keys = chunk_prompt(conversations[c][2], chunker, hasher, fingerprint)
        name = disk_mod.record_name(keys[c].prefix_key)  # chunk c of conversation c
        _corrupt(tmp_path / name[:2] / name, how)
        damaged += 1
    second = make_engine("llama", cache=_tiers(tmp_path))
    exact: dict = {}
    _serve(second, conversations, range(2, 4), cold_outputs, exact)  # outputs equal cold (checked inside)
    stats = second.cache_stats()
    assert stats["corrupt_entries_dropped"] == damaged
    # conversation 0 lost its first chunk: no exact hit (later chunks may still be content hits); conversation
    # 2 lost its third: exact hits up to it
    assert exact[(0, 2)] == 0 and exact[(2, 2)] == 32
    again = second.generate(conversations[0][2], max_new_tokens=6)  # recomputed chunks were stored again
    assert again.cached_tokens == len(conversations[0][2]) - 1 and again.output_ids == cold_outputs[(0, 2)]
    second.store.verify()
    second.close()


def test_another_model_or_salt_gets_no_hits_from_the_same_folder(tmp_path, conversations, cold_outputs):
    with make_engine("llama", cache=_tiers(tmp_path)) as first:
        _serve(first, conversations, range(2), cold_outputs)
        first_fp = first.fingerprint
    prompt = conversations[0][1]
    other = KVBoost(tiny_model("llama", seed=1), ToyTokenizer(), model_identity="tiny-llama", chunker=CHUNK,
                    cache=_tiers(tmp_path))  # fmt: skip
    assert other.fingerprint != first_fp and len(other.store.tiers[1]) > 0  # it sees the records...
    r = other.generate(prompt, max_new_tokens=6)
    assert r.cached_tokens == 0 and other.cache_stats()["per_tier_hits"] == {}  # ...and is served none
    other.close()
    salted = make_engine("llama", cache=_tiers(tmp_path))
    assert salted.generate(prompt, max_new_tokens=6, cache_salt="tenant-2").cached_tokens == 0
    assert salted.generate(prompt, max_new_tokens=6).cached_tokens > 0  # unsalted: the first engine's entries
    salted.close()


def test_a_hit_from_a_write_through_tier_stored_again_keeps_the_books(tmp_path, conversations, cold_outputs):
    """A chunk served from the write-through tier below and stored again is promoted into the pool tier; when the
    full pool tier refuses it or evicts others to take it, the store's books must follow (the entry stays below;
    the evicted ones move down). Before the fix the promotion ignored the pool tier's answer: the books kept
    refused or evicted entries at the pool tier, and the next lookup of one raised "tier memory lost ... behind
    the store's back" (seen with a 1 MiB memory tier over Redis, experiments/checks/ray_router_check)."""
    tiers = _tiers(tmp_path, memory_chunks=2)
    tiers[1]["write_through"] = True
    engine = make_engine("llama", cache=tiers)
    for t in range(4):
        for c, conv in enumerate(conversations):
            r = engine.generate(conv[t], max_new_tokens=6)
            assert r.output_ids == cold_outputs[(c, t)], (c, t)
            engine.store.verify()
    assert engine.cache_stats()["per_tier_hits"].get("disk", 0) > 0
    engine.close()
