"""``decode="quantized"`` (kvboost.runtime.quant_step, kvboost/csrc/cpu_quant.cpp): the CPU decode step multiplied from a GGUF
model's own 4-bit blocks. The kernels against float64 references (fp32 activations) and against an emulation of
their integer arithmetic (int8 activations); the step on tiny GGUF files written here (llama: permuted q/k rows;
qwen2: q/k/v biases) against HF's own decode; the path choice, its refusals and the cache fingerprint; the bundled
SmolLM2 (integration)."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize
from kvboost_testkit.tiny import ToyTokenizer, hf_greedy_reference, random_ids, tiny_model, write_gguf

from kvboost.models.gguf_int4 import unpack_q4_scale_min
from kvboost.runtime.quant_step import Q4Weight, Q8Weight, extension_unavailable_reason, q8_0_blocks

pytestmark = pytest.mark.skipif(extension_unavailable_reason() is not None, reason=str(extension_unavailable_reason()))


@pytest.fixture(scope="module")
def ext():
    from kvboost.runtime.quant_step import load_quant_extension

    return load_quant_extension()


def _q4(n: int, k: int, seed: int = 0, bias: bool = False, wide_for: str | None = None) -> Q4Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.02
    minv = -torch.rand(n, k // 32, generator=g) * 0.1
    return Q4Weight(q, scale, minv, torch.randn(n, generator=g) if bias else None, wide_for=wide_for)


def _rounded_rows(x: torch.Tensor, qmax: int) -> torch.Tensor:
    """What the int8 / int16 paths multiply: each row's 32-value groups rounded to codes with scale max|x| / qmax
    (fp32 arithmetic, ties to even as nearbyint), back in fp64."""
    m, k = x.shape
    g = x.float().reshape(m, -1, 32)
    d = g.abs().amax(-1, keepdim=True) / qmax
    q = torch.round(g * torch.where(d > 0, 1 / d, 0))
    return (q.double() * d.double()).reshape(m, k)


# ---------------------------------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 9, 13])
def test_q4_product_fp32_activations_is_the_dense_product(ext, rows):
    """Every row tile (blocks of 4 rows, 8 in the VNNI build, and every remainder) and the bias: within fp32
    rounding of the float64 product of the dequantized weight."""
    w = _q4(72, 96, seed=rows, bias=True)
    x = torch.randn(rows, 96)
    ref = x.double() @ w.dequantized().double().T + w.bias.double()
    out = ext.q4_matmul(x, w.codes, w.scale, w.minv, w.bias, ACT["fp32"])
    assert out.shape == (rows, 72)
    assert (out.double() - ref).abs().max() < 1e-5 * max(1.0, ref.abs().max().item())


ACT = {"fp32": 0, "int8": 1, "int16": 2}  # the extension's activation codes (kvboost.runtime.quant_step)


@pytest.mark.parametrize("act, qmax, off", [("int8", 127, 1e-3), ("int16", 32767, 1e-6)])
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_integer_activations_are_the_rounded_rows_times_the_weight(ext, rows, act, qmax, off):
    """int8 / int16 activations: the codes' part is the rounded rows times (w - min) exactly (integer products),
    the min part uses the exact fp32 group sums; off the fp32 product by the rounding (the test sees which path
    ran), int16's rounding ~300x finer than int8's."""
    w = _q4(56, 128, seed=10 + rows, bias=True)
    x = torch.randn(rows, 128)
    dense = w.dequantized().double()
    mins = w.group_params()[1].double().repeat_interleave(32, 1)
    ref = _rounded_rows(x, qmax) @ (dense - mins).T + x.double() @ mins.T + w.bias.double()
    out = ext.q4_matmul(x, w.codes, w.scale, w.minv, w.bias, ACT[act])
    assert (out.double() - ref).abs().max() < 1e-5 * ref.abs().max().item()
    exact = x.double() @ dense.T + w.bias.double()
    assert off < (out.double() - exact).abs().max() < 300 * off


@pytest.mark.parametrize("act", ["fp32", "int8", "int16"])
def test_q8_product(ext, act):
    g = torch.Generator().manual_seed(3)
    w = Q8Weight(torch.randint(-127, 128, (40, 64), generator=g, dtype=torch.int8), torch.rand(40, 2, generator=g))
    x = torch.randn(5, 64, generator=g)
    rows = {"fp32": x.double(), "int8": _rounded_rows(x, 127), "int16": _rounded_rows(x, 32767)}[act]
    ref = rows @ w.dequantized().double().T
    out = ext.q8_matmul(x, w.codes, w.scale, ACT[act])
    assert (out.double() - ref).abs().max() < 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("act", ["fp32", "int8", "int16"])
def test_a_rows_result_does_not_depend_on_the_batch(ext, act):
    """Each row's arithmetic is the same whichever rows share its block (blocks of 4, or 8 in the VNNI build, and
    a tail): the product of 13 rows equals each row's product alone, bit for bit, for the 4-bit and the 8-bit
    kernel."""
    w = _q4(48, 160, seed=4, bias=True)
    g = torch.Generator().manual_seed(8)
    w8 = Q8Weight(torch.randint(-127, 128, (24, 160), generator=g, dtype=torch.int8), torch.rand(24, 5, generator=g))
    x = torch.randn(13, 160, generator=g)
    together = ext.q4_matmul(x, w.codes, w.scale, w.minv, w.bias, ACT[act])
    together8 = ext.q8_matmul(x, w8.codes, w8.scale, ACT[act])
    for r in range(13):
        assert torch.equal(together[r], ext.q4_matmul(x[r:r + 1], w.codes, w.scale, w.minv, w.bias, ACT[act])[0])
        assert torch.equal(together8[r], ext.q8_matmul(x[r:r + 1], w8.codes, w8.scale, ACT[act])[0])


def _build_or_skip(isa: str):
    """Build ``isa`` of the quantized kernels, or skip naming why this CPU cannot run it."""
    from kvboost.runtime.quant_step import isa_unavailable_reason, load_quant_extension

    reason = isa_unavailable_reason(isa)
    if reason is not None:
        pytest.skip(reason)
    try:
        return load_quant_extension(isa)
    except RuntimeError as exc:  # the amx build where Linux refuses the tile state
        if isa == "amx" and "AMX tiles" in str(exc):
            pytest.skip(str(exc))
        raise


SIMD_ISAS = ("avx2", "avx_vnni", "avx512_vnni", "amx")


@pytest.mark.parametrize("act", ["fp32", "int8", "int16"])
@pytest.mark.parametrize("isa", SIMD_ISAS)
def test_every_build_gives_the_scalar_builds_product_bits(isa, act):
    """The scalar build (plain C++, no SIMD intrinsics) is the bit reference: every vector build this CPU runs gives
    its bits for every row count (1 row; the tails and full passes of 4-, 8- and 16-row blocks; the amx build's tile
    passes from 16 rows), 4-bit and 8-bit weights, fp32 and fp16 group values, with a bias, and (avx512_vnni, amx)
    4-bit weights in wide tiles. Exact equality holds by construction, not by luck: each 32-value group's integer
    products are summed exactly in int32 (|code| <= 32767, |w| <= 128, 32 terms: far from overflow), and every build
    then applies the same fp32 operations in the same order (fp32 activations: the same chain of fused multiply-adds
    over k; integers: float(isum) * (scale * d) fused into the sum, then min * group_sum; bias; accumulate), with
    -ffp-contract=off so no build fuses what the source did not; the rows' rounding (max, one division,
    round-to-nearest-even) and group sums (one fixed lane order) are the same operations in both paths."""
    from kvboost.runtime.quant_step import load_quant_extension

    scalar, ext = load_quant_extension("scalar"), _build_or_skip(isa)
    assert (scalar.isa, ext.isa) == ("scalar", isa)
    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (64, 192), generator=g, dtype=torch.uint8)
    full = (torch.rand(64, 6, generator=g) * 0.02, -torch.rand(64, 6, generator=g) * 0.1)
    bias = torch.randn(64, generator=g)
    weights = [Q4Weight(q, *full, bias), Q4Weight(q, *(v.half() for v in full), bias)]
    wide = []
    if act != "fp32" and isa in ("avx512_vnni", "amx"):
        wide = [Q4Weight(q, *full, bias, wide_for=act), Q4Weight(q, *(v.half() for v in full), bias, wide_for=act)]
    q8s = [Q8Weight(torch.randint(-128, 128, (32, 192), generator=g, dtype=torch.int8), scale)
           for scale in (torch.rand(32, 6, generator=g), torch.rand(32, 6, generator=g).half())]  # fmt: skip
    assert (weights[1].scale.dtype, q8s[1].scale.dtype) == (torch.float16, torch.float16)
    for rows in (1, 2, 3, 6, 7, 8, 13, 15, 16, 17, 32, 33, 48):
        x = torch.randn(rows, 192, generator=g) * 4
        for w, ref_w in [(w, w) for w in weights] + list(zip(wide, weights)):
            ref = scalar.q4_matmul(x, ref_w.codes, ref_w.scale, ref_w.minv, ref_w.bias, ACT[act])
            assert ref.shape == (rows, 64)
            assert torch.equal(ext.q4_matmul(x, w.codes, w.scale, w.minv, w.bias, ACT[act]), ref), (rows, w.wide_for)
        for q8 in q8s:
            assert torch.equal(ext.q8_matmul(x, q8.codes, q8.scale, ACT[act]),
                               scalar.q8_matmul(x, q8.codes, q8.scale, ACT[act])), rows  # fmt: skip


@pytest.mark.parametrize("wide", [False, True])
def test_the_amx_build_runs_many_rows_on_tiles_and_few_on_vnni(wide):
    """The amx build's products run on AMX tiles from ``AMX_MIN_ROWS`` integer rows (int8 and int16, tiles of 8 and
    wide tiles, 4-bit and 8-bit weights) and on its AVX-512 VNNI kernels below that and for fp32 rows: counted by the
    extension. Their bits are the scalar build's (test_every_build_gives_the_scalar_builds_product_bits[amx-*])."""
    from kvboost.runtime.quant_step import AMX_MIN_ROWS, amx_unavailable_reason

    ext = _build_or_skip("amx")
    if amx_unavailable_reason(ext) is not None:
        pytest.skip(amx_unavailable_reason(ext))
    assert ext.amx_min_rows == AMX_MIN_ROWS
    g = torch.Generator().manual_seed(2)
    q8 = Q8Weight(torch.randint(-128, 128, (32, 128), generator=g, dtype=torch.int8), torch.rand(32, 4, generator=g))
    for act in ("int8", "int16"):
        w = _q4(64, 128, seed=1, bias=True, wide_for=act if wide else None)
        for rows, act_code, on_tiles in ((AMX_MIN_ROWS, ACT[act], 2 - wide), (AMX_MIN_ROWS - 1, ACT[act], 0),
                                         (AMX_MIN_ROWS, ACT["fp32"], 0)):  # fmt: skip
            if wide and act_code == ACT["fp32"]:
                continue
            x = torch.randn(rows, 128, generator=g)
            before = ext.amx_products()
            ext.q4_matmul(x, w.codes, w.scale, w.minv, w.bias, act_code)
            if not wide:
                ext.q8_matmul(x, q8.codes, q8.scale, act_code)
            assert ext.amx_products() - before == on_tiles, (act, rows, act_code)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="no objdump to read the builds' instructions")
@pytest.mark.parametrize("isa", ("scalar", *SIMD_ISAS))
def test_each_build_holds_only_its_own_instructions(isa):
    """A build runs on every CPU of its kind: the scalar build holds no AVX instruction (no ymm / zmm register), the
    avx2 and avx_vnni builds no AVX-512 one (no zmm; the avx2 build was compiled with AVX-512 flags on AVX-512
    machines before, so it never ran what an AVX2-only CPU runs), and only the builds with VNNI dot products hold
    vpdpwssd / vpdpbusd. Read from the built library's disassembly."""
    from kvboost.runtime.quant_step import load_quant_extension

    ext = _build_or_skip(isa) if isa != "scalar" else load_quant_extension("scalar")
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", ext.__file__], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip
    has = {"ymm": "ymm" in text, "zmm": "zmm" in text, "dot": "vpdpwssd" in text or "vpdpbusd" in text}
    expected = {"scalar": (False, False, False), "avx2": (True, False, False), "avx_vnni": (True, False, True),
                "avx512_vnni": (True, True, True), "amx": (True, True, True)}[isa]  # fmt: skip
    assert (has["ymm"], has["zmm"], has["dot"]) == expected, has


@pytest.mark.parametrize("act", ["int16", "fp32"])
def test_every_build_runs_the_scalar_builds_decode_step(tmp_path, act):
    """A whole step (a prompt chunk of three sequences, then batched decode steps) on every build this CPU runs,
    against the scalar build. Bit for bit between builds compiled for one CPU capability (avx2 / avx_vnni: AVX2;
    avx512_vnni / amx: AVX512): their products are the scalar bits (the test above), and norms, RoPE, SiLU and the
    paged attention kernel are the same code compiled for the same vector width. Across capabilities only close:
    the attention kernel's fp32 sums and torch's vectorized exp run over 8 lanes under AVX2, 16 under AVX512 and
    one at a time in the scalar build (issue 61), another summation order; that is why the build's capability is in
    the engine's cache fingerprint (test_the_kernels_capability_is_in_the_cache_fingerprint)."""
    from kvboost.kv.block_table import BlockTable
    from kvboost.runtime.batch import ForwardBatch, SeqInput
    from kvboost.runtime.quant_step import ISA_CAPABILITY, QUANT_ISAS, QuantDecodeStep, isa_unavailable_reason

    model = gguf_model(tmp_path, "qwen2", seed=4)
    engine = _engine(model, decode="quantized", decode_activations=act)
    prompts = [random_ids(n, seed=n) for n in (3, 21, 40)]
    runs = {}
    for isa in QUANT_ISAS:
        if isa_unavailable_reason(isa) is not None:
            continue
        try:
            step = QuantDecodeStep(engine.runner, act, isa=isa)
        except RuntimeError as exc:  # amx: no tile state from Linux
            assert isa == "amx" and "AMX tiles" in str(exc)
            continue
        assert step.describe()["isa"] == isa
        tables = [BlockTable(engine.pool) for _ in prompts]
        logits = [step.run(ForwardBatch.build([SeqInput(t, p) for t, p in zip(tables, prompts, strict=True)]))]
        for i in range(3):
            logits.append(step.run(ForwardBatch.build([SeqInput(t, [5 + i + j]) for j, t in enumerate(tables)])))
        keys = [engine.pool.keys[layer][:, tables[2].slots(0, 43)].clone() for layer in range(engine.pool.num_layers)]
        runs[isa] = logits + keys
        for t in tables:
            t.release()
    engine.close()
    assert "scalar" in runs
    for isa, outs in runs.items():
        same_width = [other for other in runs if other != isa and ISA_CAPABILITY[other] == ISA_CAPABILITY[isa]]
        for other in same_width:
            assert all(torch.equal(a, b) for a, b in zip(outs, runs[other], strict=True)), (isa, other)
        for a, b in zip(outs, runs["scalar"], strict=True):
            assert (a - b).abs().max() <= 1e-4 * max(1.0, b.abs().max().item()), isa


@pytest.mark.parametrize("act", ["int8", "int16"])
def test_wide_tiles_give_the_tiles_of_8_bits(act):
    """The VNNI build's wide tiles (16 features, 8 k per 512-bit load: the step's layouts for int16 rows (words) and
    int8 rows (quads) there) sum the same integers exactly and scale them with the same fp32 operations as the tiles
    of 8: the same bits for every row count (8-row passes, their tails, a prompt's many passes), fp32 and fp16 group
    values, with a bias; and each row's result is its result alone."""
    from kvboost.runtime.quant_step import load_quant_extension, vnni_unavailable_reason

    if vnni_unavailable_reason() is not None:
        pytest.skip(vnni_unavailable_reason())
    vnni = load_quant_extension("avx512_vnni")
    g = torch.Generator().manual_seed(21)
    q = torch.randint(0, 16, (48, 160), generator=g, dtype=torch.uint8)
    bias = torch.randn(48, generator=g)
    full = (torch.rand(48, 5, generator=g) * 0.02, -torch.rand(48, 5, generator=g) * 0.1)
    half = tuple(v.half() for v in full)
    for scale, minv in (full, half):
        narrow, wide = Q4Weight(q, scale, minv, bias), Q4Weight(q, scale, minv, bias, wide_for=act)
        assert wide.codes.shape == {"int8": (3, 20, 64), "int16": (3, 20, 32, 2)}[act]
        assert wide.scale.shape == (3, 5, 16) and wide.scale.dtype == scale.dtype
        assert wide.nbytes == narrow.nbytes
        assert torch.equal(wide.dequantized(), narrow.dequantized())
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 33, 70):
            x = torch.randn(rows, 160, generator=g) * 3
            ours = vnni.q4_matmul(x, wide.codes, wide.scale, wide.minv, wide.bias, ACT[act])
            assert torch.equal(ours, vnni.q4_matmul(x, narrow.codes, narrow.scale, narrow.minv, narrow.bias, ACT[act]))
            if rows in (9, 17):
                for r in range(rows):
                    alone = vnni.q4_matmul(x[r : r + 1], wide.codes, wide.scale, wide.minv, wide.bias, ACT[act])
                    assert torch.equal(ours[r], alone[0])


def test_wide_tiles_are_read_where_their_kernel_is_and_refused_elsewhere(ext):
    """A wide weight rebuilt from its tiles is the one it was built from (words and quads); out_features not a
    multiple of 16, a stack of two layouts, an unknown row kind, fp32 activations, rows of the other kind than the
    weight was packed for and the AVX2 build are refused, each naming why."""
    from kvboost.runtime.quant_step import load_quant_extension, wide_tiles_for

    g = torch.Generator().manual_seed(3)
    q = torch.randint(0, 16, (32, 64), generator=g, dtype=torch.uint8)
    scale, minv = torch.rand(32, 2, generator=g), torch.randn(32, 2, generator=g)
    dense = (q.float().reshape(32, 2, 32) * scale[..., None] + minv[..., None]).reshape(32, 64)
    words, quads = Q4Weight(q, scale, minv, wide_for="int16"), Q4Weight(q, scale, minv, wide_for="int8")
    for wide in (words, quads):
        assert torch.equal(wide.dequantized(), dense)
        assert all(torch.equal(a, b) for a, b in zip(wide.group_params(), (scale, minv), strict=True))
        assert torch.equal(Q4Weight.cat([wide, wide]).dequantized(), torch.cat([dense, dense]))
    # word 2j+i of an octet holds feature j's codes for k+2n+i in its nibble n: w[0, 0..7] in words 0 and 1
    word0 = int(words.codes[0, 0, 0, 0]) | int(words.codes[0, 0, 0, 1]) << 8
    assert [(word0 >> (4 * n)) & 15 for n in range(4)] == [int(q[0, k]) for k in (0, 2, 4, 6)]
    with pytest.raises(ValueError, match="multiple of 16"):
        Q4Weight(q[:24], scale[:24], minv[:24], wide_for="int16")
    with pytest.raises(ValueError, match="different layouts"):
        Q4Weight.cat([words, Q4Weight(q, scale, minv)])
    with pytest.raises(ValueError, match="different layouts"):
        Q4Weight.cat([words, quads])
    with pytest.raises(ValueError, match="packed for one of"):
        Q4Weight(q, scale, minv, wide_for="fp32")
    wide = words
    assert (wide_tiles_for("int16", "avx512_vnni"), wide_tiles_for("int8", "avx512_vnni")) == (True, True)
    assert not wide_tiles_for("fp32", "avx512_vnni") and not wide_tiles_for("int16", "avx2")
    x = torch.randn(2, 64, generator=g)
    if ext.isa == "avx512_vnni":
        with pytest.raises(RuntimeError, match="int8 or int16 activations"):
            ext.q4_matmul(x, wide.codes, wide.scale, wide.minv, None, ACT["fp32"])
        with pytest.raises(RuntimeError, match=r"\[N/16, K/32, 16\]"):
            ext.q4_matmul(x, wide.codes, wide.scale.reshape(32, 2), wide.minv.reshape(32, 2), None, ACT["int16"])
        with pytest.raises(RuntimeError, match=r"int8 rows are quads"):
            ext.q4_matmul(x, words.codes, words.scale, words.minv, None, ACT["int8"])
        with pytest.raises(RuntimeError, match=r"int16 rows are words"):
            ext.q4_matmul(x, quads.codes, quads.scale, quads.minv, None, ACT["int16"])
    with pytest.raises(RuntimeError, match="avx512_vnni build only"):
        load_quant_extension("avx2").q4_matmul(x, wide.codes, wide.scale, wide.minv, None, ACT["int16"])


@pytest.mark.parametrize("wide", [False, True])
def test_products_do_not_depend_on_threads_or_callers(ext, wide):
    """The products run on kvb::WorkPool (kvboost/csrc/work_pool.h: the caller and helpers claim chunks of tiles):
    the same bits with 1, 2 or 5 threads (more than this machine's cores) and from 4 Python threads at once (one job
    at a time; the others run alone); in tiles of 8 and in wide tiles (VNNI build)."""
    import threading

    if wide and ext.isa not in ("avx512_vnni", "amx"):
        pytest.skip("wide tiles are read by the avx512_vnni build only")
    w, w8 = (_q4(256, 192, seed=6, bias=True, wide_for=act if wide else None) for act in ("int16", "int8"))
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(m, 192, generator=g) for m in (1, 2, 7, 8, 33)]
    before = torch.get_num_threads()
    ext.set_decode_pool(True)  # what kvboost-server's engine loop asks for (OpenMP otherwise)
    assert ext.decode_pool() or os.environ.get("KVBOOST_QUANT_POOL") == "omp"
    try:
        torch.set_num_threads(1)
        ref = [ext.q4_matmul(x, w.codes, w.scale, w.minv, w.bias, ACT["int16"]) for x in xs]
        ref8 = [ext.q4_matmul(x, w8.codes, w8.scale, w8.minv, w8.bias, ACT["int8"]) for x in xs]
        for threads in (2, 5):  # 33 rows: prepared on every thread too
            torch.set_num_threads(threads)
            for _ in range(20):
                for x, r, r8 in zip(xs, ref, ref8):
                    assert torch.equal(ext.q4_matmul(x, w.codes, w.scale, w.minv, w.bias, ACT["int16"]), r)
                    assert torch.equal(ext.q4_matmul(x, w8.codes, w8.scale, w8.minv, w8.bias, ACT["int8"]), r8)
    finally:
        torch.set_num_threads(before)
    bad: list[int] = []

    def caller(k: int) -> None:
        for i in range(60):
            j = (i + k) % len(xs)
            if not torch.equal(ext.q4_matmul(xs[j], w.codes, w.scale, w.minv, w.bias, ACT["int16"]), ref[j]):
                bad.append(j)

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        ext.set_decode_pool(False)
    assert not bad


def test_work_pool_state_machine(ext):
    """Stateful: thread counts, row counts and concurrent callers in any order; after every step each product equals
    the one-thread reference bit for bit (the pool's claims lose or repeat no chunk, whatever ran before)."""
    import threading

    from hypothesis import settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

    w = _q4(128, 96, seed=12, bias=True)
    g = torch.Generator().manual_seed(13)
    xs = {m: torch.randn(m, 96, generator=g) for m in (1, 3, 8, 17)}
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    ref = {m: ext.q4_matmul(x, w.codes, w.scale, w.minv, w.bias, ACT["int16"]) for m, x in xs.items()}
    torch.set_num_threads(before)

    class Pool(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.results: list[tuple[int, torch.Tensor]] = []

        @rule(threads=st.integers(1, 4))
        def set_threads(self, threads):
            torch.set_num_threads(threads)

        @rule(m=st.sampled_from(sorted(xs)))
        def product(self, m):
            self.results.append((m, ext.q4_matmul(xs[m], w.codes, w.scale, w.minv, w.bias, ACT["int16"])))

        @rule(ms=st.lists(st.sampled_from(sorted(xs)), min_size=2, max_size=4))
        def concurrent_products(self, ms):
            out: list[tuple[int, torch.Tensor]] = []
            runs = [threading.Thread(target=lambda m=m: out.append(
                (m, ext.q4_matmul(xs[m], w.codes, w.scale, w.minv, w.bias, ACT["int16"])))) for m in ms]  # fmt: skip
            for t in runs:
                t.start()
            for t in runs:
                t.join()
            assert len(out) == len(ms)
            self.results.extend(out)

        @invariant()
        def every_product_is_the_reference(self):
            for m, r in self.results:
                assert torch.equal(r, ref[m])
            self.results.clear()

    ext.set_decode_pool(True)
    try:
        Pool.TestCase.settings = settings(max_examples=25, stateful_step_count=15, deadline=None)
        Pool.TestCase().runTest()
    finally:
        torch.set_num_threads(before)
        ext.set_decode_pool(False)


def test_the_decode_pool_is_off_in_process_and_on_in_the_engine_loop(tmp_path):
    """OpenMP by default (faster in a process alone); kvboost-server's engine loop turns the step's own pool on for a
    quantized decode while it runs (two loops: until both have stopped), and decode_info says which runs."""
    from kvboost.engine.loop import EngineLoop
    from kvboost.runtime.quant_step import load_quant_extension, use_decode_pool

    if os.environ.get("KVBOOST_QUANT_POOL"):
        pytest.skip("KVBOOST_QUANT_POOL forces the choice")
    ext = load_quant_extension()
    use_decode_pool(False)
    engines = [_engine(gguf_model(tmp_path, "llama"), decode="quantized") for _ in range(2)]
    assert engines[0].decode_info()["quantized"]["decode_pool"] == "openmp"
    loops = [EngineLoop(engines[0]).start()]
    try:
        assert ext.decode_pool() and engines[0].decode_info()["quantized"]["decode_pool"] == "own"
        loops.append(EngineLoop(engines[1]).start())
        loops[0].shutdown()
        assert ext.decode_pool()  # the second loop still serves
        loops[1].shutdown()
        assert not ext.decode_pool() and engines[0].decode_info()["quantized"]["decode_pool"] == "openmp"
    finally:
        for loop in loops:
            loop.shutdown()
        use_decode_pool(False)


def test_the_kernels_build_is_chosen_from_the_cpu_or_the_environment(monkeypatch):
    """``quant_isa``: $KVBOOST_QUANT_ISA when set (an unknown name, or a build whose instructions the CPU lacks, is
    refused naming why), else the widest build the CPU's flags allow (flags faked here: every CPU kind's choice)."""
    import kvboost.env
    from kvboost.runtime import quant_step

    monkeypatch.setenv(quant_step.QUANT_ISA_ENV, "scalar")
    assert quant_step.quant_isa() == "scalar" and quant_step.quant_isa_reason() == "$KVBOOST_QUANT_ISA"
    monkeypatch.setenv(quant_step.QUANT_ISA_ENV, "avx1024")
    with pytest.raises(ValueError, match="KVBOOST_QUANT_ISA='avx1024'"):
        quant_step.quant_isa()
    monkeypatch.delenv(quant_step.QUANT_ISA_ENV)
    avx2 = {"avx2", "fma", "f16c"}
    zen4 = avx2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
    for flags, expected in ((set(), "scalar"), (avx2, "avx2"), (avx2 | {"avx_vnni"}, "avx_vnni"), (zen4, "avx512_vnni"),
                            (zen4 | {"avx_vnni", "amx_tile", "amx_int8"}, "avx512_vnni")):  # fmt: skip
        monkeypatch.setattr(kvboost.env, "cpu_flags", lambda flags=flags: frozenset(flags))
        assert quant_step.quant_isa() == expected, flags
        assert quant_step.quant_isa_reason().startswith("the best build the CPU's flags allow")
    monkeypatch.setattr(kvboost.env, "cpu_flags", lambda: frozenset(avx2))
    monkeypatch.setenv(quant_step.QUANT_ISA_ENV, "avx512_vnni")
    with pytest.raises(ValueError, match="cannot run here: the CPU has no avx512f"):
        quant_step.quant_isa()
    assert "avx2: the CPU has no" not in str(quant_step.isa_unavailable_reason("avx2"))
    with pytest.raises(ValueError, match="must be one of"):
        quant_step.load_quant_extension("sse2")


def test_the_kernels_capability_is_in_the_cache_fingerprint(tmp_path, monkeypatch):
    """Two builds whose decode steps can write other K/V bits (another vector width: issue 61) give two engine
    fingerprints, for the quantized step (avx2 against avx512_vnni) and for the cpu_kernel attention backend and the
    compiled decode's attention (AVX2 against AVX512 capability); builds of one width (avx512_vnni, amx) share one,
    their bits being equal (test_every_build_runs_the_scalar_builds_decode_step)."""
    import kvboost.attention.cpu_ext as cpu_ext
    from kvboost.runtime import quant_step

    assert quant_step.quant_arithmetic_tag("avx2") != quant_step.quant_arithmetic_tag("avx512_vnni")
    assert quant_step.quant_arithmetic_tag("amx") == quant_step.quant_arithmetic_tag("avx512_vnni")
    assert quant_step.quant_arithmetic_tag("scalar") not in {quant_step.quant_arithmetic_tag(i) for i in SIMD_ISAS}
    model = gguf_model(tmp_path, "llama")
    prints = {}
    for isa in ("avx2", "avx512_vnni"):
        if quant_step.isa_unavailable_reason(isa) is None:
            monkeypatch.setenv(quant_step.QUANT_ISA_ENV, isa)
            engine = _engine(model, decode="quantized")
            assert engine.decode_info()["quantized"]["isa"] == isa
            prints[isa] = engine.fingerprint
            engine.close()
    monkeypatch.delenv(quant_step.QUANT_ISA_ENV)
    if len(prints) == 2:
        assert prints["avx2"] != prints["avx512_vnni"]
    attn = {}
    for cap in ("AVX2", "AVX512"):
        monkeypatch.setattr(cpu_ext, "cpu_capability", lambda cap=cap: cap)
        for options in ({"attn": "cpu_kernel", "decode": "eager"}, {"decode": "compiled"}):
            engine = _engine(model, **options)
            attn[cap, options.get("attn", "compiled")] = engine.fingerprint
            engine.close()
    assert attn["AVX2", "cpu_kernel"] != attn["AVX512", "cpu_kernel"]
    assert attn["AVX2", "compiled"] != attn["AVX512", "compiled"]


def test_the_tiled_layout_round_trips_and_refuses_partial_tiles():
    """The kernel's layouts hold tiles of 8 output features: a weight rebuilt from them is the one it was built from,
    and a weight whose out_features are not a multiple of 8 is refused naming the rule."""
    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (16, 64), generator=g, dtype=torch.uint8)
    scale, minv = torch.rand(16, 2, generator=g), torch.randn(16, 2, generator=g)
    dense = (q.float().reshape(16, 2, 32) * scale[..., None] + minv[..., None]).reshape(16, 64)
    assert torch.equal(Q4Weight(q, scale, minv).dequantized(), dense)
    q8 = torch.randint(-127, 128, (16, 64), generator=g, dtype=torch.int8)
    assert torch.equal(Q8Weight(q8, scale).dequantized(), (q8.float().reshape(16, 2, 32) * scale[..., None]).reshape(16, 64))
    with pytest.raises(ValueError, match="multiple of 8"):
        Q4Weight(q[:12], scale[:12], minv[:12])
    with pytest.raises(ValueError, match="multiple of 8"):
        Q8Weight(q8[:12], scale[:12])


@pytest.mark.parametrize("act", ["fp32", "int8", "int16"])
def test_fp16_group_values_give_the_fp32_bits_and_fewer_bytes(ext, act):
    """Scales and mins that are fp16 values (GGUF's Q4_0 / Q4_1 / Q8_0 blocks store them so) are kept in fp16: 20
    bytes per 32 weights of a 4-bit matrix instead of 24, 34 instead of 36 of an 8-bit one. The kernels convert them
    to fp32 exactly, so every row count of every kernel gives the bits of the same weight kept in fp32."""
    g = torch.Generator().manual_seed(11)
    q = torch.randint(0, 16, (40, 192), generator=g, dtype=torch.uint8)
    scale = (torch.rand(40, 6, generator=g) * 0.02).half().float()  # fp16 values, as a file's
    minv = (-torch.rand(40, 6, generator=g) * 0.1).half().float()
    bias = torch.randn(40, generator=g)
    half = Q4Weight(q, scale, minv, bias)
    full = Q4Weight(q, scale, minv, bias)
    full.scale, full.minv = full.scale.float(), full.minv.float()
    assert half.scale.dtype == half.minv.dtype == torch.float16
    assert half.nbytes * 24 == full.nbytes * 20
    q8 = torch.randint(-127, 128, (40, 192), generator=g, dtype=torch.int8)
    half8 = Q8Weight(q8, scale)
    full8 = Q8Weight(q8, scale)
    full8.scale = full8.scale.float()
    assert half8.scale.dtype == torch.float16 and half8.nbytes * 36 == full8.nbytes * 34
    for rows in (1, 2, 3, 8, 13):
        x = torch.randn(rows, 192, generator=g) * 3
        assert torch.equal(ext.q4_matmul(x, half.codes, half.scale, half.minv, half.bias, ACT[act]),
                           ext.q4_matmul(x, full.codes, full.scale, full.minv, full.bias, ACT[act]))  # fmt: skip
        assert torch.equal(ext.q8_matmul(x, half8.codes, half8.scale, ACT[act]),
                           ext.q8_matmul(x, full8.codes, full8.scale, ACT[act]))  # fmt: skip
    assert torch.equal(half.dequantized(), full.dequantized())
    # one value that is not an fp16 keeps the whole weight in fp32; stacking an fp32 part makes the stack fp32
    scale[3, 2] += 1e-7
    mixed = Q4Weight(q, scale, minv)
    assert mixed.scale.dtype == mixed.minv.dtype == torch.float32
    both = Q4Weight.cat([half, mixed])
    assert both.scale.dtype == both.minv.dtype == torch.float32
    assert torch.equal(both.dequantized(), torch.cat([half.dequantized(), mixed.dequantized()]))
    with pytest.raises(RuntimeError, match="same dtype"):
        ext.q4_matmul(torch.randn(1, 192), half.codes, half.scale, full.minv, None, 0)


def test_kernels_refuse_bad_shapes(ext):
    w = _q4(8, 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ext.q4_matmul(torch.randn(1, 48), w.codes[:, :24].contiguous(), w.scale[:, :1].contiguous(),
                      w.minv[:, :1].contiguous(), None, 0)  # fmt: skip
    with pytest.raises(RuntimeError, match="float32"):
        ext.q4_matmul(torch.randn(1, 64, dtype=torch.float64), w.codes, w.scale, w.minv, None, 0)
    with pytest.raises(RuntimeError, match="activations code"):
        ext.q4_matmul(torch.randn(1, 64), w.codes, w.scale, w.minv, None, 5)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        ext.q4_matmul(torch.randn(1, 64), w.codes[:4].contiguous(), w.scale[:4].contiguous(), w.minv[:4].contiguous())


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1])
def test_scale_min_unpacking_is_gguf_dequantization(kind):
    rng = np.random.default_rng(int(kind))
    w = (rng.standard_normal((24, 128)) * rng.uniform(0.01, 3, (24, 1))).astype(np.float32)
    raw = quantize(w, kind)
    q, scale, minv = unpack_q4_scale_min(kind, raw)
    ours = Q4Weight(q, scale, minv).dequantized()
    ref = torch.from_numpy(dequantize(raw, kind).astype(np.float32))
    # equal values (Q4_0's d * (8 - 8) is -0.0 for a negative d where ours is 8 d - 8 d = +0.0)
    assert torch.equal(ours, ref)
    assert torch.equal(ours.view(torch.int32)[ref != 0], ref.view(torch.int32)[ref != 0])


def test_q8_0_blocks_are_gguf_dequantization_bit_for_bit():
    w = np.random.default_rng(1).standard_normal((16, 96)).astype(np.float32)
    raw = quantize(w, T.Q8_0)
    ours = q8_0_blocks(raw, 16, 96).dequantized()
    assert torch.equal(ours, torch.from_numpy(dequantize(raw, T.Q8_0).astype(np.float32)))


# ---------------------------------------------------------------------------------------------- tiny GGUF models
def gguf_model(tmp_path, arch: str, *, head: T = T.Q8_0, types: dict | None = None, seed: int = 0):
    """A tiny model whose dense weights are what transformers loads from a GGUF file written here (Q4_1 linears,
    llama.cpp's q/k row permutation for llama, the head in ``head``), the file recorded on the model as the
    loader records it. Biases (qwen2) stay fp32 in the model, as GGUF keeps them."""
    model = tiny_model(arch, seed=seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                m.bias.normal_(0, 0.5)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(model, path, arch, {"output.weight": head, **(types or {})})
    model._kvboost_gguf_file = str(path)
    return model


def _engine(model, **options):
    from kvboost import KVBoost

    options.setdefault("chunker", {"name": "fixed", "chunk_size": 16})
    return KVBoost(model, ToyTokenizer(), model_identity="tiny-gguf", share_model=True, **options)


def _teacher_forced(engine, ids, fed):
    """(logits of each decode step fed ``fed`` after prefilling ``ids``, the table holding the rows)."""
    from kvboost.kv.block_table import BlockTable
    from kvboost.runtime.batch import ForwardBatch, SeqInput

    table = BlockTable(engine.pool)
    engine.runner.run(ForwardBatch.build([SeqInput(table, ids)]))
    steps = [engine.runner.run(ForwardBatch.build([SeqInput(table, [t])]))[0].float() for t in fed]
    return steps, table


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fp32_step_decodes_as_hf(tmp_path, arch):
    """fp32 activations: 8 greedy steps equal HF's own decode of the dense model, logits within 1e-4, the K/V rows
    the step wrote equal to a dense prefill's of the same tokens within 1e-5; the Q8_0 head is the one used."""
    from kvboost.runtime.batch import ForwardBatch, SeqInput

    model = gguf_model(tmp_path, arch)
    engine = _engine(model, decode="quantized", decode_activations="fp32")
    info = engine.decode_info()
    assert info["decode"] == "quantized" and info["quantized"]["head"] == "output.weight (Q8_0 blocks)"
    ids = random_ids(37, seed=2)
    fed, ref_logits, _ = hf_greedy_reference(model, ids, 8)
    assert engine.generate(ids, 9, mode="cold").output_ids == fed + [int(ref_logits[-1].argmax())]
    steps, table = _teacher_forced(engine, ids, fed)
    assert engine.runner.forwards["quantized"] >= 16
    for step, ref in zip(steps, ref_logits, strict=True):
        assert (step - ref).abs().max() < 1e-4
    eager = _engine(copy.deepcopy(model), decode="eager")
    from kvboost.kv.block_table import BlockTable

    dense_table = BlockTable(eager.pool)
    eager.runner.run(ForwardBatch.build([SeqInput(dense_table, ids + fed)]))
    n = len(ids) + len(fed)
    ours, ref = table.slots(0, n), dense_table.slots(0, n)
    for layer in range(engine.pool.num_layers):
        for cache in ("keys", "values"):
            diff = getattr(engine.pool, cache)[layer][:, ours] - getattr(eager.pool, cache)[layer][:, ref]
            assert diff.abs().max() < 1e-5, (layer, cache)
    table.release()
    dense_table.release()
    engine.close()
    eager.close()


@pytest.mark.parametrize("act, tol", [("int16", 1e-3), ("int8", 0.02)])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_integer_step_is_close_to_hf_and_batches_like_one(tmp_path, arch, act, tol):
    """int16 activations (the default) and int8: logits of 6 teacher-forced steps within ``tol`` of the logits'
    range of HF's; a batch of three prompts of other lengths decodes each as it decodes alone (same kernel per
    row: equal). int8's generated rows are not stored (not a prefill's K/V); int16's are."""
    model = gguf_model(tmp_path, arch, seed=1)
    engine = _engine(model, decode="quantized", **({} if act == "int16" else {"decode_activations": act}))
    assert engine.decode_info()["quantized"]["activations"] == act
    assert engine.generated_rows_exact == (act != "int8")
    ids = random_ids(29, seed=5)
    fed, ref_logits, _ = hf_greedy_reference(model, ids, 6)
    steps, table = _teacher_forced(engine, ids, fed)
    for logits, ref in zip(steps, ref_logits, strict=True):
        spread = (ref.max() - ref.min()).item()
        assert (logits - ref).abs().max().item() < tol * spread
    table.release()
    prompts = [random_ids(n, seed=n) for n in (5, 23, 40)]
    alone = [engine.generate(p, 7, mode="cold").output_ids for p in prompts]
    together = [r.output_ids for r in engine.generate_batch(prompts, 7, mode="cold")]
    assert together == alone
    engine.close()


@pytest.mark.parametrize("act", ["int16", "int8"])
def test_the_step_in_wide_tiles_gives_the_tiles_of_8_logits(tmp_path, act):
    """On the VNNI build the step packs int16 / int8 weights in wide tiles (the tiny model's projections are whole
    tiles of 16): a prompt chunk and batched decode steps give the logits, bit for bit, and the pool rows of the same
    step packed in tiles of 8. Elsewhere it keeps tiles of 8 and refuses wide ones."""
    from kvboost.kv.block_table import BlockTable
    from kvboost.runtime.batch import ForwardBatch, SeqInput
    from kvboost.runtime.quant_step import QuantDecodeStep

    model = gguf_model(tmp_path, "qwen2", seed=3)  # q/k/v biases: the wide tiles' bias too
    engine = _engine(model, decode="quantized", decode_activations=act)
    step = engine.runner.quantized
    if step.ext.isa not in ("avx512_vnni", "amx"):
        assert engine.decode_info()["quantized"]["layout"] == "tiles of 8"
        with pytest.raises(ValueError, match="wide tiles need"):
            QuantDecodeStep(engine.runner, act, wide=True)
        engine.close()
        return
    assert engine.decode_info()["quantized"]["layout"] == f"wide tiles of 16 ({'words' if act == 'int16' else 'quads'})"
    narrow = QuantDecodeStep(engine.runner, act, wide=False)
    assert narrow.describe()["layout"] == "tiles of 8"
    prompts = [random_ids(n, seed=n) for n in (3, 21, 40)]
    runs = {}
    for name, quantized in (("wide", step), ("narrow", narrow)):
        engine.runner.quantized = quantized
        tables = [BlockTable(engine.pool) for _ in prompts]
        logits = [quantized.run(ForwardBatch.build([SeqInput(t, p) for t, p in zip(tables, prompts, strict=True)]))]
        for i in range(4):
            feed = [SeqInput(t, [5 + i + j]) for j, t in enumerate(tables)]
            logits.append(quantized.run(ForwardBatch.build(feed)))
        keys = [engine.pool.keys[layer][:, tables[2].slots(0, 44)].clone() for layer in range(engine.pool.num_layers)]
        runs[name] = (logits, keys)
        for t in tables:
            t.release()
    engine.runner.quantized = step
    for a, b in zip(*(runs[n][0] + runs[n][1] for n in ("wide", "narrow")), strict=True):
        assert torch.equal(a, b)
    engine.close()


def test_bf16_model_decodes_from_the_blocks_into_a_bf16_pool(tmp_path):
    """A bf16 model (dtype=auto on AVX-512 BF16 / AMX CPUs): the blocks are checked against the bf16 weights, the
    step writes bf16 K/V rows and attends over them (its activations stay fp32 between the products); logits of 6
    teacher-forced steps within 3% of the logits' range of HF's fp32 decode."""
    model = gguf_model(tmp_path, "llama", seed=2)
    ids = random_ids(33, seed=6)
    fed, ref_logits, _ = hf_greedy_reference(model, ids, 6)
    engine = _engine(copy.deepcopy(model).to(torch.bfloat16), decode="quantized")
    assert engine.pool.dtype == torch.bfloat16 and engine.decode_info()["decode"] == "quantized"
    steps, table = _teacher_forced(engine, ids, fed)
    for logits, ref in zip(steps, ref_logits, strict=True):
        assert (logits - ref).abs().max().item() < 0.03 * (ref.max() - ref.min()).item()
    # the 33-row prefill too where prefill=auto puts a bf16 model's prompt rows on the blocks (a CPU without AMX)
    prefilled = int(engine.decode_info()["prefill"] == "quantized")
    assert engine.runner.forwards["quantized"] == len(fed) + prefilled
    table.release()
    engine.close()


def test_a_mixed_step_decodes_its_decode_rows_quantized_and_the_rest_eagerly(tmp_path):
    """A serving step with decode rows and a prompt chunk under prefill='fused' (a bf16 model's auto, or asked
    for): the decode rows run the quantized step, the chunk the eager forward, and every logits row comes back in the batch's order, equal to running each part alone."""
    from kvboost.kv.block_table import BlockTable
    from kvboost.runtime.batch import ForwardBatch, SeqInput

    engine = _engine(gguf_model(tmp_path, "llama"), decode="quantized", decode_activations="fp32", prefill="fused")
    runner = engine.runner
    tables = [BlockTable(engine.pool) for _ in range(4)]
    for i, t in enumerate(tables):
        runner.run(ForwardBatch.build([SeqInput(t, random_ids(20 + i, seed=i))]))
    twins = [t.fork() for t in tables]  # the same rows, to run the parts alone
    seqs = [SeqInput(tables[0], [7]), SeqInput(tables[1], random_ids(5, seed=9), logits=[2, 4]),
            SeqInput(tables[2], [8]), SeqInput(tables[3], [9])]  # fmt: skip
    before = dict(runner.forwards)
    mixed = runner.run(ForwardBatch.build(seqs))
    assert runner.forwards["quantized"] == before["quantized"] + 1
    assert runner.forwards["eager"] == before["eager"] + 1
    assert mixed.shape[0] == 5
    decoded = runner.run(ForwardBatch.build([SeqInput(twins[0], [7]), SeqInput(twins[2], [8]), SeqInput(twins[3], [9])]))
    chunk = runner._run_eager(ForwardBatch.build([SeqInput(twins[1], random_ids(5, seed=9), logits=[2, 4])]))
    expected = torch.cat([decoded[:1], chunk, decoded[1:]])
    assert (mixed - expected).abs().max() < 1e-5
    for t in tables + twins:
        t.release()
    engine.close()


@pytest.mark.parametrize("act, tol", [("fp32", 1e-4), ("int16", 1e-3)])
def test_quantized_prefill_is_close_to_hf_and_reuse_equals_cold(tmp_path, act, tol):
    """prefill='quantized': prompt chunks run the quantized step too (no eager forward): the last prompt row's
    logits within ``tol`` of the logits' range of HF's; a prompt prefilled in two chunks gives each row's K/V and
    the logits of one prefill of it within 1e-4 (exact reuse's promise: a row's products do not depend on the rows
    beside it, the attention call's shape rounds); a reuse of a stored prefix gives a cold request's greedy tokens."""
    from kvboost.kv.block_table import BlockTable
    from kvboost.runtime.batch import ForwardBatch, SeqInput

    model = gguf_model(tmp_path, "qwen2", seed=3)
    engine = _engine(model, decode="quantized", prefill="quantized", decode_activations=act)
    assert engine.decode_info()["prefill"] == "quantized"
    runner = engine.runner
    ids = random_ids(45, seed=11)
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    fed, ref_steps, _ = hf_greedy_reference(model, ids, 1)
    whole, split = BlockTable(engine.pool), BlockTable(engine.pool)
    logits = runner.run(ForwardBatch.build([SeqInput(whole, ids)]))[0]
    spread = (ref.max() - ref.min()).item()
    assert (logits - ref).abs().max().item() < tol * spread
    runner.run(ForwardBatch.build([SeqInput(split, ids[:19])]))
    second = runner.run(ForwardBatch.build([SeqInput(split, ids[19:])]))[0]
    assert (second - logits).abs().max().item() < 1e-4 * spread
    k1, v1 = engine.pool.read(whole.slots(0, 45))
    k2, v2 = engine.pool.read(split.slots(0, 45))
    assert (k1 - k2).abs().max().item() < 1e-4 and (v1 - v2).abs().max().item() < 1e-4
    step = runner.run(ForwardBatch.build([SeqInput(whole, fed)]))[0]  # a decode step over the prefilled rows
    assert (step - ref_steps[0]).abs().max().item() < tol * (ref_steps[0].max() - ref_steps[0].min()).item()
    assert runner.forwards["eager"] == 0 and runner.forwards["quantized"] == 4
    whole.release()
    split.release()
    engine.generate(ids[:32], 1)  # stores the prompt's chunks
    reuse = engine.generate(ids + [5, 6], 8)
    cold = engine.generate(ids + [5, 6], 8, mode="cold")
    assert reuse.cached_tokens >= 32 and reuse.output_ids == cold.output_ids
    assert runner.forwards["eager"] == 0
    engine.close()


def test_quantized_prefill_needs_the_quantized_decode_and_is_in_the_cache_key(tmp_path):
    model = gguf_model(tmp_path, "llama")
    with pytest.raises(ValueError, match="prefill='quantized'.*decode='quantized'"):
        _engine(model, decode="eager", prefill="quantized")
    with pytest.raises(ValueError, match="prefill='quantized' with decode_activations='int8'"):
        _engine(model, decode="quantized", prefill="quantized", decode_activations="int8")
    prints = set()
    for prefill in ("fused", "quantized"):
        engine = _engine(model, decode="quantized", prefill=prefill)
        prints.add(engine.fingerprint)
        engine.close()
    assert len(prints) == 2


def test_one_bound_names_the_prefill_path():
    """RunnerConfig keeps which prompt forwards run on the quantized step as one bound (forwards of fewer rows than
    it): none, SHORT_PREFILL_ROWS or every one; the path's name (decode_info, the cache key) follows from it."""
    from kvboost.runtime.config import ALL_ROWS, SHORT_PREFILL_ROWS, RunnerConfig

    def path(rows: int, graphed: bool = False) -> str:
        config = RunnerConfig("llama", "quantized", "plain", graph_prefill=graphed, quantized_prefill_rows=rows)
        return config.prefill_path

    assert (path(0), path(SHORT_PREFILL_ROWS), path(ALL_ROWS)) == ("fused", "quantized_short", "quantized")
    assert path(0, graphed=True) == "graphed"


def test_chunked_prompts_put_a_bf16_models_prompt_rows_on_the_blocks(tmp_path, monkeypatch):
    """kvboost-server feeds prompts in its step budget's chunks (engine.chunked_prompts): then prefill=auto runs a bf16
    model's prompt rows through the quantized step too (a smaller fixed cost per forward), says why, and keys the
    cache apart; in process a bf16 model on an AMX CPU keeps its dense prefill, and on one without AMX takes the
    blocks too, with its own reason. An explicit prefill still wins, and int8 activations never prefill."""
    import kvboost.env

    monkeypatch.setattr(kvboost.env, "has_amx", lambda: True)
    model = copy.deepcopy(gguf_model(tmp_path, "llama", seed=3)).to(torch.bfloat16)
    ids = random_ids(40, seed=9)
    infos, prints = {}, set()
    for chunked in (None, False, True):
        engine = _engine(model, decode="quantized", chunked_prompts=chunked)
        infos[chunked] = engine.decode_info()
        prints.add(engine.fingerprint)
        engine.generate(ids, 4)
        assert (engine.runner.forwards["eager"] == 0) == bool(chunked)
        engine.close()
    assert infos[None]["prefill"] == infos[False]["prefill"] == "fused"
    assert infos[True]["prefill"] == "quantized" and "chunked_prompts" in infos[True]["prefill_reason"]
    assert len(prints) == 2  # None and False are the same engine
    for options, path in (({"prefill": "fused"}, "fused"), ({"decode_activations": "int8"}, "fused")):
        engine = _engine(model, decode="quantized", chunked_prompts=True, **options)
        assert engine.decode_info()["prefill"] == path
        engine.close()
    monkeypatch.setattr(kvboost.env, "has_amx", lambda: False)
    engine = _engine(model, decode="quantized")
    info = engine.decode_info()
    assert info["prefill"] == "quantized" and "without AMX" in info["prefill_reason"]
    engine.close()


def test_prefill_quantized_short_puts_short_forwards_on_the_blocks(tmp_path, monkeypatch):
    """engine.prefill=quantized_short (asked for; auto never picks it): forwards of fewer than SHORT_PREFILL_ROWS
    rows on the quantized step, longer ones on the dense weights, decode on the step; the path is named and keyed
    apart from fused and quantized; it needs the quantized decode and int16 / fp32 activations."""
    import kvboost.env
    from kvboost.runtime.config import SHORT_PREFILL_ROWS

    monkeypatch.setattr(kvboost.env, "has_amx", lambda: True)  # auto: the dense prefill (below)
    model = copy.deepcopy(gguf_model(tmp_path, "llama", seed=3)).to(torch.bfloat16)
    engine = _engine(model, decode="quantized", prefill="quantized_short")
    info, prints = engine.decode_info(), {engine.fingerprint}
    assert info["prefill"] == "quantized_short" and info["prefill_reason"] == "requested"
    forwards = engine.runner.forwards
    engine.generate(random_ids(40, seed=9), 1)
    assert (forwards["quantized"], forwards["eager"]) == (1, 0)
    engine.generate(random_ids(SHORT_PREFILL_ROWS + 20, seed=10), 1)
    assert (forwards["quantized"], forwards["eager"]) == (1, 1)
    engine.generate(random_ids(SHORT_PREFILL_ROWS - 1, seed=11), 3)  # one short prefill, then decode steps
    assert forwards["quantized"] >= 2 and forwards["eager"] == 1
    engine.close()
    for prefill in ("auto", "fused", "quantized"):
        engine = _engine(model, decode="quantized", prefill=prefill)
        assert engine.decode_info()["prefill"] == ("fused" if prefill == "auto" else prefill)
        prints.add(engine.fingerprint)
        engine.close()
    assert len(prints) == 3  # auto is fused with AMX
    with pytest.raises(ValueError, match="prefill='quantized_short'.*decode='quantized'"):
        _engine(model, decode="eager", prefill="quantized_short")
    with pytest.raises(ValueError, match="prefill='quantized_short' with decode_activations='int8'"):
        _engine(model, decode="quantized", prefill="quantized_short", decode_activations="int8")


def test_int8_decode_stores_no_generated_rows(tmp_path):
    """The rows an int8 decode step writes are not a prefill's: a chat-less request stores its prompt's chunks only,
    where int16 (default) stores the generated rows too."""
    ids = random_ids(48, seed=4)
    stored = {}
    for act in ("int16", "int8"):
        engine = _engine(gguf_model(tmp_path, "llama"), decode="quantized", decode_activations=act)
        engine.generate(ids, 40)
        # the next request continues the answer: only int16's generated rows are there to reuse
        out = engine.generate(ids + engine.generate(ids, 40, mode="cold").output_ids[:32], 1)
        stored[act] = out.cached_tokens
        engine.close()
    assert stored["int16"] >= 48 + 16 and stored["int8"] == 48


def test_auto_picks_the_quantized_step_for_a_gguf_model_and_says_why_not_otherwise(tmp_path):
    model = gguf_model(tmp_path, "llama")
    engine = _engine(model)
    info = engine.decode_info()
    assert info["decode"] == "quantized" and "GGUF" in info["decode_reason"]
    engine.close()
    plain = _engine(tiny_model("llama"))
    info = plain.decode_info()
    assert info["decode"] != "quantized" and "not loaded from a GGUF file" in info["decode_reason"]
    plain.close()


def test_refusals_name_the_reason(tmp_path):
    with pytest.raises(ValueError, match="not loaded from a GGUF file"):
        _engine(tiny_model("llama"), decode="quantized")
    mixed = gguf_model(tmp_path, "llama", types={"blk.1.ffn_down.weight": T.Q8_0})
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_down\.weight is Q8_0"):
        _engine(mixed, decode="quantized")
    with pytest.raises(ValueError, match="decode_activations"):
        _engine(gguf_model(tmp_path, "llama"), decode="quantized", decode_activations="int4")
    other = gguf_model(tmp_path, "llama")
    other._kvboost_gguf_file = str(tmp_path / "tiny-qwen2.gguf")
    gguf_model(tmp_path, "qwen2")  # a file that is not this model's
    with pytest.raises(ValueError, match="does not match the model's dense weight|is \\[|shape"):
        _engine(other, decode="quantized")


def test_a_head_of_another_type_runs_through_the_model_head(tmp_path):
    model = gguf_model(tmp_path, "llama", head=T.Q4_0)
    engine = _engine(model, decode="quantized", decode_activations="fp32")
    assert engine.decode_info()["quantized"]["head"].startswith("the model's lm_head")
    ids = random_ids(20, seed=9)
    fed, _, _ = hf_greedy_reference(model, ids, 4)
    assert engine.generate(ids, 4, mode="cold").output_ids == fed
    engine.close()


def test_activations_are_in_the_cache_fingerprint(tmp_path):
    model = gguf_model(tmp_path, "llama")
    prints = set()
    for options in ({"decode": "quantized", "decode_activations": "int8"}, {"decode": "quantized"},
                    {"decode": "quantized", "decode_activations": "fp32"}, {"decode": "eager"}):  # fmt: skip
        engine = _engine(model, **options)
        prints.add(engine.fingerprint)
        engine.close()
    assert len(prints) == 4


# ---------------------------------------------------------------------------------------------- the bundled model
@pytest.mark.integration
def test_bundled_model_decodes_quantized_by_default():
    """The bundled SmolLM2 (Q4_1 linears, Q8_0 embedding tied to the head): ``auto`` decodes from its blocks; with
    fp32 activations the first 16 greedy tokens of a chat prompt equal eager's."""
    from kvboost import KVBoost

    try:
        engine = KVBoost.from_pretrained(None, dtype="float32")
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    try:
        info = engine.decode_info()
        assert info["decode"] == "quantized", info["decode_reason"]
        assert info["quantized"]["head"] == "token_embd.weight (Q8_0 blocks)"
    finally:
        engine.close()
    prompt = "Write one sentence about the sea."
    outs = {}
    for name, options in (("fp32", {"decode": "quantized", "decode_activations": "fp32"}), ("eager", {"decode": "eager"})):
        eng = KVBoost.from_pretrained(None, dtype="float32", **options)
        outs[name] = eng.generate(prompt, 16, mode="cold").output_ids
        eng.close()
    assert outs["fp32"] == outs["eager"]
