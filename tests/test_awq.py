"""AWQ int4 weights (kvboost/models/awq.py): AutoAWQ's GEMM packing, the int4 linear, AWQ folders through
load_model_and_tokenizer, the fingerprint, bad inputs, and (when autoawq is installed) the packing against
autoawq's own ``WQLinear_GEMM``."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kvboost_testkit.tiny import VOCAB, tiny_model

from kvboost.models.awq import (
    AWQ_ORDER,
    AWQConfig,
    AWQLinear,
    awq_config_of,
    default_quantized_linears,
    dequantize_awq,
    dequantize_model,
    pack_awq,
    pack_int4,
    quantize_model_rtn,
    rtn_quantize,
    save_awq_folder,
    unpack_awq,
    unpack_int4,
)
from kvboost.models.fingerprint import ModelFingerprint
from kvboost.models.loading import load_model_and_tokenizer


@pytest.fixture(params=["int4pack", "dequant"])
def cpu_kernel(request, monkeypatch):
    monkeypatch.setattr(AWQLinear, "cpu_kernel", request.param)
    return request.param


def random_codes(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------- packing
def test_nibble_order_hand_built():
    # Codes 0..7 in columns 0..7: AutoAWQ puts column AWQ_ORDER[k] = [0, 2, 4, 6, 1, 3, 5, 7][k] in nibble k.
    codes = torch.arange(8, dtype=torch.int32).view(1, 8)
    assert AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    assert pack_int4(codes).item() == 0x75316420
    # The top nibble set: an int32 with the sign bit (column 7 -> nibble 7, bits 28..31).
    codes = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 15, 1, 0, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert packed[0, 0].item() == 0xF0000000 - 2**32 and packed[0, 1].item() == 1
    # Column 1 lives in nibble 4 (bits 16..19).
    assert pack_int4(torch.tensor([[0, 9, 0, 0, 0, 0, 0, 0]], dtype=torch.int32)).item() == 9 << 16
    assert torch.equal(unpack_int4(packed), codes)


def test_pack_unpack_round_trip_is_exact():
    codes = random_codes(64, 48)
    assert torch.equal(unpack_int4(pack_int4(codes)), codes)


@pytest.mark.parametrize("group", [16, 32, 64])
def test_rtn_pack_unpack_equals_rtn_dequantized(group):
    torch.manual_seed(0)
    w = torch.randn(40, 128) * 0.05
    w[3, :] = w[3, :].abs() * 3  # a lopsided row: zero points away from the middle...
    w[3, ::8] = -0.01  # ...but every group spans 0 (AutoAWQ clamps the zero point to [0, 15], as this RTN does)
    codes, zeros, scales = rtn_quantize(w, group)
    assert codes.shape == (128, 40) and zeros.shape == scales.shape == (128 // group, 40)
    assert scales.dtype == torch.float16 and int(codes.min()) >= 0 and int(codes.max()) <= 15
    expected = ((codes - zeros.repeat_interleave(group, 0)).float() * scales.float().repeat_interleave(group, 0)).t()
    t = pack_awq(codes, zeros, scales)
    assert t["qweight"].shape == (128, 5) and t["qzeros"].shape == (128 // group, 5)
    q2, z2 = unpack_awq(t["qweight"], t["qzeros"])
    assert torch.equal(q2, codes) and torch.equal(z2, zeros)
    assert torch.equal(dequantize_awq(t["qweight"], t["qzeros"], t["scales"]), expected)
    # RTN: every weight within half a step of its group's grid (plus fp16 rounding of the scale).
    step = scales.float().repeat_interleave(group, 0).t()
    assert ((expected - w).abs() <= step * 0.52 + 1e-6).all()


# ---------------------------------------------------------------------------------------------- AWQLinear
@pytest.mark.parametrize("in_f,out_f,group,bias", [(128, 64, 32, True), (192, 48, 64, False), (64, 24, 16, True)])
def test_awq_linear_forward_equals_f_linear(cpu_kernel, in_f, out_f, group, bias):
    torch.manual_seed(1)
    linear = torch.nn.Linear(in_f, out_f, bias=bias)
    module = AWQLinear.from_linear(linear, group)
    assert {n for n, _ in module.named_buffers()} == {"qweight", "qzeros", "scales", *(["bias"] if bias else [])}
    assert list(module.parameters()) == []
    x = torch.randn(2, 7, in_f)
    w = module.dequantized_weight()
    b = module.bias.float() if bias else None
    torch.testing.assert_close(module(x), F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    for dtype in (torch.bfloat16, torch.float16):  # other activation dtypes: same result within their precision
        out = module(x.to(dtype))
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), F.linear(x, w, b), atol=5e-2, rtol=5e-2)


def test_awq_linear_int4pack_cache_follows_buffer_edits(monkeypatch):
    monkeypatch.setattr(AWQLinear, "cpu_kernel", "int4pack")
    torch.manual_seed(2)
    module = AWQLinear.from_linear(torch.nn.Linear(64, 32), 32)
    x = torch.randn(3, 64)
    module(x)
    with torch.no_grad():
        module.qweight.copy_(pack_int4(random_codes(64, 32, seed=5)))  # in place: the derived form is rebuilt
    torch.testing.assert_close(
        module(x), F.linear(x, module.dequantized_weight(), module.bias.float()), atol=1e-5, rtol=1e-5
    )
    assert "_int4pack" not in dict(module.named_buffers()) and len(module.state_dict()) == 4


# ---------------------------------------------------------------------------------------------- folders
def _save_fast_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(folder))


def _awq_folder(tmp_path: Path, *, group: int = 32, tie: bool = False, skip: list[str] | None = None):
    model = tiny_model("llama", tie_word_embeddings=tie)
    float_model = copy.deepcopy(model)
    config = AWQConfig(group_size=group, modules_to_not_convert=skip or [])
    names = quantize_model_rtn(model, config)
    folder = save_awq_folder(model, tmp_path / "awq")
    _save_fast_tokenizer(folder)
    return folder, model, float_model, names


@pytest.mark.parametrize("tie", [False, True])
def test_awq_folder_loads_with_same_logits_as_dequantized(tmp_path, cpu_kernel, tie):
    folder, model, _, names = _awq_folder(tmp_path, tie=tie)
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "awq" and qc["version"] == "gemm" and qc["bits"] == 4 and qc["group_size"] == 32
    loaded, tokenizer, path = load_model_and_tokenizer(folder, dtype="float32", device="cpu")
    assert path == str(folder) and tokenizer is not None
    assert sorted(n for n, m in loaded.named_modules() if isinstance(m, AWQLinear)) == sorted(names)
    assert loaded.model.layers[0].self_attn.q_proj.qweight.dtype == torch.int32
    reference = dequantize_model(copy.deepcopy(loaded))
    ids = torch.randint(3, VOCAB, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want, original = loaded(ids).logits, reference(ids).logits, model(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, original, atol=1e-4, rtol=1e-4)
    if tie:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_modules_to_not_convert_stay_float(tmp_path):
    folder, _, float_model, names = _awq_folder(tmp_path, skip=["down_proj"])
    assert names and not any("down_proj" in n for n in names)
    loaded, _, _ = load_model_and_tokenizer(folder, dtype="float32", device="cpu")
    down = loaded.model.layers[0].mlp.down_proj
    assert isinstance(down, torch.nn.Linear)
    torch.testing.assert_close(down.weight, float_model.model.layers[0].mlp.down_proj.weight)
    assert isinstance(loaded.model.layers[0].mlp.up_proj, AWQLinear)


def test_state_dict_names_equal_checkpoint_names(tmp_path):
    from safetensors import safe_open

    folder, _, _, _ = _awq_folder(tmp_path)
    loaded, _, _ = load_model_and_tokenizer(folder, dtype="float32", device="cpu")
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert set(loaded.state_dict()) == stored
    module = loaded.model.layers[1].mlp.gate_proj
    assert set(module.state_dict()) == {"qweight", "qzeros", "scales"}


def test_fingerprint_covers_awq(tmp_path):
    folder, _, float_model, _ = _awq_folder(tmp_path)
    loaded, _, _ = load_model_and_tokenizer(folder, dtype="float32", device="cpu")
    fp_float = ModelFingerprint(float_model, "same-id", disk_cache=False)
    fp_awq = ModelFingerprint(loaded, "same-id", disk_cache=False)
    assert fp_float.current() != fp_awq.current()
    assert fp_awq.describe()["quantization"]["quant_method"] == "awq"
    before = fp_awq.current()
    with torch.no_grad():  # an in-place edit of an int buffer changes the weights digest
        loaded.model.layers[0].self_attn.q_proj.qweight[0, 0] ^= 1
    assert fp_awq.current() != before
    # A fresh load of the folder: the fingerprint from before the edit (deterministic, digest of the int buffers).
    other, _, _ = load_model_and_tokenizer(folder, dtype="float32", device="cpu")
    assert ModelFingerprint(other, "same-id", disk_cache=False).current() == before


# ---------------------------------------------------------------------------------------------- bad inputs
def test_bad_inputs_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="not divisible by group_size"):
        AWQLinear(100, 64, group_size=64)
    with pytest.raises(ValueError, match="not divisible by 8"):
        AWQLinear(64, 20, group_size=32)
    with pytest.raises(ValueError, match="not divisible by group_size"):
        rtn_quantize(torch.randn(16, 96), 64)
    with pytest.raises(ValueError, match="only 4-bit"):
        AWQConfig.from_dict({"quant_method": "awq", "bits": 8, "group_size": 128, "version": "gemm"})
    with pytest.raises(ValueError, match="only 4-bit"):
        AWQLinear(64, 64, w_bit=3)
    with pytest.raises(ValueError, match="'gemm'"):
        AWQConfig.from_dict({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"})
    with pytest.raises(ValueError, match="zero_point"):
        AWQConfig(zero_point=False)
    with pytest.raises(ValueError, match="codes must lie"):
        pack_int4(torch.full((1, 8), 16, dtype=torch.int32))
    assert awq_config_of({"quantization_config": {"quant_method": "gptq"}}) is None

    from safetensors.torch import load_file, save_file

    folder, _, _, _ = _awq_folder(tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    missing = dict(tensors)
    del missing["model.layers.1.mlp.up_proj.qzeros"]
    save_file(missing, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.qzeros"):
        load_model_and_tokenizer(folder, dtype="float32", device="cpu")
    bad = dict(tensors)
    bad["model.layers.0.self_attn.q_proj.scales"] = bad["model.layers.0.self_attn.q_proj.scales"][:1]
    save_file(bad, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="has shape"):
        load_model_and_tokenizer(folder, dtype="float32", device="cpu")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"]["version"] = "gemv"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'gemm'"):
        load_model_and_tokenizer(folder, dtype="float32", device="cpu")


def test_default_quantized_linears_skip_head_and_listed():
    model = tiny_model("llama")
    names = default_quantized_linears(model, AWQConfig(group_size=32, modules_to_not_convert=["o_proj"]))
    assert "lm_head" not in names and not any("o_proj" in n for n in names)
    assert len(names) == model.config.num_hidden_layers * 6


# ---------------------------------------------------------------------------------------------- against autoawq
def test_packing_matches_autoawq_wqlinear_gemm():
    """Once against autoawq's own packer (``WQLinear_GEMM.from_linear``) and unpacker (``dequantize_gemm``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gemm = pytest.importorskip("awq.modules.linear.gemm")
        packing = pytest.importorskip("awq.utils.packing_utils")
    group, in_f, out_f = 32, 96, 64
    codes, zeros = random_codes(in_f, out_f, seed=3), random_codes(in_f // group, out_f, seed=4)
    scales = (torch.rand(in_f // group, out_f, generator=torch.Generator().manual_seed(5)) * 0.02 + 1e-3).half()
    ours = pack_awq(codes, zeros, scales)
    weight = dequantize_awq(ours["qweight"], ours["qzeros"], ours["scales"])  # [out, in], exactly on the grid
    linear = torch.nn.Linear(in_f, out_f, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight)
    theirs = gemm.WQLinear_GEMM.from_linear(linear, 4, group, scales=scales.float(), zeros=zeros.float())
    assert torch.equal(theirs.qweight, ours["qweight"]) and torch.equal(theirs.qzeros, ours["qzeros"])
    deq = packing.dequantize_gemm(ours["qweight"], ours["qzeros"], ours["scales"], 4, group)  # fp16, [in, out]
    torch.testing.assert_close(deq.float(), weight.t(), atol=1e-3, rtol=1e-3)


def test_to_dtype_keeps_stored_buffers():
    torch.manual_seed(3)
    module = AWQLinear.from_linear(torch.nn.Linear(64, 32), 32)
    scales = module.scales.clone()
    module.to(torch.bfloat16)
    assert module.scales.dtype == torch.float16 and torch.equal(module.scales, scales)
    assert module.bias.dtype == torch.float16 and module.qweight.dtype == torch.int32
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert module(x).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("dtype", "rows", "expect_int4pack"),
    [(torch.float32, 1, True), (torch.float32, 8, False), (torch.bfloat16, 1, True), (torch.bfloat16, 64, True)],
)
def test_auto_kernel_avoids_int4pack_for_fp32_prefill(monkeypatch, dtype, rows, expect_int4pack):
    """``auto`` sends fp32 calls of more than INT4PACK_FP32_MAX_ROWS rows to dequantize + F.linear (torch's int4
    CPU kernel is slow there); bf16 always takes the int4 kernel; both agree with the dequantized weight."""
    monkeypatch.setattr(AWQLinear, "cpu_kernel", "auto")
    torch.manual_seed(0)
    module = AWQLinear.from_linear(torch.nn.Linear(64, 32, bias=False), 32)
    calls = []
    real = AWQLinear._int4pack_forward
    monkeypatch.setattr(AWQLinear, "_int4pack_forward", lambda self, x: calls.append(x.shape) or real(self, x))
    x = torch.randn(rows, 64).to(dtype)
    out = module(x)
    assert bool(calls) == expect_int4pack
    ref = F.linear(x.float(), module.dequantized_weight(torch.float32))
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_int4pack_equals_its_members_to_the_bit(dtype):
    from kvboost.env import has_amx

    """q/k/v (mixed biases) fused into one int4 matrix: one call gives each member's output to the bit, and each
    member then computes from its rows of the fused matrix."""
    from kvboost.models.awq import fuse_int4pack, fused_int4pack_unsupported

    torch.manual_seed(0)
    # 128 rows first (a whole number of packing blocks: shared rows), then two members off a block boundary
    shapes = ((128, True), (32, False), (32, True))
    members = [AWQLinear.from_linear(torch.nn.Linear(128, n, bias=b), 32) for n, b in shapes]
    x = torch.randn(3, 128).to(dtype)
    alone = [m(x) for m in members]
    assert fused_int4pack_unsupported(members, dtype) is None
    pack = fuse_int4pack(members, dtype)
    assert pack.splits == (128, 32, 32) and pack.weight.shape[0] == 192
    fused = torch.ops.aten._weight_int4pack_mm_for_cpu(x, pack.weight, pack.group_size, pack.scale_zero) + pack.bias
    for got, want in zip(fused.split(pack.splits, dim=-1), alone, strict=True):
        if dtype == torch.float32 and not has_amx():
            # Without AMX (AMD Zen 4) torch's fp32 int4 kernel blocks its sums by the output width: the fused
            # product differs from the members' in the last bits (2e-7 to 4e-7 measured), no more.
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got, want)
    shared = []
    for m, want in zip(members, alone, strict=True):  # now reading their rows of the fused matrix where valid
        assert torch.equal(m(x), want)
        shared.append(m.int4pack(dtype)[0].untyped_storage().data_ptr() == pack.weight.untyped_storage().data_ptr())
    assert shared[0]


def test_fused_int4pack_refuses_what_it_cannot_fuse(monkeypatch):
    from kvboost.models.awq import fuse_int4pack, fused_int4pack_unsupported

    a = AWQLinear.from_linear(torch.nn.Linear(128, 32), 32)
    narrower = AWQLinear.from_linear(torch.nn.Linear(64, 32), 32)
    assert "input sizes" in fused_int4pack_unsupported([a, narrower], torch.float32)
    assert "AWQ" in fused_int4pack_unsupported([a, torch.nn.Linear(128, 32)], torch.float32)
    monkeypatch.setattr(AWQLinear, "cpu_kernel", "dequant")
    with pytest.raises(ValueError, match="int4 CPU kernel"):
        fuse_int4pack([a], torch.bfloat16)
