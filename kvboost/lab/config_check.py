"""Configs are data, checked when composed: every plugin name is registered and every field an argument.

``check_config(cfg)`` runs before the runner loads anything, so a typo (``chunker.chunk_szie=32``, an unknown
recompute strategy, a workload field that does not exist) fails at start-up with the field's name, not after
a model was loaded and half a run was measured. ``tests/test_configs.py`` composes every config file of every
group with Hydra's compose API and runs it through here.
"""

from __future__ import annotations

from typing import Any

from kvboost.build import check_engine_config
from kvboost.lab.modes import MODES
from kvboost.lab.workloads import WORKLOADS

#: workload config fields the runner reads itself (not passed to the workload)
RUNNER_WORKLOAD_FIELDS = ("modes", "repeats")
LOGGERS = ("none", "wandb")


def split_workload_config(cfg: dict[str, Any]) -> tuple[str, dict[str, Any], list[str], int]:
    """(workload name, its own fields, runner modes, repeats) from ``cfg["workload"]``."""
    workload = dict(cfg.get("workload") or {"name": "sharegpt_replay"})
    workload.pop("description", None)
    name = workload.pop("name", "sharegpt_replay")
    modes = list(workload.pop("modes", None) or ["baseline", "hf_prefix", "kvboost_cold", "kvboost"])
    repeats = workload.pop("repeats", 1)
    return name, workload, modes, repeats


def check_config(cfg: dict[str, Any]) -> None:
    """Raise ValueError (or UnknownPluginError) for the first thing in ``cfg`` no run could use: the engine and
    model parts (:func:`kvboost.build.check_engine_config`), then the workload, its modes and the logger."""
    check_engine_config(cfg)
    name, fields, modes, repeats = split_workload_config(cfg)
    WORKLOADS.validate({"name": name, **fields}, provided=("env",))
    unknown_modes = [m for m in modes if m not in MODES]
    if unknown_modes or not modes:
        raise ValueError(f"unknown modes {unknown_modes or modes}; available: {', '.join(MODES.names())}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"workload.modes lists a mode twice: {modes}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"workload.repeats must be a positive integer, got {repeats!r}")

    logger = dict(cfg.get("logger") or {"name": "none"})
    if logger.get("name", "none") not in LOGGERS:
        raise ValueError(f"unknown logger {logger.get('name')!r}; use one of: {', '.join(LOGGERS)}")
