"""Every config of every group composes with Hydra's compose API and passes the start-up check.

Configs are data, checked when composed (lightning-hydra-template's habit): a yaml whose plugin does not exist
or whose fields the plugin does not take fails here, not half-way through somebody's sweep.
"""

from __future__ import annotations

import pytest
from kvboost_testkit.compose import CONFIG_DIR, compose
from omegaconf import OmegaConf

from kvboost.build import ENGINE_OPTIONS, engine_signature_options
from kvboost.lab.config_check import check_config

GROUPS = sorted(p.name for p in CONFIG_DIR.iterdir() if p.is_dir() and p.name not in ("hydra", "experiment"))
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONFIG_DIR / g).glob("*.yaml"))]



@pytest.mark.parametrize("group, option", OPTIONS)
def test_every_option_composes_and_checks(group, option):
    cfg = OmegaConf.to_container(compose([f"{group}={option}"]), resolve=True)
    check_config(cfg)
    if group in ("chunker", "hasher", "recompute", "quant", "attn", "cache", "eviction", "workload", "logger"):
        assert cfg[group]["name"] == option, f"kvboost/configs/{group}/{option}.yaml must name itself"


def test_every_config_group_mirrors_its_registry():
    from kvboost.lab.modes import MODES
    from kvboost.lab.workloads import WORKLOADS
    from kvboost.registry import ALL_REGISTRIES

    registries = {**ALL_REGISTRIES, "workload": WORKLOADS}
    for group, registry in registries.items():
        names = {p.stem for p in (CONFIG_DIR / group).glob("*.yaml")}
        assert names, f"kvboost/configs/{group}/ is missing"
        assert names == set(registry.names()), f"kvboost/configs/{group}/ and the {group} registry differ"
    assert set(MODES.names()) == {"baseline", "hf_prefix", "kvboost_cold", "kvboost", "transformers_cb"}


def test_engine_options_are_the_engines():
    assert set(ENGINE_OPTIONS) <= set(engine_signature_options())
