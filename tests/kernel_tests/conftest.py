"""Shared setup for the kernel tests.

Triton decides at import time (when ``@triton.jit`` runs) whether kernels are compiled or interpreted, so
``TRITON_INTERPRET`` must be set before anything imports triton.  Without a CUDA device the kernels can only run
under the CPU interpreter, so it is switched on here (``setdefault``: an explicit setting by the user wins).
"""

import os
import sys
from collections import defaultdict

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Make ``kvboost.kernels_triton`` importable when pytest is started from anywhere without an installed package.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

# Largest relative error observed per (kernel, dtype) during the session, printed in the terminal summary.
_MAX_ERRORS: dict = defaultdict(float)


@pytest.fixture
def record_error():
    """Return a callable ``record(kernel_name, dtype, err)`` that keeps the largest error per dtype."""

    def record(kernel: str, dtype: torch.dtype, err: float) -> None:
        key = (kernel, str(dtype).replace("torch.", ""))
        _MAX_ERRORS[key] = max(_MAX_ERRORS[key], float(err))

    return record


def pytest_terminal_summary(terminalreporter):
    if not _MAX_ERRORS:
        return
    mode = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"
    terminalreporter.write_sep("-", f"max relative error vs float64 reference ({mode})")
    for (kernel, dtype), err in sorted(_MAX_ERRORS.items()):
        terminalreporter.write_line(f"{kernel:<16} {dtype:<9} {err:.3e}")
