"""A/B of two checkouts on the same run: ``run.py`` of this checkout and of another (a git worktree of an earlier
commit), alternating, on the same machine, same overrides; paired ratios of kvboost's TTFT and decode rate.

    git worktree add /tmp/kvboost-before <commit>
    python -m experiments.bench.ab_compare --before /tmp/kvboost-before --pairs 3 --name replay_bf16 \\
        --out experiments/results/runtime_ab -- logger=none
    python -m experiments.bench.ab_compare --before /tmp/kvboost-before --pairs 3 --name rag_query_aware \\
        --out experiments/results/runtime_ab -- workload=rag_reorder recompute=query_aware logger=none

Order within a pair alternates (before-after, then after-before, ...) so that drift of the machine falls on both.
Each run writes its own Hydra folder (kept under ``--out/<name>/runs``); the comparison reads their
``summary.json``: per mode in ``--modes`` (default kvboost), ``ttft_ms_p50`` and ``decode_tok_s_p50`` (overall),
``greedy_match_rate`` and accuracy where the workload has answers. Reported: each pair's after / before ratio,
the median ratio and its range, and the per-request ratios (the same request in both runs of a pair, every pair
pooled: median and p10-p90); for TTFT a ratio below 1 is faster after, for decode above 1. Written:
``<out>/<name>.json`` and ``<out>/<name>.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository root

from experiments.common import spread

METRICS = ("ttft_ms_p50", "decode_tok_s_p50")


def run_once(checkout: Path, overrides: list[str], out_dir: Path) -> dict[str, Any]:
    """``python run.py`` of ``checkout`` with ``overrides``, into ``out_dir``; its summary.json and wall time."""
    start = time.perf_counter()
    cmd = [sys.executable, "run.py", *overrides, f"hydra.run.dir={out_dir}"]
    proc = subprocess.run(cmd, cwd=checkout, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} in {checkout} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads((out_dir / "summary.json").read_text())
    return {"summary": summary, "wall_s": time.perf_counter() - start, "dir": str(out_dir)}


def extract(summary: dict[str, Any], mode: str) -> dict[str, Any]:
    overall = summary["modes"][mode]["overall"]
    quality = (summary.get("quality") or {}).get(mode) or {}
    accuracy = (summary.get("accuracy") or {}).get(mode) or {}
    return {
        **{m: overall.get(m) for m in METRICS},
        "reuse_ratio": overall.get("reuse_ratio"),
        "greedy_match_rate": quality.get("greedy_match_rate", overall.get("greedy_match_rate")),
        "accuracy": accuracy.get("accuracy"),
        "n": overall.get("n"),
    }


def per_request_ratios(rows: list[dict[str, Any]], mode: str, metric: str) -> list[float]:
    """after / before of ``metric`` for every request of ``mode`` (first measurement) in every pair."""
    ratios = []
    for pair in sorted({r["pair"] for r in rows}):
        sides = {r["side"]: _records(Path(r["dir"]), mode) for r in rows if r["pair"] == pair}
        for key, before in sides["before"].items():
            after = sides["after"].get(key)
            if after is not None and before.get(metric) and after.get(metric):
                ratios.append(after[metric] / before[metric])
    return ratios


def _records(run_dir: Path, mode: str) -> dict[str, dict[str, Any]]:
    out = {}
    for line in (run_dir / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["mode"] == mode and r.get("repeat", 0) == 0:
            out[r["request_id"]] = r
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="the other checkout (a git worktree)")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--name", required=True)
    parser.add_argument("--modes", nargs="+", default=["kvboost"])
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "runtime_ab"))
    args = parser.parse_args(argv)
    before, after = Path(args.before).resolve(), ROOT
    out = Path(args.out).resolve()
    runs_dir = out / args.name / "runs"
    rows: list[dict[str, Any]] = []
    for pair in range(args.pairs):
        order = [("before", before), ("after", after)] if pair % 2 == 0 else [("after", after), ("before", before)]
        for label, checkout in order:
            result = run_once(checkout, overrides, runs_dir / f"pair{pair}_{label}")
            row = {"pair": pair, "side": label, "wall_s": result["wall_s"], "dir": result["dir"],
                   **{mode: extract(result["summary"], mode) for mode in args.modes}}  # fmt: skip
            rows.append(row)
            print(f"pair {pair} {label}: " + ", ".join(
                f"{mode} ttft p50 {row[mode]['ttft_ms_p50']:.1f} ms, decode {row[mode]['decode_tok_s_p50']:.1f} tok/s, "
                f"greedy {row[mode]['greedy_match_rate']}" for mode in args.modes), flush=True)  # fmt: skip
    comparison: dict[str, Any] = {}
    for mode in args.modes:
        cell: dict[str, Any] = {}
        for metric in METRICS:
            ratios = []
            for pair in range(args.pairs):
                b = next(r for r in rows if r["pair"] == pair and r["side"] == "before")[mode][metric]
                a = next(r for r in rows if r["pair"] == pair and r["side"] == "after")[mode][metric]
                ratios.append(a / b)
            cell[metric] = {"after_over_before": ratios, "median": statistics.median(ratios), "min": min(ratios),
                            "max": max(ratios)}  # fmt: skip
        for field in ("greedy_match_rate", "accuracy", "reuse_ratio"):
            cell[field] = {side: [r[mode][field] for r in rows if r["side"] == side] for side in ("before", "after")}
        comparison[mode] = cell
    for mode in args.modes:  # per request: the same request in both runs of a pair (far more pairs than runs)
        for metric in ("ttft_ms", "prefill_ms", "decode_tok_s"):
            ratios = per_request_ratios(rows, mode, metric)
            if ratios:
                comparison[mode][f"per_request_{metric}"] = spread(ratios)
    command = f"python -m experiments.bench.ab_compare {' '.join(argv)} -- {' '.join(overrides)}"
    result = {"command": command, "before": str(before), "after": str(after), "overrides": overrides,
              "pairs": args.pairs, "rows": rows, "comparison": comparison}  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2, default=str))
    (out / f"{args.name}.md").write_text(to_markdown(result))
    print((out / f"{args.name}.md").read_text())
    return result


def to_markdown(result: dict[str, Any]) -> str:
    lines = [f"# A/B: {' '.join(result['overrides']) or 'defaults'}", "", "```", result["command"], "```", "",
             f"before: `{result['before']}`, after: `{result['after']}`; {result['pairs']} pairs, order alternating.",
             "", "| mode | metric | after / before per pair | median [min-max] |", "|---|---|---|---|"]  # fmt: skip
    for mode, cell in result["comparison"].items():
        for metric in METRICS:
            c = cell[metric]
            lines.append(f"| {mode} | {metric} | {', '.join(f'{r:.3f}' for r in c['after_over_before'])} | "
                         f"{c['median']:.3f} [{c['min']:.3f}-{c['max']:.3f}] |")  # fmt: skip
        for metric in ("ttft_ms", "prefill_ms", "decode_tok_s"):
            c = cell.get(f"per_request_{metric}")
            if c:
                lines.append(f"| {mode} | {metric} per request (all pairs) | n = {c['n']} | "
                             f"{c['median']:.3f} [p10 {c['p10']:.3f} - p90 {c['p90']:.3f}] |")  # fmt: skip
        for field in ("greedy_match_rate", "accuracy", "reuse_ratio"):
            values = cell[field]
            if any(v is not None for side in values.values() for v in side):
                lines.append(f"| {mode} | {field} | before {values['before']}, after {values['after']} | |")
    lines += ["", "Per run:", "", "| pair | side | " + " | ".join(f"{m} {x}" for m in result["comparison"] for x in
              ("ttft p50 ms", "decode tok/s", "greedy")) + " | wall s |", "|---" * (3 + 3 * len(result["comparison"])) + "|"]  # fmt: skip
    for r in result["rows"]:
        cells = []
        for m in result["comparison"]:
            cells += [f"{r[m]['ttft_ms_p50']:.1f}", f"{r[m]['decode_tok_s_p50']:.1f}", str(r[m]["greedy_match_rate"])]
        lines.append(f"| {r['pair']} | {r['side']} | " + " | ".join(cells) + f" | {r['wall_s']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
