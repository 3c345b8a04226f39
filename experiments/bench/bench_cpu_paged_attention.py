"""The C++ CPU kernel's paged entry point (``cpu_paged_attention_forward``) against torch SDPA and the contiguous
kernel (``cpu_attention_forward``) on the same keys, same run.

    python -m experiments.bench.bench_cpu_paged_attention --threads 2 --out /tmp/cpu_paged     # ~3 min on 2 cores
    python -m experiments.bench.bench_cpu_paged_attention --quick                              # a smoke run, seconds

Geometry: one attention layer of the bundled model (SmolLM2-135M: 9 query heads over 3 KV heads, head dim 64),
fp32 and bf16, a pool of ``--block-size`` (16) slot blocks handed out as a random permutation (no sequence is
contiguous: the worst case for reading it). Decode: one query per sequence at batch 1, 8, 32 over contexts of
256, 1024, 4096 keys. Suffix prefill: 32, 128, 256 new queries over 1000 cached keys, batch 1.

Rows per case: ``paged`` the paged kernel on the pool; ``sdpa`` torch SDPA (``enable_gqa``; decode without a
mask, prefill with the additive causal mask built once, as the fused prefill passes it) on K/V already gathered
into contiguous ``[B, Hkv, L, D]`` tensors; ``gather+sdpa`` the same including the gather from the pool (what a
paged engine without a paged kernel pays per layer); ``dense`` the contiguous kernel (``cpu_attention_forward``)
on the gathered K/V; ``read`` (decode only) a sum over the gathered K and V's bytes (as float32), a
sequential-read reference for "memory speed". Each timed call runs on the next of ``L`` copies of the case
("layers", up to ``--layers``, 30 as in the model) so that, as in a decode step through the model, the keys come
from DRAM unless every layer fits in the last-level cache; a sample is one pass over the L layers, divided by L.

Timing: ``--rounds`` rounds, the rows in a rotated order each round (each goes first in turn); per round each
row's median over ``--repeats`` samples. Reported: the median over rounds with the p10-p90 spread, the
per-round ratio of each row to ``paged`` (> 1: the paged kernel is faster), GB/s for decode (K and V bytes read
per call, 2 x B x Hkv x L x D x itemsize) and GFLOP/s for prefill (4 x D FLOPs per visible (query, key) pair and
query head), and the paged and dense outputs' largest error relative to float64 SDPA.

``--out DIR`` writes ``cpu_paged_attention.json`` and ``cpu_paged_attention.md`` (the command, the CPU model and
its flags that matter here: avx2, avx512f, avx512_bf16, amx, from /proc/cpuinfo).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]  # the repository root

from experiments.common import percentile, rotated
from kvboost.attention.cpu_ext import cpu_attention_forward, cpu_paged_attention_forward, load_cpu_extension
from kvboost.lab.environment import describe_environment

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M
DECODE_BATCHES = (1, 8, 32)
DECODE_CONTEXTS = (256, 1024, 4096)
PREFILL_NEW = (32, 128, 256)
PREFILL_CACHED = 1000
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_description() -> dict[str, Any]:
    """The CPU model name and the flags this kernel's speed depends on, from /proc/cpuinfo (Linux)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    return {"model": model, "flags": {f: f in flags for f in CPU_FLAGS}, "logical_cpus": os.cpu_count()}


class Case:
    """``layers`` copies of one paged batch (pool, block tables, queries) and of its gathered contiguous K/V.

    Every sequence has ``new`` queries at positions ``cached .. cached + new - 1`` over ``cached + new`` keys.
    """

    def __init__(self, dtype, batch, new, cached, block_size, layers, seed=0):
        self.dtype, self.batch, self.new, self.kv = dtype, batch, new, cached + new
        gen = torch.Generator().manual_seed(seed)
        per_seq = -(-self.kv // block_size)
        num_blocks = batch * per_seq + 1
        tables = torch.randperm(num_blocks, generator=gen)[: batch * per_seq].view(batch, per_seq).to(torch.int32)
        rows = torch.arange(self.kv)
        self.slots = tables.long()[:, rows // block_size] * block_size + rows % block_size  # [B, kv]
        self.index = {
            "block_tables": tables,
            "kv_lens": torch.full((batch,), self.kv, dtype=torch.int32),
            "query_start": torch.arange(batch + 1, dtype=torch.int32) * new,
            "q_positions": torch.arange(cached, self.kv, dtype=torch.int32).repeat(batch),
            "block_size": block_size,
        }
        self.layers = []
        for _ in range(layers):
            k_cache = torch.randn(KV_HEADS, num_blocks * block_size, HEAD_DIM, generator=gen).to(dtype)
            v_cache = torch.randn(KV_HEADS, num_blocks * block_size, HEAD_DIM, generator=gen).to(dtype)
            q = torch.randn(batch * new, HEADS, HEAD_DIM, generator=gen).to(dtype)
            self.layers.append({
                "q": q, "k_cache": k_cache, "v_cache": v_cache, "out": torch.empty_like(q),
                "q4": q.view(batch, new, HEADS, HEAD_DIM).transpose(1, 2),  # [B, Hq, new, D] view, as a model has
                "k4": self.gather(k_cache), "v4": self.gather(v_cache),
                "out4": torch.empty(batch, HEADS, new, HEAD_DIM, dtype=dtype),
            })  # fmt: skip
        if new > 1:  # the additive causal mask, built once per forward in the fused prefill
            allowed = torch.arange(self.kv)[None, :] <= torch.arange(cached, self.kv)[:, None]
            self.mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
        else:
            self.mask = None  # one query at the last position sees every key

    def gather(self, cache: torch.Tensor) -> torch.Tensor:
        """``[Hkv, S, D]`` pool rows of every sequence -> contiguous ``[B, Hkv, kv, D]`` (one indexing op)."""
        heads = torch.arange(cache.shape[0])
        return cache[heads[None, :, None], self.slots[:, None, :]]

    def kv_bytes(self) -> int:
        return 2 * self.batch * KV_HEADS * self.kv * HEAD_DIM * self.dtype.itemsize

    def flops(self) -> float:
        cached = self.kv - self.new
        pairs = self.new * cached + self.new * (self.new + 1) / 2
        return 4 * HEAD_DIM * HEADS * self.batch * pairs

    # The rows; each takes one layer.
    def paged(self, x: dict) -> torch.Tensor:
        return cpu_paged_attention_forward(x["q"], x["k_cache"], x["v_cache"], **self.index, out=x["out"])

    def sdpa(self, x: dict, k4=None, v4=None) -> torch.Tensor:
        k4 = x["k4"] if k4 is None else k4
        v4 = x["v4"] if v4 is None else v4
        return F.scaled_dot_product_attention(x["q4"], k4, v4, attn_mask=self.mask, enable_gqa=True)

    def gather_sdpa(self, x: dict) -> torch.Tensor:
        return self.sdpa(x, self.gather(x["k_cache"]), self.gather(x["v_cache"]))

    def dense(self, x: dict) -> torch.Tensor:
        return cpu_attention_forward(x["q4"], x["k4"], x["v4"], causal=True, out=x["out4"])

    def read(self, x: dict) -> torch.Tensor:
        # The bytes summed as float32 whatever the dtype (a bf16 sum converts on the way, far below memory speed).
        return x["k4"].view(torch.float32).sum() + x["v4"].view(torch.float32).sum()


def layers_for(dtype: torch.dtype, batch: int, kv: int, args: argparse.Namespace) -> int:
    """Copies to cycle through: enough that their K/V (pool + gathered copy) exceed ``--working-set-mb``."""
    per_layer = 4 * batch * KV_HEADS * kv * HEAD_DIM * dtype.itemsize
    return max(1, min(args.layers, math.ceil(args.working_set_mb * 2**20 / per_layer)))


def sample_ms(fn: Callable[[dict], Any], layers: list[dict]) -> float:
    start = time.perf_counter()
    for x in layers:
        fn(x)
    return (time.perf_counter() - start) * 1e3 / len(layers)


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).abs().max() / exact.abs().max()).item()


def measure(case: Case, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    rows = {"paged": case.paged, "sdpa": case.sdpa, "gather+sdpa": case.gather_sdpa, "dense": case.dense}
    if kind == "decode":
        rows["read"] = case.read
    x = case.layers[0]
    mask = None if case.mask is None else case.mask.double()
    exact = F.scaled_dot_product_attention(x["q4"].double(), x["k4"].double(), x["v4"].double(), attn_mask=mask,
                                           enable_gqa=True)  # fmt: skip
    errors = {
        "paged": relative_error(case.paged(x).view(case.batch, case.new, HEADS, HEAD_DIM).transpose(1, 2), exact),
        "dense": relative_error(case.dense(x), exact),
        "sdpa": relative_error(case.sdpa(x), exact),
    }
    for fn in rows.values():  # warm-up: first-call costs, caches, the thread pool
        sample_ms(fn, case.layers)
    per_round: dict[str, list[float]] = {name: [] for name in rows}
    for round_ in range(args.rounds):
        for name in rotated(list(rows), round_):
            per_round[name].append(statistics.median(sample_ms(rows[name], case.layers) for _ in range(args.repeats)))
    summary = {}
    for name, times in per_round.items():
        summary[name] = {"ms": statistics.median(times), "p10": percentile(times, 10), "p90": percentile(times, 90)}
        ratios = [t / p for t, p in zip(times, per_round["paged"], strict=True)]
        summary[name]["over_paged"] = {"median": statistics.median(ratios), "p10": percentile(ratios, 10),
                                       "p90": percentile(ratios, 90)}  # fmt: skip
        if kind == "decode":
            summary[name]["gb_s"] = case.kv_bytes() / summary[name]["ms"] / 1e6
        elif name != "read":
            summary[name]["gflop_s"] = case.flops() / summary[name]["ms"] / 1e6
    return {"kind": kind, "batch": case.batch, "new": case.new, "kv": case.kv, "layers": len(case.layers),
            "kv_mb_per_layer": case.kv_bytes() / 2**20, "rows": summary, "rounds_ms": per_round,
            "max_rel_error_vs_fp64": errors}  # fmt: skip


def cases(args: argparse.Namespace) -> list[tuple[str, int, int, int]]:
    """(kind, batch, new, cached) of every case."""
    if args.quick:
        return [("decode", 2, 1, 99), ("prefill", 1, 9, 40)]
    decode = [("decode", b, 1, ctx - 1) for b in DECODE_BATCHES for ctx in DECODE_CONTEXTS]
    prefill = [("prefill", 1, new, PREFILL_CACHED) for new in PREFILL_NEW]
    return [case for case in decode + prefill if case[0] in args.kinds.split(",")]


def fmt_row(row: dict[str, Any]) -> str:
    return f"{row['ms']:.3f} [{row['p10']:.3f}-{row['p90']:.3f}]"


def to_markdown(result: dict[str, Any]) -> str:
    cpu = result["cpu"]
    flags = ", ".join(f"{f}={'yes' if v else 'no'}" for f, v in cpu["flags"].items())
    lines = [
        f"# Paged CPU attention kernel vs SDPA and the contiguous kernel ({result['threads']} threads)", "",
        "```", result["command"], "```", "",
        f"CPU: {cpu['model']} ({flags}); torch {result['environment']['versions']['torch']}.", "",
        (f"Geometry: {HEADS} query heads over {KV_HEADS} KV heads, head dim {HEAD_DIM}; blocks of "
         f"{result['block_size']} slots in a random permutation; {result['rounds']} rounds of {result['repeats']} "
         "samples, rows rotated per round. Times: ms per call, median over rounds [p10-p90]; ratios: per round, "
         "row time / paged time (> 1: paged is faster), median [p10-p90]. Errors: largest |x - exact| / max |exact| "
         "against float64 SDPA. Each sample cycles through `layers` copies of the case (see the script)."), "",
    ]  # fmt: skip
    for dtype, rows in result["dtypes"].items():
        for kind in ("decode", "prefill"):
            sel = [r for r in rows if r["kind"] == kind]
            if not sel:
                continue
            if kind == "decode":
                lines += [f"## {dtype}: decode (one query per sequence)", "",
                          ("| batch | keys | layers | MB/layer | paged ms | paged GB/s | sdpa ms | sdpa GB/s | sdpa / paged "
                           "| gather+sdpa / paged | dense / paged | read GB/s | err paged | err dense |"),
                          "| --- " * 14 + "|"]  # fmt: skip
            else:
                lines += [f"## {dtype}: suffix prefill (batch 1)", "",
                          ("| cached | new | paged ms | paged GFLOP/s | sdpa ms | sdpa GFLOP/s | sdpa / paged "
                           "| gather+sdpa / paged | dense ms | dense / paged | err paged | err dense |"),
                          "| --- " * 12 + "|"]  # fmt: skip
            for r in sel:
                x, err = r["rows"], r["max_rel_error_vs_fp64"]

                def ratio(name: str, x: dict = x) -> str:
                    o = x[name]["over_paged"]
                    return f"{o['median']:.2f} [{o['p10']:.2f}-{o['p90']:.2f}]"

                if kind == "decode":
                    lines.append(
                        f"| {r['batch']} | {r['kv']} | {r['layers']} | {r['kv_mb_per_layer']:.1f} | {fmt_row(x['paged'])} "
                        f"| {x['paged']['gb_s']:.1f} | {fmt_row(x['sdpa'])} | {x['sdpa']['gb_s']:.1f} | {ratio('sdpa')} "
                        f"| {ratio('gather+sdpa')} | {ratio('dense')} | {x['read']['gb_s']:.1f} | {err['paged']:.1e} "
                        f"| {err['dense']:.1e} |"
                    )
                else:
                    lines.append(
                        f"| {r['kv'] - r['new']} | {r['new']} | {fmt_row(x['paged'])} | {x['paged']['gflop_s']:.0f} "
                        f"| {fmt_row(x['sdpa'])} | {x['sdpa']['gflop_s']:.0f} | {ratio('sdpa')} | {ratio('gather+sdpa')} "
                        f"| {fmt_row(x['dense'])} | {ratio('dense')} | {err['paged']:.1e} | {err['dense']:.1e} |"
                    )
            lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--kinds", default="decode,prefill", help="which shapes: decode, prefill or both")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layers", type=int, default=30, help="most copies of a case to cycle through")
    parser.add_argument(
        "--working-set-mb",
        type=float,
        default=128.0,
        help="cycle through enough copies for their K/V to exceed this (the LLC is 32 MB here)",
    )
    parser.add_argument("--quick", action="store_true", help="two tiny cases, 2 rounds: a smoke run")
    parser.add_argument("--out", default=None, help="directory for cpu_paged_attention.json / .md")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.repeats, args.layers = 2, 1, 2
    from experiments.common import set_threads

    set_threads(args.threads)
    start = time.perf_counter()
    load_cpu_extension()
    result: dict[str, Any] = {
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "threads": torch.get_num_threads(), "block_size": args.block_size, "rounds": args.rounds,
        "repeats": args.repeats, "kernel_load_s": time.perf_counter() - start, "cpu": cpu_description(),
        "environment": describe_environment(), "dtypes": {},
    }  # fmt: skip
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        rows = []
        for kind, batch, new, cached in cases(args):
            layers = layers_for(dtype, batch, cached + new, args)
            case = Case(dtype, batch, new, cached, args.block_size, layers)
            rows.append(measure(case, kind, args))
            x = rows[-1]["rows"]
            rate = f"{x['paged']['gb_s']:.1f} GB/s" if kind == "decode" else f"{x['paged']['gflop_s']:.0f} GFLOP/s"
            print(f"{name} {kind} B={batch} new={new} keys={cached + new} layers={layers}: paged {fmt_row(x['paged'])} "
                  f"ms ({rate}), sdpa/paged {x['sdpa']['over_paged']['median']:.2f}, gather+sdpa/paged "
                  f"{x['gather+sdpa']['over_paged']['median']:.2f}, dense/paged {x['dense']['over_paged']['median']:.2f}",
                  flush=True)  # fmt: skip
            del case
        result["dtypes"][name] = rows
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "cpu_paged_attention.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "cpu_paged_attention.md").write_text(to_markdown(result) + "\n")
        print(f"wrote {out / 'cpu_paged_attention.md'}")
    return result


if __name__ == "__main__":
    main()
