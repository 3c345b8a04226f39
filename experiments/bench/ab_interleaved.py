"""A/B of two checkouts request by request: one engine process per checkout, the same requests sent to both in
alternating order (A B, B A, ...), so that the machine's drift (minutes-long swings of +-20% on a shared 2-core
VM) falls on both sides of every pair. Reported: per request, after / before of TTFT, prefill time and decode rate
(median and p10-p90), whether the two produced the same tokens, reuse, and accuracy where the workload has answers.

    git worktree add /tmp/kvboost-before <commit>
    python -m experiments.bench.ab_interleaved --before /tmp/kvboost-before --workload sharegpt_replay --dtype bfloat16 \\
        --name replay_bf16 --out experiments/results/runtime_ab
    python -m experiments.bench.ab_interleaved --before /tmp/kvboost-before --workload rag_reorder \\
        --engine recompute=query_aware --name rag_query_aware --out experiments/results/runtime_ab

The requests are the runner's workloads (``experiments/workloads``, built here once, with this checkout's code):
the ShareGPT replay (history from the dataset, so both sides get the same prompts) or rag_reorder (its documents
warmed in both engines first, as the runner does; the separator chunker, as its config selects, unless ``--engine``
names a chunker). Each engine is ``KVBoost.from_pretrained`` (the bundled model)
with ``--engine`` settings, warmed up (``engine.warmup``) and given one unmeasured request before the first pair.
Only the engine's own modes are compared (``reuse``; ``--cold`` adds the cold path): the HF baselines did not change.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository root


# ---------------------------------------------------------------------------------------------- the worker
def worker(root: str) -> None:
    """One engine of checkout ``root``: JSON commands on stdin, one JSON answer per line on stdout."""
    from experiments.common import use_checkout

    use_checkout(root)
    import torch

    import kvboost

    if not kvboost.__file__.startswith(root):
        raise RuntimeError(f"kvboost came from {kvboost.__file__}, not {root}")
    from kvboost import KVBoost

    engine = None
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "init":
            torch.set_num_threads(cmd.get("threads") or torch.get_num_threads())
            engine = KVBoost.from_pretrained(None, dtype=cmd["dtype"], **cmd["options"])
            engine.warmup(max_tokens=cmd["max_tokens"])
            for text in cmd["warm"]:
                engine.warm(text)
            engine.generate([{"role": "user", "content": "Warm-up request, not measured: name three colours."}],
                            max_new_tokens=4, mode="cold")  # fmt: skip
            answer: dict[str, Any] = {"ok": True, "kvboost": kvboost.__file__}
        elif cmd["op"] == "generate":
            r = engine.generate(cmd["prompt"], max_new_tokens=cmd["max_new_tokens"], mode=cmd["mode"])
            answer = {"ttft_ms": r.ttft_ms, "decode_tok_s": r.tokens_per_sec, "prefill_ms": r.extra.get("prefill_ms"),
                      "cached_tokens": r.cached_tokens, "output_ids": r.output_ids, "output_text": r.output_text,
                      "prompt_tokens": r.prompt_tokens}  # fmt: skip
        else:
            break
        print(json.dumps(answer), flush=True)


class Engine:
    """A worker process seen from the coordinator."""

    def __init__(self, root: Path) -> None:
        self.root = root
        # this checkout's script (``-m`` from ROOT); the worker then puts ``root`` first (``use_checkout``)
        self.proc = subprocess.Popen([sys.executable, "-m", "experiments.bench.ab_interleaved", "--worker", str(root)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)  # fmt: skip

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the worker of {self.root} died (rc {self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


# ---------------------------------------------------------------------------------------------- the coordinator
def _settings(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in pairs:
        key, _, value = item.partition("=")
        out[key] = json.loads(value) if value[:1] in "[{0123456789-" or value in ("true", "false", "null") else value
    return out


def build_workload(name: str, fields: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    from experiments.workloads import WORKLOADS
    from experiments.workloads.base import WorkloadEnv
    from kvboost.models.loading import bundled_model_dir

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir())

    def count(prompt: Any) -> int:
        if isinstance(prompt, str):
            return len(tokenizer(prompt)["input_ids"])
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

    return WORKLOADS.build({"name": name, **fields}, env=WorkloadEnv(tokenizer=tokenizer, count_tokens=count))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(argv[1])
        return {}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True)
    parser.add_argument("--workload", default="sharegpt_replay", choices=("sharegpt_replay", "rag_reorder"))
    parser.add_argument("--fields", nargs="*", default=[], help="workload fields, key=value")
    parser.add_argument("--engine", nargs="*", default=[], help="engine settings, key=value (e.g. recompute=query_aware)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cold", action="store_true", help="also measure mode='cold' (the engine path, no cache)")
    parser.add_argument("--name", required=True)
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "runtime_ab"))
    args = parser.parse_args(argv)
    workload = build_workload(args.workload, _settings(args.fields))
    requests = list(workload.requests())
    modes = ["reuse", "cold"] if args.cold else ["reuse"]
    options = _settings(args.engine)
    if args.workload == "rag_reorder" and "chunker" not in options:
        # as its Hydra config does: content reuse needs the documents as separator-delimited segments
        options["chunker"] = {"name": "separator", "separator": workload.cfg.separator, "chunk_size": 64}
    sides = {"before": Engine(Path(args.before).resolve()), "after": Engine(ROOT)}
    try:
        init = {"op": "init", "dtype": args.dtype, "options": options, "threads": args.threads,
                "max_tokens": int(getattr(workload.cfg, "max_prompt_tokens", None) or 2048) + workload.max_new_tokens,
                "warm": workload.shared_context()}  # fmt: skip
        for side in sides.values():
            print(side.ask(**init), flush=True)
        rows = []
        for i, request in enumerate(requests):
            order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
            for mode in modes:
                row: dict[str, Any] = {"request_id": request.request_id, "turn": request.turn, "mode": mode}
                for side in order:
                    row[side] = sides[side].ask(op="generate", prompt=request.prompt, mode=mode,
                                                max_new_tokens=workload.max_new_tokens)  # fmt: skip
                    row[side]["correct"] = workload.is_correct(request, row[side]["output_text"])
                rows.append(row)
                b, a = row["before"], row["after"]
                print(f"{i:3d} {mode:5s} ttft {b['ttft_ms']:7.1f} -> {a['ttft_ms']:7.1f} ms, decode "
                      f"{b['decode_tok_s']:5.1f} -> {a['decode_tok_s']:5.1f} tok/s, same tokens "
                      f"{a['output_ids'] == b['output_ids']}", flush=True)  # fmt: skip
    finally:
        for side in sides.values():
            side.close()
    result = {"command": "python -m experiments.bench.ab_interleaved " + " ".join(argv), "before": args.before,
              "workload": args.workload, "dtype": args.dtype, "engine": options, "summary": summarize(rows, modes),
              "rows": rows}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2, default=str))
    (out / f"{args.name}.md").write_text(to_markdown(result))
    print((out / f"{args.name}.md").read_text())
    return result


def summarize(rows: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    from experiments.common import spread  # here, not at the top: a worker imports this file before its kvboost

    out: dict[str, Any] = {}
    for mode in modes:
        mine = [r for r in rows if r["mode"] == mode]
        cell: dict[str, Any] = {}
        for metric in ("ttft_ms", "prefill_ms", "decode_tok_s"):
            ratios = [r["after"][metric] / r["before"][metric] for r in mine
                      if r["before"].get(metric) and r["after"].get(metric)]  # fmt: skip
            if ratios:
                cell[metric] = spread(ratios)
        for side in ("before", "after"):
            cell[f"{side}_ttft_ms_p50"] = statistics.median(r[side]["ttft_ms"] for r in mine)
            cell[f"{side}_decode_tok_s_p50"] = statistics.median(r[side]["decode_tok_s"] for r in mine)
            cell[f"{side}_cached_tokens"] = sum(r[side]["cached_tokens"] for r in mine)
            judged = [r[side]["correct"] for r in mine if r[side]["correct"] is not None]
            cell[f"{side}_accuracy"] = sum(judged) / len(judged) if judged else None
        cell["same_tokens"] = sum(r["after"]["output_ids"] == r["before"]["output_ids"] for r in mine)
        cell["requests"] = len(mine)
        out[mode] = cell
    return out


def to_markdown(result: dict[str, Any]) -> str:
    lines = [f"# Request-interleaved A/B: {result['workload']} ({result['dtype']}, {result['engine'] or 'defaults'})",
             "", "```", result["command"], "```", "",
             "after / before per request (the same request on both sides, alternating order); TTFT and prefill: < 1 "
             "is faster after; decode: > 1 is faster after.", "",
             "| mode | requests | TTFT ratio median [p10-p90] | prefill ratio | decode ratio | TTFT p50 before -> after | "
             "decode p50 before -> after | same tokens | cached tokens before / after | accuracy before / after |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for mode, c in result["summary"].items():
        def q(metric: str) -> str:
            x = c.get(metric)
            return f"{x['median']:.3f} [{x['p10']:.3f}-{x['p90']:.3f}]" if x else "-"

        acc = "-" if c["before_accuracy"] is None else f"{c['before_accuracy']:.3f} / {c['after_accuracy']:.3f}"
        lines.append(f"| {mode} | {c['requests']} | {q('ttft_ms')} | {q('prefill_ms')} | {q('decode_tok_s')} | "
                     f"{c['before_ttft_ms_p50']:.1f} -> {c['after_ttft_ms_p50']:.1f} ms | "
                     f"{c['before_decode_tok_s_p50']:.1f} -> {c['after_decode_tok_s_p50']:.1f} | "
                     f"{c['same_tokens']}/{c['requests']} | {c['before_cached_tokens']} / {c['after_cached_tokens']} | "
                     f"{acc} |")  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
