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
    """Weights & Biases. Offline by default (no network): ``wandb sync <dir>`` uploads later.

    ``mode: online`` in the logger config (or ``WANDB_MODE=online``) logs live.
    """

    def __init__(self, *, project: str = "kvboost", entity: str | None = None, mode: str | None = None,
                 group: str | None = None, tags: list[str] | None = None, run_name: str | None = None,
                 out_dir: str | Path = ".", config: dict[str, Any] | None = None) -> None:  # fmt: skip
        import wandb

        self._wandb = wandb
        mode = mode or os.environ.get("WANDB_MODE") or "offline"
        self.run = wandb.init(
            project=project, entity=entity, mode=mode, group=group, tags=tags, name=run_name,
            dir=str(out_dir), config=config or {}, reinit="finish_previous",
        )  # fmt: skip

    def log_request(self, record: dict[str, Any], step: int) -> None:
        numeric = {f"{record['mode']}/{k}": v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        numeric["turn"] = record.get("turn")
        self.run.log(numeric, step=step)

    def log_summary(self, summary: dict[str, Any], plots: list[Path]) -> None:
        flat: dict[str, Any] = {}
        for mode, data in summary.get("modes", {}).items():
            for key, value in (data.get("overall") or {}).items():
                if isinstance(value, (int, float)):
                    flat[f"overall/{mode}/{key}"] = value
        for mode, data in summary.get("quality", {}).items():
            for key, value in data.items():
                if isinstance(value, (int, float)):
                    flat[f"quality/{mode}/{key}"] = value
        self.run.summary.update(flat)
        images = {f"plots/{p.stem}": self._wandb.Image(str(p)) for p in plots}
        if images:
            self.run.log(images)

    def finish(self) -> None:
        self.run.finish()


def build_logger(cfg: dict[str, Any] | None, *, out_dir: Path, config: dict[str, Any]) -> NullLogger:
    cfg = dict(cfg or {"name": "none"})
    name = cfg.pop("name", "none")
    cfg.pop("description", None)
    if name == "none":
        return NullLogger()
    if name == "wandb":
        return WandbLogger(out_dir=out_dir, config=config, **cfg)
    raise ValueError(f"unknown logger {name!r}; use one of: none, wandb")
