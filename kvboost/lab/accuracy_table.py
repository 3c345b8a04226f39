"""The accuracy-by-reuse table: does serving a prompt from the cache cost quality, at matched requests?

Per mode and per reuse-ratio bucket: task accuracy (records with ``correct``), perplexity of scored reference
text (records with ``answer_logprob`` and ``score_tokens`` but no ``correct``: held-out replies, see
``kvboost/lab/workloads/accuracy.py``), and the same numbers for the *cold reference* on the very same
requests, with the log-probability deltas paired by ``request_id``. The reference is ``kvboost_cold`` when the
run has it (the engine's own path without the cache: only reuse differs), else ``baseline``.

Buckets. A cold mode's reuse ratio is 0 for every request, so bucketing each record by its own reuse would put
all cold records in one bucket and compare different requests. Instead a request's bucket is the reuse ratio
that ``bucket_mode`` (``kvboost``) had for it, and every mode's record of that request falls into that bucket:
a cold row of bucket (0.75, 0.9] holds the cold prefills of the requests kvboost served 75-90% from the cache,
so each bucket's rows compare like for like. (Without ``bucket_mode`` in the records, each record is bucketed
by its own reuse ratio.) Edges ``(0, 0.25, 0.5, 0.75, 0.9, 1.0)`` give the buckets ``0`` (no reuse at all),
``(0, 0.25]``, ``(0.25, 0.5]``, ``(0.5, 0.75]``, ``(0.75, 0.9]``, ``(0.9, 1]``; ``all`` is every request.

Per cell (``table["modes"][MODE][BUCKET]``):

- ``n``: requests; ``reuse_ratio``: this mode's own mean reuse ratio (0 for cold modes);
- ``n_tasks``, ``accuracy``, ``accuracy_ref`` (the reference's accuracy on the same tasks), ``flipped_to_wrong``
  / ``flipped_to_right``: tasks the reference got right and this mode wrong, and the reverse;
- ``n_scored``, ``scored_tokens``, ``perplexity``: token-weighted, ``exp(-sum(answer_logprob) / sum(score_tokens))``
  over the bucket's scored replies (a request's own perplexity is ``exp(-answer_logprob / score_tokens)``);
  ``perplexity_ref``: the reference's, over the same requests;
- ``logprob_delta_per_token``: ``sum(answer_logprob - reference's) / sum(score_tokens)`` over the paired scored
  replies (nats per token; negative: the mode finds the reference text less likely, i.e. a quality loss);
- ``answer_logprob_delta``: mean of ``answer_logprob - reference's`` over the paired tasks.

A statistic without data is None. Only each request's first repeat counts (repeats are for timing).
For a finished run: ``python -m kvboost.lab.accuracy_table outputs/DATE/TIME``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

DEFAULT_EDGES: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 0.9, 1.0)
REFERENCE_MODES = ("kvboost_cold", "baseline")
MODE_ORDER = ("baseline", "hf_prefix", "kvboost_cold", "kvboost")
ALL = "all"


def bucket_labels(edges: Sequence[float] = DEFAULT_EDGES) -> list[str]:
    """The bucket names of ``edges`` in order: ``"0"`` (reuse == edges[0]), then ``"(lo, hi]"`` per pair."""
    _check_edges(edges)
    return [f"{edges[0]:g}"] + [f"({lo:g}, {hi:g}]" for lo, hi in zip(edges, edges[1:])]


def bucket_of(ratio: float, edges: Sequence[float] = DEFAULT_EDGES) -> str:
    """The bucket of a reuse ratio: ``"0"`` for no reuse, else the ``(lo, hi]`` holding it (clamped to the
    first and last bucket outside the edges)."""
    labels = bucket_labels(edges)
    if ratio <= edges[0]:
        return labels[0]
    for i, hi in enumerate(edges[1:], start=1):
        if ratio <= hi:
            return labels[i]
    return labels[-1]


def _check_edges(edges: Sequence[float]) -> None:
    if len(edges) < 2 or any(b <= a for a, b in zip(edges, edges[1:])):
        raise ValueError(f"bucket edges must be at least two increasing numbers, got {list(edges)}")


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _request_key(record: Mapping[str, Any]) -> str:
    if record.get("request_id") is not None:
        return str(record["request_id"])
    return f"{record.get('conversation_id')}/{record.get('turn')}"


def _is_task(record: Mapping[str, Any]) -> bool:
    return isinstance(record.get("correct"), bool)


def _scored_tokens(record: Mapping[str, Any]) -> int | None:
    """Tokens of scored reference text (perplexity records only: not tasks, answer_logprob present)."""
    if _is_task(record) or _num(record.get("answer_logprob")) is None:
        return None
    tokens = _num(record.get("score_tokens"))
    return int(tokens) if tokens and tokens > 0 else None


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _perplexity(logprob: float, tokens: int) -> float | None:
    if not tokens:
        return None
    try:
        return math.exp(-logprob / tokens)
    except OverflowError:
        return math.inf


def _cell(pairs: list[tuple[Mapping[str, Any], Mapping[str, Any] | None]]) -> dict[str, Any]:
    """Statistics of one (mode, bucket): ``pairs`` of (the mode's record, the reference's record or None)."""
    reuse = [v for r, _ in pairs if (v := _num(r.get("reuse_ratio"))) is not None]
    tasks = [(r, ref) for r, ref in pairs if _is_task(r)]
    paired_tasks = [(r, ref) for r, ref in tasks if ref is not None and _is_task(ref)]
    scored = [(r, ref, t) for r, ref in pairs if (t := _scored_tokens(r))]
    paired_scored = [(r, ref, t) for r, ref, t in scored if ref is not None and _scored_tokens(ref) == t]
    task_deltas = [
        a - b for r, ref in paired_tasks
        if (a := _num(r.get("answer_logprob"))) is not None and (b := _num(ref.get("answer_logprob"))) is not None
    ]  # fmt: skip
    tokens = sum(t for _, _, t in scored)
    paired_tokens = sum(t for _, _, t in paired_scored)
    return {
        "n": len(pairs),
        "reuse_ratio": _mean(reuse),
        "n_tasks": len(tasks),
        "accuracy": _mean([float(r["correct"]) for r, _ in tasks]),
        "accuracy_ref": _mean([float(ref["correct"]) for _, ref in paired_tasks]),
        "flipped_to_wrong": sum(1 for r, ref in paired_tasks if ref["correct"] and not r["correct"]),
        "flipped_to_right": sum(1 for r, ref in paired_tasks if r["correct"] and not ref["correct"]),
        "n_scored": len(scored),
        "scored_tokens": tokens,
        "perplexity": _perplexity(sum(float(r["answer_logprob"]) for r, _, _ in scored), tokens),
        "perplexity_ref": _perplexity(sum(float(ref["answer_logprob"]) for _, ref, _ in paired_scored), paired_tokens),
        "logprob_delta_per_token": (
            sum(float(r["answer_logprob"]) - float(ref["answer_logprob"]) for r, ref, _ in paired_scored)
            / paired_tokens if paired_tokens else None
        ),
        "answer_logprob_delta": _mean(task_deltas),
    }  # fmt: skip


def accuracy_by_reuse(
    records: Iterable[Mapping[str, Any]],
    *,
    edges: Sequence[float] = DEFAULT_EDGES,
    bucket_mode: str = "kvboost",
    reference_mode: str | None = None,
) -> dict[str, Any]:
    """The accuracy-by-reuse table of ``records`` (module docstring)::

        {"bucket_mode": "kvboost" | None, "reference_mode": "kvboost_cold" | "baseline" | None,
         "edges": [...], "buckets": ["0", "(0, 0.25]", ..., "all"],
         "modes": {MODE: {BUCKET: cell}}}   # only non-empty buckets

    ``reference_mode`` None picks ``kvboost_cold``, else ``baseline``, among the modes present.
    """
    _check_edges(edges)
    by_request: dict[str, dict[str, Mapping[str, Any]]] = defaultdict(dict)
    for record in records:
        if (record.get("repeat") or 0) != 0 or "mode" not in record:
            continue
        by_request[_request_key(record)].setdefault(str(record["mode"]), record)
    modes_present = {m for per_mode in by_request.values() for m in per_mode}
    if reference_mode is None:
        reference_mode = next((m for m in REFERENCE_MODES if m in modes_present), None)
    elif reference_mode not in modes_present:
        raise ValueError(f"reference mode {reference_mode!r} has no records; modes: {sorted(modes_present)}")
    bucketing = bucket_mode if bucket_mode in modes_present else None

    cells: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for per_mode in by_request.values():
        source = per_mode.get(bucketing) if bucketing else None
        reference = per_mode.get(reference_mode) if reference_mode else None
        for mode, record in per_mode.items():
            ratio = _num((source or record).get("reuse_ratio")) or 0.0
            pair = (record, reference)
            cells[mode][bucket_of(ratio, edges)].append(pair)
            cells[mode][ALL].append(pair)

    labels = bucket_labels(edges) + [ALL]
    ordered = sorted(cells, key=lambda m: (MODE_ORDER.index(m) if m in MODE_ORDER else len(MODE_ORDER), m))
    return {
        "bucket_mode": bucketing,
        "reference_mode": reference_mode,
        "edges": list(edges),
        "buckets": labels,
        "modes": {mode: {b: _cell(cells[mode][b]) for b in labels if cells[mode].get(b)} for mode in ordered},
    }


def has_scores(records: Iterable[Mapping[str, Any]]) -> bool:
    """Whether any record carries a task result (``correct``) or a scored log-probability."""
    return any(_is_task(r) or _num(r.get("answer_logprob")) is not None for r in records)


def add_accuracy_by_reuse(summary: dict[str, Any], records: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """Put the table in ``summary["accuracy_by_reuse"]`` when the run scored anything; returns it (or None)."""
    if not has_scores(records):
        return None
    table = accuracy_by_reuse(records)
    summary["accuracy_by_reuse"] = table
    return table


# ------------------------------------------------------------------------------------------------- format
def _f(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return format(value, spec)


def format_accuracy_table(table: Mapping[str, Any]) -> str:
    """The table as Markdown (one row per mode and non-empty bucket), with a one-line verdict per warm mode."""
    ref = table.get("reference_mode")
    bucket_by = table.get("bucket_mode")
    lines = [
        f"Accuracy by reuse (bucket: {bucket_by + ' reuse ratio of the request' if bucket_by else 'own reuse ratio'}; "
        f"ref = {ref or 'none'} on the same requests)",
        "",
        "| mode | reuse bucket | n | reuse | accuracy | acc. ref | flips -/+ | ppl | ppl ref | Δ logprob/token "
        "| Δ answer logprob |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for mode, buckets in table.get("modes", {}).items():
        for bucket in table.get("buckets", []):
            c = buckets.get(bucket)
            if not c:
                continue
            acc = f"{_f(c['accuracy'], '.1%')} ({c['n_tasks']})" if c["n_tasks"] else "-"
            flips = f"{c['flipped_to_wrong']}/{c['flipped_to_right']}" if c["n_tasks"] else "-"
            ppl = f"{_f(c['perplexity'], '.3f')} ({c['scored_tokens']} tok)" if c["n_scored"] else "-"
            lines.append(
                f"| {mode} | {bucket} | {c['n']} | {_f(c['reuse_ratio'], '.2f')} | {acc} "
                f"| {_f(c['accuracy_ref'], '.1%')} | {flips} | {ppl} | {_f(c['perplexity_ref'], '.3f')} "
                f"| {_f(c['logprob_delta_per_token'], '+.3g')} | {_f(c['answer_logprob_delta'], '+.3g')} |"
            )  # fmt: skip
    for mode, buckets in table.get("modes", {}).items():
        c = buckets.get(ALL)
        if not c or mode == ref or not ref or not (c["reuse_ratio"] or 0) > 0:
            continue
        parts = []
        if c["n_tasks"]:
            parts.append(f"accuracy {_f(c['accuracy'], '.1%')} vs {_f(c['accuracy_ref'], '.1%')} "
                         f"({c['flipped_to_wrong']} lost, {c['flipped_to_right']} gained)")  # fmt: skip
        if c["n_scored"]:
            parts.append(f"perplexity {_f(c['perplexity'], '.3f')} vs {_f(c['perplexity_ref'], '.3f')} "
                         f"({_f(c['logprob_delta_per_token'], '+.3g')} nats/token)")  # fmt: skip
        if parts:
            lines.append(f"\n{mode} (mean reuse {c['reuse_ratio']:.2f}) vs {ref}: " + "; ".join(parts))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m kvboost.lab.accuracy_table RUN_DIR_OR_RECORDS_JSONL [--json]``: the table of a finished run."""
    import argparse
    import json
    from pathlib import Path

    from kvboost.lab.report import read_records

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("path", help="a run's output folder or its records.jsonl")
    parser.add_argument("--edges", type=float, nargs="+", default=list(DEFAULT_EDGES))
    parser.add_argument("--json", action="store_true", help="print the table as JSON instead of Markdown")
    args = parser.parse_args(argv)
    path = Path(args.path)
    table = accuracy_by_reuse(read_records(path / "records.jsonl" if path.is_dir() else path), edges=args.edges)
    print(json.dumps(table, indent=1) if args.json else format_accuracy_table(table))


if __name__ == "__main__":
    main()
