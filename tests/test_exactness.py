"""Issue 61, "keys and promises that match the kernels": what exact reuse gives on the CPU's default path for a GGUF
model (the 4-bit step for prompt rows and decode rows), held on the machine the suite runs on.

The promise (kvboost.quality.reuse_is_bit_exact / exactness_promise): reuse is bit-equal to the same engine's cold
prefill, rows the decode step generated included, on every build of the kernels this CPU runs. It holds on every CPU
kind because nothing in the step depends on the CPU beyond the build's lane count (no MKL call: the paged attention
runs every tile on its row-invariant path), and each build is checked here on the machine that runs it; the builds
a CPU cannot run are skipped with the reason. Before the row-invariant attention (prompt tiles of more than 48 rows
took MKL's GEMMs) the tiny model's reuse differed from cold by ~1e-5 in the logits and SmolLM2's by 6-8e-3
(experiments/results/exactness/).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T
from kvboost_testkit.tiny import ToyTokenizer, random_ids, tiny_model, write_gguf

from kvboost.quality import reuse_is_bit_exact, reuse_logit_bound
from kvboost.runtime import quant_step


def _runnable_builds() -> list:
    """Every build of the kernels, those this CPU cannot run (or where the extension cannot be built) skipped."""
    params = []
    for isa in quant_step.QUANT_ISAS:
        reason = quant_step.extension_unavailable_reason() or quant_step.isa_unavailable_reason(isa)
        marks = [pytest.mark.skip(reason=f"{isa}: {reason}")] if reason else []
        params.append(pytest.param(isa, marks=marks, id=isa))
    return params


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory):
    """A tiny random llama whose dense weights are a GGUF file's Q4_1 blocks (Q8_0 head), long enough a context
    that a row attends across the paged kernel's key splits (512 keys)."""
    model = tiny_model("llama", seed=3, num_hidden_layers=3, max_position_embeddings=2048)
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    write_gguf(model, path, "llama", {"output.weight": T.Q8_0})
    model._kvboost_gguf_file = str(path)
    return model


def _engine(model, **options):
    from kvboost import KVBoost

    options.setdefault("chunker", {"name": "fixed", "chunk_size": 16})
    return KVBoost(model, ToyTokenizer(), model_identity="tiny-gguf", share_model=True, **options)


def _same_bits(reuse, cold) -> None:
    assert reuse.output_ids == cold.output_ids
    diff = (reuse.first_token_logits - cold.first_token_logits).abs().max().item()
    assert torch.equal(reuse.first_token_logits, cold.first_token_logits), f"max |logit diff| {diff:.3e}"


@pytest.mark.parametrize("act", ["int16", "fp32"])
@pytest.mark.parametrize("isa", _runnable_builds())
def test_reuse_equals_cold_to_the_bit_on_the_4bit_step(gguf_llama, tmp_path, monkeypatch, isa, act):
    """A pinned prefix then a longer prompt (a suffix prefill over the pinned rows, across the 512-key split), a
    restart over a disk tier, and a second turn over the rows the decode step generated: each reuse gives the
    first-token logits of the same engine's cold prefill bit for bit and its greedy tokens."""
    monkeypatch.setenv(quant_step.QUANT_ISA_ENV, isa)
    cache = [{"name": "memory"}, {"name": "disk", "path": str(tmp_path / "disk"), "capacity": "1GiB"}]
    engine = _engine(gguf_llama, cache=cache, decode_activations=act)
    info = engine.decode_info()
    assert (info["decode"], info["prefill"], info["quantized"]["isa"]) == ("quantized", "quantized", isa)
    assert reuse_is_bit_exact(engine) and reuse_logit_bound(engine) == 0.0
    ids = random_ids(600, seed=7)
    engine.warm(ids[:530], pin=True)
    reuse = engine.generate(ids, 6)
    cold = engine.generate(ids, 6, mode="cold")
    assert reuse.cached_tokens >= 528  # whole chunks of the pinned prefix
    _same_bits(reuse, cold)
    engine.close()  # the pool's entries spill to disk

    engine = _engine(gguf_llama, cache=cache, decode_activations=act)
    turn2 = ids + reuse.output_ids + random_ids(40, seed=8)
    again = engine.generate(turn2, 6)
    assert again.cached_tokens >= 592  # the prompt and answer of turn 1, from disk (the answer: decode-step rows)
    _same_bits(again, engine.generate(turn2, 6, mode="cold"))
    report = engine.verify_correctness(max_new_tokens=4)
    assert report.bit_exact and report.passed, str(report)
    assert all(c.max_abs_logit_diff == 0.0 for c in report.checks)
    engine.close()


def test_a_bf16_model_on_the_4bit_step_reuses_to_the_bit(gguf_llama, tmp_path):
    """bf16 (the default dtype on a CPU with AVX-512 BF16 but no AMX, whose prompt rows then run on the 4-bit step;
    asked for here with prefill="quantized" on any CPU): the K/V pool is bf16 and the same row-invariant
    arithmetic gives reuse cold's bits."""
    model = tiny_model("llama", seed=3, num_hidden_layers=3, max_position_embeddings=2048)
    model.load_state_dict(gguf_llama.state_dict())
    model = model.to(torch.bfloat16)
    model._kvboost_gguf_file = gguf_llama._kvboost_gguf_file
    engine = _engine(model, prefill="quantized")
    assert engine.decode_info()["prefill"] == "quantized" and reuse_is_bit_exact(engine)
    ids = random_ids(300, seed=9)
    engine.warm(ids[:200])
    reuse = engine.generate(ids, 6)
    assert reuse.cached_tokens >= 192
    _same_bits(reuse, engine.generate(ids, 6, mode="cold"))
    engine.close()


def test_only_the_4bit_step_for_every_row_promises_bit_equal_reuse(gguf_llama):
    """Where prompt rows stay on the dense weights (prefill=fused: MKL's GEMMs round by the call's shape) or split
    by length (quantized_short), or the KV quantizer is lossy, reuse is not promised bit-equal; the promise and
    verify_correctness say which bound holds instead."""
    from kvboost.quality import INT16_DECODE_LOGIT_DRIFT, INT16_PREFILL_LOGIT_DRIFT, exactness_promise

    expected = {
        ("quantized", "none"): (True, 0.0),
        ("fused", "none"): (False, 1e-4),
        ("quantized_short", "none"): (False, INT16_PREFILL_LOGIT_DRIFT),
        ("quantized", "kivi8"): (False, INT16_PREFILL_LOGIT_DRIFT),
    }
    for (prefill, quant), (exact, bound) in expected.items():
        engine = _engine(gguf_llama, prefill=prefill, quant=quant)
        assert reuse_is_bit_exact(engine) is exact, (prefill, quant)
        assert reuse_logit_bound(engine) == bound, (prefill, quant)
        why = exactness_promise(engine)[1]
        assert ("bit-equal" in why) is exact, why
        if prefill == "fused":
            assert reuse_logit_bound(engine, over_generated_rows=True) == INT16_DECODE_LOGIT_DRIFT
        engine.close()


def test_the_cpu_kernels_that_set_stored_bits_are_in_the_cache_key(gguf_llama, monkeypatch):
    """Rows from torch's dense CPU kernels (MKL / oneDNN GEMMs, at::vec lanes) are keyed by the CPU's capability, AMX
    and vendor (two CPU kinds sharing a disk or Redis tier must not share them); the 4-bit step for every row is keyed
    by its build's lanes alone (quant-lanes=...), which no dense tag changes."""
    import kvboost.runtime.config as config
    from kvboost.runtime.config import dense_cpu_tag

    assert dense_cpu_tag().split("/")[0] in ("AVX512", "AVX512+amx", "AVX2", "AVX2+amx", "DEFAULT", "DEFAULT+amx")
    dense, stepped = _engine(gguf_llama, prefill="fused"), _engine(gguf_llama, prefill="quantized")
    before = dense.fingerprint, stepped.fingerprint
    assert f"cpu={dense_cpu_tag()}" in before[0] and "cpu=" not in before[1]
    assert f"quant-lanes={quant_step.ISA_CAPABILITY[quant_step.quant_isa()]}" in before[1]
    monkeypatch.setattr(config, "dense_cpu_tag", lambda: "AVX2/AuthenticAMD")
    assert dense.fingerprint != before[0] and stepped.fingerprint == before[1]
    dense.close()
    stepped.close()


def test_the_paged_kernels_row_invariant_mode_gives_a_row_the_same_bits_however_the_queries_are_split():
    """paged_forward(row_invariant=True) (the 4-bit step's call): a prompt's queries attended in one call or in
    pieces (a reuse's suffix, decode rows) give every row the same bits, across the 512-key split and for tiles that
    would otherwise take MKL's GEMM path (G x tile > 48 rows); the default mode's GEMM tiles round by the shape."""
    from kvboost.attention.cpu_ext import cpu_extension_unavailable_reason, load_cpu_extension

    reason = cpu_extension_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    ext = load_cpu_extension()
    gen = torch.Generator().manual_seed(0)
    hq, hkv, dim, block, n = 6, 2, 32, 16, 1100
    k = torch.randn(hkv, 4096, dim, generator=gen)
    v = torch.randn(hkv, 4096, dim, generator=gen)
    q = torch.randn(n, hq, dim, generator=gen)
    table = torch.arange(4096 // block, dtype=torch.int32)[None]

    def attend(lo: int, hi: int) -> torch.Tensor:
        out = torch.empty(hi - lo, hq, dim)
        ext.paged_forward(q[lo:hi].contiguous(), k, v, table, torch.tensor([hi], dtype=torch.int32),
                          torch.tensor([0, hi - lo], dtype=torch.int32), torch.arange(lo, hi, dtype=torch.int32),
                          block, dim**-0.5, out, 32, row_invariant=True)  # fmt: skip
        return out

    whole = attend(0, n)
    pieces = torch.cat([attend(lo, hi) for lo, hi in ((0, 19), (19, 100), (100, 530), (530, 1099), (1099, 1100))])
    assert torch.equal(whole, pieces)
    gemm = torch.empty(n, hq, dim)  # the default mode (GEMM tiles): the same attention up to fp32 rounding
    ext.paged_forward(q, k, v, table, torch.tensor([n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32),
                      torch.arange(n, dtype=torch.int32), block, dim**-0.5, gemm, 32)  # fmt: skip
    assert (whole - gemm).abs().max().item() < 1e-5
