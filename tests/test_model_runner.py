"""The model runners over the paged KV pool (kvboost.runtime) against HF's own forward, and how the path is chosen.

What is guaranteed, and how it is checked:

- ``LlamaRunner`` eager with plain weights and ``attn=sdpa`` *is* HF's forward: logits and every K/V row bit-equal
  (``torch.equal``) for a cold prefill, a suffix after a cached prefix held in non-consecutive blocks (shared with
  another table, so the partial block is copied on write), decode, and k + 1 verification rows; in fp32 and bf16,
  for llama, qwen2 and mistral. The int8 head and AWQ int4 projections (fused or through their modules) keep
  that: HF's bits with the same modules.
- ``HFGenericRunner`` (phi3, gemma) is HF's forward over the pool, to the bit.
- Rows at arbitrary positions (content repair) agree between the two runners to the bit and with a full
  recompute within 1e-5 (fp32), and never see keys after their own position.
- The other arithmetics are close, not exact: compiled decode (1e-4 of HF, fp32, and no recompile after warm-up),
  prepacked weights, the cpu_kernel backend, the static forward CUDA graphs capture (``GraphRunner``), flat
  batches of several sequences (1e-5 of each sequence alone, same greedy tokens).
- ``choose_runner`` picks and refuses paths with reasons; the engine's paths give the same greedy tokens.

HF references run on a second, identical model (same seed) that keeps transformers' own ``sdpa`` attention, so the
kvboost backend installed on the runner's model is not part of the reference.
"""

from __future__ import annotations

import os

import pytest
import torch
from kvboost_testkit.tiny import VOCAB, ToyTokenizer, make_engine, random_ids, tiny_model
from transformers import DynamicCache

from kvboost.attention.cpu_ext import cpu_extension_unavailable_reason
from kvboost.kv import BlockTable, KVPool
from kvboost.models.prepack import unavailable_reason as prepack_unavailable_reason
from kvboost.registry import ATTENTION
from kvboost.runtime.batch import ForwardBatch, SeqInput
from kvboost.runtime.config import choose_runner
from kvboost.runtime.graphs import GraphRunner, bucket
from kvboost.runtime.hf_generic import HFGenericRunner, cache_kwarg
from kvboost.runtime.llama import LlamaRunner, inductor_unavailable_reason, unsupported_reason
from kvboost.runtime.projections import Int4Projections, PackedProjections, PlainProjections

LLAMA_FAMILY = ("llama", "qwen2", "mistral")
DTYPES = (torch.float32, torch.bfloat16)

needs_inductor = pytest.mark.skipif(
    inductor_unavailable_reason() is not None, reason=str(inductor_unavailable_reason())
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
# Triton kernels on CPU tensors run only in Triton's interpreter, which conftest switches on where there is no GPU;
# on a GPU machine (found by its first GPU run: "compiled Triton kernels need CUDA tensors") these CPU checks skip,
# and their CUDA twins below run instead.
triton_on_cpu = pytest.mark.skipif(
    torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton on CPU tensors needs TRITON_INTERPRET=1 (a GPU machine runs the CUDA variants)",
)


# ---------------------------------------------------------------------------------------------- helpers
def make_pool(model, num_blocks: int = 32, block_size: int = 16) -> KVPool:
    """A pool of the model's KV shape, dtype and device, filled with finite garbage (seeded): whatever a forward
    reads past a sequence's rows would show, and results do not depend on what ``torch.empty`` left there (see
    ``test_decode_ignores_nan_past_a_sequence`` for NaN there)."""
    cfg = model.config.get_text_config(decoder=True)
    param = next(model.parameters())
    pool = KVPool(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                  head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                  num_blocks=num_blocks, block_size=block_size, dtype=param.dtype, device=param.device)  # fmt: skip
    gen = torch.Generator(device=param.device).manual_seed(1234)
    for t in (pool.keys, pool.values):
        t.normal_(generator=gen)
    return pool


def serve(model, attn="sdpa"):
    """Install a kvboost attention backend in ``model`` (as the engine does); returns it."""
    backend = ATTENTION.build(attn)
    backend.install(model)
    return backend


def llama_runner(model, *, attn="sdpa", num_blocks: int = 32, **options) -> LlamaRunner:
    return LlamaRunner(model, make_pool(model, num_blocks), serve(model, attn), **options)


def run(runner, table: BlockTable, ids, positions=None, logits=None) -> torch.Tensor:
    """One sequence's forward (built in inference mode, as the engine builds its batches)."""
    with torch.inference_mode():
        return runner.run(ForwardBatch.build([SeqInput(table, ids, positions, logits)]))


class HF:
    """HF's own forward over a DynamicCache, call by call (logits of the last ``keep`` rows, fp32)."""

    def __init__(self, model) -> None:
        self.model, self.cache, self.kw = model, DynamicCache(), cache_kwarg(model.forward)
        self.device = next(model.parameters()).device

    def __call__(self, ids, keep: int = 1) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([list(ids)], device=self.device), use_cache=True,
                             logits_to_keep=keep, **{self.kw: self.cache})  # fmt: skip
        return out.logits[0].float()

    def rows(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cache.layers[layer].keys[0], self.cache.layers[layer].values[0]

    def greedy(self, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
        """HF's greedy decode after ``prompt``: the tokens fed and each step's logits."""
        token = int(self(prompt)[-1].argmax())
        fed, logits = [], []
        for _ in range(steps):
            fed.append(token)
            logits.append(self([token])[-1])
            token = int(logits[-1].argmax())
        return fed, logits


def assert_rows(pool: KVPool, table: BlockTable, ref: HF, n: int, atol: float = 0.0) -> None:
    """The table's first ``n`` K/V rows of every layer against HF's cache (bit-equal when ``atol`` is 0)."""
    keys, values = pool.read(table.slots(0, n))
    for layer in range(pool.num_layers):
        ref_k, ref_v = ref.rows(layer)
        for got, want in ((keys[layer], ref_k), (values[layer], ref_v)):
            assert got.shape == want.shape
            if atol:
                assert torch.allclose(got.float(), want.float(), atol=atol, rtol=0), (got - want).abs().max()
            else:
                assert torch.equal(got, want), (layer, (got.float() - want.float()).abs().max())


def same(got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32
    if atol == 0:
        assert torch.equal(got, want), (got - want).abs().max()
    else:
        assert torch.allclose(got, want, atol=atol, rtol=0), (got - want).abs().max()


def exercise(runner, ref: HF, ids: list[int], atol: float = 0.0, *, decode: int = 3, verify: int = 4) -> None:
    """Cold prefill of 21 rows, a 24-row suffix, ``decode`` decode steps and ``verify`` verification rows, each
    against HF's forward; then every K/V row. The 21-row prefix lives in non-consecutive blocks (a stray block
    between them) and the suffix runs on a fork of its table: the shared partial block is copied on write, and
    the parent's rows stay as they were."""
    pool = runner.pool
    parent = BlockTable(pool)
    parent.reserve(1)
    stray = pool.alloc(1)  # the block after the parent's first one: its second block cannot follow it
    same(run(runner, parent, ids[:21]), ref(ids[:21]), atol)
    assert parent.run_start() is None, parent  # a gathered (non-strided) sequence
    before = pool.read(parent.slots(0, 21))
    table = parent.fork()
    same(run(runner, table, ids[21:45]), ref(ids[21:45]), atol)
    assert table.blocks[0] == parent.blocks[0] and table.blocks[1] != parent.blocks[1]  # copy on write
    for got, want in zip(pool.read(parent.slots(0, 21)), before, strict=True):
        assert torch.equal(got, want)  # the shared prefix was never written
    n = 45
    for token in ids[n : n + decode]:
        same(run(runner, table, [token]), ref([token]), atol)
    n += decode
    rows = ids[n : n + verify]
    got = run(runner, table, rows, logits=range(verify))
    assert got.shape == (verify, VOCAB)
    same(got, ref(rows, keep=verify), atol)
    n += verify
    assert table.length == n
    assert_rows(pool, table, ref, n, atol)
    for t in (table, parent):
        t.release()
    pool.decref(stray)
    assert pool.num_free == pool.num_blocks
    pool.verify()


def _awq_tiny(arch: str, dtype: torch.dtype):
    from kvboost.models.awq import AWQConfig, quantize_model_rtn

    model = tiny_model(arch)
    quantize_model_rtn(model, AWQConfig(group_size=32))
    return model.to(dtype)


# ---------------------------------------------------------------------------------------------- exact eager
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", LLAMA_FAMILY)
def test_eager_runner_is_hf_forward_to_the_bit(arch, dtype):
    """decode=eager, plain weights, attn=sdpa: HF's logits and K/V rows to the bit, every kind of forward."""
    runner = llama_runner(tiny_model(arch).to(dtype), decode="eager", weights="plain")
    assert runner.exact and all(isinstance(p, PlainProjections) for p in runner.projections)
    exercise(runner, HF(tiny_model(arch).to(dtype)), random_ids(60, seed=7))
    assert runner.forwards == {"eager": 1 + 1 + 3 + 1, "compiled": 0, "graphed": 0, "quantized": 0}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["phi3", "gemma"])
def test_hf_generic_runner_is_hf_forward_to_the_bit(arch, dtype):
    """Architectures the Llama runner does not cover run HF's modules over the pool: HF's bits."""
    model = tiny_model(arch).to(dtype)
    assert unsupported_reason(model) is not None
    with pytest.raises(ValueError, match="does not support"):
        LlamaRunner(model, make_pool(model), ATTENTION.build("sdpa"))
    runner = HFGenericRunner(model, make_pool(model), serve(model))
    exercise(runner, HF(tiny_model(arch).to(dtype)), random_ids(60, seed=8))
    assert runner.forwards["hf"] == 6 and runner.forwards["layerwise"] == 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_an_int8_head_is_hf_forward_with_that_head_to_the_bit(dtype):
    from kvboost.models.int8_head import Int8Linear, quantize_lm_head

    model = quantize_lm_head(tiny_model("llama").to(dtype), "int8")
    assert isinstance(model.lm_head, Int8Linear)
    runner = llama_runner(model, decode="eager")
    exercise(runner, HF(quantize_lm_head(tiny_model("llama").to(dtype), "int8")), random_ids(60, seed=9))


# ---------------------------------------------------------------------------------------------- subset rows
def _assembled(pool: KVPool, ref_k, ref_v, n: int, garbage: list[int]) -> BlockTable:
    """A table of ``n`` rows holding ``ref_k``/``ref_v`` except rows ``garbage`` (huge values): an assembled
    prompt whose selected rows a forward must recompute."""
    table = BlockTable(pool)
    table.reserve(n)
    keys, values = ref_k.clone(), ref_v.clone()
    keys[:, :, garbage], values[:, :, garbage] = 1e3, -1e3
    pool.write(table.slots(0, n), keys, values)
    table.length = n
    return table


@pytest.mark.parametrize(("arch", "dtype", "attn"), [
    ("llama", torch.float32, "sdpa"), ("qwen2", torch.float32, "sdpa"), ("mistral", torch.float32, "sdpa"),
    ("llama", torch.bfloat16, "sdpa"), ("llama", torch.float32, "eager"),
    pytest.param("llama", torch.float32, "triton", marks=triton_on_cpu),
], ids=["llama-fp32", "qwen2-fp32", "mistral-fp32", "llama-bf16", "llama-fp32-eager", "llama-fp32-triton"])  # fmt: skip
def test_subset_rows_agree_between_runners_and_with_a_full_recompute(arch, dtype, attn):
    """Rows at arbitrary positions over an assembled prompt (content repair's forward): the Llama runner and the
    HF-generic runner (layer by layer) give the same bits under sdpa and eager, where both call the same kernel;
    in fp32 both are a full recompute within 1e-5. Under triton the Llama runner calls the paged kernel and the
    generic runner the flash kernel over gathered K/V: two kernels, equal only up to rounding (bit-equal on AVX-512
    CPUs, 1 ulp apart on an AVX2-only AMD EPYC, where the interpreter's numpy dot rounds by block shape). Each
    backend's kernel really runs (one call per layer)."""
    model = tiny_model(arch).to(dtype)
    backend = serve(model, attn)
    pool = make_pool(model)
    llama, generic = LlamaRunner(model, pool, backend), HFGenericRunner(model, pool, backend)
    ids, n = random_ids(41, seed=3), 41
    full = BlockTable(pool)
    full_logits = run(llama, full, ids, logits=[n - 1])
    ref_k, ref_v = pool.read(full.slots(0, n))
    selected = [0, 5, 6, 7, 19, 33, 40]
    results = {}
    for name, runner in (("llama", llama), ("hf", generic)):
        table = _assembled(pool, ref_k, ref_v, n, selected)
        calls = backend.kernel_calls
        logits = run(runner, table, [ids[p] for p in selected], positions=selected)
        assert backend.kernel_calls - calls == model.config.num_hidden_layers, name
        results[name] = (logits, *pool.read(table.slots(0, n)))
        table.release()
    assert generic.forwards["layerwise"] == 1
    for a, b in zip(results["llama"], results["hf"], strict=True):
        if attn == "triton":
            assert float((a.float() - b.float()).abs().max()) <= 1e-6
        else:
            assert torch.equal(a, b), (a.float() - b.float()).abs().max()
    if dtype == torch.float32:
        logits, keys, values = results["llama"]
        assert float((logits - full_logits).abs().max()) <= 1e-5
        assert float((keys - ref_k).abs().max()) <= 1e-5 and float((values - ref_v).abs().max()) <= 1e-5


@pytest.mark.parametrize("arch", ["phi3", "gemma"])
def test_hf_generic_subset_rows_equal_a_full_recompute(arch):
    """The HF-generic runner's layer-by-layer forward of selected rows: a full recompute within 1e-5 (fp32)."""
    model = tiny_model(arch)
    runner = HFGenericRunner(model, make_pool(model), serve(model))
    pool = runner.pool
    ids, n = random_ids(41, seed=4), 41
    full = BlockTable(pool)
    full_logits = run(runner, full, ids)
    ref_k, ref_v = pool.read(full.slots(0, n))
    selected = [1, 2, 17, 30, 40]
    table = _assembled(pool, ref_k, ref_v, n, selected)
    logits = run(runner, table, [ids[p] for p in selected], positions=selected)
    keys, values = pool.read(table.slots(0, n))
    assert runner.forwards == {"hf": 1, "layerwise": 1}
    assert float((logits - full_logits).abs().max()) <= 1e-5
    assert float((keys - ref_k).abs().max()) <= 1e-5 and float((values - ref_v).abs().max()) <= 1e-5


@pytest.mark.parametrize(("kind", "attn"), [
    ("llama", "sdpa"), ("hf_generic", "sdpa"), pytest.param("llama", "triton", marks=triton_on_cpu)])
def test_a_selected_row_never_sees_later_keys(kind, attn):
    """Query at position p attends keys <= p only: garbage in every row between two selected ones leaves the
    first selected row's K/V (every layer: each depends on the layer below's attention) as a full prefill's."""
    model = tiny_model("llama")
    backend = serve(model, attn)
    pool = make_pool(model)
    runner = LlamaRunner(model, pool, backend) if kind == "llama" else HFGenericRunner(model, pool, backend)
    ids, n = random_ids(24, seed=5), 24
    full = BlockTable(pool)
    run(runner, full, ids)
    ref_k, ref_v = pool.read(full.slots(0, n))
    table = _assembled(pool, ref_k, ref_v, n, [10, *range(11, 23), 23])  # rows 11..22 stay garbage
    run(runner, table, [ids[10], ids[23]], positions=[10, 23])
    keys, values = pool.read(table.slots(10, 11))
    assert float((keys - ref_k[:, :, 10:11]).abs().max()) <= 1e-5
    assert float((values - ref_v[:, :, 10:11]).abs().max()) <= 1e-5


# ---------------------------------------------------------------------------------------------- compiled decode
@pytest.fixture(scope="module")
def compiled():
    """A warmed-up compiled llama runner, and how many graphs each probe compiled after the warm-up.

    The compiled code is shared by every runner (dynamo caches per function), so the cache is reset first and
    the probes run here, before any other test can compile a shape they would otherwise find compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = tiny_model("llama")
    runner = llama_runner(model, decode="compiled", num_blocks=64)
    runner.warmup()
    assert runner.compile_seconds > 0 and runner.fallback_reason is None
    probes = {}

    def probe(name: str, lengths: list[int], steps: int = 3) -> None:
        tables = [BlockTable(runner.pool) for _ in lengths]
        for table, n in zip(tables, lengths, strict=True):
            run(runner, table, random_ids(n, seed=n))
        before = counters["stats"]["unique_graphs"]
        with torch.inference_mode():
            for step in range(steps):
                runner.run(ForwardBatch.build([SeqInput(t, [3 + step]) for t in tables]))
        probes[name] = counters["stats"]["unique_graphs"] - before
        for table in tables:
            table.release()

    # block-table widths 2 (= kv heads), 4 (= heads), 16 (= head_dim, block size), 19; then two batches
    for n in (20, 60, 250, 300):
        probe(f"one sequence of {n} rows", [n])
    probe("a batch of 2", [40, 70])
    probe("a batch of 3", [33, 50, 130])
    probe("one block", [5])  # a one-block table: warmup covers it too (a size of 1 is specialised)
    return runner, probes


@needs_inductor
def test_compiled_decode_does_not_recompile_after_warmup(compiled):
    """New positions, block-table widths (equal to model dimensions too) and batch sizes reuse the warm-up's
    graphs: no measured request pays for a compile."""
    runner, probes = compiled
    assert probes == dict.fromkeys(probes, 0)
    assert runner.forwards["compiled"] > 0 and runner.decode == "compiled"


@needs_inductor
def test_compiled_decode_is_close_to_hf_forward(compiled):
    """Compiled decode (fused reductions, gathered attention): not HF's bits, but within 1e-4 in fp32 (llama:
    the warmed runner; qwen2: projection biases), K/V rows included."""
    for arch in ("llama", "qwen2"):
        runner = compiled[0] if arch == "llama" else llama_runner(tiny_model(arch), decode="compiled")
        ref = HF(tiny_model(arch))
        prompt = random_ids(37, seed=3)
        fed, ref_logits = ref.greedy(prompt, steps=6)
        table = BlockTable(runner.pool)
        run(runner, table, prompt)
        before = runner.forwards["compiled"]
        for token, want in zip(fed, ref_logits, strict=True):
            got = run(runner, table, [token])[0]
            assert torch.allclose(got, want, atol=1e-4, rtol=0), (arch, (got - want).abs().max())
            assert int(got.argmax()) == int(want.argmax())
        assert runner.forwards["compiled"] - before == len(fed), arch
        assert_rows(runner.pool, table, ref, table.length, atol=1e-4)
        table.release()


@pytest.mark.parametrize("decode", ["eager", pytest.param("compiled", marks=needs_inductor)])
def test_decode_ignores_nan_past_a_sequence(decode, request):
    """Rows of a sequence's blocks past its length are never part of its attention, whatever they hold."""
    if decode == "compiled":
        request.getfixturevalue("compiled")  # the compiled code (shared by every runner) is warm; own pool here
    runner = llama_runner(tiny_model("llama"), decode=decode)
    pool = runner.pool
    table = BlockTable(pool)
    table.reserve(32)
    for t in (pool.keys, pool.values):
        t[:, :, table.slots(0, 32)] = float("nan")
    ref = HF(tiny_model("llama"))
    ids = random_ids(21, seed=13)
    run(runner, table, ids[:20])
    ref(ids[:20])
    before = runner.forwards[decode]
    got = run(runner, table, ids[20:])
    assert runner.forwards[decode] == before + 1
    assert torch.isfinite(got).all()
    assert torch.allclose(got, ref(ids[20:]), atol=1e-4, rtol=0)
    table.release()


def test_a_failing_compiler_falls_back_to_eager_with_a_reason(monkeypatch):
    """A compile error on the first compiled forward leaves the eager path (HF's bits) with the error's first
    line as the reason, in the runner and in the engine's decode_info."""

    def broken_compile(fn, **kwargs):
        def fail(*args, **kw):
            raise RuntimeError("inductor: no compiler\nmore lines")

        return fail

    monkeypatch.setattr(torch, "compile", broken_compile)
    runner = llama_runner(tiny_model("llama"), decode="compiled")
    ref = HF(tiny_model("llama"))
    ids = random_ids(24, seed=6)
    table = BlockTable(runner.pool)
    assert torch.equal(run(runner, table, ids[:20]), ref(ids[:20]))
    for token in ids[20:]:
        assert torch.equal(run(runner, table, [token]), ref([token]))
    assert runner.fallback_reason == "RuntimeError: inductor: no compiler"
    assert runner.decode == "eager" and runner.forwards == {"eager": 5, "compiled": 0, "graphed": 0, "quantized": 0}
    monkeypatch.setattr("kvboost.runtime.llama.inductor_unavailable_reason", lambda: None)
    engine = make_engine("llama", decode="compiled")
    assert engine.decode_info()["decode"] == "compiled"
    engine.generate(random_ids(20, seed=1), 3)
    info = engine.decode_info()
    assert info["decode"] == "eager" and "inductor: no compiler" in info["decode_reason"]
    engine.close()


# ---------------------------------------------------------------------------------------------- flat batches
@pytest.mark.parametrize("decode", ["eager", pytest.param("compiled", marks=needs_inductor)])
def test_a_flat_batch_gives_each_sequence_its_logits_alone(decode, request):
    """Sequences of different lengths (one after a cached prefix) prefilled in one flat batch, then decoded
    together: each row's logits within 1e-5 of the sequence run alone, and the same greedy tokens."""
    if decode == "compiled":
        runner = request.getfixturevalue("compiled")[0]
    else:
        runner = llama_runner(tiny_model("llama"), decode="eager", num_blocks=64)
    pool = runner.pool
    prompts = [random_ids(n, seed=n) for n in (7, 23, 40)]
    cached = {2: 16}  # sequence 2 has its first 16 rows cached before the batch

    def start(b: int) -> BlockTable:
        table = BlockTable(pool)
        if b in cached:
            run(runner, table, prompts[b][: cached[b]])
        return table

    alone_tables = [start(b) for b in range(3)]
    batch_tables = [start(b) for b in range(3)]
    alone = [run(runner, t, p[t.length :])[0] for t, p in zip(alone_tables, prompts, strict=True)]
    with torch.inference_mode():
        together = runner.run(ForwardBatch.build([SeqInput(t, p[t.length :])
                                                  for t, p in zip(batch_tables, prompts, strict=True)]))  # fmt: skip
    tokens_alone, tokens_together = [[] for _ in prompts], [[] for _ in prompts]
    for _ in range(4):
        for b in range(3):
            assert torch.allclose(together[b], alone[b], atol=1e-5, rtol=0), (b, (together[b] - alone[b]).abs().max())
            tokens_alone[b].append(int(alone[b].argmax()))
            tokens_together[b].append(int(together[b].argmax()))
        alone = [run(runner, t, [tok[-1]])[0] for t, tok in zip(alone_tables, tokens_alone, strict=True)]
        with torch.inference_mode():
            together = runner.run(ForwardBatch.build([SeqInput(t, [tok[-1]])
                                                      for t, tok in zip(batch_tables, tokens_together, strict=True)]))  # fmt: skip
    assert tokens_alone == tokens_together
    for table in alone_tables + batch_tables:
        table.release()


# ---------------------------------------------------------------------------------------------- AWQ int4
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # without and with projection biases
def test_awq_int4_projections_are_hf_forward_with_the_same_modules(arch, dtype):
    """weights=int4: q/k/v and gate/up fused for torch's int4 CPU kernel (forwards of few rows; fp32 forwards of
    more rows run the modules themselves): HF's bits through the same modules, bf16 and fp32.

    Exact in fp32 too, on purpose: torch's int4 CPU kernel computes every output column on its own, so the fused
    [q; k; v] product equals the members' products to the bit. (A ~3e-7 fp32 difference was expected on CPUs
    without AMX; measured here on an AVX-512 BF16 Zen 4 without AMX, over 6 prompts, verification widths 2 and
    4, llama and qwen2: 0.0. A CPU where it differs should fail this test: it would be a kernel whose fused call
    is not the members' call, and the tolerance should then be chosen from what it shows.)"""
    from kvboost.models.awq import AWQLinear

    model = _awq_tiny(arch, dtype)
    assert isinstance(model.model.layers[0].self_attn.q_proj, AWQLinear)
    runner = llama_runner(model, decode="eager", weights="int4")
    assert all(isinstance(p, Int4Projections) for p in runner.projections)
    # the fused matrix holds the members' codes once: q_proj's rows (a whole packing block) are a view of it
    proj, q_proj = runner.projections[0], model.model.layers[0].self_attn.q_proj
    assert q_proj.int4pack(dtype)[0].untyped_storage().data_ptr() == proj.qkv_pack.weight.untyped_storage().data_ptr()
    exercise(runner, HF(_awq_tiny(arch, dtype)), random_ids(60, seed=10), verify=2)  # 2 rows: the fp32 int4 kernel
    assert runner.exact is False  # weights=int4 is not reported as the plain (exact) path


def test_awq_projections_through_their_modules_are_hf_forward(monkeypatch):
    """Where the one-row int4 kernel does not serve (cpu_kernel=dequant), nothing is fused: the path chosen is
    plain weights through the AWQ modules themselves (HF's calls, HF's bits), not int4."""
    from kvboost.models.awq import AWQLinear
    from kvboost.runtime.projections import ModuleProjections

    monkeypatch.setattr(AWQLinear, "cpu_kernel", "dequant")
    model = _awq_tiny("qwen2", torch.bfloat16)
    config = choose_runner(model, ATTENTION.build("sdpa"))
    assert (config.decode, config.weights) == ("eager", "plain") and "through their modules" in config.reasons[
        "weights"
    ]
    runner = llama_runner(model, decode="eager", weights=config.weights)
    assert all(isinstance(p, ModuleProjections) for p in runner.projections)
    exercise(runner, HF(_awq_tiny("qwen2", torch.bfloat16)), random_ids(60, seed=14))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dense_awq_prefill_from_the_threshold(arch):
    """model.awq_prefill=dense: forwards of DENSE_MIN_ROWS rows or more multiply fused dequantized copies (close
    to HF's forward through the dense modules, another product shape), fewer rows keep the int4 path (HF's bits)."""
    from kvboost.models.awq import DENSE_MIN_ROWS, set_awq_prefill

    model = set_awq_prefill(_awq_tiny(arch, torch.float32), "dense")
    runner = llama_runner(model, decode="eager", weights="int4")
    proj = runner.projections[0]
    assert proj.dense_min_rows == DENSE_MIN_ROWS
    for rows, path, atol in (
        (DENSE_MIN_ROWS - 1, "modules", 0.0),
        (DENSE_MIN_ROWS, "dense", 1e-4),
        (20, "dense", 1e-4),
    ):
        ref = HF(set_awq_prefill(_awq_tiny(arch, torch.float32), "dense"))
        ids = random_ids(9 + rows, seed=rows)
        table = BlockTable(runner.pool)
        same(run(runner, table, ids[:9]), ref(ids[:9]), 0.0)
        same(run(runner, table, ids[9:]), ref(ids[9:]), atol)
        assert proj._path == path, (rows, proj._path)
        assert_rows(runner.pool, table, ref, len(ids), atol=1e-4)
        table.release()


def test_dense_prefill_multiplies_dequantized_copies_from_the_threshold():
    """AWQLinear with dense prefill: below the threshold the int4 kernel, from it F.linear on a dequantized copy
    (another rounding of the same weights), rebuilt when a buffer is edited; the option is checked."""
    from kvboost.models.awq import DENSE_MIN_ROWS, AWQLinear, enable_dense_prefill

    torch.manual_seed(0)
    module = AWQLinear.from_linear(torch.nn.Linear(64, 96), group_size=32).to(torch.bfloat16)
    small = torch.randn(DENSE_MIN_ROWS - 1, 64, dtype=torch.bfloat16)
    large = torch.randn(DENSE_MIN_ROWS, 64, dtype=torch.bfloat16)
    int4_small, int4_large = module(small), module(large)
    holder = torch.nn.Sequential(module)
    assert enable_dense_prefill(holder) == 1
    dense = module.dequantized_weight(torch.bfloat16)
    assert torch.equal(module(small), int4_small)  # below the threshold: still the int4 kernel
    expected = torch.nn.functional.linear(large, dense) + module.bias.to(torch.bfloat16)
    assert torch.equal(module(large), expected)
    assert not torch.equal(expected, int4_large)  # really another path (another rounding)
    assert torch.allclose(expected.float(), int4_large.float(), atol=0.1, rtol=0.05)  # of the same weights
    module.qweight.add_(1)  # an edited buffer rebuilds the copy
    assert not torch.equal(module.dense_weight(torch.bfloat16), dense)
    enable_dense_prefill(holder, None)
    assert module.dense_min_rows is None and module._dense is None
    with pytest.raises(ValueError, match="min_rows"):
        enable_dense_prefill(holder, 0)


def test_awq_prefill_option_is_checked():
    from kvboost.models.awq import set_awq_prefill

    with pytest.raises(ValueError, match="no AWQ linears"):
        set_awq_prefill(tiny_model("llama"), "dense")
    with pytest.raises(ValueError, match="awq_prefill must be"):
        set_awq_prefill(_awq_tiny("llama", torch.float32), "int2")
    model = tiny_model("llama")
    assert set_awq_prefill(model, None) is model and set_awq_prefill(model, "int4") is model


def test_engines_on_awq_models(monkeypatch):
    """An AWQ engine decodes eagerly with fused int4 projections, the tokens of decode=hf; with dense prefill a
    prefix hit equals a cold prefill within 1e-4 (fp32) and the engine reports it; prepacked weights are refused."""
    from kvboost import KVBoost
    from kvboost.models.awq import set_awq_prefill

    monkeypatch.delenv("KVBOOST_DECODE", raising=False)

    def engine(model, **options):
        return KVBoost(model, ToyTokenizer(), model_identity="tiny-awq", chunker={"name": "fixed", "chunk_size": 16},
                       **options)  # fmt: skip

    ids = random_ids(20, seed=5)
    fused = engine(_awq_tiny("llama", torch.bfloat16))
    info = fused.decode_info()
    assert (info["runner"], info["decode"], info["prefill_weights"]) == ("llama", "eager", "int4")
    tokens = fused.generate(ids, 6, mode="cold").output_ids
    fused.close()
    hf = engine(_awq_tiny("llama", torch.bfloat16), decode="hf")
    assert hf.generate(ids, 6, mode="cold").output_ids == tokens
    hf.close()
    with pytest.raises(ValueError, match="AWQ"):
        engine(_awq_tiny("llama", torch.bfloat16), prefill_weights="prepacked")
    dense = engine(set_awq_prefill(_awq_tiny("llama", torch.float32), "dense"))
    assert dense.decode_info()["awq_prefill"] == "dense"
    prompt = random_ids(60, seed=9)
    dense.warm(prompt[:32])
    warm, cold = dense.generate(prompt, 6), dense.generate(prompt, 6, mode="cold")
    assert warm.cached_tokens == 32 and warm.output_ids == cold.output_ids
    assert torch.allclose(warm.first_token_logits, cold.first_token_logits, atol=1e-4, rtol=0)
    dense.close()


# ---------------------------------------------------------------------------------------------- prepacked weights
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_prepacked_weights_are_close_to_hf_forward(dtype):
    """weights=prepacked (oneDNN bf16 / MKL fp32 copies for forwards of several rows): logits within 1e-2 of
    their scale in bf16, 1e-4 in fp32, of HF's forward; the copies are reported."""
    reason = prepack_unavailable_reason(dtype, torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    model = tiny_model("qwen2").to(dtype)  # q/k/v biases, applied by the packed product
    runner = llama_runner(model, decode="eager", weights="prepacked")
    assert runner.packed is not None and all(isinstance(p, PackedProjections) for p in runner.packed)
    weights = sum(p.numel() * p.element_size() for layer in model.model.layers for name, p in layer.named_parameters()
                  if name.endswith("proj.weight"))  # fmt: skip
    assert runner.describe()["packed_weight_bytes"] >= weights
    assert not runner.exact
    ref = HF(tiny_model("qwen2").to(dtype))
    ids = random_ids(60, seed=11)
    table = BlockTable(runner.pool)
    for chunk in (ids[:31], ids[31:53], ids[53:54], ids[54:56]):
        got, want = run(runner, table, chunk), ref(chunk)
        tol = 1e-2 * float(want.abs().max()) if dtype == torch.bfloat16 else 1e-4
        assert float((got - want).abs().max()) <= tol
    assert_rows(runner.pool, table, ref, 56, atol=0.1 if dtype == torch.bfloat16 else 1e-4)


needs_onednn_bf16 = pytest.mark.skipif(prepack_unavailable_reason(torch.bfloat16, torch.device("cpu")) is not None,
                                       reason="no oneDNN bf16 linear in this torch")  # fmt: skip
needs_mkl_pack = pytest.mark.skipif(prepack_unavailable_reason(torch.float32, torch.device("cpu")) is not None,
                                    reason="no MKL packed GEMM in this torch")  # fmt: skip


@needs_onednn_bf16
def test_prepacked_linear_applies_weight_and_bias():
    from kvboost.models.prepack import PrepackedLinear

    gen = torch.Generator().manual_seed(2)
    w, b = (torch.randn(24, 40, generator=gen) * 0.1).bfloat16(), torch.randn(24, generator=gen).bfloat16()
    x = torch.randn(7, 40, generator=gen).bfloat16()
    linear = PrepackedLinear(w, b)
    assert linear.nbytes == 24 * 40 * 2
    assert torch.allclose(linear(x).float(), torch.nn.functional.linear(x, w, b).float(), atol=0.05, rtol=0.02)
    with pytest.raises(ValueError, match="takes 40"):
        linear(torch.randn(7, 41).bfloat16())


@needs_mkl_pack
def test_mkl_packed_linear_matches_f_linear():
    """MKL's packed product of any row count equals F.linear within fp32 rounding (the bias added after)."""
    from kvboost.models.mkl_pack import MklPackedLinear

    gen = torch.Generator().manual_seed(5)
    w, b = torch.randn(48, 80, generator=gen), torch.randn(48, generator=gen)
    for bias in (None, b):
        linear = MklPackedLinear(w, bias)
        for rows in (1, 3, 17, 64, 130):
            x = torch.randn(rows, 80, generator=gen)
            assert torch.allclose(linear(x), torch.nn.functional.linear(x, w, bias), atol=1e-5, rtol=1e-5)
        assert linear(torch.randn(0, 80)).shape == (0, 48)
        assert linear(torch.randn(6, 160)[:, ::2]).shape == (6, 48)  # a strided input is made contiguous
    with pytest.raises(ValueError, match="takes \\[rows, 80\\]"):
        linear(torch.randn(3, 81))
    with pytest.raises(ValueError, match="fp32 CPU inputs"):
        linear(torch.randn(3, 80).bfloat16())
    with pytest.raises(ValueError, match="2-D fp32"):
        MklPackedLinear(w.bfloat16(), None)


def test_prefill_weights_choice(monkeypatch):
    """auto packs only with the runner's prefill, plain projections, bf16 on a CPU with native bf16 and copies
    within the memory share; asking for prepacked where it cannot run is an error."""
    from kvboost.models import prepack
    from kvboost.models.prepack import choose_prefill_weights

    cpu = torch.device("cpu")
    ok = {"fused_prefill": True, "plain_projections": True, "dtype": torch.bfloat16, "device": cpu,
          "weight_bytes": 10, "memory_bytes": 1000}  # fmt: skip
    monkeypatch.setattr(prepack, "native_bf16_cpu", lambda: True)
    if prepack_unavailable_reason(torch.bfloat16, cpu) is None:
        assert choose_prefill_weights("auto", **ok) == ("prepacked", "auto")
        assert choose_prefill_weights("prepacked", **ok) == ("prepacked", "requested")
        mode, reason = choose_prefill_weights("auto", **{**ok, "weight_bytes": 51})
        assert mode == "plain" and "5%" in reason
        monkeypatch.setattr(prepack, "native_bf16_cpu", lambda: False)
        mode, reason = choose_prefill_weights("auto", **ok)
        assert mode == "plain" and "native bf16" in reason
    assert choose_prefill_weights("plain", **ok) == ("plain", "requested")
    mode, reason = choose_prefill_weights("auto", **{**ok, "dtype": torch.float32})
    assert mode == "plain" and ("keeps HF's bits" in reason or "MKL" in reason)
    if prepack_unavailable_reason(torch.float32, cpu) is None:  # fp32 packs for MKL when asked
        assert choose_prefill_weights("prepacked", **{**ok, "dtype": torch.float32}) == ("prepacked", "requested")
    for field, value, words in [("dtype", torch.float16, "serve bf16 and fp32"), ("fused_prefill", False, "fused prefill"),
                                ("plain_projections", False, "AWQ")]:  # fmt: skip
        mode, reason = choose_prefill_weights("auto", **{**ok, field: value})
        assert mode == "plain" and words in reason
        with pytest.raises(ValueError, match="prefill_weights='prepacked' cannot run here"):
            choose_prefill_weights("prepacked", **{**ok, field: value})
    with pytest.raises(ValueError, match="prefill_weights must be"):
        choose_prefill_weights("packed", **ok)


@needs_mkl_pack
def test_engine_with_prepacked_weights_reuses_within_1e4_in_fp32(monkeypatch):
    """fp32 packs only when asked; the engine reports it (and the packed bytes), keeps its entries apart in the
    fingerprint, and a prefix hit still equals a cold prefill within 1e-4 with the same greedy tokens."""
    monkeypatch.delenv("KVBOOST_DECODE", raising=False)
    engine = make_engine("llama", prefill_weights="prepacked", decode="eager")
    info = engine.decode_info()
    assert info["prefill_weights"] == "prepacked" and info["prefill_weights_reason"] == "requested"
    assert info["exact"] is False and "weights=prepacked" in engine.fingerprint
    weights = sum(p.numel() * 4 for layer in engine.model.model.layers for name, p in layer.named_parameters()
                  if name.endswith("proj.weight"))  # fmt: skip
    assert info["packed_weight_bytes"] >= weights
    prompt = random_ids(70, seed=9)
    engine.warm(prompt[:40])
    hit, cold = engine.generate(prompt, 6), engine.generate(prompt, 6, mode="cold")
    assert hit.cached_tokens == 40 and hit.output_ids == cold.output_ids
    assert torch.allclose(hit.first_token_logits, cold.first_token_logits, atol=1e-4, rtol=0)
    engine.close()
    plain = make_engine("llama", decode="eager")  # fp32 never packs under auto
    assert plain.decode_info()["prefill_weights"] == "plain" and "prefill_weights" not in plain.fingerprint
    plain.close()


# ---------------------------------------------------------------------------------------------- cpu_kernel backend
@pytest.mark.skipif(cpu_extension_unavailable_reason() is not None, reason=str(cpu_extension_unavailable_reason()))
def test_the_cpu_kernel_backend_is_close_to_hf_forward_in_fp32():
    """attn=cpu_kernel attends every eager forward (fp32 softmax and accumulation, not SDPA's bits): logits and
    K/V rows within 1e-5 of HF's forward, and the kernel really ran (one call per layer and forward)."""
    runner = llama_runner(tiny_model("llama"), attn="cpu_kernel", decode="eager")
    exercise(runner, HF(tiny_model("llama")), random_ids(60, seed=12), atol=1e-5)
    assert runner.attention.kernel_calls == 6 * runner.num_layers and runner.attention.fallback_calls == 0


# ---------------------------------------------------------------------------------------------- graphs' static forward
def _static(graphs: GraphRunner, batch: ForwardBatch) -> tuple[torch.Tensor, dict]:
    """What a replay computes, uncaptured: the bucket's buffers filled from ``batch`` (padding rows on the scratch
    block), then the static forward; returns the real rows' logits and the buffers."""
    key = graphs._bucket_of(batch)
    assert key is not None
    bufs = graphs._fill(key, batch)
    logits = graphs.static_forward(bufs)
    rows = batch.num_seqs if key[0] == "decode" else 1
    return logits[:rows], bufs


def _unchanged_but(pool: KVPool, before: tuple, slots: torch.Tensor, scratch: int) -> None:
    """Every pool row but ``slots`` and the scratch block's is as it was."""
    changed = torch.zeros(pool.num_blocks * pool.block_size, dtype=torch.bool)
    changed[slots] = True
    changed[scratch * pool.block_size : (scratch + 1) * pool.block_size] = True
    for now, then in zip((pool.keys, pool.values), before, strict=True):  # bits (the pool starts uninitialised)
        assert torch.equal(now[:, :, ~changed].view(torch.uint8), then[:, :, ~changed].view(torch.uint8))


def _reference_kernel(q, k, v, max_q_len=None, max_kv_len=None, dynamic_splits=False, **kwargs):
    """The paged attention contract's reference, taking (and ignoring) the launch hints the graphs pass."""
    from kvboost.kernels_triton.paged_attention_reference import paged_attention_reference

    return paged_attention_reference(q, k, v, **kwargs)


@pytest.mark.parametrize(("arch", "layer", "kernel"), [
    ("llama", "unfused", "reference"),
    ("llama", "unfused", "default"),
    pytest.param("llama", "compiled", "reference", marks=needs_inductor),
    pytest.param("llama", "fused", "reference", marks=triton_on_cpu),
    pytest.param("qwen2", "fused", "default", marks=triton_on_cpu),
])  # fmt: skip
def test_graph_static_forward_with_padding_rows_is_close_to_hf(arch, layer, kernel):
    """The arithmetic CUDA graphs capture, run uncaptured on CPU (paged attention: the reference, or the
    kernel ``paged_attention_kernel`` picks on CPU; the fused layer's kernels under the Triton interpreter): a
    decode bucket of 4 rows for 3 sequences and a prefill bucket of 32 rows for 21 tokens give HF's logits and
    K/V within 1e-4 (fp32; qwen2: q/k/v biases in the fused product); padding rows write only into the scratch
    block (every other pool row but the real rows' slots is unchanged)."""
    model = tiny_model(arch)
    runner = llama_runner(model, decode="eager", num_blocks=48)
    graphs = GraphRunner(runner, compile=layer == "compiled", fused=layer == "fused")
    if kernel == "reference":
        graphs._attention = _reference_kernel
        graphs._layer = graphs._layer_fn()
    assert graphs.describe()["graph_layer"] == layer
    pool = runner.pool
    # decode: three sequences (prefilled eagerly), one step in a bucket of 4
    prompts = [random_ids(n, seed=n) for n in (37, 9, 20)]
    refs = [HF(tiny_model(arch)) for _ in prompts]
    tables = [BlockTable(pool) for _ in prompts]
    tokens = []
    for table, prompt, ref in zip(tables, prompts, refs, strict=True):
        first = run(runner, table, prompt)
        assert torch.equal(first, ref(prompt))
        tokens.append(int(first.argmax()))
    with torch.inference_mode():
        batch = ForwardBatch.build([SeqInput(t, [tok]) for t, tok in zip(tables, tokens, strict=True)])
        assert graphs._bucket_of(batch) == ("decode", 4)
        assert not graphs.can_run(batch)  # replay needs CUDA: the runner never takes this path on CPU
        graphs._scratch_block()
        before = (pool.keys.clone(), pool.values.clone())
        logits, bufs = _static(graphs, batch)
    assert int(bufs["block_tables"][3, 0]) == graphs._scratch and int(bufs["slots"][3]) == graphs._scratch * 16
    _unchanged_but(pool, before, batch.slot_mapping, graphs._scratch)
    for b, (table, ref) in enumerate(zip(tables, refs, strict=True)):
        same(logits[b : b + 1], ref([tokens[b]]), 1e-4)
        assert_rows(pool, table, ref, table.length, atol=1e-4)
    # prefill: 21 tokens after 37 cached rows, padded to 32 rows
    table, ref = tables[0], refs[0]
    ids = random_ids(21, seed=99)
    with torch.inference_mode():
        batch = ForwardBatch.build([SeqInput(table, ids)])
        assert graphs._bucket_of(batch) == ("prefill", 32)
        before = (pool.keys.clone(), pool.values.clone())
        logits, bufs = _static(graphs, batch)
    assert bufs["q_positions"][21:].tolist() == list(range(59, 70))  # padding rows: later positions
    _unchanged_but(pool, before, batch.slot_mapping, graphs._scratch)
    same(logits, ref(ids), 1e-4)
    assert_rows(pool, table, ref, table.length, atol=1e-4)
    assert graphs.fallback_reason is None


def test_fused_weights_are_the_models_own_and_leave_hf_forward_unchanged():
    """The fused layer's q/k/v and gate/up weights are built in place: the modules' parameters become row slices
    of them (no second copy), HF's forward gives the same bits as before, and a second graph runner on the same
    model reuses them (no new copy); a fused layer that fails falls back to the unfused one with the reason."""
    model = tiny_model("qwen2")
    ids = torch.tensor([random_ids(20, seed=4)])
    with torch.inference_mode():
        before = model(ids).logits
    runner = llama_runner(model, decode="eager", num_blocks=48)
    graphs = GraphRunner(runner, compile=False, fused=True)
    fused = graphs._fused_weights[0]
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    q_rows, k_rows = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    assert attn.q_proj.weight.data_ptr() == fused.wqkv.data_ptr()
    assert attn.v_proj.weight.data_ptr() == fused.wqkv[q_rows + k_rows :].data_ptr()
    assert attn.k_proj.bias.data_ptr() == fused.bqkv[q_rows:].data_ptr()
    assert mlp.up_proj.weight.data_ptr() == fused.wgu[mlp.gate_proj.weight.shape[0] :].data_ptr()
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)
    again = GraphRunner(runner, compile=False, fused=True)._fused_weights[0]
    assert again.wqkv.data_ptr() == fused.wqkv.data_ptr() and again.wgu.data_ptr() == fused.wgu.data_ptr()
    assert torch.equal(again.wqkv, fused.wqkv) and again.wqkv.shape == fused.wqkv.shape
    graphs._unfuse(RuntimeError("a kernel that does not build"))
    assert not graphs.fused and "RuntimeError: a kernel that does not build" in graphs.fallback_reason
    assert graphs.describe()["graph_layer"] == "unfused"


@triton_on_cpu
def test_a_capture_never_clobbers_a_requests_inputs(monkeypatch):
    """GraphRunner.run captures a bucket on first use before filling its buffers (a capture fills them with
    padding and its warm-up runs write the pool's scratch block): checked on CPU with a stand-in capture that
    scribbles over every buffer a capture writes, as a capture sets them up, and leaves the bucket uncaptured (the
    static forward then runs as is); the logits are still HF's within 1e-4."""
    from kvboost.runtime import graphs as graphs_module

    def clobbering_capture(self, key):
        bufs = self._buffers(key)
        for name in ("tokens", "q_positions", "slots", "block_tables", "kv_lens"):
            bufs[name].fill_(7)
        if key[0] == "prefill":  # what the real capture sets for a prefill bucket
            bufs["query_start"][1] = key[1]
            bufs["logits_rows"].zero_()
        return graphs_module._Graph(None, None)

    monkeypatch.setattr(GraphRunner, "_capture", clobbering_capture)
    runner = llama_runner(tiny_model("llama"), decode="eager", num_blocks=48)
    graphs = GraphRunner(runner, compile=False)
    graphs._attention = _reference_kernel
    graphs._layer = graphs._layer_fn()
    ref = HF(tiny_model("llama"))
    ids = random_ids(40, seed=15)
    table = BlockTable(runner.pool)
    assert torch.equal(run(runner, table, ids[:20]), ref(ids[:20]))
    with torch.inference_mode():
        same(graphs.run(ForwardBatch.build([SeqInput(table, ids[20:38])])), ref(ids[20:38]), 1e-4)  # prefill 32
        for token in ids[38:]:
            same(graphs.run(ForwardBatch.build([SeqInput(table, [token])])), ref([token]), 1e-4)  # decode 1
    assert sorted(graphs._graphs) == [("decode", 1), ("prefill", 32)]


def test_graph_buckets():
    """Decode batches round up to powers of two, one-sequence prefills of one logits row to >= 16 rows; other
    batches (several logits rows, several prefills) have no bucket."""
    assert [bucket(n) for n in (1, 2, 3, 5, 64)] == [1, 2, 4, 8, 64]
    assert bucket(5, 16) == 16 and bucket(17, 16) == 32
    model = tiny_model("llama")
    runner = llama_runner(model, decode="eager")
    graphs = GraphRunner(runner, compile=False, max_graph_tokens=64)
    pool = runner.pool

    def key(seqs):
        key = graphs._bucket_of(ForwardBatch.build(seqs))
        for seq in seqs:
            seq.table.release()
        return key

    assert key([SeqInput(BlockTable(pool), [1, 2, 3])]) == ("prefill", 16)
    assert key([SeqInput(BlockTable(pool), list(range(65)))]) is None  # past max_graph_tokens
    assert key([SeqInput(BlockTable(pool), [1, 2, 3], logits=[0, 1, 2])]) is None  # verification rows
    assert key([SeqInput(BlockTable(pool), [1, 2]), SeqInput(BlockTable(pool), [3, 4])]) is None


# ---------------------------------------------------------------------------------------------- on a GPU
@needs_cuda
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("layer", ["fused", "unfused", "compiled"])
def test_graph_replay_equals_hf_on_cuda(layer, arch):
    """Captured decode and prefill graphs replay HF's numbers on the same GPU (fp32, 1e-3), capture per bucket,
    and never fall back (qwen2: the q/k/v biases inside the graph), for each layer variant."""
    model = tiny_model(arch).cuda()
    backend = serve(model)
    runner = LlamaRunner(model, make_pool(model, 48), backend, decode="graphed",
                         graph_options={"compile": layer == "compiled", "fused": layer == "fused", "max_batch": 4})  # fmt: skip
    runner.warmup(max_tokens=64)
    assert runner.graphs.fallback_reason is None, runner.graphs.fallback_reason
    assert runner.graphs.describe()["graph_layer"] == layer
    ref = HF(tiny_model(arch).cuda())
    prompt = random_ids(37, seed=3)
    fed, ref_logits = ref.greedy(prompt, steps=6)
    table = BlockTable(runner.pool)
    with torch.inference_mode():
        runner.run(ForwardBatch.build([SeqInput(table, prompt[:16])]))  # graphed prefill, bucket 16
        runner.run(ForwardBatch.build([SeqInput(table, prompt[16:])]))  # graphed prefill, bucket 32 (21 rows)
        for token, want in zip(fed, ref_logits, strict=True):
            got = runner.run(ForwardBatch.build([SeqInput(table, [token])]))[0]
            assert torch.allclose(got, want, atol=1e-3, rtol=0), (got - want).abs().max()
    assert runner.forwards["graphed"] == len(fed) + 2
    assert_rows(runner.pool, table, ref, table.length, atol=1e-3)
    assert all(g.graph is not None for g in runner.graphs._graphs.values())


@needs_cuda
def test_engine_decodes_graphed_on_cuda_with_the_greedy_tokens_of_eager():
    from kvboost import KVBoost

    def engine(decode):
        return KVBoost(tiny_model("llama").cuda(), ToyTokenizer(), model_identity="tiny-llama", decode=decode,
                       chunker={"name": "fixed", "chunk_size": 16})  # fmt: skip

    graphed = engine("auto")
    assert graphed.decode_info()["decode"] == "graphed" and graphed.decode_info()["prefill"] == "graphed"
    graphed.warmup(max_tokens=128)
    prompt = random_ids(120, seed=5)
    first = graphed.generate(prompt, max_new_tokens=16)
    assert graphed.decode_info()["forwards"]["graphed"] > 0
    graphed.close()
    eager = engine("eager")
    assert eager.generate(prompt, max_new_tokens=16).output_ids == first.output_ids
    eager.close()


@needs_cuda
def test_graphed_batched_decode_gives_each_row_its_single_run_on_cuda():
    """generate_batch on CUDA (graphed decode over several rows of the pool): each row's greedy tokens equal the
    same prompt generated alone (fp32)."""
    from kvboost import KVBoost

    engine = KVBoost(tiny_model("qwen2").cuda(), ToyTokenizer(), model_identity="tiny-qwen2",
                     chunker={"name": "fixed", "chunk_size": 16})  # fmt: skip
    engine.warmup(max_tokens=128)
    prompts = [random_ids(n, seed=n) for n in (20, 45, 70, 33, 90)]
    batched = engine.generate_batch(prompts, max_new_tokens=12)
    assert engine.decode_info()["forwards"]["graphed"] > 0
    engine.reset_cache()
    singles = [engine.generate(p, max_new_tokens=12).output_ids for p in prompts]
    engine.close()
    assert [r.output_ids for r in batched] == singles


# ---------------------------------------------------------------------------------------------- path choice
def test_choose_runner_picks_and_refuses_paths(monkeypatch):
    """auto on CPU: the Llama runner, compiled decode with sdpa; eager under batch_invariant and AWQ int4; the
    HF-generic runner for phi3; impossible requests are errors naming what would work."""
    from kvboost.models.prepack import native_bf16_cpu

    monkeypatch.delenv("KVBOOST_DECODE", raising=False)
    sdpa, invariant, eager_attn = (ATTENTION.build(n) for n in ("sdpa", "batch_invariant", "eager"))
    model = tiny_model("llama")
    config = choose_runner(model, sdpa)
    assert (config.runner, config.weights) == ("llama", "plain") and not config.graph_prefill
    if inductor_unavailable_reason() is None:
        assert config.decode == "compiled" and "CPU" in config.reasons["decode"]
    config = choose_runner(model, invariant)
    assert (config.runner, config.decode, config.weights) == ("llama", "eager", "plain")
    assert "batch_invariant" in config.reasons["decode"]
    assert choose_runner(model, eager_attn).decode == "eager"  # a backend that attends every forward
    with pytest.raises(ValueError, match="batch_invariant"):
        choose_runner(model, invariant, decode="compiled")
    with pytest.raises(ValueError, match="batch_invariant"):
        choose_runner(model, invariant, prefill_weights="prepacked")
    with pytest.raises(ValueError, match="CUDA"):
        choose_runner(model, sdpa, decode="graphed")
    with pytest.raises(ValueError, match="CUDA"):
        choose_runner(model, sdpa, prefill="graphed")
    with pytest.raises(ValueError, match="decode must be"):
        choose_runner(model, sdpa, decode="fast")
    with pytest.raises(ValueError, match="prefill must be"):
        choose_runner(model, sdpa, prefill="fast")
    assert choose_runner(model, sdpa, decode="hf").runner == "hf"
    assert choose_runner(model, sdpa, prefill="hf").runner == "hf"
    bf16 = tiny_model("llama").to(torch.bfloat16)
    if native_bf16_cpu() and prepack_unavailable_reason(torch.bfloat16, torch.device("cpu")) is None:
        assert choose_runner(bf16, sdpa).weights == "prepacked"
    assert choose_runner(bf16, sdpa, prefill_weights="plain").weights == "plain"
    handle = model.model.layers[1].register_forward_pre_hook(lambda *a: None)  # e.g. a layer streamer's
    config = choose_runner(model, sdpa)
    assert config.runner == "hf" and "hooks" in config.reasons["runner"]
    handle.remove()
    # other architectures
    for arch in ("phi3", "gemma"):
        config = choose_runner(tiny_model(arch), sdpa)
        assert (config.runner, config.decode, config.weights) == ("hf", "hf", "plain")
        with pytest.raises(ValueError, match="does not support"):
            choose_runner(tiny_model(arch), sdpa, decode="eager")
    # AWQ int4
    awq = _awq_tiny("llama", torch.bfloat16)
    config = choose_runner(awq, sdpa)
    assert (config.decode, config.weights) == ("eager", "int4") and "int4" in config.reasons["decode"]
    with pytest.raises(ValueError, match="AWQ int4"):
        choose_runner(awq, sdpa, prefill_weights="prepacked")
    with pytest.raises(ValueError, match="int4"):
        choose_runner(awq, sdpa, decode="compiled")
    # the environment, and a missing compiler
    monkeypatch.setenv("KVBOOST_DECODE", "eager")
    assert choose_runner(model, sdpa).decode == "eager"
    assert choose_runner(model, sdpa, decode="hf").runner == "hf"  # explicit beats the environment
    monkeypatch.setenv("KVBOOST_DECODE", "turbo")
    with pytest.raises(ValueError, match="KVBOOST_DECODE"):
        choose_runner(model, sdpa)
    monkeypatch.delenv("KVBOOST_DECODE")
    monkeypatch.setattr("kvboost.runtime.llama.inductor_unavailable_reason", lambda: "no C++ compiler")
    config = choose_runner(model, sdpa)
    assert config.decode == "eager" and config.reasons["decode"] == "not compiled: no C++ compiler"
    with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
        choose_runner(model, sdpa, decode="compiled")


def test_runner_constructor_refuses_what_it_cannot_run():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="decode must be"):
        LlamaRunner(model, make_pool(model), ATTENTION.build("sdpa"), decode="fast")
    for decode in ("compiled", "graphed"):
        with pytest.raises(ValueError, match="int4"):
            LlamaRunner(_awq_tiny("llama", torch.float32), make_pool(model), ATTENTION.build("sdpa"), decode=decode)
    other = tiny_model("llama", num_hidden_layers=3)
    with pytest.raises(ValueError, match="shape"):
        LlamaRunner(other, make_pool(model), ATTENTION.build("sdpa"))


def test_auto_dtype_follows_the_hardware(monkeypatch):
    from kvboost.models.compute import auto_dtype, describe
    from kvboost.models.loading import resolve_dtype

    monkeypatch.setattr("kvboost.models.compute.cpu_bf16_isa", lambda: None)
    assert auto_dtype("cpu")[0] == torch.float32
    assert resolve_dtype("auto", "cpu") == torch.float32
    monkeypatch.setattr("kvboost.models.compute.cpu_bf16_isa", lambda: "amx")
    assert auto_dtype("cpu") == (torch.bfloat16, "CPU with amx")
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    assert resolve_dtype("float32", "cpu") == torch.float32  # explicit dtypes are never changed
    info = describe(torch.bfloat16, "cpu", "auto")
    assert info["dtype"] == "bfloat16" and "amx" in info["matmul_path"] and info["dtype_reason"] == "CPU with amx"
    assert describe(torch.float32, "cpu", "float32")["matmul_path"].endswith("fp32 BLAS")
    with pytest.raises(ValueError, match="auto"):
        resolve_dtype("fp8")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_the_suffix_mask_is_what_sdpa_makes_of_the_bool_mask(dtype):
    """The causal-by-position mask built once per forward (sdpa backend): 0 where query i (position start + i)
    sees key j <= start + i, -inf elsewhere, and SDPA gives the same bits with it as with the bool mask."""
    mask = ATTENTION.build("sdpa").causal_mask(torch.arange(5, 9), 9, dtype)
    assert mask.shape == (1, 1, 4, 9) and mask.dtype == dtype
    allowed = torch.arange(9)[None, :] <= torch.arange(5, 9)[:, None]
    assert torch.equal(mask[0, 0] == 0, allowed) and bool(torch.isneginf(mask[0, 0][~allowed]).all())
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 6, 4, 16, generator=gen).to(dtype)
    k, v = (torch.randn(1, 2, 9, 16, generator=gen).to(dtype) for _ in range(2))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    assert torch.equal(
        sdpa(q, k, v, attn_mask=mask, enable_gqa=True), sdpa(q, k, v, attn_mask=allowed, enable_gqa=True)
    )


# ---------------------------------------------------------------------------------------------- the engine
def test_engine_decode_paths_give_the_same_tokens_and_stored_answers(monkeypatch):
    """Cold and reuse agree on every path, the KV written for generated tokens is reused by the next turn (which
    still equals a cold prefill within 1e-4), and hf / eager / compiled decode the same greedy tokens."""
    monkeypatch.delenv("KVBOOST_DECODE", raising=False)
    paths = ["hf", "eager"] + (["compiled"] if inductor_unavailable_reason() is None else [])
    outputs, bits = {}, {}
    for decode in paths:
        engine = make_engine("llama", decode=decode)
        info = engine.decode_info()
        assert info["decode"] == decode and info["runner"] == ("hf" if decode == "hf" else "llama")
        assert info["exact"] == (decode != "compiled")
        prompt = random_ids(48, seed=11)
        first = engine.generate(prompt, 12)
        assert engine.generate(prompt, 12, mode="cold").output_ids == first.output_ids
        follow = prompt + first.output_ids + random_ids(9, seed=12)
        cold = engine.generate(follow, 8, mode="cold")
        warm = engine.generate(follow, 8)
        assert warm.cached_tokens > len(prompt)  # the generated tokens' KV came from the store
        assert warm.output_ids == cold.output_ids
        assert torch.allclose(warm.first_token_logits, cold.first_token_logits, atol=1e-4, rtol=0)
        forwards = engine.decode_info()["forwards"]
        if decode == "compiled":
            assert forwards["compiled"] > 0
        elif decode == "eager":
            assert forwards["compiled"] == 0 and forwards["eager"] > 0
        outputs[decode] = (first.output_ids, warm.output_ids)
        bits[decode] = (first.first_token_logits, warm.first_token_logits, engine.attention.stats()["kernel_calls"])
        engine.close()
    assert all(out == outputs["hf"] for out in outputs.values()), outputs
    # the exact paths: HF's modules and the Llama runner's eager forward give the same bits, by the same calls
    assert torch.equal(bits["hf"][0], bits["eager"][0]) and torch.equal(bits["hf"][1], bits["eager"][1])
    assert bits["hf"][2] == bits["eager"][2]


def test_engine_warmup_reports_the_path(monkeypatch):
    monkeypatch.delenv("KVBOOST_DECODE", raising=False)
    engine = make_engine("llama", decode="eager")
    info = engine.warmup()
    assert {"runner", "decode", "decode_reason", "prefill", "prefill_weights", "exact", "forwards",
            "kv_pool"} <= set(info)  # fmt: skip
    assert info["runner"] == "llama" and info["decode"] == "eager" and info["exact"] is True
    assert info["decode_compile_s"] >= 0 and info["forwards"] == {"eager": 0, "compiled": 0, "graphed": 0, "quantized": 0}
    assert info["kv_pool"]["free_blocks"] == info["kv_pool"]["num_blocks"]  # warm-up gave its blocks back
    engine.close()
    phi = make_engine("phi3")
    info = phi.warmup()
    assert info["runner"] == "hf" and info["decode"] == "hf" and info["prefill"] == "hf"
    phi.close()


@needs_inductor
def test_engine_warmup_compiles_the_decode_forward(monkeypatch, compiled):
    """A compiled engine's warm-up compiles (or finds compiled) the decode forward; its requests then compile
    nothing (the warmed ``compiled`` fixture made sure the code cache holds this shape family)."""
    from torch._dynamo.utils import counters

    monkeypatch.delenv("KVBOOST_DECODE", raising=False)
    engine = make_engine("llama", decode="compiled")
    info = engine.warmup()
    assert info["decode"] == "compiled" and info["decode_compile_s"] > 0
    before = counters["stats"]["unique_graphs"]
    engine.generate(random_ids(40, seed=2), 6)
    assert counters["stats"]["unique_graphs"] == before
    assert engine.decode_info()["forwards"]["compiled"] == 5
    engine.close()
