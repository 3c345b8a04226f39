"""KV events read by consumers that follow llm-d's and NVIDIA Dynamo's rules (re-implemented here from their
sources, cited; no code of theirs), checked against the engine's own store:

- llm-d's KV-cache indexer (``llm-d/llm-d-kv-cache``): the topic ``kv@<pod>@<model>`` gives the pod and the model
  (``pkg/kvevents/engineadapter/vllm_adapter.go``, ``parseVLLMTopic``; events decoded positionally, msgpack
  ``array``); the medium, lower-cased, is the device tier, ``gpu`` when empty (``pkg/kvevents/pool.go``,
  ``normalizeEventDeviceTier``); a ``BlockStored`` whose parent engine key it does not know is skipped, its tokens are
  re-chunked into request keys of the indexer's own block size chained from the parent's request key, a partial tail
  dropped (``processEventBatch``, ``TokensToKVBlockKeys``); ``BlockRemoved`` evicts by engine key; ``AllBlocksCleared``
  is only logged. A request is scored by its longest prefix of request keys a pod holds (``kvblock_scorer.go``).
- Dynamo's KV router: the medium maps to a storage tier by ``StorageTier::from_kv_medium``, any other name counted
  as the GPU (``lib/kv-router/src/protocols.rs``); an event whose ``block_size`` is not the router's block size (or
  whose tokens are not whole blocks) is not indexed; ``AllBlocksCleared`` clears the worker.

The engine publishes with ``kv_events.block_size`` = the consumer's block size (8 here, kvboost's chunks 16 tokens),
and for every prompt asked so far the consumer's longest prefix equals what the engine's store holds (whole blocks of
the leading chunks its lookup would find), through evictions, demotion to disk and a clear. Before this change
kvboost published ``memory``/``disk`` (Dynamo: GPU), one 16-token block per chunk (Dynamo: dropped; llm-d: fine only
when the chunk is a multiple of its block size) and short last chunks as blocks that break llm-d's chains.
"""

from __future__ import annotations

import hashlib

import msgpack
import pytest
from kvboost_testkit.tiny import make_engine, random_ids

from kvboost.cache.events import encode_batch, store_index

BLOCK_BYTES = 16 * 512  # one 16-token block of the tiny llama


class Capture:
    """A publisher that keeps the wire bytes, as a SUB socket would receive them, with the engine's topic."""

    def __init__(self, topic: str) -> None:
        self.topic, self.messages, self.dropped = topic, [], 0

    def publish(self, batch) -> None:
        self.messages.append((self.topic, encode_batch(batch, "array")))  # llm-d's adapter reads the array layout

    def shutdown(self) -> None:
        pass


class LlmdIndex:
    """llm-d's handling of vLLM events (see the module docstring)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.engine_to_requests: dict[int, list[str]] = {}  # engine key -> the request keys it covers
        self.holders: dict[str, set[tuple[str, str]]] = {}  # request key -> {(pod, device tier)}
        self.skipped = 0

    def request_keys(self, parent: str, tokens: list[int], model: str) -> list[str]:
        keys = []
        for i in range(0, len(tokens) - self.block_size + 1, self.block_size):  # a partial tail is dropped
            parent = hashlib.sha256(f"{parent}|{model}|{tokens[i : i + self.block_size]}".encode()).hexdigest()
            keys.append(parent)
        return keys

    def handle(self, topic: str, payload: bytes) -> None:
        parts = topic.split("@")
        pod, model = (parts[1], parts[2]) if len(parts) == 3 else (topic, "")
        _ts, events, *_ = msgpack.unpackb(payload, raw=False)
        for event in events:
            tag = event[0]
            if tag == "BlockStored":
                hashes, parent, tokens, _size, _lora, medium = event[1:7]
                tier = (medium or "gpu").lower()
                parent_key = ""
                if parent:  # a parent it does not know: the event is skipped
                    known = self.engine_to_requests.get(parent)
                    if not known:
                        self.skipped += 1
                        continue
                    parent_key = known[-1]
                keys = self.request_keys(parent_key, list(tokens), model)
                if not keys:
                    continue
                per = max(1, len(keys) // len(hashes))  # 1:1 or 1:many (engine block >= indexer block)
                for i, h in enumerate(hashes):
                    self.engine_to_requests[h] = keys[i * per : (i + 1) * per] or keys[-1:]
                for key in keys:
                    self.holders.setdefault(key, set()).add((pod, tier))
            elif tag == "BlockRemoved":
                hashes, medium = event[1], event[2]
                tier = (medium or "gpu").lower()
                for h in hashes:
                    for key in self.engine_to_requests.get(h, []):
                        self.holders.get(key, set()).discard((pod, tier))
            # AllBlocksCleared: logged only

    def longest_prefix(self, tokens: list[int], model: str, pod: str) -> int:
        held = 0
        for key in self.request_keys("", tokens, model):
            if not any(p == pod for p, _ in self.holders.get(key, ())):
                break
            held += 1
        return held

    def tiers(self, pod: str) -> set[str]:
        return {t for holders in self.holders.values() for p, t in holders if p == pod}


#: Dynamo's StorageTier::from_kv_medium (lib/kv-router/src/protocols.rs); other names: the GPU (device) tier
DYNAMO_TIERS = {"GPU": "device", "DEVICE": "device", "CPU": "host", "CPU_PINNED": "host", "CPU_TIER1": "host",
                "CPU_TIER2": "disk", "DISK": "disk", "NVME": "disk", "EXTERNAL": "external", "NETWORK": "external",
                "REMOTE": "external", "SHARED": "external"}  # fmt: skip


class DynamoIndex:
    """Dynamo's handling: (tier, block hash) held per worker, blocks of the router's size only."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.held: dict[str, set[int]] = {}
        self.dropped = 0

    def handle(self, payload: bytes) -> None:
        _ts, events, *_ = msgpack.unpackb(payload, raw=False)
        for event in events:
            if event[0] == "BlockStored":
                hashes, _parent, tokens, size, _lora, medium = event[1:7]
                if size != self.block_size or len(tokens) != size * len(hashes):
                    self.dropped += 1
                    continue
                self.held.setdefault(DYNAMO_TIERS.get(medium or "GPU", "device"), set()).update(hashes)
            elif event[0] == "BlockRemoved":
                self.held.get(DYNAMO_TIERS.get(event[2] or "GPU", "device"), set()).difference_update(event[1])
            else:
                self.held.clear()


def engine_prefix_blocks(engine, ids: list[int], block: int) -> int:
    """Whole ``block``-token blocks of the prompt tokens the engine's lookup would reuse from its store: the
    leading chunks held under the prompt's own keys, then the frontier (a stored child of the last one whose tokens
    start as the prompt's next ones: a previous prompt's tail chunk with its generated tokens, matched token by
    token, kvboost.lookup)."""
    spans = engine.chunker.split(ids)
    keys = engine.hasher.chunk_keys(ids, spans, engine.fingerprint, "")
    matched, parent = 0, engine.hasher.root_key(engine.fingerprint, "")
    for span, key in zip(spans, keys):
        if key.prefix_key not in engine.store:
            break
        matched, parent = span.end, key.prefix_key
    frontier = 0
    if matched < len(ids):
        for child in engine.store.children_with_first_token(parent, ids[matched]):
            stored = engine.store.peek(child).token_ids
            common = 0
            while common < min(len(stored), len(ids) - matched) and stored[common] == ids[matched + common]:
                common += 1
            frontier = max(frontier, common)
    return (matched + frontier) // block


@pytest.mark.parametrize("router_block", [8, 16])
def test_llmd_and_dynamo_consumers_see_what_the_engine_holds(tmp_path, router_block):
    capture = Capture("kv@pod-a@tiny-model")
    engine = make_engine("llama", cache=[{"name": "memory", "capacity": 6 * BLOCK_BYTES},
                                         {"name": "disk", "path": str(tmp_path), "fsync": False}],
                         kv={"pool_bytes": 40 * BLOCK_BYTES}, decode="eager",
                         kv_events={"enabled": True, "publisher": capture, "block_size": router_block})  # fmt: skip
    llmd, dynamo, seen = LlmdIndex(router_block), DynamoIndex(router_block), 0
    try:
        shared = random_ids(32, seed=7)
        prompts = [shared + random_ids(20, seed=i) for i in range(4)] + [random_ids(44, seed=30 + i) for i in range(4)]
        for i, ids in enumerate(prompts):
            engine.generate(ids, max_new_tokens=2)
            for topic, payload in capture.messages[seen:]:
                llmd.handle(topic, payload)
                dynamo.handle(payload)
            seen = len(capture.messages)
            for asked in prompts[: i + 1]:
                expected = engine_prefix_blocks(engine, asked, router_block)
                assert llmd.longest_prefix(asked, "tiny-model", "pod-a") == expected, (i, asked[:4])
            truth = store_index(engine.store)  # medium -> published block hashes
            assert {DYNAMO_TIERS[m]: hs for m, hs in truth.items()} == {t: hs for t, hs in dynamo.held.items() if hs}
        assert dynamo.dropped == 0 and llmd.skipped == 0
        assert "disk" in llmd.tiers("pod-a") and "gpu" in llmd.tiers("pod-a")  # media llm-d can weight
        assert set(dynamo.held) >= {"device", "disk"}
        engine.store.clear()  # llm-d ignores AllBlocksCleared: the removals before it empty its index
        for topic, payload in capture.messages[seen:]:
            llmd.handle(topic, payload)
            dynamo.handle(payload)
        assert all(llmd.longest_prefix(ids, "tiny-model", "pod-a") == 0 for ids in prompts)
        assert not any(dynamo.held.values())
    finally:
        engine.close()


def test_chunk_blocks_are_what_dynamo_drops():
    """One block per 16-token chunk (``block_size: chunk``, what kvboost published before) is dropped by a consumer
    configured for 8-token blocks; with ``block_size: 8`` every block is indexed."""
    for block_size, dropped in (("chunk", True), (8, False)):
        capture = Capture("kv@p@m")
        engine = make_engine("llama", decode="eager",
                             kv_events={"enabled": True, "publisher": capture, "block_size": block_size})  # fmt: skip
        dynamo = DynamoIndex(8)
        try:
            engine.generate(random_ids(48, seed=2), max_new_tokens=1)  # 3 chunks of 16
            for _topic, payload in capture.messages:
                dynamo.handle(payload)
            assert (dynamo.dropped > 0) == dropped and bool(dynamo.held.get("device")) != dropped
        finally:
            engine.close()


def test_content_only_entries_are_never_published():
    """Repaired KV (a content-only entry: no prompt's prefix) was published as a block without parent, which a
    consumer reads as a prompt's first block (a false prefix hit): it is stored, and not published."""
    import torch

    from kvboost.cache import KVEntry, KVStore, MemoryTier, segment_only_key
    from kvboost.cache.events import KVEventSink
    from kvboost.quant.none import RawKV

    capture = Capture("kv@p@m")
    store = KVStore([MemoryTier(capacity=1 << 20)])
    store.attach_events(KVEventSink(capture, block_size=4))
    k = torch.zeros(2, 1, 8, 8)
    tokens = tuple(range(8))
    store.put(KVEntry(segment_only_key("s1"), "s1", None, tokens, 0, RawKV(k, k.clone()), exact=False))
    store.put(KVEntry("ab" * 32, "s2", "cd" * 32, tokens, 0, RawKV(k, k.clone())))
    stored = [e for _t, p in capture.messages for e in msgpack.unpackb(p, raw=False)[1] if e[0] == "BlockStored"]
    assert segment_only_key("s1") in store and len(stored) == 1 and stored[0][3] == list(tokens)
    store.remove(segment_only_key("s1"))  # its removal is not published either
    assert all(e[0] != "BlockRemoved" for _t, p in capture.messages for e in msgpack.unpackb(p, raw=False)[1])


def test_server_flags_set_the_block_size_host_and_llmd_topic(monkeypatch):
    """``kvboost-server``'s event options: the topic llm-d splits into pod and model (kv@<pod>@<model>; the pod from
    --kv-events-pod, $POD_NAME or the host name), the block size and the bound interface as overrides."""
    from kvboost.serving.cli import UsageError, build_parser, compose_config, served_names, with_events_topic

    args = build_parser().parse_args(["model=tiny_random", "engine.kv_events.enabled=true", "--kv-events-block-size",
                                      "32", "--kv-events-host", "10.1.2.3", "--kv-events-pod", "replica-7"])  # fmt: skip
    cfg = compose_config(args)
    events = cfg["engine"]["kv_events"]
    assert (events["block_size"], events["host"], events["topic"]) == (32, "10.1.2.3", "")
    topic = with_events_topic(cfg, args.kv_events_pod, served_names(args, cfg)[0])["engine"]["kv_events"]["topic"]
    assert topic == "kv@replica-7@tiny-random" and topic.split("@")[1:] == ["replica-7", "tiny-random"]
    monkeypatch.setenv("POD_NAME", "pod-from-env")
    assert with_events_topic(cfg, None, "org/model")["engine"]["kv_events"]["topic"] == "kv@pod-from-env@org/model"
    explicit = compose_config(build_parser().parse_args(["model=tiny_random", "engine.kv_events.enabled=true",
                                                         "engine.kv_events.topic=mine"]))  # fmt: skip
    assert with_events_topic(explicit, "p", "m")["engine"]["kv_events"]["topic"] == "mine"  # an explicit topic wins
    off = compose_config(build_parser().parse_args(["model=tiny_random"]))
    assert not off["engine"]["kv_events"]["topic"] and with_events_topic(off, "p", "m") is off
    with pytest.raises(UsageError, match="split"):
        with_events_topic(cfg, "a@b", "m")
    assert build_parser().parse_args(["--kv-events-block-size", "chunk"]).kv_events_block_size == "chunk"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--kv-events-block-size", "0"])
