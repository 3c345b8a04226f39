"""Comparison across runs (kvboost/lab/compare.py) on fake run folders with known numbers."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the experiments/ runner is not an installed package
    sys.path.insert(0, str(ROOT))

from kvboost.lab.compare import CompareError, SummaryWarning, compare, find_summaries, main  # noqa: E402
from kvboost.lab.report import summarize, write_summary  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _stats(p50, p10, p90, **extra):
    return {"ttft_ms_p50": p50, "ttft_ms_p10": p10, "ttft_ms_p90": p90, "n": 4, **extra}


def _summary(kv_p50, speedup, ci, cold_speedup, reuse, kl, acc, turns=(1, 2)):
    """A small summary as summarize() writes it: baseline, kvboost_cold and kvboost over ``turns``."""
    def mode(scale, **overall):
        by_turn = {str(t): _stats(scale * t, scale * t * 0.8, scale * t * 1.2, reuse_ratio=reuse * (t > 1))
                   for t in turns}
        return {"by_turn": by_turn, "overall": _stats(scale, scale * 0.7, scale * 1.5, **overall)}

    return {
        "modes": {
            "baseline": mode(kv_p50 * speedup, speedup_vs_baseline_p50=1.0),
            "kvboost_cold": mode(kv_p50 * cold_speedup),
            "kvboost": mode(kv_p50, speedup_vs_baseline_p50=speedup, speedup_vs_baseline_ci95=ci,
                            speedup_vs_kvboost_cold_p50=cold_speedup, speedup_vs_kvboost_cold_ci95=None,
                            reuse_ratio=reuse, exact_ratio=reuse / 2, content_ratio=reuse / 2, recompute_ratio=0.1),
        },
        "quality": {"kvboost": {"greedy_match_rate": 0.75, "first_token_kl_mean": kl, "first_token_kl_max": 2 * kl,
                                "answer_logprob_delta_mean": -kl, "n": 4}},
        "accuracy": {"baseline": {"accuracy": 0.75, "n_correct": 3, "n": 4},
                     "kvboost": {"accuracy": acc, "n_correct": int(acc * 4), "n": 4}},
        "speedup_split": {},
        "baseline_mode": "baseline",
        "reference_modes": ["kvboost_cold"],
        "bootstrap": {"resamples": 2000, "seed": 0, "confidence": 0.95},
    }


def _write_run(folder: Path, summary, overrides=None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(summary))
    if overrides is not None:
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
        (folder / ".hydra" / "config.yaml").write_text("seed: 0\n")
    return folder


@pytest.fixture
def sweep(tmp_path):
    """A Hydra multirun folder with two jobs (and a stray non-run folder)."""
    root = tmp_path / "multirun" / "2025-01-01" / "12-00-00"
    _write_run(root / "0_recompute=none", _summary(50.0, 4.0, [3.5, 4.5], 3.2, 0.8, 0.02, 0.5),
               ["workload=rag_reorder", "recompute=none"])
    _write_run(root / "1_recompute=full", _summary(160.0, 1.25, [1.2, 1.3], 1.0, 0.8, 0.0, 0.75),
               ["workload=rag_reorder", "recompute=full"])
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_compare_sweep_rows_values_and_plots(sweep, tmp_path):
    out = tmp_path / "cmp"
    result = compare([sweep], out)
    assert [r.label for r in result["runs"]] == ["recompute=none", "recompute=full"]  # shared override dropped

    rows = _csv_rows(out / "comparison.csv")
    assert [r["run"] for r in rows] == ["recompute=none", "recompute=full"]
    none, full = rows
    assert none["overrides"] == "workload=rag_reorder recompute=none"
    assert float(none["ttft_ms_p50"]) == pytest.approx(50.0)
    assert float(none["ttft_ms_p10"]) == pytest.approx(35.0)
    assert float(none["ttft_ms_p50_turn1"]) == pytest.approx(50.0)
    assert float(none["ttft_ms_p50_turn2"]) == pytest.approx(100.0)
    assert float(none["speedup_vs_baseline"]) == pytest.approx(4.0)
    assert float(none["speedup_vs_baseline_ci_lo"]) == pytest.approx(3.5)
    assert float(none["speedup_vs_baseline_ci_hi"]) == pytest.approx(4.5)
    assert float(none["speedup_vs_kvboost_cold"]) == pytest.approx(3.2)
    assert none["speedup_vs_kvboost_cold_ci_lo"] == ""  # not measured: empty, not 0
    assert float(none["baseline_ttft_ms_p50"]) == pytest.approx(200.0)
    assert float(none["reuse_ratio"]) == pytest.approx(0.8)
    assert float(none["content_ratio"]) == pytest.approx(0.4)
    assert float(none["recompute_ratio"]) == pytest.approx(0.1)
    assert float(none["reuse_ratio_turn2"]) == pytest.approx(0.8)
    assert float(none["greedy_match_rate"]) == pytest.approx(0.75)
    assert float(none["first_token_kl_mean"]) == pytest.approx(0.02)
    assert float(none["answer_logprob_delta_mean"]) == pytest.approx(-0.02)
    assert float(none["accuracy_baseline"]) == pytest.approx(0.75)
    assert float(none["accuracy_kvboost"]) == pytest.approx(0.5)
    assert float(full["accuracy_kvboost"]) == pytest.approx(0.75)
    assert float(full["speedup_vs_baseline"]) == pytest.approx(1.25)

    md = (out / "comparison.md").read_text()
    table = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| ---")]
    assert len(table) == 3  # header + one row per run
    assert "workload=rag_reorder" in md.split("|")[0]  # shared overrides listed once, above the table
    row = next(line for line in table if line.startswith("| recompute=none "))
    for cell in ("50.0 [35.0-75.0]", "4.00x (3.50-4.50)", "3.20x", "80.0%", "75.0%", "50.0%", "0.02"):
        assert cell in row
    assert "| turn 1 | turn 2 |" in table[0]

    for name in ("ttft_by_turn.png", "reuse_by_turn.png", "quality_vs_ttft.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG and len(data) > 5000
    assert {p.name for p in result["paths"]} == {"comparison.md", "comparison.csv", "ttft_by_turn.png",
                                                   "reuse_by_turn.png", "quality_vs_ttft.png"}


def test_compare_run_folders_without_overrides(tmp_path):
    a = _write_run(tmp_path / "runs" / "3_chunker.chunk_size=32",
                   _summary(10.0, 2.0, None, 1.5, 0.5, 0.1, 0.5, turns=(1,)))
    b = _write_run(tmp_path / "runs" / "plain", _summary(20.0, 1.0, None, 1.0, 0.0, 0.0, 0.5, turns=(1,)))
    out = tmp_path / "out"
    result = compare([a, b / "summary.json"], out, x="speedup")  # a run folder and a summary file
    assert [r.label for r in result["runs"]] == ["chunker.chunk_size=32", "plain"]
    rows = _csv_rows(out / "comparison.csv")
    assert len(rows) == 2 and rows[0]["speedup_vs_baseline_ci_lo"] == ""
    # single-turn runs: per-run bars instead of by-turn lines, no turn columns in the Markdown table
    names = {p.name for p in result["paths"]}
    assert {"ttft_by_run.png", "reuse_by_run.png", "quality_vs_ttft.png"} <= names
    assert "turn 1" not in (out / "comparison.md").read_text()


def test_compare_real_summaries_and_cli(tmp_path, capsys):
    """Summaries written by report.summarize/write_summary: the key names the runner produces."""
    sweep = tmp_path / "sweep"
    for job, (name, factor) in enumerate((("none", 0.2), ("full", 0.9))):
        recs = []
        for i, t in enumerate((100.0, 200.0, 300.0, 400.0)):
            for mode, f in (("baseline", 1.0), ("kvboost_cold", 0.95), ("kvboost", factor)):
                r = {"request_id": f"q{i}", "conversation_id": f"q{i}", "turn": 1, "mode": mode, "repeat": 0,
                     "ttft_ms": t * f, "reuse_ratio": 0.9 if mode == "kvboost" else 0.0}
                if mode == "kvboost":
                    r.update(greedy_match=True, first_token_kl=0.01 * factor, correct=i < 2 + job)
                recs.append(r)
        folder = sweep / f"{job}_recompute={name}"
        write_summary(summarize(recs, reference_modes=("kvboost_cold",), n_boot=100), folder / "summary.json")
        (folder / ".hydra").mkdir()
        (folder / ".hydra" / "overrides.yaml").write_text(f"- recompute={name}\n")

    assert main([str(sweep)]) == 0  # default output folder: the one DIR given
    printed = capsys.readouterr().out
    assert "recompute=none" in printed and "wrote" in printed
    rows = _csv_rows(sweep / "comparison.csv")
    assert [r["run"] for r in rows] == ["recompute=none", "recompute=full"]
    assert float(rows[0]["speedup_vs_baseline"]) == pytest.approx(5.0)
    assert float(rows[0]["speedup_vs_kvboost_cold"]) == pytest.approx(4.75)
    assert float(rows[0]["speedup_vs_baseline_ci_lo"]) == pytest.approx(5.0)
    assert float(rows[1]["accuracy_kvboost"]) == pytest.approx(0.75)
    assert float(rows[0]["first_token_kl_mean"]) == pytest.approx(0.002)
    assert (sweep / "quality_vs_ttft.png").read_bytes()[:8] == PNG
    # the comparison's own outputs are not mistaken for runs on a second pass
    assert len(find_summaries([sweep])) == 2


def test_errors_name_the_folder(tmp_path, sweep, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CompareError, match="empty: no summary.json"):
        compare([empty])
    with pytest.raises(CompareError, match="missing: no such file"):
        compare([tmp_path / "missing"])
    with pytest.raises(CompareError, match="mode 'nope' is in none of the runs.*kvboost"):
        compare([sweep], tmp_path / "o", mode="nope")

    assert main([str(empty), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "error" in err and str(empty) in err


def test_corrupt_summary_is_skipped_with_a_warning(tmp_path, sweep, capsys):
    bad = sweep / "2_recompute=selective"
    bad.mkdir()
    (bad / "summary.json").write_text('{"modes": {"kvboost": ')
    odd = sweep / "3_recompute=oracle"
    odd.mkdir()
    (odd / "summary.json").write_text("[1, 2]")
    with pytest.warns(SummaryWarning) as caught:
        result = compare([sweep], tmp_path / "o")
    assert any("2_recompute=selective" in str(w.message) and "not readable JSON" in str(w.message) for w in caught)
    assert any("3_recompute=oracle" in str(w.message) and "not a run summary" in str(w.message) for w in caught)
    assert len(result["runs"]) == 2

    assert main([str(sweep), "--out", str(tmp_path / "o2")]) == 0
    err = capsys.readouterr().err
    assert "warning: skipping" in err and str(bad / "summary.json") in err

    only_bad = tmp_path / "only_bad"
    only_bad.mkdir()
    (only_bad / "summary.json").write_text("not json")
    with pytest.warns(SummaryWarning), pytest.raises(CompareError, match="no readable summary.json"):
        compare([only_bad])
