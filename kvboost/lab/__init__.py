"""kvboost's research runner (``pip install 'kvboost[lab]'``): what ``run.py`` / ``kvboost-run`` /
``python -m kvboost.lab`` run.

``run`` (the Hydra entry point), ``runner`` (one run), ``workloads/``, ``modes`` and ``hf_baselines`` (what is
compared), ``config_check`` (a run config, checked before the model loads: the engine's part is
:mod:`kvboost.build`'s), ``report`` (summaries, tables, plots), ``compare`` (runs and sweeps side by side:
``kvboost-compare``), ``objective`` (the sweep objective), ``loggers`` (W&B), ``run_control`` (interrupts, record
sinks), ``environment``, ``accuracy_table``, ``sharegpt_data``, ``rag_corpus``.

The benchmarks and checks that measure kvboost (``experiments/bench``, ``experiments/checks``, ``experiments/sims``)
are the source checkout's, run from a clone as ``python -m experiments.bench.<name>``; they are not installed.
"""
