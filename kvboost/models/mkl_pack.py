"""fp32 projections from MKL-packed weights (``engine.prefill_weights=prepacked`` in fp32 on CPU).

An fp32 ``F.linear`` on CPU is MKL's ``sgemm``, which copies the weight into its internal panel layout on every
call. MKL's packed API does that once: ``cblas_sgemm_pack`` lays the weight out for the kernel, and
``cblas_sgemm_compute`` multiplies any number of rows by it. torch's x86 CPU build links MKL and exports those
three functions from ``libtorch_cpu``; torch itself only reaches them through ``torch.ops.mkl._mkl_linear``, which
falls back to a plain ``F.linear`` unless the row count equals the one packed for (useless for prefills of every
length), so they are called here through ``ctypes``. Where the library or the symbols are missing (another BLAS,
another platform), :func:`unavailable_reason` says so and nothing is packed.

``python -m experiments.bench.bench_prefill_paths --threads 2 --dtypes float32 --rounds 9`` (bundled model, AMX Xeon, an
exact prefix hit plus a suffix): TTFT of the fused prefill on plain -> packed weights 73.6 -> 65.7 ms (20 cached + 42
new tokens), 238.7 -> 231.4 (500 + 188), 373.4 -> 344.9 (1,000 + 255). Results equal ``F.linear``'s bits for most
shapes and row counts >= 64 and differ by an ulp elsewhere (MKL picks its kernel by shape); the fused prefill is
then close to HF's forward (first-token logits within 3e-5 there), not its bits.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162  # MKL's CBLAS enum values
# The rows MKL is told to expect when packing. The packed weight serves any row count; packed for 1 row it chose a
# slower kernel for prefill-sized calls (no gain over F.linear), for 128 rows 6-12% faster ones.
_PACK_ROWS_HINT = 128


@functools.lru_cache(maxsize=1)
def _library() -> tuple[ctypes.CDLL | None, str | None]:
    """(libtorch_cpu with MKL's packed-GEMM functions typed, None) or (None, why not)."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not path.is_file():
        return None, f"no {path.name} beside torch (MKL's packed GEMM is reached through it)"
    try:
        lib = ctypes.CDLL(str(path))
        get_size, pack, compute = lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack, lib.cblas_sgemm_compute
    except (OSError, AttributeError) as exc:
        return None, f"this torch build does not export MKL's packed GEMM ({exc})"
    c_int, c_ptr = ctypes.c_int, ctypes.c_void_p
    get_size.restype, get_size.argtypes = ctypes.c_size_t, [c_int, c_int, c_int, c_int]
    pack.restype = None
    pack.argtypes = [c_int, c_int, c_int, c_int, c_int, c_int, ctypes.c_float, c_ptr, c_int, c_ptr]
    compute.restype = None
    compute.argtypes = [c_int, c_int, c_int, c_int, c_int, c_int, c_ptr, c_int, c_ptr, c_int, ctypes.c_float, c_ptr,
                        c_int]  # fmt: skip
    return lib, None


def unavailable_reason() -> str | None:
    """Why MKL-packed fp32 weights cannot run here (None: they can)."""
    if not torch.backends.mkl.is_available():
        return "this torch build has no MKL"
    return _library()[1]


class MklPackedLinear:
    """``y = x W^T + b`` in fp32 with ``W`` packed once by MKL (CPU). Callable like the module."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        lib, reason = _library()
        if lib is None:
            raise RuntimeError(f"MKL-packed weights are not available: {reason}")
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"MKL packing takes a 2-D fp32 CPU weight, got {tuple(weight.shape)} {weight.dtype}")
        self._compute = lib.cblas_sgemm_compute
        self.out_features, self.in_features = n, k = weight.shape
        w = weight.detach().contiguous()
        size = lib.cblas_sgemm_pack_get_size(_B_MATRIX, _PACK_ROWS_HINT, n, k)
        self._buffer = torch.empty((size + 3) // 4, dtype=torch.float32)  # bytes -> floats, MKL's own layout
        # B = W^T: the row-major [n, k] weight, transposed.
        lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, _PACK_ROWS_HINT, n, k, 1.0, w.data_ptr(), k,
                             self._buffer.data_ptr())  # fmt: skip
        self.bias = None if bias is None else bias.detach()
        self.nbytes = self._buffer.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"input of shape {tuple(x.shape)}; this linear takes [rows, {self.in_features}]")
        if x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"MKL-packed weights multiply fp32 CPU inputs, got {x.dtype} on {x.device}")
        x = x.contiguous()
        m, n, k = x.shape[0], self.out_features, self.in_features
        y = torch.empty(m, n, dtype=torch.float32)
        if m:
            self._compute(_ROW_MAJOR, _NO_TRANS, _PACKED, m, n, k, x.data_ptr(), k, self._buffer.data_ptr(), k, 0.0,
                          y.data_ptr(), n)  # fmt: skip
        return y if self.bias is None else y.add_(self.bias)
