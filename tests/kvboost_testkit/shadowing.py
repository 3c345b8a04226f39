"""The check that no folder or module the tests put on ``sys.path`` takes the name of an installed package.

pytest's ``pythonpath`` setting (``.`` and ``tests``) puts the checkout's folders first on ``sys.path``, so every
module and package directly inside them is importable by its bare name, ahead of site-packages. A test folder named
like a real distribution's top-level package is then imported in its place by any library that asks for it: the
folder ``tests/kernels`` replaced Hugging Face's ``kernels`` package once transformers 5.25 started importing it,
and 741 tests failed with ``cannot import name 'CUDAProperties' from 'kernels'``. This module finds such names
before anything imports them; ``tests/conftest.py`` runs it first thing and ``tests/test_test_layout.py`` tests it.

Standard library only: it must run before anything that a shadowing folder could break.
"""

from __future__ import annotations

import importlib.metadata
import sysconfig
from pathlib import Path

#: the distribution whose own packages (``kvboost``, ``hydra_plugins``) are the checkout's: not a collision
OWN_DISTRIBUTION = "kvboost"


def importable_names(directory: Path) -> dict[str, Path]:
    """Top-level names that ``directory`` on ``sys.path`` makes importable: ``*.py`` modules and folders.

    Folders count with or without ``__init__.py``: a namespace folder does not hide a regular package, but it merges
    into (and can break) a namespace package of the same name.
    """
    names: dict[str, Path] = {}
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith((".", "_")):
            continue  # hidden folders, __pycache__, __init__.py
        if entry.is_file() and entry.suffix == ".py":
            names.setdefault(entry.stem, entry)
        elif entry.is_dir() and entry.name.isidentifier():
            names.setdefault(entry.name, entry)
    return names


def installed_top_level() -> dict[str, list[str]]:
    """Top-level import name -> the installed distributions that provide it (our own distribution left out)."""
    owners: dict[str, list[str]] = {}
    for name, dists in importlib.metadata.packages_distributions().items():
        if not any(d.lower().replace("_", "-") == OWN_DISTRIBUTION for d in dists):
            owners[name] = sorted(set(dists))
    return owners


def find_shadowing(directories: list[Path], installed: dict[str, list[str]] | None = None) -> list[str]:
    """One line per module or folder in ``directories`` whose name an installed distribution also provides."""
    installed = installed_top_level() if installed is None else installed
    clashes = []
    for directory in directories:
        for name, path in importable_names(directory).items():
            if name in installed:
                clashes.append(f"{path} shadows the package '{name}' of {', '.join(installed[name])}")
    return clashes


def checkout_entries(sys_path: list[str], root: Path) -> list[Path]:
    """The folders of ``sys_path`` inside the checkout ``root`` (what pytest and the tests put there).

    The interpreter's own folders are left out: a virtual environment made inside the checkout (``.ci/run``'s
    ``.venv``) holds the installed packages themselves.
    """
    root = root.resolve()
    interpreter = {Path(p).resolve() for key, p in sysconfig.get_paths().items() if key in _INTERPRETER_PATHS}
    found: list[Path] = []
    for entry in sys_path:
        path = Path(entry or ".").resolve()
        inside = path == root or root in path.parents
        if inside and path.is_dir() and path not in found and not any(p == path or p in path.parents
                                                                      for p in interpreter):
            found.append(path)
    return found


_INTERPRETER_PATHS = ("stdlib", "platstdlib", "purelib", "platlib")


def shadowing_message(clashes: list[str]) -> str:
    return ("folders or modules of the checkout on sys.path take the names of installed packages, so any library "
            "that imports those packages would get the checkout's file instead; rename them (the README's Tests section):\n  "
            + "\n  ".join(clashes))
