"""Decode speed of the bundled model: every decode path of the runner (hf / eager / compiled / graphed / quantized),
batch 1 or more.

    python -m experiments.bench.bench_decode --dtypes float32 bfloat16 --contexts 256 1024 --tokens 64 --repeats 5
    python -m experiments.bench.bench_decode --dtypes float32 --paths compiled quantized --contexts 512 \
        --batches 1 2 4 8 16 32 --tokens 16 --repeats 3 --out experiments/results/decode/batch   # batched step cost
    python -m experiments.bench.bench_decode --model "$(python scripts/quantize_awq.py --print-path)" --dtypes bfloat16 \
        --out experiments/results/decode/awq       # AWQ int4 weights: hf and eager (int4 kernel) paths
    python -m experiments.bench.bench_decode --dtypes bfloat16 --paths quantized --override engine.decode_activations=int8

For each dtype, one engine per decode path on the same weights; each (context, repeat) feeds the same random
prompt of ``context`` tokens (prefilled once, not timed) and then times ``--tokens`` greedy steps, EOS ignored,
with every path interleaved in the same repeat so drift hits them alike (after one discarded round on another
prompt). Reported per path: tokens/s
(median and min-max over repeats), ms per token, the ratio to HF's rate in the same repeat (median and range),
the greedy agreement with HF over the timed tokens, and the compile time (``engine.warmup()``, timed apart).
The weight-streaming floor (bytes of all weights / measured copy bandwidth) is printed beside them: a decode
step cannot be faster than reading every weight once.

Writes ``<out>/decode_<dtype>.json`` and ``<out>/decode.md`` (default ``experiments/results/decode/``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[2]  # the repository root

from experiments.common import compose_run_config
from kvboost.build import build_engine
from kvboost.lab.environment import describe_environment
from kvboost.models.awq import AWQ_TENSORS
from kvboost.models.compute import describe
from kvboost.models.loading import load_model_and_tokenizer
from kvboost.runtime.llama import has_int4_projections

PATHS = ("hf", "eager", "compiled", "graphed", "quantized")  # graphed: CUDA only; quantized: CPU, GGUF 4-bit blocks
AWQ_BUFFERS = (*AWQ_TENSORS, "bias")  # an AWQ linear keeps its bias as a buffer too


def stream_bandwidth_gbs(nbytes: int = 256 << 20, repeats: int = 5, device: str = "cpu") -> float:
    """GB/s of reading a large tensor once (``sum``): what streaming the weights can reach at best."""
    x = torch.ones(nbytes // 4, device=device)
    x.sum()
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def weight_bytes(model: Any) -> int:
    """Bytes a decode step reads: every parameter once (tied embeddings counted once), and the int4 buffers of
    AWQ linears (codes, zeros, scales, as stored; the CPU int4 kernel reads a repacked copy of the same size)."""
    seen, total = set(), 0
    tensors = list(model.parameters()) + [b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] in AWQ_BUFFERS]
    for p in tensors:
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def time_decode(engine: Any, prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    """(seconds for ``steps`` greedy decode forwards of every prompt together, each row's tokens), EOS ignored;
    the prefill is not timed. Each step is one ``runner.run`` of a ``ForwardBatch`` with one row per prompt (the
    batch's construction included: it is part of every real step)."""
    from kvboost.kv.block_table import BlockTable
    from kvboost.runtime.batch import ForwardBatch, SeqInput

    runner = engine.runner
    tables = [BlockTable(engine.pool) for _ in prompts]
    try:
        with torch.inference_mode():
            logits = runner.run(ForwardBatch.build([SeqInput(t, p) for t, p in zip(tables, prompts, strict=True)]))
            tokens = [[int(row.argmax())] for row in logits]
            sync = torch.cuda.synchronize if logits.is_cuda else (lambda: None)
            sync()
            start = time.perf_counter()
            for _ in range(steps):
                logits = runner.run(ForwardBatch.build([SeqInput(t, [toks[-1]]) for t, toks in zip(tables, tokens)]))
                for row, toks in zip(logits.argmax(-1).tolist(), tokens, strict=True):
                    toks.append(int(row))
            sync()
            return time.perf_counter() - start, [toks[1:] for toks in tokens]
    finally:
        for t in tables:
            t.release()


def run_dtype(dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    model, tokenizer, path = load_model_and_tokenizer(args.model, dtype=dtype)
    device = next(model.parameters()).device
    engines, compile_s = {}, {}
    paths = [p for p in args.paths if not (p in ("compiled", "graphed") and has_int4_projections(model))]
    if len(paths) < len(args.paths):
        print("int4 (AWQ) projections: the compiled paths do not take them; timing", ", ".join(paths))
    if device.type != "cuda" and "graphed" in paths:
        paths.remove("graphed")
        print("not on a CUDA device: the graphed path (CUDA graphs) is skipped")
    if "quantized" in paths:
        from kvboost.runtime.quant_step import unavailable_reason

        if (why := unavailable_reason(model)) is not None:
            paths.remove("quantized")
            print(f"the quantized path is skipped: {why}")
    for name in paths:
        engine = build_engine(compose_run_config(args.override, decode=name), model, tokenizer, model_identity=path,
                              share_model=bool(engines))  # fmt: skip
        compile_s[name] = engine.warmup()["decode_compile_s"]
        engines[name] = engine
    gen = torch.Generator().manual_seed(args.seed)
    # One discarded round on its own prompt: the first call of a shape builds kernels (oneDNN, allocator).
    batches = args.batches or [args.batch]
    for engine in engines.values():
        time_decode(engine, [torch.randint(100, 40000, (max(args.contexts),), generator=gen).tolist()] * max(batches), 4)
    rows: list[dict[str, Any]] = []
    total = len(args.contexts) * args.repeats * len(engines) * len(batches)
    with tqdm(total=total, desc=f"decode {dtype}") as bar:
        for context in args.contexts:
            for repeat in range(args.repeats):
                for batch in batches:
                    prompts = [torch.randint(100, min(len(tokenizer), 40000), (context,), generator=gen).tolist()
                               for _ in range(batch)]  # fmt: skip
                    timed = {}
                    for name, engine in engines.items():
                        timed[name] = time_decode(engine, prompts, args.tokens)
                        bar.update(1)
                    ref_tokens = timed.get("hf", next(iter(timed.values())))[1]
                    for name, (seconds, tokens) in timed.items():
                        agree = statistics.mean(
                            next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), len(mine))
                            for mine, ref in zip(tokens, ref_tokens, strict=True)
                        )
                        rows.append({
                            "path": name, "context": context, "repeat": repeat, "seconds": seconds, "batch": batch,
                            "tokens_per_s": args.tokens * batch / seconds,
                            "ratio_vs_hf": timed["hf"][0] / seconds if "hf" in timed else None,
                            "tokens_equal_to_hf_before_divergence": agree,
                        })  # fmt: skip
    bandwidth = stream_bandwidth_gbs(device=device.type)
    nbytes = weight_bytes(model)
    summary = {}
    for name in engines:
        for context, batch in ((c, b) for c in args.contexts for b in batches):
            mine = [r for r in rows if r["path"] == name and r["context"] == context and r["batch"] == batch]
            # a step of `batch` rows against a step of one row, paired by repeat (same drift)
            one = {r["repeat"]: r["seconds"] for r in rows if r["path"] == name and r["context"] == context
                   and r["batch"] == min(batches)}  # fmt: skip
            costs = [r["seconds"] / one[r["repeat"]] for r in mine if r["repeat"] in one]
            rates = [r["tokens_per_s"] for r in mine]
            ratios = [r["ratio_vs_hf"] for r in mine if r["ratio_vs_hf"] is not None]
            summary[f"{name}@{context}" + (f"@b{batch}" if len(batches) > 1 else "")] = {
                "path": name, "context": context, "batch": batch,
                "step_ms_median": statistics.median(r["seconds"] for r in mine) / args.tokens * 1e3,
                "step_cost_vs_smallest_batch_median": statistics.median(costs),
                "step_cost_vs_smallest_batch_min": min(costs), "step_cost_vs_smallest_batch_max": max(costs),
                "tokens_per_s_median": statistics.median(rates), "tokens_per_s_min": min(rates),
                "tokens_per_s_max": max(rates), "ms_per_token_median": 1000 / statistics.median(rates),
                "ratio_vs_hf_median": statistics.median(ratios) if ratios else None,
                "ratio_vs_hf_min": min(ratios) if ratios else None, "ratio_vs_hf_max": max(ratios) if ratios else None,
                "greedy_prefix_equal_to_hf_mean": statistics.mean(r["tokens_equal_to_hf_before_divergence"] for r in mine),
                "compile_s": compile_s[name],
            }  # fmt: skip
    for engine in engines.values():
        engine.close()
    return {
        "dtype": dtype, "compute": describe(model.dtype, device.type, dtype),
        "weight_bytes": nbytes, "stream_gbs": bandwidth,
        "floor_tokens_per_s": bandwidth * 1e9 / nbytes, "tokens_timed": args.tokens, "summary": summary, "rows": rows,
    }  # fmt: skip


def to_markdown(results: list[dict[str, Any]], command: str) -> str:
    lines = [f"`{command}`", ""]
    for res in results:
        lines += [
            f"### {res['dtype']} ({res['compute']['matmul_path']}); weights {res['weight_bytes'] / 1e6:.0f} MB, "
            f"stream {res['stream_gbs']:.1f} GB/s -> floor {res['floor_tokens_per_s']:.0f} tok/s",
            "",
            "| path | context | rows | tok/s median (min-max) | ms/step | step cost vs the smallest batch (min-max) "
            f"| x HF (min-max) | tokens = HF before divergence (of {res['tokens_timed']}) | compile s |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for row in res["summary"].values():
            ratio = (
                f"{row['ratio_vs_hf_median']:.2f} ({row['ratio_vs_hf_min']:.2f}-{row['ratio_vs_hf_max']:.2f})"
                if row["ratio_vs_hf_median"] is not None else "-"
            )  # fmt: skip
            lines.append(
                f"| {row['path']} | {row['context']} | {row['batch']} | {row['tokens_per_s_median']:.1f} "
                f"({row['tokens_per_s_min']:.1f}-{row['tokens_per_s_max']:.1f}) | {row['step_ms_median']:.1f} | "
                f"{row['step_cost_vs_smallest_batch_median']:.2f} ({row['step_cost_vs_smallest_batch_min']:.2f}-"
                f"{row['step_cost_vs_smallest_batch_max']:.2f}) | {ratio} | "
                f"{row['greedy_prefix_equal_to_hf_mean']:.1f} | {row['compile_s']:.1f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS,
                   help="decode paths to time (graphed is skipped off CUDA)")
    p.add_argument("--contexts", nargs="+", type=int, default=[256, 1024])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (one forward per step for all)")
    p.add_argument("--batches", nargs="+", type=int, default=None,
                   help="several batch sizes in the same repeats (e.g. 1 2 4 8 16 32): each step's cost against the "
                        "smallest batch's, paired by repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--override", action="append", default=[], metavar="HYDRA_OVERRIDE",
                   help="a run.py override for every engine, e.g. engine.decode_activations=int8 (repeatable)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="model folder (default: the bundled model); an AWQ folder works")
    p.add_argument("--out", default=str(ROOT / "experiments" / "results" / "decode"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m experiments.bench.bench_decode " + " ".join(argv if argv is not None else sys.argv[1:])
    results = []
    for dtype in args.dtypes:
        res = run_dtype(dtype, args)
        res["environment"], res["command"] = describe_environment(), command
        (out / f"decode_{dtype}.json").write_text(json.dumps(res, indent=1))
        results.append(res)
    md = to_markdown(results, command)
    (out / "decode.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
