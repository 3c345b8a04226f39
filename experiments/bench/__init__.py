"""Timing scripts (benchmarks, A/B runs, load tests). Run from the repository root: ``python -m experiments.bench.<name>``; helpers in ``experiments/common.py``."""
