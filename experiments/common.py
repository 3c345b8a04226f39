"""What the scripts of ``experiments/bench``, ``experiments/checks`` and ``experiments/sims`` share.

Running a script. From the repository root, as a module::

    python -m experiments.bench.bench_decode --help
    python -m experiments.checks.kv_quant_check bytes
    python -m experiments.sims.cache_sim --help

``-m`` puts the current directory first on ``sys.path``, so the script runs this checkout's ``kvboost`` and
``experiments`` (also in a git worktree of another commit, which the A/B scripts rely on), installed or not;
``experiments`` itself is never installed (the wheel leaves it out), so ``-m`` from the root is the one way to run
a script. That is the one bootstrap: no script edits ``sys.path`` to find the project. (Two scripts put *another* checkout first on
purpose, to measure it: ``bench/ab.py``'s request worker and ``bench/bench_overhead.py --kvboost-root``; they
use :func:`use_checkout`.)

Contents: paths (:data:`REPO_ROOT`, :data:`RESULTS_DIR`), CLI conventions (:func:`add_threads_arg`,
:func:`set_threads`), timing (:func:`time_ms`, :func:`median_ms`), statistics (:func:`percentile` and the
helpers built on it, re-exported from :mod:`kvboost.lab.report`, where the runner's summaries use the same
definition), writers (:func:`write_json`, :func:`write_markdown`), :func:`stop_process` (a server the script
started), :func:`script_module` (a module of ``scripts/``, which is not a package).

The percentile. ``percentile(values, q)``: ``q`` in 0..100, linear interpolation between the closest ranks
(numpy's default ``method="linear"``: position ``(n - 1) * q / 100`` in the sorted values); ``None`` for no
values. It is the only one in the project: ``p10``/``p50``/``p90`` in ``summary.json``, in the benchmark tables and
in the load test all mean this.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# The one percentile of the project (and the helpers built on it) live in the runner's report module, which the
# summaries of run.py use: a p90 in a benchmark table and in summary.json mean the same thing.
from kvboost.lab.report import (
    cached_new_shape,
    median_range,
    percentile,
    rotated,
    serve_prefix_hit,
    spread,
)
from kvboost.paths import CONFIG_DIR

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "experiments" / "results"

__all__ = [
    "REPO_ROOT",
    "RESULTS_DIR",
    "add_threads_arg",
    "cached_new_shape",
    "compose_run_config",
    "median_ms",
    "median_range",
    "percentile",
    "rotated",
    "script_module",
    "serve_prefix_hit",
    "set_threads",
    "spread",
    "time_ms",
    "use_checkout",
    "write_json",
    "write_markdown",
]


# ------------------------------------------------------------------------------------------------------ CLI
def add_threads_arg(parser: argparse.ArgumentParser, default: int | None = None) -> None:
    """``--threads N``: torch intra-op threads (default: torch's own choice, usually the core count)."""
    parser.add_argument("--threads", type=int, default=default, help="torch intra-op threads (default: torch's)")


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads when ``threads`` is given; return the number in use."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def compose_run_config(overrides: Sequence[str] = (), **parts: Any) -> dict[str, Any]:
    """The config ``python run.py OVERRIDES`` would run (Hydra compose over ``kvboost/configs/``), as plain containers.

    ``parts``: what a benchmark sets after composing, for values Hydra's override grammar says badly (a plugin
    spec built in code, a cache stack with a temporary folder): a config group (``cache=[...]``, ``quant={...}``)
    replaces the composed one; an engine option (``decode="eager"``, :data:`kvboost.build.ENGINE_OPTIONS`) goes
    into ``engine``; a model field (``dtype="bfloat16"``, :data:`kvboost.build.MODEL_FIELDS`) into ``model``.
    The result is what :func:`kvboost.build.build_engine` takes: every benchmark builds its engine that way.
    """
    from kvboost.build import ENGINE_OPTIONS, MODEL_FIELDS

    out: dict[str, Any] = json.loads(_composed(tuple(overrides)))  # a fresh copy per call: callers change it
    for key, value in parts.items():
        if key in ENGINE_OPTIONS:
            out["engine"] = {**(out.get("engine") or {}), key: value}
        elif key in MODEL_FIELDS:
            out["model"] = {**(out.get("model") or {}), key: value}
        elif key in out:
            out[key] = value
        else:  # a typo must not become a silently ignored key
            raise ValueError(f"compose_run_config: {key!r} is no config group, engine option or model field")
    return out


@functools.lru_cache(maxsize=32)
def _composed(overrides: tuple[str, ...]) -> str:
    """The composed config as JSON text, once per overrides (a benchmark composes one per engine it builds)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides))
    return json.dumps(OmegaConf.to_container(cfg, resolve=True))


def use_checkout(root: str | Path) -> Path:
    """Put checkout ``root`` first on ``sys.path`` (its ``kvboost`` is the one measured). Only for the scripts
    that measure *another* checkout; everything else runs as ``python -m`` from the root it belongs to."""
    root = Path(root).resolve()
    if str(root) not in sys.path[:1]:
        sys.path.insert(0, str(root))
    return root


def script_module(name: str) -> Any:
    """The module of ``scripts/<name>.py`` (``scripts/`` is not a package), imported by path, once."""
    import importlib.util

    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------------------------------- timing
def time_ms(fn: Callable[[], Any], repeats: int, warmup: int = 0) -> list[float]:
    """Wall-clock milliseconds of ``repeats`` calls of ``fn`` (after ``warmup`` untimed calls)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def median_ms(fn: Callable[[], Any], repeats: int, warmup: int = 0) -> float:
    """Median of :func:`time_ms` (milliseconds)."""
    return statistics.median(time_ms(fn, repeats, warmup))


# ------------------------------------------------------------------------------------------------ processes
def stop_process(proc: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    """End a child process the script started (a server): SIGTERM, then SIGKILL when it has not exited after
    ``grace_s`` seconds (a hung shutdown must not hang the script). Nothing to do for None or an exited one."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


# -------------------------------------------------------------------------------------------------- writers
def write_json(path: str | Path, data: Any, indent: int = 1) -> Path:
    """``data`` as JSON (non-JSON values through ``str``), newline-terminated; parent folders created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str) + "\n")
    return path


def write_markdown(path: str | Path, text: str) -> Path:
    """``text`` (a markdown report), newline-terminated; parent folders created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path
