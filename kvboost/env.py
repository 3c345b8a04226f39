"""The CPU and library features that change kvboost's numbers or speed, and a report of them.

    python -m kvboost.env

Kernels pick their code paths by CPU: oneDNN's bf16 GEMMs run on AMX tiles where the CPU has them (Intel Xeon
Sapphire Rapids and later) and on AVX-512 BF16 elsewhere (AMD Zen 4); torch's int4 CPU kernel blocks fp32
products differently on the two kinds. Results that are bit-equal on one kind can differ in the last bits on the
other, so tests and bit-exactness claims that depend on a kernel's blocking ask :func:`cpu_features` which kind
they run on.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path
from typing import Any

#: /proc/cpuinfo flags reported (the ones kernels dispatch on).
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where the file is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def has_amx() -> bool:
    """Whether the CPU has AMX bf16 tiles (oneDNN's bf16 GEMMs then run on them)."""
    return "amx_bf16" in cpu_flags()


def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_features() -> dict[str, Any]:
    """What the report prints: CPU model, the reported flags, torch's CPU capability and thread count."""
    import torch

    flags = cpu_flags()
    return {
        "cpu": cpu_model_name(),
        "machine": platform.machine(),
        "flags": {flag: flag in flags for flag in REPORTED_FLAGS},
        "kind": "intel-amx" if has_amx() else ("avx512-bf16" if "avx512_bf16" in flags else "other"),
        "torch": torch.__version__,
        "torch_cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def main() -> None:
    info = cpu_features()
    print(f"cpu:        {info['cpu']} ({info['machine']}, kind {info['kind']})")
    print("flags:      " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in info["flags"].items()))
    print(f"torch:      {info['torch']} (CPU capability {info['torch_cpu_capability']}, {info['threads']} threads)")
    print(f"cuda:       {info['cuda'] or 'none'}")
    if info["kind"] != "intel-amx":
        print("note:       no AMX: bf16 GEMMs and fp32 int4 products round differently from the AMX machines "
              "(tests assert each kind's own guarantee)")


if __name__ == "__main__":
    main()
