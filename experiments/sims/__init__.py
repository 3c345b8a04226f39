"""Cache simulations on token traces (no model forward). Run from the repository root: ``python -m experiments.sims.<name>``; helpers in ``experiments/common.py``."""
