"""Results of a run: per-request records -> aggregates, a terminal table, PNG plots, summary.json.

A record is one measurement of one request under one mode, a flat dict with at least ``turn`` (1-based) and
``mode``, the request's identity (``request_id``, unique per request across the run, and
``conversation_id``), ``repeat`` (0-based; a request may be measured several times per mode) and the metrics
of DESIGN.md ("Metrics"): ``ttft_ms``, ``total_ms``, ``store_ms``, ``decode_tok_s``, ``prompt_tokens``,
``generated_tokens``, ``reuse_ratio``, ``exact_ratio``, ``content_ratio``, ``recompute_ratio``. Optional:
``correct`` (bool, workloads with known answers), ``answer_logprob``, and for modes measured against the
baseline's prefill of the same prompt ``greedy_match`` (bool), ``first_token_kl``, ``first_divergence`` (int,
or None: no divergence), ``max_abs_logit_diff`` and ``answer_logprob_delta``.

Records without ``request_id`` are their own request, ``conversation_id + "/" + turn``; records without
``repeat`` are repeat 0. Timing statistics are over requests, each request's value being the median of its
repeats; quality and accuracy use repeat 0 only (repeats are for timing). Every metric is optional per
record: a record without it (or with None/NaN) is skipped for that metric only, and an aggregate with no
values is None. Modes may cover different turns and requests; speedups pair the requests both modes served.

Typical use at the end of a run::

    write_records(records, out / "records.jsonl")
    summary = summarize(records, reference_modes=("kvboost_cold",))
    print(format_table(summary))
    plot_summary(summary, out)
    write_summary(summary, out / "summary.json")
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Aggregates per (mode, turn) and per mode overall: output key -> (record field, statistic). Each request
# contributes one value per field: the median over its repeats.
_STAT_FIELDS: dict[str, tuple[str, str]] = {
    "ttft_ms_p10": ("ttft_ms", "p10"),
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
_COLLAPSED_FIELDS = tuple(dict.fromkeys(name for name, _ in _STAT_FIELDS.values()))
_QUALITY_FIELDS = ("greedy_match", "first_token_kl", "first_divergence", "max_abs_logit_diff",
                   "answer_logprob_delta")
#: answer scores a workload writes into its records (``Workload.score``): ``accuracy[mode]`` gets ``<name>_mean``
_SCORE_FIELDS = ("f1", "f1_ref")
DEFAULT_BOOTSTRAP = 2000


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


def cached_new_shape(text: str) -> tuple[int, int]:
    """``"cached:new"`` -> ``(cached, new)``: a request shape of the prefill benchmarks (an exact prefix hit of
    ``cached`` tokens plus ``new`` tokens; ``new`` >= 1). For ``argparse`` ``type=``."""
    import argparse

    cached, _, new = text.partition(":")
    if not cached.isdigit() or not new.isdigit() or int(new) < 1:
        raise argparse.ArgumentTypeError(f"a shape is cached:new with new >= 1, got {text!r}")
    return int(cached), int(new)


def rotated(names: Sequence[str], round_: int) -> list[str]:
    """``names`` starting at ``round_ % len(names)``: the engine order of a same-request benchmark's round, so
    each engine goes first in turn."""
    k = round_ % len(names)
    return [*names[k:], *names[:k]]


def serve_prefix_hit(engine: Any, ids: list[int], cached: int, max_new_tokens: int) -> Any:
    """``engine`` serves ``ids`` as an exact prefix hit of its first ``cached`` tokens: the cache is emptied, the
    prefix warmed (untimed), then the whole prompt served (``store=False``); an engine that reused another count
    is an error (the request would not be the shape measured)."""
    engine.reset_cache()
    if cached:
        engine.warm(ids[:cached])
    result = engine.generate(ids, max_new_tokens=max_new_tokens, store=False)
    if result.cached_tokens != cached:
        raise RuntimeError(f"expected {cached} cached tokens, the engine reused {result.cached_tokens}")
    return result


def spread(values: Sequence[float]) -> dict[str, float]:
    """``{"median", "p10", "p90", "n"}`` of ``values`` (percentiles by :func:`percentile`): how the A/B scripts
    report the per-request ratios of two checkouts."""
    return {"median": statistics.median(values), "p10": percentile(values, 10), "p90": percentile(values, 90),
            "n": len(values)}  # fmt: skip


def median_range(values: Sequence[float], digits: int = 1) -> str:
    """``"median [min-max]"`` of ``values`` with ``digits`` decimals (the spread the benchmark tables print)."""
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


_STATISTICS: dict[str, Callable[[Sequence[float]], float | None]] = {
    "p10": lambda v: percentile(v, 10),
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


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def _bootstrap_p50s(samples: Sequence[Sequence[float]], *, n_boot: int, seed: int) -> Any:
    """Paired bootstrap: ``n_boot`` resamples (with replacement) of the positions 0..n-1 shared by every
    sequence in ``samples`` (all of length n); returns an array (n_boot, len(samples)) of the p50 of each
    sequence in each resample."""
    import numpy as np

    data = np.asarray(samples, dtype=float)  # (k, n)
    n = data.shape[1]
    rng = np.random.default_rng(seed)
    out = np.empty((n_boot, data.shape[0]))
    block = max(1, 1_000_000 // (n * data.shape[0]))  # about 8 MB gathered per block
    for start in range(0, n_boot, block):
        rows = min(block, n_boot - start)
        idx = rng.integers(0, n, size=(rows, n))
        out[start:start + rows] = np.median(data[:, idx], axis=2).T
    return out


def bootstrap_ratio_ci(numerator: Sequence[float], denominator: Sequence[float], *,
                       n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0,
                       confidence: float = 0.95) -> list[float] | None:
    """The ``confidence`` interval of p50(numerator) / p50(denominator) by a seeded paired bootstrap:
    position i of both sequences is one request (resampled together). [lo, hi], or None without data,
    without resamples or where every resampled ratio is undefined (a zero p50)."""
    if len(numerator) != len(denominator):
        raise ValueError(f"paired samples differ in length: {len(numerator)} vs {len(denominator)}")
    if not numerator or n_boot <= 0:
        return None
    import numpy as np

    p50 = _bootstrap_p50s([numerator, denominator], n_boot=n_boot, seed=seed)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = p50[:, 0] / p50[:, 1]
    return _interval(ratios, confidence)


def bootstrap_median_ci(values: Sequence[float], *, n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0,
                        confidence: float = 0.95) -> list[float] | None:  # fmt: skip
    """The ``confidence`` interval of the median of ``values`` by a seeded bootstrap: for a median of per-request
    ratios (each request's baseline and mode timed back to back), so requests timed under different loads or on
    different machines pool without their absolute times mixing. [lo, hi], or None without data or resamples."""
    if not values or n_boot <= 0:
        return None
    return _interval(_bootstrap_p50s([values], n_boot=n_boot, seed=seed)[:, 0], confidence)


def wilson_interval(successes: int, n: int, confidence: float = 0.95) -> list[float] | None:
    """The Wilson score interval of ``successes`` out of ``n`` (unlike the normal approximation it stays inside
    [0, 1] and keeps its coverage near 0 and 1 and at small n). None for n = 0."""
    if n <= 0:
        return None
    from statistics import NormalDist

    z = NormalDist().inv_cdf(0.5 + confidence / 2)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def paired_difference_ci(a: Sequence[float], b: Sequence[float], *, n_boot: int = DEFAULT_BOOTSTRAP, seed: int = 0,
                         confidence: float = 0.95) -> list[float] | None:  # fmt: skip
    """The ``confidence`` interval of mean(a) - mean(b) by a seeded paired bootstrap: position i of both sequences
    is one request (resampled together). For a difference of accuracies, a and b are 0/1 per request."""
    if len(a) != len(b):
        raise ValueError(f"paired samples differ in length: {len(a)} vs {len(b)}")
    if not a:
        return None
    import numpy as np

    diff = np.asarray(a, dtype=float) - np.asarray(b, dtype=float)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(n_boot, len(diff)))].mean(axis=1)
    return _interval(means, confidence)


def _interval(values: Any, confidence: float) -> list[float] | None:
    import numpy as np

    finite = values[np.isfinite(values)]
    if not finite.size:
        return None
    tail = 50.0 * (1.0 - confidence)
    lo, hi = np.percentile(finite, [tail, 100.0 - tail])
    return [float(lo), float(hi)]


@dataclass
class _Request:
    """All records of one request under one mode (its repeats)."""

    key: str
    turn: int
    records: list[Mapping[str, Any]] = field(default_factory=list)

    def median(self, name: str) -> float | None:
        return percentile(_values(self.records, name), 50)

    def first(self) -> list[Mapping[str, Any]]:
        """The records of the first repeat (normally one; quality and accuracy are measured there)."""
        first = min(_repeat_of(r) for r in self.records)
        return [r for r in self.records if _repeat_of(r) == first]


def _turn_of(record: Mapping[str, Any]) -> int:
    try:
        return int(record["turn"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"record without a usable integer 'turn': {dict(record)!r:.200}") from exc


def _repeat_of(record: Mapping[str, Any]) -> int:
    value = record.get("repeat")
    if value is None:
        return 0
    try:
        return int(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"record with a non-integer 'repeat': {dict(record)!r:.200}") from exc


def _request_key(record: Mapping[str, Any], index: int) -> str:
    if record.get("request_id") is not None:
        return str(record["request_id"])
    if record.get("conversation_id") is not None:
        return f"{record['conversation_id']}/{_turn_of(record)}"
    return f"#{index}"  # nothing identifies it: its own request, paired with nothing


def _group_requests(records: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, _Request]]:
    """mode -> request key -> _Request, in order of first appearance."""
    by_mode: dict[str, dict[str, _Request]] = {}
    for index, r in enumerate(records):
        if "mode" not in r:
            raise ValueError(f"record without 'mode': {dict(r)!r:.200}")
        turn = _turn_of(r)
        key = _request_key(r, index)
        requests = by_mode.setdefault(str(r["mode"]), {})
        request = requests.setdefault(key, _Request(key, turn))
        if request.turn != turn:
            raise ValueError(f"request {key!r} of mode {r['mode']!r} has records for turns {request.turn} and {turn}")
        request.records.append(r)
    return by_mode


def _first_records(requests: Iterable[_Request]) -> list[Mapping[str, Any]]:
    return [r for req in requests for r in req.first()]


def _stats(requests: list[_Request]) -> dict[str, Any]:
    collapsed = [{name: req.median(name) for name in _COLLAPSED_FIELDS} for req in requests]
    stats: dict[str, Any] = {key: _STATISTICS[stat](_values(collapsed, name))
                             for key, (name, stat) in _STAT_FIELDS.items()}
    stats["n"] = len(requests)
    stats["n_records"] = sum(len(req.records) for req in requests)
    first = _first_records(requests)
    if any("greedy_match" in r for r in first):
        stats["greedy_match_rate"] = _mean(_values(first, "greedy_match"))
    if any(r.get("correct") is not None for r in first):
        stats["accuracy"] = _mean(_values(first, "correct"))
    return stats


def _ttfts(requests: Mapping[str, _Request]) -> dict[str, float]:
    """request key -> the request's TTFT (median over repeats), for requests with one."""
    return {k: t for k, req in requests.items() if (t := req.median("ttft_ms")) is not None}


def _paired(*ttfts: Mapping[str, float], keys: Iterable[str]) -> list[list[float]]:
    """The TTFTs of the requests in ``keys`` that every mapping has, one list per mapping, same order."""
    common = [k for k in keys if all(k in t for t in ttfts)]
    return [[t[k] for k in common] for t in ttfts]


def _speedup(ref: Mapping[str, float], mode: Mapping[str, float], keys: Iterable[str], *, n_boot: int,
             seed: int) -> tuple[float | None, list[float] | None]:
    """p50 of ``ref`` / p50 of ``mode`` over the requests (of ``keys``) both have, and its bootstrap CI."""
    ref_v, mode_v = _paired(ref, mode, keys=keys)
    if not ref_v:
        return None, None
    point = _ratio(percentile(ref_v, 50), percentile(mode_v, 50))
    return point, bootstrap_ratio_ci(ref_v, mode_v, n_boot=n_boot, seed=seed) if point is not None else None


def _quality(records: list[Mapping[str, Any]]) -> dict[str, Any]:
    with_quality = [r for r in records if any(f in r for f in _QUALITY_FIELDS)]
    kl = _values(with_quality, "first_token_kl")
    logit_diff = _values(with_quality, "max_abs_logit_diff")
    # first_divergence present and None means "never diverged"; absent means "not measured"
    measured_div = [r for r in with_quality if "first_divergence" in r]
    divergences = _values(measured_div, "first_divergence")
    return {
        "greedy_match_rate": _mean(_values(with_quality, "greedy_match")),
        # kvboost only: same greedy tokens as the engine's own cold prefill (None where not measured)
        "greedy_match_vs_cold_rate": _mean(_values(records, "greedy_match_vs_cold")),
        "first_token_kl_max": max(kl) if kl else None,
        "first_token_kl_mean": _mean(kl),
        "first_divergence_min": int(min(divergences)) if divergences else None,
        "n_diverged": len(divergences),
        "max_abs_logit_diff_max": max(logit_diff) if logit_diff else None,
        "answer_logprob_delta_mean": _mean(_values(with_quality, "answer_logprob_delta")),
        "n": len(with_quality),
    }


def _accuracy(records: list[Mapping[str, Any]]) -> dict[str, Any]:
    values = _values(records, "correct")
    out = {"accuracy": _mean(values), "n_correct": int(sum(values)), "n": len(values)}
    for name in _SCORE_FIELDS:
        if scores := _values(records, name):
            out[f"{name}_mean"] = _mean(scores)
            out[f"{name}_n"] = len(scores)
    return out


def _scored(record: Mapping[str, Any]) -> bool:
    return record.get("correct") is not None or any(record.get(f) is not None for f in _SCORE_FIELDS)


def summarize(records: Iterable[Mapping[str, Any]], *, baseline_mode: str = "baseline",
              reference_modes: Sequence[str] = (), n_boot: int = DEFAULT_BOOTSTRAP,
              seed: int = 0) -> dict[str, Any]:
    """Aggregate records per mode, per turn and overall, plus quality and accuracy per mode.

    Returns::

        {"modes": {MODE: {"by_turn": {"1": {...}, "2": {...}}, "overall": {...}}},
         "quality": {MODE: {"greedy_match_rate", "greedy_match_vs_cold_rate", "first_token_kl_max", "first_token_kl_mean",
                            "first_divergence_min", "n_diverged", "max_abs_logit_diff_max",
                            "answer_logprob_delta_mean", "n"}},
         "accuracy": {MODE: {"accuracy", "n_correct", "n", "f1_mean", "f1_n"}},  # f1_*: records with f1
         "speculative": {MODE: {"strategy", "drafted_tokens", "accepted_tokens", "acceptance_rate",
                                "target_forwards", "tokens_per_target_forward", "n"}},  # only with drafting
         "speedup_split": {MODE: {"engine_path", "reuse", "total", "engine_path_ci95", "reuse_ci95",
                                  "total_ci95", "n"}},
         "baseline_mode": baseline_mode, "reference_modes": [...],
         "bootstrap": {"resamples": n_boot, "seed": seed, "confidence": 0.95}}

    Each stats dict has ``ttft_ms_p10/p50/p90/mean``, ``total_ms_p50``, ``store_ms_p50``,
    ``decode_tok_s_p50``, ``prompt_tokens_mean``, ``generated_tokens_mean``, mean ``reuse_ratio``,
    ``exact_ratio``, ``content_ratio``, ``recompute_ratio`` (all over requests, each request's value the
    median of its repeats), ``n`` (requests), ``n_records``, ``speedup_vs_baseline_p50`` and
    ``speedup_vs_baseline_ci95``, and per reference mode R ``speedup_vs_R_p50`` and ``speedup_vs_R_ci95``;
    modes with quality fields add ``greedy_match_rate``, modes with ``correct`` add ``accuracy``.
    ``overall`` adds ``reuse_ratio_turns_ge2`` (mean over turns >= 2, where reuse is possible).

    A speedup vs mode R is R's TTFT p50 / this mode's TTFT p50 over the requests both served (paired, so a
    mode missing requests is not credited for their different lengths); None where they share none. Its
    ``_ci95`` is [lo, hi], the 2.5/97.5 percentiles of that ratio over ``n_boot`` seeded resamples of the
    common requests (None with ``n_boot=0``).

    ``speedup_split`` (with a reference mode; the first one if several) splits each other non-baseline
    mode's speedup on the requests all three served: ``engine_path`` = baseline p50 / reference p50,
    ``reuse`` = reference p50 / mode p50, ``total`` = their product = baseline p50 / mode p50. With
    ``kvboost_cold`` as the reference it separates kvboost's own prefill path from its cache reuse.

    Quality and accuracy use each request's first repeat only. ``quality`` only lists modes whose records
    carry a quality field, ``accuracy`` modes whose records carry ``correct``. Turn keys are strings (JSON
    object keys) in numeric order. Percentiles interpolate linearly.
    """
    by_mode = _group_requests(records)
    refs = [baseline_mode] + [m for m in reference_modes if m != baseline_mode]
    ref_names = {baseline_mode: "baseline", **{m: m for m in refs[1:]}}
    ref_ttfts = {m: _ttfts(by_mode.get(m, {})) for m in refs}

    def by_turn(requests: Mapping[str, _Request]) -> dict[int, dict[str, _Request]]:
        groups: dict[int, dict[str, _Request]] = {}
        for key, req in requests.items():
            groups.setdefault(req.turn, {})[key] = req
        return dict(sorted(groups.items()))

    def add_speedups(stats: dict[str, Any], ttfts: Mapping[str, float], keys: Iterable[str]) -> None:
        keys = list(keys)
        for ref in refs:
            point, ci = _speedup(ref_ttfts[ref], ttfts, keys, n_boot=n_boot, seed=seed)
            stats[f"speedup_vs_{ref_names[ref]}_p50"] = point
            stats[f"speedup_vs_{ref_names[ref]}_ci95"] = ci

    modes: dict[str, Any] = {}
    quality: dict[str, Any] = {}
    accuracy: dict[str, Any] = {}
    speculative: dict[str, Any] = {}
    for mode, requests in by_mode.items():
        ttfts = _ttfts(requests)
        per_turn = {}
        for t, reqs in by_turn(requests).items():
            stats = _stats(list(reqs.values()))
            add_speedups(stats, ttfts, reqs)
            per_turn[str(t)] = stats

        overall = _stats(list(requests.values()))
        overall["reuse_ratio_turns_ge2"] = _mean(
            [v for req in requests.values() if req.turn >= 2 and (v := req.median("reuse_ratio")) is not None])
        add_speedups(overall, ttfts, requests)
        modes[mode] = {"by_turn": per_turn, "overall": overall}

        first = _first_records(requests.values())
        if any(f in r for r in first for f in _QUALITY_FIELDS):
            quality[mode] = _quality(first)
        if any(_scored(r) for r in first):
            accuracy[mode] = _accuracy(first)
        if any("drafted_tokens" in r for r in first):
            speculative[mode] = _speculative(first)

    split: dict[str, Any] = {}
    if len(refs) > 1:
        ref = refs[1]
        for mode, requests in by_mode.items():
            if mode in (baseline_mode, ref):
                continue
            entry = _split(ref_ttfts[baseline_mode], ref_ttfts[ref], _ttfts(requests), n_boot=n_boot, seed=seed)
            if entry is not None:
                split[mode] = entry
    return {"modes": modes, "quality": quality, "accuracy": accuracy, "speedup_split": split,
            **({"speculative": speculative} if speculative else {}), "baseline_mode": baseline_mode, "reference_modes": refs[1:],
            "bootstrap": {"resamples": n_boot, "seed": seed, "confidence": 0.95}}


def _speculative(first: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Totals over requests of the draft stats a speculative engine reports (``kvboost.speculative``)."""
    recs = [r for r in first if "drafted_tokens" in r]
    drafted = sum(r["drafted_tokens"] for r in recs)
    accepted = sum(r["accepted_tokens"] for r in recs)
    forwards = sum(r["target_forwards"] for r in recs)
    after_first = sum(max(int(r.get("generated_tokens") or 0) - 1, 0) for r in recs)
    return {"strategy": recs[0].get("speculative"), "drafted_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0, "target_forwards": forwards,
            "tokens_per_target_forward": after_first / forwards if forwards else None, "n": len(recs)}


def _split(base: Mapping[str, float], ref: Mapping[str, float], mode: Mapping[str, float], *, n_boot: int,
           seed: int) -> dict[str, Any] | None:
    base_v, ref_v, mode_v = _paired(base, ref, mode, keys=mode)
    b, r, m = (percentile(v, 50) for v in (base_v, ref_v, mode_v))
    if not base_v or not r or not m:
        return None
    entry: dict[str, Any] = {"engine_path": b / r, "reuse": r / m, "total": b / m, "n": len(base_v),
                             "engine_path_ci95": None, "reuse_ci95": None, "total_ci95": None}
    if n_boot > 0:
        import numpy as np

        p50 = _bootstrap_p50s([base_v, ref_v, mode_v], n_boot=n_boot, seed=seed)
        with np.errstate(divide="ignore", invalid="ignore"):
            entry["engine_path_ci95"] = _interval(p50[:, 0] / p50[:, 1], 0.95)
            entry["reuse_ci95"] = _interval(p50[:, 1] / p50[:, 2], 0.95)
            entry["total_ci95"] = _interval(p50[:, 0] / p50[:, 2], 0.95)
    return entry


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


def fmt_ms(value: float | None) -> str:
    """Milliseconds with three significant digits or more: 1234, 812, 81.2, 8.12."""
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def fmt_spread(p50: float | None, p10: float | None, p90: float | None) -> str:
    """``812 [640-1020]``: p50 with the p10-p90 range; ``-`` without a p50."""
    if p50 is None:
        return "-"
    return fmt_ms(p50) if p10 is None or p90 is None else f"{fmt_ms(p50)} [{fmt_ms(p10)}-{fmt_ms(p90)}]"


def fmt_speedup(point: float | None, ci: Sequence[float] | None = None) -> str:
    """``3.10x (2.80-3.40)``: a ratio with its 95% interval; ``-`` without a ratio."""
    if point is None or not math.isfinite(point):
        return "-"

    def num(v: float) -> str:
        return f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"

    if not ci or any(v is None for v in ci):
        return f"{num(point)}x"
    return f"{num(point)}x ({num(ci[0])}-{num(ci[1])})"


_Column = tuple[str, str, Callable[[str], str]]  # (group header, column header, row key -> cell)


def _render(columns: list[_Column], rows: list[str], first_header: str = "turn") -> list[str]:
    """Fixed-width text table: a group line, a header line, a rule, one line per row (a rule before
    ``overall`` when other rows precede it)."""
    cells = [[get(row) for _, _, get in columns] for row in rows]
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

    row_w = max(len(first_header), *(len(r) for r in rows))
    sep = " | "
    group_line = " " * row_w + sep + sep.join(
        g.center(sum(widths[i] for i in idx) + 2 * (len(idx) - 1)) for g, idx in groups)
    header_line = first_header.ljust(row_w) + sep + sep.join(
        "  ".join(columns[i][1].rjust(widths[i]) for i in idx) for _, idx in groups)
    rule = "-" * len(header_line)
    lines = [group_line.rstrip(), header_line, rule]
    for n, (row, row_cells) in enumerate(zip(rows, cells)):
        if row == "overall" and n:
            lines.append(rule)
        lines.append(row.ljust(row_w) + sep + sep.join(
            "  ".join(row_cells[i].rjust(widths[i]) for i in idx) for _, idx in groups))
    return lines


def format_table(summary: Mapping[str, Any]) -> str:
    """A plain-text table for the terminal (about 150 columns for 4 modes).

    Main table, one row per turn plus ``overall`` (only ``overall`` for a single-turn workload): the number
    of requests, then per mode (baseline first) TTFT ``p50 [p10-p90]`` in ms over requests and, except for
    the baseline, the speedup vs the baseline ``ratio (95% CI)``. A second table: mean reuse ratio per
    non-baseline mode, speedup vs each reference mode, greedy-match rate per mode that measured quality.
    Below: the speedup split, one accuracy line and one quality line per mode where measured. Missing
    values print as ``-``; a summary without records prints ``(no records)``.
    """
    modes = _ordered_modes(summary)
    if not modes:
        return "(no records)"
    base = summary.get("baseline_mode", "baseline")
    refs = [r for r in summary.get("reference_modes", []) if r in modes]
    quality = summary.get("quality", {})
    quality_modes = [m for m in modes if m in quality]
    accuracy = summary.get("accuracy", {})
    boot = summary.get("bootstrap", {})

    def stats(mode: str, row: str) -> Mapping[str, Any]:
        m = summary["modes"].get(mode, {})
        return m.get("overall", {}) if row == "overall" else m.get("by_turn", {}).get(row, {})

    turns = _turn_keys(summary)
    rows = (turns if len(turns) > 1 else []) + ["overall"]

    def n_cell(row: str) -> str:
        counts = [stats(m, row).get("n") for m in modes]
        present = [c for c in counts if c]
        if len(set(present)) <= 1:
            return str(present[0]) if present else "-"
        return "/".join("-" if c is None else str(c) for c in counts)

    main: list[_Column] = [("", "n", n_cell)]
    for mode in modes:
        main.append((mode, "TTFT ms", lambda row, m=mode: fmt_spread(
            stats(m, row).get("ttft_ms_p50"), stats(m, row).get("ttft_ms_p10"), stats(m, row).get("ttft_ms_p90"))))
        if mode != base:
            main.append((mode, f"vs {base}", lambda row, m=mode: fmt_speedup(
                stats(m, row).get("speedup_vs_baseline_p50"), stats(m, row).get("speedup_vs_baseline_ci95"))))

    n_boot = boot.get("resamples")
    ci_note = (f" (95% paired bootstrap interval, {n_boot} resamples)" if n_boot
               else " (no interval)" if n_boot is not None else "")
    lines = [
        "TTFT ms: p50 [p10-p90] over requests, each request's TTFT the median of its repeats",
        f"vs X: X's TTFT p50 / the mode's, on the requests both served{ci_note}",
        "",
    ]
    lines += _render(main, rows)

    extra: list[_Column] = []
    for mode in modes:
        if mode != base and any(stats(mode, r).get("reuse_ratio") is not None for r in rows):
            extra.append(("reuse (mean)", mode, lambda row, m=mode: _fmt(stats(m, row).get("reuse_ratio"), ".1%")))
    for ref in refs:
        for mode in modes:
            if mode not in (base, ref):
                extra.append((f"vs {ref}", mode, lambda row, m=mode, r=ref: fmt_speedup(
                    stats(m, row).get(f"speedup_vs_{r}_p50"), stats(m, row).get(f"speedup_vs_{r}_ci95"))))
    for mode in quality_modes:
        extra.append(("greedy match", mode, lambda row, m=mode: _fmt(stats(m, row).get("greedy_match_rate"), ".0%")))
    if extra:
        lines.append("")
        lines += _render(extra, rows)

    split = summary.get("speedup_split", {})
    if split and refs:
        lines += ["", f"speedup split on the requests all three served: engine path = {base} / {refs[0]}, "
                      f"reuse = {refs[0]} / mode (TTFT p50 ratios)"]
        for mode in [m for m in modes if m in split]:
            s = split[mode]
            lines.append(
                f"{mode}: {fmt_speedup(s.get('total'), s.get('total_ci95'))} vs {base} = engine path "
                f"{fmt_speedup(s.get('engine_path'), s.get('engine_path_ci95'))} x reuse "
                f"{fmt_speedup(s.get('reuse'), s.get('reuse_ci95'))}, n={s.get('n', 0)}")

    if accuracy or quality_modes:
        lines.append("")
    for mode in [m for m in modes if m in accuracy]:
        a = accuracy[mode]
        lines.append(f"{mode}: accuracy {_fmt(a.get('accuracy'), '.1%')} "
                     f"({a.get('n_correct', 0)} of {a.get('n', 0)} requests correct)"
                     + (f", F1 mean {a['f1_mean']:.3f} (n={a.get('f1_n')})" if a.get("f1_mean") is not None else ""))
    if quality_modes:
        lines.append(greedy_match_legend(summary))
    for mode in quality_modes:
        q = quality[mode]
        first_div = q.get("first_divergence_min")
        delta = q.get("answer_logprob_delta_mean")
        lines.append(
            f"{mode}: greedy match {_fmt(q.get('greedy_match_rate'), '.1%')}, first-token KL max "
            f"{_fmt(q.get('first_token_kl_max'), '.3g')} mean {_fmt(q.get('first_token_kl_mean'), '.3g')}, "
            f"first divergence min {'none' if first_div is None else first_div}"
            f" ({q.get('n_diverged', 0)} of {q.get('n', 0)} diverged)"
            + (f", answer log-prob delta mean {delta:+.3g}" if delta is not None else "")
            + (f"; same tokens as kvboost_cold {q['greedy_match_vs_cold_rate']:.1%}"
               if q.get("greedy_match_vs_cold_rate") is not None else ""))
    return "\n".join(lines)


def greedy_match_legend(summary: Mapping[str, Any]) -> str:
    """The plain-words meaning of the "greedy match" column, with the run's token count and dtype."""
    cfg = summary.get("config") or {}
    tokens = (cfg.get("workload") or {}).get("max_new_tokens")
    dtype = (summary.get("run") or {}).get("dtype") or (cfg.get("model") or {}).get("dtype")
    import textwrap

    text = (f"greedy match: share of requests whose greedy tokens equal the baseline's (HF generate on the same "
            f"prompt ids) over all {tokens or 'N'} generated tokens (fewer where both stop at end-of-sequence).")  # fmt: skip
    if dtype is None or "float32" not in str(dtype):
        text += (" In bf16 (and fp16) the kernels round differently for other batch shapes (a cached prefix "
                 "leaves a shorter prefill), so a mismatch need not be a reuse error: compare with 'same tokens as "
                 "kvboost_cold', or run model.dtype=float32 (exact) or attn=batch_invariant (README: Exactness in "
                 "bf16).")  # fmt: skip
    return "\n".join(textwrap.wrap(text, 120, subsequent_indent="  "))


def format_overhead(overhead: Mapping[str, Any]) -> str:
    """kvboost's lookup + assembly time per request against hf_prefix's crop of its carried cache, and what it is.

    The two only do the same work where they reuse the same tokens (exact prefixes of a chat). Where kvboost reuses
    more (content hits: a RAG prompt's reordered documents, which hf_prefix cannot reuse past the first change),
    the difference is the price of that reuse, paid back by the prefill it saves: the hits' KV read out of the
    pool, keys re-rotated to their new positions in a float32 copy, and written into the request's blocks
    (measured for 1314 reused tokens, bf16, 1 thread of a loaded 2-core Zen 4: lookup 58 ms, assembly 79 ms, of
    which the pool write 46 ms and the rotation 20 ms). The line then says so and prints both."""
    line = (f"kvboost lookup+assembly overhead vs hf_prefix crop: {overhead['lookup_ms_mean_diff']:+.2f} ms/request; "
            f"extra prefill tokens: {overhead['extra_prefill_tokens_mean']:+.1f}/request")
    k_cached, h_cached = overhead.get("kvboost_cached_tokens_mean"), overhead.get("hf_prefix_cached_tokens_mean")
    if k_cached is None or h_cached is None or k_cached - h_cached < 0.1 * max(k_cached, 1.0):
        return line
    content = overhead.get("kvboost_content_ratio_mean")
    prefill_diff = overhead.get("prefill_ms_mean_diff")
    return (
        f"kvboost lookup+assembly vs hf_prefix crop: {overhead['lookup_ms_mean_diff']:+.2f} ms/request; not overhead "
        f"on the same work: kvboost reused {k_cached:.0f} tokens/request"
        + (f" ({content:.0%} of the prompt by content: keys re-rotated per layer and copied into its KV pool)"
           if content else "")
        + f", hf_prefix {h_cached:.0f} (its carried cache cut at the first differing token); the prefill that "
        f"saved: {overhead['extra_prefill_tokens_mean']:+.0f} tokens"
        + (f", {prefill_diff:+.0f} ms/request" if prefill_diff is not None else "")
    )  # fmt: skip


def explain_hf_prefix(summary: Mapping[str, Any]) -> str | None:
    """A line beside hf_prefix's figure when it is slower than the baseline while reusing little: why.

    A carried cache serves only the prefix up to the first token that differs from the last request (in
    rag_reorder: the system prompt's head, before the reordered documents), so hf_prefix prefills almost the
    whole prompt like the baseline, but *after a cache*: HF then builds an explicit causal mask and its SDPA runs
    the masked kernel over every key block instead of the ``is_causal`` path, which skips the upper triangle.
    Measured on a 2-core AMD EPYC (Zen 4), bf16, SmolLM2 shape at 1.5k tokens: SDPA 1.6-1.75x per layer, the
    whole forward 1.31x (``experiments/results/rag_reorder_overhead/README.md``)."""
    modes = summary.get("modes") or {}
    overall = (modes.get("hf_prefix") or {}).get("overall") or {}
    speed, reuse = overall.get("speedup_vs_baseline_p50"), overall.get("reuse_ratio")
    if speed is None or reuse is None or speed >= 0.95 or reuse >= 0.2:
        return None
    return (f"hf_prefix {speed:.2f}x vs baseline while reusing {reuse:.0%} of each prompt: its one carried cache "
            "serves only the prefix before the first token that differs from the last request, so it prefills "
            "nearly the whole prompt, and after a cache HF's SDPA takes an explicit causal mask (the masked kernel "
            "over every key block) instead of the is_causal path a cold prefill takes (measured 1.3x slower for "
            "the whole 1.5k-token forward in bf16 on a CPU); see the interval for the noise")  # fmt: skip


# ------------------------------------------------------------------------------------------------- plots
def _series(summary: Mapping[str, Any], mode: str, key: str) -> tuple[list[int], list[float]]:
    by_turn = summary["modes"][mode].get("by_turn", {})
    pts = [(int(t), s[key]) for t, s in by_turn.items() if s.get(key) is not None]
    pts.sort()
    return [p[0] for p in pts], [p[1] for p in pts]


def _new_figure(size: tuple[float, float] = (7, 4.5), ncols: int = 1) -> tuple[Any, list[Any]]:
    # Figure + Agg canvas directly: no pyplot global state, no backend switch for the caller's process
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def line_styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Distinct marker and dash style per name: series with equal numbers overlap exactly (e.g. hf_prefix
    and kvboost reuse), so colour alone would hide one."""
    return {m: dict(marker="osD^vP*X"[i % 8], linestyle=("-", "--", "-.", ":")[i % 4]) for i, m in enumerate(names)}


def plot_summary(summary: Mapping[str, Any], out_dir: str | os.PathLike) -> list[Path]:
    """Write the run's plots into ``out_dir``; returns their paths.

    Several turns: ``ttft_by_turn.png`` (TTFT p50 per turn per mode, band p10 to p90) and
    ``reuse_by_turn.png`` (mean reuse ratio per turn per mode). A single turn (single-turn workloads):
    ``ttft_by_mode.png`` instead (TTFT p50 per mode with p10-p90 error bars, and mean reuse per mode)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if len(_turn_keys(summary)) == 1:
        return [_plot_by_mode(summary, out / "ttft_by_mode.png")]

    from matplotlib.ticker import MaxNLocator, PercentFormatter

    modes = _ordered_modes(summary)
    styles = line_styles(modes)
    paths = []

    fig, (ax,) = _new_figure()
    for mode in modes:
        turns, p50 = _series(summary, mode, "ttft_ms_p50")
        if not turns:
            continue
        (line,) = ax.plot(turns, p50, label=f"{mode} p50", **styles[mode])
        by_turn = summary["modes"][mode]["by_turn"]
        band = [(t, lo, hi) for t in turns
                if (lo := by_turn[str(t)].get("ttft_ms_p10")) is not None
                and (hi := by_turn[str(t)].get("ttft_ms_p90")) is not None]
        if band:
            ax.fill_between([b[0] for b in band], [b[1] for b in band], [b[2] for b in band],
                            color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_title("Time to first token by turn (line: p50, band: p10 to p90 over requests)")
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

    fig, (ax,) = _new_figure()
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


def _plot_by_mode(summary: Mapping[str, Any], path: Path) -> Path:
    from matplotlib.ticker import PercentFormatter

    modes = _ordered_modes(summary)
    overall = [summary["modes"][m].get("overall", {}) for m in modes]
    x = list(range(len(modes)))
    fig, (ax, ax_reuse) = _new_figure((10, 4.5), ncols=2)

    p50 = [s.get("ttft_ms_p50") for s in overall]
    heights = [v if v is not None else 0.0 for v in p50]
    bars = ax.bar(x, heights, color=[f"C{i}" for i in x], alpha=0.8)
    err = [[v - s["ttft_ms_p10"], s["ttft_ms_p90"] - v] if v is not None and s.get("ttft_ms_p10") is not None
           and s.get("ttft_ms_p90") is not None else [0.0, 0.0] for v, s in zip(p50, overall)]
    ax.errorbar(x, heights, yerr=[[e[0] for e in err], [e[1] for e in err]], fmt="none", ecolor="black", capsize=5)
    for bar, s, v in zip(bars, overall, p50):
        if v is None:
            continue
        text = fmt_speedup(s.get("speedup_vs_baseline_p50"))
        ax.annotate(f"{fmt_ms(v)} ms" + (f"\n{text}" if text != "-" else ""), (bar.get_x() + bar.get_width() / 2, v),
                    xytext=(4, 2), textcoords="offset points", ha="left", va="bottom", fontsize=8)
    ax.set_xticks(x, modes, rotation=20, ha="right")
    ax.set_ylabel("TTFT (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("Time to first token per mode\n(bar: p50, whiskers: p10 to p90, label: speedup vs baseline)",
                 fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)

    reuse = [s.get("reuse_ratio") for s in overall]
    ax_reuse.bar(x, [v if v is not None else 0.0 for v in reuse], color=[f"C{i}" for i in x], alpha=0.8)
    ax_reuse.set_xticks(x, modes, rotation=20, ha="right")
    ax_reuse.set_ylim(0, 1.02)
    ax_reuse.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax_reuse.set_title("Prompt tokens served from cache (mean)", fontsize=10)
    ax_reuse.grid(True, axis="y", alpha=0.3)
    fig.savefig(path, dpi=120)
    return path


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
