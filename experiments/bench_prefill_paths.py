"""Suffix prefill through HF's forward vs the fused prefill (``engine.prefill: hf|fused``), same requests.

    python experiments/bench_prefill_paths.py --threads 2                    # bf16 and fp32, ~2 min on 2 cores

Two engines on the bundled model, same dtype, differing only in ``prefill``. For each shape (``--shapes``
``cached:new``, default 20:42, 500:188 and 1000:255) and round, a fresh random prompt's first ``cached`` tokens are
warmed into both engines (so the request is an exact prefix hit plus a ``new``-token suffix), then both serve the
whole prompt (one token, ``store=False``), the engine order alternating by round. Reported per shape: TTFT
median [min-max] of each path, the per-round paired ratio hf / fused, and whether the first-token logits are
bit-equal (the fused prefill is HF's arithmetic; they should be).

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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from experiments.environment import describe_environment
from experiments.report import median_range

RESULTS = ROOT / "experiments" / "results" / "decode"


def _shape(text: str) -> tuple[int, int]:
    cached, _, new = text.partition(":")
    if not cached.isdigit() or not new.isdigit() or int(new) < 1:
        raise argparse.ArgumentTypeError(f"a shape is cached:new with new >= 1, got {text!r}")
    return int(cached), int(new)


def run(dtype: str, shapes: list[tuple[int, int]], rounds: int) -> dict[str, Any]:
    from kvboost import KVBoost

    engines = {path: KVBoost.from_pretrained(dtype=dtype, prefill=path) for path in ("hf", "fused")}
    for engine in engines.values():
        engine.warmup()
    vocab = engines["hf"].vocab_size
    rng = random.Random(0)
    rows = []
    with tqdm(total=len(shapes) * rounds * 2, desc=f"prefill paths {dtype}", unit="req") as progress:
        for cached, new in shapes:
            times: dict[str, list[float]] = {path: [] for path in engines}
            equal = 0
            for round_ in range(rounds):
                ids = [rng.randrange(100, vocab) for _ in range(cached + new)]
                logits = {}
                order = list(engines) if round_ % 2 == 0 else list(engines)[::-1]
                for path in order:
                    engine = engines[path]
                    engine.reset_cache()
                    if cached:
                        engine.warm(ids[:cached])
                    r = engine.generate(ids, max_new_tokens=1, store=False)
                    if r.cached_tokens != cached:
                        raise RuntimeError(f"expected {cached} cached tokens, the engine reused {r.cached_tokens}")
                    times[path].append(r.ttft_ms)
                    logits[path] = r.first_token_logits
                    progress.update(1)
                equal += int(torch.equal(logits["hf"], logits["fused"]))
            rows.append({
                "cached": cached, "new": new, "ttft_ms": times,
                "ratio_hf_over_fused": [a / b for a, b in zip(times["hf"], times["fused"], strict=True)],
                "bit_equal_logits": equal / rounds,
            })  # fmt: skip
    info = engines["fused"].decode_info()
    for engine in engines.values():
        engine.close()
    return {"dtype": dtype, "rounds": rounds, "prefill_reason": info["prefill_reason"], "shapes": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--shapes", nargs="+", type=_shape, default=[(20, 42), (500, 188), (1000, 255)])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python experiments/bench_prefill_paths.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for dtype in args.dtypes:
        result = {"command": command, "threads": torch.get_num_threads(), **run(dtype, args.shapes, args.rounds),
                  "environment": describe_environment()}  # fmt: skip
        stem = out / f"prefill_paths_{dtype}"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
        lines = [
            f"# Suffix prefill: HF's forward vs the fused prefill ({dtype})", "", "```", command, "```", "",
            (f"Exact prefix hit of `cached` tokens plus `new` tokens, TTFT of one token, {args.rounds} rounds "
             f"(engine order alternating), {result['threads']} threads. Median [min-max]."), "",
            "| cached | new | TTFT ms hf | TTFT ms fused | hf / fused (paired) | first-token logits bit-equal |",
            "| --- | --- | --- | --- | --- | --- |",
        ]  # fmt: skip
        for row in result["shapes"]:
            lines.append(
                f"| {row['cached']} | {row['new']} | {median_range(row['ttft_ms']['hf'])} | "
                f"{median_range(row['ttft_ms']['fused'])} | {median_range(row['ratio_hf_over_fused'], 2)}x | "
                f"{row['bit_equal_logits']:.2f} |"
            )
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        results[dtype] = result
    return results


if __name__ == "__main__":
    main()
