"""Attention backends (``ATTENTION`` registry): sdpa, eager, triton, cuda, cpu_kernel,
batch_invariant.

Importing this package registers the built-ins; kernels and extensions are imported lazily, only when a
backend is checked or installed, so this import never needs triton, a GPU or a compiler. Usage::

    from kvboost.registry import ATTENTION

    backend = ATTENTION.build("triton")     # or {"name": "triton"} from kvboost/configs/attn/triton.yaml
    backend.install(model)                  # raises RuntimeError with a clear message if it cannot run here
    model(input_ids)
    backend.stats()                         # {"backend": "triton", "kernel_calls": ..., "fallback_calls": ...}
"""

from kvboost.attention.base import AttentionBackend, FlashKernelBackend
from kvboost.attention.batch_invariant import BatchInvariantBackend
from kvboost.attention.cpu_kernel import CpuKernelBackend
from kvboost.attention.cuda import CudaBackend
from kvboost.attention.eager import EagerBackend
from kvboost.attention.masks import KernelMaskParams, allowed_from_mask, mask_to_kernel_params
from kvboost.attention.sdpa import SdpaBackend
from kvboost.attention.triton import TritonBackend

__all__ = [
    "AttentionBackend",
    "BatchInvariantBackend",
    "CpuKernelBackend",
    "CudaBackend",
    "EagerBackend",
    "FlashKernelBackend",
    "KernelMaskParams",
    "SdpaBackend",
    "TritonBackend",
    "allowed_from_mask",
    "mask_to_kernel_params",
]
