"""Hydra finds the configs of kvboost plugin packages without ``hydra.searchpath``.

Hydra imports every module under the ``hydra_plugins`` namespace package (kvboost ships this one) and calls each
``SearchPathPlugin`` whenever it composes a config: ``run.py``, a ``-m`` sweep, the compose API of the tests and
tools. :class:`KvboostSearchPathPlugin` appends, after kvboost's own ``kvboost/configs/``, the config folder of every
installed plugin package, so ``python run.py recompute=last_n`` selects ``<package>/configs/recompute/last_n.yaml``
with no flag.

Which folders (:func:`plugin_config_dirs`):

1. For every entry point of ``kvboost.plugins`` (the group a plugin package already declares so that kvboost
   imports its code), the folder ``configs/`` inside the entry point's top-level package, where it exists.
2. For every entry point of ``kvboost.configs``, the folder of the package it names (``my_configs =
   "my_package.hydra_configs"``): for a package whose configs live elsewhere, or that registers nothing itself.

Why the existing group first, by convention, rather than a new group only: the failure this fixes (issue 45) is a
step a new user did not know about; a second declaration to write is a second step to forget, while a package
that declares ``kvboost.plugins`` and ships ``configs/<group>/<name>.yaml`` beside its code now just works. The
convention is looked up without importing the plugin's code (``importlib.util.find_spec`` of a top-level package
locates it on disk and runs nothing), so composing a config does not pay for importing torch or a broken plugin;
kvboost's registry still imports the code on first lookup. A single-module plugin (no package) has no folder of
its own: it uses ``kvboost.configs``. Those entry points do name a package to find (its parent packages' imports
run).

The folders come after kvboost's own ``kvboost/configs/`` (and any ``hydra.searchpath``): a plugin adds options to the
groups (``recompute/last_n.yaml``, ``experiment/my_study.yaml``) but cannot replace a built-in yaml of the same
name. A folder that cannot be found is skipped with a warning; composing never fails because of a plugin.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

log = logging.getLogger(__name__)

PLUGIN_GROUP = "kvboost.plugins"  # kvboost.registry.ENTRY_POINT_GROUP (not imported: it would import kvboost)
CONFIGS_GROUP = "kvboost.configs"
CONFIGS_FOLDER = "configs"
PROVIDER = "kvboost-plugin"


def _package_dir(name: str) -> Path | None:
    """The folder of package ``name`` (None: not found, or a single module)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def plugin_config_dirs() -> list[Path]:
    """The config folders of the installed plugin packages, in entry-point order, each once (see the module doc)."""
    from importlib import metadata  # looked up per call: tests replace metadata.entry_points

    found: list[Path] = []
    for group in (PLUGIN_GROUP, CONFIGS_GROUP):
        for ep in metadata.entry_points(group=group):
            module = ep.value.split(":", 1)[0].strip()
            try:
                if group == PLUGIN_GROUP:
                    package = _package_dir(module.split(".", 1)[0])
                    folder = package / CONFIGS_FOLDER if package is not None else None
                else:
                    folder = _package_dir(module)
                    if folder is None:
                        log.warning("kvboost: %s entry point %r names %r, not a package folder", group, ep.name,
                                    module)  # fmt: skip
            except Exception as exc:  # noqa: BLE001  (a broken plugin must not break composing the built-ins)
                log.warning("kvboost: configs of %s entry point %r not found: %s", group, ep.name, exc)
                continue
            if folder is not None and folder.is_dir() and folder.resolve() not in found:
                found.append(folder.resolve())
    return found


class KvboostSearchPathPlugin(SearchPathPlugin):
    """Appends :func:`plugin_config_dirs` to Hydra's config search path."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        for folder in plugin_config_dirs():
            search_path.append(provider=PROVIDER, path=f"file://{folder}")
