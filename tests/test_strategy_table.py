"""The strategy leaderboard (experiments/bench/strategy_table.py): its statistics and tables on synthetic records,
its spec parsing, and a tiny end-to-end run (``model=tiny_random``) over two workloads."""

from __future__ import annotations

import json
from typing import ClassVar

import pytest

from experiments.bench import strategy_table as st
from kvboost.lab.report import paired_difference_ci, wilson_interval


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


def test_summarize_only_reads_the_old_tables_records(tmp_path):
    """records.jsonl of the rag_reorder-only table (no model / workload / score fields) still summarize."""
    with open(tmp_path / "records.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _records())
    st.main(["--out", str(tmp_path), "--summarize-only"])
    saved = json.loads((tmp_path / "summary.json").read_text())
    cell = saved["cells"]["rag_reorder__model"]
    assert cell["summary"]["arms"]["none"]["pooled"]["correct"] == 14
    assert (tmp_path / "rag_reorder__model.md").read_text().startswith("# Content-reuse strategies on rag_reorder")
    assert (tmp_path / "rag_reorder__model.png").stat().st_size > 0 and (tmp_path / "summary.md").exists()


def test_existing_records_are_not_overwritten(tmp_path):
    (tmp_path / "records.jsonl").write_text("{}\n")
    with pytest.raises(SystemExit, match="--append"):
        st.main(
            ["--out", str(tmp_path), "--queries", "1", "--draws", "0", "--strategies", "none", "--model", "tiny_random"]
        )


# ------------------------------------------------------------------------------------------------ specs


def test_strategy_overrides_old_and_new_forms():
    assert st.strategy_overrides("none") == ["recompute=none"]
    assert st.strategy_overrides("cacheblend:0.3") == ["recompute=cacheblend", "recompute.ratio=0.3"]
    assert st.strategy_overrides("cacheblend:ratio=0.15,check_layers=[1]") == [
        "recompute=cacheblend", "recompute.ratio=0.15", "recompute.check_layers=[1]"]  # fmt: skip
    # commas inside brackets belong to the value; nested fields are dotted
    assert st.strategy_overrides("cacheblend:check_layers=[1,2],ratios=[0.3, 0.15],ratio=0.1") == [
        "recompute=cacheblend", "recompute.check_layers=[1,2]", "recompute.ratios=[0.3, 0.15]",
        "recompute.ratio=0.1"]  # fmt: skip
    assert st.strategy_overrides("compose:first.k=8,second={name:query_aware,ratio:0.1},ratio=null") == [
        "recompute=compose", "recompute.first.k=8", "recompute.second={name:query_aware,ratio:0.1}",
        "recompute.ratio=null"]  # fmt: skip
    spec = st.parse_spec("epic:k=32")
    assert spec.label == "epic:k=32" and spec.get("k") == "32" and spec.get("ratio") is None
    assert st.parse_spec("rag_reorder:question_after", "workload").fields == (("layout", "question_after"),)


@pytest.mark.parametrize(
    "spec, message",
    [
        (":0.3", "no name"),
        ("cacheblend:x", "the ratio 'x' is not a number"),
        ("cacheblend:1.5", r"must be in \(0, 1\]"),
        ("cacheblend:0", r"must be in \(0, 1\]"),
        ("cacheblend:ratio=abc", "the ratio 'abc' is not a number"),
        ("cacheblend:", "nothing after ':'"),
        ("cacheblend:ratio=0.1,", "an empty field"),
        ("cacheblend:ratio=0.1,check_layers", "is not key=value"),
        ("cacheblend:ratio=", "no value for 'ratio'"),
        ("cacheblend:check_layers=[1,2", "unbalanced"),
        ("cacheblend:check_layers=1]", "unbalanced"),
        ("cacheblend:ratio=0.1,ratio=0.2", "set twice"),
        ("cacheblend:1x=2", "not a field name"),
        ("cache blend", "not a config name"),
    ],
)
def test_bad_specs_fail_naming_the_spec(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        st.strategy_overrides(spec)
    assert repr(spec.strip()) in str(info.value) or repr(spec) in str(info.value)


def test_bad_spec_on_the_command_line_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        st.main(["--out", str(tmp_path), "--strategies", "cacheblend:ratio=0.1,", "--model", "tiny_random"])
    assert "an empty field" in capsys.readouterr().err
    assert not (tmp_path / "records.jsonl").exists()


@pytest.mark.parametrize("spec, message", [("no_such_strategy", "no_such_strategy"),
                                           ("cacheblend:no_such_field=1", "no_such_field")])  # fmt: skip
def test_an_unknown_strategy_or_field_fails_before_the_model_loads(spec, message, tmp_path, monkeypatch):
    from kvboost.lab import runner

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the strategies were checked")

    monkeypatch.setattr(runner, "build_engine", no_model)
    with pytest.raises(SystemExit, match=message) as info:
        st.main(["--out", str(tmp_path), "--model", "tiny_random", "--workloads", "needle", "--strategies", "none",
                 spec])  # fmt: skip
    assert f"strategy {spec!r}" in str(info.value)


def test_ctrl_c_writes_the_tables_of_what_finished(tmp_path, monkeypatch):
    def interrupted(model, cfgs, workloads, arms, strategies, args, records_path, info):
        assert [a.label for a in arms] == ["none", "cacheblend:ratio=0.2"] and not arms[1].query_aware
        with open(records_path, "a") as f:
            f.writelines(json.dumps({**r, "model": model}) + "\n" for r in _records())
        info["dtype"] = "float32"
        raise KeyboardInterrupt

    monkeypatch.setattr(st, "_run_model", interrupted)
    st.main(["--out", str(tmp_path), "--model", "tiny_random", "qwen_coder_0_5b", "--workloads", "needle",
             "--strategies", "none", "cacheblend", "--ratios", "0.2"])  # fmt: skip
    meta = json.loads((tmp_path / "summary.json").read_text())["meta"]
    assert meta["interrupted"] == "tiny_random" and list(meta["models"]) == ["tiny_random"]
    assert "Interrupted during tiny_random" in (tmp_path / "summary.md").read_text()
    assert "(float32)" in (tmp_path / "rag_reorder__tiny_random.md").read_text()


def test_ratio_driven_strategies_cross_the_ratios():
    has_ratio = {"cacheblend", "query_aware", "compose"}.__contains__
    specs = st.expand_strategies(["none", "cacheblend", "cacheblend:0.3", "query_aware:heads=mean", "epic:k=8",
                                  "compose"], [0.1, 0.3], lambda s: has_ratio(s.name))  # fmt: skip
    assert [s.label for s in specs] == [
        "none", "cacheblend:ratio=0.1", "cacheblend:ratio=0.3", "query_aware:heads=mean,ratio=0.1",
        "query_aware:heads=mean,ratio=0.3", "epic:k=8", "compose:ratio=0.1", "compose:ratio=0.3"]  # fmt: skip
    # the old form's cacheblend:0.3 is the crossed cacheblend:ratio=0.3: one arm
    assert st.parse_spec("cacheblend:0.3") == st.parse_spec("cacheblend:ratio=0.3")


def test_workloads_expand_rag_reorder_to_both_layouts():
    specs = st.expand_workloads(["musique", "rag_reorder", "needle:context_tokens=2000", "rag_reorder:question_after"])
    assert [w.label for w in specs] == ["musique", "rag_reorder:layout=question_both",
                                        "rag_reorder:layout=question_after", "needle:context_tokens=2000"]  # fmt: skip
    # labels (records, tables, file names): the name and the layout; other fields stay in summary.json
    assert list(st.workload_labels(specs)) == ["musique", "rag_reorder:question_both", "rag_reorder:question_after",
                                               "needle"]  # fmt: skip
    assert st.cell_key("rag_reorder:question_after", "smollm2") == "rag_reorder-question_after__smollm2"
    with pytest.raises(ValueError, match="share the label 'needle'"):
        st.workload_labels(st.expand_workloads(["needle", "needle:context_tokens=2000"]))


def test_query_aware_follows_the_strategy_not_its_name():
    from kvboost.registry import RECOMPUTE

    aware = {n: st.is_query_aware(RECOMPUTE.build(n)) for n in
             ("none", "selective", "cacheblend", "epic", "key_temperature", "query_aware", "true_deviation", "full")}
    assert aware == {"none": False, "selective": False, "cacheblend": False, "epic": False, "key_temperature": False,
                     "query_aware": True, "true_deviation": True, "full": False}  # fmt: skip
    assert st.is_query_aware(RECOMPUTE.build({"name": "compose", "first": "epic", "second": "query_aware"}))
    assert not st.is_query_aware(RECOMPUTE.build({"name": "compose", "first": "epic", "second": "cacheblend"}))


# ------------------------------------------------------------------------------------- plot and verdicts


def _leaderboard_records():
    """One cell: baseline F1 0.5; cacheblend (agnostic) and query_aware (aware) at 0.1 / 0.3; epic; full."""
    arms = [("baseline", None, None, False, 1000.0, 0.5), ("none", "none", None, False, 100.0, 0.1),
            ("cacheblend:ratio=0.1", "cacheblend", 0.1, False, 300.0, 0.2),
            ("cacheblend:ratio=0.3", "cacheblend", 0.3, False, 500.0, 0.4),
            ("query_aware:ratio=0.1", "query_aware", 0.1, True, 350.0, 0.45),
            ("query_aware:ratio=0.3", "query_aware", 0.3, True, 600.0, 0.5),
            ("epic", "epic", None, False, 200.0, 0.3), ("full", "full", None, False, 1100.0, 0.5)]  # fmt: skip
    out = []
    for q in range(6):
        for i, (arm, name, ratio, aware, ttft, f1) in enumerate(arms):
            used = {"none": 0.0, "epic": 0.05, "full": 1.0}.get(arm, (ratio or 0.0) + 0.02)
            out.append({"model": "m", "workload": "musique", "arm": arm, "arm_index": i, "draw": 0, "query": f"q{q}",
                        "strategy": name or arm, "ratio": ratio, "query_aware": aware, "score_name": "f1",
                        "score": f1, "f1": f1, "correct": False, "ttft_ms": ttft, "recompute_ratio": used * 0.9,
                        "content_ratio": 0.9, "greedy_match": False, "first_token_kl": 0.1})  # fmt: skip
    return out


def test_plot_data_draws_query_aware_and_agnostic_strategies_apart():
    data = st.plot_data(st.summarize(_leaderboard_records()))
    assert set(data["query_agnostic"]) == {"none", "cacheblend", "epic"}
    assert set(data["query_aware"]) == {"query_aware"}
    assert [p["x"] for p in data["query_aware"]["query_aware"]] == [0.1, 0.3]
    assert [p["score"] for p in data["query_agnostic"]["cacheblend"]] == pytest.approx([0.2, 0.4])
    assert data["query_agnostic"]["epic"][0]["x"] == pytest.approx(0.05)  # no ratio: its measured fraction
    assert data["full_prefill"]["score"] == pytest.approx(0.5) and data["full_recompute"]["score"] == pytest.approx(0.5)


def test_verdicts_best_per_ratio_and_parity():
    summary = st.summarize(_leaderboard_records())
    v = st.verdicts(summary, [0.05, 0.1, 0.3])
    assert v["best_by_ratio"]["0.05"]["arm"] == "epic"  # only the strategies without a ratio fit 0.05
    assert v["best_by_ratio"]["0.1"]["arm"] == "query_aware:ratio=0.1"
    assert v["best_by_ratio"]["0.3"]["arm"] == "query_aware:ratio=0.3"
    # query_aware:0.1 is 0.05 below at 2.86x; query_aware:0.3 is at parity but only 1.67x: no parity at >= 2.5x
    assert not v["parity"]["met"] and v["parity"]["closest_fast"] == "query_aware:ratio=0.1"
    table = st.format_table(summary, {"workload": "musique", "model": "m", "command": "c", "queries": 6})
    assert "| query_aware:ratio=0.1 | query-aware |" in table and "| cacheblend:ratio=0.1 | query-agnostic |" in table
    assert "-0.050" in table and "token F1" in table
    # the full prefill at 0: every strategy "matches" it; no verdict rather than a vacuous yes
    floor = [{**r, "score": 0.0} for r in _leaderboard_records()]
    parity = st.verdicts(st.summarize(floor), [0.1])["parity"]
    assert parity["at_floor"] and not parity["met"] and "none" in parity["arms"]


def test_wandb_table_through_the_projects_logger(tmp_path, monkeypatch):
    """--logger wandb: one run, the leaderboard as a wandb.Table (all cells and one per cell), the plots."""
    import sys
    import types

    logged = {}

    class Run:
        dir = str(tmp_path / "wandb" / "offline-run" / "files")
        summary: ClassVar[dict] = {}

        def log(self, payload, step=None):
            logged.update(payload)

        def finish(self):
            logged["finished"] = True

    fake = types.SimpleNamespace(init=lambda **kw: Run(), teardown=lambda: None,
                                 Table=lambda columns, data: ("table", columns, data),
                                 Image=lambda path: ("image", path))  # fmt: skip
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    for k, v in vars(fake).items():
        setattr(sys.modules["wandb"], k, v)
    with open(tmp_path / "records.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in _leaderboard_records())
    st.main(["--out", str(tmp_path), "--summarize-only", "--logger", "wandb"])
    kind, columns, rows = logged["strategy_table"]
    assert kind == "table" and columns == list(st.WANDB_COLUMNS) and len(rows) == 8
    row = dict(zip(columns, rows[[r[3] for r in rows].index("query_aware:ratio=0.1")]))
    assert row["query_aware"] is True and row["score_diff"] == pytest.approx(-0.05) and row["ratio"] == 0.1
    assert logged["strategy_table/musique__m"][2] == rows and logged["plots/musique__m"][0] == "image"
    assert logged["finished"]


# ------------------------------------------------------------------------------------------- end to end

MUSIQUE = [
    {"question": f"Where was person {i} born?", "answers": [f"Town {i}", f"T{i}"],
     "ctxs": [{"title": f"Person {i}", "text": f"Person {i} was born in Town {i}. They later moved away."},
              {"title": "", "text": f"Town {i} is a small place near the coast, known for its harbour {i}."},
              {"title": f"Coast {i}", "text": f"The coast {i} has many towns and a long history of fishing."},
              {"title": "Other", "text": "An unrelated passage about weather and seasons."}]}
    for i in range(2)
]  # fmt: skip


def test_tiny_end_to_end_two_workloads_and_summarize_only(tmp_path):
    data = tmp_path / "musique.json"
    data.write_text(json.dumps(MUSIQUE))
    out = tmp_path / "board"
    st.main(["--out", str(out), "--models", "tiny_random",
             "--workloads", f"musique:data_path={data},num_passages=3,max_new_tokens=3",
             "needle:context_tokens=320,passage_tokens=48,max_new_tokens=3",
             "--queries", "2", "--draws", "0", "1", "--ratios", "0.2", "0.5",
             "--strategies", "none", "cacheblend:check_layers=[0]", "query_aware", "epic:k=4", "full",
             "--oracle-agreement", "--override", "engine.decode=eager", "--threads", "2"])  # fmt: skip
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    arms = ["baseline", "none", "cacheblend:check_layers=[0],ratio=0.2", "cacheblend:check_layers=[0],ratio=0.5",
            "query_aware:ratio=0.2", "query_aware:ratio=0.5", "epic:k=4", "full"]  # fmt: skip
    assert len(records) == 2 * 2 * 2 * len(arms)  # workloads x draws x queries x arms
    assert {r["arm"] for r in records} == set(arms)
    musique = [r for r in records if r["workload"] == "musique"]
    assert {r["score_name"] for r in musique} == {"f1"} and all(r["score"] == r["f1"] for r in musique)
    needle = [r for r in records if r["workload"] != "musique"]
    assert {r["workload"] for r in needle} == {"needle"} and {r["score_name"] for r in needle} == {"correct"}
    assert all(r["score"] == float(r["correct"]) and "needle_depth" in r for r in needle)
    # every strategy arm read the warmed passages; oracle agreement where the strategy takes it
    assert all(r["cached_tokens"] > 0 for r in records if r["arm"] != "baseline")
    assert all(isinstance(r.get("oracle_recall"), float) for r in records
               if r["strategy"] in ("cacheblend", "query_aware", "epic"))  # fmt: skip
    full = [r for r in records if r["arm"] == "full"]
    assert all(r["recompute_ratio"] == pytest.approx(r["content_ratio"]) for r in full)
    assert all(r["query_aware"] == r["strategy"].startswith("query_aware") for r in records)

    stems = ["musique__tiny_random", "needle__tiny_random"]
    for stem in stems:
        assert (out / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["cells"]) == stems
    cell = summary["cells"]["musique__tiny_random"]
    assert set(cell["plot"]["query_aware"]) == {"query_aware"}
    assert set(cell["plot"]["query_agnostic"]) == {"none", "cacheblend:check_layers=[0]", "epic:k=4"}
    assert cell["summary"]["arms"]["query_aware:ratio=0.2"]["pooled"]["oracle_n"] == 4
    assert set(cell["verdicts"]["best_by_ratio"]) <= {"0.2", "0.5"}
    overview = (out / "summary.md").read_text()
    assert "## musique on tiny_random" in overview and "## needle on tiny_random" in overview
    assert "at parity with the full prefill" in overview
    table = (out / "musique__tiny_random.md").read_text()
    assert "token F1" in table and "| query_aware:ratio=0.5 | query-aware |" in table

    before = {p.name: p.read_text() for p in out.glob("*.md")}
    before_json = (out / "summary.json").read_text()
    st.main(["--out", str(out), "--summarize-only"])
    assert {p.name: p.read_text() for p in out.glob("*.md")} == before
    assert (out / "summary.json").read_text() == before_json


# ---------------------------------------------------------------------------------------- plugin strategy


@pytest.fixture
def last_n_plugin(monkeypatch, tmp_path):
    """tests/test_plugin_searchpath.py's out-of-repo strategy package (``last_n``), behind a kvboost.plugins entry
    point, its yaml in the package's configs/ (found by the Hydra search-path plugin, no flag)."""
    import sys

    from test_plugin_searchpath import PACKAGE, _install, _write_package

    from kvboost.registry import RECOMPUTE

    _write_package(tmp_path)
    _install(monkeypatch, tmp_path, plugins={"last_n": f"{PACKAGE}.last_n"})
    yield
    RECOMPUTE.unregister("last_n")
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        sys.modules.pop(name, None)


def test_a_plugin_strategy_is_selected_by_name_with_its_fields(last_n_plugin):
    import argparse

    from experiments.common import compose_run_config

    args = argparse.Namespace(strategies=["none", "last_n", "last_n:n=8", "cacheblend"], ratios=[0.1],
                              oracle_agreement=False)  # fmt: skip
    arms, strategies = st._build_arms(["model=tiny_random", "workload=needle", "logger=none"], args, compose_run_config)
    assert [a.label for a in arms] == ["none", "last_n", "last_n:n=8", "cacheblend:ratio=0.1"]
    assert type(strategies["last_n"]).__name__ == "LastN" and strategies["last_n"].n == 24  # the plugin's yaml
    assert strategies["last_n:n=8"].n == 8 and arms[1].ratio is None and not arms[1].query_aware


def test_parity_is_two_sided_equivalence_by_question_a_large_gain_is_not_parity():
    """Issue 59: the old rule (score_diff >= -margin) called a strategy far above the full prefill "at parity"."""
    records = _leaderboard_records()
    gain = [{**r, "score": 0.9, "f1": 0.9} if r["arm"] == "none" else r for r in records]  # +0.4, 10x TTFT
    v = st.verdicts(st.summarize(gain), [0.1])["parity"]
    assert "none" not in v["arms"] and not v["met"]
    # epic (5x TTFT) within a few thousandths of the baseline on every question: equivalent
    close = [{**r, "score": 0.5 + 0.002 * (int(r["query"][1:]) % 3 - 1)} if r["arm"] == "epic" else r for r in records]
    v = st.verdicts(st.summarize(close), [0.1])["parity"]
    assert v["met"] and v["arms"] == ["epic"]
    cell = st.summarize(close)["arms"]["epic"]["pooled"]
    assert cell["score_tost"]["n"] == 6 and cell["score_tost"]["margin"] == st.PARITY
