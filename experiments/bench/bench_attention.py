"""Benchmark the attention kernels: SDPA (flash and default), Triton FlashAttention-2, and the CUDA extension.

    python -m experiments.bench.bench_attention                 # GPU: full grid, bf16
    python -m experiments.bench.bench_attention --quick         # GPU: one shape per family
    python -m experiments.bench.bench_attention --families suffix square   # GPU: only these families
    python -m experiments.bench.bench_attention --quick         # CPU: tiny fp32 shapes through the Triton interpreter

Shape families (GPU, GQA 4:1 = 32 q heads / 8 kv heads, head dim 64 and 128, causal, bottom-right aligned):

* ``prefill``: square prefill, sequence 512..16k, batch chosen so that batch * seq ~ 16k tokens;
* ``square``: square prefill q_len = kv_len in 4k..16k with batch 1 (the goal: Triton >= 0.9x SDPA flash);
* ``suffix``: a short prefill over a long cache, q_len 16 / 128 / 512 over kv_len 4k / 16k with batch 1 -- what
  chunk reuse produces (the goal: Triton above SDPA flash; this is what the split-KV path is for);
* ``decode``: q_len 1 against 1k..16k cached keys with batch 8 and 32.

Backends: ``sdpa_flash`` (torch SDPA restricted to its flash kernel, the baseline), ``sdpa`` (torch's default
dispatch, the correctness reference), ``triton`` (automatic path choice), ``triton_split`` / ``triton_nosplit``
(split-KV / one-pass forced), and on a GPU ``cuda`` / ``cuda_split`` / ``cuda_nosplit`` likewise. SDPA gets the
same mask as the kernels: ``is_causal`` for square shapes, ``causal_lower_right`` for q_len < kv_len.

Every backend is first checked against SDPA on the shape (max abs error), then timed: a warm-up (Triton
autotuning happens there), then the median of many runs timed with CUDA events, rotating among several
pre-allocated input sets so that L2 residency does not flatter small shapes. Each line prints ms, TFLOP/s, GB/s
and the speed ratio to SDPA flash; a summary checks the goals above.

FLOPs: 4 * B * Hq * D * (attended query-key pairs). For square causal prefill the usual convention
Lq * Lk / 2 pairs is used; otherwise the pairs are counted exactly (bottom-right causal alignment, as in the
kernel contract: query i attends keys j <= Lk - Lq + i).

Writes ``experiments/results/bench_attention_<device>.json`` (device name, torch/triton versions, every
measurement, the goal checks). On a CPU the timings only show that the code paths run: they are NOT performance
numbers, and the JSON says so (``"performance_numbers": false``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Without a GPU the Triton kernels can only run under the interpreter, which Triton picks when the kernel
# module is imported; set it before anything imports kvboost.kernels_triton.flash_attn.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from experiments.common import percentile  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]  # the repository root

RESULTS_DIR = ROOT / "experiments" / "results"

Shape = dict[str, Any]
Inputs = dict[str, torch.Tensor]


# ---------------------------------------------------------------------------------------------------- shapes
FAMILIES = ("prefill", "square", "suffix", "decode")


def gpu_shapes(args: argparse.Namespace) -> list[Shape]:
    heads = dict(Hq=args.q_heads, Hkv=args.kv_heads)
    shapes: list[Shape] = []
    for d in args.head_dims:
        if "prefill" in args.families:
            for seq in args.prefill_seqs:
                batch = max(1, args.prefill_tokens // seq)
                shapes.append(dict(kind="prefill", B=batch, **heads, Lq=seq, Lk=seq, D=d))
        if "square" in args.families:
            shapes += [dict(kind="square", B=1, **heads, Lq=seq, Lk=seq, D=d) for seq in args.square_seqs]
        if "suffix" in args.families:
            for kv in args.suffix_kv:
                shapes += [dict(kind="suffix", B=1, **heads, Lq=q, Lk=kv, D=d) for q in args.suffix_q if q <= kv]
        if "decode" in args.families:
            for kv in args.decode_kv:
                shapes += [dict(kind="decode", B=b, **heads, Lq=1, Lk=kv, D=d) for b in args.decode_batches]
    return shapes


def cpu_shapes(args: argparse.Namespace) -> list[Shape]:
    # Tiny on purpose: the Triton interpreter executes every program instance in Python.
    shapes = [
        dict(kind="prefill", B=1, Hq=4, Hkv=1, Lq=64, Lk=64, D=32),
        dict(kind="square", B=1, Hq=4, Hkv=1, Lq=48, Lk=48, D=32),
        dict(kind="suffix", B=1, Hq=4, Hkv=1, Lq=16, Lk=96, D=32),
        dict(kind="decode", B=2, Hq=4, Hkv=1, Lq=1, Lk=96, D=32),
    ]
    return [s for s in shapes if s["kind"] in args.families]


def quick_gpu_shapes(args: argparse.Namespace) -> list[Shape]:
    heads = dict(Hq=args.q_heads, Hkv=args.kv_heads)
    shapes = [
        dict(kind="prefill", B=4, **heads, Lq=4096, Lk=4096, D=128),
        dict(kind="square", B=1, **heads, Lq=4096, Lk=4096, D=128),
        dict(kind="suffix", B=1, **heads, Lq=128, Lk=16384, D=128),
        dict(kind="decode", B=16, **heads, Lq=1, Lk=4096, D=128),
    ]
    return [s for s in shapes if s["kind"] in args.families]


def attended_pairs(lq: int, lk: int) -> float:
    """Query-key pairs a bottom-right-aligned causal mask keeps (square: the Lq*Lk/2 convention)."""
    if lq == lk:
        return lq * lk / 2
    # query i attends keys 0 .. lk - lq + i
    return lq * (lk - lq) + lq * (lq + 1) / 2


def flops(shape: Shape) -> float:
    return 4.0 * shape["B"] * shape["Hq"] * shape["D"] * attended_pairs(shape["Lq"], shape["Lk"])


def bytes_moved(shape: Shape, elem: int) -> int:
    """Minimum HBM traffic: read q, k, v once, write out once (what bounds decode)."""
    b, hq, hkv, lq, lk, d = (shape[k] for k in ("B", "Hq", "Hkv", "Lq", "Lk", "D"))
    return elem * b * d * (2 * hq * lq + 2 * hkv * lk)


def describe(shape: Shape) -> str:
    return (
        f"{shape['kind']:<7} B={shape['B']:<3} H={shape['Hq']}/{shape['Hkv']} "
        f"Lq={shape['Lq']:<5} Lk={shape['Lk']:<5} D={shape['D']}"
    )


# ---------------------------------------------------------------------------------------------------- backends
def _sdpa(inp: Inputs, causal: bool) -> torch.Tensor:
    """torch SDPA with the kernels' mask: bottom-right causal. SDPA's ``is_causal`` is top-left aligned, which
    only coincides for square shapes; a single query sees every key; otherwise ``causal_lower_right``."""
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = inp["q"], inp["k"], inp["v"]
    lq, lk = q.shape[2], k.shape[2]
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if not causal or lq == 1:
        return F.scaled_dot_product_attention(q, k, v, **gqa)
    if lq == lk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, lk), **gqa)


def make_backends(device: torch.device) -> tuple[dict[str, Callable[[Inputs, bool], torch.Tensor]], dict[str, str]]:
    """name -> fn(inputs, causal); plus name -> reason for backends that cannot run here."""
    backends: dict[str, Callable[[Inputs, bool], torch.Tensor]] = {}
    skipped: dict[str, str] = {}

    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa_flash(inp: Inputs, causal: bool) -> torch.Tensor:
            return _sdpa(inp, causal)

        # The backend choice is a context, entered once around all runs of this backend (see bench_shape)
        # so that its Python overhead does not show up in the microsecond-scale decode timings.
        sdpa_flash.context = lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)  # type: ignore[attr-defined]
        backends["sdpa_flash"] = sdpa_flash
    backends["sdpa"] = _sdpa  # torch's default dispatch

    # Automatic path choice, and each path forced (split-KV: GQA-packed rows + key splits; one-pass otherwise).
    paths = {"": None, "_split": True, "_nosplit": False}
    try:
        from kvboost.kernels_triton.flash_attn import flash_attn_forward

        for suffix, split in paths.items():

            def triton_fa(inp: Inputs, causal: bool, split: bool | None = split) -> torch.Tensor:
                return flash_attn_forward(inp["q"], inp["k"], inp["v"], causal=causal, split_kv=split)

            backends["triton" + suffix] = triton_fa
    except Exception as exc:  # report, keep benchmarking the others
        skipped["triton"] = f"{type(exc).__name__}: {exc}"

    if device.type == "cuda":
        try:
            from kvboost.attention.cuda_ext import cuda_flash_attn_forward, load_cuda_extension

            load_cuda_extension()
            for suffix, split in paths.items():

                def cuda_fa(inp: Inputs, causal: bool, split: bool | None = split) -> torch.Tensor:
                    return cuda_flash_attn_forward(inp["q"], inp["k"], inp["v"], causal=causal, split_kv=split)

                backends["cuda" + suffix] = cuda_fa
        except Exception as exc:
            skipped["cuda"] = f"{type(exc).__name__}: {exc}"
    else:
        skipped["cuda"] = "no CUDA device"
    return backends, skipped


# ---------------------------------------------------------------------------------------------------- timing
def make_inputs(shape: Shape, n_sets: int, dtype: torch.dtype, device: torch.device, seed: int) -> list[Inputs]:
    gen = torch.Generator(device=device).manual_seed(seed)
    b, hq, hkv, lq, lk, d = (shape[k] for k in ("B", "Hq", "Hkv", "Lq", "Lk", "D"))
    sets = []
    for _ in range(n_sets):
        sets.append(
            {
                "q": torch.randn(b, hq, lq, d, generator=gen, device=device, dtype=dtype),
                "k": torch.randn(b, hkv, lk, d, generator=gen, device=device, dtype=dtype),
                "v": torch.randn(b, hkv, lk, d, generator=gen, device=device, dtype=dtype),
            }
        )
    return sets


def rotation_sets(shape: Shape, elem: int, target_bytes: int, max_sets: int) -> int:
    """Enough input sets that one rotation touches ``target_bytes`` (several times the L2), within limits."""
    per_set = bytes_moved(shape, elem)
    return int(min(max_sets, max(2, math.ceil(target_bytes / max(per_set, 1)))))


def time_fn(fn: Callable[[Inputs], Any], sets: list[Inputs], iters: int, warmup: int, device: torch.device) -> list[float]:
    """Milliseconds per run: warm-up, then ``iters`` runs, cycling through ``sets``."""
    for i in range(max(warmup, len(sets))):
        fn(sets[i % len(sets)])
    if device.type == "cuda":
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            inp = sets[i % len(sets)]
            starts[i].record()
            fn(inp)
            ends[i].record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(sets[i % len(sets)])
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def bench_shape(
    shape: Shape,
    backends: dict[str, Callable[[Inputs, bool], torch.Tensor]],
    args: argparse.Namespace,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Any]:
    causal = True  # bottom-right aligned: decode (q_len 1) sees every key; _sdpa builds the same mask for SDPA
    elem = torch.finfo(dtype).bits // 8
    n_sets = rotation_sets(shape, elem, args.rotate_mib * 2**20, args.max_sets)
    sets = make_inputs(shape, n_sets, dtype, device, args.seed)

    def call(name: str, inp: Inputs) -> torch.Tensor:
        return backends[name](inp, causal)

    reference = call("sdpa", sets[0]).float()
    row: dict[str, Any] = {
        **shape,
        "causal": causal,
        "dtype": str(dtype).removeprefix("torch."),
        "flops": flops(shape),
        "min_bytes": bytes_moved(shape, elem),
        "input_sets": n_sets,
        "backends": {},
    }
    for name in backends:
        entry: dict[str, Any] = {}
        context = getattr(backends[name], "context", contextlib.nullcontext)
        try:
            with context():
                out = call(name, sets[0])
                times = time_fn(lambda inp, n=name: call(n, inp), sets, args.iters, args.warmup, device)
            entry["max_abs_err_vs_sdpa"] = (out.float() - reference).abs().max().item()
            ms = statistics.median(times)
            entry.update(
                ms=ms,
                ms_p10=percentile(times, 10),
                ms_p90=percentile(times, 90),
                runs=len(times),
                tflops=row["flops"] / (ms * 1e-3) / 1e12,
                gbps=row["min_bytes"] / (ms * 1e-3) / 1e9,
            )
        except Exception as exc:  # one failing backend must not end the sweep
            entry["error"] = f"{type(exc).__name__}: {exc}"[:500]
        row["backends"][name] = entry
    # Ratios are to SDPA's flash kernel where it ran (GPU), else to SDPA's default dispatch.
    row["baseline"] = "sdpa_flash" if "ms" in row["backends"].get("sdpa_flash", {}) else "sdpa"
    baseline = row["backends"].get(row["baseline"], {}).get("ms")
    for entry in row["backends"].values():
        if "ms" in entry and baseline:
            entry["speedup_vs_sdpa"] = baseline / entry["ms"]
    del sets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------------------------------------------- output
def print_row(row: dict[str, Any], tol: float) -> None:
    print(describe(row))
    for name, e in row["backends"].items():
        if "error" in e:
            print(f"    {name:<14} ERROR {e['error']}")
            continue
        err = e["max_abs_err_vs_sdpa"]
        flag = "ok" if err <= tol else "MISMATCH"
        print(
            f"    {name:<14} {e['ms']:10.4f} ms  {e['tflops']:9.3g} TFLOP/s  {e['gbps']:9.3g} GB/s  "
            f"x{e.get('speedup_vs_sdpa', float('nan')):5.2f} vs {row['baseline']}  "
            f"max|err| {err:.2e} {flag}"
        )


#: The issue's targets for the Triton kernel (automatic path), as (name, row filter, minimum ratio to SDPA flash).
GOALS = (
    ("triton >= 0.9x sdpa_flash, square q_len = kv_len >= 4k",
     lambda r: r["Lq"] == r["Lk"] >= 4096, 0.9),
    ("triton > 1.0x sdpa_flash, q_len <= 512 over kv_len >= 4k",
     lambda r: r["Lq"] <= 512 and r["Lk"] >= 4096, 1.0),  # suffix and decode rows
)


def check_goals(rows: list[dict[str, Any]], measured: bool, backend: str = "triton") -> list[dict[str, Any]]:
    """Per goal: the rows it applies to, the worst ratio and whether every row meets it (None if not measured:
    CPU runs, or no such rows / no SDPA flash baseline)."""
    results = []
    for name, applies, minimum in GOALS:
        ratios = [
            r["backends"][backend]["speedup_vs_sdpa"]
            for r in rows
            if applies(r)
            and r.get("baseline") == "sdpa_flash"
            and "speedup_vs_sdpa" in r["backends"].get(backend, {})
        ]
        met = None
        if measured and ratios:
            met = min(ratios) >= minimum if minimum < 1.0 else min(ratios) > minimum
        results.append({"goal": name, "backend": backend, "rows": len(ratios),
                        "worst_ratio": min(ratios) if ratios else None, "met": met})
    return results


def device_slug(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")


def environment(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    env: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "dtype": str(dtype).removeprefix("torch."),
        "triton_interpret": os.environ.get("TRITON_INTERPRET"),
        "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env["sm_count"] = props.multi_processor_count
        env["capability"] = f"{props.major}.{props.minor}"
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", help="auto | cuda | cpu")
    p.add_argument("--dtype", default=None, help="bf16 | fp16 | fp32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--quick", action="store_true", help="GPU: one shape per family")
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--prefill-seqs", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--prefill-tokens", type=int, default=16384, help="batch * seq for prefill shapes")
    p.add_argument("--square-seqs", type=int, nargs="+", default=[4096, 8192, 16384], help="batch-1 square")
    p.add_argument("--suffix-q", type=int, nargs="+", default=[16, 128, 512])
    p.add_argument("--suffix-kv", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--decode-kv", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--decode-batches", type=int, nargs="+", default=[8, 32])
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--iters", type=int, default=None, help="timed runs per backend (default 100 GPU, 3 CPU)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up runs (default 10 GPU, 1 CPU)")
    p.add_argument("--rotate-mib", type=int, default=512, help="bytes one rotation of input sets should touch")
    p.add_argument("--max-sets", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON path (default experiments/results/...)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, None: None}[args.dtype]
    dtype = dtype or (torch.bfloat16 if on_gpu else torch.float32)
    args.iters = args.iters or (100 if on_gpu else 3)
    args.warmup = args.warmup if args.warmup is not None else (10 if on_gpu else 1)
    tol = 2e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4

    if on_gpu:
        shapes = quick_gpu_shapes(args) if args.quick else gpu_shapes(args)
    else:
        shapes = cpu_shapes(args)
        print(
            "NOTE: no GPU -- tiny fp32 shapes through the Triton CPU interpreter. These CPU timings are NOT "
            "performance numbers; they only show that every path runs and agrees with SDPA."
        )

    backends, skipped = make_backends(device)
    for name, why in skipped.items():
        print(f"skipping backend {name}: {why}")
    env = environment(device, dtype)
    print(f"device {env['device']}  torch {env['torch']}  triton {env['triton']}  dtype {env['dtype']}")

    rows = []
    for shape in shapes:
        row = bench_shape(shape, backends, args, dtype, device)
        print_row(row, tol)
        rows.append(row)

    goals = check_goals(rows, measured=on_gpu)
    print("goals (Triton, automatic path):" if on_gpu else "goals: not evaluated (CPU timings are not performance)")
    for g in goals:
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[g["met"]]
        worst = "-" if g["worst_ratio"] is None else f"x{g['worst_ratio']:.2f}"
        print(f"    {g['goal']:<60} {verdict:<8} worst {worst} over {g['rows']} shapes")

    result = {
        "environment": env,
        "performance_numbers": on_gpu,
        "note": None if on_gpu else "CPU run through the Triton interpreter: NOT performance numbers",
        "goals": goals,
        "flops_convention": "4*B*Hq*D*pairs; square causal pairs = Lq*Lk/2, otherwise exact bottom-right count",
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "skipped_backends": skipped,
        "error_tolerance": tol,
        "results": rows,
    }
    out = args.out or RESULTS_DIR / f"bench_attention_{device_slug(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
