"""Plain-torch reference of the AWQ int4 dequant-GEMM (:mod:`kvboost.kernels_triton.awq_gemm`).

Layout (AutoAWQ GEMM, 4 bits, zero points): ``qweight`` int32 ``[K, N/8]``, ``qzeros`` int32 ``[K/group, N/8]``,
``scales`` ``[K/group, N]``. Column ``8c + j`` of a packed row sits in the nibble at bits ``4 r .. 4 r + 3`` of int32
``c`` with ``r = AWQ_REVERSE_ORDER[j] = (j % 2) * 4 + j // 2`` (AutoAWQ packs nibble ``k`` from column
``[0, 2, 4, 6, 1, 3, 5, 7][k]``). The weight is ``W[k, n] = (q[k, n] - z[k // group, n]) * s[k // group, n]`` and the
product ``x @ W`` is accumulated in float32 (``float64`` with ``dtype=torch.float64`` for error measurements).
"""

from __future__ import annotations

import torch

AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 ``[rows, n]`` -> int32 codes ``[rows, 8 n]`` in logical column order."""
    cols = torch.arange(packed.shape[1] * 8, device=packed.device)
    shifts = torch.tensor(AWQ_REVERSE_ORDER, device=packed.device)[cols % 8] * 4
    return (packed[:, cols // 8] >> shifts) & 0xF


def awq_dequantize_reference(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The weight ``[K, N]`` (``x @ W`` layout) in ``dtype``."""
    q = unpack_columns(qweight).to(dtype)
    z = unpack_columns(qzeros).to(dtype).repeat_interleave(group_size, dim=0)
    s = scales.to(dtype).repeat_interleave(group_size, dim=0)
    return (q - z) * s


def awq_gemm_reference(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # fmt: skip
    """``x [M, K] @ W [K, N]`` computed in ``dtype`` (float32 by default), returned in ``dtype``."""
    return x.to(dtype) @ awq_dequantize_reference(qweight, qzeros, scales, group_size, dtype)
