"""Compare runs: one row per run (a Hydra multirun's jobs, or run folders), a Markdown and CSV table, plots.

    python -m kvboost.lab.compare multirun/2025-01-01/12-00-00            # every job of a sweep
    python -m kvboost.lab.compare outputs/A outputs/B --out cmp --mode kvboost --x speedup

Each run folder holds ``summary.json`` (written by the runner, see ``kvboost/lab/report.py``) and, for Hydra
runs, ``.hydra/overrides.yaml`` (the overrides that define the run; without it the folder's name is the
label, minus a Hydra job number prefix such as ``3_``). Overrides every run shares are listed once above the
table; each row is labelled by the rest.

Written into ``--out`` (default: the one DIR given, else the current folder): ``comparison.md``,
``comparison.csv`` and plots for the chosen mode: ``ttft_by_turn.png`` and ``reuse_by_turn.png`` (one line
per run; ``ttft_by_run.png`` and ``reuse_by_run.png`` instead when every run is single-turn) and
``quality_vs_ttft.png`` (a point per run: x = TTFT p50 or speedup vs baseline, y = accuracy where measured,
else first-token KL mean vs the baseline): for ``python run.py -m workload=rag_reorder
recompute=none,selective,cacheblend,full`` the quality-vs-TTFT trade-off of the recompute strategies.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import re
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvboost.lab.report import _natural_key, fmt_ms, fmt_speedup, fmt_spread, line_styles

DEFAULT_MODE = "kvboost"
DEFAULT_REFERENCE = "kvboost_cold"


class CompareError(ValueError):
    """A comparison that cannot be made (no summaries, unknown mode); the message names the cause."""


class SummaryWarning(UserWarning):
    """A summary.json or overrides file that was skipped or ignored."""


@dataclass
class Run:
    path: Path  # the run folder
    summary: dict[str, Any]
    overrides: list[str] | None = None  # None: no .hydra/overrides.yaml
    label: str = ""
    row: dict[str, Any] = field(default_factory=dict)

    @property
    def override_string(self) -> str:
        return " ".join(self.overrides or [])


# ------------------------------------------------------------------------------------------------ finding
def _path_key(path: Path) -> tuple:
    # Hydra job folders "0_a=b", ..., "10_a=c" (or "0", ..., "10"): by job number, then name
    return tuple((0, int(m.group(1)), m.group(2) or "") if (m := re.match(r"^(\d+)(?:_(.*))?$", part))
                 else (1, 0, part) for part in path.parts)


def find_summaries(dirs: Sequence[str | os.PathLike]) -> list[Path]:
    """Every ``summary.json`` in or below each DIR (a run folder, a sweep folder, or a summary file), in
    job order, without duplicates. Raises CompareError naming a DIR that does not exist or has none."""
    if not dirs:
        raise CompareError("no run folder given")
    found: list[Path] = []
    for d in dirs:
        p = Path(d)
        if not p.exists():
            raise CompareError(f"{d}: no such file or folder")
        if p.is_file():
            if p.name != "summary.json":
                raise CompareError(f"{d}: not a run folder or a summary.json")
            paths = [p]
        else:
            paths = sorted((s for s in p.rglob("summary.json") if ".hydra" not in s.parts and s.is_file()),
                           key=lambda s: _path_key(s.relative_to(p)))
            if not paths:
                raise CompareError(f"{d}: no summary.json in this folder or below it")
        found += [s for s in paths if s.resolve() not in {f.resolve() for f in found}]
    return found


def _read_overrides(run_dir: Path) -> list[str] | None:
    path = run_dir / ".hydra" / "overrides.yaml"
    if not path.is_file():
        return None
    try:
        import yaml

        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except Exception as exc:  # noqa: BLE001 - any unreadable file: fall back to the folder name
        warnings.warn(f"{path}: unreadable overrides ({exc}); labelling the run by its folder", SummaryWarning,
                      stacklevel=3)
        return None
    if data is None:
        return []
    if not isinstance(data, list):
        warnings.warn(f"{path}: expected a list of overrides, got {type(data).__name__}; labelling the run by its "
                      "folder", SummaryWarning, stacklevel=3)
        return None
    return [str(o) for o in data]


def load_runs(summaries: Sequence[Path]) -> list[Run]:
    """Read each summary (a corrupt one is skipped with a SummaryWarning naming the file) and its run's
    overrides; label the runs. Raises CompareError when none is readable."""
    runs = []
    for path in summaries:
        try:
            summary = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            warnings.warn(f"skipping {path}: not readable JSON ({exc})", SummaryWarning, stacklevel=2)
            continue
        if not isinstance(summary, dict) or not isinstance(summary.get("modes"), dict):
            warnings.warn(f"skipping {path}: not a run summary (no 'modes' object)", SummaryWarning, stacklevel=2)
            continue
        runs.append(Run(path.parent, summary, _read_overrides(path.parent)))
    if not runs:
        raise CompareError("no readable summary.json among: " + ", ".join(str(p) for p in summaries))
    _label(runs)
    return runs


def common_overrides(runs: Sequence[Run]) -> list[str]:
    """Overrides every run has (empty for a single run or when some run has no overrides file)."""
    if len(runs) < 2 or any(r.overrides is None for r in runs):
        return []
    first = runs[0].overrides or []
    return [o for o in first if all(o in (r.overrides or []) for r in runs[1:])]


def _label(runs: list[Run]) -> None:
    common = set(common_overrides(runs))
    for run in runs:
        if run.overrides:
            run.label = " ".join(o for o in run.overrides if o not in common) or "(shared overrides only)"
        else:
            name = run.path.resolve().name
            run.label = re.sub(r"^\d+_(?=.)", "", name) if run.overrides is None else "(defaults)"
    labels = [r.label for r in runs]
    if len(set(labels)) < len(labels):  # e.g. two plain runs both named by time: show the paths
        resolved = [r.path.resolve() for r in runs]
        root = Path(os.path.commonpath(resolved)) if len(resolved) > 1 else resolved[0].parent
        for run, path in zip(runs, resolved):
            if labels.count(run.label) > 1:
                run.label = f"{run.label} ({path.relative_to(root) if path != root else path.name})"


# ------------------------------------------------------------------------------------------------- rows
def _get(mapping: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(mapping, Mapping):
            return None
        mapping = mapping.get(k)
    return mapping


def _ordered_modes(runs: Sequence[Run]) -> list[str]:
    modes: list[str] = []
    for run in runs:
        base = run.summary.get("baseline_mode", "baseline")
        for m in [base] + list(run.summary["modes"]):
            if m in run.summary["modes"] and m not in modes:
                modes.append(m)
    return modes


def _turns(runs: Sequence[Run], mode: str) -> list[str]:
    keys = {t for r in runs for t in (_get(r.summary, "modes", mode, "by_turn") or {})}
    return sorted(keys, key=_natural_key)


def _ci(value: Any, i: int) -> Any:
    return value[i] if isinstance(value, (list, tuple)) and len(value) == 2 else None


def build_rows(runs: Sequence[Run], mode: str = DEFAULT_MODE, reference: str = DEFAULT_REFERENCE) -> list[str]:
    """Fill ``run.row`` for each run (raw numbers, None where not measured); returns the column names."""
    if not any(mode in r.summary["modes"] for r in runs):
        present = ", ".join(_ordered_modes(runs)) or "none"
        raise CompareError(f"mode {mode!r} is in none of the runs (modes present: {present})")
    turns = _turns(runs, mode)
    acc_modes = [m for m in _ordered_modes(runs) if any(m in (r.summary.get("accuracy") or {}) for r in runs)]
    columns = ["run", "overrides", "path", "mode", "n", "ttft_ms_p50", "ttft_ms_p10", "ttft_ms_p90",
               "baseline_ttft_ms_p50"]
    columns += [f"ttft_ms_p50_turn{t}" for t in turns]
    columns += ["speedup_vs_baseline", "speedup_vs_baseline_ci_lo", "speedup_vs_baseline_ci_hi",
                f"speedup_vs_{reference}", f"speedup_vs_{reference}_ci_lo", f"speedup_vs_{reference}_ci_hi",
                "reuse_ratio", "exact_ratio", "content_ratio", "recompute_ratio", "reuse_ratio_turns_ge2"]
    columns += [f"reuse_ratio_turn{t}" for t in turns]
    columns += ["greedy_match_rate", "first_token_kl_mean", "first_token_kl_max", "answer_logprob_delta_mean"]
    columns += [f"accuracy_{m}" for m in acc_modes]
    for run in runs:
        s = run.summary
        overall = _get(s, "modes", mode, "overall") or {}
        by_turn = _get(s, "modes", mode, "by_turn") or {}
        quality = _get(s, "quality", mode) or {}
        row: dict[str, Any] = {
            "run": run.label, "overrides": run.override_string, "path": str(run.path), "mode": mode,
            "n": overall.get("n"), "ttft_ms_p50": overall.get("ttft_ms_p50"),
            "ttft_ms_p10": overall.get("ttft_ms_p10"), "ttft_ms_p90": overall.get("ttft_ms_p90"),
            "baseline_ttft_ms_p50": _get(s, "modes", s.get("baseline_mode", "baseline"), "overall", "ttft_ms_p50"),
        }
        for t in turns:
            row[f"ttft_ms_p50_turn{t}"] = _get(by_turn, t, "ttft_ms_p50")
            row[f"reuse_ratio_turn{t}"] = _get(by_turn, t, "reuse_ratio")
        for name, key in (("baseline", "baseline"), (reference, reference)):
            ci = overall.get(f"speedup_vs_{key}_ci95")
            row[f"speedup_vs_{name}"] = overall.get(f"speedup_vs_{key}_p50")
            row[f"speedup_vs_{name}_ci_lo"] = _ci(ci, 0)
            row[f"speedup_vs_{name}_ci_hi"] = _ci(ci, 1)
        if mode == reference and mode in s["modes"]:
            row[f"speedup_vs_{reference}"] = row[f"speedup_vs_{reference}"] or 1.0
        for key in ("reuse_ratio", "exact_ratio", "content_ratio", "recompute_ratio", "reuse_ratio_turns_ge2"):
            row[key] = overall.get(key)
        for key in ("greedy_match_rate", "first_token_kl_mean", "first_token_kl_max", "answer_logprob_delta_mean"):
            row[key] = quality.get(key)
        for m in acc_modes:
            row[f"accuracy_{m}"] = _get(s, "accuracy", m, "accuracy")
        run.row = {c: row.get(c) for c in columns}
    return columns


# ------------------------------------------------------------------------------------------------ writing
def _num(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    return f"{value:.10g}" if isinstance(value, float) else str(value)


def write_csv(runs: Sequence[Run], columns: Sequence[str], path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for run in runs:
            writer.writerow([_num(run.row.get(c)) for c in columns])
    return path


def _pct(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}%}"


def _g(value: Any, spec: str = ".3g") -> str:
    return "-" if value is None else f"{abs(value) if value == 0 else value:{spec}}"  # no "-0"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|")


def format_markdown(runs: Sequence[Run], columns: Sequence[str], mode: str, reference: str,
                    out_dir: Path | None = None) -> str:
    turns = [c.removeprefix("ttft_ms_p50_turn") for c in columns if c.startswith("ttft_ms_p50_turn")]
    acc_modes = [c.removeprefix("accuracy_") for c in columns if c.startswith("accuracy_")]
    boot = next((r.summary.get("bootstrap") for r in runs if r.summary.get("bootstrap")), None) or {}
    common = common_overrides(runs)
    lines = [f"# Comparison of {len(runs)} run(s), mode `{mode}`", ""]
    if common:
        lines += [f"Overrides of every run: `{' '.join(common)}`", ""]
    lines += [
        f"TTFT ms: p50 [p10-p90] over requests; `turn N`: TTFT p50 of that turn. Speedups: the other mode's TTFT "
        f"p50 / `{mode}`'s on the requests both served, with the 95% paired bootstrap interval"
        + (f" ({boot['resamples']} resamples)" if boot.get("resamples") else "")
        + ". Ratios are means over requests; quality is vs the baseline's prefill of the same prompt; accuracy per "
        "mode (fraction of requests answered correctly).",
        "",
    ]
    header = ["run", "n", "TTFT ms"] + ([f"turn {t}" for t in turns] if len(turns) > 1 else [])
    header += ["vs baseline", f"vs {reference}", "reuse", "content", "recompute", "greedy match", "KL mean",
               "logprob delta"]
    header += [f"acc {m}" for m in acc_modes]
    lines += ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    for run in runs:
        r = run.row
        spread = fmt_spread(r["ttft_ms_p50"], r["ttft_ms_p10"], r["ttft_ms_p90"])
        cells = [_md_escape(run.label), _g(r["n"], "d"), spread]
        if len(turns) > 1:
            cells += [fmt_ms(r[f"ttft_ms_p50_turn{t}"]) for t in turns]
        for name in ("baseline", reference):
            lo, hi = r[f"speedup_vs_{name}_ci_lo"], r[f"speedup_vs_{name}_ci_hi"]
            cells.append(fmt_speedup(r[f"speedup_vs_{name}"], [lo, hi] if lo is not None and hi is not None else None))
        cells += [_pct(r["reuse_ratio"]), _pct(r["content_ratio"]), _pct(r["recompute_ratio"]),
                  _pct(r["greedy_match_rate"]), _g(r["first_token_kl_mean"]),
                  _g(r["answer_logprob_delta_mean"], "+.3g")]
        cells += [_pct(r[f"accuracy_{m}"]) for m in acc_modes]
        lines.append("| " + " | ".join(cells) + " |")
    def where(path: Path) -> str:
        if out_dir is None:
            return str(path)
        try:
            return os.path.relpath(path, out_dir)
        except ValueError:  # another drive (Windows)
            return str(path)

    lines += ["", "Runs:", ""] + [f"- {_md_escape(run.label)}: `{where(run.path)}`" for run in runs]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------------------- plots
def _figure(size: tuple[float, float] = (8, 5)) -> tuple[Any, Any]:
    # Figure + Agg canvas directly, as in kvboost/lab/report.py: no pyplot global state
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _plot_by_turn(runs: Sequence[Run], mode: str, key: str, path: Path, *, title: str, ylabel: str,
                  band: tuple[str, str] | None = None, percent: bool = False) -> Path:
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    fig, ax = _figure()
    styles = line_styles([r.label for r in runs])
    for run in runs:
        by_turn = _get(run.summary, "modes", mode, "by_turn") or {}
        pts = sorted((int(t), s) for t, s in by_turn.items() if str(t).isdigit() and s.get(key) is not None)
        if not pts:
            continue
        (line,) = ax.plot([t for t, _ in pts], [s[key] for _, s in pts], label=run.label, **styles[run.label])
        if band:
            b = [(t, s[band[0]], s[band[1]]) for t, s in pts
                 if s.get(band[0]) is not None and s.get(band[1]) is not None]
            if b:
                ax.fill_between([x[0] for x in b], [x[1] for x in b], [x[2] for x in b], color=line.get_color(),
                                alpha=0.12, linewidth=0)
    ax.set_title(title)
    ax.set_xlabel("turn")
    ax.set_ylabel(ylabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if percent:
        ax.set_ylim(-0.02, 1.02)
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    else:
        ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    return path


def _plot_by_run(runs: Sequence[Run], key: str, path: Path, *, title: str, ylabel: str,
                 spread: tuple[str, str] | None = None, percent: bool = False, baseline_key: str | None = None) -> Path:
    from matplotlib.ticker import PercentFormatter

    fig, ax = _figure((max(6.0, 1.2 * len(runs) + 2), 5))
    x = list(range(len(runs)))
    values = [run.row.get(key) for run in runs]
    ax.bar(x, [v or 0.0 for v in values], color=[f"C{i % 10}" for i in x], alpha=0.8)
    if spread:
        err = [[v - run.row[spread[0]], run.row[spread[1]] - v]
               if v is not None and run.row.get(spread[0]) is not None and run.row.get(spread[1]) is not None
               else [0.0, 0.0] for v, run in zip(values, runs)]
        ax.errorbar(x, [v or 0.0 for v in values], yerr=[[e[0] for e in err], [e[1] for e in err]], fmt="none",
                    ecolor="black", capsize=5)
    if baseline_key:
        pts = [(i, v) for i, run in enumerate(runs) if (v := run.row.get(baseline_key)) is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], linestyle="none", marker="_", markersize=30,
                    markeredgewidth=2, color="black", label="baseline p50 (same run)")
            ax.legend(fontsize=8, markerscale=0.4)
    ax.set_xticks(x, [r.label for r in runs], rotation=20, ha="right", fontsize=8)
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    if percent:
        ax.set_ylim(0, 1.02)
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    else:
        ax.set_ylim(bottom=0)
    ax.grid(True, axis="y", alpha=0.3)
    fig.savefig(path, dpi=120)
    return path


def _plot_quality(runs: Sequence[Run], mode: str, x_kind: str, path: Path) -> Path:
    fig, ax = _figure()
    use_acc = any(run.row.get(f"accuracy_{mode}") is not None for run in runs)
    y_key = f"accuracy_{mode}" if use_acc else "first_token_kl_mean"
    if x_kind == "speedup":
        x_key, lo_key, hi_key = "speedup_vs_baseline", "speedup_vs_baseline_ci_lo", "speedup_vs_baseline_ci_hi"
        xlabel = f"{mode} speedup vs baseline (TTFT p50 ratio; bars: 95% interval)"
    else:
        x_key, lo_key, hi_key = "ttft_ms_p50", "ttft_ms_p10", "ttft_ms_p90"
        xlabel = f"{mode} TTFT p50 (ms; bars: p10 to p90)"
    ys = []
    for i, run in enumerate(runs):
        x, y = run.row.get(x_key), run.row.get(y_key)
        if x is None or y is None:
            continue
        ys.append(y)
        lo, hi = run.row.get(lo_key), run.row.get(hi_key)
        xerr = [[x - lo], [hi - x]] if lo is not None and hi is not None else None
        ax.errorbar([x], [y], xerr=xerr, fmt="o", color=f"C{i % 10}", capsize=4, markersize=7)
        ax.annotate(run.label, (x, y), xytext=(6, 6), textcoords="offset points", fontsize=8)

    if x_kind == "speedup":
        ax.axvline(1.0, color="grey", linestyle="--", linewidth=1, label="baseline (full prefill)")
    else:
        base = [v for r in runs if (v := _get(r.summary, "modes", r.summary.get("baseline_mode", "baseline"),
                                              "overall", "ttft_ms_p50")) is not None]
        if base:
            ax.axvline(sorted(base)[len(base) // 2], color="grey", linestyle="--", linewidth=1,
                       label="baseline TTFT p50 (full prefill)")
    if use_acc:
        base_acc = [v for r in runs if (v := _get(r.summary, "accuracy", r.summary.get("baseline_mode", "baseline"),
                                                  "accuracy")) is not None]
        if base_acc:
            ax.axhline(sum(base_acc) / len(base_acc), color="black", linestyle=":", linewidth=1,
                       label="baseline accuracy")
        ax.set_ylabel(f"{mode} accuracy")
        from matplotlib.ticker import PercentFormatter

        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
        title = "Accuracy vs time to first token, one point per run"
    else:
        ax.set_ylabel(f"{mode} first-token KL vs baseline (mean)")
        positive = [y for y in ys if y > 0]
        if positive and max(positive) / min(positive) > 100:  # spans orders of magnitude (exact recompute ~0)
            if len(positive) == len(ys):
                ax.set_yscale("log")
            else:
                ax.set_yscale("symlog", linthresh=min(positive))
        title = "Quality (first-token KL, lower is better) vs time to first token, one point per run"
    if not ys:
        ax.text(0.5, 0.5, f"no run has both {x_key} and {y_key} for mode {mode}", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
    return path


def plot_comparison(runs: Sequence[Run], mode: str, out: Path, *, x_kind: str = "ttft") -> list[Path]:
    multi_turn = len(_turns(runs, mode)) > 1
    if multi_turn:
        paths = [
            _plot_by_turn(runs, mode, "ttft_ms_p50", out / "ttft_by_turn.png", band=("ttft_ms_p10", "ttft_ms_p90"),
                          title=f"{mode}: time to first token by turn (line: p50, band: p10 to p90)",
                          ylabel="TTFT (ms)"),
            _plot_by_turn(runs, mode, "reuse_ratio", out / "reuse_by_turn.png", percent=True,
                          title=f"{mode}: prompt tokens served from cache by turn (mean)", ylabel="reuse ratio"),
        ]
    else:
        paths = [
            _plot_by_run(runs, "ttft_ms_p50", out / "ttft_by_run.png", spread=("ttft_ms_p10", "ttft_ms_p90"),
                         baseline_key="baseline_ttft_ms_p50",
                         title=f"{mode}: time to first token per run (bar: p50, whiskers: p10 to p90)",
                         ylabel="TTFT (ms)"),
            _plot_by_run(runs, "reuse_ratio", out / "reuse_by_run.png", percent=True,
                         title=f"{mode}: prompt tokens served from cache per run (mean)", ylabel="reuse ratio"),
        ]
    paths.append(_plot_quality(runs, mode, x_kind, out / "quality_vs_ttft.png"))
    return paths


# ---------------------------------------------------------------------------------------------------- api
def compare(dirs: Sequence[str | os.PathLike], out: str | os.PathLike | None = None, *, mode: str = DEFAULT_MODE,
            reference: str = DEFAULT_REFERENCE, x: str = "ttft") -> dict[str, Any]:
    """Compare the runs in ``dirs``; write comparison.md, comparison.csv and the plots into ``out``.

    Returns {"runs": [Run...], "markdown": str, "paths": [Path...]}. Raises CompareError (message names
    the folder or mode) when there is nothing to compare; corrupt summaries are skipped with a
    SummaryWarning naming the file."""
    if x not in ("ttft", "speedup"):
        raise CompareError(f"x must be 'ttft' or 'speedup', got {x!r}")
    runs = load_runs(find_summaries(dirs))
    columns = build_rows(runs, mode, reference)
    if out is None:
        single = Path(dirs[0]) if len(dirs) == 1 else None
        out = "." if single is None else single if single.is_dir() else single.parent
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    markdown = format_markdown(runs, columns, mode, reference, out_dir)
    md_path = out_dir / "comparison.md"
    md_path.write_text(markdown, encoding="utf-8")
    csv_path = write_csv(runs, columns, out_dir / "comparison.csv")
    plots = plot_comparison(runs, mode, out_dir, x_kind=x)
    return {"runs": runs, "markdown": markdown, "paths": [md_path, csv_path, *plots]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvboost-compare",
        description="Compare kvboost runs (Hydra multirun folders or run folders): a table per run and plots.")
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="a multirun folder, a run folder or a summary.json")
    parser.add_argument("--out", default=None, help="output folder (default: the one DIR given, else the current one)")
    parser.add_argument("--mode", default=DEFAULT_MODE, help=f"the mode compared across runs (default {DEFAULT_MODE})")
    parser.add_argument("--reference", default=DEFAULT_REFERENCE,
                        help=f"the second reference mode for speedups (default {DEFAULT_REFERENCE})")
    parser.add_argument("--x", choices=("ttft", "speedup"), default="ttft",
                        help="x axis of quality_vs_ttft.png: TTFT p50 ms or speedup vs baseline (default ttft)")
    args = parser.parse_args(argv)
    result, error = None, ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", SummaryWarning)
        try:
            result = compare(args.dirs, args.out, mode=args.mode, reference=args.reference, x=args.x)
        except CompareError as exc:
            error = str(exc)
    for w in caught:
        if issubclass(w.category, SummaryWarning):
            print(f"warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if result is None:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    print(result["markdown"])
    for path in result["paths"]:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
