"""Prepacked weights for the fused prefill on CPU (``engine.prefill_weights``): oneDNN's layout in bf16, MKL's in fp32.

A bf16 ``F.linear`` on CPU runs oneDNN's matrix-unit kernel, which first copies the plain ``[out, in]`` weight into
its blocked layout, on every call: for the few hundred rows of a suffix prefill that copy is a large share of the
product. :class:`PrepackedLinear` holds the weight in oneDNN's layout once (``torch.ops.mkldnn._reorder_linear_weight``)
and multiplies with ``torch.ops.mkldnn._linear_pointwise``, the pair torch's own compiler emits when it freezes a
CPU model. ``python -m experiments.bench.bench_prefill_paths --threads 2`` (bundled model, AMX CPU, bf16, exact prefix hit
plus a suffix): TTFT of the fused prefill on plain -> prepacked weights 49.0 -> 43.4 ms (20 cached + 42 new tokens),
110.4 -> 102.2 (500 + 188), 147.9 -> 141.0 (1,000 + 255).

The price: the packed copies live beside the model's own weights (2 bytes per weight in bf16; ~212 MB for the
bundled model), and the kernel the packed layout selects is not always the one ``F.linear`` selects for the same
row count, so the fused prefill is no longer bit-equal to HF's forward in bf16 (its rows differ in last bits, as
any reuse in bf16 does). ``auto`` therefore packs only where it pays and is cheap: bf16 on a CPU with native bf16
(AMX or AVX-512 BF16), plain ``nn.Linear`` projections, and copies of at most :data:`AUTO_MAX_MEMORY_FRACTION` of
the machine's memory. fp32 packs for MKL (:mod:`kvboost.models.mkl_pack`, 4 bytes per weight) when asked for.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from kvboost.models import mkl_pack
from kvboost.models.awq import fused_bias

PREFILL_WEIGHTS = ("plain", "prepacked")
#: ``auto`` packs only when the copies take at most this fraction of physical memory.
AUTO_MAX_MEMORY_FRACTION = 0.05


class PrepackedLinear:
    """``y = x W^T + b`` with ``W`` held in oneDNN's blocked layout (CPU, bf16). Callable like the module."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        if weight.dim() != 2:
            raise ValueError(f"a linear weight is 2-D, got shape {tuple(weight.shape)}")
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else bias.detach()
        self.nbytes = weight.numel() * weight.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} features; this linear takes {self.in_features}")
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def native_bf16_cpu() -> bool:
    """Whether this CPU multiplies bf16 natively (AMX tiles or AVX-512 BF16), as oneDNN uses them."""
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # torch.cpu's probes (private, hence getattr)
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in checks)


def unavailable_reason(dtype: torch.dtype, device: torch.device) -> str | None:
    """Why prepacked weights cannot run for this dtype and device (None: they can): bf16 packs for oneDNN, fp32
    for MKL (:mod:`kvboost.models.mkl_pack`)."""
    if device.type != "cpu":
        return f"prepacked weights are a CPU path (the model is on {device.type})"
    if dtype == torch.float32:
        return mkl_pack.unavailable_reason()
    if dtype != torch.bfloat16:
        return f"prepacked weights serve bf16 and fp32 (the model is {str(dtype).replace('torch.', '')})"
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return "this torch build has no oneDNN linear"
    return onednn_bf16_refusal()


@functools.cache
def onednn_bf16_refusal() -> str | None:
    """oneDNN's own answer on whether it packs bf16 weights on this CPU (None: it does).

    Asked by packing a tiny weight: oneDNN needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT for its bf16 path and
    raises otherwise (seen on an AVX2-only AMD EPYC), and no public torch probe names that condition.
    """
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
    except RuntimeError as error:
        return f"oneDNN cannot pack bf16 weights on this CPU ({str(error).splitlines()[0]})"
    return None


def choose_prefill_weights(
    requested: str, *, fused_prefill: bool, plain_projections: bool, dtype: torch.dtype, device: torch.device,
    weight_bytes: int, memory_bytes: int | None = None,
) -> tuple[str, str]:  # fmt: skip
    """(``"plain"`` or ``"prepacked"``, why) for the engine's ``prefill_weights`` option.

    ``"prepacked"`` where it cannot run (HF's prefill, AWQ projections, another dtype or device) is an error;
    ``"auto"`` picks it only with the fused prefill, plain projections, bf16 on a CPU with native bf16, and copies
    (``weight_bytes``) of at most :data:`AUTO_MAX_MEMORY_FRACTION` of ``memory_bytes`` (default: this machine's).
    fp32 packs (for MKL) only when asked: fp32 is the dtype of the exactness guarantees, and ``plain`` keeps HF's
    bits there.
    """
    if requested not in ("auto", *PREFILL_WEIGHTS):
        raise ValueError(f"prefill_weights must be 'auto' or one of {PREFILL_WEIGHTS}, got {requested!r}")
    if requested == "plain":
        return "plain", "requested"
    reasons = [
        None if fused_prefill else "only the fused prefill multiplies prepacked weights",
        None if plain_projections else "the projections are not plain linears (AWQ int4 keeps its own kernels)",
        unavailable_reason(dtype, device),
    ]
    reason = next((r for r in reasons if r), None)
    if requested == "prepacked":
        if reason is not None:
            raise ValueError(f"prefill_weights='prepacked' cannot run here: {reason}; use 'plain' (or 'auto')")
        return "prepacked", "requested"
    if reason is not None:
        return "plain", reason
    if dtype != torch.bfloat16:
        return "plain", "fp32 keeps HF's bits under auto (ask for prefill_weights=prepacked)"
    reason = auto_skip_reason(dtype, weight_bytes, memory_bytes)
    if reason is not None:
        return "plain", reason
    return "prepacked", "auto"


def auto_skip_reason(dtype: torch.dtype, weight_bytes: int, memory_bytes: int | None = None) -> str | None:
    """Why ``auto`` leaves weights that could be packed unpacked (None: it packs them): bf16 on a CPU without
    native bf16 (oneDNN would emulate it), or copies (``weight_bytes``) above :data:`AUTO_MAX_MEMORY_FRACTION` of
    ``memory_bytes`` (default: this machine's)."""
    if dtype == torch.bfloat16 and not native_bf16_cpu():
        return "this CPU has no native bf16 (AMX or AVX-512 BF16)"
    memory = memory_bytes if memory_bytes is not None else physical_memory_bytes()
    if memory is None or weight_bytes > AUTO_MAX_MEMORY_FRACTION * memory:
        return (f"the packed copies ({weight_bytes / 2**20:.0f} MiB) would exceed "
                f"{AUTO_MAX_MEMORY_FRACTION:.0%} of the machine's memory")  # fmt: skip
    return None


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> PrepackedLinear | mkl_pack.MklPackedLinear:
    """A packed copy of one linear for its dtype: oneDNN's layout in bf16, MKL's in fp32 (callable like it)."""
    kind = PrepackedLinear if weight.dtype == torch.bfloat16 else mkl_pack.MklPackedLinear
    return kind(weight, bias)


def physical_memory_bytes() -> int | None:
    """Physical memory of this machine in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def projection_bytes(layers: Any) -> int:
    """Bytes of the decoder projections' weights (what packing copies) of HF decoder ``layers``."""
    total = 0
    for layer in layers:
        for proj in _projections(layer):
            total += proj.weight.numel() * proj.weight.element_size()
    return total


def plain_projections(layers: Any) -> bool:
    """Whether every decoder projection is a plain ``nn.Linear`` (what can be packed)."""
    return all(type(proj) is torch.nn.Linear for layer in layers for proj in _projections(layer))


def _projections(layer: Any) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)


def pack_layer(layer: Any) -> tuple:
    """One decoder layer's weights for the runner's prepacked projections (``kvboost.runtime.projections``):
    ``(ln1, qkv, o, ln2, gate_up, down)``, q/k/v and gate/up each packed as one matrix, every product packed for
    its dtype (oneDNN in bf16, MKL in fp32) and applying its own bias.

    One product instead of three and two: fewer calls, wider outputs for the threads to share, and, in fp32, MKL's
    packed buffers take 32.6 instead of 58.0 MB per SmolLM2 layer for these five matrices (its pack sizes do not
    scale with the weight). Measured on the project's 2-core AMX CPU (paired, same process): the q/k/v + gate/up
    products 1.04-1.07x faster at 110 / 188 / 258 rows in fp32, 1.23-1.31x in bf16 (oneDNN, AMX)."""
    q, k, v, o, gate, up, down = _projections(layer)
    qkv = packed_linear(torch.cat((q.weight, k.weight, v.weight)), fused_bias((q, k, v), q.weight.dtype))
    gate_up = packed_linear(torch.cat((gate.weight, up.weight)), fused_bias((gate, up), gate.weight.dtype))
    return (layer.input_layernorm.weight, qkv, packed_linear(o.weight, o.bias), layer.post_attention_layernorm.weight,
            gate_up, packed_linear(down.weight, down.bias))  # fmt: skip


__all__ = [
    "AUTO_MAX_MEMORY_FRACTION",
    "PREFILL_WEIGHTS",
    "PrepackedLinear",
    "auto_skip_reason",
    "choose_prefill_weights",
    "native_bf16_cpu",
    "pack_layer",
    "packed_linear",
    "physical_memory_bytes",
    "plain_projections",
    "projection_bytes",
    "unavailable_reason",
]
