"""The checkout's measurement scripts, run from the repository root as modules
(``python -m experiments.bench.bench_decode``): ``bench/`` (timing), ``checks/`` (correctness and feature checks),
``sims/`` (cache simulations without a model); they share ``common`` (paths, CLI conventions, timers, writers) and
write their outputs under ``results/``. Not installed with the wheel; the research runner they build on is
:mod:`kvboost.lab`.
"""
