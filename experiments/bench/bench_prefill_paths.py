"""Suffix prefill through HF's forward vs the fused prefill (``engine.prefill: hf|fused``), same requests.

    python -m experiments.bench.bench_prefill_paths --threads 2                    # bf16 and fp32, ~4 min on 2 cores
    python -m experiments.bench.bench_prefill_paths --threads 2 --dtypes bfloat16 --quantized \
        --shapes 0:16 0:48 0:128 0:256 0:512                                       # the dense prefill vs the blocks'

Engines on the bundled model, same dtype, differing only in ``prefill`` (``hf`` / ``fused`` on the model's own
weights) and, where prepacking runs (oneDNN in bf16, MKL in fp32), a third: ``fused`` on prepacked weights
(``prefill_weights=prepacked``).
For each shape (``--shapes`` ``cached:new``, default 20:42, 500:188 and 1000:255) and round, a fresh random
prompt's first ``cached`` tokens are warmed into every engine (so the request is an exact prefix hit plus a
``new``-token suffix), then each serves the whole prompt (one token, ``store=False``), each engine first in turn by round. Reported per shape: TTFT
median [min-max] of each path, the per-round paired ratios hf / fused (and hf / prepacked), whether the fused
prefill's first-token logits are bit-equal to HF's (it is HF's arithmetic; they should be) and how far the
prepacked engine's are (another kernel: bf16 rounding, not bits).

Writes ``experiments/results/decode/prefill_paths_<dtype>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]  # the repository root

from experiments.common import cached_new_shape, median_range, rotated, serve_prefix_hit
from kvboost.lab.environment import describe_environment

RESULTS = ROOT / "experiments" / "results" / "decode"


def engine_options(dtype: str, quantized: bool = False) -> dict[str, dict[str, str]]:
    """The engines compared: HF's forward, the fused prefill on the model's own weights, (bf16 on a CPU with
    oneDNN) the fused prefill on prepacked weights, and with ``quantized`` the quantized step's prefill on the GGUF
    blocks (``prefill=quantized``: kvboost.runtime.quant_step)."""
    from kvboost.models.prepack import unavailable_reason

    options = {"hf": {"prefill": "hf"}, "fused": {"prefill": "fused", "prefill_weights": "plain"}}
    if unavailable_reason(getattr(torch, dtype), torch.device("cpu")) is None:
        options["fused_prepacked"] = {"prefill": "fused", "prefill_weights": "prepacked"}
    if quantized:
        options["quantized"] = {"prefill": "quantized", "decode": "quantized"}
    return options


def run(dtype: str, shapes: list[tuple[int, int]], rounds: int, quantized: bool = False) -> dict[str, Any]:
    from experiments.common import compose_run_config
    from kvboost.build import build_engine

    options = engine_options(dtype, quantized)
    engines = {path: build_engine(compose_run_config(dtype=dtype, **opts)) for path, opts in options.items()}
    for engine in engines.values():
        engine.warmup()
    names = list(engines)
    vocab = engines["hf"].vocab_size
    rng = random.Random(0)
    rows = []
    with tqdm(total=len(shapes) * rounds * len(names), desc=f"prefill paths {dtype}", unit="req") as progress:
        for cached, new in shapes:
            times: dict[str, list[float]] = {path: [] for path in engines}
            equal, prepacked_diff = 0, []
            for round_ in range(rounds):
                ids = [rng.randrange(100, vocab) for _ in range(cached + new)]
                logits = {}
                for path in rotated(names, round_):
                    r = serve_prefix_hit(engines[path], ids, cached, 1)
                    times[path].append(r.ttft_ms)
                    logits[path] = r.first_token_logits
                    progress.update(1)
                equal += int(torch.equal(logits["hf"], logits["fused"]))
                if "fused_prepacked" in logits:
                    prepacked_diff.append(float((logits["hf"] - logits["fused_prepacked"]).abs().max()))
            rows.append({
                "cached": cached, "new": new, "ttft_ms": times,
                **{f"ratio_hf_over_{path}": [a / b for a, b in zip(times["hf"], times[path], strict=True)]
                   for path in names[1:]},
                "bit_equal_logits": equal / rounds,
                **({"prepacked_max_abs_logit_diff_vs_hf": prepacked_diff} if prepacked_diff else {}),
            })  # fmt: skip
    info = engines["fused"].decode_info()
    for engine in engines.values():
        engine.close()
    return {"dtype": dtype, "rounds": rounds, "engines": options,
            "prefill_reason": info["prefill_reason"], "shapes": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--shapes", nargs="+", type=cached_new_shape, default=[(20, 42), (500, 188), (1000, 255)])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quantized", action="store_true",
                        help="also the quantized step's prefill on the GGUF blocks (engine.prefill=quantized)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    from experiments.common import set_threads

    set_threads(args.threads)
    command = "python -m experiments.bench.bench_prefill_paths " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for dtype in args.dtypes:
        result = {"command": command, "threads": torch.get_num_threads(), **run(dtype, args.shapes, args.rounds, args.quantized),
                  "environment": describe_environment()}  # fmt: skip
        stem = out / f"prefill_paths_{dtype}"
        packed = "fused_prepacked" in result["engines"]
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        lines = [
            f"# Suffix prefill: HF's forward vs the fused prefill ({dtype})", "", "```", command, "```", "",
            (f"Exact prefix hit of `cached` tokens plus `new` tokens, TTFT of one token, {args.rounds} rounds "
             f"(engine order rotating: each first in turn), {result['threads']} threads. Median [min-max]."), "",
            "| cached | new | TTFT ms hf | TTFT ms fused | hf / fused (paired) | first-token logits bit-equal |"
            + (" TTFT ms fused, prepacked | hf / prepacked (paired) | logit max abs diff vs hf |" if packed else ""),
            "| --- | --- | --- | --- | --- | --- |" + (" --- | --- | --- |" if packed else ""),
        ]  # fmt: skip
        for row in result["shapes"]:
            line = (
                f"| {row['cached']} | {row['new']} | {median_range(row['ttft_ms']['hf'])} | "
                f"{median_range(row['ttft_ms']['fused'])} | {median_range(row['ratio_hf_over_fused'], 2)}x | "
                f"{row['bit_equal_logits']:.2f} |"
            )
            if packed:
                line += (
                    f" {median_range(row['ttft_ms']['fused_prepacked'])} | "
                    f"{median_range(row['ratio_hf_over_fused_prepacked'], 2)}x | "
                    f"{max(row['prepacked_max_abs_logit_diff_vs_hf']):.3g} |"
                )
            lines.append(line)
        if "quantized" in result["engines"]:
            dense = "fused_prepacked" if packed else "fused"
            lines += ["", f"The quantized step's prefill (`prefill=quantized`) against the dense one ({dense}):", "",
                      f"| cached | new | TTFT ms quantized | {dense} / quantized (paired) |", "| --- | --- | --- | --- |"]  # fmt: skip
            for row in result["shapes"]:
                t = row["ttft_ms"]
                paired = [d / q for d, q in zip(t[dense], t["quantized"], strict=True)]
                lines.append(f"| {row['cached']} | {row['new']} | {median_range(t['quantized'])} | "
                             f"{median_range(paired, 2)}x |")  # fmt: skip
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        results[dtype] = result
    return results


if __name__ == "__main__":
    main()
