"""``decode="quantized"``: the CPU decode step multiplied from a GGUF model's own 4-bit blocks (``kvboost/csrc/cpu_quant.cpp``).

A CPU decode step reads every weight once per token, so its floor is the weights' bytes over the memory bandwidth,
and it pays a fixed cost per kernel call. Dense fp32 weights are 4 bytes per weight; the Q4_1 blocks the bundled
SmolLM2 ships in are 0.625. transformers loads a GGUF model by dequantizing those blocks, so the model's dense
weights *are* the blocks' values: multiplying the blocks computes the same function, summed in another order. This
step does that in one C++ call per step (per layer: norm + q/k/v + RoPE + the K/V write, the paged attention kernel,
o + residual + norm + SiLU MLP + residual; ``decode_layers``) and one for the head (from the Q8_0 embedding table the
head is tied to, or the model's own head), the activations rounded per 32 values as :data:`ACTIVATIONS` says.

What it needs, checked by :func:`unavailable_reason`: the Llama-family runner on CPU, a model loaded from a GGUF
file whose seven projections of every layer are Q4_0 / Q4_1 / Q4_K (``model._kvboost_gguf_file``, recorded by the
loader), an x86 CPU where the C++ extension builds (the build for the CPU's widest vector ISA: AVX-512 VNNI,
AVX-VNNI, AVX2 + FMA, or plain C++; :data:`QUANT_ISAS`, :func:`quant_isa`) and
the C++ paged attention kernel (``attn=cpu_kernel``'s). Every 4-bit tensor is checked against the dense weight it
stands for when the step is built (bit for bit in fp32; after rounding to the model's dtype otherwise), so a file
that is not the model's fails the build with the tensor's name instead of producing noise. Prefill and every
forward with hooks keep the dense weights (MKL / oneDNN GEMMs are faster from ~16 rows up).

Memory: the packs beside the dense weights (the bundled model: 67 MB of 4-bit projections, 29 MB of 8-bit head).
"""

from __future__ import annotations

import functools
import os
import platform
import threading
from typing import Any

import numpy as np
import torch

from kvboost.paths import CSRC_DIR

_SOURCE = CSRC_DIR / "cpu_quant.cpp"
_EXT_NAME = "kvboost_cpu_quant"
#: GGUF types whose blocks the 4-bit kernel multiplies (one (scale, min) per 32 weights)
Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
#: how the step's products see the activations (the first is the default):
#: ``int16``: each row's 32-value groups rounded to int16 codes with their own scale (a step of 3e-5 of the group's
#: largest value), integer products (vpmaddwd): the dense model's function up to ~1e-5, so reuse and cold decode
#: alike; ``int8``: the same with int8 codes (llama.cpp's arithmetic, vpmaddubsw): fastest, but a rounding that
#: flips between two runs moves later logits by ~1e-2 (greedy tokens part at near ties; its generated rows are not
#: stored); ``fp32``: exact activations, every code converted to fp32 (the dense model's function up to fp32
#: summation order; ~2.5x int8's instructions per weight).
ACTIVATIONS = ("int16", "int8", "fp32")
#: the extension's code for each of :data:`ACTIVATIONS` (its ``act`` argument; kvboost/csrc/cpu_quant.cpp kAct*)
ACTIVATION_CODES = {"fp32": 0, "int8": 1, "int16": 2}
_PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def extension_unavailable_reason() -> str | None:
    """Why the quantized step's C++ extension cannot be built here, or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the quantized CPU step is built for x86 (this machine is {platform.machine()})"
    from kvboost.attention.cpu_ext import toolchain_unavailable_reason

    return toolchain_unavailable_reason(_SOURCE)


#: The kernels' builds, each compiled for its own vector ISA (and torch's ``at::vec`` / the attention kernel for the
#: matching CPU capability, :data:`ISA_CAPABILITY`):
#: ``scalar``: no SIMD intrinsics (plain C++, x86-64 baseline): the bit reference every other build is checked against
#: (tests/test_quant_step.py; CI compiles and runs it on every machine). ``avx2``: AVX2 / FMA / F16C intrinsics,
#: vpmaddwd / vpmaddubsw, 4 rows a pass. ``avx_vnni``: the same kernels with the VEX-encoded AVX-VNNI vpdpwssd /
#: vpdpbusd (Intel client CPUs from Alder Lake; no AVX-512 needed). ``avx512_vnni``: AVX-512 VNNI on 256-bit vectors
#: and 8 rows a pass, int16 rows from 2 on two to a 512-bit vector and 16 a pass, wide tiles (AMD Zen 4, Intel Xeon
#: since Cascade Lake). ``amx``: the avx512_vnni build plus an AMX-INT8 tile kernel for products of many rows
#: (:data:`AMX_MIN_ROWS`; Intel Xeon since Sapphire Rapids). Every build sums each 32-value group's integer products
#: exactly and scales them with the same fp32 operations in the same order (std::fma where the vector kernels use
#: FMA; every build compiled with ``-ffp-contract=off`` so plain C++ means the same operations in each), so all give
#: the scalar build's product bits.
QUANT_ISAS = ("scalar", "avx2", "avx_vnni", "avx512_vnni", "amx")
#: The CPU capability each build compiles torch's vector code and the paged attention kernel for (the attention
#: reduces over 8 lanes under AVX2 and 16 under AVX512, issue 61; ``DEFAULT`` is torch's scalar ``at::vec``). This,
#: not the product kernel, is what can change a decode step's bits between builds (:func:`quant_arithmetic_tag`).
ISA_CAPABILITY = {"scalar": "DEFAULT", "avx2": "AVX2", "avx_vnni": "AVX2", "avx512_vnni": "AVX512", "amx": "AVX512"}
#: The compiler's ISA flags of each build (beside its capability's own, kvboost.attention.cpu_ext).
_ISA_FLAGS = {
    "scalar": (),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
    "avx_vnni": ("-mavx2", "-mfma", "-mf16c", "-mavxvnni"),
    "avx512_vnni": ("-mavx2", "-mfma", "-mf16c", "-mavx512vnni"),
    "amx": ("-mavx2", "-mfma", "-mf16c", "-mavx512vnni", "-mamx-tile", "-mamx-int8"),
}
#: /proc/cpuinfo flags each build's instructions need
_ISA_CPU_FLAGS = {
    "scalar": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx_vnni": ("avx2", "fma", "f16c", "avx_vnni"),
    "avx512_vnni": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"),
    "amx": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "amx_tile",
            "amx_int8"),
}
#: The automatic choice's order of preference (the first this CPU runs). ``amx`` is not in it: its tile kernel is
#: chosen only by ``$KVBOOST_QUANT_ISA=amx`` until it measures faster (experiments/results/README.md, "AMX").
_PREFERENCE = ("avx512_vnni", "avx_vnni", "avx2", "scalar")
#: Environment variable that picks the build (one of :data:`QUANT_ISAS`) instead of the best this CPU runs (A/B runs).
QUANT_ISA_ENV = "KVBOOST_QUANT_ISA"
#: Integer rows from which the amx build's products run on AMX tiles (fewer, and fp32 rows: its AVX-512 VNNI
#: kernels); kvboost/csrc/cpu_quant.cpp kAmxMinRows.
AMX_MIN_ROWS = 16


def isa_unavailable_reason(isa: str) -> str | None:
    """Why build ``isa`` (one of :data:`QUANT_ISAS`; ValueError otherwise) cannot run on this CPU (a flag missing),
    or None. The amx build's kernel permission (Linux ``arch_prctl``) is asked for when it loads."""
    if isa not in QUANT_ISAS:
        raise ValueError(f"quantized kernels' build must be one of {QUANT_ISAS}, got {isa!r}")
    from kvboost.env import cpu_flags

    flags = cpu_flags()
    missing = [f for f in _ISA_CPU_FLAGS[isa] if f not in flags]
    if missing:
        return f"the CPU has no {', '.join(missing)} (the {isa} build needs them)"
    return None


def vnni_unavailable_reason() -> str | None:
    """Why the ``avx512_vnni`` build cannot run on this CPU, or None."""
    return isa_unavailable_reason("avx512_vnni")


def quant_isa() -> str:
    """The build :func:`load_quant_extension` loads by default: ``$KVBOOST_QUANT_ISA`` when set (ValueError for a
    name not in :data:`QUANT_ISAS` or a build this CPU cannot run, with the reason), else the first of
    avx512_vnni, avx_vnni, avx2, scalar that the CPU's flags allow."""
    chosen = os.environ.get(QUANT_ISA_ENV, "").strip()
    if chosen:
        if chosen not in QUANT_ISAS:
            raise ValueError(f"{QUANT_ISA_ENV}={chosen!r}: expected one of {QUANT_ISAS}")
        reason = isa_unavailable_reason(chosen)
        if reason is not None:
            raise ValueError(f"{QUANT_ISA_ENV}={chosen!r} cannot run here: {reason}")
        return chosen
    return next(isa for isa in _PREFERENCE if isa_unavailable_reason(isa) is None)


def quant_isa_reason() -> str:
    """How :func:`quant_isa` chose (for ``decode_info``)."""
    if os.environ.get(QUANT_ISA_ENV, "").strip():
        return f"${QUANT_ISA_ENV}"
    skipped = [f"{isa}: {isa_unavailable_reason(isa)}" for isa in _PREFERENCE[: _PREFERENCE.index(quant_isa())]]
    return "the best build the CPU's flags allow" + (f" ({'; '.join(skipped)})" if skipped else "")


def quant_arithmetic_tag(isa: str | None = None) -> str:
    """What of build ``isa`` (default :func:`quant_isa`) can change a decode step's bits, for the engine's cache
    fingerprint: the CPU capability its attention kernel and ``at::vec`` code are compiled for (their lane counts
    set the fp32 summation order). The product kernels are not keyed: every build gives the scalar build's product
    bits by construction (exact int32 group sums, the same fp32 operations in the same order) and by test
    (tests/test_quant_step.py), so two builds of one capability write the same K/V bits."""
    return f"quant-lanes={ISA_CAPABILITY[quant_isa() if isa is None else isa]}"


def use_decode_pool(on: bool = True) -> None:
    """Run this process's quantized decode steps on the step's own thread pool (``kvboost/csrc/work_pool.h``) instead
    of torch's OpenMP pool (the default). kvboost-server's engine loop holds it on while it runs
    (:func:`hold_decode_pool`): there HTTP threads and clients
    share the cores, and OpenMP's fixed split stalls each of a step's ~150 parallel regions on whichever thread the OS
    set aside (2 Zen 4 cores, one client: 7.2 against 13.9 ms between tokens). In a process alone OpenMP is faster
    (``engine.generate`` 151 against 106 tok/s there). ``$KVBOOST_QUANT_POOL=omp|pool`` overrides this. No-op where
    the extension cannot be built."""
    if extension_unavailable_reason() is None:
        load_quant_extension().set_decode_pool(bool(on))


_pool_holds = 0
_pool_before = False  # the setting before the first hold, restored when the last one is released
_pool_lock = threading.Lock()


def hold_decode_pool() -> None:
    """:func:`use_decode_pool` for as long as a holder needs it (kvboost-server's engine loop, from start until its
    thread ends): holds are counted, and when the last is released (:func:`release_decode_pool`) the setting from
    before the first comes back, so a process that served and then computes alone is on OpenMP again."""
    global _pool_holds, _pool_before
    if extension_unavailable_reason() is not None:
        return
    ext = load_quant_extension()
    with _pool_lock:
        if _pool_holds == 0:
            _pool_before = bool(ext.decode_pool())
        _pool_holds += 1
        ext.set_decode_pool(True)


def release_decode_pool() -> None:
    """One hold of :func:`hold_decode_pool` fewer (a release without a hold is ignored)."""
    global _pool_holds
    if extension_unavailable_reason() is not None:
        return
    with _pool_lock:
        if _pool_holds == 0:
            return
        _pool_holds -= 1
        if _pool_holds == 0:
            load_quant_extension().set_decode_pool(_pool_before)


def load_quant_extension(isa: str | None = None) -> Any:
    """Build (once; torch caches the binary) and return the extension of build ``isa`` (default :func:`quant_isa`);
    RuntimeError naming why it cannot. It compiles the paged attention kernel (``kvboost/csrc/cpu_attention.cpp``) in
    with the same vector ISA flags, so one call runs a whole step."""
    return _load_quant_extension(quant_isa() if isa is None else isa)


def quant_build_flags(isa: str) -> tuple[str, ...]:
    """The compiler's ISA flags of the quantized kernels' build ``isa`` (beside the CPU capability's own)."""
    if isa not in QUANT_ISAS:
        raise ValueError(f"quantized kernels' build must be one of {QUANT_ISAS}, got {isa!r}")
    return _ISA_FLAGS[isa]


def build_quant_source(name: str, source: Any, isa: str) -> Any:
    """Compile ``source`` (cpu_quant.cpp or a copy of it) as build ``isa`` and load it as ``<name>_<isa>_<cap>``: its
    flags, its CPU capability (:data:`ISA_CAPABILITY`), and ``-ffp-contract=off`` (no fused multiply-add the source
    did not write, so plain C++ computes the same fp32 operations in the scalar build and the vector ones)."""
    from kvboost.attention.cpu_ext import build_cpu_source

    return build_cpu_source(f"{name}_{isa}", source, quant_build_flags(isa), capability=ISA_CAPABILITY[isa],
                            extra_flags=("-ffp-contract=off",))  # fmt: skip


@functools.cache
def _load_quant_extension(isa: str) -> Any:
    reason = extension_unavailable_reason() or isa_unavailable_reason(isa)
    if reason is not None:
        raise RuntimeError(f"decode='quantized' is unavailable: {reason}")
    try:
        ext = build_quant_source(_EXT_NAME, _SOURCE, isa)
    except Exception as exc:
        raise RuntimeError(f"decode='quantized': building {_SOURCE.name} ({isa}) failed ({type(exc).__name__}); it "
                           "needs g++ and ninja") from exc  # fmt: skip
    return ext


def amx_unavailable_reason(ext: Any) -> str | None:
    """Why extension ``ext``'s products do not run on AMX tiles (not the amx build, or Linux refused the tile
    state: then the amx build runs its AVX-512 VNNI kernels, the same bits), or None."""
    return str(ext.amx_unavailable_reason()) or None


#: Output features per tile of the kernel's layouts (kvboost/csrc/cpu_quant.cpp: kTile).
TILE = 8
#: Output features per wide tile: a 4-bit weight's layout for int16 / int8 activations on the avx512_vnni build
#: (kvboost/csrc/cpu_quant.cpp: kWideTile, wide_tile_rows).
WIDE_TILE = 16


def _group_dtype(*values: torch.Tensor) -> torch.dtype:
    """The dtype a weight keeps its per-group values in: fp16 when every value is one exactly (GGUF's Q4_0 / Q4_1 /
    Q8_0 store fp16 scales and mins, so their bundled blocks are), else fp32 (Q4_K's scale is an fp16 times a 6-bit
    integer). The kernels convert fp16 to fp32 exactly, so the choice changes no result, only the bytes a decode step
    streams from memory: 20 instead of 24 per 32 weights of a 4-bit matrix, 34 instead of 36 of an 8-bit one."""
    for v in values:
        v32 = v.to(torch.float32)
        if not torch.equal(v32.to(torch.float16).to(torch.float32), v32):
            return torch.float32
    return torch.float16


def _tiled_groups(t: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """A per-group matrix ``[N, K/32]`` in the tiles' order ``[N/tile][K/32][tile]`` (kept 2-D, ``[N, K/32]``, for
    tiles of 8; ``[N/16, K/32, 16]`` for wide ones)."""
    rows, groups = t.shape
    tiled = t.reshape(rows // tile, tile, groups).transpose(1, 2)
    return (tiled if tile == WIDE_TILE else tiled.reshape(rows, groups)).contiguous()


def _untiled_groups(t: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    groups = t.shape[-2] if tile == WIDE_TILE else t.shape[1]
    rows = t.numel() // groups
    return t.reshape(rows // tile, groups, tile).transpose(1, 2).reshape(rows, groups)


def tile_unfit_reason(rows: int, cols: int, tile: int = TILE) -> str | None:
    """Why a ``[rows, cols]`` weight does not fit the kernel's tiles of ``tile`` features, or None."""
    if rows % tile or cols % 32:
        return f"[{rows}, {cols}]: the kernel takes out_features a multiple of {tile} and in_features a multiple of 32"
    return None


def _check_tiles(rows: int, cols: int, what: str, tile: int = TILE) -> None:
    reason = tile_unfit_reason(rows, cols, tile)
    if reason is not None:
        raise ValueError(f"{what}: a weight of {reason}")


#: the activations whose rows read wide tiles, and the name of each one's byte order (:class:`Q4Weight`)
WIDE_PACKING = {"int16": "words", "int8": "quads"}
WIDE_ACTIVATIONS = tuple(WIDE_PACKING)


def wide_tiles_for(activations: str, isa: str) -> bool:
    """Whether the step packs its 4-bit weights in wide tiles: int16 or int8 activations on the avx512_vnni build,
    whose kernel for them (``wide_tile_rows``) unpacks 16 features by 8 k per 512-bit load with masks and shifts. Every
    layout gives the same bits; the wide ones are the faster there (experiments/results/README.md)."""
    return activations in WIDE_ACTIVATIONS and isa in ("avx512_vnni", "amx")


def pack_q4_codes(q: torch.Tensor, wide_for: str | None = None) -> torch.Tensor:
    """4-bit codes ``q`` ``[N, K]`` (0..15) in :class:`Q4Weight`'s tiled layout for ``wide_for`` rows (None: tiles of
    8; ``"int8"``: quads; ``"int16"``: words)."""
    rows, cols = q.shape
    q = q.to(torch.uint8)
    if wide_for == "int8":
        t = q.reshape(rows // WIDE_TILE, WIDE_TILE, cols // 8, 2, 4)  # [tile, j, octet, half, i]
        nibbles = t[..., 0, :] | (t[..., 1, :] << 4)  # [tile, j, octet, i]
        return nibbles.permute(0, 2, 1, 3).reshape(rows // WIDE_TILE, cols // 8, 64).contiguous()
    if wide_for == "int16":
        t = q.reshape(rows // WIDE_TILE, WIDE_TILE, cols // 8, 4, 2)  # [tile, j, octet, n, i]
        low = t[..., 0, :] | (t[..., 1, :] << 4)  # nibbles 0 and 1 of word 2j+i: its low byte
        high = t[..., 2, :] | (t[..., 3, :] << 4)
        words = torch.stack([low, high], dim=-1)  # [tile, j, octet, i, byte]
        return words.permute(0, 2, 1, 3, 4).reshape(rows // WIDE_TILE, cols // 8, 32, 2).contiguous()
    t = q.reshape(rows // TILE, TILE, cols // 4, 4)  # [tile, j, quad, i]
    pairs = torch.stack([t[..., 0] | (t[..., 2] << 4), t[..., 1] | (t[..., 3] << 4)], dim=-1)
    return pairs.permute(0, 2, 1, 3).reshape(rows, cols // 2).contiguous()  # [tile, quad, j, 2]


def unpack_q4_codes(codes: torch.Tensor, wide_for: str | None = None) -> torch.Tensor:
    """The codes ``[N, K]`` (uint8, 0..15, the weight's own order) back from :func:`pack_q4_codes`'s layout."""
    if wide_for == "int8":
        tiles, octets = codes.shape[:2]
        nibbles = codes.reshape(tiles, octets, WIDE_TILE, 4).permute(0, 2, 1, 3)  # [tile, j, octet, i]
        q = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-2)  # [tile, j, octet, half, i]
    elif wide_for == "int16":
        tiles, octets = codes.shape[:2]
        words = codes.reshape(tiles, octets, WIDE_TILE, 2, 2).permute(0, 2, 1, 3, 4)  # [tile, j, octet, i, byte]
        low, high = words[..., 0], words[..., 1]
        q = torch.stack([low & 0x0F, low >> 4, high & 0x0F, high >> 4], dim=-2)  # [tile, j, octet, n, i]
    else:
        rows, half = codes.shape
        pairs = codes.reshape(rows // TILE, half // 2, TILE, 2).permute(0, 2, 1, 3)  # [tile, j, quad, 2]
        low, high = pairs & 0x0F, pairs >> 4
        return torch.stack([low[..., 0], low[..., 1], high[..., 0], high[..., 1]], dim=-1).reshape(rows, half * 2)
    return q.reshape(tiles * WIDE_TILE, octets * 8)


class Q4Weight:
    """One 4-bit matrix ``[N, K]`` (``w = q * scale + min`` per 32-weight group) in one of the kernel's tiled
    layouts, so that one vector holds a tile's results and each weight read serves every row of a step.

    Tiles of 8 (the default; every build and activation): ``codes`` uint8 ``[N, K/2]`` holding ``[N/8][K/4][16]``:
    for each tile and 4 consecutive k, byte ``2j`` holds feature j's codes for k (low nibble) and k+2 (high), byte
    ``2j+1`` those for k+1 and k+3; ``scale`` / ``minv`` fp16 or fp32 (:func:`_group_dtype`) ``[N, K/32]`` holding
    ``[N/8][K/32][8]``.

    Wide tiles of 16 (``wide_for="int16"`` or ``"int8"``: read by those activations' rows on the avx512_vnni build,
    :func:`wide_tiles_for`), 64 bytes for each tile and 8 consecutive k; ``scale`` / ``minv`` ``[N/16, K/32, 16]``:
    - int8 rows, quads: ``codes`` ``[N/16, K/8, 64]``, byte ``4j+i`` holds feature j's codes for k+i (low nibble)
      and k+4+i (high);
    - int16 rows, words: ``codes`` ``[N/16, K/8, 32, 2]``, 32 little-endian 16-bit words; word ``2j+i`` holds
      feature j's code for k+2n+i in its nibble n (bits 4n to 4n+3).
    The extension tells the layouts apart by the codes' dimensions, and refuses a weight packed for other rows.

    Optional fp32 ``bias`` ``[N]``. Built from the codes ``q`` ``[N, K]`` (0..15) and per-group ``scale`` /
    ``minv`` ``[N, K/32]``."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, minv: torch.Tensor, bias: torch.Tensor | None = None,
                 wide_for: str | None = None):  # fmt: skip
        if wide_for not in (None, *WIDE_ACTIVATIONS):
            raise ValueError(f"Q4Weight: wide tiles are packed for one of {WIDE_ACTIVATIONS} rows, got {wide_for!r}")
        rows, cols = q.shape
        self.wide_for = wide_for
        _check_tiles(rows, cols, "Q4Weight", self.tile)
        if tuple(scale.shape) != (rows, cols // 32) or scale.shape != minv.shape:
            raise ValueError(f"Q4Weight: codes {tuple(q.shape)} need scale and min [{rows}, {cols // 32}]")
        self.codes = pack_q4_codes(q, wide_for)
        dtype = _group_dtype(scale, minv)
        self.scale = _tiled_groups(scale.to(torch.float32).to(dtype), self.tile)
        self.minv = _tiled_groups(minv.to(torch.float32).to(dtype), self.tile)
        self.bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.shape = (rows, cols)

    @property
    def wide(self) -> bool:
        return self.wide_for is not None

    @property
    def tile(self) -> int:
        """Output features per tile of this weight's layout."""
        return WIDE_TILE if self.wide else TILE

    @classmethod
    def cat(cls, parts: list[Q4Weight]) -> Q4Weight:
        """The matrices stacked along the output axis (q/k/v, gate/up: one product each); whole tiles, so the
        layouts stack as they are."""
        if len({p.wide_for for p in parts}) != 1:
            raise ValueError("Q4Weight.cat: the parts are in different layouts (tiles of 8, or wide tiles for "
                             f"different rows: {sorted({str(p.wide_for) for p in parts})})")  # fmt: skip
        out = cls.__new__(cls)
        out.wide_for = parts[0].wide_for
        out.codes = torch.cat([p.codes for p in parts]).contiguous()
        dtype = functools.reduce(torch.promote_types, [p.scale.dtype for p in parts])  # fp32 if any part is
        out.scale = torch.cat([p.scale.to(dtype) for p in parts]).contiguous()
        out.minv = torch.cat([p.minv.to(dtype) for p in parts]).contiguous()
        biases = [p.bias for p in parts]
        out.bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else torch.zeros(p.shape[0]) for b, p in zip(biases, parts)]).contiguous()  # fmt: skip
        out.shape = (sum(p.shape[0] for p in parts), parts[0].shape[1])
        return out

    def group_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale, min)`` per 32-weight group, ``[N, K/32]`` in the weight's own row order (not the tiles')."""
        return _untiled_groups(self.scale, self.tile), _untiled_groups(self.minv, self.tile)

    def dequantized(self) -> torch.Tensor:
        """The fp32 weight ``[N, K]`` (tests, the build-time check)."""
        rows, cols = self.shape
        q = unpack_q4_codes(self.codes, self.wide_for).reshape(rows, cols // 32, 32)
        scale, minv = self.group_params()
        return (q.float() * scale[..., None] + minv[..., None]).reshape(rows, cols)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.minv) if t is not None)


class Q8Weight:
    """An 8-bit matrix ``[N, K]`` (``w = q * scale``) in the kernel's tiled layout: ``codes`` int8 ``[N, K]``
    holding ``[N/8][K/2][16]`` (byte ``2j`` feature j's code for k, ``2j+1`` for k+1), ``scale`` fp16 or fp32
    (:func:`_group_dtype`) ``[N, K/32]`` holding ``[N/8][K/32][8]``. Built from the codes ``q`` ``[N, K]`` and
    per-group ``scale`` ``[N, K/32]``."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        rows, cols = q.shape
        _check_tiles(rows, cols, "Q8Weight")
        t = q.to(torch.int8).reshape(rows // TILE, TILE, cols // 2, 2)
        self.codes = t.permute(0, 2, 1, 3).reshape(rows, cols).contiguous()
        self.scale = _tiled_groups(scale.to(torch.float32).to(_group_dtype(scale)))
        self.shape = (rows, cols)

    def dequantized(self) -> torch.Tensor:
        rows, cols = self.shape
        q = self.codes.reshape(rows // TILE, cols // 2, TILE, 2).permute(0, 2, 1, 3).reshape(rows, -1, 32)
        return (q.float() * _untiled_groups(self.scale)[..., None]).reshape(rows, cols)

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * self.scale.element_size()


def q8_0_blocks(raw: np.ndarray, rows: int, cols: int) -> Q8Weight:
    """GGUF Q8_0 (32 values in 34 bytes: fp16 ``d``, 32 int8) -> :class:`Q8Weight` (``d * q`` exact in fp32)."""
    blocks = np.ascontiguousarray(np.asarray(raw, dtype=np.uint8)).reshape(rows, cols // 32, 34)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    q = blocks[..., 2:].copy().view(np.int8).reshape(rows, cols)
    return Q8Weight(torch.from_numpy(q), torch.from_numpy(d))


def _check_equal(ours: torch.Tensor, dense: torch.Tensor, name: str) -> None:
    """The 4-/8-bit weight equals the dense weight it stands for (in the dense weight's dtype)."""
    dense = dense.detach()
    if not torch.equal(ours.to(dense.dtype), dense):
        diff = (ours - dense.float()).abs().max().item()
        raise ValueError(f"decode='quantized': {name} in the GGUF file does not match the model's dense weight "
                         f"(max |difference| {diff:.3g}); is the model loaded from this file?")  # fmt: skip


def _layer_linears(model: Any, i: int) -> dict[str, Any]:
    layer = model.model.layers[i]
    attn, mlp = layer.self_attn, layer.mlp
    return {"attn_q": attn.q_proj, "attn_k": attn.k_proj, "attn_v": attn.v_proj, "attn_output": attn.o_proj,
            "ffn_gate": mlp.gate_proj, "ffn_up": mlp.up_proj, "ffn_down": mlp.down_proj}  # fmt: skip


def gguf_file(model: Any) -> str | None:
    """The GGUF file the model was loaded from (recorded by the loader), or None."""
    return getattr(model, "_kvboost_gguf_file", None)


def unavailable_reason(model: Any) -> str | None:
    """Why ``decode="quantized"`` cannot run this model here (None when it can). Reads the GGUF header only."""
    if next(model.parameters()).device.type != "cpu":
        return "the quantized step runs on the CPU"
    path = gguf_file(model)
    if path is None:
        return "the model was not loaded from a GGUF file (its 4-bit blocks are what the step multiplies)"
    reason = extension_unavailable_reason()
    if reason is not None:
        return reason
    from kvboost.attention.cpu_ext import cpu_extension_unavailable_reason

    reason = cpu_extension_unavailable_reason()
    if reason is not None:
        return f"the C++ paged attention kernel: {reason}"
    from kvboost.models.awq import AWQLinear
    from kvboost.models.gguf_weights import gguf_reader

    if any(isinstance(m, AWQLinear) for m in model.modules()):
        return "int4 modules (weights='gguf_int4' or AWQ): the step reads the GGUF blocks beside dense weights"
    types = {t.name: t.tensor_type.name for t in gguf_reader(path).tensors}
    for i in range(len(model.model.layers)):
        linears = _layer_linears(model, i)
        for kind in _PROJECTIONS:
            name = f"blk.{i}.{kind}.weight"
            if types.get(name) not in Q4_TYPES:
                return f"{name} is {types.get(name, 'missing')} (the step multiplies {', '.join(Q4_TYPES)} blocks)"
            unfit = tile_unfit_reason(*linears[kind].weight.shape)
            if unfit is not None:
                return f"{name} is {unfit}"
    return None


class QuantDecodeStep:
    """The quantized forward of a :class:`~kvboost.runtime.llama.LlamaRunner`'s model over its pool: ``run(batch)``
    -> fp32 logits of the batch's logits rows, for a forward without hooks: decode batches, and prompt chunks under
    ``engine.prefill=quantized``."""

    def __init__(self, runner: Any, activations: str = ACTIVATIONS[0], wide: bool | None = None,
                 isa: str | None = None) -> None:
        """``wide``: pack the 4-bit weights in wide tiles (None: where :func:`wide_tiles_for` says so and every
        projection has whole tiles of 16; False: tiles of 8, the A/B baseline of the same bits). ``isa``: the
        kernels' build (default :func:`quant_isa`: the CPU's best, or ``$KVBOOST_QUANT_ISA``)."""
        from kvboost.models.gguf_int4 import unpack_q4_scale_min
        from kvboost.models.gguf_weights import PERMUTED_ARCHITECTURES, _field_str, gguf_reader, llama_row_order

        model = runner.model
        reason = unavailable_reason(model)
        if reason is not None:
            raise ValueError(f"decode='quantized' cannot run here: {reason}; use decode='auto', 'compiled' or 'eager'")
        if activations not in ACTIVATIONS:
            raise ValueError(f"quantized decode activations must be one of {ACTIVATIONS}, got {activations!r}")
        self.activations = activations
        self.act = ACTIVATION_CODES[activations]
        self.runner = runner
        self.isa_reason = quant_isa_reason() if isa is None else "chosen by the caller"
        self.ext = load_quant_extension(isa)
        path = gguf_file(model)
        reader = gguf_reader(path)
        tensors = {t.name: t for t in reader.tensors}
        arch = _field_str(reader, "general.architecture") or ""
        heads, kv_heads = runner.heads, runner.kv_heads
        linears = [_layer_linears(model, i) for i in range(runner.num_layers)]
        # Wide tiles where the kernel for them exists and every projection has whole tiles of 16 (the bundled
        # model's do); else every weight in tiles of 8.
        fits = all(tile_unfit_reason(*lin[kind].weight.shape, WIDE_TILE) is None
                   for lin in linears for kind in _PROJECTIONS)  # fmt: skip
        possible = wide_tiles_for(activations, str(self.ext.isa)) and fits
        if wide and not possible:
            raise ValueError(f"wide tiles need int16 or int8 activations on the avx512_vnni build and projections "
                             f"of whole tiles of {WIDE_TILE} (activations {activations}, build "
                             f"{self.ext.isa})")  # fmt: skip
        self.wide = possible if wide is None else wide

        def q4(name: str, linear: Any, rows_order: np.ndarray | None) -> Q4Weight:
            t = tensors[name]
            q, scale, minv = unpack_q4_scale_min(t.tensor_type, t.data)
            if rows_order is not None:
                q, scale, minv = q[rows_order], scale[rows_order], minv[rows_order]
            w = Q4Weight(q, scale, minv, linear.bias, wide_for=activations if self.wide else None)
            if tuple(w.shape) != tuple(linear.weight.shape):
                raise ValueError(
                    f"decode='quantized': {name} is {list(w.shape)}, the model's {list(linear.weight.shape)}"
                )
            _check_equal(w.dequantized(), linear.weight, name)
            return w

        self.layers: list[tuple] = []
        for i, lin in enumerate(linears):
            w = {}
            for kind in _PROJECTIONS:
                order = None
                if arch in PERMUTED_ARCHITECTURES and kind in ("attn_q", "attn_k"):
                    out = lin[kind].weight.shape[0]
                    order = torch.from_numpy(llama_row_order(out, heads if kind == "attn_q" else kv_heads))
                w[kind] = q4(f"blk.{i}.{kind}.weight", lin[kind], order)
            layer = model.model.layers[i]
            self.layers.append((
                layer.input_layernorm.weight.detach().float().contiguous(),
                Q4Weight.cat([w["attn_q"], w["attn_k"], w["attn_v"]]), w["attn_output"],
                layer.post_attention_layernorm.weight.detach().float().contiguous(),
                Q4Weight.cat([w["ffn_gate"], w["ffn_up"]]), w["ffn_down"],
            ))  # fmt: skip
        self.norm = model.model.norm.weight.detach().float().contiguous()
        self.head: Q8Weight | None = None
        head_name = "output.weight" if "output.weight" in tensors else "token_embd.weight"
        head_tensor = tensors[head_name]
        head_weight = model.lm_head.weight if hasattr(model.lm_head, "weight") else None
        if (head_tensor.tensor_type.name == "Q8_0" and head_weight is not None and head_weight.dim() == 2
                and tile_unfit_reason(*head_weight.shape) is None):
            rows, cols = head_weight.shape
            self.head = q8_0_blocks(head_tensor.data, rows, cols)
            _check_equal(self.head.dequantized(), head_weight, head_name)
            self.head_source = f"{head_name} (Q8_0 blocks)"
        else:
            self.head_source = f"the model's lm_head ({head_tensor.tensor_type.name} in the file)"
        self.eps = runner.eps
        none = torch.empty(0)
        self.flat = [t for ln1, qkv, o, ln2, gu, down in self.layers for t in (
            ln1, qkv.codes, qkv.scale, qkv.minv, none if qkv.bias is None else qkv.bias,
            o.codes, o.scale, o.minv, none if o.bias is None else o.bias,
            ln2, gu.codes, gu.scale, gu.minv, down.codes, down.scale, down.minv)]  # fmt: skip
        self._pools: dict[tuple[int, str], list[torch.Tensor]] = {}

    def _pool_layers(self, pool: Any, kind: str) -> list[torch.Tensor]:
        """The pool's per-layer K (or V) tensors as a list (cached per pool: the runner may be rebound)."""
        key = (id(pool), kind)
        if key not in self._pools:
            self._pools = {k: v for k, v in self._pools.items() if k[0] == id(pool)}
            self._pools[key] = [getattr(pool, kind)[i] for i in range(self.runner.num_layers)]
        return self._pools[key]

    @property
    def nbytes(self) -> int:
        """Bytes of the packs (4-bit projections and the 8-bit head)."""
        total = sum(w.nbytes for layer in self.layers for w in (layer[1], layer[2], layer[4], layer[5]))
        return total + (self.head.nbytes if self.head is not None else 0)

    def run(self, batch: Any) -> torch.Tensor:
        """Logits of ``batch.logits_rows`` for a forward without hooks (decode rows, prompt chunks or both: the
        paged attention contract's query spans and positions); writes every row's K/V into the pool."""
        from kvboost.runtime.ops import rope_tables

        runner, ext = self.runner, self.ext
        inner, pool = runner.inner, runner.pool
        x = inner.embed_tokens.weight.index_select(0, batch.input_ids).float().contiguous()
        cos, sin = rope_tables(batch.positions, inner.rotary_emb.inv_freq, runner.attention_scaling, torch.float32)
        cos, sin = cos.contiguous(), sin.contiguous()
        slots = batch.slot_mapping.to(torch.int64).contiguous()
        args = batch.kernel_args()
        tables, kv_lens = args["block_tables"].contiguous(), args["kv_lens"].contiguous()
        starts, q_positions = args["query_start"].contiguous(), args["q_positions"].contiguous()
        rows = x.shape[0]
        heads, kv_heads, dim = runner.heads, runner.kv_heads, runner.head_dim
        scale, block_size = runner.scale, pool.block_size
        ext.decode_layers(x, self.flat, self._pool_layers(pool, "keys"), self._pool_layers(pool, "values"), cos, sin,
                          slots, tables, kv_lens, starts, q_positions, heads, kv_heads, dim, self.eps, scale,
                          block_size, self.act)  # fmt: skip
        x = x.index_select(0, batch.logits_rows) if batch.logits_rows.numel() != rows else x
        h = ext.rms_norm(x.contiguous(), self.norm, self.eps)
        if self.head is not None:
            return ext.q8_matmul(h, self.head.codes, self.head.scale, self.act)
        head = runner.model.lm_head
        return head(h.to(runner.dtype)).float()

    def describe(self) -> dict[str, Any]:
        return {"isa": str(self.ext.isa), "isa_reason": self.isa_reason,
                "arithmetic": quant_arithmetic_tag(str(self.ext.isa)),
                **({"amx_tiles": amx_unavailable_reason(self.ext) or f"from {AMX_MIN_ROWS} integer rows"}
                   if self.ext.isa == "amx" else {}),
                "activations": self.activations, "head": self.head_source,
                "layout": f"wide tiles of 16 ({WIDE_PACKING[self.activations]})" if self.wide else "tiles of 8",
                "pack_bytes": self.nbytes, "decode_pool": "own" if self.ext.decode_pool() else "openmp"}  # fmt: skip
