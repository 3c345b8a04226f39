"""attn=cpu_kernel's C++ kernel against torch's SDPA, on the attention calls of a suffix prefill, same run.

    python -m experiments.bench.bench_cpu_attention --threads 2                # fp32 and bf16, ~1 min on 2 cores

For each shape ``cached:new`` (default 0:600, 200:42, 600:174, 1000:188, 1000:255, 2000:255 and 1000:1, a decode
call) on the bundled model's attention geometry (9 query heads over 3 KV heads, head dim 64): ``new`` queries at
positions ``cached ..`` over ``cached + new`` keys, causal by position. SDPA gets what the fused prefill passes
it (``enable_gqa``, the additive mask built once per forward); the kernel gets the same tensors. Each round
times both (median of ``--repeats`` calls each, order alternating by round); reported: the medians, the
per-round ratio SDPA / kernel as median [min-max], each one's rate on the causal work (the compute floor's count:
4 x heads x head_dim FLOPs per visible key per query), and each one's largest error against float64.

Then, with ``--engine-shapes`` (default 200:42, 600:174, 1000:188, 1000:255; empty to skip), the same comparison
end to end: two engines on the bundled model in ``--engine-dtype`` (default float32, with
``--prefill-weights``, default prepacked), differing only in ``attn`` (sdpa / cpu_kernel), both on the fused
prefill, serve the same exact-prefix-hit requests (a fresh random prompt per round, its first ``cached`` tokens
warmed untimed, engine order alternating): TTFT medians, the paired ratio, each one's TTFT over the compute
floor of ``experiments/bench/bench_peers.py`` (matmul rate measured in this process, at the shape's new-token count),
and the largest first-token logit difference between the two.

Writes ``experiments/results/decode/cpu_attention.json`` and ``.md`` (the command at the top).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]  # the repository root

from experiments.common import cached_new_shape, median_ms, median_range, rotated, serve_prefix_hit
from kvboost.attention.cpu_ext import cpu_attention_forward, load_cpu_extension
from kvboost.lab.environment import describe_environment

RESULTS = ROOT / "experiments" / "results" / "decode"
SHAPES = "0:600,200:42,600:174,1000:188,1000:255,2000:255,1000:1"


def measure(dtype: torch.dtype, cached: int, new: int, args: argparse.Namespace) -> dict[str, Any]:
    """One shape: both implementations, ``args.rounds`` paired rounds."""
    gen = torch.Generator().manual_seed(cached * 7 + new)
    keys = cached + new
    q = torch.randn(1, args.heads, new, args.head_dim, generator=gen).to(dtype)
    k = torch.randn(1, args.kv_heads, keys, args.head_dim, generator=gen).to(dtype)
    v = torch.randn(1, args.kv_heads, keys, args.head_dim, generator=gen).to(dtype)
    allowed = torch.arange(keys)[None, :] <= torch.arange(cached, keys)[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
    scale = args.head_dim**-0.5
    out = torch.empty_like(q)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    def kernel() -> torch.Tensor:
        return cpu_attention_forward(q, k, v, causal=True, sm_scale=scale, out=out, tile=args.tile)

    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double(), scale=scale,
                                           enable_gqa=True)  # fmt: skip
    errors = {name: (fn().double() - exact).abs().max().item() for name, fn in (("sdpa", sdpa), ("kernel", kernel))}
    for fn in (sdpa, kernel):  # warm-up
        median_ms(fn, 3)
    rounds = []
    for r in range(args.rounds):
        calls = {"sdpa": sdpa, "kernel": kernel}
        rounds.append({name: median_ms(calls[name], args.repeats) for name in rotated(list(calls), r)})
    flops = 4 * args.heads * args.head_dim * (cached + 1 + keys) * new / 2  # sum over queries of visible keys
    sdpa_ms = statistics.median(r["sdpa"] for r in rounds)
    kernel_ms = statistics.median(r["kernel"] for r in rounds)
    return {
        "cached": cached, "new": new, "rounds": rounds, "sdpa_ms": sdpa_ms, "kernel_ms": kernel_ms,
        "speedup": [r["sdpa"] / r["kernel"] for r in rounds],
        "sdpa_gflop_s": flops / sdpa_ms / 1e6, "kernel_gflop_s": flops / kernel_ms / 1e6,
        "max_abs_error_vs_fp64": errors,
    }  # fmt: skip


def measure_engines(args: argparse.Namespace, shapes: list[tuple[int, int]]) -> dict[str, Any]:
    """TTFT of attn=sdpa vs attn=cpu_kernel engines on the same prefix-hit requests, and TTFT / compute floor."""
    import random

    from experiments.bench.bench_peers import Arch, compute_floor_ms, measure_matmul_rate
    from experiments.common import compose_run_config
    from kvboost.build import build_engine

    engines = {attn: build_engine(compose_run_config([f"attn={attn}"], dtype=args.engine_dtype,
                                                     prefill_weights=args.prefill_weights))
               for attn in ("sdpa", "cpu_kernel")}  # fmt: skip
    for engine in engines.values():
        engine.warmup()
    info = {attn: e.decode_info() for attn, e in engines.items()}
    arch = Arch.from_model(engines["sdpa"].model)
    dtype = engines["sdpa"].adapter.dtype
    rng = random.Random(0)
    rows = []
    for cached, new in shapes:
        times: dict[str, list[float]] = {attn: [] for attn in engines}
        logit_diff = []
        for round_ in range(args.engine_rounds):
            ids = [rng.randrange(100, engines["sdpa"].vocab_size) for _ in range(cached + new)]
            logits = {}
            for attn in rotated(list(engines), round_):
                r = serve_prefix_hit(engines[attn], ids, cached, 1)
                times[attn].append(r.ttft_ms)
                logits[attn] = r.first_token_logits
            logit_diff.append(float((logits["sdpa"] - logits["cpu_kernel"]).abs().max()))
        rate = measure_matmul_rate(new, arch.hidden, arch.intermediate, dtype)
        floor = compute_floor_ms(cached + new, cached, arch, rate)
        rows.append({
            "cached": cached, "new": new, "ttft_ms": times, "floor_ms": floor, "matmul_gflop_s": rate / 1e9,
            "ratio_sdpa_over_kernel": [a / b for a, b in zip(times["sdpa"], times["cpu_kernel"], strict=True)],
            "ttft_over_floor": {attn: [t / floor for t in ts] for attn, ts in times.items()},
            "max_abs_logit_diff": max(logit_diff),
        })  # fmt: skip
        r = rows[-1]
        print(f"engine {cached}:{new}  sdpa {median_range(times['sdpa'])} ms  cpu_kernel "
              f"{median_range(times['cpu_kernel'])} ms  floor {floor:.1f} ms", flush=True)  # fmt: skip
    for engine in engines.values():
        engine.close()
    return {"dtype": str(dtype).replace("torch.", ""), "prefill_weights": args.prefill_weights,
            "rounds": args.engine_rounds, "decode_info": info, "shapes": rows}  # fmt: skip


def to_markdown(result: dict[str, Any]) -> str:
    lines = [f"# attn=cpu_kernel vs SDPA on suffix-prefill attention calls ({result['threads']} threads)", "",
             "```", result["command"], "```", "",
             (f"Geometry: {result['heads']} query heads over {result['kv_heads']} KV heads, head dim "
              f"{result['head_dim']}; kernel tile {result['tile']}; {result['rounds']} paired rounds of "
              f"{result['repeats']} calls each (median per round)."), ""]  # fmt: skip
    for dtype, rows in result["dtypes"].items():
        lines += [f"## {dtype}", "",
                  ("| cached | new | SDPA ms | kernel ms | SDPA / kernel median [min-max] | SDPA GFLOP/s | kernel GFLOP/s "
                   "| max err SDPA | max err kernel |"), "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in rows:
            err = r["max_abs_error_vs_fp64"]
            lines.append(
                f"| {r['cached']} | {r['new']} | {r['sdpa_ms']:.3f} | {r['kernel_ms']:.3f} | "
                f"{median_range(r['speedup'], 2)} | {r['sdpa_gflop_s']:.0f} | {r['kernel_gflop_s']:.0f} | "
                f"{err['sdpa']:.1e} | {err['kernel']:.1e} |"
            )
        lines.append("")
    engine = result.get("engine")
    if engine:
        lines += [(f"## End to end: TTFT of a prefix hit, engines attn=sdpa vs attn=cpu_kernel ({engine['dtype']}, "
                   f"prefill_weights={engine['prefill_weights']}, fused prefill)"), "",
                  (f"{engine['rounds']} rounds, a fresh prompt per round, engine order alternating; median [min-max]. "
                   "Floor: the compute floor of experiments/bench/bench_peers.py (matmul rate measured here)."), "",
                  ("| cached | new | TTFT ms sdpa | TTFT ms cpu_kernel | sdpa / cpu_kernel (paired) | floor ms "
                   "| sdpa TTFT / floor | cpu_kernel TTFT / floor | max abs first-token logit diff |"),
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
        for r in engine["shapes"]:
            lines.append(
                f"| {r['cached']} | {r['new']} | {median_range(r['ttft_ms']['sdpa'])} | "
                f"{median_range(r['ttft_ms']['cpu_kernel'])} | {median_range(r['ratio_sdpa_over_kernel'], 2)} | "
                f"{r['floor_ms']:.1f} | {median_range(r['ttft_over_floor']['sdpa'], 2)} | "
                f"{median_range(r['ttft_over_floor']['cpu_kernel'], 2)} | {r['max_abs_logit_diff']:.1e} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=SHAPES, help="comma-separated cached:new pairs")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--tile", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--engine-shapes",
        default="200:42,600:174,1000:188,1000:255",
        help="cached:new pairs for the end-to-end engines (empty: skip)",
    )
    parser.add_argument("--engine-dtype", default="float32")
    parser.add_argument("--prefill-weights", default="prepacked", choices=["auto", "plain", "prepacked"])
    parser.add_argument("--engine-rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    from experiments.common import set_threads

    set_threads(args.threads)
    shapes = [cached_new_shape(s) for s in args.shapes.split(",") if s]
    build_start = time.perf_counter()
    load_cpu_extension()
    result: dict[str, Any] = {
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "threads": torch.get_num_threads(), "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
        "tile": args.tile, "rounds": args.rounds, "repeats": args.repeats,
        "kernel_load_s": time.perf_counter() - build_start, "environment": describe_environment(), "dtypes": {},
    }  # fmt: skip
    for name in args.dtypes.split(","):
        rows = []
        for cached, new in shapes:
            rows.append(measure(getattr(torch, name), cached, new, args))
            r = rows[-1]
            print(f"{name} {cached}:{new}  sdpa {r['sdpa_ms']:.3f} ms  kernel {r['kernel_ms']:.3f} ms  "
                  f"x{median_range(r['speedup'], 2)}", flush=True)  # fmt: skip
        result["dtypes"][name] = rows
    engine_shapes = [cached_new_shape(s) for s in args.engine_shapes.split(",") if s]
    if engine_shapes:
        result["engine"] = measure_engines(args, engine_shapes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_attention.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "cpu_attention.md").write_text(to_markdown(result) + "\n")
    print(f"wrote {out / 'cpu_attention.md'}")
    return result


if __name__ == "__main__":
    main()
