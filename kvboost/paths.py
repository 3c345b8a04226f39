"""Where kvboost keeps files on disk, and where its own files are, the same from a source checkout and from an
installed wheel (a leaf module: no kvboost imports, so anything may use it).

- :func:`kvboost_cache_dir`: the root of kvboost's on-disk caches;
- :data:`CONFIG_DIR`: the Hydra configs (``config.yaml`` and one folder per plugin family), shipped inside the
  package; :data:`CONFIG_PATH` names the same folder for ``hydra.main`` / ``initialize_config_module``
  (``pkg://kvboost.configs``), which resolves it through the import system, zipped or not.
- :func:`project_root`: what a relative path in a run config (``workload.data_path``) is resolved against: the
  source checkout when kvboost runs from one (editable install or ``python run.py`` in a clone), else the
  current folder.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CONFIG_DIR = PACKAGE_DIR / "configs"
#: the C++ / CUDA kernel sources, built on first use by torch.utils.cpp_extension (shipped in the wheel)
CSRC_DIR = PACKAGE_DIR / "csrc"
CONFIG_MODULE = "kvboost.configs"
CONFIG_PATH = f"pkg://{CONFIG_MODULE}"


def kvboost_cache_dir() -> Path:
    """Root of kvboost's on-disk caches (``$KVBOOST_CACHE_DIR`` or ``~/.cache/kvboost``): converted models
    (``models/``), weight digests (``digests/``), the disk KV tier's default folder (``kv/``), int4 sidecars."""
    root = os.environ.get("KVBOOST_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kvboost")
    return Path(root)


def checkout_root() -> Path | None:
    """The source checkout holding this package (the folder above it with kvboost's ``pyproject.toml``), or
    None for an installed wheel."""
    root = PACKAGE_DIR.parent
    pyproject = root / "pyproject.toml"
    try:
        declares = 'name = "kvboost"' in pyproject.read_text(encoding="utf-8")
    except OSError:
        return None
    return root if declares else None


def project_root() -> Path:
    """The source checkout when there is one, else the current folder."""
    return checkout_root() or Path.cwd()
