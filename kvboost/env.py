"""The CPU and library features that change kvboost's numbers or speed, and a report of them.

    python -m kvboost.env            # add --json for the machine-readable form

Kernels pick their code paths by CPU: oneDNN's bf16 GEMMs run on AMX tiles where the CPU has them (Intel Xeon
Sapphire Rapids and later) and on AVX-512 BF16 elsewhere (AMD Zen 4); torch's int4 CPU kernel blocks fp32
products differently on the two kinds. Results that are bit-equal on one kind can differ in the last bits on the
other, so tests and bit-exactness claims that depend on a kernel's blocking ask :func:`cpu_features` which kind
they run on.
"""

from __future__ import annotations

import functools
import json
import platform
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Conditional:
    """A test or claim whose result depends on what the machine has.

    ``where``: the test node or the claim; ``needs``: the feature it depends on; ``with_it`` / ``without_it``: what is
    asserted (or holds) on a machine that has it / lacks it; ``present``: whether this machine has it.
    """

    where: str
    needs: str
    with_it: str
    without_it: str
    present: Callable[[], bool]


def _native_bf16() -> bool:
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def _tool(name: str) -> Callable[[], bool]:
    return lambda: shutil.which(name) is not None


#: Tests and claims that assert or promise something else on the other CPU kind (or without a tool). A test
#: whose result depends on the CPU kind asks :func:`has_amx` / :func:`cpu_flags` and asserts that kind's guarantee.
CONDITIONAL: tuple[Conditional, ...] = (
    Conditional(
        "tests/test_awq.py::test_fused_int4pack_equals_its_members_to_the_bit[dtype0] (fp32)", "amx_bf16",
        "fused q/k/v int4 product bit-equal to the members'",
        "within 1e-6 (torch's fp32 int4 CPU kernel blocks its sums by the output width: 2e-7 to 4e-7 measured on "
        "Zen 4)",
        has_amx,
    ),
    Conditional(
        "model.dtype=auto (from_pretrained, run.py)", "amx_bf16 or avx512_bf16",
        "bf16 (oneDNN's native bf16 GEMMs)", "float32 (bf16 would be emulated)", _native_bf16,
    ),
    Conditional(
        "verify_correctness() on the default configuration", "amx_bf16 or avx512_bf16 (the dtype auto picks)",
        "bf16: same greedy tokens, first-token KL within the bf16 tolerance (exact reuse equal up to bf16 rounding)",
        "float32: same greedy tokens, first-token KL within 1e-4", _native_bf16,
    ),
    Conditional(
        "engine.prefill_weights=auto; tests/test_model_runner.py prepacked bf16 tests (needs_onednn_bf16)",
        "amx_bf16 or avx512_bf16", "prepacked oneDNN bf16 weights for multi-row forwards (kvboost's bf16 prefill "
        "then has other bits than HF's)", "plain weights (the tests skip where oneDNN refuses to pack bf16: no AVX-512 "
        "BW/VL/DQ and no AVX-NE-CONVERT, e.g. an AVX2-only AMD EPYC)", _native_bf16,
    ),
    Conditional(
        "bf16 figures in README / experiments/results (speeds, greedy-match counts)", "amx_bf16",
        "measured on AMX machines (~2 TFLOP/s bf16 on 2 threads)",
        "not comparable: AVX-512 BF16 ~410 GFLOP/s, other rounding; rerun the bench on this kind", has_amx,
    ),
    Conditional(
        "attn=batch_invariant rows=auto: projections in unpadded calls where the probe finds rows free",
        "amx_bf16", "bf16 projections keep their fixed tiles (not probed: the probe missed AMX differences)",
        "probed per shape (AVX-512 BF16 Zen 4: every bf16 shape of the bundled model free)", has_amx,
    ),
    Conditional(
        "attn=batch_invariant: bf16 reuse bit-equal to a cold prefill", "any CPU",
        "holds (fixed GEMM shapes: a row's bits do not depend on the call)", "holds (same reason)", lambda: True,
    ),
    Conditional(
        "tests/test_redis_tier.py and the redis-backed serving tests", "redis-server on PATH",
        "run against a real server", "skip", _tool("redis-server"),
    ),
    Conditional(
        "tests/kernel_tests/test_cuda_kernel.py (CPU emulation of the CUDA kernel)", "g++ with C++20 and nvcc/CUDA headers",
        "compiled and run on the CPU", "skip", lambda: all(shutil.which(tool) for tool in ("g++", "nvcc")),
    ),
)


def conditional_report() -> list[dict[str, Any]]:
    """Each :data:`CONDITIONAL` entry with what holds on this machine."""
    out = []
    for c in CONDITIONAL:
        here = bool(c.present())
        out.append({"where": c.where, "needs": c.needs, "present": here, "here": c.with_it if here else c.without_it,
                    "elsewhere": c.without_it if here else c.with_it})  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    info = cpu_features()
    if "--json" in args:
        print(json.dumps({**info, "conditional": conditional_report()}, indent=1))
        return
    print(f"cpu:        {info['cpu']} ({info['machine']}, kind {info['kind']})")
    print("flags:      " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in info["flags"].items()))
    print(f"torch:      {info['torch']} (CPU capability {info['torch_cpu_capability']}, {info['threads']} threads)")
    print(f"cuda:       {info['cuda'] or 'none'}")
    if info["kind"] != "intel-amx":
        print("note:       no AMX: bf16 GEMMs and fp32 int4 products round differently from the AMX machines "
              "(tests assert each kind's own guarantee)")
    print("\nconditional tests and claims (what holds here; on a machine of the other kind):")
    for row in conditional_report():
        mark = "yes" if row["present"] else "no"
        print(f"- {row['where']}\n    needs {row['needs']}: {mark} here\n    here:      {row['here']}\n"
              f"    otherwise: {row['elsewhere']}")


if __name__ == "__main__":
    main()
