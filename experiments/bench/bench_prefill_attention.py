"""Attention in a suffix prefill on CPU: how fast torch's kernels run it, against the matmul rate.

    python -m experiments.bench.bench_prefill_attention --threads 2

The shape of a suffix prefill after reuse on the bundled model: ``--new`` queries (default 255) at positions
``--cached`` .. (default 1000 cached tokens), 9 query heads over 3 KV heads, head dim 64, causal by position.
Variants, each timed as the median of ``--repeats`` calls after warm-up: what transformers' SDPA integration
passes (KV heads repeated, additive float mask), a bool mask, ``enable_gqa`` with a bool mask (prebuilt, and built
in the call as the fused prefill did in every layer until it built an additive mask once per forward), ``enable_gqa``
with that additive mask (what the fused prefill runs now), no mask (wrong results: the kernel's rate without
masking work), fp32 inputs, and scores by batched matmul + fp32 softmax. Then the layer-wise attention of content
repair (``--selected`` cached rows plus the new ones, in position-sorted groups): masks built in every call
against the groups the ``sdpa`` backend now builds once per selection (``QueryGroups``).
Each variant's rate counts the unmasked work (2 x 2 x heads x queries x keys x head_dim FLOPs), so it compares
directly with the dense matmul rate measured beside it (``[new, 576] x [576, 1536]``, the model's MLP shape).

Writes ``experiments/results/decode/prefill_attention_<dtype>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]  # the repository root

from kvboost.lab.environment import describe_environment


def timed(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls (three warm-up calls first)."""
    with torch.inference_mode():
        for _ in range(3):
            fn()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def selected_query_rows(q, k, v, keys: int, count: int, repeats: int) -> list[dict]:
    """Layer-wise attention of ``count`` cached rows (drawn at random) plus every new row, as content repair runs
    it (``kvboost.attention.sdpa.selected_query_attention``): masks built in every call, as it did until the
    backend built its ``QueryGroups`` once per selection, against the groups built once."""
    from kvboost.attention.sdpa import QueryGroups, selected_query_attention

    new = q.shape[2]
    cached = keys - new
    gen = torch.Generator().manual_seed(1)
    picked = torch.randperm(cached, generator=gen)[: min(count, cached)].sort().values
    positions = torch.cat([picked, torch.arange(cached, keys)])
    group = q.shape[1] // k.shape[1]
    rows_q = torch.randn(1, q.shape[1], positions.numel(), q.shape[3], generator=gen).to(q.dtype)
    plan = QueryGroups.build(positions, q.dtype)

    def per_call_bool() -> torch.Tensor:
        out = rows_q.new_empty(1, positions.numel(), q.shape[1], q.shape[3])
        for a, b, k_end, _ in plan.groups:
            allowed = torch.arange(k_end)[None, :] <= positions[a:b, None]
            part = F.scaled_dot_product_attention(rows_q[:, :, a:b], k[:, :, :k_end], v[:, :, :k_end],
                                                  attn_mask=allowed, enable_gqa=group > 1)  # fmt: skip
            out[:, a:b] = part.transpose(1, 2)
        return out

    scale = q.shape[3] ** -0.5
    variants = {
        "selected queries, bool masks built in every call (before)": per_call_bool,
        "selected queries, QueryGroups built once per selection": lambda: selected_query_attention(
            rows_q, k, v, plan, scale),
    }  # fmt: skip
    rows = []
    for name, fn in variants.items():
        seconds = timed(fn, repeats)
        rows.append({"variant": name, "queries": int(positions.numel()), "ms": round(seconds * 1e3, 3)})
        print(f"{name:70s} {seconds * 1e3:7.3f} ms  ({positions.numel()} queries)", flush=True)
    with torch.inference_mode():
        rows[-1]["bit_equal_to_before"] = bool(torch.equal(per_call_bool(), variants[rows[-1]["variant"]]()))
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--new", type=int, default=255)
    parser.add_argument("--cached", type=int, default=1000)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--selected",
        type=int,
        default=320,
        help="queries of the layer-wise (content repair) comparison, drawn among the cached rows",
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "decode"))
    args = parser.parse_args(argv)
    from experiments.common import set_threads

    set_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    h, kvh, d, n, m = args.heads, args.kv_heads, args.head_dim, args.new, args.cached
    keys = m + n
    q = torch.randn(1, h, n, d, dtype=dtype)
    k = torch.randn(1, kvh, keys, d, dtype=dtype)
    v = torch.randn(1, kvh, keys, d, dtype=dtype)
    allowed = (torch.arange(keys)[None] <= torch.arange(m, keys)[:, None])[None, None]  # query i sees j <= pos(i)
    additive = torch.zeros(1, 1, n, keys, dtype=dtype).masked_fill(~allowed, float("-inf"))
    kr, vr = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
    group = h // kvh

    def by_matmul() -> torch.Tensor:
        scores = torch.matmul(q.view(kvh, group * n, d), k[0].transpose(1, 2)).float() / math.sqrt(d)
        probs = torch.softmax(scores.view(kvh, group, n, keys).masked_fill(~allowed[0], float("-inf")), dim=-1)
        return torch.matmul(probs.to(dtype).view(kvh, group * n, keys), v[0]).view(1, h, n, d)

    variants: dict[str, Callable[[], torch.Tensor]] = {
        "sdpa, repeated KV, additive mask (transformers' call)": lambda: F.scaled_dot_product_attention(
            q, kr, vr, attn_mask=additive),
        "sdpa, repeated KV, bool mask": lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=allowed),
        "sdpa, enable_gqa, bool mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed,
                                                                               enable_gqa=True),
        "sdpa, enable_gqa, bool mask built in the call (fused prefill before)": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.arange(keys)[None, :] <= torch.arange(m, keys)[:, None], enable_gqa=True),
        "sdpa, enable_gqa, additive mask built once (the fused prefill)": lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=additive, enable_gqa=True),
        "sdpa, no mask (wrong result: the kernel's unmasked rate)": lambda: F.scaled_dot_product_attention(q, kr, vr),
        "sdpa, fp32 inputs, bool mask": lambda: F.scaled_dot_product_attention(q.float(), kr.float(), vr.float(),
                                                                                attn_mask=allowed),
        "batched matmul + fp32 softmax": by_matmul,
    }  # fmt: skip
    flops = 2 * 2 * h * n * keys * d
    reference = F.scaled_dot_product_attention(q.float(), kr.float(), vr.float(), attn_mask=allowed)
    rows = []
    for name, fn in variants.items():
        seconds = timed(fn, args.repeats)
        with torch.inference_mode():
            err = (fn().float() - reference).abs().max().item()
        rows.append({"variant": name, "ms": round(seconds * 1e3, 3), "gflop_s": round(flops / seconds / 1e9, 1),
                     "max_abs_err_vs_fp32": err})  # fmt: skip
        print(f"{name:70s} {seconds * 1e3:7.3f} ms  {flops / seconds / 1e9:7.1f} GFLOP/s  err {err:.2e}", flush=True)
    selected = selected_query_rows(q, k, v, keys, args.selected, args.repeats)
    x, w = torch.randn(n, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
    mm_s = timed(lambda: F.linear(x, w), args.repeats)
    mm_rate = 2 * n * 576 * 1536 / mm_s / 1e9
    print(f"{'matmul [new, 576] x [576, 1536]':60s} {mm_s * 1e3:7.3f} ms  {mm_rate:7.1f} GFLOP/s")
    command = "python -m experiments.bench.bench_prefill_attention " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "command": command, "shape": {"new": n, "cached": m, "heads": h, "kv_heads": kvh, "head_dim": d},
        "dtype": args.dtype, "threads": torch.get_num_threads(), "attention_gflop": flops / 1e9, "variants": rows,
        "selected_queries": selected, "matmul_gflop_s": round(mm_rate, 1), "environment": describe_environment(),
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"prefill_attention_{args.dtype}.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
