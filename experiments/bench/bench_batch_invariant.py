"""The price of exact bf16 reuse: ``attn=batch_invariant`` against the default ``attn=sdpa``, same requests.

    python -m experiments.bench.bench_batch_invariant --threads 2          # ~4 min on 2 cores

Two engines on the bundled model in the same dtype (default bf16), built with their defaults (``sdpa``: the
fused prefill and the compiled decode step; ``batch_invariant``: tiled projections on prepacked weights, its own
attention, the eager decode step calling it). For each shape (``--shapes`` ``cached:new``, default a cold 1,000
tokens, 1,000 + 255, 500 + 120 and 20 + 42) and round, a fresh random prompt's first ``cached`` tokens are warmed
into each engine (the request is an exact prefix hit plus a ``new``-token suffix), then each serves the whole
prompt with ``--tokens`` greedy tokens (``store=False``), each engine first in turn by round. Each engine then
serves the same prompt cold (``mode="cold"``, untimed): the share of requests whose reuse gave the cold
prefill's first-token logits bit for bit and its greedy tokens is the column the backend exists for.

Reported per shape: TTFT and decode tokens/s, median [min-max] of each engine, the per-round paired ratio
batch_invariant / sdpa, and the exactness shares. Writes ``experiments/results/bf16_exactness/cost/
bench_<dtype>.json`` and ``.md``.
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

from experiments.common import RESULTS_DIR, cached_new_shape, median_range, rotated, serve_prefix_hit
from kvboost.lab.environment import describe_environment

RESULTS = RESULTS_DIR / "bf16_exactness" / "cost"
ENGINES = {"sdpa": {}, "batch_invariant": {"attn": "batch_invariant"}}
#: ``--before``: the backend with its fixed shapes everywhere (``attn.rows=tiles``: the arithmetic before the row
#: probes, the same bits), measured in the same run.
BEFORE = {"batch_invariant_tiles": {"attn": {"name": "batch_invariant", "rows": "tiles"}}}


def run(dtype: str, shapes: list[tuple[int, int]], rounds: int, tokens: int, before: bool = False) -> dict[str, Any]:
    from experiments.common import compose_run_config
    from kvboost.build import build_engine

    configs = {**ENGINES, **(BEFORE if before else {})}
    engines = {name: build_engine(compose_run_config(dtype=dtype, **opts)) for name, opts in configs.items()}
    for engine in engines.values():
        engine.warmup()
        # One untimed request: attn=batch_invariant's row probes (per GEMM shape, on first use) run here.
        engine.generate(list(range(100, 140)), max_new_tokens=3, store=False, mode="cold")
    names = list(engines)
    vocab = engines["sdpa"].vocab_size
    rng = random.Random(0)
    rows = []
    with tqdm(total=len(shapes) * rounds * len(names), desc=f"batch_invariant vs sdpa {dtype}", unit="req") as bar:
        for cached, new in shapes:
            ttft: dict[str, list[float]] = {name: [] for name in names}
            decode: dict[str, list[float]] = {name: [] for name in names}
            logits_equal = dict.fromkeys(names, 0)
            tokens_equal = dict.fromkeys(names, 0)
            same_as_tiles = 0  # rounds where batch_invariant's reuse logits equal batch_invariant_tiles' to the bit
            for round_ in range(rounds):
                ids = [rng.randrange(100, vocab) for _ in range(cached + new)]
                logits: dict[str, torch.Tensor] = {}
                for name in rotated(names, round_):
                    engine = engines[name]
                    reuse = serve_prefix_hit(engine, ids, cached, tokens)
                    ttft[name].append(reuse.ttft_ms)
                    decode[name].append(reuse.decode_tok_s)
                    logits[name] = reuse.first_token_logits
                    cold = engine.generate(ids, max_new_tokens=tokens, store=False, mode="cold")
                    logits_equal[name] += int(torch.equal(reuse.first_token_logits, cold.first_token_logits))
                    tokens_equal[name] += int(reuse.output_ids == cold.output_ids)
                    bar.update(1)
                if before:
                    same_as_tiles += int(torch.equal(logits["batch_invariant"], logits["batch_invariant_tiles"]))
            ratios = {
                f"ttft_ratio_{name}_over_sdpa": [a / b for a, b in zip(ttft[name], ttft["sdpa"], strict=True)]
                for name in names if name != "sdpa"
            } | {
                f"decode_time_ratio_{name}_over_sdpa": [
                    a / b for a, b in zip(decode["sdpa"], decode[name], strict=True)]
                for name in names if name != "sdpa"
            }  # fmt: skip
            if before:
                ratios["ttft_ratio_invariant_over_tiles"] = [
                    a / b for a, b in zip(ttft["batch_invariant"], ttft["batch_invariant_tiles"], strict=True)]
                ratios["decode_time_ratio_invariant_over_tiles"] = [
                    a / b for a, b in zip(decode["batch_invariant_tiles"], decode["batch_invariant"], strict=True)]
                ratios["invariant_logits_equal_tiles"] = same_as_tiles / rounds
            rows.append({**ratios,
                "cached": cached, "new": new, "ttft_ms": ttft, "decode_tok_s": decode,
                "ttft_ratio_invariant_over_sdpa": [a / b for a, b in zip(ttft["batch_invariant"], ttft["sdpa"],
                                                                          strict=True)],
                "decode_ratio_sdpa_over_invariant": [a / b for a, b in zip(decode["sdpa"], decode["batch_invariant"],
                                                                            strict=True)],
                "reuse_equals_cold_logits": {n: logits_equal[n] / rounds for n in names},
                "reuse_equals_cold_tokens": {n: tokens_equal[n] / rounds for n in names},
            })  # fmt: skip
    info = {name: engine.decode_info() for name, engine in engines.items()}
    for engine in engines.values():
        engine.close()
    return {"dtype": dtype, "rounds": rounds, "tokens": tokens, "engines": configs, "decode_info": info,
            "shapes": rows}  # fmt: skip


def _table(result: dict[str, Any], command: str) -> list[str]:
    lines = [
        f"# attn=batch_invariant vs attn=sdpa ({result['dtype']})", "", "```", command, "```", "",
        (f"Exact prefix hit of `cached` tokens plus `new` tokens (cached 0: a cold prompt), {result['tokens']} greedy "
         f"tokens, {result['rounds']} rounds (engine order rotating), {result['threads']} threads; median [min-max]. "
         "Ratios are per round. 'reuse = cold' is the share of requests whose reuse gave the cold prefill's "
         "first-token logits bit for bit / its greedy tokens."), "",
        ("| cached | new | TTFT ms sdpa | TTFT ms invariant | invariant / sdpa | decode tok/s sdpa | decode tok/s "
         "invariant | sdpa / invariant (decode time) | reuse = cold, sdpa | reuse = cold, invariant |"),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    if "batch_invariant_tiles" in result["engines"]:
        return _table_before(result, command)
    for row in result["shapes"]:
        logits, toks = row["reuse_equals_cold_logits"], row["reuse_equals_cold_tokens"]
        lines.append(
            f"| {row['cached']} | {row['new']} | {median_range(row['ttft_ms']['sdpa'])} | "
            f"{median_range(row['ttft_ms']['batch_invariant'])} | "
            f"{median_range(row['ttft_ratio_invariant_over_sdpa'], 2)}x | {median_range(row['decode_tok_s']['sdpa'])} | "
            f"{median_range(row['decode_tok_s']['batch_invariant'])} | "
            f"{median_range(row['decode_ratio_sdpa_over_invariant'], 2)}x | "
            f"{logits['sdpa']:.2f} / {toks['sdpa']:.2f} | {logits['batch_invariant']:.2f} / {toks['batch_invariant']:.2f} |"
        )
    return lines


def _table_before(result: dict[str, Any], command: str) -> list[str]:
    """The table of a ``--before`` run: sdpa, the backend with fixed shapes (before) and with the row probes
    (after), same requests."""
    lines = [
        f"# attn=batch_invariant before (rows=tiles) and after (rows=auto) vs attn=sdpa ({result['dtype']})", "",
        "```", command, "```", "",
        (f"Exact prefix hit of `cached` tokens plus `new` tokens (cached 0: a cold prompt), {result['tokens']} greedy "
         f"tokens, {result['rounds']} rounds (engine order rotating), {result['threads']} threads; median [min-max]. "
         "Ratios are per round against sdpa in the same round (decode: time per token). 'reuse = cold': share of "
         "requests whose reuse gave the cold prefill's first-token logits bit for bit / its greedy tokens; "
         "'after = before': share whose reuse logits are the tiles' to the bit."), "",
        ("| cached | new | TTFT ms sdpa | TTFT ms before | TTFT ms after | TTFT before / sdpa | TTFT after / sdpa | "
         "decode tok/s sdpa | before | after | decode time before / sdpa | after / sdpa | reuse = cold, sdpa | "
         "before | after | after = before |"),
        "|" + " --- |" * 16,
    ]  # fmt: skip
    for row in result["shapes"]:
        logits, toks = row["reuse_equals_cold_logits"], row["reuse_equals_cold_tokens"]
        t, d = row["ttft_ms"], row["decode_tok_s"]
        lines.append(
            f"| {row['cached']} | {row['new']} | {median_range(t['sdpa'])} | "
            f"{median_range(t['batch_invariant_tiles'])} | {median_range(t['batch_invariant'])} | "
            f"{median_range(row['ttft_ratio_batch_invariant_tiles_over_sdpa'], 2)}x | "
            f"{median_range(row['ttft_ratio_batch_invariant_over_sdpa'], 2)}x | {median_range(d['sdpa'])} | "
            f"{median_range(d['batch_invariant_tiles'])} | {median_range(d['batch_invariant'])} | "
            f"{median_range(row['decode_time_ratio_batch_invariant_tiles_over_sdpa'], 2)}x | "
            f"{median_range(row['decode_time_ratio_batch_invariant_over_sdpa'], 2)}x | "
            + " | ".join(f"{logits[e]:.2f} / {toks[e]:.2f}" for e in ("sdpa", "batch_invariant_tiles",
                                                                        "batch_invariant"))
            + f" | {row['invariant_logits_equal_tiles']:.2f} |"
        )  # fmt: skip
    return lines


def _cpu() -> dict[str, Any]:
    """The CPU model and the features that change the kernels' bits (``python -m kvboost.env``)."""
    from kvboost import env

    return {"model": env.cpu_model_name(), **env.cpu_features()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--shapes", nargs="+", type=cached_new_shape, default=[(0, 1000), (1000, 255), (500, 120), (20, 42)]
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=16, help="greedy tokens per request (decode rate)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--before", action="store_true",
                        help="also the backend with fixed shapes everywhere (attn.rows=tiles), same requests")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.tokens < 2:
        parser.error("--rounds must be >= 1 and --tokens >= 2 (the decode rate needs a token after the first)")
    if args.threads:
        torch.set_num_threads(args.threads)
    command = "python -m experiments.bench.bench_batch_invariant " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command, "threads": torch.get_num_threads(),
              **run(args.dtype, args.shapes, args.rounds, args.tokens, args.before),
              "environment": describe_environment(), "cpu": _cpu()}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"bench_{args.dtype}{'_before_after' if args.before else ''}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = _table(result, command)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
