"""A plugin package's configs are found with no flag (hydra_plugins/kvboost_searchpath, issue 45).

A strategy package is built in tmp_path as a user would write it (README "Writing a strategy as your own package"):
``last_n_strategies/__init__.py``, ``last_n_strategies/last_n.py`` registering ``RECOMPUTE['last_n']`` and
``last_n_strategies/configs/recompute/last_n.yaml``, declared by a ``kvboost.plugins`` entry point. The run.py
config is composed with Hydra's compose API (tests/kvboost_testkit/compose.py) and ``recompute=last_n``, with no
``hydra.searchpath`` override: before the search-path plugin, Hydra failed with "Could not find 'recompute/last_n'".
"""

from __future__ import annotations

import sys

import pytest
from kvboost_testkit.compose import compose
from omegaconf import OmegaConf

from kvboost.lab.config_check import check_config
from kvboost.registry import RECOMPUTE, UnknownPluginError

PACKAGE = "last_n_strategies"

STRATEGY = '''\
"""Recompute the last n content-hit tokens of the prompt (and the new ones)."""

import torch

from kvboost.recompute.base import RecomputeStrategy
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("last_n")
class LastN(RecomputeStrategy):
    ratio = None  # a threshold budget: the base keeps every token scoring at least it

    def __init__(self, n: int = 16):
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        self.n, self.threshold = n, 1 - n

    def score(self, view):
        content = view.plan.positions("content")
        return (torch.searchsorted(content, view.candidates) - (content.numel() - 1)).float()
'''

YAML = """\
name: last_n
description: recompute the last n content-hit tokens (a plugin from its own package)
n: 24
"""


def _install(monkeypatch, tmp_path, *, plugins: dict[str, str], configs: dict[str, str] | None = None) -> None:
    """Entry points ``plugins`` (``kvboost.plugins``) and ``configs`` (``kvboost.configs``), name -> value, as the
    only ones installed, with tmp_path/site on sys.path and nothing loaded yet (as in a fresh process); mirrors
    tests/test_registry.py's ``_plugin_package``."""
    import importlib.metadata as md

    import kvboost.registry as registry_module

    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    groups = {"kvboost.plugins": plugins, "kvboost.configs": configs or {}}
    eps = {g: [md.EntryPoint(name=n, value=v, group=g) for n, v in named.items()] for g, named in groups.items()}
    monkeypatch.setattr(md, "entry_points", lambda group=None: eps.get(group, []))
    monkeypatch.setattr(registry_module, "_entry_points_loaded", False)
    monkeypatch.setattr(registry_module, "_entry_point_failures", {})
    monkeypatch.setattr(RECOMPUTE, "_loaded", False)


def _write_package(tmp_path, configs_folder: str = "configs") -> None:
    pkg = tmp_path / "site" / PACKAGE
    (pkg / configs_folder / "recompute").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "last_n.py").write_text(STRATEGY)
    (pkg / configs_folder / "recompute" / "last_n.yaml").write_text(YAML)


@pytest.fixture
def cleanup():
    yield
    RECOMPUTE.unregister("last_n")
    for name in [m for m in sys.modules if m == PACKAGE or m.startswith(PACKAGE + ".")]:
        sys.modules.pop(name, None)


def test_a_plugin_packages_yaml_is_selected_with_no_searchpath_flag(monkeypatch, tmp_path, cleanup):
    _write_package(tmp_path)
    _install(monkeypatch, tmp_path, plugins={"last_n": f"{PACKAGE}.last_n"})
    cfg = compose(["recompute=last_n", "logger=none"], hydra=True)
    assert cfg.recompute.name == "last_n" and cfg.recompute.n == 24  # the plugin's yaml, not a command-line key
    assert cfg.hydra.runtime.choices.recompute == "last_n"
    sources = [(s.provider, s.path) for s in cfg.hydra.runtime.config_sources]
    assert ("kvboost-plugin", str((tmp_path / "site" / PACKAGE / "configs").resolve())) in sources
    # kvboost's own configs come first: the plugin adds options, it does not shadow built-ins
    assert [p for p, _ in sources].index("main") < [p for p, _ in sources].index("kvboost-plugin")
    assert PACKAGE + ".last_n" not in sys.modules  # composing found the yaml without importing the plugin's code
    plain = OmegaConf.to_container(compose(["recompute=last_n", "logger=none"]), resolve=True)
    check_config(plain)  # the start-up check imports the plugin through its entry point and validates n
    strategy = RECOMPUTE.build(plain["recompute"])
    assert type(strategy).__name__ == "LastN" and strategy.n == 24
    bad = OmegaConf.to_container(compose(["recompute=last_n", "recompute.n=-1", "logger=none"]), resolve=True)
    with pytest.raises(ValueError, match="n must be >= 0"):
        check_config(bad)


def test_a_kvboost_configs_entry_point_names_a_folder_elsewhere(monkeypatch, tmp_path, cleanup):
    """A package whose configs are not in <package>/configs declares them with a kvboost.configs entry point."""
    _write_package(tmp_path, configs_folder="hydra_conf")
    (tmp_path / "site" / PACKAGE / "hydra_conf" / "__init__.py").write_text("")
    _install(monkeypatch, tmp_path, plugins={"last_n": f"{PACKAGE}.last_n"},
             configs={"last_n": f"{PACKAGE}.hydra_conf"})  # fmt: skip
    assert compose(["recompute=last_n", "logger=none"]).recompute.n == 24


def test_without_a_configs_folder_the_missing_option_still_fails_as_before(monkeypatch, tmp_path, cleanup):
    """No folder, no option: Hydra's own error, listing the options it did find."""
    from hydra.errors import MissingConfigException

    _write_package(tmp_path, configs_folder="elsewhere")
    _install(monkeypatch, tmp_path, plugins={"last_n": f"{PACKAGE}.last_n"})
    with pytest.raises(MissingConfigException, match="recompute/last_n"):
        compose(["recompute=last_n", "logger=none"])


def test_a_broken_plugin_never_breaks_composing(monkeypatch, tmp_path, cleanup):
    """An entry point naming a package that is not installed, or a single module: skipped, built-ins compose."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "single_module_plugin.py").write_text("")
    _install(monkeypatch, tmp_path, plugins={"gone": "not_installed_pkg.mod", "single": "single_module_plugin"},
             configs={"gone": "not_installed_pkg.conf"})  # fmt: skip
    assert compose(["recompute=cacheblend", "logger=none"]).recompute.name == "cacheblend"


def test_unknown_plugin_error_says_how_plugins_and_their_configs_are_found():
    with pytest.raises(UnknownPluginError) as err:
        RECOMPUTE.build("last_n")
    message = str(err.value)
    assert "unknown recompute plugin 'last_n'" in message
    assert "kvboost.plugins entry point" in message and "<package>/configs/<group>/<name>.yaml" in message


def test_kvboost_server_selects_a_plugin_strategy_by_name(monkeypatch, tmp_path, cleanup):
    """kvboost-server composes run.py's config the same way: ``--recompute-strategy last_n`` (and the override
    ``recompute=last_n``) pick the plugin's yaml and pass the start-up check, with no flag beyond the name."""
    from kvboost.serving.cli import build_parser, compose_config

    _write_package(tmp_path)
    _install(monkeypatch, tmp_path, plugins={"last_n": f"{PACKAGE}.last_n"})
    for argv in (["--recompute-strategy", "last_n"], ["recompute=last_n", "recompute.n=8"]):
        cfg = compose_config(build_parser().parse_args(argv))
        assert cfg["recompute"]["name"] == "last_n"
        assert cfg["recompute"]["n"] == (8 if "recompute.n=8" in argv else 24)
