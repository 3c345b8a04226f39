"""The number a sweeper optimises: one run's summary reduced to a float (lower is better).

``objective`` in the run config (``kvboost/configs/config.yaml``)::

    objective:
      mode: kvboost            # whose metric
      metric: ttft_ms_p50      # a key of summary["modes"][mode]["overall"] (minimised)
      constraint:              # optional quality bound; null = none
        metric: accuracy_drop  # accuracy_drop | greedy_mismatch | first_token_kl_mean
        max: 0.03

Quality constraints compare the mode with the baseline of the same run: ``accuracy_drop`` = baseline accuracy -
mode accuracy (workloads with answers), ``greedy_mismatch`` = 1 - greedy match rate, ``first_token_kl_mean``
as measured. A run that breaks its constraint returns ``BROKEN_CONSTRAINT + value``: the sweeper keeps the trial
and ranks it after every run that holds it (Optuna's TPE has no native constraints).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

BROKEN_CONSTRAINT = 1e9
CONSTRAINT_METRICS = ("accuracy_drop", "greedy_mismatch", "first_token_kl_mean")


class ObjectiveError(ValueError):
    """An objective that this run's summary cannot give (unknown metric, mode not run, no accuracy...)."""


def constraint_value(summary: Mapping[str, Any], mode: str, metric: str) -> float:
    """The quality figure a constraint bounds (see the module docstring)."""
    if metric == "accuracy_drop":
        acc = summary.get("accuracy") or {}
        base = summary.get("baseline_mode", "baseline")
        if mode not in acc or base not in acc:
            raise ObjectiveError(f"accuracy_drop needs accuracy for {base!r} and {mode!r} (a workload with answers)")
        return float(acc[base]["accuracy"]) - float(acc[mode]["accuracy"])
    quality = (summary.get("quality") or {}).get(mode)
    if quality is None:
        raise ObjectiveError(f"no quality measured for mode {mode!r} (is the baseline mode in workload.modes?)")
    if metric == "greedy_mismatch":
        return 1.0 - float(quality["greedy_match_rate"])
    if metric == "first_token_kl_mean":
        return float(quality["first_token_kl_mean"])
    raise ObjectiveError(f"unknown constraint metric {metric!r}; use one of {', '.join(CONSTRAINT_METRICS)}")


def objective_mode_not_run(cfg: Mapping[str, Any]) -> str | None:
    """Why the configured sweep objective cannot be computed from this run (its mode is not among the workload's
    modes), or None."""
    objective = cfg.get("objective")
    if not objective:
        return None
    mode = objective.get("mode", "kvboost")
    modes = list((cfg.get("workload") or {}).get("modes") or [])
    if modes and mode not in modes:
        return (f"objective.mode {mode!r} is not among workload.modes {modes}; add it, or set objective.mode to one "
                "of them")  # fmt: skip
    return None


def sweep_objective(summary: Mapping[str, Any], objective: Mapping[str, Any] | None) -> float | None:
    """The value to minimise, or None when the config has no objective."""
    if not objective:
        return None
    mode, metric = objective.get("mode", "kvboost"), objective.get("metric", "ttft_ms_p50")
    overall = ((summary.get("modes") or {}).get(mode) or {}).get("overall")
    if overall is None:
        raise ObjectiveError(f"objective.mode {mode!r} was not run (workload.modes)")
    if not isinstance(overall.get(metric), (int, float)):
        numeric = sorted(k for k, v in overall.items() if isinstance(v, (int, float)))
        raise ObjectiveError(f"objective.metric {metric!r} is not a number in the summary; available: {', '.join(numeric)}")
    value = float(overall[metric])
    constraint = objective.get("constraint")
    if constraint:
        measured = constraint_value(summary, mode, constraint["metric"])
        if math.isnan(measured) or measured > float(constraint["max"]):
            return BROKEN_CONSTRAINT + value
    return value
