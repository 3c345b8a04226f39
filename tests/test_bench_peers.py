"""experiments/bench/bench_peers.py: the pure functions on fake records, a torch system on a tiny model, and (where
llama-cpp-python is installed) the two llama.cpp systems on the bundled GGUF."""

from __future__ import annotations

import math

import pytest

from experiments.bench import bench_peers as bp

EOS = 2


def _rec(system, order, conv, turn, ttft, *, prompt=100, reused=0, tok_s=50.0, out=(5, 6, EOS)):
    return {"system": system, "order": order, "request_id": f"{conv}/{turn}", "conversation_id": conv, "turn": turn,
            "prompt_tokens": prompt, "reused_tokens": reused, "ttft_ms": ttft, "decode_tok_s": tok_s,
            "generated_tokens": len(out), "output_ids": list(out)}  # fmt: skip


def _fake_records():
    recs = []
    for order in ("sequential", "interleaved"):
        for conv, scale in (("a", 1.0), ("b", 2.0)):
            for turn in (1, 2):
                recs.append(
                    _rec("llama_cpp_prefix", order, conv, turn, 100.0 * scale, prompt=200, reused=50 * (turn - 1))
                )
                recs.append(_rec("kvboost", order, conv, turn, 40.0 * scale * turn, prompt=200, reused=100 * (turn - 1),
                                 tok_s=None if turn == 2 else 30.0, out=(5, 6, EOS, 9)))  # fmt: skip
                recs.append(_rec("hf_baseline", order, conv, turn, 300.0, prompt=200, out=(5, 6, EOS, 7)))
    return recs


def test_percentile_and_describe():
    assert bp.percentile([3, 1, 2], 50) == 2
    assert bp.percentile([0, 10], 10) == pytest.approx(1.0)
    d = bp.describe([1.0, None, 3.0, float("nan")])
    assert d["n"] == 2 and d["p50"] == 2.0 and d["mean"] == 2.0 and d["min"] == 1.0 and d["max"] == 3.0
    assert d["std"] == pytest.approx(math.sqrt(2))
    assert bp.describe([])["p50"] is None


def test_aggregate_by_turn_and_overall():
    recs = _fake_records()
    by_turn = bp.aggregate_by_turn(recs)
    k2 = by_turn["kvboost"]["sequential"][2]
    assert k2["ttft_ms"]["n"] == 2 and k2["ttft_ms"]["p50"] == pytest.approx(120.0)  # 80 and 160
    assert k2["reuse_ratio_mean"] == pytest.approx(0.5)
    overall = bp.aggregate_overall(recs)["kvboost"]["interleaved"]
    assert overall["requests"] == 4
    assert overall["decode_tok_s"]["n"] == 2  # turn 2 decoded a single token: no rate
    assert overall["reuse_ratio_token_weighted"] == pytest.approx(200 / 800)


def test_ratio_by_turn_pairs_the_same_request():
    ratios = bp.ratio_by_turn(_fake_records())
    t1, t2 = ratios["sequential"][1], ratios["sequential"][2]
    assert t1["n"] == 2 and t1["p50"] == pytest.approx(0.4) and t1["min"] == t1["max"]  # 40/100 and 80/200
    assert t2["p50"] == pytest.approx(0.8)


def test_greedy_match_cuts_after_eos():
    assert bp.truncate_at_eos([1, EOS, 3], {EOS}) == [1, EOS]
    match = bp.greedy_match(_fake_records(), {EOS})
    assert match["kvboost"]["sequential"]["match_rate"] == 1.0  # differs from hf_baseline only after EOS
    assert match["llama_cpp_prefix"]["sequential"]["match_rate"] == 1.0
    recs = _fake_records() + [_rec("hf_prefix", "sequential", "a", 1, 1.0, out=(5, 8, EOS))]
    m = bp.greedy_match(recs, {EOS})["hf_prefix"]["sequential"]
    assert m["match_rate"] == 0.0 and m["matched_prefix_share_mean"] == pytest.approx(1 / 3)


def test_floor_formula_matches_a_brute_force_sum():
    arch = bp.Arch(non_embedding_params=1000, num_layers=3, attn_width=8, hidden=4, intermediate=16, vocab=50)
    n, c = 37, 11
    brute = sum(2 * 1000 + 4 * 3 * 8 * (p + 1) for p in range(c, n)) + 2 * 50 * 4
    assert bp.prefill_flops(n, c, arch) == pytest.approx(brute)
    assert bp.prefill_flops(n, n, arch) == 0.0
    assert bp.compute_floor_ms(n, c, arch, 1e9) == pytest.approx(brute / 1e9 * 1e3)
    recs = _fake_records()
    bp.add_floor(recs, arch, 1e6)
    k = [r for r in recs if r["system"] == "kvboost"]
    assert all(r["new_tokens"] == r["prompt_tokens"] - r["reused_tokens"] for r in k)
    assert all(r["ttft_over_floor"] == pytest.approx(r["ttft_ms"] / r["floor_ms"]) for r in k)
    assert "floor_ms" not in next(r for r in recs if r["system"] == "hf_baseline")
    floors = bp.floor_by_turn(recs)
    assert floors["interleaved"][2]["new_tokens"]["p50"] == 100


def test_arch_reads_a_tiny_model():
    from kvboost_testkit.tiny import tiny_model

    model = tiny_model("llama")
    arch = bp.Arch.from_model(model)
    embed = model.model.embed_tokens.weight.numel() + model.lm_head.weight.numel()
    assert arch.non_embedding_params == sum(p.numel() for p in model.parameters()) - embed
    assert (arch.num_layers, arch.attn_width, arch.hidden, arch.intermediate) == (2, 64, 64, 128)


def test_arch_counts_awq_int4_weights_like_float_ones():
    """An AWQ model does the same multiply-adds as its float original: its floor must not shrink."""
    from kvboost_testkit.tiny import tiny_model

    from kvboost.models.awq import AWQConfig, quantize_model_rtn

    model = tiny_model("llama")
    float_arch = bp.Arch.from_model(model)
    quantize_model_rtn(model, AWQConfig(group_size=32))
    awq_arch = bp.Arch.from_model(model)
    biases = sum(m.bias.numel() for m in model.modules() if getattr(m, "bias", None) is not None)
    assert awq_arch.non_embedding_params + biases == float_arch.non_embedding_params


def test_markdown_report_has_every_table():
    recs = _fake_records()
    arch = bp.Arch(1000, 3, 8, 4, 16, 50)
    bp.add_floor(recs, arch, 1e6)
    result = {
        "title": "fake", "command": "python -m experiments.bench.bench_peers --fake", "notes": ["a note"],
        "orders": ["sequential", "interleaved"], "by_turn": bp.aggregate_by_turn(recs),
        "overall": bp.aggregate_overall(recs), "ratio_by_turn": bp.ratio_by_turn(recs),
        "floor_by_turn": bp.floor_by_turn(recs), "greedy_match": bp.greedy_match(recs, {EOS}),
        "matmul_rate": {"dtype": "float32", "m": 100, "k": 4, "n": 16, "gflop_s": 12.0, "other_m_gflop_s": {"16": 3.0}},
    }  # fmt: skip
    md = bp.markdown_report(result)
    assert md.splitlines()[2] == "```" and "--fake" in md
    for heading in ("## sequential: TTFT", "## interleaved: TTFT", "## Decode tokens/s"):
        assert heading in md
    assert "kvboost / llama_cpp_prefix" in md and "0.40 [0.40-0.40]" in md
    assert "| kvboost | sequential | 4 |" in md and "12 GFLOP/s" in md


def test_parse_assignments_and_parser():
    assert bp.parse_assignments(["decode=compiled", "n=3", "flag=true"]) == {"decode": "compiled", "n": 3, "flag": True}
    with pytest.raises(ValueError, match="key=value"):
        bp.parse_assignments(["oops"])
    args = bp.build_parser().parse_args(["--kvboost-arg", "decode=compiled", "--dtype", "bfloat16"])
    assert args.kvboost_arg == ["decode=compiled"] and args.max_new_tokens == 32 and args.threads == 2


def test_torch_system_on_a_tiny_engine_ignores_eos():
    from kvboost_testkit.tiny import ToyTokenizer, tiny_model

    from kvboost.engine import InferenceEngine
    from kvboost.lab.modes import MODES

    engine = InferenceEngine(tiny_model("llama"), ToyTokenizer())
    try:
        ids = list(range(5, 70))
        kv = bp.TorchSystem("kvboost", MODES.get("kvboost")(engine), ignore_eos=True)
        hf = bp.TorchSystem("hf_prefix", MODES.get("hf_prefix")(engine), ignore_eos=True)
        for system in (kv, hf):
            first = system.generate(ids, 6)
            again = system.generate(ids + [9, 10, 11], 6)
            assert first["generated_tokens"] == 6 and len(first["output_ids"]) == 6
            assert first["reused_tokens"] == 0 and again["reused_tokens"] >= 64
            assert again["ttft_ms"] > 0 and again["decode_tok_s"] > 0
            system.reset()
            assert system.generate(ids, 2)["reused_tokens"] == 0
        assert engine.eos_ids == set()
    finally:
        engine.close()


@pytest.mark.integration
def test_llama_cpp_systems_reuse_prefixes():
    pytest.importorskip("llama_cpp", reason="llama-cpp-python not installed (optional extra 'peers')")
    from kvboost.models.loading import bundled_gguf_path

    try:
        gguf = str(bundled_gguf_path())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    ids = [1, 9690, 198] + list(range(1000, 1040))  # <|im_start|>system\n + 40 ordinary tokens
    more = ids + list(range(2000, 2010))
    prefix = bp.LlamaPrefixSystem(bp._build_llama(gguf, 512, 2, {}), eos_ids={EOS}, ignore_eos=True)
    first = prefix.generate(ids, 4)
    assert first["generated_tokens"] == 4 and first["reused_tokens"] == 0 and first["decode_tok_s"] > 0
    assert prefix.generate(more, 4)["reused_tokens"] == len(ids)

    llm = bp._build_llama(gguf, 512, 2, {})
    ram = bp.LlamaRamCacheSystem(llm, capacity_bytes=1 << 30, eog_ids=bp._llama_eog_ids(llm), ignore_eos=True)
    a = ram.generate(ids, 4)
    assert a["generated_tokens"] == 4 and a["reused_tokens"] == 0 and a["save_ms"] >= 0
    ram.generate(list(range(3000, 3030)), 2)  # another prompt: the slot no longer holds ids
    back = ram.generate(more, 4)
    assert back["reused_tokens"] >= len(ids)  # restored from the saved state of the first prompt
    ram.reset()
    assert ram.generate(ids, 2)["reused_tokens"] == 0


# ---------------------------------------------------------------------------------- llama_server (llama-server)
# A /completion answer as llama-server 0.3.36 (llama.cpp tools/server) returns it with return_tokens=true.
COMPLETION = {
    "index": 0, "content": " Hello there", "tokens": [22503, 2147, EOS], "id_slot": 0, "stop": True,
    "model": "gpt-3.5-turbo", "tokens_predicted": 3, "tokens_evaluated": 120, "stop_type": "eos",
    "stopping_word": "", "tokens_cached": 119, "truncated": False,
    "timings": {"cache_n": 100, "prompt_n": 20, "prompt_ms": 31.5, "prompt_per_token_ms": 1.575,
                "prompt_per_second": 634.9, "predicted_n": 3, "predicted_ms": 40.0,
                "predicted_per_token_ms": 20.0, "predicted_per_second": 50.0},
}  # fmt: skip


def test_parse_completion_reads_the_server_timings():
    r = bp.parse_completion(COMPLETION, wall_ms=80.0)
    assert r["ttft_ms"] == 31.5 and r["total_ms"] == r["server_wall_ms"] == 80.0  # TTFT = prompt_ms, no HTTP
    assert r["decode_tok_s"] == pytest.approx(50.0)  # (3 - 1) tokens / 40 ms: the first token is the prefill's
    assert r["decode_tok_s"] == pytest.approx(COMPLETION["timings"]["predicted_per_second"])
    assert r["reused_tokens"] == 100 and r["server_prompt_n"] == 20 and r["stop_type"] == "eos"
    assert r["output_ids"] == [22503, 2147, EOS] and r["generated_tokens"] == 3
    one = {**COMPLETION, "tokens": [5], "timings": {**COMPLETION["timings"], "predicted_n": 1, "predicted_ms": 0.001}}
    assert bp.parse_completion(one, 1.0)["decode_tok_s"] is None  # one token: no decode step
    with pytest.raises(RuntimeError, match="no token ids"):
        bp.parse_completion({**COMPLETION, "tokens": []}, 1.0)
    # a record of it aggregates like any other system's
    rec = bp._record("llama_server", "sequential", type("R", (), {"request_id": "a/1", "conversation_id": "a",
                                                                 "turn": 1})(), list(range(120)), r)  # fmt: skip
    assert bp.aggregate_overall([rec])["llama_server"]["sequential"]["reuse_ratio_token_weighted"] == 100 / 120


def test_llama_server_request_body():
    body = bp.LlamaServerSystem("http://127.0.0.1:1/", ignore_eos=True).request_body([1, 2, 3], 8)
    assert body["prompt"] == [1, 2, 3] and body["n_predict"] == 8 and body["cache_prompt"] is True
    assert body["return_tokens"] is True and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert body["top_k"] == 1 and body["id_slot"] == 0


def test_system_selection_and_ratio_pair():
    assert bp.default_systems(True) == ("llama_cpp_prefix", "llama_cpp_ramcache", "hf_baseline", "hf_prefix", "kvboost")
    assert bp.default_systems(False) == ("llama_server", "hf_baseline", "hf_prefix", "kvboost")
    assert bp.build_parser().parse_args([]).systems is None  # resolved in run() by what is installed
    assert bp.ratio_pair(["llama_server", "llama_cpp_prefix", "kvboost"]) == ("kvboost", "llama_cpp_prefix")
    assert bp.ratio_pair(["kvboost", "llama_server"]) == ("kvboost", "llama_server")
    assert bp.ratio_pair(["kvboost"]) == bp.RATIO_PAIR  # nothing to divide by: the table leaves the column out
    recs = [dict(r, system="llama_server") if r["system"] == "llama_cpp_prefix" else r for r in _fake_records()]
    result = {
        "title": "fake", "orders": ["sequential"], "by_turn": bp.aggregate_by_turn(recs),
        "overall": bp.aggregate_overall(recs), "ratio_pair": list(bp.ratio_pair(["kvboost", "llama_server"])),
        "ratio_by_turn": bp.ratio_by_turn(recs, "kvboost", "llama_server"), "floor_by_turn": {},
        "greedy_match": bp.greedy_match(recs, {EOS}),
    }  # fmt: skip
    md = bp.markdown_report(result)
    assert "kvboost / llama_server p50" in md and "0.40 [0.40-0.40]" in md
    assert "| llama_server | sequential | 4 | 50.0 |" in md and "| kvboost | sequential | 4 | 30.0 |" in md


def _cached_llama_server():
    """The llama-server binary ``ensure_llama_server()`` would return, if it is already built (never builds)."""
    from experiments.bench import peer_server as ps

    version = ps.LLAMA_CPP_PYTHON_VERSION
    key = ps.cache_key(version, ps.default_cmake_flags(), ps.cpu_model(), ps.isa_flags(ps.cpu_flags()))
    binary = ps.binary_dir(ps.DEFAULT_CACHE_DIR.expanduser(), version, key) / ps.TARGET
    return binary if binary.is_file() else None


@pytest.mark.integration
def test_llama_server_system_reuses_the_slot_prefix(tmp_path):
    binary = _cached_llama_server()
    if binary is None:
        pytest.skip("no llama-server built under ~/.cache/kvboost/peers (python -m experiments.bench.peer_server)")
    from experiments.bench.peer_server import start_llama_server
    from kvboost.models.loading import bundled_gguf_path

    try:
        gguf = str(bundled_gguf_path())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    ids = [1, 9690, 198] + list(range(1000, 1040))  # <|im_start|>system\n + 40 ordinary tokens
    more = ids + list(range(2000, 2010))
    with start_llama_server(binary, gguf, parallel=1, ctx=512, threads=2, extra=bp.llama_server_args(tmp_path),
                            ready_timeout_s=120) as server:  # fmt: skip
        system = bp.LlamaServerSystem(server.base_url, ignore_eos=True)
        first = system.generate(ids, 4)
        assert first["generated_tokens"] == 4 and first["reused_tokens"] == 0 and first["decode_tok_s"] > 0
        assert first["ttft_ms"] > 0 and first["server_wall_ms"] >= first["ttft_ms"]
        assert system.generate(more, 4)["reused_tokens"] == len(ids)
        system.reset()
        assert system.generate(ids, 2)["reused_tokens"] == 0
