"""scripts/quantize_awq.py: the workaround for autoawq's CPU weight aliasing, and the quality gate."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import quantize_awq


def test_cpu_returns_copies_only_inside_the_context():
    t = torch.randn(4)
    assert t.cpu() is t  # torch's behaviour, which autoawq's CPU snapshot relies on by mistake
    with quantize_awq._cpu_returns_copies():
        c = t.cpu()
        assert c is not t and torch.equal(c, t)
        c.add_(1.0)
        assert not torch.equal(c, t)
    assert t.cpu() is t


def _quantizer():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantizer_module = pytest.importorskip("awq.quantize.quantizer")
    q = object.__new__(quantizer_module.AwqQuantizer)
    q.w_bit, q.group_size, q.zero_point = 4, 32, True
    q.n_parallel_calib_samples, q.duo_scaling, q.max_chunk_memory = None, True, 1024 * 1024 * 1024
    return quantizer_module.AwqQuantizer, q


def _search(cls, q):
    """autoawq's scale search on one linear layer; returns (weight before, weight after)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=False)
    x = torch.randn(2, 8, 64) * torch.linspace(0.1, 4.0, 64)
    with torch.no_grad():
        before = linear.weight.detach().clone()
        w_mean = linear.weight.abs().mean(0)
        x_mean = x.abs().reshape(-1, 64).mean(0)
        cls._compute_best_scale(q, x, w_mean, x_mean, linear, [linear], linear(x), {})
    return before, linear.weight.detach()


def test_unpatched_autoawq_scale_search_corrupts_cpu_weights():
    """The defect the workaround exists for (if autoawq ever fixes it, this test says so)."""
    cls, q = _quantizer()
    search = getattr(cls._compute_best_scale, "__wrapped__", cls._compute_best_scale)
    original = cls._compute_best_scale
    cls._compute_best_scale = search
    try:
        before, after = _search(cls, q)
    finally:
        cls._compute_best_scale = original
    assert not torch.equal(before, after)


def test_patched_scale_search_restores_the_weights():
    cls, q = _quantizer()
    quantize_awq._patch_autoawq_scale_search()
    quantize_awq._patch_autoawq_scale_search()  # idempotent: one wrapper
    assert not getattr(cls._compute_best_scale.__wrapped__, "_kvboost_patched", False)
    before, after = _search(cls, q)
    assert torch.equal(before, after)


def test_quality_gate_refuses_a_broken_quantization(tmp_path, monkeypatch):
    """check_quality raises (and main writes nothing) when the quantized model's perplexity is far off."""
    src = quantize_awq.bundled_model_dir()
    if not (src / "config.json").is_file():
        pytest.skip("bundled model not installed")
    out = tmp_path / "rtn"

    real = quantize_awq.quantize_rtn

    def broken_rtn(src, out, group_size):
        info = real(src, out, group_size)
        from safetensors.torch import load_file, save_file

        path = next(out.glob("*.safetensors"))
        tensors = load_file(path)
        for name in tensors:
            if name.endswith("input_layernorm.weight"):
                tensors[name] = tensors[name] * 8.0  # what the aliasing bug does to a block, roughly
        save_file(tensors, path, metadata={"format": "pt"})
        return info

    monkeypatch.setattr(quantize_awq, "quantize_rtn", broken_rtn)
    with pytest.raises(RuntimeError, match="perplexity is .* the source's"):
        quantize_awq.main(["--method", "rtn", "--output", str(out)])
    assert not out.exists() and not list(tmp_path.iterdir())
