"""The quantized step's products at 1-32 rows on every build of the kernels this CPU runs (scalar, avx2, avx_vnni,
avx512_vnni, amx): the cost of R rows against one row, per build, same process, same weights.

    python -m experiments.bench.bench_quant_isas --out experiments/results/decode/isas

Each build (``kvboost.runtime.quant_step.QUANT_ISAS``; those this CPU lacks are listed as skipped) multiplies the
weights packed as the step packs them for it (wide tiles on avx512_vnni and amx for int16 / int8 rows, tiles of 8
elsewhere; ``wide_tiles_for``): one layer's four 4-bit products in the bundled model's shapes (SmolLM2-135M, as
``bench_quant_products``) and the 49,152-row 8-bit head, rows rounded to ``--act``. The weights stay in the caches:
this is the kernels' compute (what batching amortises), not a decode step's stream of every layer from memory.
Every build's outputs are compared with the scalar build's bit for bit first (a difference is reported).

Each round times every build at every row count (the builds' order reversed every other round; ``--repeats``
calls, the best kept; the scalar build ``--scalar-repeats``: it is ~50x slower). Reported per build and row count:
the median over ``--rounds`` rounds of the layer's products and of the head (ms) with their min-max, and the cost
against one row (median layer ms at R rows / at 1 row, with the range over rounds). The load average before and
after is recorded (the machine may be shared). Writes ``<out>/isas.json`` and ``<out>/isas.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository root

from experiments.bench.bench_quant_products import HIDDEN, LAYER, MLP, VOCAB, best_ms, layer_products, random_q4, random_q8
from kvboost.lab.environment import describe_environment
from kvboost.runtime.quant_step import (
    ACTIVATION_CODES,
    AMX_MIN_ROWS,
    QUANT_ISAS,
    Q4Weight,
    amx_unavailable_reason,
    isa_unavailable_reason,
    load_quant_extension,
    wide_tiles_for,
)


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isas", nargs="+", choices=QUANT_ISAS, default=list(QUANT_ISAS))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--act", choices=("int16", "int8"), default="int16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--scalar-repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/decode/isas")
    args = parser.parse_args(argv)
    if args.rows[0] != 1:
        parser.error("--rows must start at 1 (the cost is reported against one row)")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    act = ACTIVATION_CODES[args.act]
    skipped = {isa: isa_unavailable_reason(isa) for isa in args.isas if isa_unavailable_reason(isa) is not None}
    builds = {isa: load_quant_extension(isa) for isa in args.isas if isa not in skipped}
    if "amx" in builds and amx_unavailable_reason(builds["amx"]) is not None:
        skipped["amx"] = f"runs its AVX-512 VNNI kernels: {amx_unavailable_reason(builds.pop('amx'))}"
    reference = builds.get("scalar") or load_quant_extension("scalar")
    gen = torch.Generator().manual_seed(0)
    weights = [(k, random_q4(n, k, gen)) for _, k, n in LAYER]
    narrow = [(k, Q4Weight(*w)) for k, w in weights]
    layers = {isa: [(k, Q4Weight(*w, wide_for=args.act)) for k, w in weights] if wide_tiles_for(args.act, isa)
              else narrow for isa in builds}  # fmt: skip
    head = random_q8(VOCAB, HIDDEN, gen)
    inputs = {rows: {k: torch.randn(rows, k, generator=gen) for k in (HIDDEN, MLP)} for rows in args.rows}

    mismatches = []
    for rows, xs in inputs.items():
        ref = layer_products(reference, xs, narrow, act)
        ref_head = reference.q8_matmul(xs[HIDDEN], head.codes, head.scale, act)
        for isa, ext in builds.items():
            if not all(torch.equal(a, b) for a, b in zip(ref, layer_products(ext, xs, layers[isa], act))):
                mismatches.append(f"{isa}: layer products at {rows} rows")
            if not torch.equal(ref_head, ext.q8_matmul(xs[HIDDEN], head.codes, head.scale, act)):
                mismatches.append(f"{isa}: head at {rows} rows")

    times = {isa: {r: {"layer": [], "head": []} for r in args.rows} for isa in builds}
    for rnd in range(args.rounds):
        order = list(builds) if rnd % 2 == 0 else list(reversed(builds))
        for isa in order:
            ext, layer = builds[isa], layers[isa]
            repeats = args.scalar_repeats if isa == "scalar" else args.repeats
            for rows, xs in inputs.items():
                times[isa][rows]["layer"].append(best_ms(lambda: layer_products(ext, xs, layer, act), repeats))
                times[isa][rows]["head"].append(
                    best_ms(lambda: ext.q8_matmul(xs[HIDDEN], head.codes, head.scale, act), max(1, repeats // 4)))
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    results: dict[str, Any] = {
        "command": "python -m experiments.bench.bench_quant_isas " + shlex.join(sys.argv[1:] if argv is None else argv),
        "act": args.act, "threads": torch.get_num_threads(), "amx_min_rows": AMX_MIN_ROWS,
        "load_average_before": load_before, "load_average_after": os.getloadavg(),
        "environment": describe_environment(), "skipped": skipped, "mismatches_vs_scalar": mismatches, "builds": {},
    }  # fmt: skip
    for isa in builds:
        one = times[isa][args.rows[0]]["layer"]
        results["builds"][isa] = {rows: {
            "layer_ms": _spread(t["layer"]), "head_ms": _spread(t["head"]),
            "layer_vs_one_row": _spread([a / b for a, b in zip(t["layer"], one)]),
        } for rows, t in times[isa].items()}  # fmt: skip

    lines = [f"`{results['command']}`", "",
             f"activations {args.act}, {results['threads']} threads, {args.rounds} rounds, load average "
             f"{load_before[0]:.1f} before / {results['load_average_after'][0]:.1f} after; bit mismatches against the "
             f"scalar build: {', '.join(mismatches) or 'none'}; skipped: {skipped or 'none'}", "",
             "| build | rows | layer ms median (min-max) | cost vs 1 row median (min-max) | head ms median (min-max) |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for isa, per_rows in results["builds"].items():
        for rows, e in per_rows.items():
            (lm, llo, lhi), (cm, clo, chi), (hm, hlo, hhi) = e["layer_ms"], e["layer_vs_one_row"], e["head_ms"]
            lines.append(f"| {isa} | {rows} | {lm:.3f} ({llo:.3f}-{lhi:.3f}) | {cm:.2f} ({clo:.2f}-{chi:.2f}) | "
                         f"{hm:.3f} ({hlo:.3f}-{hhi:.3f}) |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "isas.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "isas.md").write_text(text)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
