"""Issue 59: teacher-forced fidelity of recompute strategies on workload=musique (kvboost.lab.fidelity), its
statistics (kvboost.lab.fidelity_stats) and the resumable CLI (experiments.bench.fidelity), on the tiny random
model and a 3-question fixture."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from experiments.bench import fidelity as cli
from kvboost.lab import fidelity as fid
from kvboost.lab import fidelity_stats as st

ARMS = ["cacheblend:ratio=0.5,check_layers=[0]", "query_aware:ratio=0.3"]


@pytest.fixture
def fixture_file(tmp_path):
    from test_musique_workload import FIXTURE

    path = tmp_path / "musique.json"
    path.write_text(json.dumps(FIXTURE))
    return path


def _argv(out, data, queries, layouts=("independent",)):
    return ["--out", str(out), "--models", "tiny_random", "--queries", str(queries), "--layouts", *layouts,
            "--strategies", *ARMS, "--override", f"workload.data_path={data}", "workload.num_passages=3",
            "engine.decode=eager"]  # fmt: skip


def _records(out):
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def test_fidelity_run_control_floor_records_summary_and_resume(tmp_path, fixture_file):
    out = tmp_path / "run"
    cli.main(_argv(out, fixture_file, 2))
    records = _records(out)
    arms = {"full", "none", *ARMS}
    assert {r["arm"] for r in records} == arms and len(records) == 2 * len(arms)  # full and none added
    for r in records:
        assert r["commit"] and len(r["config_hash"]) == 16 and "(" in r["machine"] and r["model"] == "tiny_random"
        assert r["layout"] == "independent" and r["answer_tokens"] >= 1
    hashes = {r["arm"]: r["config_hash"] for r in records}
    assert len(set(hashes.values())) == len(arms)  # the arm is part of the composed config
    by_arm = {a: [r for r in records if r["arm"] == a] for a in arms}
    # the control: every reused row recomputed reproduces the cold full prefill (fp32 rounding at most)
    for r in by_arm["full"]:
        assert r["answer_kl"] < 1e-6 and r["first_token_kl"] < 1e-6 and r["greedy_match"], r
        assert abs(r["gold_logprob_delta"]) < 1e-3
    # the floor reuses as cached: it deviates, and recomputes nothing
    assert all(r["recompute_fraction"] == 0.0 for r in by_arm["none"])
    assert max(r["answer_kl"] for r in by_arm["none"]) > 1e3 * max(r["answer_kl"] for r in by_arm["full"]) + 1e-9
    # the measured fraction counts the query-aware probe on top of the engine's recomputed rows; not cacheblend's
    for r in by_arm["query_aware:ratio=0.3"]:
        assert r["recompute_fraction"] > r["recompute_ratio"] > 0
    for r in by_arm[ARMS[0]]:
        assert r["recompute_fraction"] == pytest.approx(r["recompute_ratio"]) and r["recompute_fraction"] > 0
    summary = json.loads((out / "summary.json").read_text())
    cell = summary["cells"]["independent__tiny_random"]
    for arm in arms:
        row = cell[arm]
        for name in (*fid.SUMMARY_FIELDS, "ttft_ms_mean", "ttft_ms_p50"):
            assert row[name] is not None, (arm, name)
        assert row["answer_kl"] == pytest.approx(sum(r["answer_kl"] for r in by_arm[arm]) / 2)
    assert (out / "independent__tiny_random.png").stat().st_size > 0
    table = (out / "independent__tiny_random.md").read_text()
    assert "python -m experiments.bench.fidelity" in table and "TOST" in table
    # resume: the same command measures nothing again; one more question adds only its records
    cli.main(_argv(out, fixture_file, 2))
    assert len(_records(out)) == len(records)
    cli.main(_argv(out, fixture_file, 3))
    again = _records(out)
    assert len(again) == 3 * len(arms) and again[: len(records)] == records
    assert {r["question"] for r in again[len(records):]} == {"musique002"}
    assert len((out / "commands.txt").read_text().splitlines()) == 3


def test_recompute_fraction_counts_the_probe_less_the_rows_it_kept():
    class Probe:
        needs_reader_attention = True

        def reader_layers(self, n):
            return [0, 5]

    result = SimpleNamespace(prompt_tokens=100, recompute_ratio=0.1, cached_tokens=80,
                             extra={"probe_ms": 1.0, "probe_kept_tokens": 5})  # fmt: skip
    # 0.1 x 100 x 10 recomputed pairs + (20 new - 5 kept) x 6 probe layers, over 100 x 10
    assert fid.recompute_fraction(result, Probe(), 10) == pytest.approx((100 + 15 * 6) / 1000)
    assert fid.recompute_fraction(result, SimpleNamespace(), 10) == pytest.approx(0.1)
    no_probe_ran = SimpleNamespace(prompt_tokens=100, recompute_ratio=0.0, cached_tokens=0, extra={})
    assert fid.recompute_fraction(no_probe_ran, Probe(), 10) == 0.0
    with pytest.raises(ValueError, match="positive"):
        fid.recompute_fraction(SimpleNamespace(prompt_tokens=0, recompute_ratio=0, cached_tokens=0, extra={}),
                               Probe(), 10)  # fmt: skip


# ------------------------------------------------------------------------------------------ statistics


def test_tost_is_two_sided_a_large_gain_is_not_parity():
    import random

    rng = random.Random(0)
    qs = [f"q{i}" for i in range(60)]
    base = {q: rng.random() for q in qs}
    close = {q: base[q] + rng.gauss(0.0, 0.02) for q in qs}
    gain = {q: base[q] + 0.3 + rng.gauss(0.0, 0.02) for q in qs}
    loss = {q: base[q] - 0.3 + rng.gauss(0.0, 0.02) for q in qs}
    assert st.tost(close, base, 0.05)["equivalent"] is True
    assert st.tost(gain, base, 0.05)["equivalent"] is False  # the old "within 0.03" rule counted this as parity
    assert st.tost(loss, base, 0.05)["equivalent"] is False
    noisy = {q: base[q] + rng.gauss(0.0, 0.5) for q in qs[:5]}  # few, noisy questions: no equivalence shown
    assert st.tost(noisy, base, 0.05)["equivalent"] is False
    assert st.tost({"a": 1.0}, {"a": 1.0}, 0.05)["equivalent"] is None
    with pytest.raises(ValueError, match="margin"):
        st.tost(close, base, 0.0)


def test_paired_and_mean_intervals_resample_questions():
    a = {"q1": 1.0, "q2": 0.0, "q3": 1.0, "q4": 1.0}
    b = {"q1": 0.0, "q2": 0.0, "q3": 1.0, "q5": 0.0}  # q4 / q5 unpaired: left out
    d = st.paired(a, b)
    assert d["n"] == 3 and d["diff"] == pytest.approx(1 / 3)
    assert d["ci"][0] <= d["diff"] <= d["ci"][1] and d["ci"][0] >= 0.0
    m = st.mean_ci([0.0, 1.0, 1.0, 1.0])
    assert m["mean"] == 0.75 and m["n"] == 4 and 0.0 <= m["ci"][0] < 0.75 < m["ci"][1] <= 1.0
    records = [{"arm": "x", "question": "q1", "f1": 1.0}, {"arm": "x", "question": "q1", "f1": 0.0}]
    with pytest.raises(ValueError, match="one per"):
        st.by_question(records, "x", "f1")  # two passage orders of one question are not two samples


def test_pareto_frontier():
    pts = [(0.0, 0.2, "none"), (0.1, 0.6, "a"), (0.2, 0.5, "b"), (0.3, 0.9, "c"), (1.0, 1.0, "full"),
           (0.3, 0.8, "d")]  # fmt: skip
    assert [p[2] for p in cli.pareto(pts, higher_is_better=True)] == ["none", "a", "c", "full"]
    kl = [(0.0, 1.0, "none"), (0.1, 0.5, "a"), (0.2, 0.7, "b"), (1.0, 0.0, "full")]
    assert [p[2] for p in cli.pareto(kl, higher_is_better=False)] == ["none", "a", "full"]


def test_records_after_a_torn_line_are_kept(tmp_path):
    """A run killed mid-write leaves a torn last line: it is skipped on reading, and the next record appended
    starts on its own line (before, it was glued to the torn one and lost)."""
    path = tmp_path / "records.jsonl"
    good = {"question": "q0", "arm": "none", "layout": "independent", "model": "m"}
    path.write_text(json.dumps(good) + "\n" + '{"question": "q1", "ar')
    assert fid.read_records(path) == [good]
    with fid.open_records(path) as sink:
        sink.write(json.dumps({**good, "question": "q2"}) + "\n")
    assert [r["question"] for r in fid.read_records(path)] == ["q0", "q2"]
    assert fid.done_keys(fid.read_records(path)) == {("q0", "none", "independent", "m"),
                                                     ("q2", "none", "independent", "m")}  # fmt: skip
    with fid.open_records(tmp_path / "new.jsonl") as sink:  # a missing file: created
        sink.write("{}\n")
