"""The fused decoder-layer kernels (``kvboost.kernels_triton.decoder_ops``) against the torch ops the unfused layer runs
(``kvboost.runtime.ops`` and ``F.silu``).

What each platform guarantees, and so what is asserted:
- fp32, anywhere: within 1e-6 relative (the sum of squares is added in another order, and a GPU may contract a
  product and a sum into one FMA);
- bf16, on a GPU and under the CPU interpreter: RoPE, the K/V write and the residual add round where torch's ops
  round (the kernels round by integer arithmetic on the bits, which neither the compiler nor the interpreter's
  truncating cast changes), so they are bit-equal; the RMSNorm (its sum's order) and SiLU (Triton's exp against
  torch's expf) may differ by a rounding: within 2^-6 of ``|want| + 1``.
"""

import pytest
import torch
import torch.nn.functional as F

from kvboost.kernels_triton.decoder_ops import add_rms_norm, rope_write_kv, silu_mul
from kvboost.runtime.ops import apply_rope, rms_norm, rope_tables

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = (torch.float32, torch.bfloat16)


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, *, exact: bool) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if dtype == torch.bfloat16 and exact:
        assert torch.equal(got, want), (got.float() - want.float()).abs().max()
        return
    # A sum of rounded terms may cancel, so the bound is on |got - want| / (|want| + 1) (the data are O(1)): a
    # few roundings of bf16 (2^-8 relative each) for bf16, a few fp32 ulps for fp32. A wrong formula is off by O(1).
    bound = 1e-6 if dtype == torch.float32 else 2**-6
    err = ((got.float() - want.float()).abs() / (want.float().abs() + 1)).max().item()
    assert err <= bound, err


def randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 1000])  # a power-of-two-free width: the masked tail of the row
def test_add_rms_norm_is_the_residual_add_then_rms_norm(dtype, hidden):
    x, d, w = (
        randn(5, hidden, dtype=dtype, seed=0),
        randn(5, hidden, dtype=dtype, seed=1),
        randn(hidden, dtype=dtype, seed=2),
    )
    h, out = add_rms_norm(x, d, w, 1e-6)
    close(h, x + d, dtype, exact=True)
    close(out, rms_norm(x + d, w, 1e-6), dtype, exact=False)
    same, out = add_rms_norm(x, None, w, 1e-6)  # the first layer: no residual to add
    assert same is x
    close(out, rms_norm(x, w, 1e-6), dtype, exact=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (3, 1, 24)])  # GQA; a non-power-of-two half
def test_rope_write_kv_rotates_q_and_k_and_writes_k_v_at_the_slots(dtype, heads, kv_heads, head_dim):
    t = 4
    qkv = randn(t, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=3)
    positions = torch.tensor([0, 5, 300, 17], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    cos, sin = rope_tables(positions, inv_freq, 1.0, dtype)
    keys = torch.full((kv_heads, 64, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    values = keys.clone()
    slots = torch.tensor([3, 40, 9, 63], device=DEVICE)
    before = keys.clone(), values.clone()
    q = rope_write_kv(qkv, cos, sin, keys, values, slots, heads, kv_heads, head_dim)
    wq, wk, wv = qkv.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    close(q, apply_rope(wq.reshape(t, heads, head_dim), cos, sin), dtype, exact=True)
    close(keys[:, slots].transpose(0, 1), apply_rope(wk.reshape(t, kv_heads, head_dim), cos, sin), dtype, exact=True)
    assert torch.equal(values[:, slots].transpose(0, 1), wv.reshape(t, kv_heads, head_dim))  # v is copied as is
    untouched = torch.ones(64, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    for now, then in zip((keys, values), before, strict=True):  # no other slot written (NaN stays NaN)
        assert now[:, untouched].isnan().all() and then[:, untouched].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [200, 2500])  # one block, and several blocks with a tail
def test_silu_mul_is_silu_of_gate_times_up(dtype, width):
    gu = randn(3, 2 * width, dtype=dtype, seed=4) * 4
    out = silu_mul(gu)
    want = F.silu(gu[:, :width]) * gu[:, width:]
    if dtype == torch.float32:
        close(out, want, dtype, exact=False)
    else:  # the exponential's last bit may differ (Triton's exp against torch's expf): a bf16 rounding apart
        close(out, want, dtype, exact=False)


def test_bad_inputs_are_refused_with_the_shape_expected():
    x = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must be a contiguous \\[8\\]"):
        add_rms_norm(x, None, torch.zeros(7, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="does not match"):
        add_rms_norm(x, torch.zeros(3, 8, device=DEVICE), torch.zeros(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="contiguous rows"):
        add_rms_norm(x.t(), None, torch.zeros(2, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="columns"):
        rope_write_kv(torch.zeros(2, 40, device=DEVICE), torch.zeros(2, 8, device=DEVICE),
                      torch.zeros(2, 8, device=DEVICE), torch.zeros(1, 4, 8, device=DEVICE),
                      torch.zeros(1, 4, 8, device=DEVICE), torch.zeros(2, dtype=torch.long, device=DEVICE), 2, 1, 8)  # fmt: skip
    with pytest.raises(ValueError, match="even number"):
        silu_mul(torch.zeros(2, 7, device=DEVICE))
