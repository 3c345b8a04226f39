"""experiments/sims/cache_sim.py on small synthetic traces with known answers (no model, no dataset, a few seconds).

- Unbounded store: the exact token hit ratio is the trace's shared-prefix fraction (per request, the longest
  common token prefix with any earlier request, capped at n - 1 as the engine always computes the last token).
- The memory tier is the KV pool (``experiments/sims/pool_model.py``): a budget below one block keeps nothing; the
  capacity is whole blocks (a partial last block costs a block); smaller blocks waste less.
- ``leaves_first=false`` strands descendants (found by content lookup only); with LRU it hits no more than
  leaves first.
- Every policy keeps the pool's and the store's books exact (``PoolModel.verify`` after every request).
- The CLI writes the JSON (shape checked) and the PNG; bad arguments fail with one clear line.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from experiments.sims import cache_sim
from experiments.sims.cache_sim import KVShape, Simulator, default_capacities, parse_policy, sweep
from experiments.sims.token_trace import TraceRequest

SHAPE = KVShape(layers=30, kv_heads=3, head_dim=64)  # SmolLM2-135M
BPT = SHAPE.bytes_per_token
CHUNK = 16


def synthetic_trace(conversations: int = 6, turns: int = 4, users: int = 3, seed: int = 0, system: int = 20,
                    new: tuple[int, int] = (10, 60), vocab: int = 500) -> list[list[int]]:  # fmt: skip
    """Multi-turn chats sharing a system prompt: turn t's prompt = turn t-1's prompt + an answer + a new
    message; ``users`` conversations interleaved (turn t of each before turn t+1); one request repeated."""
    rng = random.Random(seed)
    system_ids = [rng.randrange(vocab) for _ in range(system)]
    convs = []
    for _ in range(conversations):
        ids, prompts = list(system_ids), []
        for t in range(turns):
            if t:
                ids += [rng.randrange(vocab) for _ in range(rng.randrange(*new))]  # the previous answer
            ids += [rng.randrange(vocab) for _ in range(rng.randrange(*new))]  # the new user message
            prompts.append(list(ids))
        convs.append(prompts)
    order = []
    for g in range(0, conversations, users):
        for t in range(turns):
            order += [prompts[t] for prompts in convs[g : g + users]]
    order.append(list(order[len(order) // 2]))  # an exact repeat: everything but the last token is reused
    return order


def shared_prefix_tokens(trace: list[list[int]]) -> int:
    total = 0
    for i, ids in enumerate(trace):
        best = 0
        for prev in trace[:i]:
            n = min(len(prev), len(ids))
            k = 0
            while k < n and prev[k] == ids[k]:
                k += 1
            best = max(best, k)
        total += min(best, len(ids) - 1)
    return total


def sim(**kwargs) -> Simulator:
    return Simulator(kv_shape=SHAPE, chunk_size=CHUNK, **kwargs)


def test_kv_bytes_per_token_of_smollm2():
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert KVShape.from_config(config).bytes_per_token == 46080 == BPT
    bundled = sorted(Path.home().glob(".cache/kvboost/models/SmolLM2-135M-Instruct-*/config.json"))
    if bundled:  # the converted bundled model, when this machine has it
        assert KVShape.from_config(json.loads(bundled[0].read_text())).bytes_per_token == 46080
    with pytest.raises(cache_sim.SimError):
        KVShape.from_config({"hidden_size": 3})


@pytest.mark.parametrize("policy", ["lru", "lfu", "s3fifo"])
def test_unbounded_store_hits_exactly_the_shared_prefixes(policy):
    trace = synthetic_trace()
    r = sim().run(trace, policy=policy, leaves_first=True, capacity_bytes=None, check=True)
    assert r.prompt_tokens == sum(map(len, trace)) and r.requests == len(trace)
    assert r.exact_tokens == shared_prefix_tokens(trace) > 0
    assert r.content_tokens == 0 and r.evicted == 0 and r.rejected == 0 and r.orphans_at_end == 0
    assert r.token_hit_ratio == pytest.approx(r.exact_tokens / r.prompt_tokens)
    assert r.partial_hits > 0  # the frontier match did part of it


def test_a_budget_below_one_block_keeps_nothing():
    trace = synthetic_trace()
    r = sim().run(trace, policy="lru", leaves_first=True, capacity_bytes=BPT * CHUNK - 1, check=True)
    assert r.capacity_blocks == 0 and r.block_size == CHUNK
    # no chunk fits: each is refused when its request stores it (as a memory tier's byte budget refused it)
    assert r.stored == 0 and r.rejected > 0 and r.evicted == 0
    assert r.exact_tokens == 0 and r.token_hit_ratio == 0.0
    assert r.entries_at_end == 0 and r.used_blocks_at_end == 0 and r.used_bytes_at_end == 0


@pytest.mark.parametrize("policy", ["lru", "lfu", "s3fifo"])
def test_capacity_is_whole_blocks(policy):
    trace = synthetic_trace(conversations=8, turns=5, users=4, new=(30, 90))
    blocks = 30
    r = sim().run(trace, policy=policy, leaves_first=True, capacity_bytes=blocks * CHUNK * BPT + CHUNK * BPT - 1,
                  check=True)  # fmt: skip
    assert r.capacity_blocks == blocks and 0 < r.used_blocks_at_end <= blocks
    assert r.used_bytes_at_end == r.used_blocks_at_end * CHUNK * BPT
    # partial last blocks: the entries' tokens fit in fewer bytes than their blocks take
    assert r.cached_tokens_at_end <= r.used_blocks_at_end * CHUNK
    ideal = sim().run(trace, policy=policy, leaves_first=None, capacity_bytes=None, check=True)
    assert ideal.cached_tokens_at_end < ideal.used_blocks_at_end * CHUNK
    assert ideal.evicted == 0 and ideal.copied_blocks > 0  # frontier hits copy the shared partial block


def test_smaller_blocks_round_less_and_shared_rows_count_once():
    trace = synthetic_trace(conversations=8, turns=5, users=4, new=(30, 90))
    waste = {}
    for bs in (16, 4, 1):
        r = Simulator(kv_shape=SHAPE, chunk_size=CHUNK, block_size=bs).run(trace, policy="lru", leaves_first=None,
                                                                           capacity_bytes=None)  # fmt: skip
        waste[bs] = r.used_blocks_at_end * bs - r.cached_tokens_at_end
        assert r.exact_tokens == shared_prefix_tokens(trace)  # hits are token-level whatever the block size
    # with 1-token blocks nothing is rounded, and rows two sibling entries share (a frontier hit taken by
    # reference, then the longer chunk stored over the same blocks) count once: fewer blocks than entry tokens
    assert waste[16] > waste[4] > waste[1] and waste[1] <= 0


@pytest.mark.parametrize("policy", ["lru", "lfu", "s3fifo"])
def test_without_leaves_first_descendants_are_stranded(policy):
    trace = synthetic_trace(conversations=8, turns=5, users=4, new=(30, 90))
    longest = max(map(len, trace))
    cap = (longest + CHUNK) * BPT  # holds any one prompt: leaves first never has to reject one
    with_lf = sim().run(trace, policy=policy, leaves_first=True, capacity_bytes=cap, check=True)
    without = sim().run(trace, policy=policy, leaves_first=False, capacity_bytes=cap, check=True)
    assert with_lf.evicted > 0 and without.evicted > 0
    assert with_lf.orphans_at_end == 0 and with_lf.content_tokens == 0
    # stranded (a chunk whose exact chain has a gap), and found by content only; eviction takes a stranded chain
    # down from its root, so few or no orphans need be left at the very end
    assert without.content_tokens > 0
    if policy == "lru":
        # LRU evicts a chain from its root (inserted first): the stranded tail is dead weight.
        assert without.token_hit_ratio <= with_lf.token_hit_ratio
    # lfu and s3fifo can do better without leaves first on chat traces: protecting every internal node
    # leaves them only the chains' newest tails to evict (what the next turn reuses). Not asserted either way.


def test_stranded_chunks_come_back_as_content_hits_only():
    """With the fixed chunker a segment is the whole prompt: a chunk whose ancestor was evicted is found by its
    segment key (the engine's content lookup), never by the exact walk."""
    trace = synthetic_trace(conversations=8, turns=5, users=4, new=(30, 90))
    cap = (max(map(len, trace)) + CHUNK) * BPT
    on = sim().run(trace, policy="lru", leaves_first=False, capacity_bytes=cap)
    off = sim(content=False).run(trace, policy="lru", leaves_first=False, capacity_bytes=cap)
    assert on.content_tokens > 0 and on.reuse_ratio > on.token_hit_ratio
    assert off.content_tokens == 0 and off.reuse_ratio == off.token_hit_ratio


def test_generated_tokens_take_room_but_are_never_hit():
    trace = synthetic_trace()
    plain = sim().run(trace, policy="lru", leaves_first=True, capacity_bytes=None)
    answered = sim(generated_tokens=24).run(trace, policy="lru", leaves_first=True, capacity_bytes=None, check=True)
    assert answered.exact_tokens == plain.exact_tokens
    assert answered.used_bytes_at_end > plain.used_bytes_at_end


def test_default_capacities_are_log_spaced_up_to_most_of_the_footprint():
    caps = default_capacities(1000 * BPT * 100, conversations=100)
    assert len(caps) == 5 and caps == sorted(caps)
    assert caps[0] == pytest.approx(3 * 1000 * BPT, rel=1e-6)
    assert caps[-1] == pytest.approx(0.8 * 1000 * BPT * 100, rel=1e-6)
    ratios = [b / a for a, b in zip(caps, caps[1:])]
    assert max(ratios) == pytest.approx(min(ratios), rel=1e-3)
    with pytest.raises(cache_sim.SimError):
        default_capacities(0, conversations=3)


def test_sweep_result_shape():
    trace = synthetic_trace()
    result = sweep(trace, sim(), policies=["lru", "s3fifo"], leaves_first=[True, False], capacities=None,
                   conversations=6)  # fmt: skip
    assert len(result["capacities"]) == 5 and len(result["runs"]) == 2 * 2 * 5
    assert set(result["curves"]) == {f"{p} (leaves_first={lf})" for p in ("lru", "s3fifo") for lf in ("true", "false")}
    assert all(len(v) == 5 and all(0 <= x <= 1 for x in v) for v in result["curves"].values())
    ideal = result["trace"]["ideal_token_hit_ratio"]
    assert all(x <= ideal + 1e-12 for v in result["curves"].values() for x in v)
    assert result["trace"]["footprint_bytes"] == result["ideal"]["used_bytes_at_end"] > 0
    assert result["timing"]["us_per_request"] > 0


def _fake_trace(**kwargs):
    return [TraceRequest(f"c{i}", 1, tuple(ids)) for i, ids in enumerate(synthetic_trace())]


def test_cli_writes_json_and_png(tmp_path, monkeypatch):
    monkeypatch.setattr("experiments.sims.token_trace.build_trace", _fake_trace)
    monkeypatch.setattr(cache_sim, "bundled_kv_shape", lambda: (SHAPE, "config.json"))
    out = tmp_path / "sim"
    cache_sim.main(["--conversations", "6", "--users", "3", "--out", str(out), "--capacities", "20MiB", "60MiB",
                    "--policies", "lru", "lfu", "--chunk-size", str(CHUNK), "--no-progress"])  # fmt: skip
    data = json.loads((out / "cache_sim.json").read_text())
    assert set(data) >= {"settings", "trace", "capacities", "ideal", "runs", "curves", "timing"}
    assert [c["bytes"] for c in data["capacities"]] == [20 * 2**20, 60 * 2**20]
    assert len(data["runs"]) == 2 * 2 * 2 and data["settings"]["bytes_per_token"] == 46080
    assert data["settings"]["block_size"] == 16 and data["settings"]["block_bytes"] == 16 * 46080
    assert [c["blocks"] for c in data["capacities"]] == [20 * 2**20 // (16 * BPT), 60 * 2**20 // (16 * BPT)]
    run = data["runs"][0]
    for key in ("policy", "leaves_first", "capacity_bytes", "capacity_blocks", "token_hit_ratio", "reuse_ratio",
                "orphans_at_end", "used_blocks_at_end", "cached_tokens_at_end", "us_per_request", "label"):  # fmt: skip
        assert key in run
    assert (out / "hit_ratio.png").stat().st_size > 1000


def test_cli_errors_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("experiments.sims.token_trace.build_trace", _fake_trace)
    monkeypatch.setattr(cache_sim, "bundled_kv_shape", lambda: (SHAPE, "config.json"))
    with pytest.raises(SystemExit):
        cache_sim.main(["--conversations", "2", "--users", "1", "--out", str(tmp_path), "--policies", "lruu"])
    err = capsys.readouterr().err
    assert "lruu" in err and "lru" in err and "s3fifo" in err
    with pytest.raises(SystemExit):
        cache_sim.main(["--conversations", "2", "--users", "1", "--out", str(tmp_path), "--capacities", "lots"])
    assert "lots" in capsys.readouterr().err
    monkeypatch.setattr("experiments.sims.token_trace.build_trace", lambda **kw: [])
    with pytest.raises(SystemExit):
        cache_sim.main(["--conversations", "2", "--users", "1", "--out", str(tmp_path), "--no-progress"])
    assert "empty" in capsys.readouterr().err


def test_policy_specs_take_constructor_arguments():
    assert parse_policy("lru") == ("lru", {})
    assert parse_policy("s3fifo:small_ratio=0.3,move_to_main_threshold=2") == (
        "s3fifo", {"small_ratio": 0.3, "move_to_main_threshold": 2})  # fmt: skip
    for bad in ("s3fifo:small_ratio", "s3fifo:smal_ratio=0.3", "s3fifo:small_ratio=2", "lru:leaves_first=false",
                "nope"):  # fmt: skip
        with pytest.raises(cache_sim.SimError):
            parse_policy(bad)
    trace = synthetic_trace()
    result = sweep(trace, sim(), policies=["s3fifo", "s3fifo:small_ratio=0.5"], leaves_first=[True],
                   capacities=[40 * 2**20], conversations=6)  # fmt: skip
    assert [r["policy"] for r in result["runs"]] == ["s3fifo", "s3fifo:small_ratio=0.5"]
    assert result["runs"][1]["policy_args"] == {"small_ratio": 0.5}
