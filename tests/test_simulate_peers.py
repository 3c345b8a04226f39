"""experiments/sims/simulate_peers.py: each peer's policy on hand-made traces, the output files, bad arguments, and the
kvboost simulator against the real engine request by request."""

from __future__ import annotations

import json
import random

import pytest

from experiments.sims.simulate_peers import (
    SYSTEMS,
    KVBoostStore,
    LlamaCppSlot,
    LMCacheChunks,
    SGLangRadixCache,
    VLLMPrefixCache,
    build_simulator,
    main,
    replay,
    simulate_trace,
    summarize,
)
from experiments.sims.token_trace import TraceRequest
from kvboost.cache.block_run import BlockRun
from kvboost.cache.pool_tier import PoolTier
from kvboost.cache.store import KVStore
from kvboost.engine import InferenceEngine


def ids(n: int, seed: int) -> list[int]:
    """``n`` distinct-looking token ids; different seeds share no prefix (first ids differ by range)."""
    rng = random.Random(seed)
    return [seed * 100_000 + rng.randrange(100_000) for _ in range(n)]


SHARED = ids(40, 1)
A = SHARED + ids(10, 2)
B = SHARED + ids(10, 3)


# ------------------------------------------------------------------------------------------------ each peer
@pytest.mark.parametrize(
    ("name", "expected"),
    [("vllm", 32), ("sglang", 40), ("lmcache", 0), ("llamacpp", 40), ("kvboost", 40)],
)
def test_shared_40_token_prefix(name, expected):
    # vLLM rounds down to full 16-token blocks, LMCache to 256-token chunks; radix / slot / kvboost are token-level
    sim = build_simulator(name, 100_000)
    assert sim.serve(A) == 0
    assert sim.serve(B) == expected


@pytest.mark.parametrize(("name", "expected"), [("vllm", 16), ("sglang", 31), ("llamacpp", 31), ("kvboost", 31)])
def test_an_identical_prompt_still_computes_its_last_token(name, expected):
    prompt = ids(32, 4)
    sim = build_simulator(name, 100_000)
    sim.serve(prompt)
    assert sim.serve(prompt) == expected  # vLLM: len - 1 = 31 tokens, rounded down to one 16-token block


def test_lmcache_chunks_and_unfull_chunk():
    shared = ids(600, 5)
    lm = LMCacheChunks(100_000)
    assert lm.save_unfull_chunk is False  # LMCache's documented default
    lm.serve(shared + ids(10, 6))
    assert lm.serve(shared + ids(50, 7)) == 512  # two full 256-token chunks
    prompt = ids(300, 8)
    for save_unfull, expected in ((False, 256), (True, 299)):
        lm = LMCacheChunks(100_000, save_unfull_chunk=save_unfull)
        lm.serve(prompt)
        assert lm.serve(prompt) == expected


def test_vllm_evicts_the_tail_of_a_chain_first():
    vllm = VLLMPrefixCache(48)  # three 16-token blocks
    a = ids(48, 9)
    vllm.serve(a)  # three full cached blocks, freed last block first
    vllm.serve(ids(16, 10))  # one new block: takes a's last block
    assert vllm.serve(a + ids(16, 11)) == 32  # a's first two blocks survived


def test_lmcache_plain_lru_strands_a_chain():
    lm = LMCacheChunks(48, chunk_size=16)  # room for three chunks
    a = ids(48, 9)
    lm.serve(a)
    lm.serve(ids(16, 10))  # evicts the least recently used chunk: a's first
    assert lm.serve(a + ids(16, 11)) == 0  # the lookup stops at the missing first chunk


def test_kvboost_evicts_leaves_first():
    kv = KVBoostStore(40, chunk_size=16)  # two 16-token blocks
    assert kv.model.capacity_blocks == 2
    a = ids(32, 9)
    kv.serve(a)
    kv.serve(ids(16, 10))  # a third block: storing it evicts a's leaf chunk, keeps its root
    assert kv.used_blocks == 2
    assert kv.serve(a + ids(16, 11)) == 16


def test_kvboost_capacity_is_whole_blocks():
    kv = KVBoostStore(64, chunk_size=64)  # four blocks
    a = ids(40, 30)  # one chunk of 40 tokens: three blocks, the last partial
    kv.serve(a)
    assert kv.used_blocks == 3 and len(kv.store) == 1
    kv.serve(ids(20, 31))  # two more blocks: five idle > four, the LRU entry (a) goes whole
    assert kv.used_blocks == 2 and kv.serve(a) == 0
    # a longer prompt sharing a's partial block: the frontier hit copies it on write, the old run is dropped
    kv = KVBoostStore(10_000)
    kv.serve(a)
    assert kv.serve(a + ids(30, 32)) == 40
    # [0, 64) and [64, 70) in 5 blocks (a's partial third block replaced by its copy); the shorter sibling [0, 40)
    # went with its blocks
    assert kv.used_blocks == 5 and len(kv.store) == 2 and kv.model.cached_tokens() == 70


def test_sglang_lru_leaf_eviction():
    sg = SGLangRadixCache(100)
    a, b, c = ids(40, 12), ids(40, 13), ids(40, 14)
    assert sg.serve(a) == 0 and sg.serve(b) == 0
    assert sg.serve(a) == 39  # a is now more recent than b
    sg.serve(c)  # needs 40, 20 free: evicts the least recently used leaf, b
    assert sg.size <= 100
    assert sg.serve(a) == 39
    assert sg.serve(b) == 0


def test_sglang_never_exceeds_capacity_and_splits_nodes():
    sg = SGLangRadixCache(64)
    rng = random.Random(0)
    base = ids(30, 15)
    for i in range(40):
        prompt = base[: rng.randrange(1, 30)] + ids(rng.randrange(1, 40), 100 + i)
        sg.serve(prompt)
        assert sg.size <= 64
        assert sg.size == sum(len(n.key) for n in _nodes(sg.root)) - len(sg.root.key)


def _nodes(node):
    yield node
    for child in node.children.values():
        yield from _nodes(child)


@pytest.mark.parametrize(
    ("capacity_tokens", "expected"),
    [
        # 400 tokens hold one 300-token prompt: vLLM frees a chain tail first and kvboost evicts leaves first, so
        # both keep a's leading blocks / chunk; SGLang drops a's whole leaf; LMCache's LRU drops a's only chunk
        (400, {"vllm": 96, "sglang": 0, "lmcache": 0, "llamacpp": 0, "kvboost": 64}),
        (4096, {"vllm": 288, "sglang": 300, "lmcache": 256, "llamacpp": 0, "kvboost": 300}),
    ],
)
def test_eviction_at_small_capacity(capacity_tokens, expected):
    a, b = ids(300, 16), ids(300, 17)
    got = {}
    for name in SYSTEMS:
        sim = build_simulator(name, capacity_tokens)
        sim.serve(a)
        sim.serve(b)
        got[name] = sim.serve(a + ids(20, 18))
    assert got == expected


def test_llamacpp_loses_reuse_when_users_interleave():
    a1, b1 = ids(30, 19), ids(30, 20)
    a2, b2 = a1 + ids(20, 21), b1 + ids(20, 22)
    assert replay(LlamaCppSlot(10_000), [a1, a2, b1, b2]) == [0, 30, 0, 30]
    assert replay(LlamaCppSlot(10_000), [a1, b1, a2, b2]) == [0, 0, 0, 0]
    sg = SGLangRadixCache(10_000)  # a radix cache keeps both conversations
    assert replay(sg, [a1, b1, a2, b2]) == [0, 0, 30, 30]


def test_kvboost_frontier_reuses_a_partial_chunk():
    a = ids(100, 23)  # chunks [0, 64) and a partial [64, 100)
    kv = KVBoostStore(10_000)
    kv.serve(a)
    assert kv.serve(a + ids(50, 24)) == 100


def test_kvboost_simulator_runs_the_real_store_and_engine_code():
    kv = KVBoostStore(1000)
    tier = kv.store.tiers[0]
    assert isinstance(kv.store, KVStore) and isinstance(tier, PoolTier) and tier.pool is kv.pool
    assert tier.eviction.registry_name == "lru" and tier.eviction.leaves_first
    assert kv.pool.device.type == "meta" and kv.pool.block_size == 16  # no memory; the engine's block size
    assert tier.capacity_bytes == (1000 // 16) * kv.pool.block_bytes
    import experiments.sims.pool_model as pm
    from kvboost.cache import sequence_store

    assert pm.store_sequence is sequence_store.store_sequence  # the engine's own store path
    assert kv.chunker.fingerprint() == "fixed:64"
    kv.serve(ids(100, 25))
    assert kv.used_blocks == 7 == kv.pool.num_idle  # 100 tokens: 7 blocks (the last one partial)
    assert all(isinstance(tier.peek(k).payload, BlockRun) for k in tier.keys())  # noqa: SIM118
    kv.model.verify()


def test_bad_capacities_and_names():
    with pytest.raises(ValueError, match="capacity_tokens"):
        SGLangRadixCache(0)
    with pytest.raises(ValueError, match="16-token block"):
        VLLMPrefixCache(10)
    with pytest.raises(ValueError, match="256-token chunk"):
        LMCacheChunks(100)
    with pytest.raises(ValueError, match="capacity_tokens"):
        KVBoostStore(-5)
    with pytest.raises(ValueError, match="16-token block"):
        KVBoostStore(10)
    with pytest.raises(ValueError, match="unknown system 'foo'"):
        build_simulator("foo", 1000)


# ------------------------------------------------------------------------------------------------ aggregation
def test_summarize_is_token_weighted():
    out = summarize([1, 1, 2], [100, 300, 200], [0, 300, 50])
    assert out["overall"] == pytest.approx(350 / 600)
    assert out["by_turn"] == {1: pytest.approx(0.75), 2: pytest.approx(0.25)}


def test_simulate_trace_shape_on_a_synthetic_trace():
    t1 = ids(50, 26)
    trace = [TraceRequest("c", 1, tuple(t1)), TraceRequest("c", 2, tuple(t1 + ids(30, 27)))]
    out = simulate_trace(trace, 4096)
    assert list(out) == list(SYSTEMS)
    for res in out.values():
        assert set(res) == {"overall", "by_turn"} and set(res["by_turn"]) == {1, 2}
    assert out["sglang"]["by_turn"] == {1: 0.0, 2: 50 / 80}
    assert out["vllm"]["by_turn"][2] == 48 / 80


# ------------------------------------------------------------------------------------------------ CLI
@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers")
    argv = ["--conversations", "6", "--users", "3", "--capacity-tokens", "4096", "--out", str(out),
            "--max-turns", "3", "--no-progress"]  # fmt: skip
    return out, main(argv)


def test_cli_writes_the_four_files(cli_run):
    out, results = cli_run
    data = json.loads((out / "simulated_reuse.json").read_text())
    assert set(data) == {"sequential", "interleaved"}
    for order in data.values():
        assert list(order) == list(SYSTEMS)
        for res in order.values():
            assert set(res) == {"overall", "by_turn"}
            assert 0.0 <= res["overall"] <= 1.0
            assert res["by_turn"] and all(t.isdigit() and 0.0 <= r <= 1.0 for t, r in res["by_turn"].items())
    assert data == json.loads(json.dumps(results))
    meta = json.loads((out / "simulated_reuse_meta.json").read_text())
    assert meta["settings"]["capacity_tokens"] == 4096 and meta["trace"]["interleaved"]["requests"] > 0
    # both orders replay the same requests
    assert meta["trace"]["sequential"]["prompt_tokens"] == meta["trace"]["interleaved"]["prompt_tokens"]
    md = (out / "simulated_reuse.md").read_text()
    assert "| kvboost |" in md and "By turn, interleaved" in md
    assert (out / "simulated_reuse.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capacity-tokens", "0"], "positive integer"),
        (["--capacity-tokens", "100"], "256-token chunk"),
        (["--conversations", "-1"], "positive integer"),
        (["--users", "zero"], "positive integer"),
        (["--systems", "vllm,trtllm"], "unknown"),
    ],
)
def test_cli_bad_arguments(tmp_path, capsys, args, message):
    base = {"--conversations": "2", "--users": "2", "--capacity-tokens": "4096", "--out": str(tmp_path)}
    base.update(dict(zip(args[::2], args[1::2])))
    with pytest.raises(SystemExit) as exc:
        main([x for kv in base.items() for x in kv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "simulated_reuse.json").exists()


# ------------------------------------------------------------------------------------------------ the key check
@pytest.fixture(scope="module")
def small_trace():
    from experiments.sims.token_trace import build_trace, bundled_tokenizer

    tokenizer = bundled_tokenizer()
    trace = build_trace(num_conversations=4, max_turns=3, min_turns=3, interleave=True, users=4, seed=0,
                        max_prompt_tokens=1024, tokenizer=tokenizer)  # fmt: skip
    assert len(trace) >= 8 and {r.turn for r in trace} == {1, 2, 3}
    return tokenizer, trace


def test_token_level_systems_agree_without_eviction(small_trace):
    _, trace = small_trace
    prompts = [r.token_ids for r in trace]
    got = {name: replay(build_simulator(name, 1_000_000), prompts) for name in SYSTEMS}
    assert got["kvboost"] == got["sglang"]  # frontier matching reaches the radix tree's longest common prefix
    for name in ("vllm", "lmcache", "llamacpp"):
        assert all(x <= y for x, y in zip(got[name], got["sglang"])), name
    assert sum(got["kvboost"]) > sum(got["vllm"]) > 0


@pytest.mark.parametrize("capacity_tokens", [1_000_000, 1500])
def test_kvboost_simulation_equals_the_engine(small_trace, capacity_tokens):
    from kvboost_testkit.tiny import tiny_model

    tokenizer, trace = small_trace
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048)
    cfg = model.config
    # float32 K and V per token over all layers: the engine's memory tier (its pool) keeps capacity // block bytes
    # idle blocks, the simulator capacity_tokens // 16 (the model's blocks are smaller: compare blocks, not bytes)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    engine = InferenceEngine(
        model, tokenizer, chunker={"name": "fixed", "chunk_size": 64},
        cache={"name": "memory", "capacity": capacity_tokens * bytes_per_token},
        eviction={"name": "lru", "leaves_first": True}, store_generated=False,
    )  # fmt: skip
    with engine:
        tier = engine.store.tiers[0]
        assert isinstance(tier, PoolTier) and engine.pool.row_bytes == bytes_per_token
        sim = KVBoostStore(capacity_tokens, 64, num_blocks=engine.pool.num_blocks)  # the engine's pool size
        assert sim.pool.block_size == engine.pool.block_size
        assert tier.capacity_bytes // engine.pool.block_bytes == sim.model.capacity_blocks
        engine_ratios, sim_ratios, engine_blocks, sim_blocks = [], [], [], []
        for r in trace:
            result = engine.generate(list(r.token_ids), max_new_tokens=1)
            engine_ratios.append(result.metrics()["reuse_ratio"])
            sim_ratios.append(sim.serve(r.token_ids) / len(r.token_ids))
            engine_blocks.append((engine.pool.num_idle, engine.pool.num_cached, engine.pool.num_referenced))
            sim_blocks.append((sim.pool.num_idle, sim.pool.num_cached, sim.pool.num_referenced))
        assert sim_ratios == engine_ratios  # exactly, request by request
        assert sim_blocks == engine_blocks  # cached blocks, request by request
        assert sum(engine_ratios) > 0
        e, s = engine.store.stats, sim.store.stats
        assert (e.exact_hits, e.partial_hits, e.content_hits, e.stored, e.evicted) == (
            s.exact_hits, s.partial_hits, s.content_hits, s.stored, s.evicted)  # fmt: skip
        assert len(engine.store) == len(sim.store) > 0
        assert len(tier) == len(sim.store.tiers[0])
        assert tier.used_bytes // engine.pool.block_bytes == sim.used_blocks > 0
        if capacity_tokens < 10_000:
            assert e.evicted > 0 and sim.used_blocks <= capacity_tokens // 16  # the tight budget really evicts


def test_pool_model_equals_the_engine_with_stored_answers(small_trace):
    """The shared pool model (``experiments/sims/pool_model.py``, what ``cache_sim`` runs) with decode rows and
    ``store_generated``: each request's answer tokens (all but the last have a row) stored after its prompt."""
    from kvboost_testkit.tiny import tiny_model

    from experiments.sims.pool_model import PoolModel

    tokenizer, trace = small_trace
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048)
    cfg = model.config
    bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    engine = InferenceEngine(
        model, tokenizer, chunker={"name": "fixed", "chunk_size": 64},
        cache={"name": "memory", "capacity": 1500 * bytes_per_token},
        eviction={"name": "lru", "leaves_first": True}, store_generated=True, store_canonical=False,
    )  # fmt: skip
    with engine:
        blocks = engine.store.tiers[0].capacity_bytes // engine.pool.block_bytes
        sim = PoolModel(blocks, num_blocks=engine.pool.num_blocks)
        got, want, decoded = [], [], 0
        for r in trace:
            result = engine.generate(list(r.token_ids), max_new_tokens=6)
            decoded += len(result.output_ids) - 1
            served = sim.serve(r.token_ids, result.output_ids[:-1])
            want.append((result.exact_hit_tokens, result.content_hit_tokens, engine.pool.num_idle))
            got.append((served.exact_tokens, served.content_tokens, sim.used_blocks))
            sim.verify()
        assert got == want and sum(g[0] for g in got) > 0 and decoded > 0
        e, s = engine.store.stats, sim.store.stats
        assert (e.exact_hits, e.partial_hits, e.content_hits, e.stored, e.evicted) == (
            s.exact_hits, s.partial_hits, s.content_hits, s.stored, s.evicted)  # fmt: skip
        assert e.evicted > 0
