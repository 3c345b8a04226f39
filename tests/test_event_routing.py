"""Routing by the replicas' KV events (kvboost/serving/event_routing.py, the ``events`` policy of
kvboost/serving/ray.py) and the ingress's merged /metrics. Everything here runs without Ray except the last test,
which deploys on a local Ray and skips without it.

- the index fed by two engines' events equals each engine's own store after every request (evictions, a disk tier, a
  tenant salt), and its chain walk finds, per replica, exactly the leading chunk keys the engine's store holds;
- the request's token ids and spans computed at the router equal the engine's, and through the server's app (chat
  template, API key -> tenant salt) the walk finds the blocks the replica stored;
- a replica that was *sent* a prefix but evicted it loses to the one that holds it (the guessing router picks the
  former); a prefix in the shared Redis medium counts for every replica, local copies break the tie;
- a RouteBook with the events policy follows real ZMQ publishers (replayed snapshot, live batches);
- a hypothesis state machine over the index (stores, removals, clears, restarts in three media and two tenants)
  checks its invariants after every step;
- /metrics: the KV-event publisher's counters on a server; :func:`merge_metrics` keeps every replica's samples
  under a ``replica`` label.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test
from kvboost_testkit.tiny import make_engine, random_ids

from kvboost.cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    external_hash,
    salt_tag,
    store_index,
)
from kvboost.serving import ray as kray
from kvboost.serving.event_routing import ClusterKVIndex, EventRouter, RequestTokenizer, is_shared, medium_kind
from kvboost.serving.routing import PrefixRouter, rank_replicas, token_chunk_keys

BLOCK_BYTES = 16 * 512  # one 16-token block of the tiny llama (2 layers x K,V x 2 heads x 16 dims x fp32)


class Recorder:
    """A publisher test double: keeps the batches; the test hands them to the index through the wire format."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []
        self.applied = 0
        self.published = 0
        self.dropped = 0

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)
        self.published += 1

    def pending(self) -> int:
        return 0

    def shutdown(self) -> None:
        pass

    def feed(self, index: ClusterKVIndex, replica: str) -> None:
        for batch in self.batches[self.applied :]:
            index.apply(replica, decode_batch(encode_batch(batch)))
        self.applied = len(self.batches)


SALT_KEY = "routing-test-key"  # the deployment's kv_events.salt_key


def published(salt: str) -> str:
    """A tenant salt as the replicas publish it (and the ingress computes it)."""
    return salt_tag(salt, SALT_KEY) if salt else ""


def engine_with_events(memory_blocks: int, disk: str | None = None):
    recorder = Recorder()
    cache = [{"name": "memory", "capacity": memory_blocks * BLOCK_BYTES}]
    if disk is not None:
        cache.append({"name": "disk", "path": disk, "fsync": False})
    engine = make_engine("llama", cache=cache, kv={"pool_bytes": 40 * BLOCK_BYTES}, decode="eager",
                         kv_events={"enabled": True, "publisher": recorder, "salt_key": SALT_KEY})  # fmt: skip
    return engine, recorder


def engine_truth(engine, ids, salt: str = "") -> tuple[list, int]:
    """The engine's own prefix keys of a prompt (as the hashes of their published blocks: one 16-token block per
    16-token chunk here) and how many leading ones its store holds."""
    from types import SimpleNamespace

    spans = engine.chunker.split(ids)
    keys = engine.hasher.chunk_keys(ids, spans, engine.fingerprint, salt)
    hashes = []
    for span, key in zip(spans, keys):
        entry = SimpleNamespace(exact=True, key=key.prefix_key, parent_key=key.parent_key, start=span.start,
                                token_ids=ids[span.start : span.end])  # fmt: skip
        blocks = engine.kv_events.blocks_of(entry)
        hashes.append(blocks[0][-1] if blocks else external_hash(key.prefix_key))
    held = 0
    for key in keys:
        if key.prefix_key not in engine.store:
            break
        held += 1
    return hashes, held


# ------------------------------------------------------------------------------------- index vs the engines
def test_index_from_two_engines_events_equals_their_stores_and_walks_their_keys(tmp_path):
    (a, rec_a), (b, rec_b) = engine_with_events(5), engine_with_events(8, disk=str(tmp_path))
    engines, recorders = {"a": a, "b": b}, {"a": rec_a, "b": rec_b}
    index = ClusterKVIndex()
    tok = RequestTokenizer(a.tokenizer, a.chunker, a.chat)
    try:
        shared = random_ids(48, seed=1)
        prompts = [(shared + random_ids(20, seed=10 + i), "tenant-x" if i == 3 else "") for i in range(6)]
        prompts += [(random_ids(64, seed=50 + i), "") for i in range(5)]  # fillers: the small tier evicts
        asked: list[tuple[list[int], str]] = []
        for i, (ids, salt) in enumerate(prompts):
            name = "ab"[i % 2] if i < 6 else "a"
            engines[name].generate(ids, max_new_tokens=2, cache_salt=salt)
            asked.append((ids, salt))
            for r in "ab":
                recorders[r].feed(index, r)
                assert index.media(r) == store_index(engines[r].store), f"replica {r} after request {i}"
            index.check()
            for q_ids, q_salt in asked:  # every prompt so far, walked on the index vs looked up in the stores
                q_ids_, spans = tok(q_ids)
                assert q_ids_ == q_ids and [(s.start, s.end) for s in spans] == [
                    (s.start, s.end) for s in a.tokenize_with_spans(q_ids)[1]]  # fmt: skip
                chain = index.chain(q_ids, spans, published(q_salt))
                hashes, _ = engine_truth(a, q_ids, q_salt)
                assert chain == hashes[: len(chain)]
                for r in "ab":
                    assert index.match(r, chain)[0] == engine_truth(engines[r], q_ids, q_salt)[1], (i, r)
        assert a.store.stats.evicted > 0, "the small memory tier never evicted"
        assert "DISK" in index.media("b") or b.store.summary()["tiers"][1]["entries"] == 0
        # the tenant's prompt is not found without its salt, nor the open tenant's with it
        salted_ids = prompts[3][0]
        assert index.chain(salted_ids, tok(salted_ids)[1], published("tenant-x"))
        assert index.chain(salted_ids, tok(salted_ids)[1], published("tenant-y")) == []
        # a restart: AllBlocksCleared then the snapshot; the index follows
        b.store.clear()
        recorders["b"].feed(index, "b")
        assert index.media("b") == {} == store_index(b.store)
        index.check()
    finally:
        a.close()
        b.close()


def test_request_tokens_through_the_server_find_what_the_replica_stored():
    """The ingress's view of a chat request (the template, the chunker, the API key's salt) walks onto the blocks
    the server's engine stored for it."""
    from kvboost.engine.loop import EngineLoop
    from kvboost.serving.server import create_app
    from kvboost.serving.tenancy import Tenancy

    engine, recorder = engine_with_events(64)
    loop = EngineLoop(engine).start()
    index = ClusterKVIndex()
    try:
        app = create_app(loop, model_name="tiny", api_keys=["k1", "k2"], server_secret="s3cret")
        messages = [{"role": "system", "content": "you answer briefly. " * 6},
                    {"role": "user", "content": [{"type": "text", "text": "what is a prefix cache? " * 4}]}]
        body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 3, "cache_salt": "c"}).encode()
        headers = [("content-type", "application/json"), ("authorization", "Bearer k1")]

        async def ask():
            return [p async for p in kray.call_asgi(app, "POST", "/v1/chat/completions", headers=headers, body=body)]

        parts = asyncio.run(ask())
        assert parts[0]["status"] == 200
        tenancy = Tenancy(["k1", "k2"], "s3cret")
        tokenize = RequestTokenizer(engine.tokenizer, engine.chunker, engine.chat)
        route = kray.request_route_tokens("/v1/chat/completions", body, "Bearer k1", tokenize, tenancy, SALT_KEY)
        assert route is not None and route["salt"] == published(tenancy.authenticate("Bearer k1").cache_salt("c"))
        unkeyed = kray.request_route_tokens("/v1/chat/completions", body, "Bearer k1", tokenize, tenancy)
        assert unkeyed["salt"] == kray.UNKNOWN_SALT  # without the replicas' key: matches nothing
        deadline = time.monotonic() + 10
        while index.media("r") != store_index(engine.store):
            recorder.feed(index, "r")
            assert time.monotonic() < deadline
            time.sleep(0.01)
        chain = index.chain(route["ids"], route["spans"], route["salt"])
        assert len(chain) == len(route["ids"]) // 16 > 0  # every full chunk of the prompt is held
        assert index.match("r", chain) == (len(chain), len(chain))
        other = kray.request_route_tokens("/v1/chat/completions", body, "Bearer k2", tokenize, tenancy, SALT_KEY)
        assert index.chain(other["ids"], other["spans"], other["salt"]) == []  # another tenant: nothing
        assert kray.request_route_tokens("/v1/chat/completions", body, "Bearer nope", tokenize, tenancy) is None
        assert kray.request_route_tokens("/v1/models", b"", None, tokenize) is None
        # /metrics of that server: the publisher's counters
        metrics = asyncio.run(_get(app, "/metrics", headers))
        samples = _samples(metrics)
        assert samples[("kvboost:kv_events_batches_total", ())] == recorder.published > 0
        assert samples[("kvboost:kv_events_published_total", ())] == recorder.published
        assert samples[("kvboost:kv_events_dropped_total", ())] == 0
        assert samples[("kvboost:kv_events_total", ())] >= recorder.published
    finally:
        loop.shutdown()
        engine.close()


# --------------------------------------------------------------------------------------------- routing
def test_events_route_to_the_replica_that_holds_the_prefix_where_guessing_fails():
    (a, rec_a), (b, rec_b) = engine_with_events(5), engine_with_events(40)
    recorders = {"a": rec_a, "b": rec_b}
    events, guess = EventRouter(max_imbalance=4), PrefixRouter(max_imbalance=4)
    tok = RequestTokenizer(a.tokenizer, a.chunker, a.chat)
    try:
        prompt = random_ids(64, seed=7)
        keys = token_chunk_keys(prompt, 16)
        # the guessing router sends the prompt to a (nothing anywhere: the rotation picks a) ...
        assert guess.choose(keys, ["a", "b"], {}).replica == "a"
        a.generate(prompt, max_new_tokens=2)
        # ... b gets it too without that router knowing (another ingress, or a's queue was full) ...
        b.generate(prompt, max_new_tokens=2)
        # ... and a's small cache evicts it, serving other prompts
        for i in range(4):
            a.generate(random_ids(64, seed=100 + i), max_new_tokens=2)
        for r in "ab":
            recorders[r].feed(events.index, r)
        follow_up = prompt + random_ids(16, seed=8)
        assert engine_truth(a, follow_up)[1] == 0 and engine_truth(b, follow_up)[1] == 4
        ids, spans = tok(follow_up)
        assert guess.choose(token_chunk_keys(follow_up, 16), ["a", "b"], {}).replica == "a"  # the guess: stale
        decision = events.choose(ids, spans, ["a", "b"], {})
        assert decision.replica == "b" and decision.matched == 4 and decision.local == 4
        assert events.scores(ids, spans, ["a", "b"])["a"] == (0, 0)
        # the guard: b overloaded beyond max_imbalance loses its prefix
        over = events.choose(ids, spans, ["a", "b"], {"b": 5})
        assert over.replica == "a" and over.skipped == ("b",)
        # what each engine serves from cache for the follow-up agrees with the scores
        assert b.generate(follow_up, max_new_tokens=1).exact_hit_tokens == 64
        assert a.generate(follow_up, max_new_tokens=1).exact_hit_tokens == 0
    finally:
        a.close()
        b.close()


def _stored(h, parent, tokens, medium, salt=None):
    return BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=list(tokens), block_size=len(tokens),
                       medium=medium, extra_keys=[(salt,) if salt else None])  # fmt: skip


def test_shared_redis_blocks_count_for_every_replica_and_local_copies_win_ties():
    index = ClusterKVIndex()
    router = EventRouter(index=index, max_imbalance=2)
    t = [list(range(i * 4, i * 4 + 4)) for i in range(3)]
    ids, spans = [x for chunk in t for x in chunk], [(0, 4), (4, 8), (8, 12)]
    # r0 wrote chunks 0-1 to redis (write-through) and holds them in memory; r1 holds chunk 0 in memory only
    index.apply("r0", KVEventBatch(0, [_stored(10, None, t[0], "memory"), _stored(11, 10, t[1], "memory"),
                                       _stored(10, None, t[0], "redis"), _stored(11, 10, t[1], "redis")]))
    index.apply("r1", KVEventBatch(0, [_stored(10, None, t[0], "memory")]))
    index.apply("r2", KVEventBatch(0, []))
    assert router.scores(ids, spans, ["r0", "r1", "r2"]) == {"r0": (2, 2), "r1": (2, 1), "r2": (2, 0)}
    assert router.choose(ids, spans, ["r2", "r1", "r0"], {}).replica == "r0"
    assert router.choose(ids, spans, ["r0", "r1", "r2"], {"r0": 3}).replica == "r1"  # r0 too busy: next best
    # r0's memory evicts both, redis keeps them: all equal now, the queue decides
    index.apply("r0", KVEventBatch(0, [BlockRemoved([10, 11], "memory")]))
    assert router.scores(ids, spans, ["r0", "r2"]) == {"r0": (2, 0), "r2": (2, 0)}
    assert router.choose(ids, spans, ["r0", "r2"], {"r0": 1}).replica == "r2"
    # a shared block survives its publisher's restart only if another replica holds it: r0 cleared -> r1's chunk 0
    index.apply("r0", KVEventBatch(0, [AllBlocksCleared()]))
    assert router.scores(ids, spans, ["r0", "r1"]) == {"r0": (0, 0), "r1": (1, 1)}
    index.check()
    assert medium_kind("redis#2") == "redis" and is_shared("redis#2") and not is_shared("disk")
    assert is_shared("EXTERNAL") and not is_shared("DISK") and not is_shared("GPU")  # the media kvboost publishes
    # no tokens (an unreadable body): balance only
    assert router.choose(None, None, ["r0", "r1"], {"r0": 2}).replica == "r1"
    with pytest.raises(ValueError):
        rank_replicas([], {}, {})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_route_book_events_policy_follows_real_zmq_publishers():
    pytest.importorskip("zmq")
    engines = {}
    book = kray.RouteBook("events", max_imbalance=4)
    try:
        for name in ("a", "b"):
            engines[name] = make_engine("llama", decode="eager", kv_events={
                "enabled": True, "endpoint": "tcp://127.0.0.1:*", "replay_endpoint": "tcp://127.0.0.1:*",
                "topic": "kvboost"})  # fmt: skip
        prompt = random_ids(48, seed=3)
        engines["b"].generate(prompt, max_new_tokens=2)  # before anyone follows b: the replay brings it
        for name, engine in engines.items():
            pub = engine.kv_events.publisher
            assert pub.flush()
            assert book.subscribe(name, {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                                         "topic": "kvboost"})  # fmt: skip
        assert not book.subscribe("c", None)
        tok = RequestTokenizer(engines["a"].tokenizer, engines["a"].chunker, engines["a"].chat)
        ids, spans = tok(prompt + random_ids(5, seed=4))
        route = {"ids": ids, "spans": [(s.start, s.end) for s in spans], "salt": ""}
        assert book.events.index.media("b") == store_index(engines["b"].store)
        assert book.rank(route, ["a", "b"])[0] == "b"
        engines["a"].generate(prompt + random_ids(40, seed=5), max_new_tokens=2)  # a now holds a longer chain
        engines["a"].kv_events.publisher.flush()
        longer = tok(prompt + random_ids(40, seed=5))
        route2 = {"ids": longer[0], "spans": [(s.start, s.end) for s in longer[1]], "salt": ""}
        deadline = time.monotonic() + 10
        while book.rank(route2, ["a", "b"])[0] != "a":  # drains live batches on each call
            assert time.monotonic() < deadline, "the live batches never arrived"
            time.sleep(0.02)
        assert book.events.index.media("a") == store_index(engines["a"].store)
        book.forget("b")
        assert "b" not in book.subscribers and book.events.index.media("b") == {}
    finally:
        book.close()
        for engine in engines.values():
            engine.close()


def test_events_replicas_publish_on_ephemeral_ports_with_replay():
    from kvboost.serving.cli import build_parser, compose_config

    argv = kray.replica_argv(["model=tiny_random"], redis_url="redis://h:1/0", events=True)
    events = compose_config(build_parser().parse_args(argv))["engine"]["kv_events"]
    assert events["enabled"] and events["endpoint"] == events["replay_endpoint"] == "tcp://*:*"
    assert [t["name"] for t in compose_config(build_parser().parse_args(argv))["cache"]] == ["memory", "redis"]
    own = ["model=tiny_random", "engine.kv_events.enabled=true", "engine.kv_events.endpoint=tcp://*:7000"]
    assert kray.replica_argv(own, redis_url=None, events=True) == own  # the user's own settings are kept
    assert kray.reachable("tcp://0.0.0.0:5557", "10.0.0.2") == "tcp://10.0.0.2:5557"
    assert kray.reachable("tcp://127.0.0.1:5557", "10.0.0.2") == "tcp://127.0.0.1:5557"
    assert "events" in kray.ROUTERS


# ------------------------------------------------------------------------------------- state machine
ROOTS = ("", "t1")  # two tenants
# a fixed tree of chunks per tenant: (name, parent name or None, tokens)
TREE = [("c0", None, (1, 2)), ("c1", "c0", (3, 4)), ("c2", "c1", (5, 6)), ("c3", "c0", (7, 8)),
        ("c4", None, (9, 9)), ("c5", "c4", (3, 4))]  # fmt: skip
NODES = [(salt, name) for salt in ROOTS for name, _, _ in TREE]
MEDIA = ("GPU", "DISK", "EXTERNAL")  # as kvboost publishes memory, disk and Redis tiers
REPLICAS = ("r0", "r1", "r2")


def _h(salt: str, name: str) -> int:
    return external_hash(hashlib.sha256(f"{salt}/{name}".encode()).hexdigest())


def _path(name: str) -> list[str]:
    parents = {n: p for n, p, _ in TREE}
    out = [name]
    while parents[out[-1]] is not None:
        out.append(parents[out[-1]])
    return out[::-1]


class IndexMachine(RuleBasedStateMachine):
    """A reference model (per replica and medium, the set of (tenant, chunk) held) beside the index fed with the
    events a store would publish for the same moves."""

    def __init__(self) -> None:
        super().__init__()
        self.index = ClusterKVIndex()
        self.model: dict[str, dict[str, set]] = {r: {} for r in REPLICAS}

    def _event(self, replica: str, event) -> None:
        batch = KVEventBatch(ts=0.0, events=[event])
        self.index.apply(replica, decode_batch(encode_batch(batch, ("map", "array")[len(self.model[replica]) % 2])))

    @rule(replica=st.sampled_from(REPLICAS), node=st.sampled_from(NODES), medium=st.sampled_from(MEDIA))
    def store(self, replica, node, medium):
        salt, name = node
        parent_name, tokens = {n: (p, t) for n, p, t in TREE}[name]
        parent = None if parent_name is None else _h(salt, parent_name)
        self._event(replica, _stored(_h(salt, name), parent, tokens, medium, salt=salt or None))
        self.model[replica].setdefault(medium, set()).add(node)

    @rule(replica=st.sampled_from(REPLICAS), node=st.sampled_from(NODES), medium=st.sampled_from(MEDIA))
    def remove(self, replica, node, medium):
        self._event(replica, BlockRemoved(block_hashes=[_h(*node)], medium=medium))
        self.model[replica].get(medium, set()).discard(node)

    @rule(replica=st.sampled_from(REPLICAS))
    def clear(self, replica):  # a store cleared, or a restarted publisher's opening event
        self._event(replica, AllBlocksCleared())
        self.model[replica] = {}

    @precondition(lambda self: any(self.model.values()))
    @rule(replica=st.sampled_from(REPLICAS))
    def forget(self, replica):  # the replica died
        self.index.forget(replica)
        self.model[replica] = {}

    @invariant()
    def index_equals_the_model(self):
        self.index.check()
        for r in REPLICAS:
            want = {m: {_h(*n) for n in nodes} for m, nodes in self.model[r].items() if nodes}
            assert self.index.media(r) == want
        anywhere = {n for r in REPLICAS for nodes in self.model[r].values() for n in nodes}
        shared = {n for r in REPLICAS for m, nodes in self.model[r].items() if m == "EXTERNAL" for n in nodes}
        for salt in ROOTS:
            for name, _, _ in TREE:
                path = _path(name)
                tokens = [t for n in path for t in {x: tk for x, _, tk in TREE}[n]]
                spans = [(2 * i, 2 * i + 2) for i in range(len(path))]
                chain = self.index.chain(tokens, spans, salt)
                known = 0
                while known < len(path) and (salt, path[known]) in anywhere:
                    known += 1
                assert chain == [_h(salt, n) for n in path[:known]]
                for r in REPLICAS:
                    local = {n for m, nodes in self.model[r].items() if m != "EXTERNAL" for n in nodes}
                    matched = n_local = 0
                    for n in path[:known]:
                        if (salt, n) not in local | shared:
                            break
                        matched += 1
                        n_local += (salt, n) in local
                    assert self.index.match(r, chain) == (matched, n_local)


def test_index_state_machine():
    run_state_machine_as_test(IndexMachine, settings=settings(
        max_examples=120, stateful_step_count=40, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck),
    ))  # fmt: skip


# ------------------------------------------------------------------------------------------- /metrics
async def _get(app, path, headers=()):
    parts = [p async for p in kray.call_asgi(app, "GET", path, headers=list(headers))]
    assert parts[0]["status"] == 200
    return b"".join(parts[1:]).decode()


def _samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


def test_merge_metrics_labels_every_replica_and_keeps_every_sample():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    texts = {}
    for i, name in enumerate(("r-a", "r-b")):
        reg = CollectorRegistry()
        c = Counter("vllm:prompt_tokens", "Prompt tokens.", ["model_name"], registry=reg)
        g = Gauge("vllm:num_requests_running", "Running.", ["model_name"], registry=reg)
        h = Histogram("vllm:e2e_request_latency_seconds", "E2E.", ["model_name"], buckets=(0.1, 1.0), registry=reg)
        c.labels("m").inc(10 * (i + 1))
        g.labels("m").set(i + 2)
        h.labels("m").observe(0.5 * (i + 1))
        texts[name] = generate_latest(reg).decode()
    texts["broken"] = "this is { not prometheus"
    merged = kray.merge_metrics(texts)
    samples = _samples(merged)
    assert samples[("vllm:prompt_tokens_total", (("replica", "r-a"),))] == 10
    assert samples[("vllm:prompt_tokens_total", (("replica", "r-b"),))] == 20
    assert samples[("vllm:num_requests_running", (("replica", "r-b"),))] == 3
    assert samples[("vllm:e2e_request_latency_seconds_count", (("replica", "r-a"),))] == 1
    assert samples[("vllm:e2e_request_latency_seconds_bucket", (("le", "0.1"), ("replica", "r-b")))] == 0
    for name in ("r-a", "r-b"):  # every sample of every replica is there, with its own value
        own = _samples(texts[name])
        assert all(samples[(k, tuple(sorted(labels + (("replica", name),))))] == v for (k, labels), v in own.items())
    assert merged.count("# TYPE vllm:prompt_tokens_total counter") == 1  # one family, not one per replica
    assert "broken" not in merged
    assert kray.merge_metrics({}) == ""


def test_merged_metrics_of_two_real_servers():
    from kvboost.engine.loop import EngineLoop
    from kvboost.serving.server import create_app

    apps, loops, engines = {}, [], []
    try:
        for name in ("x", "y"):
            engine, _ = engine_with_events(16)
            loop = EngineLoop(engine).start()
            engines.append(engine)
            loops.append(loop)
            apps[name] = create_app(loop, model_name="tiny", server_secret="s")
        body = json.dumps({"model": "tiny", "prompt": "hello world, a prompt " * 4, "max_tokens": 2}).encode()

        async def ask(app):
            return [p async for p in kray.call_asgi(app, "POST", "/v1/completions", body=body,
                                                    headers=[("content-type", "application/json")])]  # fmt: skip

        asyncio.run(ask(apps["x"]))
        texts = {name: asyncio.run(_get(app, "/metrics")) for name, app in apps.items()}
        samples = _samples(kray.merge_metrics(texts))
        x = samples[("vllm:prompt_tokens_total", (("replica", "x"),))]
        assert x > 0 and samples.get(("vllm:prompt_tokens_total", (("replica", "y"),)), 0) == 0  # no request: no child
        assert samples[("kvboost:kv_events_batches_total", (("replica", "x"),))] > 0
    finally:
        for loop in loops:
            loop.shutdown()
        for engine in engines:
            engine.close()


# ============================================================================== a real (local) Ray Serve
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_events_router_on_ray_serve_follows_the_replicas_caches():
    """A local Ray, two tiny-model replicas, the events router: a 3-turn chat lands on one replica and reuses the
    previous turn; the ingress's /metrics holds both replicas' series, the KV-event counters among them."""
    ray = pytest.importorskip("ray")
    import httpx
    import openai
    from ray import serve

    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        argv = ["model=tiny_random", "threads=1", "warmup=false", "engine.decode=eager"]
        serve.run(kray.build_app(argv, replicas=2, router="events", num_cpus=1), name="kvboost", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "tell me about the history of the printing press " * 4}]
        cached = []
        for turn in range(3):
            reply = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0)
            cached.append(reply.usage.prompt_tokens_details.cached_tokens)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or "ok"},
                         {"role": "user", "content": f"and {turn}?"}]  # fmt: skip
            time.sleep(0.3)  # the turn's events reach the router
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
        served = httpx.get(f"{base}/kvboost/routing", timeout=30).json()
        assert served["router"] == "events" and max(served["served"].values()) >= 3, served
        text = httpx.get(f"{base}/metrics", timeout=60).text
        samples = _samples(text)
        replicas = {dict(k[1]).get("replica") for k in samples if k[0] == "vllm:num_requests_running"}
        assert len(replicas) == 2, text[:2000]
        assert sum(v for k, v in samples.items() if k[0] == "kvboost:kv_events_batches_total") > 0
    finally:
        serve.shutdown()
        ray.shutdown()


def test_request_tokens_walk_the_published_blocks_when_they_are_not_the_chunks():
    """Replicas publishing 8-token blocks of 16-token chunks (``kv_events.block_size``): the ingress splits the
    request into the same blocks (:func:`kvboost.serving.ray.published_block_size`) and the walk finds every block
    of the prompt the replica holds. (The ingress's spans were tuples here, which request_route_tokens could not
    read: every request went unmatched.)"""
    recorder = Recorder()
    engine = make_engine("llama", kv={"pool_bytes": 40 * BLOCK_BYTES}, decode="eager",
                         kv_events={"enabled": True, "publisher": recorder, "block_size": 8, "salt_key": SALT_KEY})
    index = ClusterKVIndex()
    try:
        ids = random_ids(40, seed=5)
        engine.generate(ids, max_new_tokens=1)
        recorder.feed(index, "r")
        size = kray.published_block_size({"kv_events": {"block_size": 8}})
        assert size == 8 and kray.published_block_size({"kv": {"block_size": 32}}) == 32
        assert kray.published_block_size({"kv_events": {"block_size": "chunk"}}) is None
        tokenize = RequestTokenizer(engine.tokenizer, engine.chunker, engine.chat, block_size=size)
        body = json.dumps({"model": "tiny", "prompt": ids, "max_tokens": 1}).encode()
        route = kray.request_route_tokens("/v1/completions", body, None, tokenize)
        assert route is not None and route["spans"][:2] == [(0, 8), (8, 16)]
        chain = index.chain(route["ids"], route["spans"], route["salt"])
        assert len(chain) == 40 // 8 and index.match("r", chain) == (5, 5)  # 2 chunks of 16 + the tail's 8
    finally:
        engine.close()


def test_chunks_that_share_leading_blocks_publish_them_once():
    """Two prompts whose first 16-token chunks differ only after 8 tokens (a chat template's common header, in
    practice), published in 8-token blocks: the shared block has one hash, so the walk of either prompt follows its
    own chain past it, and removing one prompt's chunk keeps the block the other still holds. (Blocks were named by
    their chunk's key: the shared block had two hashes, the walk found only the last one registered, and the events
    router of a 1 MiB-tier deployment scored 0.188 of the prompt tokens cached against the guessing router's 0.475.)"""
    recorder = Recorder()
    engine = make_engine("llama", kv={"pool_bytes": 40 * BLOCK_BYTES}, decode="eager",
                         kv_events={"enabled": True, "publisher": recorder, "block_size": 8})  # fmt: skip
    index = ClusterKVIndex()
    try:
        header = random_ids(8, seed=11)
        prompts = [header + random_ids(40, seed=12), header + random_ids(40, seed=13)]
        for ids in prompts:
            engine.generate(ids, max_new_tokens=1)
        recorder.feed(index, "r")
        spans = [(i, i + 8) for i in range(0, 48, 8)]
        chains = [index.chain(ids, spans) for ids in prompts]
        assert [len(c) for c in chains] == [6, 6] and chains[0][0] == chains[1][0] and chains[0][1] != chains[1][1]
        stored = [e for b in recorder.batches for e in b.events if isinstance(e, BlockStored)]
        assert sum(chains[0][0] in e.block_hashes for e in stored) == 1  # published once
        first = engine.hasher.chunk_keys(prompts[0], engine.chunker.split(prompts[0]), engine.fingerprint)[0]
        assert engine.store.remove(first.prefix_key) is not None  # (remove does not cascade)
        recorder.feed(index, "r")
        assert index.media("r") == store_index(engine.store)
        assert index.chain(prompts[1], spans) == chains[1]  # the shared block is still held (by the other chunk)
        index.check()
    finally:
        engine.close()
