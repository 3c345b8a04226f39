"""Path choice: which runner serves a model, how it decodes, what its projections multiply; checked up front.

The engine's options (``decode``, ``prefill``, ``prefill_weights``) are resolved here into a
:class:`RunnerConfig` with the reason for each choice (reported by ``decode_info`` and in ``summary.json``). An
option the model or backend cannot honour is a ``ValueError`` naming what would work, raised before the engine
touches the model.

- runner: ``llama`` (:class:`~kvboost.runtime.llama.LlamaRunner`, one arithmetic for llama / mistral / qwen2)
  wherever it applies, else ``hf`` (:class:`~kvboost.runtime.hf_generic.HFGenericRunner`, HF's own modules over
  the pool); ``decode="hf"`` or ``prefill="hf"`` ask for ``hf`` (every forward is then HF's own).
- decode: ``graphed`` on CUDA (CUDA graphs); on CPU ``quantized`` for a model loaded from a GGUF file whose
  projections are 4-bit blocks (the bundled SmolLM2: :mod:`kvboost.runtime.quant_step`), else ``compiled``
  (inductor) where the backend lets the runner
  decode with its own attention (``capabilities.runner_decode``) and the projections are plain linears; ``eager``
  otherwise (AWQ int4 projections: eager with fused int4 calls, measured faster than compiled on CPU;
  ``attn=batch_invariant``: eager, the backend's tiled arithmetic).
- prefill: ``quantized`` under ``auto`` where decode is ``quantized`` on an fp32 model (prompt rows multiply the
  GGUF blocks too, int16 or fp32 activations); ``graphed`` with CUDA graphs; else the runner's eager forward.
- weights: ``prepacked`` under ``auto`` for bf16 on a CPU with native bf16 when the copies take <= 5% of memory
  (:mod:`kvboost.models.prepack`), ``int4`` for AWQ models and ``weights="gguf_int4"`` GGUF models on CPU (fused
  q/k/v and gate/up int4 packs; groups that mix int4 and dense linears run member by member), else ``plain``.

``KVBOOST_DECODE`` (environment) overrides ``decode``; ``KVBOOST_GRAPH_COMPILE=0`` captures the CUDA graphs
without compiling the layer by inductor first (a 28-layer model's warm-up drops from minutes to seconds, each
step replays unfused kernels).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

#: ``engine.decode``: ``hf`` selects the HF-generic runner; the others are the Llama runner's execution modes.
DECODE_MODES = ("hf", "eager", "compiled", "graphed", "quantized")
#: ``engine.prefill``: ``fused`` = the Llama runner (its eager forward), ``hf`` = the HF-generic runner,
#: ``graphed`` = CUDA graphs for short prefills too, ``quantized`` = prompt rows through the quantized step as well
#: (``decode="quantized"``: every forward without hooks multiplies the GGUF blocks; see kvboost.runtime.quant_step),
#: ``quantized_short`` = forwards of fewer than :data:`SHORT_PREFILL_ROWS` rows there, longer ones on the dense weights.
PREFILL_MODES = ("hf", "fused", "graphed", "quantized", "quantized_short")
#: the prefill modes that run prompt rows on the quantized step (they need decode="quantized", int16 / fp32 rows)
QUANTIZED_PREFILLS = ("quantized", "quantized_short")
#: prefill="quantized_short": forwards of fewer rows than this on the quantized step, longer ones on the dense weights
#: (the crossover of a bf16 model on 2 Zen 4 cores with the bundled model; see choose_runner)
SHORT_PREFILL_ROWS = 128
#: RunnerConfig.quantized_prefill_rows of prefill="quantized": every forward without hooks on the quantized step
ALL_ROWS = sys.maxsize


@dataclass(frozen=True)
class RunnerConfig:
    """The resolved path: ``runner`` (``llama`` | ``hf``), ``decode``, ``weights`` (``plain`` | ``prepacked`` |
    ``int4``), and why each was chosen."""

    runner: str
    decode: str
    weights: str
    reasons: dict[str, str] = field(default_factory=dict)
    graph_prefill: bool = False
    decode_activations: str = "int16"  # decode="quantized": int16 | int8 | fp32 (kvboost.runtime.quant_step.ACTIVATIONS)
    #: forwards of fewer rows than this on the quantized step, the others on the dense weights: 0 (none, ``fused``),
    #: :data:`SHORT_PREFILL_ROWS` (``quantized_short``) or :data:`ALL_ROWS` (every one, ``quantized``)
    quantized_prefill_rows: int = 0

    @property
    def prefill_path(self) -> str:
        """How the Llama runner prefills: ``graphed``, ``quantized``, ``quantized_short`` (forwards of fewer than
        :data:`SHORT_PREFILL_ROWS` rows on the quantized step, longer ones dense) or ``fused`` (decode_info and the
        cache key)."""
        if self.graph_prefill:
            return "graphed"
        if self.quantized_prefill_rows == ALL_ROWS:
            return "quantized"
        return "quantized_short" if self.quantized_prefill_rows else "fused"


def _device(model: Any) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _dtype(model: Any) -> torch.dtype:
    param = next(model.parameters(), None)
    return param.dtype if param is not None else torch.float32


def choose_runner(
    model: Any, attention: Any, *, decode: str = "auto", prefill: str = "auto", prefill_weights: str = "auto",
    decode_activations: str = "int16", chunked_prompts: bool = False,
) -> RunnerConfig:  # fmt: skip
    """Resolve the engine's options for ``model`` under the installed-to-be ``attention`` backend.

    ``chunked_prompts``: the caller feeds prompts in a serving loop's bounded chunks (kvboost-server's step budget:
    32-48 tokens a step on 2 CPU cores, more under a backlog), so ``prefill="auto"`` prefers the path with the smaller
    fixed cost per forward: the quantized step's (~15 ms on 2 Zen 4 cores) over the dense bf16 one's (~30 ms)."""
    from kvboost.env import has_amx
    from kvboost.models.prepack import choose_prefill_weights, plain_projections, projection_bytes
    from kvboost.runtime.llama import has_int4_projections, inductor_unavailable_reason, unsupported_reason

    if decode == "auto" and os.environ.get("KVBOOST_DECODE"):
        decode = os.environ["KVBOOST_DECODE"]
        if decode not in DECODE_MODES:
            raise ValueError(f"KVBOOST_DECODE={decode!r}: use one of {DECODE_MODES}")
    if decode not in ("auto", *DECODE_MODES):
        raise ValueError(f"decode must be 'auto' or one of {DECODE_MODES}, got {decode!r}")
    if prefill not in ("auto", *PREFILL_MODES):
        raise ValueError(f"prefill must be 'auto' or one of {PREFILL_MODES}, got {prefill!r}")
    from kvboost.runtime.quant_step import ACTIVATIONS

    if decode_activations not in ACTIVATIONS:
        raise ValueError(f"decode_activations must be one of {ACTIVATIONS}, got {decode_activations!r}")
    caps = attention.capabilities
    device = _device(model)
    reasons: dict[str, str] = {}
    unsupported = unsupported_reason(model)
    if decode == "hf" or prefill == "hf":
        runner = "hf"
        reasons["runner"] = "requested (decode=hf or prefill=hf: every forward is HF's own)"
    elif unsupported is not None:
        if decode not in ("auto", "hf") or prefill in ("fused", "graphed"):
            raise ValueError(f"decode={decode!r} / prefill={prefill!r} need the Llama-family runner, which does not "
                             f"support this model: {unsupported}; use 'auto' or 'hf'")  # fmt: skip
        runner = "hf"
        reasons["runner"] = f"HF-generic runner: {unsupported}"
    else:
        runner = "llama"
        reasons["runner"] = "Llama-family runner (llama / mistral / qwen2)"
    if runner == "hf":
        if prefill_weights == "prepacked":
            raise ValueError("prefill_weights='prepacked' needs the Llama-family runner; use 'plain' or 'auto'")
        return RunnerConfig("hf", "hf", "plain", {**reasons, "decode": reasons["runner"], "weights": "HF's modules"})

    int4 = has_int4_projections(model)
    plain = plain_projections(model.model.layers)
    # --- weights
    if int4:
        if prefill_weights == "prepacked":
            raise ValueError("prefill_weights='prepacked' cannot run here: the projections are AWQ int4 (they keep "
                             "their own kernels); use 'plain' or 'auto'")  # fmt: skip
        fusable = device.type == "cpu" and not caps.tiled_projections and _int4_fusable(model)
        weights = "int4" if fusable else "plain"
        reasons["weights"] = ("int4 projections (AWQ / GGUF), fused" if fusable
                              else "int4 projections (AWQ / GGUF) through their modules")  # fmt: skip
    elif caps.tiled_projections:
        if prefill_weights == "prepacked":
            raise ValueError(f"prefill_weights='prepacked' with attn={attention.name!r}: the backend multiplies "
                             "the projections itself; use 'plain' or 'auto'")  # fmt: skip
        weights, reasons["weights"] = "plain", f"attention backend {attention.name!r} tiles the projections"
    else:
        first = next(model.parameters())
        weights, reasons["weights"] = choose_prefill_weights(
            prefill_weights, fused_prefill=True, plain_projections=plain, dtype=first.dtype, device=first.device,
            weight_bytes=projection_bytes(model.model.layers) if plain else 0,
        )  # fmt: skip
    # --- decode
    own_arithmetic_ok = plain and not caps.tiled_projections and caps.runner_decode
    if decode == "auto":
        if prefill == "graphed":
            decode = "graphed"
        elif caps.tiled_projections:
            decode, reasons["decode"] = "eager", f"attention backend {attention.name!r}: the eager runner calls it"
        elif int4:
            # Measured on the bundled AWQ model (bf16, 2-core AMX CPU): eager with fused int4 calls 85 tok/s,
            # compiled 66: dynamo's per-call guards cost more than inductor saves around the int4 kernel.
            decode, reasons["decode"] = "eager", "int4 projections (AWQ / GGUF; eager int4 calls)"
        elif not caps.runner_decode:
            decode, reasons["decode"] = "eager", f"attention backend {attention.name!r} attends every forward"
        elif device.type == "cuda":
            decode, reasons["decode"] = "graphed", "auto: CUDA (CUDA graphs over the static pool)"
        elif (why_quantized := quantized_unavailable_reason(model, attention)) is None:
            # The GGUF's own 4-bit blocks (the dense weights' values) at 0.625 bytes per weight: a CPU decode step
            # is bound by the bytes it reads (kvboost.runtime.quant_step; measured in experiments/results/README.md).
            decode, reasons["decode"] = "quantized", "auto: CPU, GGUF 4-bit blocks (kvboost.runtime.quant_step)"
        elif (why := inductor_unavailable_reason()) is not None:
            decode, reasons["decode"] = "eager", f"not compiled: {why}"
        else:
            decode, reasons["decode"] = "compiled", f"auto: CPU (inductor; not quantized: {why_quantized})"
    else:
        reasons["decode"] = "requested"
    if decode == "quantized" and (why := quantized_unavailable_reason(model, attention)) is not None:
        raise ValueError(f"decode='quantized' cannot run here: {why}; use decode='auto', 'compiled' or 'eager'")
    if decode in ("compiled", "graphed") and not own_arithmetic_ok:
        why = ("AWQ int4 projections" if int4 else f"attention backend {attention.name!r} keeps its own arithmetic"
               if not caps.runner_decode or caps.tiled_projections else "projections are not plain linears")
        raise ValueError(f"decode={decode!r} runs the runner's own attention and projections, which cannot apply "
                         f"here ({why}); use decode='eager', 'hf' or 'auto'")  # fmt: skip
    if decode == "graphed" and device.type != "cuda":
        raise ValueError("decode='graphed' replays CUDA graphs; the model is not on a CUDA device (use "
                         "decode='compiled', 'eager' or 'auto')")  # fmt: skip
    if decode == "compiled" and (why := inductor_unavailable_reason()) is not None:
        raise ValueError(f"decode='compiled': {why}; use decode='eager' or 'hf'")
    graph_prefill = decode == "graphed" and prefill in ("auto", "graphed")
    if prefill == "graphed" and decode != "graphed":
        raise ValueError("prefill='graphed' needs decode='graphed' (CUDA graphs); use prefill='fused' or 'auto'")
    if prefill in QUANTIZED_PREFILLS and decode != "quantized":
        raise ValueError(f"prefill={prefill!r} multiplies the GGUF blocks of decode='quantized', which is not the "
                         f"decode path here ({decode}: {reasons.get('decode', '')}); use prefill='fused' or 'auto'")  # fmt: skip
    dtype = _dtype(model)
    if prefill in QUANTIZED_PREFILLS and decode_activations == "int8":
        raise ValueError(f"prefill={prefill!r} with decode_activations='int8': int8 rows are never stored (they are "
                         "not a prefill's), so prompt rows need int16 or fp32 activations; use prefill='fused'")  # fmt: skip
    # auto: prompt rows from the blocks where the dense prefill is fp32 (a CPU without native bf16: on 2 AVX2 cores
    # a 32 / 64 / 256-token chunk took 78 / 146 / 517 ms against 210 / 279 / 762 ms dense); a bf16 model keeps the
    # dense prefill where the CPU has AMX (below), int8 activations always (see above).
    # A serving loop's chunks (chunked_prompts) favour the blocks whatever the dtype: each dense bf16 forward costs a
    # fixed ~30 ms on 2 Zen 4 cores, the quantized step's ~15 ms, and the ShareGPT load tests served 1.09-1.24x the
    # throughput at 8 / 32 clients with it (experiments/results/README.md, "Two int16 rows to a 512-bit vector").
    # bf16 without AMX (AVX-512 BF16: oneDNN's bf16 GEMMs at the int16 kernel's multiply-adds per cycle, on 3x the
    # bytes): the blocks prefill short prompts 1.42-1.78x faster than the prepacked dense forward and 256 / 512-token
    # ones at 0.97x / 0.96x (2 Zen 4 cores; experiments/results/decode/prefill_quantized_zen4/), so one path, the
    # blocks, serves every forward (a split by length costs reuse / cold agreement; see quantized_short below).
    quantized_prefill = prefill == "quantized" or (
        prefill == "auto" and decode == "quantized" and decode_activations != "int8"
        and (dtype == torch.float32 or chunked_prompts or (dtype == torch.bfloat16 and not has_amx())))  # fmt: skip
    # quantized_short (asked for, never auto): the blocks for forwards under SHORT_PREFILL_ROWS rows, the dense
    # weights for longer ones (on 2 Zen 4 cores 3-4% faster than the blocks at 256-512 tokens). auto does not take
    # it: a cold prompt (long: dense) and a reuse's suffix (short: blocks) then run different arithmetic, and
    # run.py's reuse gave its cold prefill's greedy tokens on 12 of 16 requests against 14 of 16 on one path.
    short = SHORT_PREFILL_ROWS if prefill == "quantized_short" else 0
    quantized_prefill_rows = ALL_ROWS if quantized_prefill else short
    if prefill != "auto":
        reasons["prefill"] = "requested"
    elif quantized_prefill and dtype == torch.float32:
        reasons["prefill"] = ("auto: fp32 on a CPU with the quantized step: prompt rows from the GGUF blocks too "
                              "(kvboost.runtime.quant_step)")  # fmt: skip
    elif quantized_prefill and not chunked_prompts:
        reasons["prefill"] = ("auto: bf16 on a CPU without AMX, where the quantized step prefills short prompts faster "
                              "than the dense bf16 GEMMs and long ones about as fast: prompt rows from the GGUF blocks")  # fmt: skip
    elif quantized_prefill:
        reasons["prefill"] = ("auto: prompts come in a serving loop's chunks (engine.chunked_prompts) and the CPU "
                              "decodes from the GGUF blocks: prompt rows from the blocks too, the smaller fixed cost "
                              "per forward")  # fmt: skip
    else:
        reasons["prefill"] = ("short prefills replay CUDA graphs" if graph_prefill else
                              "the runner's eager forward" + (" on prepacked weights" if weights == "prepacked" else ""))
    return RunnerConfig("llama", decode, weights, reasons, graph_prefill=graph_prefill,
                        decode_activations=decode_activations,
                        quantized_prefill_rows=quantized_prefill_rows)  # fmt: skip


def quantized_unavailable_reason(model: Any, attention: Any) -> str | None:
    """Why ``decode="quantized"`` (:mod:`kvboost.runtime.quant_step`) cannot serve ``model`` under ``attention``,
    or None. Its step attends with the C++ paged kernel, so the backend must let the runner decode with its own
    attention (as ``compiled`` does)."""
    from kvboost.runtime.quant_step import unavailable_reason

    caps = attention.capabilities
    if caps.tiled_projections or not caps.runner_decode:
        return f"attention backend {attention.name!r} attends every forward itself"
    return unavailable_reason(model)


def _int4_fusable(model: Any) -> bool:
    """Whether the int4 projections can run fused: every group (q/k/v, o, gate/up, down) of every layer that is all
    int4 fuses, and every int4 member of a mixed group (a GGUF file with some tensors in other types) takes the
    int4 kernel alone (such groups run member by member: ``Int4Projections``)."""
    from kvboost.models.awq import AWQLinear, fused_int4pack_unsupported

    dtype = model.model.layers[0].input_layernorm.weight.dtype
    found = False
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for g in ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj),
                  (mlp.down_proj,)):  # fmt: skip
            int4 = [m for m in g if isinstance(m, AWQLinear)]
            if not int4:
                continue
            found = True
            members = [g] if len(int4) == len(g) else [(m,) for m in int4]
            if any(fused_int4pack_unsupported(m, dtype) is not None for m in members):
                return False
    return found


def build_runner(config: RunnerConfig, model: Any, pool: Any, attention: Any, **graph_options: Any) -> Any:
    """The runner ``config`` names, over ``pool``."""
    if config.runner == "hf":
        from kvboost.runtime.hf_generic import HFGenericRunner

        return HFGenericRunner(model, pool, attention)
    from kvboost.runtime.llama import LlamaRunner

    options = dict(graph_options)
    options.setdefault("prefill", config.graph_prefill)
    if os.environ.get("KVBOOST_GRAPH_COMPILE", "1") == "0":
        options.setdefault("compile", False)
    return LlamaRunner(model, pool, attention, decode=config.decode, weights=config.weights,
                       graph_options=options if config.decode == "graphed" else None,
                       decode_activations=config.decode_activations,
                       quantized_prefill_rows=config.quantized_prefill_rows)  # fmt: skip


def dense_cpu_tag() -> str:
    """What of this CPU can change the bits torch's dense CPU kernels give (MKL's and oneDNN's GEMMs, ``at::vec``
    reductions), for the engine's cache fingerprint where stored rows come from them (issue 61): torch's CPU capability
    (the lanes its vector code reduces over: 8 under AVX2, 16 under AVX512), AMX (oneDNN's bf16 GEMMs run on its
    tiles, another summation order than AVX-512 BF16's) and the vendor (MKL chooses its kernels by vendor as well as
    by ISA). Two machines of one kind share entries; an AMX Xeon, a Zen 4 and an AVX2-only EPYC do not. The 4-bit step
    for every row needs none of it (it calls neither MKL nor oneDNN; its build's lanes are in its own tag)."""
    from kvboost.attention.cpu_ext import cpu_capability
    from kvboost.env import has_amx

    return f"{cpu_capability()}{'+amx' if has_amx() else ''}/{_cpu_vendor()}"


def _cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id (``GenuineIntel``, ``AuthenticAMD``), else the platform's processor name."""
    import platform
    from pathlib import Path

    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
