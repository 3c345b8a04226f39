"""Compose the project's Hydra config (``kvboost/configs/config.yaml``) with overrides, as ``run.py`` would, in a test."""

from __future__ import annotations

from kvboost.paths import CONFIG_DIR


def compose(overrides: list[str], *, hydra: bool = False):
    """The composed config for ``overrides`` (``hydra=True`` also returns the ``hydra`` node)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=overrides, return_hydra_config=hydra)
