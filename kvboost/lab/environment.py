"""What a result was measured on: versions, device, threads."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from typing import Any

import torch


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def describe_environment() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "cuda": torch.version.cuda if cuda else None,
        "versions": {p: _version(p) for p in ("torch", "transformers", "triton", "hydra-core", "wandb", "kvboost")},
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "git_commit": _git_commit(),
    }
