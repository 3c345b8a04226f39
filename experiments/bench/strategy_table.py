"""The content-reuse strategy table: every recompute strategy on the same rag_reorder queries, one loaded model.

Per draw (``workload.seed``) the corpus and its queries are built, every document is warmed once (as
``python run.py workload=rag_reorder`` warms them: after the prompts' shared head), then every query runs once
per arm in a shuffled order: ``baseline`` (HF, full prefill) and kvboost with each strategy. The strategies
differ only in the engine's recompute plugin (swapped between requests); their requests do not write the cache
(``store=False``), so every strategy reads the same stored documents and nothing one strategy did reaches
another. That is what lets one run hold the whole table: a run per strategy (``python run.py -m
recompute=...``) pays the baseline's full prefill once per strategy, which on the 0.5B model is most of the
time.

Reported per strategy and draw, and pooled over the draws (``<out>/table.md``, ``<out>/summary.json``):

- TTFT speedup: the median over queries of baseline TTFT / strategy TTFT, each query's arms timed back to back in
  one process, with a bootstrap 95% interval of that median (``experiments.report.bootstrap_median_ci``). A ratio
  per query, not p50 / p50, so that draws run under different loads (or on different machines) pool soundly;
- accuracy (planted-fact answers) with its Wilson 95% interval, and the accuracy difference from the baseline
  (the full prefill) with a paired bootstrap 95% interval over queries;
- the measured recompute ratio, the greedy match with the baseline, the first-token KL and the answer
  log-probability delta (nats) against the baseline.

Every record is written to ``<out>/records.jsonl`` as it finishes; ``--summarize-only`` rebuilds the table from it
(an interrupted run keeps what it measured).

    python -m experiments.bench.strategy_table --model smollm2 --dtype float32 --draws 0 1 2 \\
        --out experiments/results/strategy_table/smollm2_fp32
    python -m experiments.bench.strategy_table --model qwen_coder_0_5b --dtype bfloat16 --draws 0 1 2 \\
        --out experiments/results/strategy_table/qwen_coder_0_5b_bf16
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from experiments.common import add_threads_arg, compose_run_config, percentile, set_threads, write_json, write_markdown
from experiments.report import bootstrap_median_ci, paired_difference_ci, wilson_interval

BASELINE = "baseline"
# name -> Hydra overrides of the recompute group; equal budgets: the ratio-driven strategies at 0.15 and 0.3
DEFAULT_STRATEGIES = ("none", "selective", "cacheblend:0.15", "cacheblend:0.3", "query_aware:0.15",
                      "query_aware:0.3", "oracle:0.15", "full")  # fmt: skip


def strategy_overrides(spec: str) -> list[str]:
    """``"cacheblend:0.3"`` -> ``["recompute=cacheblend", "recompute.ratio=0.3"]``; ``"none"`` -> one override."""
    name, _, ratio = spec.partition(":")
    if not name:
        raise ValueError(f"strategy {spec!r}: expected NAME or NAME:RATIO")
    out = [f"recompute={name}"]
    if ratio:
        try:
            value = float(ratio)
        except ValueError:
            raise ValueError(f"strategy {spec!r}: the ratio {ratio!r} is not a number") from None
        if not 0.0 < value <= 1.0:
            raise ValueError(f"strategy {spec!r}: the ratio must be in (0, 1]")
        out.append(f"recompute.ratio={ratio}")
    return out


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per strategy, per draw and pooled: speedup, accuracy, difference from the baseline, quality."""
    by_key: dict[tuple[int, str], dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        by_key[(r["draw"], r["query"])][r["arm"]] = r
    complete = {k: v for k, v in by_key.items() if BASELINE in v}
    arms = sorted({r["arm"] for r in records}, key=lambda a: (a != BASELINE, _arm_order(records, a)))
    draws = sorted({k[0] for k in complete})
    out: dict[str, Any] = {"draws": draws, "arms": {}}
    for arm in arms:
        rows: dict[str, Any] = {}
        for label, keys in [*((f"draw {d}", [k for k in complete if k[0] == d]) for d in draws),
                            ("pooled", list(complete))]:  # fmt: skip
            pairs = [(complete[k][BASELINE], complete[k][arm]) for k in sorted(keys) if arm in complete[k]]
            if pairs:
                rows[label] = _cell(pairs, arm)
        out["arms"][arm] = rows
    return out


def _arm_order(records: list[dict[str, Any]], arm: str) -> int:
    for i, r in enumerate(records):
        if r["arm"] == arm:
            return r.get("arm_index", i)
    return 0


def _cell(pairs: list[tuple[dict[str, Any], dict[str, Any]]], arm: str) -> dict[str, Any]:
    base_ttft = [b["ttft_ms"] for b, _ in pairs]
    ttft = [s["ttft_ms"] for _, s in pairs]
    correct = [float(bool(s["correct"])) for _, s in pairs]
    base_correct = [float(bool(b["correct"])) for b, _ in pairs]
    n, k = len(pairs), int(sum(correct))
    cell: dict[str, Any] = {
        "n": n,
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p10": percentile(ttft, 10),
        "ttft_ms_p90": percentile(ttft, 90),
        "baseline_ttft_ms_p50": percentile(base_ttft, 50),
        "correct": k,
        "accuracy": k / n,
        "accuracy_ci": wilson_interval(k, n),
        "baseline_accuracy": sum(base_correct) / n,
    }
    if arm != BASELINE:
        ratios = [b / s for b, s in zip(base_ttft, ttft) if s > 0]
        cell["speedup"] = percentile(ratios, 50) if ratios else None
        cell["speedup_ci"] = bootstrap_median_ci(ratios)
        cell["accuracy_diff"] = (sum(correct) - sum(base_correct)) / n
        cell["accuracy_diff_ci"] = paired_difference_ci(correct, base_correct)
        for name in ("recompute_ratio", "kv_reuse_ratio", "first_token_kl", "answer_logprob_delta"):
            values = [s[name] for _, s in pairs if s.get(name) is not None]
            cell[f"{name}_mean"] = sum(values) / len(values) if values else None
        cell["greedy_match"] = sum(bool(s.get("greedy_match")) for _, s in pairs) / n
    return cell


def format_table(summary: dict[str, Any], meta: dict[str, Any]) -> str:
    """The markdown table: one row per strategy, pooled figures first, the draws after."""
    draws = summary["draws"]
    lines = [
        f"# Content-reuse strategies on rag_reorder: {meta.get('model')} ({meta.get('dtype')})",
        "",
        f"Command: `{meta.get('command')}`  ",
        (
            f"Machine: {meta.get('machine')}; {len(draws)} draw(s) x {meta.get('queries')} queries; both arms of every "
            "query in one process, interleaved. Baseline = HF full prefill. Speedup = the median over queries of "
            "each query's baseline TTFT / strategy TTFT (bootstrap 95%); TTFT p50 ms pools absolute times, so it "
            "reads only within draws run on one machine."
        ),
        "",
        "| strategy | TTFT p50 ms | speedup vs baseline [95%] | accuracy [Wilson 95%] | vs baseline [95%] | "
        "recompute ratio | greedy match | first-token KL | answer log-prob delta | "
        + " | ".join(f"draw {d}: speedup / acc" for d in draws)
        + " |",
        "| --- " * (9 + len(draws)) + "|",
    ]
    for arm, rows in summary["arms"].items():
        pooled = rows.get("pooled")
        if not pooled:
            continue
        per_draw = []
        for d in draws:
            c = rows.get(f"draw {d}")
            if not c:
                per_draw.append("-")
            elif arm == BASELINE:
                per_draw.append(f"1 / {c['accuracy']:.3f}")
            else:
                per_draw.append(f"{_num(c['speedup'], 2)}x / {c['accuracy']:.3f}")
        if arm == BASELINE:
            lead = [arm, f"{pooled['ttft_ms_p50']:.0f}", "1", _acc(pooled), "-", "1 (full prefill)", "-", "-", "-"]
        else:
            lead = [
                arm, f"{pooled['ttft_ms_p50']:.0f}", f"{_num(pooled['speedup'], 2)}x {_ci(pooled['speedup_ci'], 2)}",
                _acc(pooled), f"{pooled['accuracy_diff']:+.3f} {_ci(pooled['accuracy_diff_ci'], 3)}",
                _num(pooled["recompute_ratio_mean"], 3), f"{pooled['greedy_match']:.0%}",
                _num(pooled["first_token_kl_mean"], 4), _num(pooled["answer_logprob_delta_mean"], 2),
            ]  # fmt: skip
        lines.append("| " + " | ".join(lead + per_draw) + " |")
    return "\n".join(lines) + "\n"


def _num(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ci(ci: list[float] | None, digits: int) -> str:
    return "" if not ci else f"[{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def _acc(cell: dict[str, Any]) -> str:
    return f"{cell['accuracy']:.3f} ({cell['correct']}/{cell['n']}) {_ci(cell['accuracy_ci'], 2)}"


# ------------------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> None:
    import torch

    from experiments.config_check import split_workload_config
    from experiments.hf_baselines import HFNoCache
    from experiments.runner import WARMUP_MESSAGES, build_engine, quality_fields
    from experiments.workloads import WORKLOADS
    from experiments.workloads.base import WorkloadEnv
    from kvboost.registry import RECOMPUTE

    base = [f"model={args.model}", "workload=rag_reorder", f"workload.num_queries={args.queries}", "logger=none"]
    if args.dtype:
        base.append(f"model.dtype={args.dtype}")
    base += list(args.override)
    cfg = compose_run_config(base)
    strategies = {spec: RECOMPUTE.build(compose_run_config(base + strategy_overrides(spec))["recompute"])
                  for spec in args.strategies}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records_path = out / "records.jsonl"
    if records_path.exists() and not args.append:
        raise SystemExit(f"{records_path} exists: pass --append to add to it, or another --out")
    torch.manual_seed(0)

    t0 = time.perf_counter()
    engine = build_engine(cfg)
    print(f"loaded {args.model} ({engine.adapter.dtype}) in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    try:
        baseline = HFNoCache(engine.model, engine.tokenizer, engine.tokenize)
        # kernels and compiled steps, not the cache: one unrelated request per arm, then forget
        baseline.generate(WARMUP_MESSAGES, 4, commit=False)
        for strategy in strategies.values():
            engine.recompute = strategy
            engine.generate(WARMUP_MESSAGES, max_new_tokens=4, mode="reuse", store=False)
        name, fields, _, _ = split_workload_config(cfg)
        env = WorkloadEnv(tokenizer=engine.tokenizer, count_tokens=lambda p: len(engine.tokenize(p)))
        arms = [BASELINE, *strategies]
        order_rng = random.Random(args.order_seed)
        total = len(args.draws) * args.queries * len(arms)
        with open(records_path, "a") as sink, tqdm(total=total, desc="strategy table", unit="req") as bar:
            for draw in args.draws:
                workload = WORKLOADS.build({"name": name, **fields, "seed": draw}, env=env)
                engine.reset_cache()
                bar.set_postfix_str(f"draw {draw}: warming {len(workload.shared_context())} documents")
                for text in workload.shared_context():
                    engine.warm(text, chat=False)
                for request in workload.requests():
                    bar.set_postfix_str(f"draw {draw} {request.request_id[:12]}")
                    order = list(arms)
                    order_rng.shuffle(order)
                    results = {}
                    for arm in order:
                        if arm == BASELINE:
                            results[arm] = baseline.generate(request.prompt, workload.max_new_tokens,
                                                             score_ids=request.score_ids, commit=False)  # fmt: skip
                        else:
                            engine.recompute = strategies[arm]
                            results[arm] = engine.generate(request.prompt, max_new_tokens=workload.max_new_tokens,
                                                           mode="reuse", score_ids=request.score_ids,
                                                           store=False)  # fmt: skip
                        bar.update(1)
                    for i, arm in enumerate(arms):
                        record = _record(arm, i, draw, request, results[arm], workload)
                        if arm != BASELINE:
                            record.update(quality_fields(results[BASELINE], results[arm]))
                        sink.write(json.dumps(record) + "\n")
                    sink.flush()
    finally:
        engine.close()
    meta = {"model": args.model, "dtype": str(engine.adapter.dtype).replace("torch.", ""), "queries": args.queries,
            "draws": args.draws, "strategies": list(args.strategies), "command": _command(),
            "machine": _machine(), "wall_s": round(time.perf_counter() - t0, 1)}  # fmt: skip
    write_outputs(out, meta)


def _record(arm: str, index: int, draw: int, request: Any, result: Any, workload: Any) -> dict[str, Any]:
    return {
        "arm": arm, "arm_index": index, "draw": draw, "query": request.request_id,
        "target_position": request.info.get("target_position"),
        "ttft_ms": result.ttft_ms, "prompt_tokens": result.prompt_tokens, "cached_tokens": result.cached_tokens,
        "kv_reuse_ratio": result.kv_reuse_ratio, "recompute_ratio": result.recompute_ratio,
        "output_text": result.output_text, "correct": bool(workload.is_correct(request, result.output_text)),
        "answer_logprob": result.extra.get("answer_logprob"),
    }  # fmt: skip


def _command() -> str:
    return "python -m experiments.bench.strategy_table " + " ".join(sys.argv[1:])


def _machine() -> str:
    from kvboost.env import cpu_features

    info = cpu_features()
    return f"{info['cpu']} ({info['kind']}), torch {info['torch']}, {info['threads']} thread(s)"


def write_outputs(out: Path, meta: dict[str, Any] | None = None) -> dict[str, Any]:
    """``summary.json`` and ``table.md`` from ``records.jsonl`` (``meta`` kept from an earlier summary if None)."""
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines() if line.strip()]
    if meta is None:
        previous = out / "summary.json"
        meta = json.loads(previous.read_text()).get("meta", {}) if previous.exists() else {}
    summary = summarize(records)
    write_json(out / "summary.json", {"meta": meta, **summary})
    write_markdown(out / "table.md", format_table(summary, meta))
    print(format_table(summary, meta))
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="a configs/model name (smollm2, qwen_coder_0_5b)")
    parser.add_argument("--dtype", default=None, help="model.dtype (float32, bfloat16); default: the model yaml's")
    parser.add_argument("--draws", type=int, nargs="+", default=[0, 1, 2], help="workload.seed of each draw")
    parser.add_argument("--queries", type=int, default=60)
    parser.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES),
                        help="NAME or NAME:RATIO (recompute group, recompute.ratio)")  # fmt: skip
    parser.add_argument("--override", nargs="*", default=[], help="more Hydra overrides, e.g. attn=cpu_kernel")
    parser.add_argument("--order-seed", type=int, default=0, help="seed of the arms' order per query")
    parser.add_argument("--out", required=True)
    parser.add_argument("--append", action="store_true", help="add to an existing records.jsonl (more draws)")
    parser.add_argument("--summarize-only", action="store_true", help="rebuild summary.json / table.md")
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    if args.summarize_only:
        write_outputs(Path(args.out))
        return
    for spec in args.strategies:
        strategy_overrides(spec)  # a typo fails before the model loads
    set_threads(args.threads)
    run(args)


if __name__ == "__main__":
    main()
