"""The Triton AWQ int4 dequant-GEMM (``kvboost.kernels_triton.awq_gemm``) against its plain-torch reference.

Without a GPU these run under the Triton CPU interpreter (see conftest.py): small, odd shapes, so every tile has
masked tails in M, N and K (N is a multiple of 8 and K of the group size, as the format requires).
"""

import math

import pytest
import torch

pytest.importorskip("triton")

from kvboost.kernels_triton.awq_gemm import awq_gemm
from kvboost.kernels_triton.awq_gemm_reference import awq_dequantize_reference, awq_gemm_reference
from kvboost.models.awq import dequantize_awq, pack_awq

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}

# (M, K, N, group): one row (decode), odd M, K = 3 groups, N not a multiple of the block, group 128 with K > BLOCK_K.
SHAPES = [(1, 96, 40, 32), (5, 96, 72, 32), (17, 64, 24, 16), (3, 256, 56, 128), (33, 192, 104, 64)]


def random_awq(K: int, N: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (K, N), generator=g, dtype=torch.int32)
    zeros = torch.randint(0, 16, (K // group, N), generator=g, dtype=torch.int32)
    scales = (torch.rand(K // group, N, generator=g) * 0.05 + 0.005).half()
    t = pack_awq(codes, zeros, scales)
    return t["qweight"].to(DEVICE), t["qzeros"].to(DEVICE), t["scales"].to(DEVICE)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).abs().max() / ref.abs().max().clamp(min=1e-12)).item()


def test_reference_dequant_matches_library_dequant():
    qweight, qzeros, scales = random_awq(96, 40, 32)
    ref = awq_dequantize_reference(qweight.cpu(), qzeros.cpu(), scales.cpu(), 32)
    assert torch.equal(ref, dequantize_awq(qweight.cpu(), qzeros.cpu(), scales.cpu()).t())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("M,K,N,group", SHAPES)
def test_awq_gemm_matches_reference(M, K, N, group, dtype, record_error):
    qweight, qzeros, scales = random_awq(K, N, group, seed=M + K)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(N)).to(DEVICE, dtype)
    out = awq_gemm(x, qweight, qzeros, scales, group)
    assert out.dtype == dtype and out.shape == (M, N)
    ref = awq_gemm_reference(x, qweight, qzeros, scales, group, dtype=torch.float64)
    err = rel_err(out, ref)
    record_error("awq_gemm", dtype, err)
    assert err <= TOL[dtype], err


def test_awq_gemm_strided_input_and_explicit_blocks():
    qweight, qzeros, scales = random_awq(128, 48, 64, seed=7)
    x = torch.randn(128, 9, device=DEVICE).t()  # [9, 128], non-contiguous
    ref = awq_gemm_reference(x, qweight, qzeros, scales, 64, dtype=torch.float64)
    for block in [(16, 16, 16), (32, 64, 64)]:
        assert rel_err(awq_gemm(x, qweight, qzeros, scales, 64, block=block), ref) <= 1e-5


def test_awq_gemm_bad_shapes():
    qweight, qzeros, scales = random_awq(96, 40, 32)
    with pytest.raises(ValueError, match="K=64"):
        awq_gemm(torch.randn(2, 64, device=DEVICE), qweight, qzeros, scales, 32)
    with pytest.raises(ValueError, match="group_size 64"):
        awq_gemm(torch.randn(2, 96, device=DEVICE), qweight, qzeros, scales, 64)
    assert awq_gemm(torch.randn(0, 96, device=DEVICE), qweight, qzeros, scales, 32).shape == (0, 40)
