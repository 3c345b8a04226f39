"""The experiment runner and its scripts.

The product (what ``run.py`` and ``kvboost-compare`` use): ``runner`` (one run), ``workloads/``, ``modes`` and
``hf_baselines`` (what is compared), ``config_check`` (a run config, checked before the model loads),
``report`` (summaries, tables, plots), ``compare`` (runs and sweeps side by side), ``objective``, ``loggers``,
``environment``, ``accuracy_table``, ``sharegpt_data``, ``rag_corpus``.

Beside it, scripts run from the repository root as modules (``python -m experiments.bench.bench_decode``):
``bench/`` (timing), ``checks/`` (correctness and feature checks), ``sims/`` (cache simulations without a
model); they share ``common`` (paths, CLI conventions, timers, the one ``percentile``, writers).
"""
