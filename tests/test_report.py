"""Results aggregation on synthetic records with known answers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the experiments/ runner is not an installed package
    sys.path.insert(0, str(ROOT))

from experiments.report import (  # noqa: E402
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
    for mode in ("baseline", "kvboost", "hf_prefix"):
        assert mode in lines[0]
    assert lines[0].index("baseline") < lines[0].index("kvboost")  # baseline first
    assert "greedy match" in lines[0]
    assert any(line.startswith("overall") for line in lines)
    row2 = next(line for line in lines if line.startswith("2 "))
    assert "4.00x" in row2 and "75.0%" in row2
    row3 = next(line for line in lines if line.startswith("3 "))
    assert " - " in row3  # hf_prefix has no turn 3
    # the table rows line up
    assert len({len(line) for line in lines[1:] if "|" in line}) == 1
    assert any(line.startswith("kvboost:") and "first divergence min 7" in line for line in lines)


def test_plots_are_written(tmp_path, records):
    paths = plot_summary(summarize(records), tmp_path / "plots")
    assert [p.name for p in paths] == ["ttft_by_turn.png", "reuse_by_turn.png"]
    for p in paths:
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_empty_records_summarize_cleanly(tmp_path):
    s = summarize([])
    assert s["modes"] == {} and s["quality"] == {}
    assert format_table(s) == "(no records)"
    assert all(p.exists() for p in plot_summary(s, tmp_path))
