"""The quantized step in the engine, this tree's kernels against another revision's (or against this tree's own
tiles of 8), same process, same weights.

    python -m experiments.bench.bench_step_ab --baseline-rev d77316e --out experiments/results/decode/step_ab
    python -m experiments.bench.bench_step_ab --baseline-layout tiles8 --out experiments/results/decode/wide_ab

One engine on the bundled model with its prompts on the quantized step too (``chunked_prompts=True``: what
kvboost-server runs; ``engine.prefill`` resolves to ``quantized``). Each arm is a packed step and a C++ extension,
swapped into the engine between calls (``runner.quantized``, ``QuantDecodeStep.ext``), so both time the same pool
and the same Python around the kernels:
- ``--baseline-rev REV``: the baseline is ``REV``'s ``kvboost/csrc/cpu_quant.cpp`` (built as another extension,
  as ``bench_quant_products`` does) on this tree's packing; where that revision cannot read the tree's wide tiles
  for the step's rows (``Q4Weight(wide_for=...)``; int8 rows' from 74accc5, int16 rows' words from the revision
  after 75455f5), both arms run a step packed in tiles of 8, and the report says so. The baseline's packing must
  be this tree's (the tensors are shared): a first prompt's logits under both arms are compared and a baseline
  whose logits are off by 5% of their span or more is refused.
- ``--baseline-layout tiles8``: the baseline is this tree's extension on a step packed in tiles of 8, the tree arm
  the default packing (wide tiles on the avx512_vnni build): the layouts' A/B (the same bits).
- ``--baseline-layout quads`` (int16 rows on the avx512_vnni build): the baseline is ``--baseline-rev``'s extension
  on the same weights repacked in the quads that int16 rows read from 74accc5 to 75455f5 (the int8 rows' layout;
  a revision in that range must be named), the tree arm this tree's words: the two int16 wide kernels' A/B.

Timed, in rounds that alternate which arm goes first:
- decode steps (``bench_decode.time_decode``: ``--tokens`` greedy steps of R rows, each row a random prompt of
  ``--context`` tokens prefilled untimed) at each of ``--rows``; the cost of R rows against one row per arm;
- cold prefills (``generate(..., max_new_tokens=1)``, its TTFT) of a new random prompt of each of ``--prompts``
  tokens (never seen before, so nothing is reused).

Reported: medians per arm, and the per-round speed-up (baseline / this tree: median, min-max). Writes
``<out>/step_ab.json`` and ``<out>/step_ab.md`` (the command at the top).
"""

from __future__ import annotations

import argparse
import copy
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
from kvboost.runtime.quant_step import ACTIVATIONS, QuantDecodeStep, pack_q4_codes, quant_isa, unpack_q4_codes


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


#: an arm of the A/B: a packed quantized step and the extension that runs it
Arm = tuple[Any, Any]


def words_as_quads(codes: torch.Tensor) -> torch.Tensor:
    """An int16 rows' wide weight (words ``[T, K/8, 32, 2]``) repacked in quads ``[T, K/8, 64]`` (see
    :class:`~kvboost.runtime.quant_step.Q4Weight`): the same codes."""
    return pack_q4_codes(unpack_q4_codes(codes, "int16"), "int8")


def quads_step(step: Any) -> Any:
    """A shallow copy of a words-packed int16 ``step`` whose 4-bit weights are in quads (its other tensors shared)."""
    if not (step.wide and step.activations == "int16"):
        raise SystemExit("--baseline-layout quads compares the int16 rows' wide kernels: the step must be int16 "
                         f"rows in wide tiles (here {step.activations}, {step.describe()['layout']})")  # fmt: skip
    quads = copy.copy(step)
    quads.flat = [words_as_quads(t) if t.dim() == 4 else t for t in step.flat]
    return quads


def use(engine: Any, arm: Arm) -> None:
    """Put ``arm``'s step and extension into the engine."""
    step, ext = arm
    step.ext = ext
    engine.runner.quantized = step


def reads_wide_tiles(ext: Any, activations: str) -> bool:
    """Whether ``ext`` multiplies a weight in this tree's wide tiles for ``activations`` rows (revisions before them
    refuse its codes' shape)."""
    from kvboost.runtime.quant_step import ACTIVATION_CODES, Q4Weight

    w = Q4Weight(torch.zeros(16, 32, dtype=torch.uint8), torch.ones(16, 1), torch.zeros(16, 1), wide_for=activations)
    try:
        ext.q4_matmul(torch.ones(1, 32), w.codes, w.scale, w.minv, None, ACTIVATION_CODES[activations])
    except RuntimeError:
        return False
    return True


def check_same_packing(engine: Any, arms: dict[str, Arm]) -> float:
    """Max |logit difference| of one prompt's forward under each arm; raises when it exceeds 5% of the logits'
    span: the baseline reads the packed weights differently (another layout: its timings would be meaningless).
    Kernels that round differently stay far below that (a changed summation order: ~0.07 of a span of ~25)."""
    prompt = _prompt(random.Random(7), 48)
    logits = {}
    for name, arm in arms.items():
        use(engine, arm)
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
    engine = KVBoost.from_pretrained(chunked_prompts=True, decode_activations=args.activations)
    info = engine.decode_info()
    if info.get("decode") != "quantized":
        raise SystemExit(f"the bundled model does not run on the quantized step here ({info.get('reasons')})")
    if info.get("prefill") != "quantized" and args.prompts:  # int8: prompts run dense, the same in both arms
        print(f"prompts prefill on the {info.get('prefill')} path with {args.activations} activations, not on the "
              "step: not timed", file=sys.stderr)  # fmt: skip
        args.prompts = []
    step = engine.runner.quantized

    def tiles8() -> Any:
        return step if not step.wide else QuantDecodeStep(engine.runner, step.activations, wide=False)

    if args.baseline_layout == "tiles8":
        sha, packing = "this tree", "baseline: tiles of 8; tree: " + step.describe()["layout"]
        arms = {"baseline": (tiles8(), step.ext), "tree": (step, step.ext)}
    elif args.baseline_layout == "quads":
        baseline, sha = build_baseline(args.baseline_rev, quant_isa())
        packing = "baseline: wide tiles of 16 (quads, int16 rows); tree: " + step.describe()["layout"]
        arms = {"baseline": (quads_step(step), baseline), "tree": (step, step.ext)}
    else:
        baseline, sha = build_baseline(args.baseline_rev, quant_isa())
        shared = step if not step.wide or reads_wide_tiles(baseline, step.activations) else tiles8()
        packing = "both: " + shared.describe()["layout"]
        arms = {"baseline": (shared, baseline), "tree": (shared, step.ext)}
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    diff = check_same_packing(engine, arms)
    for arm in arms.values():  # first calls of each shape: allocator, oneDNN, the kernels' pages
        use(engine, arm)
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
                    use(engine, arms[name])
                    seconds, _ = time_decode(engine, prompts, args.tokens)
                    decode.setdefault((rows, name), []).append(seconds / args.tokens * 1e3)
                    bar.update(1)
            for n in args.prompts:
                for name in order:
                    use(engine, arms[name])
                    ttft = engine.generate(_prompt(rng, n), max_new_tokens=1).ttft_ms
                    prefill.setdefault((n, name), []).append(ttft)
                    bar.update(1)
    use(engine, arms["tree"])
    engine.close()

    def speedups(base: list[float], tree: list[float]) -> dict[str, float]:
        ratios = sorted(b / t for b, t in zip(base, tree, strict=True))
        return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}

    one = {name: statistics.median(decode[(min(args.rows), name)]) for name in arms}
    decode_rows = [{
        "rows": rows, **{f"{name}_ms": statistics.median(decode[(rows, name)]) for name in arms},
        **{f"{name}_cost_vs_{min(args.rows)}_rows": statistics.median(decode[(rows, name)]) / one[name]
           for name in arms},
        "speedup": speedups(decode[(rows, "baseline")], decode[(rows, "tree")]),
    } for rows in args.rows]  # fmt: skip
    prefill_rows = [{
        "tokens": n, **{f"{name}_ms": statistics.median(prefill[(n, name)]) for name in arms},
        "speedup": speedups(prefill[(n, "baseline")], prefill[(n, "tree")]),
    } for n in args.prompts]  # fmt: skip
    return {
        "baseline_rev": sha, "packing": packing, "activations": args.activations, "isa": quant_isa(),
        "threads": torch.get_num_threads(), "rounds": args.rounds,
        "context": args.context, "tokens": args.tokens, "logits_max_diff_between_builds": diff,
        "decode": decode_rows, "prefill": prefill_rows,
        "raw": {"decode": {f"{k[0]}:{k[1]}": v for k, v in decode.items()},
                "prefill": {f"{k[0]}:{k[1]}": v for k, v in prefill.items()}},
    }  # fmt: skip


def to_markdown(res: dict[str, Any], command: str) -> str:
    base = res["baseline_rev"]
    lines = [f"`{command}`", "",
             (f"{res['isa']} build, {res['activations']} activations, {res['threads']} threads, {res['rounds']} "
              f"rounds; baseline = {base}'s extension, "
              f"tree = this tree's, swapped into one engine; packing: {res['packing']} (max logit difference "
              f"between them on one prompt: {res['logits_max_diff_between_builds']:.2g})"), "",
             f"Decode steps ({res['tokens']} steps, {res['context']} tokens of context per row):", "",
             "| rows | ms per step baseline / tree | cost vs one row baseline / tree | speed-up (min-max) |",
             "| --- | --- | --- | --- |"]  # fmt: skip
    first = min(r["rows"] for r in res["decode"])
    for r in res["decode"]:
        s = r["speedup"]
        lines.append(f"| {r['rows']} | {r['baseline_ms']:.2f} / {r['tree_ms']:.2f} | "
                     f"{r[f'baseline_cost_vs_{first}_rows']:.2f} / {r[f'tree_cost_vs_{first}_rows']:.2f} | "
                     f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) |")  # fmt: skip
    if not res["prefill"]:
        return "\n".join(lines) + "\n"
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
    parser.add_argument("--baseline-layout", choices=("same", "tiles8", "quads"), default="same",
                        help="tiles8: the baseline is this tree's kernels on a step packed in tiles of 8 (the layouts' "
                        "A/B; --baseline-rev is not used); quads: --baseline-rev's kernels (74accc5-75455f5) on the "
                        "int16 rows' former wide layout")  # fmt: skip
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--activations", choices=ACTIVATIONS, default="int16",
                        help="the step's activations (int8: decode only; its prompts prefill dense)")  # fmt: skip
    parser.add_argument("--prompts", type=int, nargs="*", default=[16, 48, 128, 256, 512])
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
