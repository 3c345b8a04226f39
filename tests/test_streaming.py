"""Layer streaming (kvboost.streaming; issue 12 item 2): streamed logits equal fully resident ones exactly, the
engine generates the same tokens and reuses KV as before, prefetch overlaps loads with compute, the planner
refuses budgets with the numbers, streamed layers own no storage, and the fingerprint is the resident model's."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from kvboost_testkit.tiny import VOCAB, ToyTokenizer, random_ids, tiny_model

from kvboost import KVBoost
from kvboost.models.fingerprint import ModelFingerprint
from kvboost.streaming import (
    StreamingBudgetError,
    StreamingConfig,
    build_streamed_model,
    plan_streaming,
)

LAYERS = 4
SEP = "\n\n"


def _save(model, folder):
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    model = tiny_model("llama", num_hidden_layers=LAYERS, max_position_embeddings=1024)
    return _save(model, tmp_path_factory.mktemp("tiny") / "fp32")


@pytest.fixture(scope="module")
def resident(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits


@pytest.mark.parametrize("resident_layers", [0, 1, LAYERS])
@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("slots", [1, 2])
def test_streamed_logits_equal_resident_exactly(folder, resident, resident_layers, prefetch, slots):
    model = build_streamed_model(folder, {"resident_layers": resident_layers, "prefetch": prefetch, "slots": slots})
    ids = torch.tensor([random_ids(23, seed=1)])
    want = _logits(resident, ids)
    for _ in range(2):  # the second forward reuses slots (and, with prefetch, the wrapped-around first layer)
        assert torch.equal(_logits(model, ids), want)
    # and with a KV cache: prefill, then one token at a time
    from transformers import DynamicCache

    with torch.inference_mode():
        c1, c2 = DynamicCache(), DynamicCache()
        a = model(ids[:, :15], past_key_values=c1, use_cache=True).logits
        b = resident(ids[:, :15], past_key_values=c2, use_cache=True).logits
        assert torch.equal(a, b)
        for t in range(15, 23):
            a = model(ids[:, t : t + 1], past_key_values=c1, use_cache=True).logits
            b = resident(ids[:, t : t + 1], past_key_values=c2, use_cache=True).logits
            assert torch.equal(a, b)
    streamer = model._kvboost_streamer
    if resident_layers == LAYERS:
        assert streamer is None
    else:
        assert streamer.overlap == (prefetch and slots >= 2)
        assert streamer.stats["loads"] > 0


def test_engine_greedy_generation_identical(folder, resident):
    prompts = [random_ids(40, seed=s) for s in range(3)]
    model = build_streamed_model(folder, {"resident_layers": 1})
    streamed = KVBoost(model, ToyTokenizer(), decode="hf", chunker={"name": "fixed", "chunk_size": 16})
    plain = KVBoost(copy.deepcopy(resident), ToyTokenizer(), decode="hf", chunker={"name": "fixed", "chunk_size": 16})
    # the engine really streams: layers 1..3 are not resident, and their weights are placeholders between forwards
    streamer = model._kvboost_streamer
    assert streamer is not None and tuple(streamer.streamed) == tuple(range(1, LAYERS))
    layers = model.model.layers
    for ids in prompts:
        loads = streamer.stats["loads"]
        a = streamed.generate(ids, max_new_tokens=12, mode="cold")
        b = plain.generate(ids, max_new_tokens=12, mode="cold")
        assert a.output_ids == b.output_ids
        assert torch.equal(a.first_token_logits, b.first_token_logits)
        # 3 streamed layers through 2 slots: every forward (a prefill, then one per decoded token) loads weights
        assert streamer.stats["loads"] - loads >= len(a.output_ids)
        assert all(p.device.type == "meta" for i in streamer.streamed for p in layers[i].parameters())
        assert all(p.device.type != "meta" for p in layers[0].parameters())


def test_exact_prefix_reuse_with_streaming(folder, resident):
    engine = KVBoost(build_streamed_model(folder, {"resident_layers": 2, "slots": 2}), ToyTokenizer(), decode="hf",
                     chunker={"name": "fixed", "chunk_size": 16})  # fmt: skip
    plain = KVBoost(copy.deepcopy(resident), ToyTokenizer(), decode="hf", chunker={"name": "fixed", "chunk_size": 16})
    first = random_ids(50, seed=3)
    engine.generate(first, max_new_tokens=6)
    follow = first + random_ids(20, seed=4)
    r = engine.generate(follow, max_new_tokens=8)
    cold = plain.generate(follow, max_new_tokens=8, mode="cold")
    assert r.exact_hit_tokens >= 48
    assert r.output_ids == cold.output_ids
    assert float((r.first_token_logits - cold.first_token_logits).abs().max()) <= 1e-4


@pytest.mark.parametrize("recompute", ["full", "cacheblend"])
def test_content_hits_with_streaming(folder, resident, recompute):
    docs = ["Alpha: the red fox lives in the northern forest. " * 2, "Beta: copper wires carry current well. " * 2]
    prompt = SEP.join(["System: answer.", docs[1], docs[0], "Question: who lives in the forest?"])
    chunker = {"name": "separator", "separator": SEP, "chunk_size": 16}
    results = []
    for model in (build_streamed_model(folder, {"resident_layers": 1, "prefetch": True}), copy.deepcopy(resident)):
        engine = KVBoost(model, ToyTokenizer(), decode="hf", chunker=chunker, recompute=recompute)
        for doc in docs:
            engine.warm(doc)
        results.append(engine.generate(prompt, max_new_tokens=6))
    streamed, plain = results
    assert streamed.content_hit_tokens > 0 and streamed.content_hit_tokens == plain.content_hit_tokens
    assert torch.equal(streamed.first_token_logits, plain.first_token_logits)
    assert streamed.output_ids == plain.output_ids


# ---------------------------------------------------------------------------------------------- prefetch
def _gate_layer(model, streamer, layer: int, nxt: int):
    """Make ``layer``'s compute wait (bounded) until the load of ``nxt`` has started; returns the started event."""
    started = threading.Event()
    started.overlapped = []  # one bool per gated compute: did the load start while the layer waited?
    source = streamer.source
    read_into = source.read_into

    def spy(name, out, **kw):
        if name.startswith(f"model.layers.{nxt}."):
            started.set()
        return read_into(name, out, **kw)

    source.read_into = spy

    def gate(module, args):
        started.overlapped.append(started.wait(timeout=5.0))  # returning None keeps the arguments

    model.model.layers[layer].self_attn.register_forward_pre_hook(gate)
    return started


def test_prefetch_overlaps_the_next_load_with_compute(folder):
    model = build_streamed_model(folder, {"resident_layers": 0, "prefetch": True, "slots": 2}, trace=True)
    streamer = model._kvboost_streamer
    # Layer 1's attention blocks until layer 2's load has started: only a load running during layer 1's
    # compute can release it (a sequential loader would time out).
    started = _gate_layer(model, streamer, 1, 2)
    _logits(model, torch.tensor([random_ids(9)]))
    assert started.overlapped and all(started.overlapped), "layer 2's load did not start while layer 1 computed"
    events = streamer.events
    t = {(kind, layer): ts for ts, kind, layer in reversed(events)}  # first occurrence of each
    for i in range(LAYERS - 1):
        # queued before layer i finished (whether the loader thread starts it before a tiny layer's compute ends
        # is the scheduler's choice; the gate above shows a load really running during a compute)
        assert t[("load_queued", i + 1)] < t[("compute_end", i)], f"layer {i + 1} queued after layer {i} finished"
    # wrap-around: the first streamed layer is loaded for the next forward while the last one computes
    assert any(
        kind == "load_queued" and layer == 0 and ts > t[("compute_end", LAYERS - 2)] for ts, kind, layer in events
    )


def test_without_prefetch_loads_wait_for_compute(folder):
    model = build_streamed_model(folder, {"resident_layers": 0, "prefetch": False}, trace=True)
    _logits(model, torch.tensor([random_ids(9)]))
    t = {(kind, layer): ts for ts, kind, layer in reversed(model._kvboost_streamer.events)}
    for i in range(LAYERS - 1):
        assert t[("load_start", i + 1)] > t[("compute_end", i)]


# ---------------------------------------------------------------------------------------------- memory
def test_streamed_layers_own_no_storage(folder):
    model = build_streamed_model(folder, {"resident_layers": 1, "slots": 2})
    plan, streamer = model._kvboost_streaming_plan, model._kvboost_streamer
    assert plan.streamed == (1, 2, 3)
    for i in plan.streamed:
        for name, t in list(model.model.layers[i].named_parameters()) + list(model.model.layers[i].named_buffers()):
            if name.endswith("inv_freq"):
                continue
            assert t.device.type == "meta", name
    storages = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta":
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert sum(storages.values()) == plan.resident_bytes  # (the planner counts the rotary buffers too)
    assert [s.buffer.numel() for s in streamer.slots] == [plan.slot_bytes] * 2
    assert plan.total_bytes == plan.resident_bytes + 2 * plan.slot_bytes + plan.kv_bytes
    # during the forward, a streamed layer's weights are views of a slot; after it, placeholders again
    seen = []
    model.model.layers[2].mlp.register_forward_pre_hook(
        lambda m, a: seen.append(m.down_proj.weight.untyped_storage().data_ptr())
    )
    _logits(model, torch.tensor([random_ids(5)]))
    assert seen and seen[0] in {s.buffer.untyped_storage().data_ptr() for s in streamer.slots}
    assert model.model.layers[2].mlp.down_proj.weight.device.type == "meta"


def test_planner_refuses_a_budget_that_cannot_hold_the_resident_part(folder):
    with pytest.raises(StreamingBudgetError, match=r"MiB.*resident.*staging slot.*KV for 1024 tokens"):
        build_streamed_model(folder, {"budget": 1000})
    with pytest.raises(StreamingBudgetError, match=r"cannot hold the resident part.*over by"):
        build_streamed_model(folder, {"resident_layers": LAYERS, "budget": "0.1MiB"})
    # numbers: 4 layers of 10 MiB, base 5 MiB, 1 KiB of KV per token
    cfg = StreamingConfig.parse({"budget": 40 << 20, "kv_tokens": 1024})
    plan = plan_streaming(cfg, base_bytes=5 << 20, layer_bytes=[10 << 20] * 4, kv_bytes_per_token=1024)
    assert plan.resident == (0,) and plan.total_bytes == (5 + 10 + 20 + 1) << 20
    cfg = StreamingConfig.parse({"budget": "24MiB", "kv_tokens": 1024})
    with pytest.raises(StreamingBudgetError) as err:
        plan_streaming(cfg, base_bytes=5 << 20, layer_bytes=[10 << 20] * 4, kv_bytes_per_token=1024)
    assert "embeddings/norm/head 5.0 MiB" in str(err.value) and "total 26.0 MiB" in str(err.value)


def test_budget_alone_picks_resident_layers(folder):
    full = build_streamed_model(folder, {"resident_layers": LAYERS})._kvboost_streaming_plan
    budget = full.base_bytes + 2 * full.layer_bytes[0] + 2 * full.layer_bytes[0] + full.kv_bytes
    model = build_streamed_model(folder, {"budget": budget})
    assert model._kvboost_streaming_plan.resident == (0, 1)
    assert model._kvboost_streaming_plan.total_bytes <= budget


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"resident_layers": 1, "slotz": 2}, r"unknown field\(s\) \['slotz'\]"),
        ({"resident_layers": 1, "slots": 0}, r"slots must be an integer >= 1"),
        ({"resident_layers": LAYERS + 1}, rf"resident_layers={LAYERS + 1} but the model has {LAYERS}"),
        ({"resident_first": 3, "resident_last": 2}, r"more than the model's 4 decoder layers"),
        ({"resident_layers": 1, "resident_first": 1}, r"not both"),
        ({"prefetch": True}, r"say what stays resident"),
        ({"resident_layers": -1}, r"non-negative integer"),
        ({"resident_layers": 1, "source": "disk"}, r"source must be one of"),
        ({"resident_layers": 1, "source": "pinned"}, r"on CPU use 'mmap'"),
        ({"resident_layers": 1, "prefetch": "yes"}, r"prefetch must be true, false or 'auto'"),
    ],
)
def test_bad_streaming_config_is_a_clear_error(folder, spec, message):
    with pytest.raises(ValueError, match=message):
        build_streamed_model(folder, spec)


def test_streaming_off_specs():
    for spec in (None, "none", {"name": "none"}, False):
        assert StreamingConfig.parse(spec) is None


def test_first_and_last_layers_resident(folder, resident):
    model = build_streamed_model(folder, {"resident_first": 1, "resident_last": 1, "source": "resident"})
    assert model._kvboost_streaming_plan.streamed == (1, 2)
    ids = torch.tensor([random_ids(17, seed=5)])
    assert torch.equal(_logits(model, ids), _logits(resident, ids))


# ---------------------------------------------------------------------------------------------- fingerprint
def test_streamed_fingerprint_equals_resident_and_sees_a_changed_weight(folder, resident, tmp_path):
    fp_resident = ModelFingerprint(resident, "tiny", disk_cache=False).current()
    for k in (0, 2):
        model = build_streamed_model(folder, {"resident_layers": k})
        assert ModelFingerprint(model, "tiny", disk_cache=False).current() == fp_resident
    changed = copy.deepcopy(resident)
    with torch.no_grad():
        changed.model.layers[3].mlp.up_proj.weight[0, 0] += 1.0
    other = _save(changed, tmp_path / "changed")
    streamed_other = build_streamed_model(other, {"resident_layers": 1})
    fp_other = ModelFingerprint(streamed_other, "tiny", disk_cache=False).current()
    assert fp_other != fp_resident
    assert fp_other == ModelFingerprint(changed, "tiny", disk_cache=False).current()
    # the digest streams the file: the streamed layers still own no storage afterwards
    assert streamed_other.model.layers[3].mlp.up_proj.weight.device.type == "meta"


# ---------------------------------------------------------------------------------------------- from_pretrained
@pytest.fixture(scope="module")
def folder_with_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    from kvboost.models.loading import bundled_model_dir

    try:
        tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir())
    except (FileNotFoundError, OSError) as exc:
        pytest.skip(f"no bundled tokenizer: {exc}")
    model = tiny_model("llama", num_hidden_layers=LAYERS, vocab_size=len(tokenizer), max_position_embeddings=1024)
    folder = _save(model, tmp_path_factory.mktemp("tok") / "m")
    tokenizer.save_pretrained(str(folder))
    return folder


def test_from_pretrained_with_streaming(folder_with_tokenizer):
    streamed = KVBoost.from_pretrained(str(folder_with_tokenizer), dtype="float32",
                                       streaming={"resident_layers": 2, "prefetch": True})  # fmt: skip
    plain = KVBoost.from_pretrained(str(folder_with_tokenizer), dtype="float32", decode="hf")
    assert streamed.streamer is not None and streamed.streamer.streamed == (2, 3)
    info = streamed.decode_info()
    # the streamer swaps weights in forward hooks, which only HF's modules fire: the HF-generic runner
    assert info["runner"] == "hf" and info["decode"] == "hf" and "hooks" in info["decode_reason"]
    assert info["prefill"] == "hf" and "hooks" in info["prefill_reason"]
    assert streamed.fingerprint == plain.fingerprint
    a = streamed.generate("Tell me about foxes.", max_new_tokens=8, mode="cold")
    b = plain.generate("Tell me about foxes.", max_new_tokens=8, mode="cold")
    assert a.output_ids == b.output_ids
    with pytest.raises(ValueError, match="forward hooks that only HF.s modules fire"):
        KVBoost.from_pretrained(str(folder_with_tokenizer), dtype="float32", decode="eager",
                                streaming={"resident_layers": 1})  # fmt: skip
    none = KVBoost.from_pretrained(str(folder_with_tokenizer), dtype="float32", decode="hf", streaming="none")
    assert none.streamer is None


# ---------------------------------------------------------------------------------------------- AWQ
def _awq_available() -> str | None:
    try:
        from kvboost.models.awq import AWQConfig, quantize_model_rtn, save_awq_folder  # noqa: F401
        from kvboost.models.loading import _awq_config  # noqa: F401
    except ImportError as exc:
        return f"the AWQ loader is not there yet: {exc}"
    return None


@pytest.mark.skipif(_awq_available() is not None, reason=str(_awq_available()))
def test_streams_a_tiny_awq_model(tmp_path):
    from kvboost.models.awq import AWQConfig, AWQLinear, quantize_model_rtn, save_awq_folder
    from kvboost.models.loading import load_model_and_tokenizer

    model = tiny_model("llama", num_hidden_layers=LAYERS)
    quantize_model_rtn(model, AWQConfig(group_size=32))
    folder = save_awq_folder(model, tmp_path / "awq")
    try:
        resident_awq, _, _ = load_model_and_tokenizer(folder, dtype="float32", device="cpu")
    except (OSError, ValueError):  # no tokenizer files in the folder: build the model alone
        from transformers import AutoConfig

        from kvboost.models.awq import load_awq_model

        resident_awq = load_awq_model(folder, AutoConfig.from_pretrained(folder), dtype=torch.float32)
    streamed = build_streamed_model(folder, {"resident_layers": 1, "prefetch": True})
    layer = streamed.model.layers[2].self_attn.q_proj
    assert isinstance(layer, AWQLinear) and layer.qweight.device.type == "meta"
    ids = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        assert torch.equal(_logits(streamed, ids), _logits(resident_awq, ids))
    fp = ModelFingerprint(resident_awq, "awq", disk_cache=False).current()
    assert ModelFingerprint(streamed, "awq", disk_cache=False).current() == fp


@pytest.mark.skipif(_awq_available() is not None, reason=str(_awq_available()))
def test_streamed_awq_in_bf16_reads_prepacked_int4_tensors(tmp_path, monkeypatch):
    """bf16 on CPU: streamed AWQ linears arrive in the int4 kernel's layout from a sidecar written once (no
    repack per forward), and the logits equal the resident model's to the bit; prepack off streams AutoAWQ's."""
    from transformers import AutoConfig

    from kvboost.models.awq import AWQConfig, Int4PackedLinear, load_awq_model, quantize_model_rtn, save_awq_folder

    monkeypatch.setenv("KVBOOST_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model("llama", num_hidden_layers=LAYERS)
    quantize_model_rtn(model, AWQConfig(group_size=32))
    folder = save_awq_folder(model, tmp_path / "awq")
    resident = load_awq_model(folder, AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
    ids = torch.randint(3, VOCAB, (1, 13), generator=torch.Generator().manual_seed(0))
    want = _logits(resident, ids)
    streamed = build_streamed_model(folder, {"resident_layers": 1, "prefetch": True}, dtype="bfloat16")
    info = streamed._kvboost_streaming_prepacked
    assert info["used"] and info["linears"] == 7 * (LAYERS - 1)
    sidecar = info["sidecar"]
    assert sidecar.startswith(str(tmp_path / "cache"))
    assert isinstance(streamed.model.layers[2].self_attn.q_proj, Int4PackedLinear)
    assert not isinstance(streamed.model.layers[0].self_attn.q_proj, Int4PackedLinear)  # resident: as loaded
    for _ in range(2):
        assert torch.equal(_logits(streamed, ids), want)
    # a second build reuses the sidecar (same file, not rewritten)
    mtime = __import__("os").stat(sidecar).st_mtime_ns
    again = build_streamed_model(folder, {"resident_layers": 1}, dtype="bfloat16")
    assert again._kvboost_streaming_prepacked["sidecar"] == sidecar and __import__("os").stat(sidecar).st_mtime_ns == mtime
    off = build_streamed_model(folder, {"resident_layers": 1, "prepack": False}, dtype="bfloat16")
    assert off._kvboost_streaming_prepacked == {"used": False, "reason": "streaming.prepack is false"}
    assert torch.equal(_logits(off, ids), want)
    fp32 = build_streamed_model(folder, {"resident_layers": 1}, dtype="float32")
    assert not fp32._kvboost_streaming_prepacked["used"] and "float32" in fp32._kvboost_streaming_prepacked["reason"]


@pytest.mark.skipif(_awq_available() is not None, reason=str(_awq_available()))
def test_int4pack_sidecar_follows_the_checkpoint_and_replaces_a_damaged_one(tmp_path, monkeypatch):
    import os

    from kvboost.models.awq import AWQConfig, quantize_model_rtn, save_awq_folder
    from kvboost.streaming.int4pack_sidecar import ensure_sidecar, sidecar_path
    from kvboost.streaming.source import SafetensorsIndex

    monkeypatch.setenv("KVBOOST_CACHE_DIR", str(tmp_path / "cache"))
    model = tiny_model("llama", num_hidden_layers=2)
    quantize_model_rtn(model, AWQConfig(group_size=32))
    folder = save_awq_folder(model, tmp_path / "awq")
    prefixes = ["model.layers.1.mlp.up_proj", "model.layers.1.self_attn.q_proj"]
    index = SafetensorsIndex(folder)
    first = ensure_sidecar(index, prefixes, torch.bfloat16, 32)
    assert first == sidecar_path(index, torch.bfloat16, 32) and first.is_file()
    assert sidecar_path(index, torch.float16, 32) != first  # another dtype, another file
    weights = next(folder.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))  # the checkpoint changed
    assert sidecar_path(SafetensorsIndex(folder), torch.bfloat16, 32) != first
    first.write_bytes(b"not a safetensors file")  # damaged: written again, not trusted
    again = ensure_sidecar(index, prefixes, torch.bfloat16, 32)
    from safetensors import safe_open

    with safe_open(str(again), framework="pt") as f:
        assert {f"{p}.int4pack_weight" for p in prefixes} <= set(f.keys())


def test_prefetch_auto_needs_a_spare_core_on_cpu(folder, monkeypatch):
    """prefetch: auto is on for CUDA, and on CPU only when a core is left beside torch's compute threads (on 2
    cores the loader thread would take one of them: measured slower than loading in line)."""
    cfg = StreamingConfig.parse({"resident_layers": 1})
    assert cfg.prefetch == "auto" and cfg.resolve_prefetch("cuda")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert not cfg.resolve_prefetch("cpu")
    assert not build_streamed_model(folder, {"resident_layers": 1})._kvboost_streamer.prefetch
    monkeypatch.setattr("os.cpu_count", lambda: 3)
    assert cfg.resolve_prefetch("cpu")
    assert build_streamed_model(folder, {"resident_layers": 1})._kvboost_streamer.prefetch
    assert StreamingConfig.parse({"resident_layers": 1, "prefetch": True}).resolve_prefetch("cpu")
