"""Correctness and feature checks. Run from the repository root: ``python -m experiments.checks.<name>``; helpers in ``experiments/common.py``."""
