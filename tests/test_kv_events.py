"""KV events (``kvboost.cache.events``): the store's cache published in vLLM's KV-event schema.

- a subscriber over real ZMQ sockets rebuilds the engine's index (the keys of each tier) after requests, evictions,
  a close (spill to disk) and a restart of the engine on the same disk tier;
- a hypothesis state machine over a two-tier store (put / get / remove / pin / clear / dropped batches) checks after
  every step that the index rebuilt from the events equals the store's own;
- the replay socket serves a late subscriber the batches from sequence N (and only what the buffer keeps); a full
  queue drops the oldest batch, counted;
- the bytes are vLLM's: msgspec structs declared as vLLM 0.33.0 declares them (``vllm/distributed/kv_events.py``:
  ``EventBatch`` ``array_like``; events tagged, maps since vLLM PR #42892) and as before #42892 (events
  ``array_like`` too) encode the same content to the same bytes, and decode ours.
"""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import time

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from kvboost_testkit.tiny import make_engine, random_ids

from kvboost.cache import DiskTier, KVEntry, KVStore, MemoryTier, segment_only_key
from kvboost.cache.events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventIndex,
    KVEventsConfig,
    KVEventSink,
    KVEventSubscriber,
    ZmqEventPublisher,
    decode_batch,
    encode_batch,
    external_hash,
    salt_tag,
    store_index,
)
from kvboost.quant.none import RawKV

zmq = pytest.importorskip("zmq")

BLOCK_BYTES = 16 * 512  # one 16-token block of the tiny llama (2 layers x K,V x 2 heads x 16 dims x fp32)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond, sub: KVEventSubscriber, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "events did not arrive"
        sub.poll(20)


def synced(engine, sub: KVEventSubscriber, restarts: int = 0) -> None:
    """Wait until ``sub`` applied every batch the engine published. A subscriber (re)connecting to a publisher misses
    what was sent before (ZMQ's slow joiner); it learns of the gap from the next batch. A live engine keeps
    publishing; here an empty batch (valid in the schema) stands for that next batch when nothing arrives."""
    publisher = engine.kv_events.publisher
    for _ in range(40):
        assert publisher.flush()
        last = publisher.last_seq
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            sub.poll(20)
            if sub.restarts == restarts and sub.last_seq == last:
                return
        publisher.publish(KVEventBatch(ts=time.time(), events=[]))
    raise AssertionError(f"subscriber at seq {sub.last_seq} (restarts {sub.restarts}), publisher at {last}")


class Recorder:
    """A publisher test double: keeps the batches (``drop_last`` loses one, as a full queue would)."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []
        self.lost: list[KVEventBatch] = []
        self.dropped = 0

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def drop_last(self) -> None:
        if self.batches:
            self.lost.append(self.batches.pop())
            self.dropped += 1

    def take_dropped(self) -> list[KVEventBatch]:
        lost, self.lost = self.lost, []
        return lost

    def shutdown(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------- (1) engine, real ZMQ
def test_subscriber_index_matches_the_engine_through_evictions_and_a_restart(tmp_path):
    pub_port, replay_port = free_port(), free_port()
    options = {
        "cache": [{"name": "memory", "capacity": 6 * BLOCK_BYTES},
                  {"name": "disk", "path": str(tmp_path), "fsync": False}],
        "kv": {"pool_bytes": 40 * BLOCK_BYTES}, "decode": "eager",
        "kv_events": {"enabled": True, "endpoint": f"tcp://*:{pub_port}", "replay_endpoint": f"tcp://*:{replay_port}",
                      "topic": "kvboost", "salt_key": "events-key"},
    }  # fmt: skip
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{pub_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                            topic="kvboost")  # fmt: skip
    engine = make_engine("llama", **options)
    try:
        shared = random_ids(32, seed=100)
        prompts = [shared + random_ids(24, seed=i) for i in range(4)] + [random_ids(48, seed=10 + i) for i in range(4)]
        for i, ids in enumerate(prompts):
            engine.generate(ids, max_new_tokens=3, cache_salt="tenant-a" if i == 5 else "")
            synced(engine, sub)
            assert sub.index.as_dict() == store_index(engine.store), f"after request {i}"
        summary = engine.store.summary()
        assert summary["demoted"] > 0 and summary["tiers"][1]["entries"] > 0, "the small memory tier never evicted"
        assert sub.index.as_dict()["DISK"], "nothing reached the disk tier"

        # the salted first chunk: parent None, its salt's keyed hash as the extra key (where vLLM puts cache_salt)
        stored = [e for _, b in sub.request_replay(0) for e in b.events if isinstance(e, BlockStored)]
        salted = [e for e in stored if e.extra_keys == [[salt_tag("tenant-a", "events-key")]]]
        assert salted and all(e.parent_block_hash is None for e in salted) and salted[0].medium == "GPU"
        # blocks of the pool's 16 tokens (= the chunks here); a prompt's short last chunk is not published
        assert all(e.block_size == 16 and len(e.token_ids) == 16 * len(e.block_hashes) for e in stored)
        assert any(e.parent_block_hash is not None for e in stored)  # chained chunks name their parent

        engine.close()  # spills memory into disk: the index keeps the disk tier only
        last = engine.kv_events.publisher.last_seq
        wait_until(lambda: sub.last_seq >= last, sub)
        before_restart = store_index(engine.store)
        assert set(before_restart) == {"DISK"} and sub.index.as_dict() == before_restart
    finally:
        engine.close()

    # Restart on the same disk tier: the new publisher counts from 0 and opens with AllBlocksCleared + its entries.
    engine = make_engine("llama", **options)
    try:
        assert store_index(engine.store) == before_restart  # the records came back
        engine.generate(prompts[0] + random_ids(8, seed=99), max_new_tokens=3)
        synced(engine, sub, restarts=1)
        assert sub.index.as_dict() == store_index(engine.store)
        assert "GPU" in sub.index.as_dict()
    finally:
        engine.close()
        sub.close()


def test_kv_events_are_off_by_default_and_options_are_checked():
    engine = make_engine("llama")
    try:
        assert engine.kv_events is None and engine.store.events is None
    finally:
        engine.close()
    with pytest.raises(ValueError, match="unknown kv_events option"):
        KVEventsConfig.from_options({"enabled": True, "endpont": "tcp://*:1"})
    with pytest.raises(ValueError, match="encoding"):
        KVEventsConfig.from_options({"encoding": "json"})
    assert KVEventsConfig.from_options({"enable_kv_cache_events": True}).enabled  # vLLM's spelling
    assert KVEventsConfig.from_options({"enabled": False}).build_publisher() is None


def test_the_engine_config_group_turns_events_on():
    """``engine.kv_events.*`` overrides (as run.py and kvboost-server compose them) reach the engine."""
    from kvboost_testkit.compose import compose
    from omegaconf import OmegaConf

    from kvboost.build import build_engine

    port = free_port()
    cfg = OmegaConf.to_container(compose(["model=tiny_random", "engine.decode=eager", "engine.kv_events.enabled=true",
                                          f"engine.kv_events.endpoint=tcp://*:{port}", "engine.kv_events.topic=kv"]),
                                 resolve=True)  # fmt: skip
    engine = build_engine(cfg)
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{port}", topic="kv")
    try:
        assert isinstance(engine.kv_events.publisher, ZmqEventPublisher)
        engine.generate("The quick brown fox jumps over the lazy dog. " * 3, max_new_tokens=2)
        synced(engine, sub)
        assert sub.index.as_dict() == store_index(engine.store) and sub.index.as_dict()["GPU"]
    finally:
        engine.close()
        sub.close()
    assert compose([]).engine.kv_events.enabled is False  # off by default


# ---------------------------------------------------------------------------------------------- (2) state machine
ROOT = "root"
# a fixed tree (a key always has the same parent and tokens): k0,k1 <- ROOT; k2,k3 <- k0; k4 <- k2; k5 <- k1; k6 <- k4
TREE = {"k0": ROOT, "k1": ROOT, "k2": "k0", "k3": "k0", "k4": "k2", "k5": "k1", "k6": "k4"}
KEYS = [*TREE, segment_only_key("s7")]


def make_entry(key: str, pinned: bool = False) -> KVEntry:
    tokens = 4 + 4 * (KEYS.index(key) % 2)
    k = torch.zeros(2, 1, tokens, 8)
    ids = tuple(range(KEYS.index(key), KEYS.index(key) + tokens))
    if not key.startswith("seg:"):  # siblings start alike: in 4-token blocks they share their first block
        first = 100 + 10 * (KEYS.index(TREE[key]) if TREE[key] in KEYS else 9)
        ids = tuple(range(first, first + tokens))
    if key.startswith("seg:"):
        return KVEntry(key, key[4:], None, ids, 0, RawKV(k, k.clone()), pinned=pinned, exact=False)
    return KVEntry(key, "s-" + key, TREE[key], ids, 0, RawKV(k, k.clone()), pinned=pinned)


ENTRY_BYTES = make_entry("k0").nbytes


class IgnoresAllBlocksCleared(KVEventIndex):
    """An index that skips ``AllBlocksCleared``, as llm-d's event pool does (``pkg/kvevents/pool.go``: the event is
    only logged)."""

    def apply(self, batch: KVEventBatch) -> None:
        super().apply(KVEventBatch(batch.ts, [e for e in batch.events if not isinstance(e, AllBlocksCleared)]))


class StoreEvents(RuleBasedStateMachine):
    """A memory tier over a disk tier (write-through or write-back), small enough that puts evict and demote."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kv_events_")
        self.write_through = len(COUNTS) % 2 == 0
        COUNTS.append(1)
        self.store = KVStore([MemoryTier(capacity=3 * ENTRY_BYTES),
                              DiskTier(self.dir, capacity=5 * ENTRY_BYTES, fsync=False)],
                             write_through=[False, self.write_through])  # fmt: skip
        self.recorder = Recorder()
        # every other run publishes fixed blocks of 4 tokens (the entries hold 4 or 8), the others one per chunk
        self.sink = KVEventSink(self.recorder, block_size=4 if len(COUNTS) % 4 < 2 else "chunk")
        self.store.attach_events(self.sink)
        self.index = KVEventIndex()
        self.ignoring = IgnoresAllBlocksCleared()  # llm-d's handling: AllBlocksCleared only logged
        self.applied = 0

    def teardown(self) -> None:
        for name in ("demoted", "promoted", "evicted", "written_through"):
            MOVES[name] = MOVES.get(name, 0) + getattr(self.store.stats, name)
        MOVES["resyncs"] = MOVES.get("resyncs", 0) + self.recorder.dropped
        self.store.close(spill=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(key=st.sampled_from(KEYS), pinned=st.booleans())
    def put(self, key, pinned):
        self.store.put(make_entry(key, pinned))

    @rule(key=st.sampled_from(KEYS))
    def get(self, key):  # a hit in the disk tier is promoted
        self.store.get(key)

    @rule(key=st.sampled_from(KEYS))
    def lookup_and_pin(self, key):
        if self.store.get(key) is not None:
            self.store.set_pinned(key, True)

    @rule(key=st.sampled_from(KEYS))
    def unpin(self, key):
        self.store.set_pinned(key, False)

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key):
        self.store.remove(key)

    @rule()
    def clear(self):
        self.store.clear()

    @rule(key=st.sampled_from(KEYS))
    def lose_a_batch(self, key):  # the publisher dropped the last batch: the next operation sends a snapshot
        self.recorder.drop_last()
        self.store.peek(key)

    @invariant()
    def index_from_events_equals_the_stores(self):
        for i, batch in enumerate(self.recorder.batches[self.applied :]):
            encoding = ("map", "array")[(self.applied + i) % 2]
            decoded = decode_batch(encode_batch(batch, encoding))  # through the wire format, both layouts
            self.index.apply(decoded)
            self.ignoring.apply(decoded)
        self.applied = len(self.recorder.batches)
        self.store.verify()
        truth = store_index(self.store)
        assert self.index.as_dict() == truth
        # a consumer that ignores AllBlocksCleared ends right too: clears and resyncs remove what is gone
        assert self.ignoring.as_dict() == truth
        # each block is stored once per medium (shared leading blocks too), so consumers keeping sets stay exact
        assert all(count == 1 for held in self.index.media.values() for count in held.values())
        assert not any(str(k).startswith("seg:") for k in self.sink._published)  # content-only: never published


COUNTS: list[int] = []
MOVES: dict[str, int] = {}


def test_store_state_machine_index_from_events_equals_the_stores():
    MOVES.clear()
    run_state_machine_as_test(StoreEvents, settings=settings(
        max_examples=150, stateful_step_count=30, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck),
    ))  # fmt: skip
    assert all(MOVES[name] > 0 for name in ("demoted", "promoted", "evicted", "written_through", "resyncs")), MOVES


def test_store_events_for_each_movement():
    recorder = Recorder()
    fits = make_entry("k0").nbytes + make_entry("k1").nbytes
    store = KVStore([MemoryTier(capacity=fits), MemoryTier(capacity=4 * fits)])
    store.attach_events(KVEventSink(recorder, block_size="chunk"))  # one block per chunk (entries of 4 and 8 tokens)
    assert [type(e) for e in recorder.batches[-1].events] == [AllBlocksCleared]  # the (empty) snapshot
    for key in ("k1", "k0", "k3"):  # k3 (8 tokens, a child of k0) demotes k1 (8 tokens, a leaf), not its parent
        store.put(make_entry(key))
    moves = recorder.batches[-1].events
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in moves] == [
        ("BlockRemoved", "GPU", [external_hash("k1")]),
        ("BlockStored", "GPU", [external_hash("k3")]),
        ("BlockStored", "CPU", [external_hash("k1")]),
    ]
    k3 = moves[1]
    assert k3.parent_block_hash == external_hash("k0") and k3.token_ids == list(make_entry("k3").token_ids)
    assert k3.block_size == len(k3.token_ids) == 8 and k3.extra_keys == [None]
    n = len(recorder.batches)
    store.peek("k0")  # nothing moves: no batch
    assert len(recorder.batches) == n
    store.clear()  # removals of what was held (for consumers that ignore AllBlocksCleared), then AllBlocksCleared
    cleared = recorder.batches[-1].events
    assert [type(e) for e in cleared] == [BlockRemoved, BlockRemoved, AllBlocksCleared]
    assert {(e.medium, h) for e in cleared[:2] for h in e.block_hashes} == {
        ("GPU", external_hash("k0")), ("GPU", external_hash("k3")), ("CPU", external_hash("k1"))}


# ---------------------------------------------------------------------------------------------- (3) replay
def test_replay_serves_a_late_subscriber_from_sequence_n():
    pub_port, replay_port = free_port(), free_port()
    publisher = ZmqEventPublisher(f"tcp://*:{pub_port}", replay_endpoint=f"tcp://*:{replay_port}", topic="kv",
                                  buffer_steps=15)  # fmt: skip
    try:
        batches = [KVEventBatch(ts=1000.0 + i, events=[BlockRemoved(block_hashes=[i], medium="memory")])
                   for i in range(20)]  # fmt: skip
        for batch in batches:
            publisher.publish(batch)
        deadline = time.monotonic() + 10
        while publisher.published < 20:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        # A subscriber that joins now missed all 20; it asks for the batches from 12 on.
        late = KVEventSubscriber(f"tcp://127.0.0.1:{pub_port}", replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
                                 topic="kv")  # fmt: skip
        try:
            replayed = late.request_replay(12)
            assert [seq for seq, _ in replayed] == list(range(12, 20))
            assert [b.events[0].block_hashes for _, b in replayed] == [[i] for i in range(12, 20)]
            assert [b.ts for _, b in replayed] == [1000.0 + i for i in range(12, 20)]
            assert all(b.data_parallel_rank == 0 for _, b in replayed)
            # the buffer keeps the last 15: from 0 it answers 5..19
            assert [seq for seq, _ in late.request_replay(0)] == list(range(5, 20))
            # raw frames, as a vLLM subscriber reads them: (topic, seq, payload) then the end marker (b"", -1, b"")
            raw = zmq.Context.instance().socket(zmq.DEALER)
            raw.connect(f"tcp://127.0.0.1:{replay_port}")
            raw.send_multipart((b"", (18).to_bytes(8, "big")))
            frames = [raw.recv_multipart() for _ in range(3)]
            raw.close(linger=0)
            assert [f[1:3] for f in frames] == [[b"kv", (18).to_bytes(8, "big")], [b"kv", (19).to_bytes(8, "big")],
                                                [b"", END_SEQ]]  # fmt: skip
            assert frames[2][3] == b""
            # a live batch after the late join: the gap before 20 is filled from the buffer (now 6..20: 6..19), then
            # 20 applies
            publisher.publish(KVEventBatch(ts=2000.0, events=[AllBlocksCleared()]))
            wait_until(lambda: late.last_seq == 20, late)
            assert late.replayed == 14 and late.index.batches == 15
        finally:
            late.close()
    finally:
        publisher.shutdown()


class _Stalled(ZmqEventPublisher):
    gate = threading.Event()

    def _run(self) -> None:
        self.gate.wait(10)
        super()._run()


def test_a_full_queue_drops_the_oldest_batch_and_counts_it():
    publisher = _Stalled(f"tcp://*:{free_port()}", max_queue_size=4)
    try:
        start = time.perf_counter()
        for i in range(10):
            publisher.publish(KVEventBatch(ts=float(i), events=[]))
        assert time.perf_counter() - start < 0.5  # publish never waits for the thread
        assert publisher.dropped == 6 and [b.ts for b in publisher._queue] == [6.0, 7.0, 8.0, 9.0]
    finally:
        _Stalled.gate.set()
        publisher.shutdown()
    assert publisher.published == 4


# ---------------------------------------------------------------------------------------------- (4) the wire layout
def _vllm_structs(events_array_like: bool, legacy_fields: bool = False):
    """msgspec structs declared as vLLM declares them (vllm/distributed/kv_events.py, 0.33.0): EventBatch is
    array_like with (ts, events, data_parallel_rank=None); KVCacheEvent is tagged (tag = class name, under "type" in
    a map), omit_defaults; BlockStored's fields in order block_hashes, parent_block_hash, token_ids, block_size,
    lora_id, medium, lora_name, then defaulted extra_keys, group_idx, kv_cache_spec_kind,
    kv_cache_spec_sliding_window, locality, ownership, session_id, lookahead_token_ids; BlockRemoved: block_hashes,
    medium, then defaulted group_idx, locality, ownership. ``events_array_like``: the layout before vLLM PR #42892
    (events array_like too). ``legacy_fields``: BlockStored's fields end at extra_keys and BlockRemoved's at medium
    (vLLM between #33304, extra_keys, and #37688, group_idx)."""
    msgspec = pytest.importorskip("msgspec")
    from typing import Any

    def struct(name, fields, **options):  # msgspec.defstruct: real types (this module's annotations are strings)
        return msgspec.defstruct(name, fields, omit_defaults=True, gc=False, **options)

    Hash = bytes | int
    event = {"tag": True, "array_like": events_array_like}
    stored = [
        ("block_hashes", list[Hash]),
        ("parent_block_hash", Hash | None),
        ("token_ids", list[int]),
        ("block_size", int),
        ("lora_id", int | None),
        ("medium", str | None),
        ("lora_name", str | None),
        ("extra_keys", list[tuple[Any, ...] | None] | None, None),
    ]
    removed = [("block_hashes", list[Hash]), ("medium", str | None)]
    if not legacy_fields:
        stored += [
            ("group_idx", int | None, None),
            ("kv_cache_spec_kind", str | None, None),
            ("kv_cache_spec_sliding_window", int | None, None),
            ("locality", str | None, None),
            ("ownership", str | None, None),
            ("session_id", str | None, None),
            ("lookahead_token_ids", list[list[int]] | None, None),
        ]
        removed += [("group_idx", int | None, None), ("locality", str | None, None), ("ownership", str | None, None)]
    stored_cls = struct("BlockStored", stored, **event)
    removed_cls = struct("BlockRemoved", removed, **event)
    cleared_cls = struct("AllBlocksCleared", [], **event)
    batch_cls = struct("KVEventBatch", [("ts", float), ("events", list[stored_cls | removed_cls | cleared_cls]),
                                        ("data_parallel_rank", int | None, None)], array_like=True)  # fmt: skip
    return msgspec, batch_cls, stored_cls, removed_cls, cleared_cls


def _sample(block_hash: str) -> KVEventBatch:
    h = [external_hash(k, block_hash) for k in ("aa" * 32, "bb" * 32, "seg:cc")]
    return KVEventBatch(ts=1764300000.25, data_parallel_rank=0, events=[
        BlockStored(block_hashes=[h[0]], parent_block_hash=None, token_ids=[1, 2, 3], block_size=3, medium="memory",
                    extra_keys=[("tenant-a",)]),
        BlockStored(block_hashes=[h[1]], parent_block_hash=h[0], token_ids=[4, 5], block_size=2, medium="disk",
                    extra_keys=[None]),
        BlockStored(block_hashes=[h[2]], parent_block_hash=None, token_ids=[6], block_size=1, medium="redis"),
        BlockRemoved(block_hashes=[h[0], h[1]], medium="memory"),
        AllBlocksCleared(),
    ])  # fmt: skip


@pytest.mark.parametrize("block_hash", ["int", "bytes"])
@pytest.mark.parametrize("encoding", ["map", "array"])
def test_vllms_msgspec_structs_encode_the_same_and_decode_ours(encoding, block_hash):
    """``map``: msgspec's encoding of the same content decodes to the same objects with the same key order (the
    bytes differ only in map headers: msgspec writes map16 for a struct declaring 16 fields or more); ``array``:
    the same bytes as vLLM's array_like structs of the fields kvboost fills; both decode with vLLM 0.33.0's
    structs (an array of the earlier fields too: missing trailing fields take their defaults)."""
    msgspec, Batch, Stored, Removed, Cleared = _vllm_structs(encoding == "array", legacy_fields=encoding == "array")
    ours = _sample(block_hash)
    theirs = Batch(ts=ours.ts, data_parallel_rank=0, events=[
        Stored(block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash, token_ids=e.token_ids,
               block_size=e.block_size, lora_id=None, medium=e.medium, lora_name=None, extra_keys=e.extra_keys)
        if isinstance(e, BlockStored) else Removed(block_hashes=e.block_hashes, medium=e.medium)
        if isinstance(e, BlockRemoved) else Cleared()
        for e in ours.events
    ])  # fmt: skip
    payload = encode_batch(ours, encoding)
    if encoding == "array":
        assert payload == msgspec.msgpack.encode(theirs)  # byte for byte
    else:
        plain, reference = (
            msgpack.unpackb(payload, raw=False),
            msgpack.unpackb(msgspec.msgpack.encode(theirs), raw=False),
        )
        assert plain == reference
        assert [list(e) for e in plain[1]] == [list(e) for e in reference[1]]  # key order: "type" first, then vLLM's
    _, Batch, *_ = _vllm_structs(encoding == "array")  # vLLM 0.33.0's full field lists
    decoded = msgspec.msgpack.Decoder(Batch).decode(payload)
    assert decoded.ts == ours.ts and decoded.data_parallel_rank == 0
    assert [type(e).__name__ for e in decoded.events] == ["BlockStored"] * 3 + ["BlockRemoved", "AllBlocksCleared"]
    assert (
        decoded.events[0].extra_keys == [("tenant-a",)]
        and decoded.events[1].parent_block_hash == ours.events[0].block_hashes[0]
    )
    assert decoded.events[2].extra_keys is None and decoded.events[3].medium == "memory"
    # and back through our decoder
    again = decode_batch(payload)
    assert [type(e) for e in again.events] == [type(e) for e in ours.events]
    assert again.events[1].block_hashes == ours.events[1].block_hashes


def test_raw_layout():
    """The shapes, read with plain msgpack: the batch an array [ts, events, rank]; ``map`` events have "type" as
    their first key; ``array`` events are [tag, fields...] with trailing defaults left off."""
    batch = _sample("int")
    as_map = msgpack.unpackb(encode_batch(batch, "map"), raw=False)
    assert isinstance(as_map, list) and as_map[0] == 1764300000.25 and as_map[2] == 0
    assert list(as_map[1][0]) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                                  "medium", "lora_name", "extra_keys"]  # fmt: skip
    assert as_map[1][0]["type"] == "BlockStored" and as_map[1][0]["extra_keys"] == [["tenant-a"]]
    assert "extra_keys" not in as_map[1][2]
    assert as_map[1][3] == {"type": "BlockRemoved", "block_hashes": batch.events[3].block_hashes, "medium": "memory"}
    assert as_map[1][4] == {"type": "AllBlocksCleared"}
    as_array = msgpack.unpackb(encode_batch(batch, "array"), raw=False)
    h = batch.events[0].block_hashes[0]
    assert as_array[1][0] == ["BlockStored", [h], None, [1, 2, 3], 3, None, "memory", None, [["tenant-a"]]]
    assert as_array[1][2] == ["BlockStored", batch.events[2].block_hashes, None, [6], 1, None, "redis", None, None]
    assert as_array[1][3] == ["BlockRemoved", batch.events[3].block_hashes, "memory"]
    assert as_array[1][4] == ["AllBlocksCleared"]
    # block hashes: the key's digest, big-endian, low 64 bits (vLLM's int block hashes)
    assert external_hash("00" * 24 + "0102030405060708") == 0x0102030405060708
    assert external_hash("ab" * 32, "bytes") == bytes.fromhex("ab" * 32)


def test_a_block_ending_one_chunk_and_inside_another_has_one_name():
    """A chunk of exactly one block (a turn's tail) and a longer sibling starting with the same tokens (the next
    turn's chunk): their common block is one block, published once; the longer one's event starts after it, its
    parent that block. (The block ending a chunk was named by the chunk key: the two carried different hashes.)"""
    recorder = Recorder()
    store = KVStore([MemoryTier(capacity=1 << 20)])
    store.attach_events(KVEventSink(recorder, block_size=4))
    k = torch.zeros(2, 1, 8, 8)
    parent = "ab" * 32
    short = KVEntry("01" * 32, "s1", parent, (5, 6, 7, 8), 0, RawKV(k[:, :, :4].clone(), k[:, :, :4].clone()))
    longer = KVEntry("02" * 32, "s2", parent, (5, 6, 7, 8, 9, 10, 11, 12), 0, RawKV(k, k.clone()))
    store.put(short)
    store.put(longer)
    first, second = [e for b in recorder.batches for e in b.events if isinstance(e, BlockStored)]
    assert len(first.block_hashes) == 1 and second.block_hashes != first.block_hashes
    assert len(second.block_hashes) == 1 and second.parent_block_hash == first.block_hashes[0]
    assert second.token_ids == [9, 10, 11, 12]
    n = len(recorder.batches)
    store.remove(short.key)  # the longer one still holds the common block: nothing to remove, no batch
    assert len(recorder.batches) == n
    assert store_index(store) == {"GPU": {first.block_hashes[0], second.block_hashes[0]}}
