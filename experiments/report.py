"""Results of a run: per-request records -> aggregates, a terminal table, PNG plots, summary.json.

A record is one request (one turn of one conversation under one mode), a flat dict with at least
``conversation_id``, ``turn`` (1-based), ``mode`` and the metrics of DESIGN.md ("Metrics"): ``ttft_ms``,
``total_ms``, ``store_ms``, ``decode_tok_s``, ``prompt_tokens``, ``generated_tokens``, ``reuse_ratio``,
``exact_ratio``, ``content_ratio``, ``recompute_ratio``; modes measured against a cold prefill also carry
``greedy_match`` (bool), ``first_token_kl`` (float) and ``first_divergence`` (int, or None: no divergence).

Every metric is optional per record: a record without it (or with None/NaN) is skipped for that metric
only, and an aggregate with no values is None. Modes may cover different turns.

Typical use at the end of a run::

    write_records(records, out / "records.jsonl")
    summary = summarize(records)
    print(format_table(summary))
    plot_summary(summary, out)
    write_summary(summary, out / "summary.json")
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

# Aggregates per (mode, turn) and per mode overall: output key -> (record field, statistic).
_STAT_FIELDS: dict[str, tuple[str, str]] = {
    "ttft_ms_p50": ("ttft_ms", "p50"),
    "ttft_ms_p90": ("ttft_ms", "p90"),
    "ttft_ms_mean": ("ttft_ms", "mean"),
    "total_ms_p50": ("total_ms", "p50"),
    "store_ms_p50": ("store_ms", "p50"),
    "decode_tok_s_p50": ("decode_tok_s", "p50"),
    "prompt_tokens_mean": ("prompt_tokens", "mean"),
    "generated_tokens_mean": ("generated_tokens", "mean"),
    "reuse_ratio": ("reuse_ratio", "mean"),
    "exact_ratio": ("exact_ratio", "mean"),
    "content_ratio": ("content_ratio", "mean"),
    "recompute_ratio": ("recompute_ratio", "mean"),
}
_QUALITY_FIELDS = ("greedy_match", "first_token_kl", "first_divergence")


# ------------------------------------------------------------------------------------------------ records
def _json_default(obj: Any) -> Any:
    # numpy / torch scalars and paths show up in records; store them as plain JSON values
    if hasattr(obj, "item") and callable(obj.item):
        value = obj.item()
        return None if isinstance(value, float) and not math.isfinite(value) else value
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON serializable")


def _finite_or_none(obj: Any) -> Any:
    """Replace NaN/inf (not valid JSON) with None, recursively."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, Mapping):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


def write_records(records: Iterable[Mapping[str, Any]], path: str | os.PathLike, *, append: bool = False) -> Path:
    """Write records as JSON Lines (one request per line). ``append=True`` adds to an existing file, so a
    runner can flush records as they come and lose nothing if it crashes. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a" if append else "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(_finite_or_none(dict(record)), default=_json_default, allow_nan=False) + "\n")
    return path


def read_records(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read a JSON Lines records file (blank lines ignored). Raises ValueError naming the bad line."""
    records = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not a JSON record ({exc.msg})") from exc
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
            records.append(record)
    return records


# --------------------------------------------------------------------------------------------- statistics
def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks (numpy's default).
    None for an empty sequence."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


_STATISTICS: dict[str, Callable[[Sequence[float]], float | None]] = {
    "p50": lambda v: percentile(v, 50),
    "p90": lambda v: percentile(v, 90),
    "mean": _mean,
}


def _as_float(value: Any) -> float | None:
    """A finite float from a record value (bool, int, float, numpy/torch scalar), else None."""
    if hasattr(value, "item") and not isinstance(value, (int, float)):
        value = value.item()
    if isinstance(value, (int, float)):  # bool is an int: True -> 1.0 for rates
        f = float(value)
        return f if math.isfinite(f) else None
    return None


def _values(records: Iterable[Mapping[str, Any]], name: str) -> list[float]:
    """The usable values of one field: missing, None, NaN and non-numbers are skipped."""
    return [f for r in records if (f := _as_float(r.get(name))) is not None]


def _stats(records: list[Mapping[str, Any]]) -> dict[str, Any]:
    stats: dict[str, Any] = {key: _STATISTICS[stat](_values(records, name))
                             for key, (name, stat) in _STAT_FIELDS.items()}
    stats["n"] = len(records)
    if any("greedy_match" in r for r in records):
        stats["greedy_match_rate"] = _mean(_values(records, "greedy_match"))
    return stats


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _quality(records: list[Mapping[str, Any]]) -> dict[str, Any]:
    with_quality = [r for r in records if any(f in r for f in _QUALITY_FIELDS)]
    kl = _values(with_quality, "first_token_kl")
    # first_divergence present and None means "never diverged"; absent means "not measured"
    measured_div = [r for r in with_quality if "first_divergence" in r]
    divergences = _values(measured_div, "first_divergence")
    return {
        "greedy_match_rate": _mean(_values(with_quality, "greedy_match")),
        "first_token_kl_max": max(kl) if kl else None,
        "first_token_kl_mean": _mean(kl),
        "first_divergence_min": int(min(divergences)) if divergences else None,
        "n_diverged": len(divergences),
        "n": len(with_quality),
    }


def _turn_of(record: Mapping[str, Any]) -> int:
    try:
        return int(record["turn"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"record without a usable integer 'turn': {dict(record)!r:.200}") from exc


def summarize(records: Iterable[Mapping[str, Any]], *, baseline_mode: str = "baseline") -> dict[str, Any]:
    """Aggregate per-request records per mode, per turn and overall, plus quality per mode.

    Returns::

        {"modes": {MODE: {"by_turn": {"1": {...}, "2": {...}}, "overall": {...}}},
         "quality": {MODE: {"greedy_match_rate", "first_token_kl_max", "first_token_kl_mean",
                            "first_divergence_min", "n_diverged", "n"}},
         "baseline_mode": baseline_mode}

    Each stats dict has ``ttft_ms_p50/p90/mean``, ``total_ms_p50``, ``store_ms_p50``,
    ``decode_tok_s_p50``, ``prompt_tokens_mean``, ``generated_tokens_mean``, mean ``reuse_ratio``,
    ``exact_ratio``, ``content_ratio``, ``recompute_ratio``, ``n``, ``speedup_vs_baseline_p50`` (baseline
    TTFT p50 / this mode's, same turn; None where the baseline lacks the turn) and, for modes with quality
    fields, ``greedy_match_rate``. ``overall`` adds ``reuse_ratio_turns_ge2`` (mean over turns >= 2, where
    reuse is possible); its speedup compares TTFT p50s over the turns both modes have, so a mode missing
    turns is not credited for the turns' different lengths. Percentiles interpolate linearly.
    Turn keys are strings (JSON object keys) in numeric order. ``quality`` only lists modes whose records
    carry at least one quality field.
    """
    by_mode: dict[str, list[Mapping[str, Any]]] = {}
    for r in records:
        if "mode" not in r:
            raise ValueError(f"record without 'mode': {dict(r)!r:.200}")
        by_mode.setdefault(str(r["mode"]), []).append(r)

    def by_turn(recs: list[Mapping[str, Any]]) -> dict[int, list[Mapping[str, Any]]]:
        groups: dict[int, list[Mapping[str, Any]]] = {}
        for r in recs:
            groups.setdefault(_turn_of(r), []).append(r)
        return dict(sorted(groups.items()))

    base_turns = by_turn(by_mode.get(baseline_mode, []))
    base_p50 = {t: percentile(_values(rs, "ttft_ms"), 50) for t, rs in base_turns.items()}

    modes: dict[str, Any] = {}
    quality: dict[str, Any] = {}
    for mode, recs in by_mode.items():
        turns = by_turn(recs)
        per_turn = {}
        for t, rs in turns.items():
            stats = _stats(rs)
            stats["speedup_vs_baseline_p50"] = _ratio(base_p50.get(t), stats["ttft_ms_p50"])
            per_turn[str(t)] = stats

        overall = _stats(recs)
        overall["reuse_ratio_turns_ge2"] = _mean(_values([r for r in recs if _turn_of(r) >= 2], "reuse_ratio"))
        common = [t for t in turns if t in base_turns]
        if common:
            base_ttft = _values([r for t in common for r in base_turns[t]], "ttft_ms")
            mode_ttft = _values([r for t in common for r in turns[t]], "ttft_ms")
            overall["speedup_vs_baseline_p50"] = _ratio(percentile(base_ttft, 50), percentile(mode_ttft, 50))
        else:
            overall["speedup_vs_baseline_p50"] = None
        modes[mode] = {"by_turn": per_turn, "overall": overall}

        if any(f in r for r in recs for f in _QUALITY_FIELDS):
            quality[mode] = _quality(recs)
    return {"modes": modes, "quality": quality, "baseline_mode": baseline_mode}


# ------------------------------------------------------------------------------------------------- table
def _ordered_modes(summary: Mapping[str, Any]) -> list[str]:
    """Baseline first, then the other modes in the order they appeared."""
    modes = list(summary.get("modes", {}))
    base = summary.get("baseline_mode", "baseline")
    return ([base] if base in modes else []) + [m for m in modes if m != base]


def _turn_keys(summary: Mapping[str, Any]) -> list[str]:
    keys = {k for m in summary.get("modes", {}).values() for k in m.get("by_turn", {})}
    return sorted(keys, key=_natural_key)


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:{spec}}{suffix}"


def format_table(summary: Mapping[str, Any]) -> str:
    """A plain-text table for the terminal: one row per turn plus an ``overall`` row.

    Columns, per mode (baseline first): TTFT p50 in ms, speedup of TTFT p50 vs the baseline, mean reuse
    ratio; then the greedy-match rate of each mode that measured quality. Below the table, one line per
    such mode with its overall quality aggregates. Missing values print as ``-``; a summary without
    records prints ``(no records)``.
    """
    modes = _ordered_modes(summary)
    if not modes:
        return "(no records)"
    quality = summary.get("quality", {})
    quality_modes = [m for m in modes if m in quality]

    # columns: (group header, column header, getter(stats dict) -> str)
    columns: list[tuple[str, str, Callable[[Mapping[str, Any]], str]]] = []
    for mode in modes:
        columns += [
            (mode, "TTFT p50 ms", lambda s: _fmt(s.get("ttft_ms_p50"), ".1f")),
            (mode, "speedup", lambda s: _fmt(s.get("speedup_vs_baseline_p50"), ".2f", "x")),
            (mode, "reuse", lambda s: _fmt(s.get("reuse_ratio"), ".1%")),
        ]
    for mode in quality_modes:
        columns.append(("greedy match", mode, lambda s: _fmt(s.get("greedy_match_rate"), ".0%")))

    def stats_for(mode: str, row: str) -> Mapping[str, Any]:
        m = summary["modes"].get(mode, {})
        return m.get("overall", {}) if row == "overall" else m.get("by_turn", {}).get(row, {})

    rows = _turn_keys(summary) + ["overall"]
    # a greedy-match column belongs to its mode's stats, not the group's name
    owner = [g if g != "greedy match" else h for g, h, _ in columns]
    cells = [[get(stats_for(owner[i], row)) for i, (_, _, get) in enumerate(columns)] for row in rows]

    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, (_, h, _) in enumerate(columns)]
    # widen the last column of a group when the group name is longer than its columns together
    groups: list[tuple[str, list[int]]] = []
    for i, (g, _, _) in enumerate(columns):
        if groups and groups[-1][0] == g:
            groups[-1][1].append(i)
        else:
            groups.append((g, [i]))
    for g, idx in groups:
        span = sum(widths[i] for i in idx) + 2 * (len(idx) - 1)
        if len(g) > span:
            widths[idx[-1]] += len(g) - span

    turn_w = max(len("turn"), *(len(r) for r in rows))
    sep = " | "
    group_line = " " * turn_w + sep + sep.join(
        g.center(sum(widths[i] for i in idx) + 2 * (len(idx) - 1)) for g, idx in groups)
    header_line = "turn".ljust(turn_w) + sep + sep.join(
        "  ".join(columns[i][1].rjust(widths[i]) for i in idx) for _, idx in groups)
    rule = "-" * len(header_line)
    lines = [group_line.rstrip(), header_line, rule]
    for row, row_cells in zip(rows, cells):
        if row == "overall":
            lines.append(rule)
        lines.append(row.ljust(turn_w) + sep + sep.join(
            "  ".join(row_cells[i].rjust(widths[i]) for i in idx) for _, idx in groups))

    for mode in quality_modes:
        q = quality[mode]
        first_div = q.get("first_divergence_min")
        lines.append(
            f"{mode}: greedy match {_fmt(q.get('greedy_match_rate'), '.1%')}, first-token KL max "
            f"{_fmt(q.get('first_token_kl_max'), '.3g')} mean {_fmt(q.get('first_token_kl_mean'), '.3g')}, "
            f"first divergence min {'none' if first_div is None else first_div}"
            f" ({q.get('n_diverged', 0)} of {q.get('n', 0)} requests diverged)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- plots
def _series(summary: Mapping[str, Any], mode: str, key: str) -> tuple[list[int], list[float]]:
    by_turn = summary["modes"][mode].get("by_turn", {})
    pts = [(int(t), s[key]) for t, s in by_turn.items() if s.get(key) is not None]
    pts.sort()
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_summary(summary: Mapping[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """Write ``ttft_by_turn.png`` (TTFT p50 per turn per mode, band up to p90) and ``reuse_by_turn.png``
    (mean reuse ratio per turn per mode) into ``out_dir``; returns their paths."""
    # Figure + Agg canvas directly: no pyplot global state, no backend switch for the caller's process
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    modes = _ordered_modes(summary)
    # modes with equal numbers overlap exactly (e.g. hf_prefix and kvboost reuse); distinct markers and
    # dash styles keep every mode visible
    styles = {m: dict(marker="osD^vP*X"[i % 8], linestyle=("-", "--", "-.", ":")[i % 4])
              for i, m in enumerate(modes)}
    paths = []

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for mode in modes:
        turns, p50 = _series(summary, mode, "ttft_ms_p50")
        if not turns:
            continue
        (line,) = ax.plot(turns, p50, label=f"{mode} p50", **styles[mode])
        # the band only where p90 is known; it shows the slow tail without cluttering with error caps
        band = [(t, lo, s) for t, lo in zip(turns, p50)
                if (s := summary["modes"][mode]["by_turn"][str(t)].get("ttft_ms_p90")) is not None]
        if band:
            ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band],
                            color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_title("Time to first token by turn (line: p50, band: p50 to p90)")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_ylim(bottom=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend()
    path = out / "ttft_by_turn.png"
    fig.savefig(path, dpi=120)
    paths.append(path)

    fig = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for mode in modes:
        turns, reuse = _series(summary, mode, "reuse_ratio")
        if turns:
            ax.plot(turns, reuse, label=mode, **styles[mode])
    ax.set_title("Prompt tokens served from cache by turn (mean)")
    ax.set_xlabel("turn")
    ax.set_ylabel("reuse ratio")
    ax.set_ylim(-0.02, 1.02)
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if ax.lines:
        ax.legend()
    path = out / "reuse_by_turn.png"
    fig.savefig(path, dpi=120)
    paths.append(path)
    return paths


# ------------------------------------------------------------------------------------------------ summary
def _natural_key(key: Any) -> tuple:
    # turn keys "1", "2", "10" sort as numbers; other keys alphabetically after them
    s = str(key)
    return (0, int(s), "") if s.isdigit() else (1, 0, s)


def _sorted_naturally(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _sorted_naturally(obj[k]) for k in sorted(obj, key=_natural_key)}
    if isinstance(obj, (list, tuple)):
        return [_sorted_naturally(v) for v in obj]
    return obj


def write_summary(summary: Mapping[str, Any], path: str | os.PathLike) -> Path:
    """Write the summary as JSON (indent 2). Keys are sorted, turn keys numerically ("2" before "10");
    NaN/inf become null so the file is strict JSON. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_sorted_naturally(_finite_or_none(summary)), indent=2, default=_json_default,
                      allow_nan=False)
    path.write_text(text + "\n", encoding="utf-8")
    return path
