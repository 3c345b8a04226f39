"""AWQ int4 dequant-GEMM in Triton: ``out = x @ W`` with ``W`` stored in AutoAWQ's GEMM layout (reference and
layout: :mod:`.awq_gemm_reference`).

One program computes a ``[BLOCK_M, BLOCK_N]`` tile of the output. It walks K in steps of ``BLOCK_K``: loads the
``[BLOCK_M, BLOCK_K]`` activations, the ``[BLOCK_K, BLOCK_N]`` packed codes (each int32 is loaded by the 8 output
columns it holds; column ``8c + j`` shifts by ``4 * ((j % 2) * 4 + j // 2)``, AutoAWQ's interleaved order), the zero
points and scales of each row's group, dequantizes ``(q - z) * s`` in float32, casts to the activation dtype
(fp16 / bf16 feed the tensor cores; fp32 inputs use an IEEE fp32 dot, not TF32) and accumulates in float32.
Under the interpreter, bf16 inputs are multiplied in fp32 (its fp32 -> bf16 cast gives garbage). Masks cover
M, N and K tails, so any M and any K, N that the format allows (N % 8 == 0, K % group == 0) work.

Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors (slowly): the tests use it there on small shapes;
:class:`kvboost.models.awq.AWQLinear` calls it on CUDA only.
"""

from __future__ import annotations

import torch

from kvboost.kernels_triton import import_triton

# at load time: @triton.jit decorates the kernels below (a clear error without triton)
triton, tl = import_triton()

__all__ = ["awq_gemm", "is_interpreter"]


def is_interpreter() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


# Listed here as the autotune space on GPU; the interpreter runs the first one only.
_CONFIGS = [
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=4, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64}, num_warps=8, num_stages=3),
]


@triton.jit
def _awq_gemm_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_qwk, stride_qwn, stride_qzg, stride_qzn, stride_sg, stride_sn, stride_om, stride_on,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    j = offs_n % 8
    shift = ((j % 2) * 4 + j // 2) * 4  # nibble of column 8c + j (AutoAWQ's interleaving)
    packed_n = offs_n // 8

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :], other=0.0,
        )  # fmt: skip
        wmask = mask_k[:, None] & mask_n[None, :]
        qw = tl.load(qw_ptr + offs_k[:, None] * stride_qwk + packed_n[None, :] * stride_qwn, mask=wmask, other=0)
        g = offs_k // GROUP
        qz = tl.load(qz_ptr + g[:, None] * stride_qzg + packed_n[None, :] * stride_qzn, mask=wmask, other=0)
        s = tl.load(s_ptr + g[:, None] * stride_sg + offs_n[None, :] * stride_sn, mask=wmask, other=0.0)
        q = (qw >> shift[None, :]) & 0xF
        z = (qz >> shift[None, :]) & 0xF
        w = (q - z).to(tl.float32) * s.to(tl.float32)  # masked rows: s = 0 -> w = 0
        if DOT_F32:  # fp32 inputs (IEEE, not TF32), and bf16 under the interpreter (its fp32 -> bf16 cast is broken)
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype), out_dtype=tl.float32)

    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on, out,
             mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


_awq_gemm_autotuned = triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "GROUP"])(_awq_gemm_kernel)


def awq_gemm(
    x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
    *, block: tuple[int, int, int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """``x [M, K] @ W [K, N]`` with ``W`` in AutoAWQ's GEMM layout; the output has ``x``'s dtype.

    ``block`` = (BLOCK_M, BLOCK_N, BLOCK_K) fixes the tile (each >= 16) instead of autotuning; under the
    interpreter the default is (16, 32, 32).
    """
    if x.dim() != 2:
        raise ValueError(f"awq_gemm: x must be [M, K] (got {tuple(x.shape)})")
    M, K = x.shape
    N = qweight.shape[1] * 8
    if qweight.shape[0] != K:
        raise ValueError(f"awq_gemm: x has K={K} but qweight has {qweight.shape[0]} rows")
    if K % group_size or qzeros.shape != (K // group_size, N // 8) or scales.shape != (K // group_size, N):
        raise ValueError(
            f"awq_gemm: shapes do not fit group_size {group_size}: qweight {tuple(qweight.shape)}, "
            f"qzeros {tuple(qzeros.shape)}, scales {tuple(scales.shape)}"
        )
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32:
        raise ValueError("awq_gemm: qweight and qzeros must be int32")
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    args = (
        x, qweight, qzeros, scales, out, M, N, K,
        x.stride(0), x.stride(1), qweight.stride(0), qweight.stride(1), qzeros.stride(0), qzeros.stride(1),
        scales.stride(0), scales.stride(1), out.stride(0), out.stride(1),
    )  # fmt: skip
    interpreted = is_interpreter()
    dot_f32 = x.dtype == torch.float32 or (interpreted and x.dtype == torch.bfloat16)
    if block is None and interpreted:
        block = (16, 32, 32)
    if block is not None:
        bm, bn, bk = block
        grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
        _awq_gemm_kernel[grid](*args, GROUP=group_size, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, DOT_F32=dot_f32)
    else:
        grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))
        _awq_gemm_autotuned[grid](*args, GROUP=group_size, DOT_F32=dot_f32)
    return out
