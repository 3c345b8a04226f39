"""Strategy fidelity on MuSiQue (issue 59): teacher-forced fidelity to the full prefill, per question and arm,
resumable, with tables and quality-vs-measured-recompute plots generated from the records.

Usage (from the repository root)::

    python -m experiments.bench.fidelity --out experiments/results/fidelity_pilot \\
        --models smollm2 --layouts independent shared_prefix --queries 5 --dtype float32 \\
        --strategies none cacheblend:ratio=0.15 epic query_aware:ratio=0.15
    python -m experiments.bench.fidelity --out ... --summarize-only     # rebuild tables and plots

What is measured: :mod:`kvboost.lab.fidelity` (the reference is the cold full prefill's greedy answer, 32 tokens;
every arm is scored teacher-forced on it; ``full`` is the control arm and ``none`` the floor, both added to every
run). Strategy specs are those of ``experiments.bench.strategy_table`` (``name``, ``name:key=value,...``); a
ratio-driven strategy without a ratio runs at every ``--ratios`` value. A run **resumes**: records already in
``records.jsonl`` for (question, arm, layout, model) are not measured again, so a long leaderboard is a series of
invocations with the same ``--out``; a tqdm bar shows progress and ETA. Every invocation's command line is
appended to ``commands.txt`` and listed under every table.

Outputs in ``--out``: ``records.jsonl`` (one line per question and arm, with commit, config hash, machine kind,
model); ``summary.json`` (per cell ``<layout>__<model>`` and arm: the means of f1, f1_ref, answer_kl,
first_token_kl, greedy_match, gold_logprob_delta, recompute_fraction and TTFT; and the statistics below);
``<cell>.md``: per arm the means with 95% bootstrap intervals over questions, the paired differences from the
``full`` arm by question, the TOST verdict against ``full`` (margins: ``kvboost.lab.fidelity_stats``), and the
paired answer-KL differences between every two arms; ``<cell>.png``: greedy match and answer KL against the
measured recompute fraction, with the Pareto frontier drawn.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from experiments.common import add_threads_arg, set_threads, write_json, write_markdown
from kvboost.lab import fidelity as fid
from kvboost.lab import fidelity_stats as st

DEFAULT_STRATEGIES = ("none", "cacheblend", "epic", "query_aware")
DEFAULT_LAYOUTS = ("independent", "shared_prefix")
#: (measure, higher is better) drawn against the measured recompute fraction
PLOTTED = (("greedy_match", True), ("answer_kl", False))


# ----------------------------------------------------------------------------------------------- run
def _base(model: str, layout: str, args: argparse.Namespace) -> list[str]:
    base = [f"model={model}", "workload=musique", f"workload.layout={layout}", f"workload.num_queries={args.queries}",
            "logger=none", "warmup=false"]  # fmt: skip
    if args.dtype:
        base.append(f"model.dtype={args.dtype}")
    return base + list(args.override)


def _with_control_and_floor(specs: list[str]) -> list[str]:
    names = [s.split(":", 1)[0] for s in specs]
    return ([fid.CONTROL_ARM] if fid.CONTROL_ARM not in names else []) + \
        ([fid.FLOOR_ARM] if fid.FLOOR_ARM not in names else []) + list(specs)  # fmt: skip


def run(args: argparse.Namespace) -> None:
    from tqdm.auto import tqdm

    from experiments.bench.strategy_table import _build_arms
    from experiments.common import compose_run_config
    from kvboost.build import build_engine
    from kvboost.lab.config_check import check_config, split_workload_config
    from kvboost.lab.workloads import WORKLOADS
    from kvboost.lab.workloads.base import WorkloadEnv

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "commands.txt", "a") as f:
        f.write(_command() + "\n")
    records_path = out / "records.jsonl"
    done = fid.done_keys(fid.read_records(records_path))
    commit, machine = fid.git_commit(), fid.machine_kind()
    args.strategies = _with_control_and_floor(list(args.strategies))
    args.oracle_agreement = False
    for model in args.models:
        cfgs = {layout: compose_run_config(_base(model, layout, args)) for layout in args.layouts}
        for layout, cfg in cfgs.items():
            try:
                check_config(cfg)
            except (ValueError, TypeError, FileNotFoundError) as exc:
                raise SystemExit(f"layout {layout!r} on {model}: {exc}") from None
        arms, strategies = _build_arms(_base(model, args.layouts[0], args), args, compose_run_config)
        hashes = {(layout, a.label): fid.config_hash(compose_run_config(_base(model, layout, args) + list(a.overrides)))
                  for layout in args.layouts for a in arms}  # fmt: skip
        engine = build_engine(next(iter(cfgs.values())))
        num_layers = engine.model.config.get_text_config(decoder=True).num_hidden_layers
        dtype = str(engine.adapter.dtype).replace("torch.", "")
        try:
            for s in strategies.values():
                s.check_model(num_layers)
            env = WorkloadEnv(tokenizer=engine.tokenizer, count_tokens=lambda p: len(engine.tokenize(p)))
            workloads = {}
            for layout, cfg in cfgs.items():
                name, fields, _, _ = split_workload_config(cfg)
                workloads[layout] = WORKLOADS.build({"name": name, **fields}, env=env)
            # question by question, every layout of a question before the next one: a run stopped early leaves
            # paired cells (the same questions in each layout)
            per_layout = {layout: list(w.requests()) for layout, w in workloads.items()}
            todo = [(layout, req, [a for a in arms if (req.request_id, a.label, layout, model) not in done])
                    for i in range(max(map(len, per_layout.values())))
                    for layout, reqs in per_layout.items() if i < len(reqs) for req in [reqs[i]]]  # fmt: skip
            todo = [(layout, req, missing) for layout, req, missing in todo if missing]
            total = sum(len(m) for _, _, m in todo)
            with fid.open_records(records_path) as sink, tqdm(total=total, desc=f"fidelity {model}", unit="arm") as bar:
                for layout, request, missing in todo:
                    bar.set_postfix_str(f"{layout} {request.request_id}")
                    context = {"layout": layout, "model": model, "dtype": dtype, "commit": commit,
                               "machine": machine, "num_passages": request.info.get("num_passages")}  # fmt: skip
                    records = fid.measure_question(engine, workloads[layout], request,
                                                   {a.label: strategies[a.label] for a in missing},
                                                   num_layers=num_layers, context=context)  # fmt: skip
                    by_label = {a.label: a for a in missing}
                    for r in records:
                        arm = by_label[r["arm"]]
                        r.update(strategy=arm.name, ratio=arm.ratio, query_aware=arm.query_aware,
                                 config_hash=hashes[(layout, arm.label)])  # fmt: skip
                        sink.write(json.dumps(r) + "\n")
                    sink.flush()
                    bar.update(len(missing))
        finally:
            engine.close()
    write_outputs(out, margin_override=args.margin)


def _command() -> str:
    return "python -m experiments.bench.fidelity " + " ".join(shlex.quote(a) for a in sys.argv[1:])


# ------------------------------------------------------------------------------------------- outputs
def cell_stats(records: list[dict[str, Any]], margins: dict[str, float]) -> dict[str, Any]:
    """Per arm: means with bootstrap CIs by question, paired differences from ``full`` and TOST against it; and
    paired answer-KL differences between every two arms."""
    arms = list(dict.fromkeys(r["arm"] for r in records))
    out: dict[str, Any] = {"arms": {}, "arm_vs_arm_answer_kl": {}}
    for arm in arms:
        row: dict[str, Any] = {}
        for name in fid.SUMMARY_FIELDS:
            vals = st.by_question(records, arm, name)
            row[name] = st.mean_ci(list(vals.values()))
            if arm != fid.CONTROL_ARM and name in margins:
                control = st.by_question(records, fid.CONTROL_ARM, name)
                row[f"{name}_vs_full"] = st.paired(vals, control)
                row[f"{name}_tost_vs_full"] = st.tost(vals, control, margins[name])
        out["arms"][arm] = row
    for a in arms:
        for b in arms:
            if a < b:
                out["arm_vs_arm_answer_kl"][f"{a} - {b}"] = st.paired(st.by_question(records, a, "answer_kl"),
                                                                       st.by_question(records, b, "answer_kl"))
    return out


def _fmt(cell: dict[str, Any] | None, digits: int = 3) -> str:
    if not cell or cell.get("mean", cell.get("diff")) is None:
        return "-"
    value = cell.get("mean", cell.get("diff"))
    ci = cell.get("ci")
    return f"{value:.{digits}f}" + (f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else "")


def _tost(cell: dict[str, Any] | None) -> str:
    if not cell or cell.get("equivalent") is None:
        return "-"
    return f"{'yes' if cell['equivalent'] else 'no'} (p={cell['p']:.2g})"


def format_cell(cell: str, stats: dict[str, Any], summary: dict[str, Any], commands: list[str],
                margins: dict[str, float]) -> str:  # fmt: skip
    """The markdown table of one cell."""
    n = max((row["n"] for row in summary.values()), default=0)
    lines = [f"# Fidelity: {cell} ({n} question(s))", "",
             "Reference: the cold full prefill's greedy answer (32 tokens). Means with 95% bootstrap intervals over "
             "questions; differences are paired by question (arm minus `full`). TOST: two one-sided tests of the "
             f"paired differences against +-margin at alpha {st.ALPHA} (margins: "
             + ", ".join(f"{k} {v}" for k, v in margins.items()) + "); a large gain is not parity.", "",
             "| arm | n | recompute fraction | answer KL | first-token KL | greedy match | greedy vs full "
             "| TOST greedy | F1 (SQuAD) | F1 vs full | TOST F1 | F1 (ref code) | gold logprob delta | TTFT p50 ms "
             "| s / question |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for arm, row in stats["arms"].items():
        s = summary[arm]
        lines.append(f"| {arm} | {s['n']} | {_fmt(row['recompute_fraction'])} | {_fmt(row['answer_kl'], 4)} | "
                     f"{_fmt(row['first_token_kl'], 4)} | {_fmt(row['greedy_match'], 2)} | "
                     f"{_fmt(row.get('greedy_match_vs_full'), 2)} | {_tost(row.get('greedy_match_tost_vs_full'))} | "
                     f"{_fmt(row['f1'])} | {_fmt(row.get('f1_vs_full'))} | {_tost(row.get('f1_tost_vs_full'))} | "
                     f"{_fmt(row['f1_ref'])} | {_fmt(row['gold_logprob_delta'])} | {s['ttft_ms_p50']:.0f} | "
                     f"{s['seconds_per_question']:.1f} |")  # fmt: skip
    lines += ["", "Paired answer-KL differences between arms (row minus column, by question):", "",
              "| pair | mean diff [95% CI] | n |", "|---|---|---|"]
    for pair, d in stats["arm_vs_arm_answer_kl"].items():
        lines.append(f"| {pair} | {_fmt(d, 4)} | {d['n']} |")
    lines += ["", "Commands that produced the records (in order):", "", *[f"    {c}" for c in commands], ""]
    return "\n".join(lines)


def pareto(points: list[tuple[float, float, str]], higher_is_better: bool) -> list[tuple[float, float, str]]:
    """The Pareto frontier of (cost, quality, label) points: no other point costs no more and is better
    (strictly on one of the two), sorted by cost."""
    sign = 1.0 if higher_is_better else -1.0
    front = []
    for c, q, label in points:
        dominated = any(c2 <= c and sign * q2 >= sign * q and (c2 < c or sign * q2 > sign * q)
                        for c2, q2, _ in points)  # fmt: skip
        if not dominated:
            front.append((c, q, label))
    return sorted(front)


def plot_cell(cell: str, summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PLOTTED), figsize=(6 * len(PLOTTED), 4.5))
    for ax, (name, higher) in zip(axes, PLOTTED, strict=True):
        points = [(row["recompute_fraction"], row[name], arm) for arm, row in summary.items()
                  if row.get(name) is not None and row.get("recompute_fraction") is not None]  # fmt: skip
        for c, q, label in points:
            ax.scatter([c], [q])
            ax.annotate(label, (c, q), fontsize=7, xytext=(3, 3), textcoords="offset points")
        front = pareto(points, higher)
        ax.plot([p[0] for p in front], [p[1] for p in front], "k--", lw=1, label="Pareto frontier")
        ax.set_xlabel("measured recompute fraction (of a full prefill's rows x layers)")
        ax.set_ylabel(name.replace("_", " "))
        if not higher and all(q > 0 for _, q, _ in points):
            ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle(f"{cell}: fidelity vs measured recompute")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out: Path, margin_override: float | None = None) -> dict[str, Any]:
    """Tables, plots and ``summary.json`` from ``records.jsonl`` and ``commands.txt``."""
    records = fid.read_records(out / "records.jsonl")
    if not records:
        raise SystemExit(f"{out / 'records.jsonl'}: no records")
    commands_path = out / "commands.txt"
    commands = [c for c in commands_path.read_text().splitlines() if c.strip()] if commands_path.exists() else []
    margins = {k: (margin_override if margin_override is not None else v) for k, v in st.DEFAULT_MARGINS.items()}
    summary = fid.summarize(records)
    stats = {}
    for cell, by_arm in summary.items():
        cell_records = [r for r in records if f"{r['layout']}__{r['model']}" == cell]
        stats[cell] = cell_stats(cell_records, margins)
        write_markdown(out / f"{cell}.md", format_cell(cell, stats[cell], by_arm, commands, margins))
        plot_cell(cell, by_arm, out / f"{cell}.png")
    machines = sorted({r.get("machine", "?") for r in records})
    commits = sorted({r.get("commit") or "?" for r in records})
    write_json(out / "summary.json", {"cells": summary, "stats": stats, "margins": margins, "commands": commands,
                                      "machines": machines, "commits": commits})  # fmt: skip
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--models", nargs="+", default=["smollm2"], help="kvboost/configs/model names")
    parser.add_argument("--dtype", default=None, help="model.dtype (float32 for fidelity near zero on the control)")
    parser.add_argument("--layouts", nargs="+", default=list(DEFAULT_LAYOUTS), choices=list(DEFAULT_LAYOUTS))
    parser.add_argument("--queries", type=int, default=5, help="workload.num_queries: the first N questions")
    parser.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES),
                        help="strategy specs (experiments.bench.strategy_table); full and none are always added")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.15],
                        help="budgets of ratio-driven strategies whose spec sets none")  # fmt: skip
    parser.add_argument("--margin", type=float, default=None, help="one TOST margin for every measure")
    parser.add_argument("--override", nargs="*", default=[], help="more Hydra overrides")
    parser.add_argument("--out", required=True)
    parser.add_argument("--summarize-only", action="store_true")
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    if args.summarize_only:
        write_outputs(Path(args.out), margin_override=args.margin)
        return
    if args.queries < 1:
        parser.error("--queries must be >= 1")
    set_threads(args.threads)
    t0 = time.perf_counter()
    run(args)
    print(f"done in {time.perf_counter() - t0:.0f} s: {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
