"""Result loggers chosen by ``logger=none|wandb``."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class NullLogger:
    """Logs nothing (records.jsonl and summary.json are written regardless)."""

    def log_request(self, record: dict[str, Any], step: int) -> None:
        pass

    def log_summary(self, summary: dict[str, Any], plots: list[Path]) -> None:
        pass

    def finish(self) -> None:
        pass


class WandbLogger(NullLogger):
    """Weights & Biases, laid out the way sweeps are read there. Offline by default (no network).

    - runs of one Hydra sweep share a ``group`` (the sweep folder) and a ``job_type`` (the experiment name, else
      the workload), and each run is named by its override string, so W&B's grouping and run table line up with
      the sweep;
    - per request: every numeric metric under ``MODE/metric`` (step = request index);
    - at the end: summary metrics with stable names (``summary_metric_names``), the per-turn table as a
      ``wandb.Table`` (``per_turn``), and every plot as an image;
    - offline runs print the ``wandb sync`` line that uploads them later; ``mode: online`` in the logger config
      (or ``WANDB_MODE=online``) logs live (``wandb login`` first).
    """

    def __init__(self, *, project: str = "kvboost", entity: str | None = None, mode: str | None = None,
                 group: str | None = None, tags: list[str] | None = None, run_name: str | None = None,
                 job_type: str | None = None, out_dir: str | Path = ".", config: dict[str, Any] | None = None,
                 run_info: dict[str, Any] | None = None) -> None:  # fmt: skip
        import wandb

        self._wandb = wandb
        info = run_info or {}
        self.mode = mode or os.environ.get("WANDB_MODE") or "offline"
        overrides = [o for o in info.get("overrides") or [] if not o.startswith("logger")]
        self.run = wandb.init(
            project=project, entity=entity, mode=self.mode,
            group=group or info.get("sweep_dir"),
            job_type=job_type or info.get("experiment") or (config or {}).get("workload", {}).get("name"),
            name=run_name or (" ".join(overrides) or "defaults"),
            tags=tags, dir=str(out_dir), config=config or {}, reinit="finish_previous",
        )  # fmt: skip

    def log_request(self, record: dict[str, Any], step: int) -> None:
        numeric = {f"{record['mode']}/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        numeric["turn"] = record.get("turn")
        self.run.log(numeric, step=step)

    def log_summary(self, summary: dict[str, Any], plots: list[Path]) -> None:
        self.run.summary.update(summary_metric_names(summary))
        columns, rows = per_turn_rows(summary)
        payload: dict[str, Any] = {"per_turn": self._wandb.Table(columns=columns, data=rows)}
        payload.update({f"plots/{p.stem}": self._wandb.Image(str(p)) for p in plots})
        self.run.log(payload)

    def finish(self) -> None:
        run_dir = Path(self.run.dir).parent  # .../wandb/offline-run-<time>-<id>
        self.run.finish()
        if self.mode == "offline":
            # finish() can return before W&B's service has written the run's last records; tearing the service
            # down waits for it (a next run starts a new one), so the folder is complete when this returns.
            self._wandb.teardown()
        if self.mode == "offline":
            print(f"W&B run saved offline; upload it with: wandb sync {run_dir}")


#: per-turn table columns (``per_turn_rows``)
PER_TURN_COLUMNS = ("mode", "turn", "n", "ttft_ms_p10", "ttft_ms_p50", "ttft_ms_p90", "speedup_vs_baseline_p50",
                    "reuse_ratio", "exact_ratio", "content_ratio", "recompute_ratio", "greedy_match_rate")  # fmt: skip


def per_turn_rows(summary: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows) of the per-turn table: one row per mode and turn, missing values as None."""
    rows = []
    for mode, data in summary.get("modes", {}).items():
        for turn, values in (data.get("by_turn") or {}).items():
            rows.append([mode, str(turn), *(values.get(c) for c in PER_TURN_COLUMNS[2:])])
    return list(PER_TURN_COLUMNS), rows


def summary_metric_names(summary: dict[str, Any]) -> dict[str, float]:
    """Summary metrics under names that stay the same across runs, so W&B's run table and charts compare them:
    ``overall/MODE/METRIC`` (TTFT percentiles, speedups, reuse...), ``quality/MODE/METRIC`` (vs the baseline),
    ``accuracy/MODE`` where a workload has answers."""
    flat: dict[str, float] = {}
    for mode, data in summary.get("modes", {}).items():
        for key, value in (data.get("overall") or {}).items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[f"overall/{mode}/{key}"] = value
    for mode, data in summary.get("quality", {}).items():
        for key, value in data.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                flat[f"quality/{mode}/{key}"] = value
    for mode, data in (summary.get("accuracy") or {}).items():
        if isinstance(data, dict) and isinstance(data.get("accuracy"), (int, float)):
            flat[f"accuracy/{mode}"] = data["accuracy"]
    return flat


def build_logger(cfg: dict[str, Any] | None, *, out_dir: Path, config: dict[str, Any],
                 run_info: dict[str, Any] | None = None) -> NullLogger:
    """The logger named by ``cfg["name"]``; ``run_info`` (overrides, experiment, sweep folder) names W&B runs."""
    cfg = dict(cfg or {"name": "none"})
    name = cfg.pop("name", "none")
    cfg.pop("description", None)
    if name == "none":
        return NullLogger()
    if name == "wandb":
        return WandbLogger(out_dir=out_dir, config=config, run_info=run_info, **cfg)
    raise ValueError(f"unknown logger {name!r}; use one of: none, wandb")
