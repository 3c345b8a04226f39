"""The quantized step in the engine, this tree's kernels against another revision's, same process, same weights.

    python -m experiments.bench.bench_step_ab --baseline-rev d77316e --out experiments/results/decode/step_ab

One engine on the bundled model with its prompts on the quantized step too (``chunked_prompts=True``: what
kvboost-server runs; ``engine.prefill`` resolves to ``quantized``). The step's C++ extension is this tree's
``kvboost/csrc/cpu_quant.cpp`` or ``--baseline-rev``'s (built as another extension, as
``bench_quant_products`` does), swapped in between calls (``QuantDecodeStep.ext``), so both time the same packed
weights, the same pool and the same Python around the kernels: the difference is the extension's. The baseline's
packing must be this tree's (the tensors are shared): a first prompt's logits under both builds are compared and a
baseline whose logits are off by 5% of their span or more is refused.

Timed, in rounds that alternate which build goes first:
- decode steps (``bench_decode.time_decode``: ``--tokens`` greedy steps of R rows, each row a random prompt of
  ``--context`` tokens prefilled untimed) at each of ``--rows``; the cost of R rows against one row per build;
- cold prefills (``generate(..., max_new_tokens=1)``, its TTFT) of a new random prompt of each of ``--prompts``
  tokens (never seen before, so nothing is reused).

Reported: medians per build, and the per-round speed-up (baseline / this tree: median, min-max). Writes
``<out>/step_ab.json`` and ``<out>/step_ab.md`` (the command at the top).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[2]  # the repository root

from experiments.bench.bench_decode import time_decode
from experiments.bench.bench_quant_products import build_baseline
from kvboost.lab.environment import describe_environment
from kvboost.runtime.quant_step import quant_isa


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40000) for _ in range(n)]


def prefill_logits(engine: Any, prompt: list[int]) -> torch.Tensor:
    """The last row's logits of one forward of ``prompt`` (a table of its own, released after: nothing is cached)."""
    from kvboost.kv.block_table import BlockTable
    from kvboost.runtime.batch import ForwardBatch, SeqInput

    table = BlockTable(engine.pool)
    try:
        with torch.inference_mode():
            return engine.runner.run(ForwardBatch.build([SeqInput(table, prompt)]))[-1].float()
    finally:
        table.release()


def check_same_packing(engine: Any, builds: dict[str, Any]) -> float:
    """Max |logit difference| of one prompt's forward under each build; raises when it exceeds 5% of the logits'
    span: the baseline reads the packed weights differently (another layout: its timings would be meaningless).
    Kernels that round differently stay far below that (a changed summation order: ~0.07 of a span of ~25)."""
    step, prompt = engine.runner.quantized, _prompt(random.Random(7), 48)
    logits = {}
    for name, ext in builds.items():
        step.ext = ext
        logits[name] = prefill_logits(engine, prompt)
    diff = (logits["baseline"] - logits["tree"]).abs().max().item()
    spread = (logits["tree"].max() - logits["tree"].min()).item()
    if not diff < 0.05 * spread:
        raise SystemExit(f"the baseline's kernels give other logits on this tree's packed weights (max diff {diff:.3g}"
                         f", the logits span {spread:.3g}): its packing differs; pick a revision with this tree's "
                         "layout")  # fmt: skip
    return diff


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvboost import KVBoost

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = KVBoost.from_pretrained(chunked_prompts=True)
    info = engine.decode_info()
    if info.get("decode") != "quantized" or info.get("prefill") != "quantized":
        raise SystemExit(f"the bundled model does not run on the quantized step here ({info.get('reasons')})")
    step = engine.runner.quantized
    baseline, sha = build_baseline(args.baseline_rev, quant_isa())
    builds = {"baseline": baseline, "tree": step.ext}
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    diff = check_same_packing(engine, builds)
    for ext in builds.values():  # first calls of each shape: allocator, oneDNN, the kernels' pages
        step.ext = ext
        time_decode(engine, [_prompt(rng, args.context)] * max(args.rows), 2)
        for n in args.prompts:
            engine.generate(_prompt(rng, n), max_new_tokens=1)
    decode: dict[tuple[int, str], list[float]] = {}
    prefill: dict[tuple[int, str], list[float]] = {}
    total = args.rounds * (len(args.rows) + len(args.prompts)) * 2
    with tqdm(total=total, desc="step A/B") as bar:
        for r in range(args.rounds):
            order = ("baseline", "tree") if r % 2 == 0 else ("tree", "baseline")
            for rows in args.rows:
                prompts = [torch.randint(100, 40000, (args.context,), generator=gen).tolist() for _ in range(rows)]
                for name in order:
                    step.ext = builds[name]
                    seconds, _ = time_decode(engine, prompts, args.tokens)
                    decode.setdefault((rows, name), []).append(seconds / args.tokens * 1e3)
                    bar.update(1)
            for n in args.prompts:
                for name in order:
                    step.ext = builds[name]
                    ttft = engine.generate(_prompt(rng, n), max_new_tokens=1).ttft_ms
                    prefill.setdefault((n, name), []).append(ttft)
                    bar.update(1)
    step.ext = builds["tree"]
    engine.close()

    def speedups(base: list[float], tree: list[float]) -> dict[str, float]:
        ratios = sorted(b / t for b, t in zip(base, tree, strict=True))
        return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}

    one = {name: statistics.median(decode[(min(args.rows), name)]) for name in builds}
    decode_rows = [{
        "rows": rows, **{f"{name}_ms": statistics.median(decode[(rows, name)]) for name in builds},
        **{f"{name}_cost_vs_{min(args.rows)}_rows": statistics.median(decode[(rows, name)]) / one[name]
           for name in builds},
        "speedup": speedups(decode[(rows, "baseline")], decode[(rows, "tree")]),
    } for rows in args.rows]  # fmt: skip
    prefill_rows = [{
        "tokens": n, **{f"{name}_ms": statistics.median(prefill[(n, name)]) for name in builds},
        "speedup": speedups(prefill[(n, "baseline")], prefill[(n, "tree")]),
    } for n in args.prompts]  # fmt: skip
    return {
        "baseline_rev": sha, "isa": quant_isa(), "threads": torch.get_num_threads(), "rounds": args.rounds,
        "context": args.context, "tokens": args.tokens, "logits_max_diff_between_builds": diff,
        "decode": decode_rows, "prefill": prefill_rows,
        "raw": {"decode": {f"{k[0]}:{k[1]}": v for k, v in decode.items()},
                "prefill": {f"{k[0]}:{k[1]}": v for k, v in prefill.items()}},
    }  # fmt: skip


def to_markdown(res: dict[str, Any], command: str) -> str:
    base = res["baseline_rev"]
    lines = [f"`{command}`", "",
             (f"{res['isa']} build, {res['threads']} threads, {res['rounds']} rounds; baseline = {base}'s extension, "
              f"tree = this tree's, swapped into one engine (max logit difference between them on one prompt: "
              f"{res['logits_max_diff_between_builds']:.2g})"), "",
             f"Decode steps ({res['tokens']} steps, {res['context']} tokens of context per row):", "",
             "| rows | ms per step baseline / tree | cost vs one row baseline / tree | speed-up (min-max) |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    first = min(r["rows"] for r in res["decode"])
    for r in res["decode"]:
        s = r["speedup"]
        lines.append(f"| {r['rows']} | {r['baseline_ms']:.2f} / {r['tree_ms']:.2f} | "
                     f"{r[f'baseline_cost_vs_{first}_rows']:.2f} / {r[f'tree_cost_vs_{first}_rows']:.2f} | "
                     f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) |")  # fmt: skip
    lines += ["", "Cold prefills (TTFT of a new prompt, nothing reused):", "",
              "| tokens | ms baseline / tree | speed-up (min-max) |", "| --- | --- | --- |"]  # fmt: skip
    for r in res["prefill"]:
        s = r["speedup"]
        lines.append(f"| {r['tokens']} | {r['baseline_ms']:.1f} / {r['tree_ms']:.1f} | "
                     f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", default="HEAD", help="git revision whose kernels are the baseline")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--prompts", type=int, nargs="+", default=[16, 48, 128, 256, 512])
    parser.add_argument("--context", type=int, default=64, help="tokens of context of each decoding row")
    parser.add_argument("--tokens", type=int, default=16, help="decode steps timed per row count and round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "experiments/results/decode/step_ab")
    args = parser.parse_args(argv)
    command = "python -m experiments.bench.bench_step_ab " + shlex.join(argv if argv is not None else sys.argv[1:])
    res = run(args)
    res["environment"], res["command"] = describe_environment(), command
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_ab.json").write_text(json.dumps(res, indent=1))
    md = to_markdown(res, command)
    (args.out / "step_ab.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
