"""Which dtype to run in, and what the hardware does with it.

``model.dtype: auto`` (the default) picks bf16 where the matrix units do bf16 natively and fp32 elsewhere:
- CUDA GPUs with bf16 support (Ampere and later): tensor cores;
- CPUs with AMX (``amx_bf16``) or AVX-512 BF16 (``avx512_bf16``): oneDNN's bf16 kernels. Measured on the
  project's CPUs (2 cores, torch 2.13): AMX ~2 TFLOP/s vs ~300 GFLOP/s fp32; AVX-512 BF16 without AMX
  ~410 vs ~190 GFLOP/s ([512, 576] x [576, 1536]); and half the bytes to stream per decoded token.
- anything else: fp32 (bf16 would be emulated, slower than fp32).
fp32 stays selectable (``model.dtype=float32``): it is what the exactness tests use (prefix reuse equal to a
cold prefill within 1e-4), while bf16 reuse is close but not bit-equal (see README, "Exactness under bf16").
``verify_correctness`` checks what the chosen dtype can promise and says so in its report
(``kvboost.quality.exactness_promise``): in bf16 a first-token KL within ``LOW_PRECISION_KL_TOLERANCE`` and greedy
tokens that part only at near ties; ``dtype=float32`` or ``attn=batch_invariant`` for bit-equal reuse.
"""

from __future__ import annotations

from typing import Any

import torch


def cpu_bf16_isa() -> str | None:
    """``"amx"`` or ``"avx512_bf16"`` when this CPU has native bf16 matrix instructions, else ``None``."""
    probes = (("amx", "_is_amx_tile_supported"), ("avx512_bf16", "_is_avx512_bf16_supported"))
    for name, probe in probes:
        check = getattr(torch.cpu, probe, None)
        try:
            if check is not None and check():
                return name
        except RuntimeError:  # a build without the probe's backend
            continue
    return None


def auto_dtype(device: torch.device | str) -> tuple[torch.dtype, str]:
    """(dtype, why) for ``model.dtype: auto`` on ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "CUDA device with bf16 support"
        return torch.float32, "CUDA device without bf16 support"
    if device.type == "cpu":
        isa = cpu_bf16_isa()
        if isa is not None:
            return torch.bfloat16, f"CPU with {isa}"
        return torch.float32, "CPU without AMX or AVX-512 BF16 (bf16 would be emulated)"
    return torch.float32, f"device type {device.type!r}: fp32 by default"


def matmul_path(dtype: torch.dtype, device: torch.device | str) -> str:
    """A short description of what runs the model's matrix products (for summaries)."""
    device = torch.device(device)
    name = str(dtype).replace("torch.", "")
    if device.type == "cuda":
        tf32 = dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32
        kind = "tensor cores" if dtype in (torch.bfloat16, torch.float16) or tf32 else "CUDA cores"
        return f"cuda {torch.cuda.get_device_name(device)}: cuBLAS {name} ({kind})"
    if device.type == "cpu":
        if dtype == torch.float32:
            return f"cpu {torch.backends.cpu.get_cpu_capability()}: fp32 BLAS"
        isa = cpu_bf16_isa()
        return f"cpu: oneDNN {name} via {isa}" if isa else f"cpu: {name} emulated (no native bf16 instructions)"
    return f"{device.type}: {name}"


def describe(dtype: torch.dtype, device: torch.device | str, requested: Any = None) -> dict[str, Any]:
    """What a run's summary reports about its arithmetic."""
    out: dict[str, Any] = {"dtype": str(dtype).replace("torch.", ""), "matmul_path": matmul_path(dtype, device)}
    if requested is not None:
        out["dtype_requested"] = str(requested)
    if str(requested).lower() == "auto":
        out["dtype_reason"] = auto_dtype(device)[1]
    return out
