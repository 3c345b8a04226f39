"""Hydra entry point of the research runner: ``python run.py [group=name ...] [key=value ...]`` in a clone, or
``kvboost-run`` / ``python -m kvboost.lab`` from an installed wheel (``pip install 'kvboost[lab]'``); ``-m`` sweeps.

    python run.py                                             # ShareGPT replay, bundled SmolLM2, CPU
    python run.py experiment=rag_blend                        # a named experiment (kvboost/configs/experiment/)
    python run.py workload.num_conversations=8 workload.max_turns=6 logger=none
    python run.py -m recompute=none,full chunker.chunk_size=32,64
    python run.py 'cache=[memory,disk]' cache.1.path=/data/kv                # a stack of tiers, fastest first
    python run.py -m experiment=chat_replay workload.interleave=false,true hydra/launcher=local

The job returns the sweep objective (``objective`` in the config, ``kvboost/lab/objective.py``), which Hydra's
Optuna sweeper minimises (``experiment=tune_rag``); other launchers ignore it.

Interrupted (Ctrl-C, SIGTERM), a run writes the summary of the requests that finished (records.jsonl is written
as they finish) and exits with 130 (SIGINT) or 143 (SIGTERM).
"""

from __future__ import annotations

import logging
import os
import sys

# The attention backend may need the Triton interpreter on a machine without a GPU; it must be chosen
# before anything imports triton. kvboost.attention handles that itself when attn=triton.
import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from kvboost.cache_stack import CacheOverrideError, CacheStackSpec, apply_cache_stack, split_cache_overrides
from kvboost.lab.objective import objective_mode_not_run, sweep_objective
from kvboost.lab.run_control import RunInterrupted, exit_code
from kvboost.lab.runner import run_experiment
from kvboost.paths import CONFIG_PATH

#: cache=[memory,disk] / cache=[{name: ...}, ...] / cache.1.path=...: a stack of tiers, which Hydra would merge into
#: one tier (or reject); taken out of the command line before Hydra reads it, put into the composed config in main()
CACHE_STACK = CacheStackSpec()


def take_cache_overrides(argv: list[str]) -> tuple[list[str], CacheStackSpec]:
    """``argv`` without its cache-stack overrides, and the stack they describe (exits with a message if bad)."""
    try:
        return split_cache_overrides(argv)
    except CacheOverrideError as exc:
        sys.exit(f"run.py: {exc}")


def hydra_run_info() -> dict[str, object]:
    """How Hydra launched this job: its overrides, experiment name and (in a multirun) the sweep folder."""
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    return {
        "overrides": list(hc.overrides.task) + CACHE_STACK.overrides,
        "experiment": hc.runtime.choices.get("experiment"),
        "sweep_dir": hc.sweep.dir if multirun else None,
        "job_num": hc.job.num if multirun else None,
    }


@hydra.main(version_base="1.3", config_path=CONFIG_PATH, config_name="config")
def main(cfg: DictConfig) -> float | None:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        apply_cache_stack(cfg, CACHE_STACK)
    except CacheOverrideError as exc:
        sys.exit(f"run.py: {exc}")
    run_info = hydra_run_info()
    sweeping = run_info["sweep_dir"] is not None
    objective = cfg.get("objective")
    unrun = objective_mode_not_run(cfg)
    if unrun and sweeping:  # a sweeper needs the number: say so before any weight loads
        sys.exit(f"run.py: {unrun}")
    try:
        summary = run_experiment(cfg, out_dir=HydraConfig.get().runtime.output_dir, run_info=run_info)
    except RunInterrupted as exc:  # records.jsonl and summary.json of what finished are written; exit non-zero
        print(f"interrupted ({exc.signal_name}): the results of what finished are in {exc.out_dir}", file=sys.stderr)
        sys.exit(exit_code(exc))
    if unrun:  # a single run returns its objective to nobody: its results stand without it
        print(f"no sweep objective: {unrun}", file=sys.stderr)
        return None
    return sweep_objective(summary, objective)


def cli() -> None:
    """``run.py`` / ``kvboost-run`` / ``python -m kvboost.lab``: the cache-stack overrides taken out, then Hydra."""
    global CACHE_STACK
    sys.argv[1:], CACHE_STACK = take_cache_overrides(sys.argv[1:])
    main()


if __name__ == "__main__":
    cli()
