"""``attn=batch_invariant``: per-token bits independent of the forward's length, so bf16 prefix reuse equals a
cold prefill bit for bit (and the arithmetic stays attention / linear within fp32 tolerance)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from kvboost_testkit.tiny import ToyTokenizer, hf_greedy_reference, make_engine, random_ids, tiny_model

from kvboost import KVBoost
from kvboost.attention import batch_invariant as bi
from kvboost.attention.batch_invariant import (
    AttentionRows,
    BatchInvariantBackend,
    chunked_linear,
    invariant_attention,
    linear_rows_are_free,
    probe_attention_rows,
    tiled_linear,
)
from kvboost.env import has_amx
from kvboost.registry import ATTENTION


def _causal(q_len: int, k_len: int) -> torch.Tensor:
    keys = torch.arange(k_len)
    return (keys[None, :] <= torch.arange(k_len - q_len, k_len)[:, None])[None, None]


@pytest.mark.parametrize("tile", [1, 4, 16])
def test_tiled_linear_is_the_linear(tile):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 40)
    x = torch.randn(1, 37, 48)
    for offset in (0, 3, 17):
        torch.testing.assert_close(tiled_linear(linear, x, offset, tile), linear(x), atol=1e-5, rtol=1e-5)


def test_tiled_linear_rows_do_not_depend_on_the_call():
    """Row p has the same bits whether it is computed in a call of 200 rows from 0 or of a few rows from p."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(576, 1536, bias=False).to(torch.bfloat16)
    x = torch.randn(200, 576, dtype=torch.bfloat16)
    full = tiled_linear(linear, x, 0, 64)
    for start, length in [(0, 1), (5, 7), (63, 2), (64, 64), (100, 99), (137, 63), (199, 1)]:
        part = tiled_linear(linear, x[start : start + length], start, 64)
        assert torch.equal(part, full[start : start + length]), (start, length)


@pytest.mark.parametrize("q_len,k_len,heads,kv_heads", [(13, 13, 4, 2), (5, 19, 4, 4), (1, 30, 6, 2), (40, 40, 2, 1)])
def test_invariant_attention_is_attention(q_len, k_len, heads, kv_heads):
    torch.manual_seed(2)
    q = torch.randn(1, heads, q_len, 16)
    k = torch.randn(1, kv_heads, k_len, 16)
    v = torch.randn(1, kv_heads, k_len, 16)
    expected = F.scaled_dot_product_attention(
        q, k, v, attn_mask=_causal(q_len, k_len), enable_gqa=kv_heads != heads
    ).transpose(1, 2)
    got = invariant_attention(q, k, v, _causal(q_len, k_len), front=(k_len - q_len) % 8, tile=8, key_block=8,
                              scaling=16**-0.5)  # fmt: skip
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_len,k_len", [(1, 40), (7, 40), (40, 40), (50, 50)])
def test_invariant_attention_with_a_batch_and_a_padding_mask(q_len, k_len):
    """Two sequences, the second left-padded by 9 keys: each row is SDPA's under the same mask, both schedules
    (one or two query tiles: tile-major; more: block-major), rows that see no key give zeros."""
    torch.manual_seed(8)
    q, k, v = torch.randn(2, 6, q_len, 16), torch.randn(2, 2, k_len, 16), torch.randn(2, 2, k_len, 16)
    allowed = _causal(q_len, k_len).repeat(2, 1, 1, 1)
    allowed[1, :, :, :9] = False
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True).transpose(1, 2)
    got = invariant_attention(q, k, v, allowed, front=(k_len - q_len) % 8, tile=8, key_block=16, scaling=16**-0.5)
    seen = allowed.any(-1)[:, 0]  # [B, Lq]: rows that see some key
    torch.testing.assert_close(got[seen], expected[seen], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[~seen], torch.zeros_like(got[~seen]))


def test_invariant_attention_rows_do_not_depend_on_the_call():
    torch.manual_seed(3)
    n = 150
    q = torch.randn(1, 4, n, 32, dtype=torch.bfloat16)
    k = torch.randn(1, 2, n, 32, dtype=torch.bfloat16)
    v = torch.randn(1, 2, n, 32, dtype=torch.bfloat16)

    def run(start: int, end: int) -> torch.Tensor:  # queries start..end over keys 0..end
        return invariant_attention(q[:, :, start:end], k[:, :, :end], v[:, :, :end], _causal(end - start, end),
                                   front=start % 16, tile=16, key_block=16, scaling=32**-0.5)  # fmt: skip

    full = run(0, n)
    for start, end in [(0, 37), (37, 38), (37, 60), (0, 20), (64, 150), (99, 131), (149, 150)]:
        assert torch.equal(run(start, end), full[:, start:end]), (start, end)


def test_fully_masked_rows_are_zero():
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    allowed = torch.zeros(1, 1, 3, 5, dtype=torch.bool)
    allowed[..., 1:, :2] = True
    out = invariant_attention(q, k, v, allowed, front=0, tile=4, key_block=4, scaling=0.3)
    assert torch.equal(out[:, 0], torch.zeros_like(out[:, 0])) and not out.isnan().any()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_bf16_prefix_hit_equals_cold_prefill_bit_for_bit(arch):
    """The point of the backend: a prefix hit (KV from a 70-token earlier request) gives the cold prefill's
    first-token logits and greedy tokens exactly, in bf16, with tiles and key blocks that cut through both
    requests at ragged places."""
    # SmolLM2's layer shapes (2 layers): on an AMX CPU, attn=sdpa gives this prefix hit other logits than the
    # cold prefill (max diff 0.005-0.008, measured), so the equality below is the backend's doing there.
    model = tiny_model(arch, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    engine = KVBoost(model.to(torch.bfloat16), ToyTokenizer(), model_identity=f"tiny-{arch}",
                     chunker={"name": "fixed", "chunk_size": 16},
                     attn={"name": "batch_invariant", "tile": 16, "key_block": 16})  # fmt: skip
    ids = random_ids(150, seed=4)
    engine.generate(ids[:70], max_new_tokens=1)  # stores the prefix
    reuse = engine.generate(ids, max_new_tokens=12)
    cold = engine.generate(ids, max_new_tokens=12, mode="cold")
    assert reuse.cached_tokens >= 64
    assert torch.equal(reuse.first_token_logits, cold.first_token_logits)
    assert reuse.output_ids == cold.output_ids
    engine.close()


def test_fingerprint_keeps_its_entries_apart():
    model = tiny_model("llama")
    invariant = ATTENTION.build("batch_invariant")
    with KVBoost(model, ToyTokenizer(), model_identity="tiny", attn=invariant) as engine:
        tagged = engine.fingerprint
    with KVBoost(model, ToyTokenizer(), model_identity="tiny") as engine:
        plain = engine.fingerprint
    assert "attn=batch_invariant" in tagged and tagged != plain


def test_uninstall_restores_the_projections():
    engine = make_engine("llama", attn="batch_invariant")
    linears = [m for m in engine.model.modules() if isinstance(m, torch.nn.Linear) and m is not engine.model.lm_head]
    assert linears and all("forward" in m.__dict__ for m in linears)
    assert engine.decode_info()["decode"] == "eager"  # the eager runner, calling the backend
    engine.close()
    assert all("forward" not in m.__dict__ for m in linears)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # without and with projection biases
def test_eager_runner_under_the_backend_is_hf_decode_to_the_bit(arch):
    """The eager runner hands projections (sequence by sequence, aligned to each one's positions) and attention
    to the backend: logits and K/V rows equal HF's decode under the same backend, bit for bit, in bf16 (ragged
    tiles: 37 prompt tokens, tiles of 16 and 8), with the prompt's blocks not consecutive."""
    from kvboost.kv.block_table import BlockTable
    from kvboost.runtime.batch import ForwardBatch, SeqInput
    from kvboost.runtime.standalone import StandaloneRunner

    model = tiny_model(arch, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    model = model.to(torch.bfloat16)
    backend = ATTENTION.build({"name": "batch_invariant", "tile": 16, "query_tile": 8, "key_block": 16})
    backend.install(model)
    prompt = random_ids(37, seed=5)
    fed, ref_logits, cache = hf_greedy_reference(model, prompt, steps=9)
    rt = StandaloneRunner(model, attention=backend, max_tokens=128)
    assert rt.config.decode == "eager"
    table = BlockTable(rt.pool)
    with torch.inference_mode():
        rt.runner.run(ForwardBatch.build([SeqInput(table, prompt[:20])]))
        rt.pool.alloc(1)  # a stray block: the rest of the prompt goes elsewhere
        rt.runner.run(ForwardBatch.build([SeqInput(table, prompt[20:])]))
        calls = backend.kernel_calls
        got = [rt.runner.run(ForwardBatch.build([SeqInput(table, [t])]))[0] for t in fed]
    assert backend.kernel_calls - calls == len(fed) * model.config.num_hidden_layers  # its kernel, every layer
    for ref, logits in zip(ref_logits, got, strict=True):
        assert torch.equal(logits, ref)
    keys, values = rt.pool.read(table.slots(0, table.length))
    for layer, ref_layer in enumerate(cache.layers):
        assert torch.equal(keys[layer], ref_layer.keys[0]) and torch.equal(values[layer], ref_layer.values[0])
    backend.uninstall(model)


def test_decode_modes_under_the_backend():
    from kvboost.runtime.config import choose_runner

    model = tiny_model("llama")
    backend = ATTENTION.build("batch_invariant")
    assert choose_runner(model, backend).decode == "eager"
    assert choose_runner(model, backend, decode="hf").runner == "hf"
    with pytest.raises(ValueError, match="keeps its own arithmetic"):
        choose_runner(model, backend, decode="compiled")
    with pytest.raises(ValueError, match="prefill_weights='prepacked'"):
        choose_runner(model, backend, prefill_weights="prepacked")


def test_packed_weights_follow_the_weights():
    """Packed copies (fp32: MKL) give F.linear's values, and a weight changed in place is repacked."""
    from kvboost.models import mkl_pack

    if mkl_pack.unavailable_reason() is not None:
        pytest.skip(mkl_pack.unavailable_reason())
    torch.manual_seed(7)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(1, 21, 64)
    backend = BatchInvariantBackend(tile=8, packed_weights=True)
    packed = tiled_linear(linear, x, 5, 8, backend._packed(linear, x))
    torch.testing.assert_close(packed, linear(x), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        linear.weight.mul_(2.0)
    again = tiled_linear(linear, x, 5, 8, backend._packed(linear, x))
    torch.testing.assert_close(again, linear(x), atol=1e-5, rtol=1e-5)
    assert BatchInvariantBackend(packed_weights=False)._packed(linear, x) is None
    assert backend.packed_bytes >= 64 * 48 * 4  # one copy, rebuilt in place of the stale one


def test_the_engine_reports_the_backends_packed_copies():
    engine = make_engine("llama", attn="batch_invariant")
    before = engine.decode_info()["packed_weight_bytes"]
    engine.generate(random_ids(20, seed=2), max_new_tokens=2)
    after = engine.decode_info()["packed_weight_bytes"]
    packs_here = engine.attention._pack_unavailable(engine.model.model.layers[0].mlp.up_proj.weight) is None
    assert before == 0 and (after > 0) == packs_here  # built on first use, where packing runs
    engine.close()
    assert engine.attention.packed_bytes == 0  # uninstall drops them


@pytest.mark.parametrize("settings", [{"tile": 16}, {"query_tile": 8}, {"key_block": 32}])
def test_settings_go_into_the_fingerprint(settings):
    model = tiny_model("llama")
    with KVBoost(model, ToyTokenizer(), model_identity="tiny", attn="batch_invariant") as engine:
        default = engine.fingerprint
    with KVBoost(model, ToyTokenizer(), model_identity="tiny", attn={"name": "batch_invariant", **settings}) as engine:
        assert engine.fingerprint != default


@pytest.mark.parametrize(
    "field,bad",
    [("tile", 0), ("tile", True), ("key_block", -1), ("key_block", 2.0), ("query_tile", 0), ("packed_weights", "yes"),
     ("rows", "free"), ("chunk", 0)],
)
def test_bad_values_are_refused(field, bad):
    with pytest.raises(ValueError, match=f"attn.{field}"):
        BatchInvariantBackend(**{field: bad})


def test_soft_capping_is_refused():
    config = SimpleNamespace(attn_logit_softcapping=50.0)
    config.get_text_config = lambda decoder=True: config
    with pytest.raises(ValueError, match="soft-capping"):
        BatchInvariantBackend().check_model(SimpleNamespace(config=config))


# ---------------------------------------------------------------------- rows="auto": the probed shapes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_chunked_linear_gives_the_tiles_bits_where_the_probe_says_so(dtype):
    """Where the probe finds a linear's rows free of the call's row count on this CPU, unpadded calls of any
    length give :func:`tiled_linear`'s bits; where it does not (bf16 on AMX), the backend keeps the tiles."""
    torch.manual_seed(11)
    linear = torch.nn.Linear(576, 192, bias=False).to(dtype)
    fn = lambda t: F.linear(t, linear.weight)  # noqa: E731
    if not linear_rows_are_free(fn, 576, dtype, tile=64, chunk=96):
        pytest.skip(f"{dtype} linear rows depend on the call's row count on this CPU (the backend tiles here)")
    x = torch.randn(300, 576, dtype=dtype)
    full = tiled_linear(linear, x, 0, 64)
    for start, length in [(0, 300), (5, 1), (63, 2), (64, 96), (100, 99), (299, 1)]:
        part = chunked_linear(linear, x[start : start + length], 96)
        assert torch.equal(part, full[start : start + length]), (start, length)


def test_probed_attention_gives_the_fixed_shapes_bits():
    """invariant_attention with the probed shapes (one tile on its own rows, merged tiles per GEMM) is the
    fixed-shape kernel, bit for bit, for decode steps, short and long suffixes and cold prefills."""
    torch.manual_seed(12)
    rows = probe_attention_rows(1, 3, 3, 64, 16, 32, max_merge=6)
    assert rows.short is None or 1 <= rows.short < 16
    assert 1 <= rows.merge <= 6
    for q_len, k_len in [(1, 1), (1, 40), (1, 97), (2, 50), (5, 33), (15, 80), (16, 16), (17, 64), (40, 130),
                         (150, 150), (100, 220)]:  # fmt: skip
        q = torch.randn(1, 9, q_len, 64, dtype=torch.bfloat16)
        k = torch.randn(1, 3, k_len, 64, dtype=torch.bfloat16)
        v = torch.randn(1, 3, k_len, 64, dtype=torch.bfloat16)
        args = dict(front=(k_len - q_len) % 16, tile=16, key_block=32, scaling=0.125)
        fixed = invariant_attention(q, k, v, _causal(q_len, k_len), **args)
        probed = invariant_attention(q, k, v, _causal(q_len, k_len), rows=rows, **args)
        assert torch.equal(probed, fixed), (q_len, k_len)


@pytest.mark.parametrize("rows", [AttentionRows(short=1, merge=1), AttentionRows(short=4, merge=3)])
def test_the_probed_schedules_are_attention(rows):
    """Whatever the probe finds, the windowed and merged schedules compute attention (batch, padding mask)."""
    torch.manual_seed(13)
    for q_len, k_len in [(1, 40), (3, 40), (7, 40), (40, 40), (50, 50)]:
        q, k, v = torch.randn(2, 6, q_len, 16), torch.randn(2, 2, k_len, 16), torch.randn(2, 2, k_len, 16)
        allowed = _causal(q_len, k_len).repeat(2, 1, 1, 1)
        allowed[1, :, :, :9] = False
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True).transpose(1, 2)
        got = invariant_attention(q, k, v, allowed, front=(k_len - q_len) % 8, tile=8, key_block=16,
                                  scaling=16**-0.5, rows=rows)  # fmt: skip
        seen = allowed.any(-1)[:, 0]
        torch.testing.assert_close(got[seen], expected[seen], atol=1e-5, rtol=1e-5)
        assert torch.equal(got[~seen], torch.zeros_like(got[~seen]))


def _tiny_bf16_engine(arch: str, **attn):
    model = tiny_model(arch, hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    return KVBoost(model.to(torch.bfloat16), ToyTokenizer(), model_identity=f"tiny-{arch}",
                   chunker={"name": "fixed", "chunk_size": 16},
                   attn={"name": "batch_invariant", "tile": 16, "key_block": 16, **attn})  # fmt: skip


@pytest.mark.parametrize("probe_says", ["this CPU", "nothing is free"])
def test_rows_auto_is_exact_and_gives_the_tiles_bits(probe_says, monkeypatch):
    """rows=auto: a bf16 prefix hit equals the cold prefill bit for bit, and every request's logits and tokens
    are rows=tiles' (the fixed shapes), whether the probe frees every shape (AVX-512 BF16) or none (as on AMX)."""
    if probe_says == "nothing is free":
        monkeypatch.setattr(bi, "_ROW_PROBES", {})
        monkeypatch.setattr(bi, "linear_rows_are_free", lambda *a, **k: False)
        monkeypatch.setattr(bi, "probe_attention_rows", lambda *a, **k: AttentionRows(None, 1))
    ids = random_ids(150, seed=5)
    results = {}
    for rows in ("tiles", "auto"):
        engine = _tiny_bf16_engine("llama", rows=rows)
        engine.generate(ids[:70], max_new_tokens=1)
        reuse = engine.generate(ids, max_new_tokens=12)
        cold = engine.generate(ids, max_new_tokens=12, mode="cold")
        assert reuse.cached_tokens >= 64
        assert torch.equal(reuse.first_token_logits, cold.first_token_logits)
        assert reuse.output_ids == cold.output_ids
        results[rows] = reuse
        engine.close()
    assert torch.equal(results["auto"].first_token_logits, results["tiles"].first_token_logits)
    assert results["auto"].output_ids == results["tiles"].output_ids


def test_rows_auto_frees_what_the_probe_frees():
    """The backend multiplies unpadded rows exactly where the probe found them free (and never under tiles); on
    AMX, bf16 projections keep their tiles whatever the probe would say (its random rows can miss a difference)."""
    linear = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    auto, tiles = BatchInvariantBackend(tile=8, chunk=16), BatchInvariantBackend(tile=8, rows="tiles")
    expected = not has_amx() and linear_rows_are_free(
        lambda t: auto._packed(linear, x)(t) if auto._packed(linear, x) else F.linear(t, linear.weight),
        64, torch.bfloat16, 8, 16,
    )  # fmt: skip
    assert auto._linear_free(linear, x, auto._packed(linear, x)) == expected
    assert tiles._linear_free(linear, x, tiles._packed(linear, x)) is False
    assert tiles._attention_rows(1, 2, 2, 16, torch.device("cpu")) is None
