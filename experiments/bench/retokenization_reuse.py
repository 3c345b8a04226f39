"""Chat reuse that survives re-tokenization: the ShareGPT replay with ``history_source=model``, canonical store on
and off, in one run.

    python -m experiments.bench.retokenization_reuse --conversations 4 --turns 4 --max-new-tokens 32 \\
        --out experiments/results/retokenization

One fp32 engine on the bundled SmolLM2-135M-Instruct (``store_canonical=True``) and a second engine on the same
weights (``share_model=True``, ``store_canonical=False``), each with its own cache. Turn t's prompt is the chat
history with the baseline's greedy answers (HF, no cache: ``run.py``'s reference for ``history_source=model``)
plus the new user message. Every request runs, in this order: the HF baseline (a cold prefill: its answer becomes
the next turn's history and it is the reference of the quality columns), then both arms in an order that
alternates per request. Per arm and turn: reuse (cached / prompt tokens), the history tokens a perfect cache could
serve (everything before the new user message), greedy tokens equal to the baseline's, first-token max |logit
diff| and KL against it, and the canonical store's cost (after the request finished: not in its TTFT).

Writes ``<out>/retokenization_reuse.json`` (records, summary, environment; rewritten after every request, so an
interrupted run keeps what finished) and ``<out>/retokenization_reuse.md``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from experiments.common import RESULTS_DIR, add_threads_arg, set_threads, write_json, write_markdown
from kvboost.lab.environment import describe_environment

ARMS = ("canonical_on", "canonical_off")


def build_engines(dtype: str) -> dict[str, Any]:
    from experiments.common import compose_run_config
    from kvboost.build import build_engine

    on = build_engine(compose_run_config(dtype=dtype, store_canonical=True))
    off = build_engine(compose_run_config(dtype=dtype, store_canonical=False), on.model, on.tokenizer,
                       model_identity=on.adapter.identity, share_model=True)
    return {"canonical_on": on, "canonical_off": off}


def history_tokens(engine: Any, messages: list[dict[str, str]]) -> int:
    """Tokens of the prompt before its new user message (what a perfect cache of earlier turns could serve)."""
    if len(messages) < 2 or messages[-2]["role"] != "assistant":
        return 0
    text = engine.tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=False, tokenize=False)
    return len(engine.tokenize_with_spans(text, chat=False)[0])


def run(args: argparse.Namespace, on_progress: Any = None) -> dict[str, Any]:
    from kvboost.lab.modes import MODES
    from kvboost.lab.runner import WARMUP_MESSAGES
    from kvboost.lab.workloads import WORKLOADS
    from kvboost.lab.workloads.base import WorkloadEnv
    from kvboost.quality import compare_generations

    engines = build_engines(args.dtype)
    on = engines["canonical_on"]
    baseline = MODES.get("baseline")(on)
    env = WorkloadEnv(tokenizer=on.tokenizer, count_tokens=lambda prompt: len(on.tokenize(prompt)))
    workload = WORKLOADS.build({"name": "sharegpt_replay", "num_conversations": args.conversations,
                                "max_turns": args.turns, "max_new_tokens": args.max_new_tokens,
                                "history_source": "model", "seed": args.seed}, env=env)  # fmt: skip
    for engine in engines.values():  # kernels and compilation, not the cache
        engine.generate(WARMUP_MESSAGES, max_new_tokens=4)
        engine.reset_cache()
    baseline.generate(WARMUP_MESSAGES, 4)
    baseline.reset()

    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    for index, request in enumerate(workload.requests()):
        base = baseline.generate(request.prompt, args.max_new_tokens)
        workload.record_answer(request, base.output_text)
        n_history = history_tokens(on, request.prompt)
        order = ARMS if index % 2 == 0 else ARMS[::-1]
        for arm in order:
            r = engines[arm].generate(request.prompt, max_new_tokens=args.max_new_tokens)
            check = compare_generations("", base, r)
            records.append({
                "request_id": request.request_id, "conversation": request.conversation_id, "turn": request.turn,
                "arm": arm, "prompt_tokens": r.prompt_tokens, "history_tokens": n_history,
                "cached_tokens": r.cached_tokens, "reuse_ratio": r.kv_reuse_ratio,
                "greedy_equal_baseline": r.output_ids == base.output_ids,
                "answer_equals_history": r.output_text == base.output_text,
                "first_divergence": check.first_divergence, "max_abs_logit_diff": check.max_abs_logit_diff,
                "first_token_kl": check.first_token_kl, "ttft_ms": r.ttft_ms, "store_ms": r.store_ms,
                **{k: v for k, v in r.extra.items() if k.startswith("canonical_")},
            })  # fmt: skip
        last = records[-2:]
        print(f"{request.request_id:>14} turn {request.turn}: prompt {last[0]['prompt_tokens']:5d}, history "
              f"{n_history:5d}, cached " + ", ".join(f"{x['arm']} {x['cached_tokens']}" for x in last),
              flush=True)  # fmt: skip
        if on_progress is not None:
            on_progress({"records": records, "summary": summarise(records), "partial": True})
    for engine in engines.values():
        engine.close()
    return {"records": records, "summary": summarise(records), "elapsed_s": time.perf_counter() - started}


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm: by turn and over turns >= 2, token-weighted reuse, share of the history served, quality."""
    groups: dict[str, dict[str, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        groups[r["arm"]][str(r["turn"])].append(r)
        if r["turn"] >= 2:
            groups[r["arm"]]["2+"].append(r)

    def agg(rows: list[dict[str, Any]]) -> dict[str, Any]:
        prompt = sum(r["prompt_tokens"] for r in rows)
        cached = sum(r["cached_tokens"] for r in rows)
        history = sum(r["history_tokens"] for r in rows)
        return {
            "n": len(rows), "prompt_tokens": prompt, "cached_tokens": cached, "history_tokens": history,
            "reuse_ratio": cached / prompt if prompt else 0.0,
            "history_served": min(cached, history) / history if history else None,
            "greedy_equal_baseline": sum(r["greedy_equal_baseline"] for r in rows),
            "max_abs_logit_diff": max(r["max_abs_logit_diff"] for r in rows),
            "canonical_prefill_tokens": sum(r.get("canonical_prefill_tokens", 0) for r in rows),
            "canonical_store_ms_mean": (sum(r.get("canonical_store_ms", 0.0) for r in rows) / len(rows)),
        }  # fmt: skip

    return {arm: {turn: agg(rows) for turn, rows in sorted(by_turn.items())} for arm, by_turn in groups.items()}


def markdown(result: dict[str, Any], command: str) -> str:
    s = result["summary"]
    lines = ["# Chat reuse and re-tokenization: canonical store on vs off (same run)", "", f"    {command}", "",
             "| turn | arm | n | prompt tok | history tok | cached tok | reuse | history served | "
             "greedy = baseline | max abs logit diff | canonical prefill tok | canonical store ms (mean) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    turns = sorted({t for arm in s.values() for t in arm}, key=lambda t: (t == "2+", t))
    for turn in turns:
        for arm in ARMS:
            a = s.get(arm, {}).get(turn)
            if a is None:
                continue
            served = "-" if a["history_served"] is None else f"{a['history_served']:.3f}"
            lines.append(f"| {turn} | {arm} | {a['n']} | {a['prompt_tokens']} | {a['history_tokens']} | "
                         f"{a['cached_tokens']} | {a['reuse_ratio']:.3f} | {served} | "
                         f"{a['greedy_equal_baseline']}/{a['n']} | {a['max_abs_logit_diff']:.2e} | "
                         f"{a['canonical_prefill_tokens']} | {a['canonical_store_ms_mean']:.0f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", help="float32: reuse equal to a cold prefill within 1e-4")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "retokenization")
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    command = "python -m experiments.bench.retokenization_reuse " + " ".join(sys.argv[1:] if argv is None else argv)
    extra = {"command": command, "threads": threads, "environment": describe_environment(),
             "config": {k: str(v) for k, v in vars(args).items()}}
    result = run(args, on_progress=lambda partial: write_json(args.out / "retokenization_reuse.json",
                                                              {**partial, **extra}))  # fmt: skip
    result.update(extra)
    write_json(args.out / "retokenization_reuse.json", result)
    table = markdown(result, command)
    write_markdown(args.out / "retokenization_reuse.md", table)
    print(table)


if __name__ == "__main__":
    main()
