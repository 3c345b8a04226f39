"""KIVI quantizers (kvboost/quant/kivi.py) and kernels (kvboost/kernels_triton/kivi.py, kivi_reference.py).

* packing round trip;
* quantize/dequantize against a float64 recomputation on odd shapes (tokens 1, 7, 33, 65; head dim 16, 24, 64;
  groups 8, 32; 8/4/2 bits): stored scales/zeros, codes, dequantized values and the error bound;
* the Triton kernels against the torch reference, bit for bit, under the interpreter on CPU (small shapes), also
  dequantizing into a strided slice of a larger (NaN-poisoned) cache buffer;
* ``payload.nbytes`` formula, the size ratio to fp16 for a realistic chunk, fingerprints, config checks;
* an engine on a tiny model serving a repeated prompt from a kivi8 cache (close to cold), and a payload / disk
  tier round trip.
"""

from __future__ import annotations

import math

import pytest
import torch
from kvboost_testkit.tiny import make_engine, random_ids

from kvboost.kernels_triton import kivi_reference as ref
from kvboost.cache import KVEntry
from kvboost.cache import payload as fmt
from kvboost.paths import CONFIG_DIR
from kvboost.quality import first_token_kl
from kvboost.quant.kivi import KiviPayload, KiviQuantizer
from kvboost.registry import KV_QUANT

BITS = (8, 4, 2)


def _kv(L, H, T, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(L, H, T, D, generator=g)
    k = k + 4 * torch.randn(1, 1, 1, D, generator=g)  # per-channel offsets: the outlier channels KIVI is built for
    v = 3 * torch.randn(L, H, T, D, generator=g)
    return k.to(dtype), v.to(dtype)


# ---------------------------------------------------------------------------------------------- packing
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("d", [1, 3, 5, 16, 24, 63])
def test_pack_round_trip(bits, d):
    g = torch.Generator().manual_seed(d)
    codes = torch.randint(0, 2**bits, (2, 3, 5, d), generator=g).to(torch.uint8)
    packed = ref.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 3, 5, math.ceil(d * bits / 8))
    assert torch.equal(ref.unpack_codes(packed, bits, d), codes)
    per = 8 // bits
    if d % per:  # the padded tail of the last byte is zero
        assert int((packed[..., -1].int() >> ((d % per) * bits)).max()) == 0


def test_pack_bit_order():
    assert ref.pack_codes(torch.tensor([[1, 2]], dtype=torch.uint8), 4).tolist() == [[0x21]]
    assert ref.pack_codes(torch.tensor([[1, 2, 3, 0, 3]], dtype=torch.uint8), 2).tolist() == [[0b00111001, 3]]


# ---------------------------------------------------------------------------------------------- float64 reference
def _groups_f64(x: torch.Tensor, group: int, per_channel: bool):
    """Per-element (min, max) of its group, in float64, by explicit loops over the groups."""
    x = x.double()
    mn, mx = torch.empty_like(x), torch.empty_like(x)
    T, D = x.shape[2], x.shape[3]
    if per_channel:
        for s in range(0, T, group):
            blk = x[:, :, s : s + group]
            mn[:, :, s : s + group] = blk.amin(2, keepdim=True)
            mx[:, :, s : s + group] = blk.amax(2, keepdim=True)
    else:
        for s in range(0, D, group):
            blk = x[..., s : s + group]
            mn[..., s : s + group] = blk.amin(3, keepdim=True)
            mx[..., s : s + group] = blk.amax(3, keepdim=True)
    return mn, mx


def _expand(t: torch.Tensor, group: int, per_channel: bool, shape) -> torch.Tensor:
    if per_channel:
        return t.repeat_interleave(group, dim=2)[:, :, : shape[2]]
    return t.repeat_interleave(group, dim=3)[..., : shape[3]]


def _check_side(x, packed, scale, zero, y, *, bits, group, per_channel, bound):
    levels = 2**bits - 1
    mn, mx = _groups_f64(x, group, per_channel)
    s = _expand(scale, group, per_channel, x.shape).double()
    z = _expand(zero, group, per_channel, x.shape).double()
    # stored grid: zero is min rounded to fp16; scale is (max - min) / L to fp16 precision
    assert torch.equal(z, mn.half().double())
    s_exact = (mx - mn) / levels
    assert bool(((s - s_exact).abs() <= s_exact * 2.0**-11 * 1.001 + 2.0**-25).all())
    # codes: the nearest grid point of the stored grid, clamped (ties may go either way)
    q = ref.unpack_codes(packed, bits, x.shape[3]).double()
    r = torch.where(s > 0, (x.double() - z) / torch.where(s > 0, s, 1.0), 0.0)
    q64 = torch.floor(r + 0.5).clamp(0, levels)
    tie = ((r - torch.floor(r)) - 0.5).abs() < 1e-4
    assert bool(((q == q64) | tie).all())
    # dequantized values: q * s + z (computed in float64) rounded to the output dtype
    expect = (q * s + z).to(y.dtype).double()
    assert bool(((y.double() - expect).abs() <= expect.abs() * 2.0**-23).all())
    # error within the quantizer's bound, and within half a step (+ storage rounding) for unclamped elements
    err = (y.double() - x.double()).abs()
    assert bool((err <= bound + 1e-12).all())
    inner = (q64 > 0) & (q64 < levels) & (s > 0)
    assert bool((err[inner] <= s[inner] * (0.5 + 1e-4) + expect[inner].abs() * 2.0**-23).all())


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", [8, 32])
@pytest.mark.parametrize("head_dim", [16, 24, 64])
@pytest.mark.parametrize("tokens", [1, 7, 33, 65])
def test_round_trip_against_float64_reference(bits, group, head_dim, tokens):
    q = KV_QUANT.build({"name": f"kivi{bits}", "group_size": group, "kernel": "torch"})
    k, v = _kv(2, 3, tokens, head_dim, seed=tokens * 100 + head_dim)
    p = q.quantize(k, v)
    assert p.num_tokens == tokens and p.quantized_tokens == tokens
    assert p.k_scale.shape == (2, 3, math.ceil(tokens / group), head_dim)
    assert p.v_scale.shape == (2, 3, tokens, math.ceil(head_dim / group))
    k2, v2 = q.dequantize(p)
    assert k2.shape == k.shape and k2.dtype == k.dtype
    bk, bv = q.error_bound(k, v)
    _check_side(k, p.k_packed, p.k_scale, p.k_zero, k2, bits=bits, group=group, per_channel=True, bound=bk)
    _check_side(v, p.v_packed, p.v_scale, p.v_zero, v2, bits=bits, group=group, per_channel=False, bound=bv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_models_within_bound(dtype):
    for bits in BITS:
        q = KV_QUANT.build({"name": f"kivi{bits}", "group_size": 8})
        k, v = _kv(2, 2, 33, 24, dtype=dtype, seed=bits)
        k2, v2 = q.dequantize(q.quantize(k, v))
        assert k2.dtype == dtype
        bk, bv = q.error_bound(k, v)
        assert bool(((k2.double() - k.double()).abs() <= bk).all())
        assert bool(((v2.double() - v.double()).abs() <= bv).all())


def test_constant_and_tiny_groups():
    """A constant group (scale 0) and a group whose scale underflows fp16 dequantize to (close to) their value."""
    k = torch.full((1, 1, 9, 8), 0.75)
    v = torch.full((1, 1, 9, 8), -2.0)
    v[0, 0, 3] = 1e-3 + torch.arange(8) * 1e-9  # a range far below fp16's smallest subnormal step: scale 0
    q = KV_QUANT.build("kivi4")
    p = q.quantize(k, v)
    assert float(p.v_scale[0, 0, 3, 0]) == 0.0
    k2, v2 = q.dequantize(p)
    assert torch.equal(k2, k) and torch.equal(v2[0, 0, :3], v[0, 0, :3])
    assert bool(((v2 - v).abs() <= 1e-6).all())  # the fp16 rounding of the zero point
    bk, bv = q.error_bound(k, v)
    assert bool(((v2.double() - v.double()).abs() <= bv).all())


def test_overflowing_fp16_grid_is_refused():
    k = torch.zeros(1, 1, 4, 8)
    k[0, 0, 0, 0] = -1e6  # zero point (the min) beyond fp16's range
    with pytest.raises(ValueError, match="bfloat16"):
        KV_QUANT.build("kivi8").quantize(k, k)
    q = KV_QUANT.build({"name": "kivi8", "scale_dtype": "bfloat16"})
    k2, _ = q.dequantize(q.quantize(k, k))
    assert bool(((k2.double() - k.double()).abs() <= q.error_bound(k, k)[0]).all())


@pytest.mark.parametrize("residual", [0, 5, 40])
def test_residual_tail_is_full_precision(residual):
    q = KV_QUANT.build({"name": "kivi2", "residual": residual})
    k, v = _kv(2, 2, 33, 16)
    p = q.quantize(k, v)
    tq = max(0, 33 - residual)
    assert p.quantized_tokens == tq and p.num_tokens == 33 and p.k_residual.shape[2] == 33 - tq
    k2, v2 = q.dequantize(p)
    assert torch.equal(k2[:, :, tq:], k[:, :, tq:]) and torch.equal(v2[:, :, tq:], v[:, :, tq:])
    bk, bv = q.error_bound(k, v)
    assert bool((bk[:, :, tq:] == 0).all())
    assert bool(((k2.double() - k.double()).abs() <= bk).all() and ((v2.double() - v.double()).abs() <= bv).all())
    # the residual is a copy: the payload does not keep the caller's tensor alive
    assert p.k_residual.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------------------------- Triton kernels
# (bits, group, tokens, head_dim, dtype): a covering set, small because the interpreter is slow
KERNEL_CASES = [
    (2, 8, 7, 24, torch.float32),
    (4, 32, 33, 16, torch.bfloat16),
    (8, 8, 1, 64, torch.float16),
    (4, 8, 65, 24, torch.float32),
    (2, 32, 33, 64, torch.float32),
    (8, 32, 7, 16, torch.bfloat16),
]


@pytest.mark.parametrize("bits,group,tokens,head_dim,dtype", KERNEL_CASES)
def test_triton_kernels_match_torch_reference(bits, group, tokens, head_dim, dtype):
    from kvboost.kernels_triton import kivi as kk

    k, v = _kv(2, 2, tokens, head_dim, dtype=dtype, seed=bits + tokens)
    k = k.transpose(0, 1).contiguous().transpose(0, 1)  # non-contiguous input: strides are honoured
    scale_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float16
    for quant, dequant, ref_quant, ref_dequant, x in (
        (kk.kivi_quantize_keys, kk.kivi_dequantize_keys, ref.quantize_keys_reference, ref.dequantize_keys_reference, k),
        (kk.kivi_quantize_values, kk.kivi_dequantize_values, ref.quantize_values_reference,
         ref.dequantize_values_reference, v),
    ):  # fmt: skip
        got = quant(x, bits, group, scale_dtype)
        want = ref_quant(x, bits, group, scale_dtype)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        args = {"bits": bits, "group_size": group, "head_dim": head_dim}
        # into rows [3, 3 + t) of a NaN-poisoned cache buffer [L, H, capacity, D], the first t tokens only
        t = max(1, tokens - 2)
        buf = torch.full((2, 2, tokens + 6, head_dim), float("nan"), dtype=dtype)
        dequant(*got, out=buf[:, :, 3 : 3 + t], **args)
        expect = ref_dequant(*want, **args, dtype=dtype)[:, :, :t]
        assert torch.equal(buf[:, :, 3 : 3 + t], expect)
        assert bool(buf[:, :, :3].isnan().all() and buf[:, :, 3 + t :].isnan().all())


def test_quantizer_paths_give_the_same_bits():
    k, v = _kv(2, 3, 21, 24, dtype=torch.bfloat16, seed=3)
    for bits in BITS:
        a = KV_QUANT.build({"name": f"kivi{bits}", "group_size": 8, "residual": 4, "kernel": "triton"})
        b = KV_QUANT.build({"name": f"kivi{bits}", "group_size": 8, "residual": 4, "kernel": "torch"})
        pa, pb = a.quantize(k, v), b.quantize(k, v)
        assert all(torch.equal(x, y) for x, y in zip(pa.tensors, pb.tensors))
        ka, va = a.dequantize(pa)
        kb, vb = b.dequantize(pb)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
        assert a.fingerprint() == b.fingerprint()


def test_dequantize_into_a_cache_slice():
    q = KV_QUANT.build({"name": "kivi4", "group_size": 8, "residual": 3})
    k, v = _kv(2, 2, 19, 16)
    p = q.quantize(k, v)
    k_full, v_full = q.dequantize(p)
    kbuf = torch.full((2, 2, 40, 16), float("nan"))
    vbuf = torch.full((2, 2, 40, 16), float("nan"))
    q.dequantize_into(p, kbuf[:, :, 10:27], vbuf[:, :, 10:27])  # a partial take: 17 of 19 tokens, residual included
    assert torch.equal(kbuf[:, :, 10:27], k_full[:, :, :17]) and torch.equal(vbuf[:, :, 10:27], v_full[:, :, :17])
    assert bool(kbuf[:, :, 27:].isnan().all() and kbuf[:, :, :10].isnan().all())
    with pytest.raises(ValueError):
        q.dequantize_into(p, kbuf[:, :, :20], vbuf[:, :, :20])  # more tokens than stored


# ---------------------------------------------------------------------------------------------- bytes
def _expected_nbytes(L, H, T, D, bits, group, residual, elem):
    tq = max(0, T - residual)
    packed = 2 * L * H * tq * math.ceil(D / (8 // bits))
    key_grid = 2 * 2 * L * H * math.ceil(tq / group) * D
    value_grid = 2 * 2 * L * H * tq * math.ceil(D / group)
    return packed + key_grid + value_grid + 2 * L * H * (T - tq) * D * elem


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape,group,residual", [((2, 3, 7, 24), 8, 0), ((3, 1, 65, 64), 32, 0),
                                                  ((2, 2, 33, 16), 32, 5), ((1, 2, 3, 24), 8, 10)])
def test_nbytes_is_the_true_footprint(bits, shape, group, residual):
    q = KV_QUANT.build({"name": f"kivi{bits}", "group_size": group, "residual": residual})
    k, v = _kv(*shape)
    p = q.quantize(k, v)
    assert p.nbytes == _expected_nbytes(*shape, bits, group, residual, 4)
    assert p.nbytes == sum(t.numel() * t.element_size() for t in p.tensors)


def test_realistic_chunk_size_vs_fp16():
    """64 tokens, 30 layers, 3 kv heads, head dim 64 (SmolLM2-135M's chunk). Scales and zeros in fp16 cost
    2 * 16 bits per group: one bit per element at group 32 (kivi4: 5 bits/element, 3.2x smaller than fp16), half a
    bit at group 64 (4.5 bits/element, 3.56x)."""
    k, v = _kv(30, 3, 64, 64, dtype=torch.float16)
    fp16 = 2 * k.numel() * 2
    size = {(b, g): KV_QUANT.build({"name": f"kivi{b}", "group_size": g}).quantize(k, v).nbytes
            for b in BITS for g in (32, 64)}  # fmt: skip
    assert fp16 / size[(4, 32)] == pytest.approx(3.2)
    assert fp16 / size[(4, 64)] >= 3.5
    assert fp16 / size[(2, 32)] == pytest.approx(16 / 3)
    assert fp16 / size[(8, 32)] == pytest.approx(16 / 9)


# ---------------------------------------------------------------------------------------------- settings
def test_fingerprint_differs_per_setting():
    fps = {
        KV_QUANT.build({"name": f"kivi{b}", "group_size": g, "residual": r, "scale_dtype": s}).fingerprint()
        for b in BITS for g in (8, 32) for r in (0, 16) for s in ("float16", "bfloat16")
    }  # fmt: skip
    assert len(fps) == 3 * 2 * 2 * 2
    assert "none" not in fps
    assert KV_QUANT.build({"name": "kivi4", "kernel": "torch"}).fingerprint() == KV_QUANT.build("kivi4").fingerprint()


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="kivi2"):
        KV_QUANT.build({"name": "kivi4", "bits": 2})
    with pytest.raises(ValueError, match="group_size"):
        KV_QUANT.build({"name": "kivi2", "group_size": 6})
    with pytest.raises(ValueError, match="residual"):
        KV_QUANT.build({"name": "kivi8", "residual": -1})
    with pytest.raises(ValueError, match="kernel"):
        KV_QUANT.build({"name": "kivi8", "kernel": "cuda"})
    with pytest.raises(ValueError, match="scale_dtype"):
        KV_QUANT.build({"name": "kivi8", "scale_dtype": "float32"})
    with pytest.raises(ValueError, match="unknown"):
        KV_QUANT.validate({"name": "kivi8", "group": 32})
    KV_QUANT.validate({"name": "kivi8", "bits": 8, "group_size": 32, "residual": 0, "kernel": "auto"})
    assert isinstance(KV_QUANT.build("kivi2"), KiviQuantizer) and KV_QUANT.build("kivi2").bits == 2


def test_yaml_configs_build():

    from omegaconf import OmegaConf

    root = CONFIG_DIR / "quant"
    for b in BITS:
        q = KV_QUANT.build(OmegaConf.load(root / f"kivi{b}.yaml"))
        assert q.bits == b and q.group_size == (64 if b == 4 else 32) and q.residual == 0
        assert q.group_size == KV_QUANT.build(f"kivi{b}").group_size  # the yaml and the class agree


# ---------------------------------------------------------------------------------------------- engine and disk
def test_engine_serves_a_repeated_prompt_from_a_kivi8_cache():
    engine = make_engine("llama", quant={"name": "kivi8"})
    assert "kivi:b8" in engine.fingerprint
    prompt = random_ids(70, seed=7)
    cold = engine.generate(prompt, max_new_tokens=8, mode="cold")
    first = engine.generate(prompt, max_new_tokens=8)
    assert first.cached_tokens == 0
    used = engine.cache_stats()["tiers"][0]["used_bytes"]
    assert 0 < used < 70 * engine.adapter.kv_bytes_per_token() / 2  # int8 + scales vs fp32
    again = engine.generate(prompt, max_new_tokens=8)
    assert again.cached_tokens >= 64
    kl, _ = first_token_kl(cold.first_token_logits, again.first_token_logits)
    assert kl < 1e-3
    assert again.output_ids == cold.output_ids
    engine.close()


def test_exact_hits_decode_into_the_sequences_blocks():
    """Under a lossy quantizer an exact hit carries the stored payload, not a dequantized copy; assembly decodes it
    (whole chunks and a partial frontier chunk) into the sequence's fresh blocks, equal to dequantize, and writes
    nothing past the hits."""
    from kvboost.kv.block_table import BlockTable
    from kvboost.lookup import chunk_prompt, lookup
    from kvboost.plan import Placement, ReusePlan
    from kvboost.reuse.assemble import assemble_exact

    engine = make_engine("llama", quant={"name": "kivi4", "group_size": 8})
    first = random_ids(70, seed=21)
    engine.warm(first)
    ids = first[:40] + random_ids(20, seed=22)  # 2 whole chunks of 16 and 8 tokens of the third
    pool = engine.pool
    with torch.inference_mode():
        spans, keys = chunk_prompt(ids, engine.chunker, engine.hasher, engine.fingerprint)
        plan = lookup(ids, spans, keys, engine.store, engine.quantizer)
        exact = [p for p in plan.placements if p.kind == "exact"]
        assert [len(p) for p in exact] == [16, 16, 8] and plan.exact_tokens == 40
        assert all(p.keys is None and p.values is None and isinstance(p.payload, KiviPayload) for p in exact)
        pool.keys.fill_(float("nan"))
        pool.values.fill_(float("nan"))
        table = BlockTable(pool)
        stats = assemble_exact(plan, table, engine.quantizer)
        assert stats.loaded_rows == 40 and stats.shared_blocks == 0  # quantized entries never share blocks
        for p in exact:
            k, v = engine.quantizer.dequantize(p.payload)
            got_k, got_v = pool.read(table.slots(p.start, p.end))
            assert torch.equal(got_k, k[:, :, : len(p)]) and torch.equal(got_v, v[:, :, : len(p)])
        rest = pool.keys[:, :, table.slots(40, table.capacity)]
        assert bool(rest.isnan().all())  # nothing written past the hits
        table.release()
    with pytest.raises(ValueError, match="payload"):  # a payload shorter than its placement
        ReusePlan(ids[:20], [Placement(0, 20, "exact", payload=exact[0].payload)])
    engine.close()


def test_payload_record_round_trip():
    for residual in (0, 3, 50):
        q = KV_QUANT.build({"name": "kivi2", "group_size": 8, "residual": residual})
        k, v = _kv(2, 2, 13, 24, dtype=torch.bfloat16)
        p = q.quantize(k, v)
        entry = KVEntry("k" * 64, "s" * 64, "p" * 64, tuple(range(13)), 16, p)
        data = fmt.encode(entry, fingerprint="fp", quantizer_settings={"name": "kivi2", "fingerprint": q.fingerprint()})
        header = fmt.decode_header(data)
        assert header["payload_type"] == "kivi" and header["nbytes"] == p.nbytes
        back = fmt.decode(data, expected_fingerprint="fp").payload
        assert isinstance(back, KiviPayload) and (back.bits, back.group_size, back.head_dim, back.dtype) == (
            2, 8, 24, "bfloat16")  # fmt: skip
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(p.tensors, back.tensors))
        ka, va = q.dequantize(p)
        kb, vb = q.dequantize(back)
        assert torch.equal(ka, kb) and torch.equal(va, vb)


def test_disk_tier_serves_kivi_entries_after_a_restart(tmp_path):
    prompt = random_ids(50, seed=11)
    cache = {"name": "disk", "path": str(tmp_path), "capacity": "16MiB"}
    with make_engine("llama", quant="kivi4", cache=cache) as first:
        first.generate(prompt, max_new_tokens=4)
        warm = first.generate(prompt, max_new_tokens=4)
        assert warm.cached_tokens >= 48
    with make_engine("llama", quant="kivi4", cache=cache) as second:
        again = second.generate(prompt, max_new_tokens=4)
        assert again.cached_tokens == warm.cached_tokens
        assert again.output_ids == warm.output_ids
        assert torch.equal(again.first_token_logits, warm.first_token_logits)
        assert second.cache_stats()["corrupt_entries_dropped"] == 0
