"""kvboost's Hydra configs (``config.yaml`` and one folder per plugin family), shipped inside the package so that
``run.py``, ``kvboost-server`` and ``python -m kvboost.lab...`` find them from a wheel: ``pkg://kvboost.configs``
(:mod:`kvboost.paths`). This module holds no code; it makes the folder importable for Hydra's ``pkg://`` source."""
