"""The graphed decode step (kvboost.models.graphed_decode): its static-shape arithmetic against HF's forward
everywhere (eager and compiled), the CUDA graph itself where a GPU is present, and how the engine picks it."""

from __future__ import annotations

import pytest
import torch
from tiny import hf_greedy_reference, random_ids, tiny_model

from kvboost.models.adapter import ModelAdapter
from kvboost.models.decode_step import choose_decode, inductor_unavailable_reason
from kvboost.models.graphed_decode import MIN_BUCKET, MIN_PREFILL_ROWS, GraphedDecodeStep, bucket_for

needs_inductor = pytest.mark.skipif(
    inductor_unavailable_reason() is not None, reason=str(inductor_unavailable_reason())
)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_bucket_for_rounds_up_to_powers_of_two_and_caps_at_the_context():
    assert bucket_for(1) == MIN_BUCKET
    assert bucket_for(5, minimum=16) == 16 and bucket_for(17, minimum=16) == 32
    assert bucket_for(MIN_BUCKET) == MIN_BUCKET
    assert bucket_for(MIN_BUCKET + 1) == 2 * MIN_BUCKET
    assert bucket_for(3000) == 4096
    assert bucket_for(3000, max_rows=3010) == 3024  # capped at the context, 16-aligned
    assert bucket_for(100, max_rows=50) == 112  # never below the rows asked for, 16-aligned
    with pytest.raises(ValueError, match="positive"):
        bucket_for(0)


def _static_run(model, prompt: list[int], fed: list[int], *, compile: bool, size: int, **options):
    """Prefill through HF, copy the rows into a workspace of ``size`` rows (stale garbage past them), then feed
    ``fed`` through ``static_forward`` with tensor positions."""
    adapter = ModelAdapter(model, "tiny")
    step = GraphedDecodeStep(model, compile=compile, **options)
    with torch.inference_mode():
        kv = adapter.allocate(len(prompt) + len(fed) + 1)
        adapter.forward(torch.tensor(prompt), kv.cache)
        shape = (kv.keys.shape[0], kv.keys.shape[1], size, kv.keys.shape[3])
        keys = torch.randn(shape, generator=torch.Generator().manual_seed(9)).to(kv.keys.dtype)  # masked garbage
        values = torch.randn(shape, generator=torch.Generator().manual_seed(8)).to(kv.keys.dtype)
        keys[:, :, : len(prompt)] = kv.keys[:, :, : len(prompt)]
        values[:, :, : len(prompt)] = kv.values[:, :, : len(prompt)]
        logits = []
        for i, token in enumerate(fed):
            position = torch.tensor([len(prompt) + i])
            logits.append(step.static_forward(torch.tensor([token]), position, torch.tensor([0]), keys, values))
    return logits, keys, values


def _check(model, *, compile: bool, size: int, atol: float, **options):
    prompt = random_ids(37, seed=3)
    fed, ref_logits, ref_cache = hf_greedy_reference(model, prompt, steps=9)
    logits, keys, values = _static_run(model, prompt, fed, compile=compile, size=size, **options)
    for ref, got in zip(ref_logits, logits, strict=True):
        assert got.shape == ref.shape and got.dtype == torch.float32
        assert torch.allclose(got, ref, atol=atol, rtol=0), (got - ref).abs().max()
        assert int(got.argmax()) == int(ref.argmax())
    n = len(prompt) + len(fed)
    for i, layer in enumerate(ref_cache.layers):  # the rows the step wrote at its tensor positions
        assert torch.allclose(keys[i, :, :n], layer.keys[0, :, :n], atol=atol, rtol=0)
        assert torch.allclose(values[i, :, :n], layer.values[0, :, :n], atol=atol, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_static_arithmetic_equals_hf_forward(arch):
    """The masked attention over a whole bucket (garbage past the position) gives HF's logits and K/V rows."""
    _check(tiny_model(arch), compile=False, size=64, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # without and with projection biases
@pytest.mark.parametrize("options", [{"decode_attention": "matmul"}, {"fuse_projections": True},
                                     {"decode_attention": "matmul", "fuse_projections": True}],
                         ids=["matmul", "fused", "matmul_fused"])  # fmt: skip
def test_static_arithmetic_variants_equal_hf_forward(arch, options):
    """The decode variants the GPU profile compares (matmul attention, concatenated q/k/v and gate/up) compute
    HF's numbers too."""
    _check(tiny_model(arch), compile=False, size=64, atol=1e-4, **options)


def test_fused_projections_report_their_copies_and_bad_options_are_refused():
    model = tiny_model("qwen2")
    step = GraphedDecodeStep(model, compile=False, fuse_projections=True)
    layer = model.model.layers[0]
    per_layer = sum(p.numel() * 4 for p in (layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                            layer.self_attn.v_proj.weight, layer.self_attn.q_proj.bias,
                                            layer.self_attn.k_proj.bias, layer.self_attn.v_proj.bias,
                                            layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight))  # fmt: skip
    assert step.packed_bytes == per_layer * len(model.model.layers)
    assert GraphedDecodeStep(model, compile=False).packed_bytes == 0
    with pytest.raises(ValueError, match="decode_attention"):
        GraphedDecodeStep(model, compile=False, decode_attention="flash")


@needs_inductor
@pytest.mark.slow
@pytest.mark.parametrize("options", [{}, {"decode_attention": "matmul", "fuse_projections": True}],
                         ids=["sdpa", "matmul_fused"])  # fmt: skip
def test_compiled_static_arithmetic_equals_hf_forward_at_two_bucket_sizes(options):
    """What the GPU graph holds (torch.compile, dynamic shapes) on CPU's inductor: HF's numbers, and a second
    workspace size does not compile again."""
    from torch._dynamo.utils import counters

    model = tiny_model("qwen2")  # projection biases
    counters.clear()
    _check(model, compile=True, size=80, atol=1e-4, **options)  # sizes unlike any model dimension
    first = counters["stats"]["unique_graphs"]
    assert first > 0
    _check(model, compile=True, size=112, atol=1e-4, **options)
    assert counters["stats"]["unique_graphs"] == first, "a new bucket size compiled again"


@pytest.mark.parametrize("fuse", [False, True])
@pytest.mark.parametrize("start", [0, 37])
def test_static_prefill_of_padded_rows_equals_hf_forward(start, fuse):
    """A prefill of 21 tokens run as 32 rows (11 padding rows at later positions) after ``start`` cached rows:
    the last real token's logits and the real rows' K/V are HF's; the padding changes nothing before it."""
    model = tiny_model("llama")
    ids = random_ids(start + 21, seed=4)
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([ids]), use_cache=True)
    step = GraphedDecodeStep(model, compile=False, fuse_projections=fuse, decode_attention="matmul")
    adapter = ModelAdapter(model, "tiny")
    with torch.inference_mode():
        kv = adapter.allocate(len(ids) + 1)
        if start:
            adapter.forward(torch.tensor(ids[:start]), kv.cache)
        shape = (kv.keys.shape[0], kv.keys.shape[1], 80, kv.keys.shape[3])
        keys, values = torch.randn(shape), torch.randn(shape)  # garbage everywhere but the cached rows
        keys[:, :, :start], values[:, :, :start] = kv.keys[:, :, :start], kv.values[:, :, :start]
        tokens = torch.tensor(ids[start:] + [0] * 11)
        logits = step.static_forward(tokens, torch.arange(start, start + 32), torch.tensor([20]), keys, values)
    assert torch.allclose(logits, ref.logits[0, -1].float(), atol=1e-4, rtol=0)
    for i, layer in enumerate(ref.past_key_values.layers):
        assert torch.allclose(keys[i, :, : len(ids)], layer.keys[0], atol=1e-4, rtol=0)
        assert torch.allclose(values[i, :, : len(ids)], layer.values[0], atol=1e-4, rtol=0)


def test_prefill_shapes_pad_to_row_buckets_and_refuse_what_does_not_fit():
    step = GraphedDecodeStep(tiny_model("llama"), compile=False, max_graph_tokens=128)  # context: 512 rows
    assert step.prefill_shape(0, 5) == (MIN_BUCKET, MIN_PREFILL_ROWS)
    assert step.prefill_shape(250, 10) == (512, 16)  # 250 + 16 padded rows need the 512-row workspace
    assert step.prefill_shape(0, 128) == (MIN_BUCKET, 128)
    assert step.prefill_shape(0, 129) is None  # past max_graph_tokens: HF's forward
    assert step.prefill_shape(500, 10) == (528, 16)  # padding rows past the 512-row context: dropped
    assert step.prefill_shape(0, 0) is None
    with pytest.raises(ValueError, match="max_graph_tokens"):
        GraphedDecodeStep(tiny_model("llama"), compile=False, max_graph_tokens=8)


def test_graphed_prefill_is_refused_off_cuda_and_auto_keeps_the_cpu_path():
    from kvboost.models.prefill_step import choose_prefill

    model = tiny_model("llama")
    with pytest.raises(ValueError, match="CUDA"):
        choose_prefill("graphed", model, "sdpa", "compiled")
    assert choose_prefill("auto", model, "sdpa", "compiled")[0] == "fused"


def test_a_capture_never_clobbers_a_requests_rows_or_inputs(monkeypatch):
    """Captures happen on first use of a (workspace, rows) pair, and their warm-up runs overwrite the input
    buffers and workspace rows: prefill and decode must capture before they fill those. Checked on CPU with a
    stand-in capture that clobbers both (and leaves the pair uncaptured, so the forward runs eagerly)."""
    from kvboost.models import graphed_decode

    def clobbering_capture(self, size, rows):
        keys, values = self._workspace(size)
        keys.normal_()
        values.normal_()
        for buffer in self._input_buffers(rows):
            buffer.fill_(7)
        return graphed_decode._Graph(None, None)

    monkeypatch.setattr(GraphedDecodeStep, "_capture", clobbering_capture)
    model = tiny_model("llama")
    prompt = random_ids(50, seed=7)
    fed, ref_logits, _ = hf_greedy_reference(model, prompt, steps=6)
    with torch.inference_mode():
        ref_first = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    step = GraphedDecodeStep(model, compile=False)
    adapter = ModelAdapter(model, "tiny")
    with torch.inference_mode():
        kv = adapter.allocate(len(prompt) + len(fed) + 1)
        adapter.forward(torch.tensor(prompt[:30]), kv.cache)
        first = step.prefill(torch.tensor(prompt[30:]), 30, kv)  # captures (256, 32) on first use
        kv.set_length(len(prompt))
        step.begin(kv, len(prompt))  # captures (256, 1) on first use
        logits = [step(t) for t in fed]
        step.finish(kv)
    assert torch.allclose(first, ref_first, atol=1e-4, rtol=0)
    for ref, got in zip(ref_logits, logits, strict=True):
        assert torch.allclose(got, ref, atol=1e-4, rtol=0)
    assert step.captured == [(MIN_BUCKET, 1), (MIN_BUCKET, 32)]


def test_graphed_mode_needs_cuda_and_is_not_auto_on_cpu():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="CUDA"):
        choose_decode("graphed", model, "sdpa")
    assert choose_decode("auto", model, "sdpa")[0] in ("compiled", "eager")
    with pytest.raises(RuntimeError, match="CUDA"):
        step = GraphedDecodeStep(model, compile=False)
        step.warmup()


def test_graphed_step_refuses_int4_projections(monkeypatch):
    import kvboost.models.graphed_decode as graphed

    monkeypatch.setattr(graphed, "has_int4_projections", lambda model: True)
    with pytest.raises(ValueError, match="int4"):
        GraphedDecodeStep(tiny_model("llama"), compile=False)


# ---------------------------------------------------------------------- on a GPU
def _cuda_engine(decode: str):
    from tiny import ToyTokenizer

    from kvboost import KVBoost

    return KVBoost(tiny_model("llama").cuda(), ToyTokenizer(), model_identity="tiny-llama", decode=decode,
                   chunker={"name": "fixed", "chunk_size": 16})  # fmt: skip


@needs_cuda
@pytest.mark.parametrize("compile", [False, True])
def test_graph_replay_equals_hf_on_cuda(compile):
    """The captured graph decodes what HF's forward decodes on the same GPU (fp32: logits within 1e-3), writes
    its rows back at ``finish``, and a longer request captures a second bucket."""
    model = tiny_model("llama").cuda()
    prompt = random_ids(37, seed=3)
    fed, ref_logits, ref_cache = hf_greedy_reference(model, prompt, steps=9)
    adapter = ModelAdapter(model, "tiny")
    step = GraphedDecodeStep(model, compile=compile)
    step.warmup()
    with torch.inference_mode():
        for extra in (0, 300):  # the second request needs the 512-row bucket
            kv = adapter.allocate(len(prompt) + len(fed) + 1 + extra)
            adapter.forward(torch.tensor(prompt), kv.cache)
            assert step.can_run(kv, len(prompt), len(fed) + extra)
            step.begin(kv, len(prompt), reserve=len(prompt) + len(fed) + extra)
            logits = [step(t) for t in fed]
            step.finish(kv)
            for ref, got in zip(ref_logits, logits, strict=True):
                assert torch.allclose(got, ref, atol=1e-3, rtol=0), (extra, (got - ref).abs().max())
            n = len(prompt) + len(fed)
            assert kv.length() == n
            for i, layer in enumerate(ref_cache.layers):
                assert torch.allclose(kv.keys[i, :, :n], layer.keys[0, :, :n], atol=1e-3, rtol=0), (extra, i)
    assert (MIN_BUCKET, 1) in step.captured and (2 * MIN_BUCKET, 1) in step.captured
    assert all(entry.graph is not None for entry in step._graphs.values()), step.fallback_reason


@needs_cuda
@pytest.mark.parametrize("start", [0, 37])
def test_graphed_prefill_equals_hf_on_cuda(start):
    """A replayed prefill graph (21 tokens padded to 32 rows) gives HF's last logits and writes HF's K/V rows
    into the request's buffers (fp32, reference: HF's forward on the same GPU)."""
    ids = random_ids(start + 21, seed=4)
    model = tiny_model("llama").cuda()
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([ids], device="cuda"), use_cache=True)
    adapter = ModelAdapter(model, "tiny")
    step = GraphedDecodeStep(model, compile=True)
    with torch.inference_mode():
        kv = adapter.allocate(len(ids) + 1)
        if start:
            adapter.forward(torch.tensor(ids[:start]), kv.cache)
        logits = step.prefill(torch.tensor(ids[start:]), start, kv)
    assert step.captured == [(MIN_BUCKET, 32)], step.captured
    assert step._graphs[(MIN_BUCKET, 32)].graph is not None, step.fallback_reason
    diff = (logits - ref.logits[0, -1].float()).abs().max()
    assert torch.allclose(logits, ref.logits[0, -1].float(), atol=1e-3, rtol=0), diff
    for i, layer in enumerate(ref.past_key_values.layers):
        assert torch.allclose(kv.keys[i, :, : len(ids)], layer.keys[0], atol=1e-3, rtol=0), i


@needs_cuda
def test_engine_decodes_graphed_on_cuda_with_the_greedy_tokens_of_eager():
    graphed = _cuda_engine("auto")
    assert graphed.decode_mode == "graphed", graphed.decode_reason
    assert graphed.prefill_mode == "graphed", graphed.prefill_reason
    info = graphed.warmup(max_tokens=300)
    assert info["decode"] == "graphed" and info["decode_compile_s"] > 0
    assert (512, 1) in graphed._decode_step.captured and (512, 256) in graphed._decode_step.captured
    assert graphed._decode_step.fallback_reason is None, graphed._decode_step.fallback_reason
    prompt = random_ids(120, seed=5)
    first = graphed.generate(prompt, max_new_tokens=24)
    # the next turn reuses the generated rows: finish() copied them back before the engine stored them
    turn2 = prompt + first.output_ids[:-1] + random_ids(20, seed=6)
    second = graphed.generate(turn2, max_new_tokens=8)
    assert second.cached_tokens > len(prompt)
    graphed.close()
    eager = _cuda_engine("eager")
    assert eager.prefill_mode == "hf"
    assert eager.generate(prompt, max_new_tokens=24).output_ids == first.output_ids
    assert eager.generate(turn2, max_new_tokens=8, mode="cold").output_ids == second.output_ids
    eager.close()
