"""Paged attention on the GPU: the Triton paged kernels (``kvboost.kernels_triton.paged_attention``) against torch
SDPA and the contiguous Triton kernel (``kvboost.kernels_triton.flash_attn.flash_attn_forward``) on the same keys.

    python -m experiments.bench.bench_paged_attention --out experiments/results/paged_attention   # full run, CUDA
    python -m experiments.bench.bench_paged_attention --quick                                     # correctness only

Shapes: one attention layer of Qwen2.5-1.5B (12 query heads, 2 KV heads, head dim 128) and Qwen2.5-7B (28 / 4 /
128), bf16, a pool of 16-slot blocks handed out as a random permutation (no sequence is contiguous).  Decode: one
query per sequence at batch 1, 8, 32, 64 over contexts of 1k, 4k, 16k keys.  Prefill: 256, 1024, 2048 new tokens
over 0, 2k, 8k cached ones, batch 1 and 4 (every sequence of a case has the same lengths, so the contiguous
baselines are exact).

Columns per case, each timed after a warm-up call (autotuning and compilation excluded) as the median of 50
CUDA-graph replays with the L2 cache flushed before each (an engine replays these kernels in graphs, so Python
launch cost is left out; ``paged eager`` times the plain Python call with ``triton.testing.do_bench`` for
comparison): ``paged`` the Triton paged kernel as an engine calls it (``max_q_len`` / ``max_kv_len`` given, no
device sync; the path it picked is reported) and, for prefill cases, ``other path`` the kernel it did not pick
(prefill <-> split, to check the heuristic); ``sdpa`` torch SDPA (GQA without repeating K/V, bottom-right causal
mask) on K/V already gathered into contiguous ``[B, Hkv, L, D]`` tensors; ``gather+sdpa`` the same including the
gather from the pool (what a paged engine without a paged kernel pays per layer); ``flash`` the contiguous Triton
kernel on the gathered K/V.  Rates: TFLOP/s counts ``4 * D`` FLOPs per visible (query, key) pair and query head (a
causal prefill of ``n`` tokens over ``c`` cached ones has ``n * c + n * (n + 1) / 2`` pairs, not ``n * (n + c)``);
GB/s (decode) counts the K/V bytes of every sequence plus q and out.  ``paged/sdpa`` is the time ratio (< 1: the
paged kernel is faster).  Every case also checks the paged output against SDPA's (``max_err``, relative to the
largest output).

``--quick`` runs a few tiny cases through every column once and checks them, without timing; without CUDA it
runs the Triton kernels under the interpreter (set here before triton is imported), so it is a smoke test on CPU.
``--out DIR`` writes ``paged_attention.json`` and ``paged_attention.md`` (device, torch / triton versions, the
command).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU: only --quick, through the interpreter

import torch.nn.functional as F
import triton

ROOT = Path(__file__).resolve().parents[2]  # the repository root

from kvboost.kernels_triton.flash_attn import flash_attn_forward
from kvboost.kernels_triton.paged_attention import _num_sms, choose_path, paged_attention
from kvboost.lab.environment import describe_environment

MODELS = {"qwen2.5-1.5b": (12, 2, 128), "qwen2.5-7b": (28, 4, 128)}
BLOCK_SIZE = 16
DECODE_BATCHES = (1, 8, 32, 64)
DECODE_CONTEXTS = (1024, 4096, 16384)
PREFILL_NEW = (256, 1024, 2048)
PREFILL_CACHED = (0, 2048, 8192)
PREFILL_BATCHES = (1, 4)
# --quick: (kind, batch, new, cached) on a small model layout; CPU-interpreter sized.
QUICK_MODELS = {"tiny-gqa3": (6, 2, 64)}
QUICK_CASES = [("decode", 3, 1, 40), ("prefill", 2, 24, 0), ("prefill", 2, 9, 30)]


def build_case(heads, kv_heads, dim, batch, new, cached, dtype, device, seed=0):
    """Pool, block tables and queries of one case; every sequence has ``new`` queries over ``cached + new`` keys."""
    kv = cached + new
    gen = torch.Generator(device="cpu").manual_seed(seed)
    per_seq = -(-kv // BLOCK_SIZE)
    num_blocks = batch * per_seq + 1
    k_cache = torch.randn(kv_heads, num_blocks * BLOCK_SIZE, dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(kv_heads, num_blocks * BLOCK_SIZE, dim, generator=gen).to(device, dtype)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
    q = torch.randn(batch * new, heads, dim, generator=gen).to(device, dtype)
    kw = {
        "block_tables": tables.to(device),
        "kv_lens": torch.full((batch,), kv, dtype=torch.int32, device=device),
        "query_start": (torch.arange(batch + 1, dtype=torch.int32) * new).to(device),
        "q_positions": torch.arange(cached, kv, dtype=torch.int32).repeat(batch).to(device),
        "block_size": BLOCK_SIZE,
    }
    rows = torch.arange(kv)
    slots = (tables.long()[:, rows // BLOCK_SIZE] * BLOCK_SIZE + rows % BLOCK_SIZE).to(device)  # [B, kv]
    return q, k_cache, v_cache, kw, slots


def gather(cache, slots):
    """``[Hkv, S, D]`` pool rows of every sequence -> contiguous ``[B, Hkv, kv, D]`` (one indexing kernel)."""
    heads = torch.arange(cache.shape[0], device=cache.device)
    return cache[heads[None, :, None], slots[:, None, :]]


def make_sdpa(new, kv):
    """SDPA on gathered ``[B, H, L, D]`` tensors with the contract's bottom-right causal mask and GQA; falls back to
    repeating K/V heads where this torch has no ``enable_gqa`` (the variant used is reported)."""
    from torch.nn.attention.bias import causal_lower_right

    if new == 1:
        mask = {}  # one query at the last position sees every key
    elif new == kv:
        mask = {"is_causal": True}
    else:
        mask = {"attn_mask": causal_lower_right(new, kv)}
    state = {"variant": "enable_gqa"}

    def sdpa(q4, k4, v4):
        if state["variant"] == "enable_gqa":
            try:
                return F.scaled_dot_product_attention(q4, k4, v4, enable_gqa=True, **mask)
            except (TypeError, RuntimeError):
                state["variant"] = "repeat_kv"
        group = q4.shape[1] // k4.shape[1]
        return F.scaled_dot_product_attention(
            q4, k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1), **mask
        )

    return sdpa, state


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return math.inf
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def bench_ms(fn, timed: bool) -> float | None:
    """Median ms of ``fn`` launched as a CUDA graph (as an engine runs it: no Python launch cost), the L2 cache
    flushed before every replay; plain ``triton.testing.do_bench`` where the capture fails."""
    if not timed:
        fn()
        return None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
    except Exception as exc:  # noqa: BLE001 - any capture failure: time it eagerly instead, and say so
        print(f"  (graph capture failed: {type(exc).__name__}: {exc}; timing eagerly)")
        return bench_eager_ms(fn)
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    warm, reps = 5, 50
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(warm + reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events[warm:])
    return times[len(times) // 2]


def bench_eager_ms(fn) -> float:
    """Median ms of eager calls (``triton.testing.do_bench``): includes the host launch cost when it exceeds the
    GPU time."""
    ms = triton.testing.do_bench(fn, warmup=10, rep=50, quantiles=[0.5])
    return ms[0] if isinstance(ms, (list, tuple)) else ms  # one quantile comes back as a float


def run_case(model, heads, kv_heads, dim, kind, batch, new, cached, dtype, device, timed):
    kv = cached + new
    q, k_cache, v_cache, kw, slots = build_case(heads, kv_heads, dim, batch, new, cached, dtype, device)
    out = torch.empty_like(q)
    hints = {"max_q_len": new, "max_kv_len": kv}
    path = choose_path(batch, heads, kv_heads, new, kv, _num_sms(q.device))
    sdpa, sdpa_state = make_sdpa(new, kv)
    q4 = q.view(batch, new, heads, dim).transpose(1, 2)
    k4, v4 = gather(k_cache, slots), gather(v_cache, slots)

    def paged():
        return paged_attention(q, k_cache, v_cache, out=out, **kw, **hints)

    def sdpa_only():
        return sdpa(q4, k4, v4)

    def gather_sdpa():
        return sdpa(q4, gather(k_cache, slots), gather(v_cache, slots))

    def flash():
        return flash_attn_forward(q4, k4, v4)

    # Warm-up: compilation and autotuning happen here, outside every timing; and the outputs are checked.
    ref = sdpa_only().transpose(1, 2).reshape(batch * new, heads, dim)
    err = rel_err(paged(), ref)
    if not timed:  # --quick: both kernels, whatever the heuristic picked
        for decode in (False, True):
            forced = paged_attention(q, k_cache, v_cache, **kw, **hints, decode=decode)
            err = max(err, rel_err(forced, ref))
    err_flash = rel_err(flash().transpose(1, 2).reshape(batch * new, heads, dim), ref)
    gather_sdpa()
    if device.type == "cuda":
        torch.cuda.synchronize()

    def paged_other():  # the kernel the heuristic did not pick (prefill cases: prefill <-> split)
        return paged_attention(q, k_cache, v_cache, out=out, **kw, **hints, decode=path == "prefill")

    columns = [("paged", paged), ("sdpa", sdpa_only), ("gather+sdpa", gather_sdpa), ("flash", flash)]
    if kind == "prefill":
        err = max(err, rel_err(paged_other(), ref))
        columns.append(("paged_other", paged_other))
    times = {name: bench_ms(fn, timed) for name, fn in columns}
    if timed:
        times["paged_eager"] = bench_eager_ms(paged)
    pairs = batch * (new * cached + new * (new + 1) // 2)  # visible (query, key) pairs per query head
    flops = 4 * dim * heads * pairs
    elem = q.element_size()
    kv_bytes = 2 * batch * kv_heads * kv * dim * elem
    qo_bytes = 2 * batch * new * heads * dim * elem
    row = {
        "model": model, "kind": kind, "batch": batch, "new": new, "cached": cached, "kv_len": kv,
        "path": path, "sdpa_variant": sdpa_state["variant"], "max_err": err, "max_err_flash": err_flash,
        "ms": times,
    }  # fmt: skip
    if timed:
        row["tflops"] = {n: flops / (t * 1e-3) / 1e12 for n, t in times.items()}
        row["other_path"] = ("split" if path == "prefill" else "prefill") if kind == "prefill" else None
        if kind == "decode":
            row["gbps"] = {n: (kv_bytes + qo_bytes) / (t * 1e-3) / 1e9 for n, t in times.items()}
        row["paged/sdpa"] = times["paged"] / times["sdpa"]
        row["paged/gather+sdpa"] = times["paged"] / times["gather+sdpa"]
    return row


def cases(quick: bool):
    if quick:
        for model, shape in QUICK_MODELS.items():
            for kind, batch, new, cached in QUICK_CASES:
                yield model, shape, kind, batch, new, cached
        return
    for model, shape in MODELS.items():
        for batch in DECODE_BATCHES:
            for ctx in DECODE_CONTEXTS:
                yield model, shape, "decode", batch, 1, ctx - 1
        for batch in PREFILL_BATCHES:
            for cached in PREFILL_CACHED:
                for new in PREFILL_NEW:
                    yield model, shape, "prefill", batch, new, cached


def to_markdown(result: dict) -> str:
    lines = [
        "# Paged attention (Triton) vs SDPA and the contiguous Triton kernel",
        "",
        (
            f"Device: {result['device']}; torch {result['torch']}; triton {result['triton']}; "
            f"dtype {result['dtype']}; block size {BLOCK_SIZE}."
        ),
        "",
        f"Command: `{result['command']}`",
        "",
        (
            "Times in ms: median of CUDA-graph replays with the L2 cache flushed before each (no Python launch "
            "cost); `paged eager` is the plain Python call (triton.testing.do_bench), launch cost included. "
            "`gather+sdpa` includes gathering K/V from the pool; `other path` is the paged kernel the heuristic did "
            "not pick (prefill <-> split). TFLOP/s counts visible causal pairs; GB/s (decode) counts K/V + q/out "
            "bytes. `paged/sdpa` < 1 means the paged kernel is faster."
        ),
        "",
        (
            "| model | kind | batch | new | cached | path | paged ms | sdpa ms | gather+sdpa ms | flash ms "
            "| other path ms | paged eager ms | paged TFLOP/s | paged GB/s | sdpa GB/s | paged/sdpa "
            "| paged/gather+sdpa | max err |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        ms = r["ms"]
        if ms["paged"] is None:
            times = " | ".join(["-"] * 6)
            rates = " | ".join(["-"] * 5)
        else:
            names = ("paged", "sdpa", "gather+sdpa", "flash", "paged_other", "paged_eager")
            times = " | ".join(f"{ms[n]:.3f}" if n in ms else "-" for n in names)
            gb = r.get("gbps")
            rates = " | ".join([
                f"{r['tflops']['paged']:.1f}",
                f"{gb['paged']:.0f}" if gb else "-",
                f"{gb['sdpa']:.0f}" if gb else "-",
                f"{r['paged/sdpa']:.2f}",
                f"{r['paged/gather+sdpa']:.2f}",
            ])  # fmt: skip
        lines.append(
            f"| {r['model']} | {r['kind']} | {r['batch']} | {r['new']} | {r['cached']} | {r['path']} | {times} "
            f"| {rates} | {r['max_err']:.1e} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="directory for paged_attention.json / .md")
    parser.add_argument("--quick", action="store_true", help="tiny correctness-only pass (works on CPU)")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not args.quick and not cuda:
        parser.error("the full run needs CUDA; use --quick for a CPU smoke test")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda or not args.quick else torch.float32
    timed = not args.quick
    start = time.perf_counter()
    rows = []
    with torch.inference_mode():
        for model, (heads, kv_heads, dim), kind, batch, new, cached in cases(args.quick):
            row = run_case(model, heads, kv_heads, dim, kind, batch, new, cached, dtype, device, timed)
            rows.append(row)
            ms = row["ms"]["paged"]
            print(f"{model:>13} {kind:>7} B={batch:<3} new={new:<5} cached={cached:<6} {row['path']:>7} "
                  f"paged={'-' if ms is None else f'{ms:.3f} ms'} "
                  f"ratio={row.get('paged/sdpa', float('nan')):.2f} err={row['max_err']:.1e}", flush=True)  # fmt: skip
            tol = 2e-2 if dtype != torch.float32 else 1e-4
            if not row["max_err"] < tol or not row["max_err_flash"] < tol:
                raise SystemExit(f"output mismatch vs SDPA: {row}")
    env = describe_environment()
    result = {
        "device": env["device"],
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "command": " ".join(["python", *sys.argv]),
        "quick": args.quick,
        "wall_s": round(time.perf_counter() - start, 1),
        "environment": env,
        "rows": rows,
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "paged_attention.json").write_text(json.dumps(result, indent=2))
        (args.out / "paged_attention.md").write_text(to_markdown(result))
        print(f"wrote {args.out / 'paged_attention.json'} and {args.out / 'paged_attention.md'}")
    print(f"{len(rows)} cases in {result['wall_s']} s")
    return result


if __name__ == "__main__":
    main()
