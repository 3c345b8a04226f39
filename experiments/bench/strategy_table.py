"""The content-reuse leaderboard: recompute strategies x workloads x models x budgets, one loaded model at a time.

Usage (from the repository root)::

    python -m experiments.bench.strategy_table --out experiments/results/strategy_table/my_run \\
        --models smollm2 qwen_coder_0_5b --workloads musique rag_reorder needle \\
        --ratios 0.05 0.1 0.15 0.3 --queries 20 --draws 0 1 2 \\
        --strategies none selective cacheblend query_aware epic key_temperature compose true_deviation full
    python -m experiments.bench.strategy_table --out ... --summarize-only        # rebuild tables / plots
    python -m experiments.bench.strategy_table --out ... --summarize-only --logger wandb   # and log them

What is compared. Per model (loaded once; the models one after another), per workload and draw
(``workload.seed``: the workload's own randomness, e.g. the passage order of ``musique``, the needle's position
and number in ``needle``, the corpus of ``rag_reorder``), every query runs once per *arm* in a shuffled order:
``baseline`` (HF, full prefill: the reference every score and TTFT is compared with) and kvboost with each
strategy. The strategies differ only in the engine's recompute plugin (swapped between requests); their requests
do not write the cache (``store=False``), so every arm reads the same stored passages and nothing one arm did
reaches another. The stored passages are the workload's own warm-up: its ``shared_context()`` before the draw's
first query (``rag_reorder``'s documents) and its ``request_context(request)`` right before each query (the
per-query passages of ``musique`` and ``needle``, ``workload.warm_passages=per_query``; the cache is emptied
first, so every query starts from the same cache), each warmed after the prompts' shared head, as
``python run.py`` warms them. Scores are the workload's own: token F1 for ``musique`` (``workload.score``),
exact match for ``needle`` and ``rag_reorder`` (``workload.is_correct``).

Workloads (``--workloads``): ``musique`` (the CacheBlend paper's layout: passages each its own chunk, the question
after them), ``needle`` (RULER-style, ~4k tokens generated in code, question at the end), ``rag_reorder`` (both
layouts: ``question_both`` and ``question_after``; ``rag_reorder:question_after`` for one). Any workload field
can be set per workload as ``name:key=value,...`` (``musique:num_passages=4,data_path=/data/2wikimqa.json``);
``--queries`` sets ``workload.num_queries`` for all.

Strategies (``--strategies``): ``name`` or ``name:key=value,key=value`` where ``name`` is a recompute config
(``kvboost/configs/recompute/<name>.yaml``, or a plugin package's, found through the ``kvboost.plugins`` entry point with
no flag) and each ``key`` any field of it (dotted for nested ones), values in Hydra's override syntax:
``cacheblend:ratio=0.15,check_layers=[1]``, ``compose:first.k=8,ratio=0.2``, ``epic:k=32``. The old
``name:0.3`` means ``name:ratio=0.3``. A strategy whose config has a ``ratio`` field and whose spec does not set
it runs once per ``--ratios`` value (default 0.05 0.1 0.15 0.3); the others (``none``, ``selective``, ``epic``,
``key_temperature``, ``full``) run once. ``--oracle-agreement`` sets ``oracle_agreement=true`` on every strategy
whose config has that field (a full prefill per request after the strategy's, kept out of TTFT): the table then reports how
well each selector agrees with the true-deviation reference's selection (``oracle_recall`` at the budget,
``oracle_rank_corr``: the field names predate the rename; the tables say "deviation recall").
A strategy is *query-aware* when it reads the question (it needs the reader-attention probe or a full
prefill: ``query_aware``, ``true_deviation``, ``compose`` when a part does); else query-agnostic.

Outputs in ``--out``:

- ``records.jsonl``: one line per query and arm, written as each query finishes (an interrupted run keeps what
  it measured, and Ctrl-C writes the tables of what finished; ``--append`` adds draws or models to it;
  ``--summarize-only`` rebuilds everything below from it);
- per model and workload (``<workload>__<model>``): ``.md``, the table: per arm the score with its 95% interval
  (Wilson for exact match, bootstrap for F1), the difference from the full prefill with a paired bootstrap 95%
  interval over queries, the TTFT speedup (the median over queries of each query's baseline TTFT / arm TTFT, both
  timed back to back in one process, with a bootstrap 95% interval), the measured recompute ratio, the selector's
  oracle agreement, greedy match and first-token KL against the baseline, and per draw speedup / score; ``.png``,
  score vs recompute budget, query-agnostic and query-aware strategies in two panels (solid vs dashed), the full
  prefill's score as a horizontal line (ratio-driven strategies at their configured ratio, the others at their
  measured fraction of reused (token, layer) pairs recomputed);
- ``summary.json``: all of it as numbers (and the plot data); ``summary.md``: per workload and model, the best
  strategy at each ratio, and whether any strategy at >= 2.5x TTFT is at parity with the full prefill's score
  (two-sided TOST by question, margin 0.02: a large gain is not parity);
- ``--logger wandb``: one W&B run (``kvboost/configs/logger/wandb.yaml``, offline unless configured) with the leaderboard
  as a ``wandb.Table`` (all cells, and one per cell) and the plots as images.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.common import add_threads_arg, percentile, set_threads, write_json, write_markdown
from kvboost.lab.report import bootstrap_median_ci, paired_difference_ci, wilson_interval

BASELINE = "baseline"
FULL = "full"
DEFAULT_MODELS = ("smollm2",)
DEFAULT_WORKLOADS = ("musique", "rag_reorder", "needle")
DEFAULT_RATIOS = (0.05, 0.1, 0.15, 0.3)
DEFAULT_STRATEGIES = ("none", "selective", "cacheblend", "query_aware", "epic", "key_temperature", "compose",
                      "true_deviation", "full")  # fmt: skip
#: the score each workload is ranked by; another workload: ``f1`` where its ``score()`` gives one, else exact match
PRIMARY_SCORE = {"musique": "f1", "needle": "correct", "rag_reorder": "correct"}
#: ``NAME:VALUE`` (no ``=``) sets this field: the old ``cacheblend:0.3`` form, and ``rag_reorder:question_after``
SHORTHAND = {"strategy": "ratio", "workload": "layout"}
#: ``rag_reorder`` without a layout runs both
WORKLOAD_EXPANSIONS = {"rag_reorder": ("layout", ("question_both", "question_after"))}
SCORE_LABELS = {"correct": "exact match", "f1": "token F1"}
SPEEDUP_TARGET = 2.5
#: the equivalence margin of the parity verdict: an arm is at parity with the full prefill when a two-sided TOST
#: of its per-question score differences (draws averaged per question) shows them within +-PARITY at alpha 0.05
#: (``kvboost.lab.fidelity_stats.tost``); a large gain is not parity (issue 59: "within 0.03" counted it)
PARITY = 0.02

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*\Z")
_KEY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")
_OPEN, _CLOSE = "[{(", "]})"


# ------------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class Spec:
    """A parsed ``name`` / ``name:key=value,...`` (``fields`` in the order given, values as Hydra override text)."""

    name: str
    fields: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        return self.name + (":" + ",".join(f"{k}={v}" for k, v in self.fields) if self.fields else "")

    def get(self, key: str) -> str | None:
        return dict(self.fields).get(key)

    def with_field(self, key: str, value: str) -> Spec:
        return Spec(self.name, (*((k, v) for k, v in self.fields if k != key), (key, value)))

    def overrides(self, group: str) -> list[str]:
        """Hydra overrides: ``["<group>=<name>", "<group>.<key>=<value>", ...]``."""
        return [f"{group}={self.name}", *(f"{group}.{k}={v}" for k, v in self.fields)]


def _split_top_level(text: str, spec: str, what: str) -> list[str]:
    """``text`` split at the commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, "", 0
    for i, ch in enumerate(text):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth < 0:
                raise ValueError(f"{what} {spec!r}: unbalanced {ch!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth or quote:
        raise ValueError(f"{what} {spec!r}: unbalanced brackets or quotes")
    parts.append(text[start:])
    return parts


def parse_spec(spec: str, what: str = "strategy") -> Spec:
    """``name``, ``name:key=value,key=value`` (values may hold lists: ``check_layers=[1,2]``) or the shorthand
    ``name:value`` (:data:`SHORTHAND`: a strategy's ratio, a workload's layout). ValueError naming the spec."""
    form = f"expected NAME or NAME:key=value,key=value (or NAME:{SHORTHAND[what].upper()})"
    name, colon, rest = spec.strip().partition(":")
    if not name:
        raise ValueError(f"{what} {spec!r}: no name; {form}")
    if not _NAME.match(name):
        raise ValueError(f"{what} {spec!r}: {name!r} is not a config name; {form}")
    if colon and not rest.strip():
        raise ValueError(f"{what} {spec!r}: nothing after ':'; {form}")
    if not colon:
        return Spec(name)
    if "=" not in rest:  # the shorthand
        key = SHORTHAND[what]
        return Spec(name, ((key, _checked(spec, what, key, rest.strip())),))
    fields: dict[str, str] = {}
    for item in _split_top_level(rest, spec, what):
        key, eq, value = item.strip().partition("=")
        key, value = key.strip(), value.strip()
        if not item.strip():
            raise ValueError(f"{what} {spec!r}: an empty field (two commas, or a trailing one)")
        if not eq:
            raise ValueError(f"{what} {spec!r}: {item.strip()!r} is not key=value; {form}")
        if not _KEY.match(key):
            raise ValueError(f"{what} {spec!r}: {key!r} is not a field name")
        if not value:
            raise ValueError(f"{what} {spec!r}: no value for {key!r}")
        if key in fields:
            raise ValueError(f"{what} {spec!r}: {key!r} is set twice")
        fields[key] = _checked(spec, what, key, value)
    return Spec(name, tuple(fields.items()))


def _checked(spec: str, what: str, key: str, value: str) -> str:
    if what == "strategy" and key == "ratio" and value != "null":
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"strategy {spec!r}: the ratio {value!r} is not a number") from None
        if not 0.0 < number <= 1.0:
            raise ValueError(f"strategy {spec!r}: the ratio must be in (0, 1], got {value}")
    return value


def strategy_overrides(spec: str) -> list[str]:
    """``"cacheblend:0.3"`` -> ``["recompute=cacheblend", "recompute.ratio=0.3"]``;
    ``"cacheblend:ratio=0.15,check_layers=[1]"`` -> ``[..., "recompute.ratio=0.15", "recompute.check_layers=[1]"]``."""
    return parse_spec(spec, "strategy").overrides("recompute")


def expand_workloads(specs: list[str]) -> list[Spec]:
    """Parsed workload specs, ``rag_reorder`` without a layout as one spec per layout (duplicates dropped)."""
    out: list[Spec] = []
    for text in specs:
        spec = parse_spec(text, "workload")
        expansion = WORKLOAD_EXPANSIONS.get(spec.name)
        if expansion and spec.get(expansion[0]) is None:
            key, values = expansion
            candidates = [Spec(spec.name, ((key, v), *spec.fields)) for v in values]
        else:
            candidates = [spec]
        out.extend(c for c in candidates if c not in out)
    return out


def workload_label(spec: Spec) -> str:
    """A workload's name in records, tables and file names: its config name, and its layout where it has one
    (``musique``, ``rag_reorder:question_after``); other fields (a data path, sizes) are in ``summary.json``."""
    layout = spec.get("layout")
    return spec.name + (f":{layout}" if layout else "")


def workload_labels(specs: list[Spec]) -> dict[str, Spec]:
    """``{label: spec}``; ValueError where two specs would share a label (their records would mix)."""
    out: dict[str, Spec] = {}
    for spec in specs:
        label = workload_label(spec)
        if label in out:
            raise ValueError(f"workloads {out[label].label!r} and {spec.label!r} would share the label {label!r}: "
                             "run them in separate invocations (--out)")  # fmt: skip
        out[label] = spec
    return out


@dataclass(frozen=True)
class Arm:
    """One strategy at one setting: what its records are labelled with, and how it is plotted."""

    label: str
    name: str
    overrides: tuple[str, ...]
    ratio: float | None  # the configured budget of a ratio-driven strategy (None: the strategy has no ratio)
    query_aware: bool


def expand_strategies(specs: list[str], ratios: list[float], has_ratio: Any) -> list[Spec]:
    """Parsed strategy specs; one per ``ratios`` value for those whose config has a ``ratio`` field
    (``has_ratio(spec)``) and whose spec does not set it. Duplicates dropped, order kept."""
    out: list[Spec] = []
    for text in specs:
        spec = parse_spec(text, "strategy")
        if spec.get("ratio") is None and ratios and has_ratio(spec):
            candidates = [spec.with_field("ratio", _ratio_text(r)) for r in ratios]
        else:
            candidates = [spec]
        out.extend(c for c in candidates if c not in out)
    return out


def _ratio_text(ratio: float) -> str:
    return f"{float(ratio):g}"


def is_query_aware(strategy: Any) -> bool:
    """Whether a strategy reads the question: it needs the reader-attention probe or the oracle's full prefill."""
    return bool(getattr(strategy, "needs_reader_attention", False) or getattr(strategy, "needs_reference", False))


# ---------------------------------------------------------------------------------------- summary
def _legacy(record: dict[str, Any]) -> dict[str, Any]:
    """Records of the rag_reorder-only table (no model / workload / score fields) read as this tool's."""
    if "score" not in record:
        record = {**record, "score": float(bool(record.get("correct"))), "score_name": "correct"}
    record.setdefault("workload", "rag_reorder")
    record.setdefault("model", "?")
    return record


def cell_key(workload: str, model: str) -> str:
    """The file stem of a (workload, model) cell: ``musique__smollm2``, ``rag_reorder-layout-question_after__...``."""
    return re.sub(r"[^A-Za-z0-9_.]+", "-", workload).strip("-") + "__" + re.sub(r"[^A-Za-z0-9_.]+", "-", model)


def split_cells(records: list[dict[str, Any]]) -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Records by (workload, model), in the order they first appear."""
    cells: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in records:
        r = _legacy(r)
        cells.setdefault((r["workload"], r["model"]), []).append(r)
    return cells


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One (workload, model) cell: per arm, per draw and pooled: speedup, score, difference from the baseline."""
    records = [_legacy(r) for r in records]
    by_key: dict[tuple[int, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        by_key[(r["draw"], r["query"])][r["arm"]] = r
    complete = {k: v for k, v in by_key.items() if BASELINE in v}
    arms = sorted({r["arm"] for r in records}, key=lambda a: (a != BASELINE, _arm_order(records, a)))
    draws = sorted({k[0] for k in complete})
    names = {r.get("score_name", "correct") for r in records}
    out: dict[str, Any] = {"draws": draws, "score_name": names.pop() if len(names) == 1 else "score",
                           "arms": {}, "arm_info": {}}  # fmt: skip
    for arm in arms:
        first = next(r for r in records if r["arm"] == arm)
        out["arm_info"][arm] = {"strategy": first.get("strategy", arm), "ratio": first.get("ratio"),
                                "query_aware": bool(first.get("query_aware", False))}  # fmt: skip
        rows: dict[str, Any] = {}
        for label, keys in [*((f"draw {d}", [k for k in complete if k[0] == d]) for d in draws),
                            ("pooled", list(complete))]:  # fmt: skip
            pairs = [(complete[k][BASELINE], complete[k][arm]) for k in sorted(keys) if arm in complete[k]]
            if pairs:
                rows[label] = _cell(pairs, arm, binary=out["score_name"] == "correct")
        out["arms"][arm] = rows
    return out


def _arm_order(records: list[dict[str, Any]], arm: str) -> int:
    for i, r in enumerate(records):
        if r["arm"] == arm:
            return r.get("arm_index", i)
    return 0


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _binary(values: list[float]) -> bool:
    return all(v in (0.0, 1.0) for v in values)


def _cell(pairs: list[tuple[dict[str, Any], dict[str, Any]]], arm: str, binary: bool = True) -> dict[str, Any]:
    base_ttft = [b["ttft_ms"] for b, _ in pairs]
    ttft = [s["ttft_ms"] for _, s in pairs]
    score = [float(s["score"]) for _, s in pairs]
    base_score = [float(b["score"]) for b, _ in pairs]
    correct = [float(bool(s.get("correct"))) for _, s in pairs]
    base_correct = [float(bool(b.get("correct"))) for b, _ in pairs]
    n, k = len(pairs), int(sum(correct))
    binary = binary and _binary(score) and _binary(base_score)  # exact match; F1 is graded even where 0 or 1
    cell: dict[str, Any] = {
        "n": n,
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p10": percentile(ttft, 10),
        "ttft_ms_p90": percentile(ttft, 90),
        "baseline_ttft_ms_p50": percentile(base_ttft, 50),
        "score": sum(score) / n,
        # exact match: Wilson; a graded score (F1): a bootstrap of the mean (a paired difference from zero)
        "score_ci": wilson_interval(int(sum(score)), n) if binary else paired_difference_ci(score, [0.0] * n),
        "baseline_score": sum(base_score) / n,
        "correct": k,
        "accuracy": k / n,
        "accuracy_ci": wilson_interval(k, n),
        "baseline_accuracy": sum(base_correct) / n,
    }
    if arm != BASELINE:
        ratios = [b / s for b, s in zip(base_ttft, ttft) if s > 0]
        cell["speedup"] = percentile(ratios, 50) if ratios else None
        cell["speedup_ci"] = bootstrap_median_ci(ratios)
        cell["score_diff"] = (sum(score) - sum(base_score)) / n
        cell["score_diff_ci"] = paired_difference_ci(score, base_score)
        cell["accuracy_diff"] = (sum(correct) - sum(base_correct)) / n
        cell["accuracy_diff_ci"] = paired_difference_ci(correct, base_correct)
        for name in ("recompute_ratio", "kv_reuse_ratio", "first_token_kl", "answer_logprob_delta", "oracle_recall",
                     "oracle_rank_corr"):  # fmt: skip
            values = [s[name] for _, s in pairs if isinstance(s.get(name), (int, float))]
            cell[f"{name}_mean"] = _mean(values)
        cell["oracle_n"] = sum(isinstance(s.get("oracle_recall"), (int, float)) for _, s in pairs)
        # the fraction of the reused (token, layer) pairs recomputed: what a ratio budgets
        used = [s["recompute_ratio"] / s["content_ratio"] for _, s in pairs
                if s.get("recompute_ratio") is not None and s.get("content_ratio")]  # fmt: skip
        cell["content_recomputed_mean"] = _mean(used)
        cell["greedy_match"] = sum(bool(s.get("greedy_match")) for _, s in pairs) / n
        cell["score_tost"] = _tost_by_question(pairs)
    return cell


def _tost_by_question(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """TOST of the arm's score against the baseline's, each question's draws averaged first: the question is the
    unit (passage orders of one question are not independent samples)."""
    from kvboost.lab.fidelity_stats import tost

    arm_q: dict[str, list[float]] = defaultdict(list)
    base_q: dict[str, list[float]] = defaultdict(list)
    for b, s in pairs:
        arm_q[str(s.get("query"))].append(float(s["score"]))
        base_q[str(b.get("query"))].append(float(b["score"]))
    return tost({q: sum(v) / len(v) for q, v in arm_q.items()}, {q: sum(v) / len(v) for q, v in base_q.items()},
                PARITY)


# ------------------------------------------------------------------------------------------- plot data
def plot_data(summary: dict[str, Any]) -> dict[str, Any]:
    """What the score-vs-ratio plot draws: the baseline's (full prefill) score, kvboost's ``full`` recompute, and
    one series per strategy (a ratio-driven strategy's settings other than the ratio make one series), split into
    ``query_agnostic`` and ``query_aware``. x: the configured ratio, or for a strategy without one its measured
    fraction of reused (token, layer) pairs recomputed."""
    out: dict[str, Any] = {"full_prefill": None, "full_recompute": None, "query_agnostic": {}, "query_aware": {}}
    for arm, rows in summary["arms"].items():
        pooled = rows.get("pooled")
        if not pooled:
            continue
        if arm == BASELINE:
            out["full_prefill"] = {"score": pooled["score"], "ci": pooled["score_ci"]}
            continue
        info = summary["arm_info"].get(arm, {})
        if info.get("strategy") == FULL:
            out["full_recompute"] = {"score": pooled["score"], "ci": pooled["score_ci"], "speedup": pooled["speedup"]}
            continue
        ratio = info.get("ratio")
        x = ratio if ratio is not None else pooled.get("content_recomputed_mean")
        if x is None:
            continue
        group = _series_name(arm, ratio is not None)
        side = "query_aware" if info.get("query_aware") else "query_agnostic"
        out[side].setdefault(group, []).append({"x": x, "score": pooled["score"], "ci": pooled["score_ci"],
                                                "speedup": pooled.get("speedup"), "arm": arm})  # fmt: skip
    for side in ("query_agnostic", "query_aware"):
        for points in out[side].values():
            points.sort(key=lambda p: p["x"])
    return out


def _series_name(arm: str, ratio_driven: bool) -> str:
    """The arm's label without its ``ratio=`` field (the series a ratio-driven strategy's arms make)."""
    if not ratio_driven:
        return arm
    spec = parse_spec(arm, "strategy")
    rest = tuple((k, v) for k, v in spec.fields if k != "ratio")
    return Spec(spec.name, rest).label


def plot_cell(summary: dict[str, Any], title: str, path: Path) -> Path:
    """The score-vs-ratio PNG of one cell (matplotlib, Agg; two panels: query-agnostic, query-aware)."""
    from kvboost.lab.report import _new_figure

    data = plot_data(summary)
    fig, axes = _new_figure(size=(11, 4.5), ncols=2)
    axes[1].sharey(axes[0])
    axes[1].sharex(axes[0])
    markers = "osD^vP*Xh<>"
    for ax, side, style, heading in ((axes[0], "query_agnostic", "-", "query-agnostic"),
                                     (axes[1], "query_aware", "--", "query-aware")):  # fmt: skip
        for i, (name, points) in enumerate(sorted(data[side].items())):
            xs = [p["x"] for p in points]
            ys = [p["score"] for p in points]
            lo = [p["score"] - p["ci"][0] if p["ci"] else 0.0 for p in points]
            hi = [p["ci"][1] - p["score"] if p["ci"] else 0.0 for p in points]
            ax.errorbar(xs, ys, yerr=[lo, hi], linestyle=style, marker=markers[i % len(markers)], capsize=3,
                        label=name)  # fmt: skip
        full = data["full_prefill"]
        if full:
            ax.axhline(full["score"], color="black", linewidth=1.2, label="full prefill (HF baseline)")
            if full["ci"]:
                ax.axhspan(full["ci"][0], full["ci"][1], color="black", alpha=0.08)
        if data["full_recompute"]:
            ax.axhline(data["full_recompute"]["score"], color="grey", linestyle=":", label="kvboost full recompute")
        ax.set_title(f"{heading} strategies")
        ax.set_xlabel("recompute budget (fraction of reused tokens)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[0].set_ylabel(SCORE_LABELS.get(summary.get("score_name"), summary.get("score_name", "score")))
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110)
    return path


# ------------------------------------------------------------------------------------------- tables
def format_table(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    """The markdown table of one cell: one row per arm, pooled figures first, the draws after."""
    draws = summary["draws"]
    score_name = summary.get("score_name", "score")
    graded = score_name != "correct"
    score_label = SCORE_LABELS.get(score_name, score_name)
    workload, model = meta.get("workload", "rag_reorder"), meta.get("model")
    lines = [
        f"# Content-reuse strategies on {workload}: {model} ({meta.get('dtype')})",
        "",
        f"Command: `{meta.get('command')}`  ",
        (
            f"Machine: {meta.get('machine')}; {len(draws)} draw(s) (workload.seed {', '.join(map(str, draws))}), "
            f"{_queries(summary)} queries in all; every arm of a query in one process, in a shuffled order. Baseline = HF "
            f"full prefill. Score: {score_label} ({'bootstrap' if graded else 'Wilson'} 95%); vs baseline: paired "
            "bootstrap 95% over queries. Speedup = the median over queries of each query's baseline TTFT / arm TTFT "
            "(bootstrap 95%); TTFT p50 ms pools absolute times, so it reads only within draws run on one machine. "
            "Content recomputed: the fraction of reused (token, layer) pairs recomputed."
        ),
        "",
    ]
    head = ["strategy", "kind", "TTFT p50 ms", "speedup vs baseline [95%]", f"{score_label} [95%]",
            "vs baseline [95%]"] + (["exact match"] if graded else []) + [
            "recompute ratio", "content recomputed", "deviation recall", "deviation rank corr", "greedy match",
            "first-token KL"] + [f"draw {d}: speedup / score" for d in draws]  # fmt: skip
    lines += ["| " + " | ".join(head) + " |", "| --- " * len(head) + "|"]
    for arm, rows in summary["arms"].items():
        pooled = rows.get("pooled")
        if not pooled:
            continue
        info = summary.get("arm_info", {}).get(arm, {})
        per_draw = []
        for d in draws:
            c = rows.get(f"draw {d}")
            if not c:
                per_draw.append("-")
            elif arm == BASELINE:
                per_draw.append(f"1 / {c['score']:.3f}")
            else:
                per_draw.append(f"{_num(c['speedup'], 2)}x / {c['score']:.3f}")
        if arm == BASELINE:
            lead = [arm, "full prefill", f"{pooled['ttft_ms_p50']:.0f}", "1", _score(pooled, graded), "-"]
            lead += [f"{pooled['accuracy']:.3f}"] if graded else []
            lead += ["1 (full prefill)", "-", "-", "-", "-", "-"]
        else:
            kind = ("reference (recomputes all)" if info.get("strategy") == FULL
                    else "query-aware" if info.get("query_aware") else "query-agnostic")  # fmt: skip
            lead = [arm, kind, f"{pooled['ttft_ms_p50']:.0f}",
                    f"{_num(pooled['speedup'], 2)}x {_ci(pooled['speedup_ci'], 2)}", _score(pooled, graded),
                    f"{pooled['score_diff']:+.3f} {_ci(pooled['score_diff_ci'], 3)}"]  # fmt: skip
            lead += [f"{pooled['accuracy']:.3f}"] if graded else []
            lead += [_num(pooled["recompute_ratio_mean"], 3), _num(pooled.get("content_recomputed_mean"), 3),
                     _num(pooled.get("oracle_recall_mean"), 3), _num(pooled.get("oracle_rank_corr_mean"), 3),
                     f"{pooled['greedy_match']:.0%}", _num(pooled["first_token_kl_mean"], 4)]  # fmt: skip
        lines.append("| " + " | ".join(lead + per_draw) + " |")
    return "\n".join(lines) + "\n"


def _queries(summary: dict[str, Any]) -> int | str:
    base = summary["arms"].get(BASELINE, {}).get("pooled")
    return base["n"] if base else "?"


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ci(ci: list[float] | None, digits: int) -> str:
    return "" if not ci else f"[{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _score(cell: dict[str, Any], graded: bool) -> str:
    if graded:
        return f"{cell['score']:.3f} {_ci(cell['score_ci'], 3)}"
    return f"{cell['score']:.3f} ({round(cell['score'] * cell['n'])}/{cell['n']}) {_ci(cell['score_ci'], 2)}"


def verdicts(summary: dict[str, Any], ratios: list[float]) -> dict[str, Any]:
    """Per ratio the best arm (highest pooled score, then speedup) among the ratio-driven arms at that ratio and
    the strategies without a ratio that recomputed at most that fraction; and whether any arm (not ``full``) at
    >= :data:`SPEEDUP_TARGET` x TTFT is equivalent to the full prefill's score (two-sided TOST by question, margin
    :data:`PARITY`)."""
    pooled = {arm: rows["pooled"] for arm, rows in summary["arms"].items() if arm != BASELINE and "pooled" in rows}
    info = summary.get("arm_info", {})
    candidates = {arm: c for arm, c in pooled.items() if info.get(arm, {}).get("strategy") != FULL}
    best: dict[str, Any] = {}
    for r in ratios:
        pool = [arm for arm, c in candidates.items()
                if (info[arm].get("ratio") is not None and abs(info[arm]["ratio"] - r) < 1e-9)
                or (info[arm].get("ratio") is None and c.get("content_recomputed_mean") is not None
                    and c["content_recomputed_mean"] <= r + 1e-9)]  # fmt: skip
        if pool:
            arm = max(pool, key=lambda a: (candidates[a]["score"], candidates[a]["speedup"] or 0.0))
            c = candidates[arm]
            best[_ratio_text(r)] = {"arm": arm, "score": c["score"], "score_diff": c["score_diff"],
                                    "score_diff_ci": c["score_diff_ci"], "speedup": c["speedup"]}  # fmt: skip
    fast = {arm: c for arm, c in candidates.items() if c["speedup"] is not None and c["speedup"] >= SPEEDUP_TARGET}
    near = sorted((arm for arm, c in fast.items() if (c.get("score_tost") or {}).get("equivalent")),
                  key=lambda a: -fast[a]["score_diff"])  # fmt: skip
    closest = max(fast, key=lambda a: fast[a]["score_diff"]) if fast else None
    base = summary["arms"].get(BASELINE, {}).get("pooled") or {}
    # the full prefill at the score's floor: every strategy "matches" it, and the verdict says nothing
    floor = base.get("score") is not None and base["score"] <= 0.0
    return {"best_by_ratio": best, "parity": {"met": bool(near) and not floor, "at_floor": floor, "arms": near,
                                              "details": [{"arm": a, "score_diff": fast[a]["score_diff"],
                                                           "speedup": fast[a]["speedup"]} for a in near],
                                              "closest_fast": closest,
                                              "closest_fast_diff": fast[closest]["score_diff"] if closest else None,
                                              "closest_fast_speedup": fast[closest]["speedup"] if closest else None}}  # fmt: skip


def format_overview(cells: dict[str, dict[str, Any]], meta: dict[str, Any]) -> str:
    """``summary.md``: per workload and model, the best strategy at each ratio, and the parity check."""
    lines = ["# Strategy leaderboard: summary", "", f"Command: `{meta.get('command')}`  ",
             f"Machine: {meta.get('machine')}; wall time {meta.get('wall_s')} s."
             + (f" Interrupted during {meta['interrupted']}: the cells hold the queries that finished."
                if meta.get("interrupted") else ""), "",
             ("Best = the highest pooled score among the strategies at that ratio (ratio-driven ones configured at "
              "it, the others where they recomputed at most that fraction of the reused tokens); `full` excluded. "
              f"Parity = a strategy at >= {SPEEDUP_TARGET}x TTFT (median per-query speedup) whose score is "
              f"equivalent to the full prefill's: a two-sided TOST of the per-question differences (draws averaged "
              f"per question) within +-{PARITY} at alpha 0.05; a large gain is not parity."), ""]  # fmt: skip
    for key, cell in cells.items():
        summary, verdict = cell["summary"], cell["verdicts"]
        base = summary["arms"].get(BASELINE, {}).get("pooled")
        lines.append(f"## {cell['workload']} on {cell['model']}")
        lines.append("")
        if base:
            lines.append(f"Full prefill (HF baseline): {summary.get('score_name')} {base['score']:.3f} over "
                         f"{base['n']} queries. Table: [{key}.md]({key}.md), plot: [{key}.png]({key}.png).")  # fmt: skip
            lines.append("")
        lines += [
            "| ratio | best strategy | score | vs full prefill [95%] | speedup |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r, b in verdict["best_by_ratio"].items():
            lines.append(f"| {r} | {b['arm']} | {b['score']:.3f} | {b['score_diff']:+.3f} "
                         f"{_ci(b['score_diff_ci'], 3)} | {_num(b['speedup'], 2)}x |")  # fmt: skip
        parity = verdict["parity"]
        lines.append("")
        if parity.get("at_floor"):
            lines.append(f"At >= {SPEEDUP_TARGET}x TTFT at parity with the full prefill: **no verdict**: the "
                         "full prefill scores 0 here, so every strategy ties with it at the floor (the score cannot "
                         "tell the strategies apart; see first-token KL and greedy match in the table).")  # fmt: skip
        elif parity["met"]:
            lines.append(f"At >= {SPEEDUP_TARGET}x TTFT at parity with the full prefill: **yes**: "
                         + ", ".join(f"{d['arm']} ({d['score_diff']:+.3f} at {d['speedup']:.2f}x)"
                                     for d in parity["details"]) + ".")  # fmt: skip
        elif parity["closest_fast"]:
            lines.append(f"At >= {SPEEDUP_TARGET}x TTFT at parity with the full prefill: **no**; the closest at "
                         f">= {SPEEDUP_TARGET}x: {parity['closest_fast']} ({parity['closest_fast_diff']:+.3f} at "
                         f"{parity['closest_fast_speedup']:.2f}x).")  # fmt: skip
        else:
            lines.append(f"At >= {SPEEDUP_TARGET}x TTFT at parity with the full prefill: **no**; no strategy "
                         f"reached {SPEEDUP_TARGET}x.")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> None:
    import torch

    from experiments.common import compose_run_config
    from kvboost.lab.config_check import check_config

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records_path = out / "records.jsonl"
    if records_path.exists() and not args.append:
        raise SystemExit(f"{records_path} exists: pass --append to add to it, or another --out")
    workloads = workload_labels(expand_workloads(args.workloads))
    t0 = time.perf_counter()
    models_meta: dict[str, Any] = {}
    if args.append and (out / "summary.json").exists():  # the models of the earlier invocations stay described
        models_meta.update(json.loads((out / "summary.json").read_text()).get("meta", {}).get("models") or {})
    arms_meta: list[dict[str, Any]] = []
    interrupted = None
    for model in args.models:
        bases = {label: _base_overrides(model, w, args) for label, w in workloads.items()}
        cfgs = {label: compose_run_config(base) for label, base in bases.items()}
        for label, cfg in cfgs.items():  # a bad field or data path fails now, before any model loads
            try:
                check_config(cfg)
            except (ValueError, TypeError, FileNotFoundError) as exc:
                raise SystemExit(f"workload {label!r} on {model}: {exc}") from None
        _check_one_engine(cfgs)
        first = next(iter(bases.values()))
        arms, strategies = _build_arms(first, args, compose_run_config)
        arms_meta = [{"label": a.label, "overrides": list(a.overrides), "ratio": a.ratio,
                      "query_aware": a.query_aware} for a in arms]  # fmt: skip
        torch.manual_seed(0)
        models_meta[model] = {}
        try:
            _run_model(model, cfgs, workloads, arms, strategies, args, records_path, models_meta[model])
        except KeyboardInterrupt:  # Ctrl-C: summarize what finished (records.jsonl holds every finished query)
            interrupted = model
            print(f"interrupted during {model}: summarizing the finished queries", file=sys.stderr)
            break
        gc.collect()
    meta = {"models": models_meta, "queries": args.queries, "draws": args.draws, "ratios": list(args.ratios),
            "workloads": {label: w.label for label, w in workloads.items()}, "strategies": list(args.strategies),
            "arms": arms_meta, "command": _command(), "machine": _machine(),
            "wall_s": round(time.perf_counter() - t0, 1), "interrupted": interrupted}  # fmt: skip
    if records_path.exists():
        write_outputs(out, meta, logger=args.logger)


def _base_overrides(model: str, workload: Spec, args: argparse.Namespace) -> list[str]:
    base = [f"model={model}", f"workload={workload.name}", f"workload.num_queries={args.queries}", "logger=none"]
    base += [f"workload.{k}={v}" for k, v in workload.fields]
    if args.dtype:
        base.append(f"model.dtype={args.dtype}")
    return base + list(args.override)


def _check_one_engine(cfgs: dict[str, dict[str, Any]]) -> None:
    """The workloads of one model share its engine: their engine settings (chunker, cache...) must agree."""
    from kvboost.build import engine_options

    options = {label: {k: v for k, v in engine_options(cfg).items() if k != "recompute"} for label, cfg in cfgs.items()}
    labels = list(options)
    for label in labels[1:]:
        if options[label] != options[labels[0]]:
            diff = sorted(k for k in set(options[label]) | set(options[labels[0]])
                          if options[label].get(k) != options[labels[0]].get(k))  # fmt: skip
            raise SystemExit(f"workloads {labels[0]!r} and {label!r} need different engines ({', '.join(diff)} "
                             "differ): run them in separate invocations")  # fmt: skip


def _build_arms(base: list[str], args: argparse.Namespace, compose: Any) -> tuple[list[Arm], dict[str, Any]]:
    """The arms (strategy x ratio) and their built strategies; a bad name or field fails here, before the model
    loads, naming the spec."""
    from kvboost.registry import RECOMPUTE

    composed: dict[Spec, dict[str, Any]] = {}

    def recompute_cfg(spec: Spec) -> dict[str, Any]:
        if spec not in composed:
            try:
                composed[spec] = compose(base + spec.overrides("recompute"))["recompute"]
            except Exception as exc:  # noqa: BLE001  (Hydra's errors: an unknown option or field)
                raise SystemExit(f"strategy {spec.label!r}: {type(exc).__name__}: {exc}") from None
        return composed[spec]

    specs = expand_strategies(list(args.strategies), list(args.ratios), lambda s: "ratio" in recompute_cfg(s))
    arms, strategies = [], {}
    for spec in specs:
        cfg = dict(recompute_cfg(spec))
        if args.oracle_agreement and "oracle_agreement" in cfg and spec.get("oracle_agreement") is None:
            cfg["oracle_agreement"] = True
        try:
            strategy = RECOMPUTE.build(cfg)
        except Exception as exc:  # noqa: BLE001
            raise SystemExit(f"strategy {spec.label!r}: {type(exc).__name__}: {exc}") from None
        ratio = spec.get("ratio")
        arms.append(Arm(label=spec.label, name=spec.name, overrides=tuple(spec.overrides("recompute")),
                        ratio=None if ratio in (None, "null") else float(ratio),
                        query_aware=is_query_aware(strategy)))  # fmt: skip
        strategies[spec.label] = strategy
    return arms, strategies


def _run_model(model: str, cfgs: dict[str, dict[str, Any]], workloads: dict[str, Spec], arms: list[Arm],
               strategies: dict[str, Any], args: argparse.Namespace, records_path: Path,
               info: dict[str, Any]) -> None:  # fmt: skip
    """Every workload, draw, query and arm on one loaded model; records appended to ``records_path``; the model's
    dtype and times into ``info`` (also when interrupted)."""
    from tqdm.auto import tqdm

    from kvboost.build import build_engine
    from kvboost.lab.config_check import split_workload_config
    from kvboost.lab.hf_baselines import HFNoCache
    from kvboost.lab.runner import WARMUP_MESSAGES, quality_fields
    from kvboost.lab.workloads import WORKLOADS
    from kvboost.lab.workloads.base import WorkloadEnv

    t0 = time.perf_counter()
    engine = build_engine(next(iter(cfgs.values())))
    load_s = time.perf_counter() - t0
    print(f"loaded {model} ({engine.adapter.dtype}) in {load_s:.1f} s", file=sys.stderr)
    num_layers = engine.model.config.get_text_config(decoder=True).num_hidden_layers
    try:
        for label, strategy in strategies.items():
            try:
                strategy.check_model(num_layers)
            except ValueError as exc:
                raise SystemExit(f"strategy {label!r} on {model}: {exc}") from None
        baseline = HFNoCache(engine.model, engine.tokenizer, engine.tokenize)
        # kernels and compiled steps, not the cache: one unrelated request per arm, then forget
        baseline.generate(WARMUP_MESSAGES, 4, commit=False)
        for strategy in strategies.values():
            engine.recompute = strategy
            engine.generate(WARMUP_MESSAGES, max_new_tokens=4, mode="reuse", store=False)
        tokenize = engine.tokenize
        env = WorkloadEnv(tokenizer=engine.tokenizer, count_tokens=lambda p: len(tokenize(p)))
        labels = [BASELINE, *(a.label for a in arms)]
        by_label = {a.label: a for a in arms}
        order_rng = random.Random(args.order_seed)
        total = len(workloads) * len(args.draws) * args.queries * len(labels)
        with open(records_path, "a") as sink, tqdm(total=total, desc=f"strategy table {model}", unit="req") as bar:
            for wlabel in workloads:
                name, fields, _, _ = split_workload_config(cfgs[wlabel])
                for draw in args.draws:
                    workload = WORKLOADS.build({"name": name, **fields, "seed": draw}, env=env)
                    score_name = PRIMARY_SCORE.get(name)
                    engine.reset_cache()
                    shared = workload.shared_context()
                    bar.set_postfix_str(f"{wlabel} draw {draw}: warming {len(shared)} documents")
                    for text in shared:
                        engine.warm(text, chat=False)
                    for request in workload.requests():
                        context = workload.request_context(request)
                        if context:  # each query finds the same cache: its own passages, warmed now, untimed
                            engine.reset_cache()
                            for text in context:
                                engine.warm(text, chat=False)
                        bar.set_postfix_str(f"{wlabel} draw {draw} {request.request_id[:12]}")
                        order = list(labels)
                        order_rng.shuffle(order)
                        results = {}
                        for arm in order:
                            if arm == BASELINE:
                                results[arm] = baseline.generate(request.prompt, workload.max_new_tokens,
                                                                 score_ids=request.score_ids, commit=False)  # fmt: skip
                            else:
                                engine.recompute = strategies[arm]
                                results[arm] = engine.generate(request.prompt, max_new_tokens=workload.max_new_tokens,
                                                               mode="reuse", score_ids=request.score_ids,
                                                               store=False)  # fmt: skip
                            bar.update(1)
                        for i, arm in enumerate(labels):
                            record = _record(arm, i, draw, request, results[arm], workload, model=model,
                                             workload_label=wlabel, score_name=score_name,
                                             arm_info=by_label.get(arm))  # fmt: skip
                            if arm != BASELINE:
                                record.update(quality_fields(results[BASELINE], results[arm]))
                            sink.write(json.dumps(record) + "\n")
                        sink.flush()
    finally:
        info.update(dtype=str(engine.adapter.dtype).replace("torch.", ""), load_s=round(load_s, 1),
                    wall_s=round(time.perf_counter() - t0, 1))  # fmt: skip
        engine.close()


def _record(arm: str, index: int, draw: int, request: Any, result: Any, workload: Any, *, model: str = "?",
            workload_label: str = "rag_reorder", score_name: str | None = None, arm_info: Arm | None = None,
            ) -> dict[str, Any]:  # fmt: skip
    correct = workload.is_correct(request, result.output_text)
    scores = workload.score(request, result.output_text)
    name = score_name or ("f1" if "f1" in scores else "correct")
    score = float(bool(correct)) if name == "correct" else float(scores.get(name, 0.0))
    extra = result.extra or {}
    record = {
        "model": model, "workload": workload_label, "arm": arm, "arm_index": index, "draw": draw,
        "query": request.request_id,
        "strategy": arm_info.name if arm_info else arm, "ratio": arm_info.ratio if arm_info else None,
        "query_aware": arm_info.query_aware if arm_info else False,
        "score_name": name, "score": score, "correct": bool(correct), **scores,
        "ttft_ms": result.ttft_ms, "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
        "kv_reuse_ratio": result.kv_reuse_ratio, "recompute_ratio": result.recompute_ratio,
        "content_ratio": result.content_ratio, "output_text": result.output_text,
        "answer_logprob": extra.get("answer_logprob"),
    }  # fmt: skip
    for key in ("oracle_recall", "oracle_rank_corr", "oracle_agreement_ms"):
        if key in extra:
            record[key] = extra[key]
    for key in ("target_position", "needle_depth"):
        if key in request.info:
            record[key] = request.info[key]
    return record


def _command() -> str:
    return "python -m experiments.bench.strategy_table " + " ".join(sys.argv[1:])


def _machine() -> str:
    from kvboost.env import cpu_features

    info = cpu_features()
    return f"{info['cpu']} ({info['kind']}), torch {info['torch']}, {info['threads']} thread(s)"


# ----------------------------------------------------------------------------------------------- outputs
def write_outputs(out: Path, meta: dict[str, Any] | None = None, logger: str = "none") -> dict[str, Any]:
    """Every table, plot and summary from ``records.jsonl`` (``meta`` kept from an earlier summary if None)."""
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line.strip()]
    previous = out / "summary.json"
    if meta is None:
        meta = json.loads(previous.read_text()).get("meta", {}) if previous.exists() else {}
    for r in records:  # the rag_reorder-only table's records name no model: its summary's meta does
        r.setdefault("model", meta.get("model") or "model")
    ratios = list(meta.get("ratios") or sorted({r["ratio"] for r in records if r.get("ratio") is not None}))
    cells: dict[str, dict[str, Any]] = {}
    for (workload, model), cell_records in split_cells(records).items():
        key = cell_key(workload, model)
        summary = summarize(cell_records)
        model_meta = (meta.get("models") or {}).get(model, {})
        cell_meta = {**meta, "workload": workload, "model": model, "dtype": model_meta.get("dtype", meta.get("dtype"))}
        table = format_table(summary, cell_meta)
        write_markdown(out / f"{key}.md", table)
        plot_cell(summary, f"{workload} on {model}: score vs recompute budget ({len(summary['draws'])} draw(s))",
                  out / f"{key}.png")  # fmt: skip
        cells[key] = {"workload": workload, "model": model, "summary": summary, "verdicts": verdicts(summary, ratios),
                      "plot": plot_data(summary), "table": f"{key}.md", "png": f"{key}.png"}  # fmt: skip
        print(table)
    overview = format_overview(cells, meta)
    write_markdown(out / "summary.md", overview)
    write_json(out / "summary.json", {"meta": meta, "cells": cells})
    print(overview)
    if logger and logger != "none":
        log_to_wandb(cells, meta, out, logger)
    return cells


#: the W&B table's columns (one row per cell and arm)
WANDB_COLUMNS = ("model", "workload", "strategy", "arm", "ratio", "query_aware", "n", "score_name", "score",
                 "score_lo", "score_hi", "score_diff", "score_diff_lo", "score_diff_hi", "speedup", "speedup_lo",
                 "speedup_hi", "recompute_ratio", "content_recomputed", "oracle_recall", "oracle_rank_corr")  # fmt: skip


def wandb_rows(cells: dict[str, dict[str, Any]]) -> list[list[Any]]:
    """The leaderboard's rows for a ``wandb.Table`` (columns :data:`WANDB_COLUMNS`), baselines included."""
    rows = []
    for cell in cells.values():
        summary = cell["summary"]
        for arm, by_draw in summary["arms"].items():
            c = by_draw.get("pooled")
            if not c:
                continue
            info = summary["arm_info"].get(arm, {})
            ci, diff_ci, speed_ci = c.get("score_ci") or [None, None], c.get("score_diff_ci") or [None, None], \
                c.get("speedup_ci") or [None, None]  # fmt: skip
            rows.append([cell["model"], cell["workload"], info.get("strategy", arm), arm, info.get("ratio"),
                         bool(info.get("query_aware")), c["n"], summary.get("score_name"), c["score"], ci[0], ci[1],
                         c.get("score_diff", 0.0), diff_ci[0], diff_ci[1], c.get("speedup", 1.0), speed_ci[0],
                         speed_ci[1], c.get("recompute_ratio_mean"), c.get("content_recomputed_mean"),
                         c.get("oracle_recall_mean"), c.get("oracle_rank_corr_mean")])  # fmt: skip
    return rows


def log_to_wandb(cells: dict[str, dict[str, Any]], meta: dict[str, Any], out: Path, logger: str) -> None:
    """One W&B run through the project's logger (``kvboost.lab.loggers``, ``kvboost/configs/logger/<logger>.yaml``): the
    leaderboard as a table (all cells, and one per cell), each cell's plot as an image, each cell's parity
    verdict in the run summary."""
    from experiments.common import compose_run_config
    from kvboost.lab.loggers import build_logger

    cfg = compose_run_config([f"logger={logger}"])
    run = build_logger(cfg.get("logger"), out_dir=out, config={"strategy_table": meta},
                       run_info={"experiment": "strategy_table"})  # fmt: skip
    wandb_run, wandb = getattr(run, "run", None), getattr(run, "_wandb", None)
    if wandb_run is None or wandb is None:  # logger=none
        return
    columns, rows = list(WANDB_COLUMNS), wandb_rows(cells)
    payload: dict[str, Any] = {"strategy_table": wandb.Table(columns=columns, data=rows)}
    for key, cell in cells.items():
        payload[f"strategy_table/{key}"] = wandb.Table(
            columns=columns, data=[r for r in rows if r[0] == cell["model"] and r[1] == cell["workload"]]
        )
        payload[f"plots/{key}"] = wandb.Image(str(out / cell["png"]))
    wandb_run.log(payload)
    wandb_run.summary.update({f"parity/{key}": cell["verdicts"]["parity"]["met"] for key, cell in cells.items()})
    run.finish()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="See the module docstring (python -c 'import experiments.bench."
                                            "strategy_table as m; help(m)') for what each output holds.")  # fmt: skip
    parser.add_argument("--models", "--model", nargs="+", default=list(DEFAULT_MODELS),
                        help="kvboost/configs/model names, loaded one after another (smollm2, qwen_coder_0_5b)")  # fmt: skip
    parser.add_argument("--dtype", default=None, help="model.dtype (float32, bfloat16); default: the model yaml's")
    parser.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS),
                        help="musique, needle, rag_reorder (both layouts) or rag_reorder:question_after; "
                             "NAME:key=value,... sets workload fields")  # fmt: skip
    parser.add_argument("--draws", type=int, nargs="+", default=[0, 1, 2], help="workload.seed of each draw")
    parser.add_argument("--queries", type=int, default=20, help="workload.num_queries of every workload")
    parser.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        default=list(DEFAULT_RATIOS),
        help="the budgets the ratio-driven strategies run at (those whose spec sets no ratio)",
    )
    parser.add_argument(
        "--strategies",
        nargs="+",
        default=list(DEFAULT_STRATEGIES),
        help="NAME, NAME:key=value,key=value (any recompute config field), or NAME:RATIO",
    )
    parser.add_argument(
        "--oracle-agreement",
        action="store_true",
        help="recompute.oracle_agreement=true where a strategy has it (oracle recall / rank corr)",
    )
    parser.add_argument("--override", nargs="*", default=[], help="more Hydra overrides, e.g. attn=cpu_kernel")
    parser.add_argument("--order-seed", type=int, default=0, help="seed of the arms' order per query")
    parser.add_argument(
        "--logger", default="none", help="none | wandb (kvboost/configs/logger): the leaderboard as a W&B table"
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--append", action="store_true", help="add to an existing records.jsonl (more draws)")
    parser.add_argument("--summarize-only", action="store_true", help="rebuild the tables, plots and summaries")
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    if args.summarize_only:
        write_outputs(Path(args.out), logger=args.logger)
        return
    try:  # a typo fails before the model loads
        for spec in args.strategies:
            parse_spec(spec, "strategy")
        workload_labels(expand_workloads(args.workloads))
    except ValueError as exc:
        parser.error(str(exc))
    for r in args.ratios:
        if not 0.0 < r <= 1.0:
            parser.error(f"--ratios: {r} is not in (0, 1]")
    set_threads(args.threads)
    run(args)


if __name__ == "__main__":
    main()
