"""Results aggregation on synthetic records with known answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the experiments/ runner is not an installed package
    sys.path.insert(0, str(ROOT))

from kvboost.lab.report import (  # noqa: E402
    bootstrap_ratio_ci,
    format_table,
    percentile,
    plot_summary,
    read_records,
    summarize,
    write_records,
    write_summary,
)


def _rec(mode, turn, ttft, conv="c0", **extra):
    r = dict(conversation_id=conv, turn=turn, mode=mode, prompt_tokens=100 * turn, ttft_ms=ttft,
             total_ms=ttft + 100, store_ms=2.0 if mode != "baseline" else 0.0, decode_tok_s=50.0,
             generated_tokens=16, reuse_ratio=0.0, exact_ratio=0.0, content_ratio=0.0, recompute_ratio=0.0)
    r.update(extra)
    return r


@pytest.fixture
def records():
    """Baseline: turns 1-3 (four conversations each). kvboost: turns 1-3, exactly 4x faster on turns
    2-3 with reuse 0.75; quality fields known. hf_prefix: turns 1-2 only, some fields missing."""
    recs = []
    base_ttft = [100.0, 200.0, 300.0, 400.0]  # p50 250, p90 370, mean 250
    for turn in (1, 2, 3):
        for i, t in enumerate(base_ttft):
            recs.append(_rec("baseline", turn, t * turn, conv=f"c{i}"))
    for turn in (1, 2, 3):
        for i, t in enumerate(base_ttft):
            fast = turn >= 2
            recs.append(_rec("kvboost", turn, t * turn / (4 if fast else 1), conv=f"c{i}",
                             reuse_ratio=0.75 if fast else 0.0, exact_ratio=0.5 if fast else 0.0,
                             content_ratio=0.25 if fast else 0.0, recompute_ratio=0.1 if fast else 0.0,
                             greedy_match=(i != 3), first_token_kl=0.001 * (i + 1),
                             first_divergence=(7 if i == 3 and turn == 3 else None)))
    for turn in (1, 2):
        for i, t in enumerate(base_ttft):
            r = _rec("hf_prefix", turn, t * turn / 2, conv=f"c{i}", reuse_ratio=0.5 if turn == 2 else 0.0)
            del r["store_ms"], r["decode_tok_s"]  # missing optional fields
            if i == 0:
                r["reuse_ratio"] = float("nan")  # an unmeasured value is skipped, not averaged
            recs.append(r)
    return recs


def test_percentile_linear_interpolation():
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile([5], 90) == 5
    assert percentile([], 50) is None
    np = pytest.importorskip("numpy")
    xs = np.random.default_rng(0).random(37).tolist()
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))


def test_summary_per_turn_values(records):
    s = summarize(records)
    base = s["modes"]["baseline"]["by_turn"]
    assert list(base) == ["1", "2", "3"]
    assert base["1"]["ttft_ms_p50"] == pytest.approx(250.0)
    assert base["1"]["ttft_ms_p90"] == pytest.approx(370.0)
    assert base["2"]["ttft_ms_p50"] == pytest.approx(500.0)
    assert base["2"]["ttft_ms_mean"] == pytest.approx(500.0)
    assert base["1"]["total_ms_p50"] == pytest.approx(350.0)
    assert base["3"]["prompt_tokens_mean"] == pytest.approx(300.0)
    assert base["1"]["n"] == 4
    assert base["2"]["speedup_vs_baseline_p50"] == pytest.approx(1.0)

    kv = s["modes"]["kvboost"]["by_turn"]
    assert kv["1"]["speedup_vs_baseline_p50"] == pytest.approx(1.0)
    assert kv["2"]["speedup_vs_baseline_p50"] == pytest.approx(4.0)
    assert kv["3"]["speedup_vs_baseline_p50"] == pytest.approx(4.0)
    assert kv["2"]["reuse_ratio"] == pytest.approx(0.75)
    assert kv["2"]["exact_ratio"] == pytest.approx(0.5)
    assert kv["2"]["content_ratio"] == pytest.approx(0.25)
    assert kv["3"]["recompute_ratio"] == pytest.approx(0.1)
    assert kv["2"]["store_ms_p50"] == pytest.approx(2.0)
    assert kv["2"]["greedy_match_rate"] == pytest.approx(0.75)


def test_summary_overall(records):
    s = summarize(records)
    kv = s["modes"]["kvboost"]["overall"]
    assert kv["n"] == 12
    assert kv["reuse_ratio"] == pytest.approx(0.5)  # (0 + 0.75 + 0.75) / 3
    assert kv["reuse_ratio_turns_ge2"] == pytest.approx(0.75)
    base_all = sorted(t * turn for turn in (1, 2, 3) for t in (100, 200, 300, 400))
    kv_all = sorted(t * turn / (4 if turn >= 2 else 1) for turn in (1, 2, 3) for t in (100, 200, 300, 400))
    assert s["modes"]["baseline"]["overall"]["ttft_ms_p50"] == pytest.approx(percentile(base_all, 50))
    assert kv["speedup_vs_baseline_p50"] == pytest.approx(percentile(base_all, 50) / percentile(kv_all, 50))


def test_missing_turns_and_fields(records):
    s = summarize(records)
    hf = s["modes"]["hf_prefix"]
    assert list(hf["by_turn"]) == ["1", "2"]
    assert hf["by_turn"]["2"]["speedup_vs_baseline_p50"] == pytest.approx(2.0)
    assert hf["by_turn"]["2"]["store_ms_p50"] is None
    assert hf["by_turn"]["2"]["decode_tok_s_p50"] is None
    assert hf["by_turn"]["2"]["reuse_ratio"] == pytest.approx(0.5)  # the NaN record is skipped
    assert hf["by_turn"]["2"]["n"] == 4
    # overall speedup only over the turns the baseline also has (1 and 2), here exactly 2x
    assert hf["overall"]["speedup_vs_baseline_p50"] == pytest.approx(2.0)
    assert "hf_prefix" not in s["quality"] and "baseline" not in s["quality"]

    # a turn the baseline lacks has no speedup; a run without the baseline has none at all
    extra = records + [_rec("kvboost", 4, 10.0)]
    assert summarize(extra)["modes"]["kvboost"]["by_turn"]["4"]["speedup_vs_baseline_p50"] is None
    no_base = summarize([r for r in records if r["mode"] != "baseline"])
    assert no_base["modes"]["kvboost"]["overall"]["speedup_vs_baseline_p50"] is None


def test_quality_aggregates(records):
    q = summarize(records)["quality"]["kvboost"]
    assert q["n"] == 12
    assert q["greedy_match_rate"] == pytest.approx(0.75)
    assert q["first_token_kl_max"] == pytest.approx(0.004)
    assert q["first_token_kl_mean"] == pytest.approx(0.0025)
    assert q["first_divergence_min"] == 7
    assert q["n_diverged"] == 1
    none_diverged = summarize([_rec("x", 1, 1.0, greedy_match=True, first_divergence=None)])["quality"]["x"]
    assert none_diverged["first_divergence_min"] is None and none_diverged["n_diverged"] == 0


def test_records_round_trip(tmp_path, records):
    path = write_records(records[:5], tmp_path / "records.jsonl")
    write_records(records[5:], path, append=True)
    back = read_records(path)
    assert len(back) == len(records)
    assert back[0] == records[0]
    nan_rec = next(r for r in back if r["mode"] == "hf_prefix" and r["conversation_id"] == "c0")
    assert nan_rec["reuse_ratio"] is None  # NaN is not JSON; it becomes null and is skipped when summarizing
    assert summarize(back)["modes"]["hf_prefix"]["by_turn"]["2"]["reuse_ratio"] == pytest.approx(0.5)

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"mode": "a", "turn": 1}\n{"mode": \n')
    with pytest.raises(ValueError, match=":2:"):
        read_records(bad)


def test_write_summary_is_strict_json_in_turn_order(tmp_path):
    recs = [_rec("baseline", t, 10.0 * t) for t in (1, 2, 10)]
    path = write_summary(summarize(recs), tmp_path / "summary.json")
    text = path.read_text()
    loaded = json.loads(text)
    assert list(loaded["modes"]["baseline"]["by_turn"]) == ["1", "2", "10"]
    assert "NaN" not in text


def test_format_table(records):
    table = format_table(summarize(records))
    lines = table.splitlines()
    assert "p50 [p10-p90]" in lines[0] and "95% paired bootstrap" in lines[1]  # which statistic is shown
    group = next(line for line in lines if "baseline" in line and "|" in line)
    for mode in ("baseline", "kvboost", "hf_prefix"):
        assert mode in group
    assert group.index("baseline") < group.index("kvboost")  # baseline first
    assert any("greedy match" in line for line in lines)
    assert sum(line.startswith("overall") for line in lines) == 2  # main table and reuse/quality table
    row1 = next(line for line in lines if line.startswith("1 "))
    assert "250 [130-370]" in row1  # baseline turn 1: p50 [p10-p90]
    row2 = next(line for line in lines if line.startswith("2 "))
    assert "500 [260-740]" in row2 and "4.00x (4.00-4.00)" in row2  # kvboost: exactly 4x on every request
    reuse_row2 = [line for line in lines if line.startswith("2 ")][1]
    assert "75.0%" in reuse_row2
    row3 = next(line for line in lines if line.startswith("3 "))
    assert " - " in row3  # hf_prefix has no turn 3
    # the rows of each table line up
    main_rows = lines[lines.index(next(line for line in lines if line.startswith("turn"))):]
    first_table = main_rows[:main_rows.index("")]
    assert len({len(line) for line in first_table}) == 1
    assert any(line.startswith("kvboost:") and "first divergence min 7" in line for line in lines)


def test_format_table_four_modes_fits_and_shows_accuracy_and_split(four_modes):
    table = format_table(summarize(four_modes, reference_modes=("kvboost_cold",), n_boot=200))
    lines = table.splitlines()
    assert max(len(line) for line in lines) <= 160
    assert "kvboost: accuracy 50.0% (2 of 4 requests correct)" in lines
    assert "baseline: accuracy 75.0% (3 of 4 requests correct)" in lines
    split = next(line for line in lines if line.startswith("kvboost: 5.00x"))
    assert "engine path 1.25x" in split and "reuse 4.00x" in split and "n=4" in split
    assert any("answer log-prob delta mean -0.25" in line for line in lines)
    assert not any(line.startswith("1 ") for line in lines)  # single turn: only the overall row
    overall = next(line for line in lines if line.startswith("overall"))
    assert "52.5 [27.3-77.7]  5.00x (5.00-5.00)" in overall  # kvboost: medians of repeats = 1.05x repeat 0


def test_plots_are_written(tmp_path, records):
    paths = plot_summary(summarize(records), tmp_path / "plots")
    assert [p.name for p in paths] == ["ttft_by_turn.png", "reuse_by_turn.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_single_turn_plot_is_by_mode(tmp_path, four_modes):
    paths = plot_summary(summarize(four_modes, reference_modes=("kvboost_cold",), n_boot=50), tmp_path)
    assert [p.name for p in paths] == ["ttft_by_mode.png"]
    data = paths[0].read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert not (tmp_path / "ttft_by_turn.png").exists()


def test_empty_records_summarize_cleanly(tmp_path):
    s = summarize([])
    assert s["modes"] == {} and s["quality"] == {}
    assert format_table(s) == "(no records)"
    assert all(p.exists() for p in plot_summary(s, tmp_path))


# --------------------------------------------------------------------- repeats, pairing, bootstrap, split
@pytest.fixture
def four_modes():
    """A single-turn workload with known answers, four modes, two repeats per request.

    Per request q0..q3 the TTFT of repeat 0: baseline 100..400, kvboost_cold 0.8x, kvboost 0.2x, hf_prefix
    0.5x; repeat 1 is 10% slower (medians of two repeats: 1.05x). Accuracy: baseline 3 of 4, kvboost 2 of 4
    at repeat 0 (repeat 1 says all correct and must be ignored)."""
    recs = []
    factor = {"baseline": 1.0, "kvboost_cold": 0.8, "kvboost": 0.2, "hf_prefix": 0.5}
    for i, t in enumerate([100.0, 200.0, 300.0, 400.0]):
        for repeat in (0, 1):
            for mode, f in factor.items():
                r = _rec(mode, 1, t * f * (1.1 if repeat else 1.0), conv=f"q{i}", request_id=f"q{i}", repeat=repeat,
                         reuse_ratio=0.9 if mode in ("kvboost", "hf_prefix") else 0.0)
                if mode == "baseline" and repeat == 0:
                    r["correct"] = i != 3
                if mode == "kvboost":
                    r["correct"] = (i % 2 == 0) if repeat == 0 else True
                    r["answer_logprob_delta"] = -0.1 * (i + 1) if repeat == 0 else -100.0
                    r["greedy_match"] = repeat == 0
                recs.append(r)
    return recs


def test_accuracy_and_speedup_split_exact(four_modes):
    s = summarize(four_modes, reference_modes=("kvboost_cold",), n_boot=300, seed=3)
    assert s["accuracy"] == {"baseline": {"accuracy": 0.75, "n_correct": 3, "n": 4},
                             "kvboost": {"accuracy": 0.5, "n_correct": 2, "n": 4}}
    assert s["reference_modes"] == ["kvboost_cold"]
    # medians over repeats scale every request by 1.05: the ratios are exact
    kv = s["modes"]["kvboost"]["overall"]
    assert kv["speedup_vs_baseline_p50"] == pytest.approx(5.0)
    assert kv["speedup_vs_kvboost_cold_p50"] == pytest.approx(4.0)
    assert kv["speedup_vs_baseline_ci95"] == pytest.approx([5.0, 5.0])
    assert s["modes"]["baseline"]["overall"]["speedup_vs_kvboost_cold_p50"] == pytest.approx(0.8)
    assert s["modes"]["kvboost_cold"]["by_turn"]["1"]["speedup_vs_kvboost_cold_p50"] == pytest.approx(1.0)
    split = s["speedup_split"]
    assert set(split) == {"kvboost", "hf_prefix"}  # not the baseline, not the reference itself
    assert split["kvboost"]["engine_path"] == pytest.approx(1.25)
    assert split["kvboost"]["reuse"] == pytest.approx(4.0)
    assert split["kvboost"]["total"] == pytest.approx(5.0)
    assert split["kvboost"]["n"] == 4
    assert split["kvboost"]["reuse_ci95"] == pytest.approx([4.0, 4.0])
    assert split["hf_prefix"]["reuse"] == pytest.approx(1.6)
    # quality and accuracy from repeat 0 only
    q = s["quality"]["kvboost"]
    assert q["answer_logprob_delta_mean"] == pytest.approx(-0.25)
    assert q["greedy_match_rate"] == pytest.approx(1.0)
    assert q["n"] == 4
    assert kv["accuracy"] == pytest.approx(0.5)
    assert kv["greedy_match_rate"] == pytest.approx(1.0)
    # without a reference mode: no split, no reference keys
    plain = summarize(four_modes, n_boot=0)
    assert plain["speedup_split"] == {} and "speedup_vs_kvboost_cold_p50" not in plain["modes"]["kvboost"]["overall"]
    assert plain["modes"]["kvboost"]["overall"]["speedup_vs_baseline_ci95"] is None


def test_repeats_collapse_to_per_request_medians():
    recs = []
    for i, base in enumerate([100.0, 200.0, 300.0]):
        for repeat, jitter in enumerate([1.0, 3.0, 1.1]):  # a slow outlier repeat: the median ignores it
            recs.append(_rec("baseline", 1, base * jitter, conv=f"c{i}", repeat=repeat))
    s = summarize(recs, n_boot=0)["modes"]["baseline"]["overall"]
    assert s["n"] == 3 and s["n_records"] == 9
    assert s["ttft_ms_p50"] == pytest.approx(220.0)  # medians 110, 220, 330
    assert s["ttft_ms_p10"] == pytest.approx(132.0)
    assert s["ttft_ms_p90"] == pytest.approx(308.0)
    assert s["ttft_ms_mean"] == pytest.approx(220.0)
    assert s["total_ms_p50"] == pytest.approx(320.0)
    # the same requests without repeat fields are separate requests only if their ids differ: old records
    # (no request_id, no repeat) with the same conversation and turn are repeats of one request
    old = [_rec("baseline", 1, t, conv="c0") for t in (10.0, 30.0, 20.0)]
    o = summarize(old, n_boot=0)["modes"]["baseline"]["overall"]
    assert o["n"] == 1 and o["n_records"] == 3 and o["ttft_ms_p50"] == pytest.approx(20.0)


def test_speedup_pairs_common_requests():
    base = [10, 20, 30, 40, 1000, 2000]
    recs = [_rec("baseline", 1, t, conv=f"q{i}", request_id=f"q{i}") for i, t in enumerate(base)]
    # the mode served only q0..q3, each exactly twice as fast: an unpaired ratio would be far above 2
    recs += [_rec("fast", 1, t / 2, conv=f"q{i}", request_id=f"q{i}") for i, t in enumerate([10, 20, 30, 40])]
    s = summarize(recs, n_boot=200)
    fast = s["modes"]["fast"]
    assert fast["overall"]["speedup_vs_baseline_p50"] == pytest.approx(2.0)
    assert fast["overall"]["speedup_vs_baseline_ci95"] == pytest.approx([2.0, 2.0])
    assert fast["by_turn"]["1"]["speedup_vs_baseline_p50"] == pytest.approx(2.0)
    assert fast["overall"]["n"] == 4
    assert s["modes"]["baseline"]["overall"]["n"] == 6
    # a request the baseline lacks is not compared; requests with no common ones give None
    lone = summarize([_rec("baseline", 1, 5.0, request_id="a"), _rec("x", 1, 1.0, request_id="b")], n_boot=50)
    assert lone["modes"]["x"]["overall"]["speedup_vs_baseline_p50"] is None
    assert lone["modes"]["x"]["overall"]["speedup_vs_baseline_ci95"] is None


def test_request_with_two_turns_is_an_error():
    with pytest.raises(ValueError, match="'r1'.*turns 1 and 2"):
        summarize([_rec("baseline", 1, 1.0, request_id="r1"), _rec("baseline", 2, 1.0, request_id="r1")])


def test_bootstrap_ci_contains_estimate_and_narrows():
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(1)

    def sample(n):
        base = rng.lognormal(6.0, 0.6, n)
        mode = base / 3.0 * rng.lognormal(0.0, 0.3, n)  # about 3x faster, noisy per request
        return base.tolist(), mode.tolist()

    widths = []
    for n in (12, 400):
        base, mode = sample(n)
        point = percentile(base, 50) / percentile(mode, 50)
        lo, hi = bootstrap_ratio_ci(base, mode, n_boot=2000, seed=0)
        assert lo <= point <= hi
        assert 1.5 < lo and hi < 6.0
        widths.append(hi - lo)
        # seeded: the same interval again; through summarize the same numbers as called directly
        assert bootstrap_ratio_ci(base, mode, n_boot=2000, seed=0) == [lo, hi]
        recs = [_rec("baseline", 1, b, request_id=f"r{i}") for i, b in enumerate(base)]
        recs += [_rec("m", 1, m, request_id=f"r{i}") for i, m in enumerate(mode)]
        s = summarize(recs, seed=0)["modes"]["m"]["overall"]
        assert s["speedup_vs_baseline_p50"] == pytest.approx(point)
        assert s["speedup_vs_baseline_ci95"] == pytest.approx([lo, hi])
    assert widths[1] < widths[0] / 2  # about 1/sqrt(n): much narrower with 33x the requests
    assert bootstrap_ratio_ci([], []) is None
    assert bootstrap_ratio_ci([1.0], [2.0]) == pytest.approx([0.5, 0.5])
    with pytest.raises(ValueError, match="differ in length"):
        bootstrap_ratio_ci([1.0, 2.0], [1.0])


def test_speculative_totals_only_for_drafting_modes():
    spec = {"speculative": "prompt_lookup", "target_forwards": 5}
    recs = [
        _rec("baseline", 1, 100.0, conv="a"),
        _rec("kvboost", 1, 50.0, conv="a", drafted_tokens=10, accepted_tokens=6, **spec),  # 16 tokens: 15 after
        _rec("kvboost", 1, 50.0, conv="b", drafted_tokens=0, accepted_tokens=0, **spec),
        _rec("baseline", 1, 100.0, conv="b"),
    ]
    summary = summarize(recs, n_boot=0)
    assert set(summary["speculative"]) == {"kvboost"}
    s = summary["speculative"]["kvboost"]
    assert (s["drafted_tokens"], s["accepted_tokens"], s["target_forwards"], s["n"]) == (10, 6, 10, 2)
    assert s["acceptance_rate"] == pytest.approx(0.6)
    assert s["tokens_per_target_forward"] == pytest.approx(30 / 10)
    assert "speculative" not in summarize([_rec("baseline", 1, 100.0)], n_boot=0)
