"""Where the graphed decode step's time goes on a GPU: kernels per token and their GPU time, and the replay rate.

    python experiments/profile_graphed_step.py [--model DIR] [--context 1024] [--tokens 200] [--out FILE.json]
        [--variants compiled compiled_matmul compiled_fused compiled_matmul_fused eager]

Runs the step's static forward once uncaptured under ``torch.profiler`` (every kernel one decode token launches,
grouped by name, with its GPU time), then times ``--tokens`` replays of the captured graph (CUDA events), for each
variant of the step: compiled or eager per-layer functions, masked SDPA or two matmuls for the decode attention
(``decode_attention``), separate or concatenated q/k/v and gate/up projections (``fuse_projections``). The sum
of kernel times against the replay time says whether the GPU work itself or the gaps between kernels set the
rate; the kernel list says what a fused kernel would save. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvboost.models.graphed_decode import GraphedDecodeStep, bucket_for
from kvboost.models.loading import load_model_and_tokenizer

#: Variant name -> GraphedDecodeStep options.
VARIANTS = {
    "compiled": {"compile": True},
    "compiled_matmul": {"compile": True, "decode_attention": "matmul"},
    "compiled_fused": {"compile": True, "fuse_projections": True},
    "compiled_matmul_fused": {"compile": True, "decode_attention": "matmul", "fuse_projections": True},
    "eager": {"compile": False},
}


def profile_step(model: Any, *, variant: str, context: int, tokens: int) -> dict[str, Any]:
    step = GraphedDecodeStep(model, **VARIANTS[variant])
    size = bucket_for(context + tokens + 1, step.max_rows)
    with torch.inference_mode():
        step._graph(size, 1)  # compile and capture
        toks, positions, last = step._input_buffers(1)
        keys, values = step._workspace(size)
        positions.fill_(context)
        step.static_forward(toks, positions, last, keys, values)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            step.static_forward(toks, positions, last, keys, values)
            torch.cuda.synchronize()
        kernels: dict[str, list[float]] = defaultdict(list)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name].append(event.device_time_total if hasattr(event, "device_time_total")
                                           else event.cuda_time_total)  # fmt: skip
        graph = step._graphs[(size, 1)].graph
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(10):
            graph.replay()
        start.record()
        for i in range(tokens):
            positions.fill_(context + i)
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / tokens
    rows = sorted(((name, len(t), sum(t)) for name, t in kernels.items()), key=lambda r: -r[2])
    return {
        "variant": variant, **VARIANTS[variant], "workspace_rows": size, "context": context,
        "kernels_per_token": sum(r[1] for r in rows), "kernel_us_per_token": sum(r[2] for r in rows),
        "replay_ms_per_token": ms, "replay_tokens_per_s": 1000 / ms,
        "top_kernels": [{"name": n[:120], "launches": c, "us": round(t, 2)} for n, c, t in rows[:25]],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("profile_graphed_step: needs a CUDA device", file=sys.stderr)
        return 2
    model, _, _ = load_model_and_tokenizer(args.model, dtype="bfloat16", device="cuda")
    results = [profile_step(model, variant=v, context=args.context, tokens=args.tokens) for v in args.variants]
    for r in results:
        print(
            f"{r['variant']}: {r['kernels_per_token']} kernels/token, {r['kernel_us_per_token']:.0f} us of "
            f"kernel time; replay {r['replay_ms_per_token']:.3f} ms/token ({r['replay_tokens_per_s']:.0f} tok/s)"
        )
        for k in r["top_kernels"][:12]:
            print(f"    {k['launches']:4d} x  {k['us']:9.1f} us  {k['name']}")
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
