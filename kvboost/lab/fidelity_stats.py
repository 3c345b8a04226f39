"""Statistics of fidelity records (issue 59): per-arm means with bootstrap intervals by question, paired differences
by question, and a two-sided equivalence test (TOST) with a stated margin.

The unit of resampling is the *question*: a cell holds one record per (question, arm), and every interval
resamples questions (never passage orders or repeats of one question, which are not independent samples).
Parity is an equivalence test, not "within 0.03": an arm is equivalent to another on a measure when both one-sided
t-tests of their paired per-question differences reject at ``alpha`` against the margin ``-margin`` and
``+margin`` (Schuirmann's TOST); a large gain fails it as surely as a large loss.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from kvboost.lab.report import paired_difference_ci

#: Equivalence margins per measure (absolute, in the measure's units), stated with every verdict: 0.05 of token F1
#: and of the greedy-match rate (5 questions in 100), 0.05 nats of gold log-probability per answer.
DEFAULT_MARGINS = {"f1": 0.05, "f1_ref": 0.05, "greedy_match": 0.05, "gold_logprob_delta": 0.05}
ALPHA = 0.05


def mean_ci(values: Sequence[float], *, n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Mean of per-question values with its 95% bootstrap interval over questions (``ci`` None without data)."""
    vals = [float(v) for v in values]
    if not vals:
        return {"mean": None, "ci": None, "n": 0}
    return {"mean": sum(vals) / len(vals), "ci": paired_difference_ci(vals, [0.0] * len(vals), n_boot=n_boot,
                                                                       seed=seed), "n": len(vals)}  # fmt: skip


def paired(a: Mapping[str, float], b: Mapping[str, float], *, n_boot: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Mean of a - b over the questions both have, with its 95% paired bootstrap interval (questions resampled)."""
    common = sorted(set(a) & set(b))
    x, y = [float(a[q]) for q in common], [float(b[q]) for q in common]
    if not common:
        return {"diff": None, "ci": None, "n": 0}
    diff = sum(x) / len(x) - sum(y) / len(y)
    return {"diff": diff, "ci": paired_difference_ci(x, y, n_boot=n_boot, seed=seed), "n": len(common)}


def tost(a: Mapping[str, float], b: Mapping[str, float], margin: float, alpha: float = ALPHA) -> dict[str, Any]:
    """Schuirmann's two one-sided tests on the paired per-question differences a - b: equivalent when the mean
    difference is significantly above ``-margin`` and below ``+margin`` (each one-sided t-test at ``alpha``).
    Returns ``p`` (the larger one-sided p-value), ``equivalent``, ``margin``, ``n``. Fewer than 2 questions: no
    verdict (``equivalent`` None). Differences without spread: equivalent iff the difference lies inside the margin."""
    if not margin > 0:
        raise ValueError(f"tost: the margin must be > 0, got {margin!r}")
    common = sorted(set(a) & set(b))
    diffs = [float(a[q]) - float(b[q]) for q in common]
    out: dict[str, Any] = {"margin": margin, "alpha": alpha, "n": len(diffs), "p": None, "equivalent": None}
    if len(diffs) < 2:
        return out
    from scipy import stats

    mean = sum(diffs) / len(diffs)
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (len(diffs) - 1))
    if sd == 0.0:
        p = 0.0 if abs(mean) < margin else 1.0
    else:
        lower = stats.ttest_1samp(diffs, -margin, alternative="greater").pvalue
        upper = stats.ttest_1samp(diffs, margin, alternative="less").pvalue
        p = float(max(lower, upper))
    out.update(p=p, equivalent=p < alpha)
    return out


def by_question(records: Sequence[Mapping[str, Any]], arm: str, field: str) -> dict[str, float]:
    """``{question: value}`` of one arm's ``field`` (records without it, or with None, left out). ValueError when
    a question has two records of the arm: a cell must hold one per (question, arm)."""
    out: dict[str, float] = {}
    for r in records:
        if r["arm"] != arm or r.get(field) is None:
            continue
        if r["question"] in out:
            raise ValueError(f"two records of arm {arm!r} for question {r['question']!r}: one per (question, arm)")
        out[r["question"]] = float(r[field])
    return out
