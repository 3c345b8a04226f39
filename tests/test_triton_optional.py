"""triton is an extra (``kvboost[gpu]``, issue 62): a CPU install has no triton, runs everything that needs no
Triton kernel, and asking for one gets an error naming the extra."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]

#: run in a child process with triton made unimportable (``sys.modules[name] = None``), as on a CPU install
_PROBE = """
import sys
sys.modules["triton"] = None
sys.modules["triton.language"] = None
import kvboost, kvboost.quant.kivi, kvboost.runtime.graphs, kvboost.models.awq, kvboost.attention.triton
from kvboost.attention.triton import load_kernel_module
try:
    load_kernel_module()
except RuntimeError as exc:
    print("attn:", exc)
try:
    import kvboost.kernels_triton.kivi
except ModuleNotFoundError as exc:
    print("kivi:", exc.name, exc)
"""


def test_without_triton_the_cpu_paths_import_and_the_triton_ones_name_the_extra():
    proc = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert "pip install 'kvboost[gpu]'" in lines["attn"] and "attn=sdpa" in lines["attn"]
    assert lines["kivi"].startswith("triton ") and "kvboost[gpu]" in lines["kivi"]


def test_triton_is_only_in_the_gpu_extra():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("triton") for dep in project["dependencies"])
    assert any(dep.startswith("triton") for dep in project["optional-dependencies"]["gpu"])
    # the tests run the kernels under TRITON_INTERPRET=1: dev brings the gpu extra
    assert any("gpu" in Requirement(dep).extras for dep in project["optional-dependencies"]["dev"])
