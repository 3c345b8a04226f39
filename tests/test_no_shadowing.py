"""No checkout folder on ``sys.path`` takes an installed package's name (issue 58: ``tests/kernels`` hid Hugging
Face's ``kernels`` from transformers 5.25 and failed 741 tests).

``tests/conftest.py`` runs the same check before anything is imported; this file runs it again once every test
module of the session has been collected (some add folders to ``sys.path``, e.g. ``scripts/``), and shows that the
check fails where it should.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kvboost_testkit.shadowing import (
    checkout_entries,
    find_shadowing,
    importable_names,
    installed_top_level,
    shadowing_message,
)

ROOT = Path(__file__).resolve().parents[1]


def test_no_checkout_folder_on_sys_path_shadows_an_installed_package(request):
    configured = [ROOT / p for p in request.config.getini("pythonpath")]
    directories = checkout_entries([str(p) for p in configured] + sys.path, ROOT)
    assert ROOT in directories and ROOT / "tests" in directories
    clashes = find_shadowing(directories)
    assert not clashes, shadowing_message(clashes)


def test_the_check_names_a_folder_called_like_an_installed_package(tmp_path):
    installed = installed_top_level()
    assert "torch" in installed and "transformers" in installed  # the check sees this environment's packages
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "torch.py").write_text("")
    (tmp_path / "kvboost_only_here").mkdir()
    fake = {**installed, "kernels": ["kernels"]}  # Hugging Face's package, whether or not it is installed here
    clashes = find_shadowing([tmp_path], fake)
    assert len(clashes) == 2, clashes
    assert any("'kernels' of kernels" in c for c in clashes) and any("'torch' of torch" in c for c in clashes)


def test_own_packages_and_private_names_are_not_collisions(tmp_path):
    for name in ("kvboost", "__pycache__", ".venv", "_private", "not-an-identifier"):
        (tmp_path / name).mkdir()
    assert set(importable_names(tmp_path)) == {"kvboost"}
    assert find_shadowing([tmp_path]) == []  # kvboost is this checkout's own distribution


def test_interpreter_folders_inside_the_checkout_are_not_checked(tmp_path):
    import sysconfig

    purelib = Path(sysconfig.get_paths()["purelib"])
    entries = checkout_entries([str(purelib), str(tmp_path)], purelib.parents[len(purelib.parents) - 2])
    assert purelib.resolve() not in entries


def test_conftest_refuses_a_shadowing_folder():
    """The whole pytest run stops with one clear error, not hundreds of ImportErrors."""
    import shutil
    import subprocess

    # Inside the checkout (the check looks there only), under a name that no scan of tests/ picks up.
    probe = ROOT / "tests" / f"_shadow_probe_{os.getpid()}"
    try:
        (probe / "torch").mkdir(parents=True)  # named like an installed package, put on sys.path below
        (probe / "torch" / "__init__.py").write_text("")
        (probe / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-o", f"pythonpath=. tests {probe}",
             str(probe / "test_nothing.py")],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )
    finally:
        shutil.rmtree(probe, ignore_errors=True)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    assert "shadows the package 'torch' of torch" in out, out
    assert "1 passed" not in out
