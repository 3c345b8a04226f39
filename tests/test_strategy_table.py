"""The strategy table's statistics and table (experiments/bench/strategy_table.py) on synthetic records."""

from __future__ import annotations

import json

import pytest

from experiments.bench import strategy_table as st
from experiments.report import paired_difference_ci, wilson_interval


def test_wilson_interval_known_values():
    # 46/60: (p + z²/2n) / (1 + z²/n) = 0.7506, half width 0.1050 (z = 1.96, worked by hand)
    lo, hi = wilson_interval(46, 60)
    assert lo == pytest.approx(0.6456, abs=2e-4) and hi == pytest.approx(0.8556, abs=2e-4)
    assert wilson_interval(0, 10)[0] == pytest.approx(0.0, abs=1e-12) and 0.25 < wilson_interval(0, 10)[1] < 0.32
    assert wilson_interval(10, 10)[1] == 1.0
    assert wilson_interval(0, 0) is None


def test_paired_difference_ci_brackets_the_difference_and_is_paired():
    a = [1.0] * 50 + [0.0] * 10
    b = [1.0] * 45 + [0.0] * 15
    lo, hi = paired_difference_ci(a, b)
    assert lo <= (50 - 45) / 60 <= hi
    # identical arms: the paired difference is exactly 0, whatever the resample
    assert paired_difference_ci(a, a) == [0.0, 0.0]
    with pytest.raises(ValueError, match="differ in length"):
        paired_difference_ci(a, b[:-1])


def test_strategy_overrides():
    assert st.strategy_overrides("none") == ["recompute=none"]
    assert st.strategy_overrides("cacheblend:0.3") == ["recompute=cacheblend", "recompute.ratio=0.3"]
    for bad in (":0.3", "cacheblend:x", "cacheblend:1.5", "cacheblend:0"):
        with pytest.raises(ValueError, match="strategy"):
            st.strategy_overrides(bad)


def _records():
    out = []
    for draw in (0, 1):
        for q in range(10):
            base_ok = q != 0
            out.append(
                {
                    "arm": "baseline",
                    "arm_index": 0,
                    "draw": draw,
                    "query": f"q{q}",
                    "ttft_ms": 1000.0 + q,
                    "correct": base_ok,
                }
            )
            out.append(
                {
                    "arm": "none",
                    "arm_index": 1,
                    "draw": draw,
                    "query": f"q{q}",
                    "ttft_ms": 100.0 + q,
                    "correct": base_ok and q >= 3,
                    "recompute_ratio": 0.0,
                    "kv_reuse_ratio": 0.9,
                    "greedy_match": q >= 3,
                    "first_token_kl": 0.1,
                    "answer_logprob_delta": -1.0,
                }
            )
    return out


def test_summarize_pools_draws_and_pairs_queries():
    summary = st.summarize(_records())
    assert summary["draws"] == [0, 1]
    base, none = summary["arms"]["baseline"]["pooled"], summary["arms"]["none"]["pooled"]
    assert base["n"] == 20 and base["correct"] == 18
    assert none["correct"] == 14 and none["accuracy_diff"] == pytest.approx((14 - 18) / 20)
    assert none["speedup"] == pytest.approx(percentile_ratio())
    assert none["greedy_match"] == pytest.approx(0.7)
    assert summary["arms"]["none"]["draw 1"]["n"] == 10
    table = st.format_table(summary, {"model": "m", "dtype": "float32", "queries": 10, "command": "c", "machine": "x"})
    assert "| none |" in table and "0.700 (14/20)" in table and "-0.200" in table


def percentile_ratio():
    # the median of the 20 per-query ratios (1000 + q) / (100 + q): q = 4 and q = 5 twice each around the middle
    ratios = sorted([(1000.0 + q) / (100.0 + q) for q in range(10)] * 2)
    return (ratios[9] + ratios[10]) / 2


def test_pooled_speedup_is_a_per_query_ratio_not_mixed_absolute_times():
    # draw 0 on a fast machine (10x per query), draw 1 on one five times slower (2x per query): the pooled figure
    # is the median of the 16 per-query ratios, (2 + 10) / 2 = 6; p50 / p50 of the mixed times would say ~2.3
    records = []
    for draw, base, ratio in ((0, 1000.0, 10.0), (1, 5000.0, 2.0)):
        for q in range(8):
            records.append({"arm": "baseline", "arm_index": 0, "draw": draw, "query": f"q{q}",
                            "ttft_ms": base + q, "correct": True})  # fmt: skip
            records.append({"arm": "none", "arm_index": 1, "draw": draw, "query": f"q{q}",
                            "ttft_ms": (base + q) / ratio, "correct": True})  # fmt: skip
    rows = st.summarize(records)["arms"]["none"]
    assert rows["pooled"]["speedup"] == pytest.approx(6.0)
    assert rows["draw 0"]["speedup"] == pytest.approx(10.0) and rows["draw 0"]["speedup_ci"] == pytest.approx([10, 10])
    lo, hi = rows["pooled"]["speedup_ci"]
    assert 2.0 <= lo <= 6.0 <= hi <= 10.0


def test_summarize_only_rebuilds_from_records(tmp_path):
    with open(tmp_path / "records.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _records())
    st.main(["--out", str(tmp_path), "--summarize-only"])
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["arms"]["none"]["pooled"]["correct"] == 14
    assert (tmp_path / "table.md").read_text().startswith("# Content-reuse strategies")


def test_existing_records_are_not_overwritten(tmp_path):
    (tmp_path / "records.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit, match="--append"):
        st.main(
            ["--out", str(tmp_path), "--queries", "1", "--draws", "0", "--strategies", "none", "--model", "tiny_random"]
        )
