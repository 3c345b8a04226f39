"""The graphed decode step on a GPU: kernels per step, GPU time per kernel kind, step time against the
weight-streaming floor, for each layer variant of :class:`kvboost.runtime.graphs.GraphRunner`, in one run.

    python -m experiments.bench.bench_decode_step --shape qwen2-1.5b --batches 1 8 32 --context 1024 --out DIR

The model is drawn on the device from a config (random weights, bf16: timings only; no file travels), the
runner is the engine's :class:`~kvboost.runtime.llama.LlamaRunner` over a paged pool with CUDA graphs captured
without inductor. Variants (``--variants``): ``unfused`` (the layer of ``decoder_layer``: ~35 kernels) and
``fused`` (:mod:`kvboost.kernels_triton.decoder_ops`, one GEMM for q/k/v and one for gate/up). For each batch size,
``batch`` prompts of ``context`` random tokens are prefilled once (eagerly, not timed) and every variant decodes
from the same K/V (the tables are cut back to the prompt after each variant):

- ``replay_ms``: GPU time of one replay of the step's CUDA graph (CUDA events over ``--replays`` replays, median of
  ``--repeats``): what the issue's floor ratio is about;
- ``step_ms``: wall time per step of ``runner.run`` on a freshly built batch, argmax fed back (the host's batch
  building, buffer copies and the logits' copy included), ``--steps`` steps;
- ``kernels``: kernels of one replay and their GPU time grouped by kind (``torch.profiler`` over 3 replays; also
  counted on the uncaptured forward, which launches the same kernels);
- ``logits``: the first step's logits against the eager runner's on the same K/V (max abs difference relative to
  the largest logit, and top-1 agreement; random weights make near-ties common, so agreement below 1 is expected
  in bf16).

The floor is every weight read once (tied embeddings once) at the device's measured streaming bandwidth
(``bench_decode.stream_bandwidth_gbs``). Writes ``<out>/decode_step.json`` and ``<out>/decode_step.md``.
``--device cpu --shape tiny`` runs the same code uncaptured on a CPU (the plumbing, not the timings).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from experiments.bench.bench_decode import stream_bandwidth_gbs, weight_bytes

#: Model shapes (Qwen2 architecture; the bundled tokenizer's 49,152-token vocabulary, as the earlier GPU runs).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2-1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
                   "num_key_value_heads": 2, "tie_word_embeddings": True},
    "qwen2-7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
                 "num_key_value_heads": 4, "tie_word_embeddings": False},
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "tie_word_embeddings": True},
}  # fmt: skip
VARIANTS = ("unfused", "fused")
KINDS = (  # (kind, substrings of kernel names), first match wins
    ("gemm", ("gemm", "gemv", "cutlass", "cublas", "nvjet", "xmma", "splitk", "sm90", "sm80")),
    ("attention", ("_paged_split_kernel", "_paged_prefill_kernel")),
    ("attention_reduce", ("_paged_split_reduce",)),
    ("norm_residual", ("_add_rms_norm",)),
    ("rope_kv_write", ("_rope_write_kv",)),
    ("silu_mul", ("_silu_mul",)),
    ("index_copy_gather", ("index", "gather", "scatter")),
    ("copy_cast", ("copy", "cast", "convert")),
    ("reduce", ("reduce",)),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "cat", "neg", "mul", "add", "silu")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def build_model(shape: str, device: str, dtype: torch.dtype, seed: int) -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=49152, max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                      use_sliding_window=False, **SHAPES[shape])  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def kernel_profile(fn: Any, calls: int) -> dict[str, Any]:
    """Kernels per call of ``fn`` and their GPU time by kind (``torch.profiler``, ``calls`` calls)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kinds: dict[str, dict[str, float]] = {}
    total_n, total_us = 0, 0.0
    for ev in prof.events():
        if (
            ev.device_type != torch.autograd.DeviceType.CUDA
            or "memcpy" in ev.name.lower()
            or "memset" in ev.name.lower()
        ):
            continue
        kind = kernel_kind(ev.name)
        entry = kinds.setdefault(kind, {"kernels": 0.0, "gpu_us": 0.0})
        entry["kernels"] += 1 / calls
        entry["gpu_us"] += ev.device_time / calls
        total_n += 1
        total_us += ev.device_time
    return {"kernels": total_n / calls, "gpu_us": total_us / calls,
            "by_kind": dict(sorted(kinds.items(), key=lambda kv: -kv[1]["gpu_us"]))}  # fmt: skip


def time_replays(graph: Any, replays: int, repeats: int) -> list[float]:
    """ms per replay of ``graph`` (CUDA events), one figure per repeat."""
    out = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / replays)
    return out


def run_variant(variant: str, model: Any, pool: Any, backend: Any, tables: list, first: list[int], args: Any,
                reference: torch.Tensor) -> dict[str, Any]:  # fmt: skip
    from kvboost.runtime.batch import ForwardBatch, SeqInput
    from kvboost.runtime.llama import LlamaRunner

    cuda = pool.device.type == "cuda"
    runner = LlamaRunner(model, pool, backend, decode="graphed", graph_options={
        "compile": False, "fused": variant == "fused", "prefill": False, "max_batch": max(args.batches)})  # fmt: skip
    graphs = runner.graphs
    context = tables[0].length
    result: dict[str, Any] = {"variant": variant, "batch": len(tables), "context": context}

    def batch_of(tokens: list[int]) -> Any:
        return ForwardBatch.build([SeqInput(t, [tok]) for t, tok in zip(tables, tokens, strict=True)])

    with torch.inference_mode():
        start = time.perf_counter()
        batch = batch_of(first)
        key = graphs._bucket_of(batch)
        if cuda:
            logits = runner.run(batch)  # captures the bucket on first use
            result["capture_s"] = time.perf_counter() - start
        else:
            logits = graphs.static_forward(graphs._fill(key, batch))[: len(tables)]
        result["graph_layer"] = graphs.describe()["graph_layer"]
        result["fallback_reason"] = graphs.fallback_reason
        diff = (logits.float() - reference).abs().max().item()
        result["logits_max_abs_diff_rel"] = diff / max(reference.abs().max().item(), 1e-30)
        result["top1_agreement"] = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        for t in tables:
            t.truncate(context)
        bufs = graphs._fill(key, batch_of(first))
        uncaptured = functools.partial(graphs.static_forward, bufs)  # the same kernels, launched one by one
        if cuda:
            entry = graphs._graphs[key]
            result["replay_ms"] = statistics.median(time_replays(entry.graph, args.replays, args.repeats))
            result["profile"] = kernel_profile(entry.graph.replay, 3)
            result["profile_uncaptured"] = kernel_profile(uncaptured, 1)
        for t in tables:
            t.truncate(context)
        tokens = list(first)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        sync()
        start = time.perf_counter()
        for _ in range(args.steps):
            tokens = runner.run(batch_of(tokens)).argmax(-1).tolist()
        sync()
        result["step_ms"] = (time.perf_counter() - start) * 1000 / args.steps
        for t in tables:
            t.truncate(context)
    result["forwards"] = dict(runner.forwards)
    del runner, graphs
    if cuda:
        torch.cuda.empty_cache()
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvboost.kv.block_table import BlockTable
    from kvboost.kv.pool import KVPool
    from kvboost.registry import ATTENTION
    from kvboost.runtime.batch import ForwardBatch, SeqInput
    from kvboost.runtime.llama import LlamaRunner

    dtype = getattr(torch, args.dtype)
    model = build_model(args.shape, args.device, dtype, args.seed)
    cfg = model.config
    backend = ATTENTION.build("sdpa")
    backend.install(model)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    block = 16
    per_seq = -(-(args.context + args.steps + 2) // block) + 1
    pool = KVPool(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                  num_blocks=per_seq * max(args.batches) + 8, block_size=block, dtype=dtype,
                  device=torch.device(args.device))  # fmt: skip
    eager = LlamaRunner(model, pool, backend, decode="eager")
    nbytes = weight_bytes(model)
    gbs = stream_bandwidth_gbs(device=args.device)
    floor_ms = nbytes / (gbs * 1e9) * 1000
    print(
        f"{args.shape}: {nbytes / 1e9:.2f} GB of weights, streaming {gbs:.0f} GB/s: floor {floor_ms:.3f} ms/step",
        flush=True,
    )
    gen = torch.Generator().manual_seed(args.seed)
    rows = []
    for batch_size in args.batches:
        tables = [BlockTable(pool) for _ in range(batch_size)]
        try:
            with torch.inference_mode():
                for table in tables:  # the prompts' K/V, written once by the eager runner (not timed)
                    eager.run(ForwardBatch.build([SeqInput(table, torch.randint(100, 40000, (args.context,),
                                                                                 generator=gen).tolist())]))  # fmt: skip
                first = torch.randint(100, 40000, (batch_size,), generator=gen).tolist()
                reference = eager.run(ForwardBatch.build([SeqInput(t, [tok]) for t, tok in zip(tables, first)]))
                reference = reference.float()
                for t in tables:
                    t.truncate(args.context)
            for variant in args.variants:
                try:
                    res = run_variant(variant, model, pool, backend, tables, first, args, reference)
                except Exception as exc:  # noqa: BLE001 - one variant failing must not lose the others' figures
                    res = {"variant": variant, "batch": batch_size, "error": f"{type(exc).__name__}: {exc}"}
                    for t in tables:
                        t.truncate(min(t.length, args.context))
                if "replay_ms" in res:
                    res["floor_fraction"] = floor_ms / res["replay_ms"]
                    res["tokens_per_s_replay"] = batch_size * 1000 / res["replay_ms"]
                if "step_ms" in res:
                    res["tokens_per_s_step"] = batch_size * 1000 / res["step_ms"]
                rows.append(res)
                print(json.dumps({k: v for k, v in res.items() if not k.startswith("profile")}), flush=True)
        finally:
            for t in tables:
                t.release()
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return {"shape": args.shape, "config": SHAPES[args.shape], "dtype": args.dtype, "context": args.context,
            "weight_bytes": nbytes, "stream_gbs": gbs, "floor_ms": floor_ms, "environment": env,
            "command": "python -m experiments.bench.bench_decode_step " + " ".join(sys.argv[1:]), "rows": rows}  # fmt: skip


def to_markdown(res: dict[str, Any]) -> str:
    lines = [
        f"# Graphed decode step, {res['shape']} shape (random weights, {res['dtype']}), context {res['context']}",
        "",
        (
            f"Device: {res['environment'].get('device')}; torch {res['environment'].get('torch')}, triton "
            f"{res['environment'].get('triton')}. Weights {res['weight_bytes'] / 1e9:.2f} GB, streaming "
            f"{res['stream_gbs']:.0f} GB/s: floor {res['floor_ms']:.3f} ms per step."
        ),
        "",
        f"Command: `{res['command']}`",
        "",
        (
            "| batch | layer | kernels / step | replay ms | % of floor | tok/s (replay) | step ms (runner.run) | "
            "logits rel. diff vs eager | top-1 agree |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['variant']} | error: {r['error'][:120]} | | | | | | |")
            continue
        prof = r.get("profile") or {}
        kernels = f"{prof.get('kernels', float('nan')):.0f}" if prof else "-"
        if r.get("profile_uncaptured"):
            kernels += f" ({r['profile_uncaptured']['kernels']:.0f} uncaptured)"
        lines.append(
            f"| {r['batch']} | {r.get('graph_layer', r['variant'])} | {kernels} | {r.get('replay_ms', float('nan')):.3f} | "
            f"{100 * r.get('floor_fraction', float('nan')):.0f}% | {r.get('tokens_per_s_replay', float('nan')):.0f} | "
            f"{r.get('step_ms', float('nan')):.3f} | {r['logits_max_abs_diff_rel']:.2e} | {r['top1_agreement']:.2f} |"
        )  # fmt: skip
    lines += ["", "GPU time per kernel kind (us per step, kernels per step):", ""]
    for r in res["rows"]:
        prof = r.get("profile")
        if prof:
            kinds = ", ".join(f"{k} {v['gpu_us']:.0f} us / {v['kernels']:.0f}" for k, v in prof["by_kind"].items())
            lines.append(f"- batch {r['batch']}, {r.get('graph_layer', r['variant'])}: {prof['gpu_us']:.0f} us in "
                         f"{prof['kernels']:.0f} kernels: {kinds}")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2-1.5b")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=64, help="runner.run steps timed per variant")
    parser.add_argument("--replays", type=int, default=50, help="graph replays per timing")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("experiments/results/gpu/decode_step"))
    args = parser.parse_args(argv)
    res = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "decode_step.json").write_text(json.dumps(res, indent=1))
    (args.out / "decode_step.md").write_text(to_markdown(res))
    print(to_markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
