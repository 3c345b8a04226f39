"""The quantized step's 4-bit / 8-bit products at 1-32 rows, this tree's kernel against another revision's, same run.

    python -m experiments.bench.bench_quant_products --baseline-rev HEAD~1 --out experiments/results/decode/products

Both builds are ``kvboost/csrc/cpu_quant.cpp`` (with the files it includes) for this CPU's default ISA
(``kvboost.runtime.quant_step.quant_isa``): the working tree's, and ``--baseline-rev``'s (read with ``git show``,
built as another extension in this process). The weights are random, in the bundled model's shapes (SmolLM2-135M:
hidden 576, MLP 1536, q/k/v 960 rows): one layer's four products (q/k/v, o, gate/up, down) on 4-bit blocks, and
the 49,152-row head on 8-bit blocks, activations rounded to int16 (the default; ``--act``). The same layer's
weights are read again and again, so they stay in the caches: this is the kernels' compute, not the decode step's
stream of every layer from memory (that is ``bench_decode``'s). ``--layout`` packs the 4-bit weights in tiles of 8
(the default), in wide tiles of 16 (the step's layouts for int16 / int8 rows on the avx512_vnni build, each packed
for ``--act``), or times this tree's kernels on both (``tiles8-vs-wide``: the baseline is tiles of 8);
``quads-vs-words`` times the int16 rows' two wide layouts: ``--baseline-rev``'s kernels (74accc5-75455f5) on quads,
this tree's on words.

Each round times both builds on the same inputs, one after the other, in alternating order (``--repeats`` calls
each, the best kept, so a descheduled call does not count); ``--rounds`` rounds. Reported per build and row count:
the median over rounds of the layer's products (ms) and the head's, multiply-adds per second, the cost against one
row of the same build, and the per-round speed-up (baseline / this tree, median and range). Before timing, every
row count's outputs of the two builds are compared bit for bit (they compute the same integers and the same fp32
operations; a difference is reported, not hidden).

Writes ``<out>/products.json`` and ``<out>/products.md`` (the command at the top).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository root

from kvboost.lab.environment import describe_environment
from kvboost.runtime.quant_step import (
    ACTIVATION_CODES,
    ACTIVATIONS,
    WIDE_ACTIVATIONS,
    Q4Weight,
    Q8Weight,
    load_quant_extension,
    build_quant_source,
    quant_isa,
)

HIDDEN, MLP, QKV, VOCAB = 576, 1536, 960, 49152
#: (name, in features, out features) of one layer's products (gate and up as one, as the step runs them)
LAYER = (("qkv", HIDDEN, QKV), ("o", HIDDEN, HIDDEN), ("gate_up", HIDDEN, 2 * MLP), ("down", MLP, HIDDEN))
_SOURCES = ("cpu_quant.cpp", "cpu_attention.cpp", "work_pool.h")  # cpu_quant.cpp and what it includes


def build_baseline(rev: str, isa: str) -> Any:
    """``rev``'s ``cpu_quant.cpp`` built as an extension of its own (its includes beside it, from the same rev)."""
    found = subprocess.run(["git", "rev-parse", "--short", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, check=False,
                           capture_output=True, text=True)  # fmt: skip
    if found.returncode != 0:
        raise SystemExit(f"--baseline-rev {rev!r} is not a commit of {ROOT}: {found.stderr.strip()}")
    sha = found.stdout.strip()
    folder = Path(tempfile.mkdtemp(prefix=f"kvboost_quant_{sha}_"))
    for name in _SOURCES:
        text = subprocess.run(["git", "show", f"{sha}:kvboost/csrc/{name}"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout  # fmt: skip
        (folder / name).write_text(text)
    ext = build_quant_source(f"kvboost_quant_baseline_{sha}", folder / "cpu_quant.cpp", isa)
    return ext, sha


def random_q4(rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One random 4-bit weight's codes ``[rows, cols]``, scales and mins (for :class:`Q4Weight`, in any layout)."""
    q = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.uint8)
    return q, torch.rand(rows, cols // 32, generator=gen) * 0.02, -torch.rand(rows, cols // 32, generator=gen) * 0.1


def random_q8(rows: int, cols: int, gen: torch.Generator) -> Q8Weight:
    return Q8Weight(torch.randint(-127, 128, (rows, cols), generator=gen, dtype=torch.int8),
                    torch.rand(rows, cols // 32, generator=gen) * 0.01)  # fmt: skip


def layer_products(ext: Any, xs: dict[int, torch.Tensor], layer: list[tuple[int, Q4Weight]], act: int) -> list:
    return [ext.q4_matmul(xs[k], w.codes, w.scale, w.minv, None, act) for k, w in layer]


def best_ms(fn: Any, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", default="HEAD", help="git revision whose kernel is the baseline")
    parser.add_argument("--layout", choices=("tiles8", "wide", "tiles8-vs-wide", "quads-vs-words"), default="tiles8",
                        help="the 4-bit weights' layout: tiles of 8 or wide tiles of 16 for both builds (the baseline "
                        "must read it), or tiles8-vs-wide: this tree's kernels on both (--baseline-rev not used), or "
                        "quads-vs-words (int16): --baseline-rev's kernels (74accc5-75455f5) on the quads int16 rows "
                        "read there, this tree's on words")  # fmt: skip
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--act", choices=ACTIVATIONS, default="int16")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/decode/products")
    args = parser.parse_args(argv)
    if args.layout != "tiles8" and args.act not in WIDE_ACTIVATIONS:
        parser.error(f"wide tiles are read by {' or '.join(WIDE_ACTIVATIONS)} rows, not {args.act}")
    if args.layout == "quads-vs-words" and args.act != "int16":
        parser.error("quads-vs-words compares the int16 rows' wide kernels: --act int16")
    if args.threads:
        torch.set_num_threads(args.threads)
    isa, act = quant_isa(), ACTIVATION_CODES[args.act]
    ours = load_quant_extension(isa)
    base, sha = (ours, "this tree (tiles of 8)") if args.layout == "tiles8-vs-wide" else build_baseline(
        args.baseline_rev, isa)  # fmt: skip
    builds = {"baseline": base, "this tree": ours}
    gen = torch.Generator().manual_seed(0)
    weights = [(k, random_q4(n, k, gen)) for _, k, n in LAYER]

    def packed(wide_for: str | None) -> list[tuple[int, Q4Weight]]:  # the same weights in one layout
        return [(k, Q4Weight(*w, wide_for=wide_for)) for k, w in weights]

    narrow = packed(None)
    wide = narrow if args.layout == "tiles8" else packed(args.act)  # --act is int16 or int8 here
    layers = {"baseline": narrow, "this tree": wide}
    if args.layout == "wide":
        layers["baseline"] = wide
    elif args.layout == "quads-vs-words":  # the quads that int16 rows read at 74accc5-75455f5
        layers["baseline"] = packed("int8")
    head = random_q8(VOCAB, HIDDEN, gen)
    layer_macs = sum(k * n for _, k, n in LAYER)
    head_macs = HIDDEN * VOCAB

    mismatches: list[str] = []
    inputs = {}
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, generator=gen) for k in (HIDDEN, MLP)}
        inputs[rows] = xs
        a, b = (layer_products(builds[name], xs, layers[name], act) for name in builds)
        if not all(torch.equal(x, y) for x, y in zip(a, b)):
            mismatches.append(f"layer products at {rows} rows")
        if not torch.equal(base.q8_matmul(xs[HIDDEN], head.codes, head.scale, act),
                           ours.q8_matmul(xs[HIDDEN], head.codes, head.scale, act)):  # fmt: skip
            mismatches.append(f"head at {rows} rows")

    times: dict[str, dict[int, dict[str, list[float]]]] = {
        name: {r: {"layer": [], "head": []} for r in args.rows} for name in builds
    }
    for rnd in range(args.rounds):
        order = list(builds) if rnd % 2 == 0 else list(reversed(builds))
        for rows in args.rows:
            xs = inputs[rows]
            for name in order:
                ext, layer = builds[name], layers[name]

                def products(ext: Any = ext, xs: dict[int, torch.Tensor] = xs, layer: list = layer) -> list:
                    return layer_products(ext, xs, layer, act)

                def head_product(ext: Any = ext, xs: dict[int, torch.Tensor] = xs) -> torch.Tensor:
                    return ext.q8_matmul(xs[HIDDEN], head.codes, head.scale, act)

                times[name][rows]["layer"].append(best_ms(products, args.repeats))
                times[name][rows]["head"].append(best_ms(head_product, max(3, args.repeats // 4)))
        print(f"round {rnd + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    results: dict[str, Any] = {"command": "python -m experiments.bench.bench_quant_products " + shlex.join(
        sys.argv[1:] if argv is None else argv), "baseline_rev": sha, "layout": args.layout, "isa": isa, "act": args.act,
        "threads": torch.get_num_threads(), "environment": describe_environment(), "mismatches": mismatches,
        "rows": {}}  # fmt: skip
    for rows in args.rows:
        entry: dict[str, Any] = {}
        for name in builds:
            t = times[name][rows]
            layer_ms, head_ms = statistics.median(t["layer"]), statistics.median(t["head"])
            one = statistics.median(times[name][args.rows[0]]["layer"])
            entry[name] = {"layer_ms": layer_ms, "head_ms": head_ms, "layer_gmacs": rows * layer_macs / layer_ms / 1e6,
                           "head_gmacs": rows * head_macs / head_ms / 1e6, "layer_vs_first_rows": layer_ms / one}  # fmt: skip
        speedups = [b / o for b, o in zip(times["baseline"][rows]["layer"], times["this tree"][rows]["layer"])]
        head_speedups = [b / o for b, o in zip(times["baseline"][rows]["head"], times["this tree"][rows]["head"])]
        entry["layer_speedup"] = [statistics.median(speedups), min(speedups), max(speedups)]
        entry["head_speedup"] = [statistics.median(head_speedups), min(head_speedups), max(head_speedups)]
        results["rows"][rows] = entry

    setting = (f"{isa} build, activations {args.act}, 4-bit layout {args.layout}, {results['threads']} threads, "
               f"{args.rounds} rounds; baseline = "
               f"{sha}; bit-for-bit mismatches between the builds: {', '.join(mismatches) or 'none'}")  # fmt: skip
    header = (f"| rows | layer ms baseline / this tree | GMAC/s baseline / this tree | cost vs {args.rows[0]} row(s) "
              "baseline / this tree | layer speed-up (min-max) | head ms baseline / this tree | head speed-up (min-max) |")  # fmt: skip
    lines = [f"`{results['command']}`", "", setting, "", header, "| --- | --- | --- | --- | --- | --- | --- |"]
    for rows, e in results["rows"].items():
        b, o = e["baseline"], e["this tree"]
        s, hs = e["layer_speedup"], e["head_speedup"]
        lines.append(f"| {rows} | {b['layer_ms']:.3f} / {o['layer_ms']:.3f} | {b['layer_gmacs']:.1f} / "
                     f"{o['layer_gmacs']:.1f} | {b['layer_vs_first_rows']:.2f} / {o['layer_vs_first_rows']:.2f} | "
                     f"{s[0]:.2f} ({s[1]:.2f}-{s[2]:.2f}) | {b['head_ms']:.3f} / {o['head_ms']:.3f} | "
                     f"{hs[0]:.2f} ({hs[1]:.2f}-{hs[2]:.2f}) |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "products.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "products.md").write_text(text)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
