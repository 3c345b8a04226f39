"""The CPU attention kernel (``kvboost/csrc/cpu_attention.cpp``), built lazily with ``torch.utils.cpp_extension``.

Python side of the attention contract in :mod:`kvboost.kernels_triton` for the ``cpu_kernel`` backend::

    out = cpu_attention_forward(q, k, v, causal=True, sm_scale=None, q_positions=None, kv_start=None, kv_len=None,
                            out=None, tile=32)

fp32 and bf16, any head dim, grouped-query attention (``Hq % Hkv == 0``), causal by position (bottom-right by
default, or per-query ``q_positions``), per-row ``kv_start`` / ``kv_len`` padding, inputs with any strides and a
contiguous last dimension, ``out`` with any strides. And its paged entry point, over one layer of a block pool
(the contract of ``kvboost/kernels_triton/paged_attention_reference.py``; same dtypes, GQA and strides)::

    out = cpu_paged_attention_forward(q, k_cache, v_cache, block_tables=..., kv_lens=..., query_start=...,
                                      q_positions=..., block_size=16, sm_scale=None, out=None, tile=32)

Why they exist and how they work: the comments in the C++ file; measured against torch's SDPA in
``experiments/bench/bench_cpu_attention.py`` and ``experiments/bench/bench_cpu_paged_attention.py``.

Needs an x86 build of torch with MKL (the kernel calls the MKL GEMMs torch carries) and a C++ compiler (g++ and
ninja). The first use compiles it (~25 s on 2 cores); torch caches the binary under ``TORCH_EXTENSIONS_DIR``
(one build per CPU capability: AVX512, AVX2 or DEFAULT, which sets the vector width of the softmax).
"""

from __future__ import annotations

import functools
import math
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

from kvboost.attention.cuda_ext import _row_bounds  # the same per-row bounds check as the CUDA kernel's
from kvboost.paths import CSRC_DIR

__all__ = [
    "CSRC_DIR",
    "check_tile",
    "cpu_attention_forward",
    "cpu_extension_unavailable_reason",
    "cpu_paged_attention_forward",
    "load_cpu_extension",
]

_SOURCE = CSRC_DIR / "cpu_attention.cpp"
_EXT_NAME = "kvboost_cpu_kernel"

#: Compiler flags per ATen CPU capability: the vector ISA the softmax's ``at::vec`` code is built for.
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
}


def cpu_capability() -> str:
    """The vector ISA to build for: torch's own choice for this CPU (``AVX512``, ``AVX2``) or ``DEFAULT``."""
    cap = str(torch.backends.cpu.get_cpu_capability()).upper()
    if cap.startswith("AVX512"):
        return "AVX512"
    return cap if cap in _CAPABILITY_FLAGS else "DEFAULT"


def cpu_extension_unavailable_reason() -> str | None:
    """Why the kernel cannot be built here (no MKL in torch, not x86, no compiler, no sources), or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it calls MKL's GEMMs, which torch carries only on x86 (this machine is {platform.machine()})"
    if not torch.backends.mkl.is_available():
        return "this torch build has no MKL (the kernel calls MKL's GEMMs inside torch's library)"
    return toolchain_unavailable_reason(_SOURCE)


def toolchain_unavailable_reason(source: Path) -> str | None:
    """Why a C++ source of this package cannot be compiled here (no compiler on PATH, the source missing), or None."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        return "no C++ compiler on PATH (install g++, e.g. apt-get install -y g++)"
    if not source.exists():
        return f"the kernel's source is missing: {source}"
    return None


def build_cpu_source(ext_name: str, source: Path, extra_isa_flags: tuple[str, ...] = (), capability: str | None = None,
                     extra_flags: tuple[str, ...] = ()) -> Any:
    """Compile ``source`` with OpenMP for a vector ISA (``capability``: ``AVX512``, ``AVX2`` or ``DEFAULT``; default
    :func:`cpu_capability`, this CPU's; ``extra_isa_flags`` added unless it is ``DEFAULT``; ``extra_flags`` always)
    and load it as extension ``<ext_name>_<capability>``: torch caches the binary, and
    ``kvboost.attention.ext_build`` lets one builder at a time through. Raises what the build raised."""
    from kvboost.attention.ext_build import load_extension

    cap = cpu_capability() if capability is None else capability
    if cap not in (*_CAPABILITY_FLAGS, "DEFAULT"):
        raise ValueError(f"capability must be one of {(*_CAPABILITY_FLAGS, 'DEFAULT')}, got {cap!r}")
    flags = ["-O3", "-fopenmp", *_CAPABILITY_FLAGS.get(cap, []), *extra_flags]
    if cap != "DEFAULT":
        flags += [f"-DCPU_CAPABILITY_{cap}", f"-DCPU_CAPABILITY={cap}", *extra_isa_flags]
    return load_extension(f"{ext_name}_{cap.lower()}", sources=[str(source)], extra_cflags=flags,
                          extra_ldflags=["-fopenmp"], verbose=False)  # fmt: skip


def attention_build_tag() -> str:
    """The build of the attention kernel this process loads (:func:`load_cpu_extension`), for the engine's cache
    fingerprint: its CPU capability sets the lanes its fp32 sums run over (8 under AVX2, 16 under AVX512, scalar
    under DEFAULT; issue 61), so K/V it helps compute differ between two CPU kinds."""
    return f"cpu_kernel[{cpu_capability()}]"


@functools.cache
def load_cpu_extension() -> Any:
    """Build (once per process; torch caches the binary on disk) and return the compiled extension module.

    Raises:
        RuntimeError: the kernel cannot be built here (see :func:`cpu_extension_unavailable_reason`), or the
            build failed (the compiler's output is in the chained exception).
    """
    reason = cpu_extension_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"attention backend 'cpu_kernel' is unavailable: {reason}; use attn=sdpa")
    try:
        return build_cpu_source(_EXT_NAME, _SOURCE)
    except Exception as exc:  # the compiler's message is in exc
        raise RuntimeError(
            f"attention backend 'cpu_kernel': building {_SOURCE.name} failed ({type(exc).__name__}); "
            "it needs g++ and ninja (pip install ninja); use attn=sdpa meanwhile"
        ) from exc


def check_tile(tile: Any, setting: str = "tile") -> int:
    """``tile`` (query tokens per work unit) if it is a positive integer; else ValueError naming ``setting``."""
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"{setting} must be a positive integer, got {tile!r}")
    return tile


def _positions(x: Any, batch: int, q_len: int) -> torch.Tensor | None:
    if x is None:
        return None
    t = torch.as_tensor(x)
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"q_positions must hold integers, got {t.dtype}")
    if tuple(t.shape) != (batch, q_len):
        raise ValueError(f"q_positions must have shape [{batch}, {q_len}], got {list(t.shape)}")
    return t.to(device="cpu", dtype=torch.int32).contiguous()


def cpu_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    sm_scale: float | None = None,
    q_positions: Any = None,
    kv_start: Any = None,
    kv_len: Any = None,
    out: torch.Tensor | None = None,
    tile: int = 32,
) -> torch.Tensor:
    """Attention of ``q`` ``[B, Hq, Lq, D]`` over ``k``/``v`` ``[B, Hkv, Lk, D]`` on the CPU; returns
    ``[B, Hq, Lq, D]`` (``out`` when given, written through its strides).

    Query ``i`` of row ``b`` sits at ``q_positions[b, i]`` (default ``Lk - Lq + i``) and sees key ``j`` iff
    ``kv_start[b] <= j < kv_len[b]`` and, when ``causal``, ``j <= `` its position; a query that sees no key
    gets zeros. ``tile``: query tokens per work unit (their G query heads form one GEMM of ``G * tile`` rows).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"cpu_kernel: {name} must be 4-D [B, H, L, D], got shape {list(t.shape)}")
        if t.device.type != "cpu":
            raise ValueError(f"cpu_kernel: {name} is on {t.device}; this kernel runs on the CPU")
    if q.dtype not in (torch.float32, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"cpu_kernel: q, k, v must all be float32 or all bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
    batch, heads, q_len, head_dim = q.shape
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim or heads % k.shape[1]:
        raise ValueError(
            f"cpu_kernel: shapes do not match: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} "
            "(q [B, Hq, Lq, D], k/v [B, Hkv, Lk, D] with Hq a multiple of Hkv)"
        )
    check_tile(tile, "cpu_kernel: tile")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("cpu_kernel: out must have q's shape and dtype and a contiguous last dimension")
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    ext = load_cpu_extension()
    cpu = torch.device("cpu")
    ext.forward(q, k, v, bool(causal), scale, _positions(q_positions, batch, q_len),
                _row_bounds(kv_start, "kv_start", batch, cpu), _row_bounds(kv_len, "kv_len", batch, cpu), out, tile)  # fmt: skip
    return out


_PAGED = "cpu_paged_attention_forward"
_FLOATS = (torch.float32, torch.bfloat16)


def _index(x: Any, name: str, shape: tuple[int, ...] | None, dims: int) -> torch.Tensor:
    """An index tensor of the paged contract (int32 on the CPU with ``dims`` dims, and ``shape`` when given),
    made contiguous; else TypeError / ValueError saying what is wrong. The common case costs a few attribute
    reads: the paged call runs once per layer per step."""
    fast = type(x) is torch.Tensor and x.dtype == torch.int32 and x.is_cpu and x.dim() == dims
    if fast and (shape is None or x.shape == shape):
        return x.contiguous()
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_PAGED}: {name} must be an int32 tensor, got {type(x).__name__}")
    if x.dtype != torch.int32:
        raise TypeError(f"{_PAGED}: {name} must be int32, got {x.dtype}")
    if x.device.type != "cpu":
        raise ValueError(f"{_PAGED}: {name} is on {x.device}; this kernel runs on the CPU")
    if x.dim() != dims or (shape is not None and x.shape != shape):
        want = list(shape) if shape is not None else f"{dims}-D"
        raise ValueError(f"{_PAGED}: {name} must have shape {want}, got {list(x.shape)}")
    return x.contiguous()  # a subclass of Tensor


def _check_float(t: Any, arg: str) -> None:
    """q / k_cache / v_cache / out: a 3-D CPU tensor with a contiguous last dimension (dtype checked apart)."""
    if type(t) is torch.Tensor and t.dim() == 3 and t.is_cpu and t.stride(2) == 1:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{_PAGED}: {arg} must be a tensor, got {type(t).__name__}")
    if t.dim() != 3:
        want = "[Hkv, S, D]" if arg in ("k_cache", "v_cache") else "[T, Hq, D]"
        raise ValueError(f"{_PAGED}: {arg} must be 3-D {want}, got shape {list(t.shape)}")
    if t.device.type != "cpu":
        raise ValueError(f"{_PAGED}: {arg} is on {t.device}; this kernel runs on the CPU")
    if arg != "q" and t.stride(2) != 1:  # (q is made contiguous instead)
        extra = " (the pool is not copied)" if arg != "out" else ""
        raise ValueError(f"{_PAGED}: {arg} must have a contiguous last dimension{extra}")


def cpu_paged_attention_forward(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    block_tables: torch.Tensor,
    kv_lens: torch.Tensor,
    query_start: torch.Tensor,
    q_positions: torch.Tensor,
    block_size: int,
    sm_scale: float | None = None,
    out: torch.Tensor | None = None,
    tile: int = 32,
) -> torch.Tensor:
    """Attention of the queries of ``B`` sequences over their keys in a paged pool, on the CPU; returns ``out``
    ``[T, Hq, D]`` (written through its strides when given, else allocated).

    The contract (``kvboost/kernels_triton/paged_attention_reference.py``): ``q`` ``[T, Hq, D]`` holds sequence ``b``'s
    queries in rows ``query_start[b] .. query_start[b + 1]``; ``k_cache`` / ``v_cache`` ``[Hkv, S, D]`` are one
    layer of the pool (``S = num_blocks * block_size``), sequence ``b``'s logical key ``j`` in slot
    ``block_tables[b, j // block_size] * block_size + j % block_size``; query ``t`` sees key ``j`` iff
    ``j <= q_positions[t]`` and ``j < kv_lens[b]`` (a query that sees no key gets zeros). Index tensors are int32
    on the CPU: ``block_tables`` ``[B, M]``, ``kv_lens`` ``[B]``, ``query_start`` ``[B + 1]``, ``q_positions``
    ``[T]``. ``tile``: query rows per work unit (with the G heads of a GQA group, one problem of ``G * tile``
    rows). Grouped-query attention: query head ``h`` reads KV head ``h // (Hq // Hkv)``.

    Shapes, dtypes, devices and strides are checked here; the index values (``query_start`` running from 0 to T
    without going back, ``0 <= kv_lens[b] <= M * block_size``, every block id of every sequence's blocks inside
    the pool) are checked by the extension before it reads anything (a plain loop over the integers, cheap
    enough for every layer of every decode step), raising ValueError too. The pool is never copied: ``k_cache`` /
    ``v_cache`` (and ``out``) must have a contiguous last dimension; ``q`` is made so if it is not. The checks
    here cost ~5 us per call (one call per layer per step).

    Raises:
        TypeError: a dtype is wrong (q / k_cache / v_cache / out not all float32 or all bfloat16, an index
            tensor not int32), or an argument is not a tensor.
        ValueError: a shape, device, stride or index value is wrong.
        RuntimeError: the extension cannot be built here (see :func:`load_cpu_extension`).
    """
    _check_float(q, "q")
    _check_float(k_cache, "k_cache")
    _check_float(v_cache, "v_cache")
    dtype = q.dtype
    if dtype not in _FLOATS or k_cache.dtype != dtype or v_cache.dtype != dtype:
        raise TypeError(
            f"{_PAGED}: q, k_cache, v_cache must all be float32 or all bfloat16, got {q.dtype}, {k_cache.dtype}, "
            f"{v_cache.dtype}"
        )
    q_shape, kv_shape = q.shape, k_cache.shape
    total, heads, head_dim = q_shape
    kv_heads, slots, kv_dim = kv_shape
    if v_cache.shape != kv_shape or kv_dim != head_dim or kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"{_PAGED}: shapes do not match: q {list(q_shape)}, k_cache {list(kv_shape)}, v_cache "
            f"{list(v_cache.shape)} (q [T, Hq, D], k_cache / v_cache [Hkv, S, D] with Hq a multiple of Hkv)"
        )
    if type(block_size) is not int or block_size < 1 or slots % block_size:
        raise ValueError(f"{_PAGED}: block_size must be a positive integer dividing the pool's {slots} slots, "
                         f"got {block_size!r}")  # fmt: skip
    if type(tile) is not int or tile < 1:
        check_tile(tile, f"{_PAGED}: tile")  # raises, naming the setting
    tables = _index(block_tables, "block_tables", None, 2)
    batch = tables.shape[0]
    lens = _index(kv_lens, "kv_lens", (batch,), 1)
    starts = _index(query_start, "query_start", (batch + 1,), 1)
    positions = _index(q_positions, "q_positions", (total,), 1)
    if q.stride(2) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(q_shape, dtype=dtype)
    else:
        _check_float(out, "out")
        if out.shape != q_shape or out.dtype != dtype:
            raise ValueError(f"{_PAGED}: out must be a {list(q_shape)} {dtype} tensor, got {list(out.shape)} "
                             f"{out.dtype}")  # fmt: skip
    scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
    load_cpu_extension().paged_forward(q, k_cache, v_cache, tables, lens, starts, positions, block_size, scale, out,
                                       tile)  # fmt: skip
    return out
