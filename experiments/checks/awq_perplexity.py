"""Perplexity and decode speed of AWQ int4 SmolLM2 against the fp32 model, on held-out ShareGPT text.

    python scripts/quantize_awq.py && python scripts/quantize_awq.py --method rtn      # once
    python -m experiments.checks.awq_perplexity                                               # ~2 min on 2 cores

Perplexity: the same ``--tokens`` tokens of ShareGPT text for every model (conversations 120..239 of the fixed
sample in ``scripts/quantize_awq.py``; 0..119 calibrate AWQ, so the text is held out), messages joined with
blank lines, scored teacher-forced in non-overlapping windows of ``--window`` tokens (every token but each
window's first is predicted). Activations in fp32 for every model: only the weights differ.

Decode speed: greedy decoding of ``--decode-tokens`` tokens after a 32-token prompt with HF's forward and a
DynamicCache (the same loop for every model; the engine's fused decode step only runs plain ``nn.Linear``
weights): the float model in fp32 and bf16 against the int4 model (the AWQ folder, else RTN: speed does not
depend on the values) with each CPU kernel and both activation dtypes, in interleaved rounds. The machine is
shared, so the load average is recorded with the numbers.

``--int8-head`` adds, for each model, its perplexity with the LM head in int8 (``model.lm_head=int8``).

Writes ``experiments/results/awq/perplexity.json`` and ``perplexity.md`` (the command on top; ``--out-name``
changes the stem).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[2]  # the repository root

RESULTS = REPO / "experiments" / "results" / "awq"


def heldout_text() -> str:
    from experiments.common import script_module

    quantize_awq = script_module("quantize_awq")
    CALIB_CONVERSATIONS, sharegpt_sample = quantize_awq.CALIB_CONVERSATIONS, quantize_awq.sharegpt_sample

    parts = []
    for conv in sharegpt_sample()[CALIB_CONVERSATIONS:]:
        for turn in conv.turns:
            parts += [turn.user, turn.assistant]
    return "\n\n".join(parts)


@torch.no_grad()
def perplexity(model: Any, ids: torch.Tensor, window: int) -> tuple[float, int]:
    nll, count = 0.0, 0
    for start in range(0, ids.numel(), window):
        chunk = ids[start : start + window].unsqueeze(0)
        if chunk.shape[1] < 2:
            break
        logits = model(chunk).logits[0, :-1].float()
        nll += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        count += chunk.shape[1] - 1
    return math.exp(nll / count), count


@torch.no_grad()
def decode_tok_s(model: Any, prompt: torch.Tensor, n: int) -> float:
    from transformers import DynamicCache

    from kvboost.runtime.hf_generic import cache_kwarg

    name = cache_kwarg(model.forward)  # past_key_values before transformers 5.24, cache after

    def run(steps: int) -> float:
        cache = DynamicCache()
        out = model(prompt.unsqueeze(0), **{name: cache}, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(steps):
            out = model(token, **{name: cache}, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        return steps / (time.perf_counter() - start)

    run(4)  # warm-up: first-call allocations, int4pack conversion
    return run(n)


def speed_table(models: dict[str, Path], prompt: torch.Tensor, n: int, rounds: int) -> list[dict[str, Any]]:
    """Decode tok/s of each variant, measured in interleaved rounds (the machine is shared: a load change hits
    every variant alike); the median over rounds is reported."""
    from kvboost.models.awq import AWQLinear
    from kvboost.models.loading import load_model_and_tokenizer

    int4_path = models.get("awq") or models.get("rtn")
    variants: dict[str, tuple[Any, str]] = {}
    for dtype in ("float32", "bfloat16"):
        variants[f"float {dtype}"] = (load_model_and_tokenizer(models["fp32"], dtype=dtype, device="cpu")[0], "auto")
        if int4_path is not None:
            int4 = load_model_and_tokenizer(int4_path, dtype=dtype, device="cpu")[0]
            for kernel in ("int4pack", "dequant"):
                variants[f"int4 {kernel}, {dtype} activations"] = (int4, kernel)
    measured: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (model, kernel) in variants.items():
            AWQLinear.cpu_kernel = kernel
            measured[name].append(decode_tok_s(model, prompt, n))
    AWQLinear.cpu_kernel = "auto"
    return [
        {"variant": name, "decode_tok_s": round(statistics.median(v), 2), "rounds": [round(x, 2) for x in v]}
        for name, v in measured.items()
    ]


def main(argv: list[str] | None = None) -> dict:
    from experiments.common import script_module

    awq_output_dir = script_module("quantize_awq").awq_output_dir

    from kvboost.models.awq import AWQLinear
    from kvboost.models.loading import bundled_model_dir, load_model_and_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument("--int8-head", action="store_true",
                        help="also score each model with its LM head in int8 (model.lm_head=int8)")
    parser.add_argument("--out-name", default="perplexity", help="file stem under experiments/results/awq/")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    from experiments.common import set_threads

    set_threads(args.threads)
    command = "python -m experiments.checks.awq_perplexity " + " ".join(argv if argv is not None else sys.argv[1:])

    candidates = {
        "fp32": bundled_model_dir(),
        "awq": awq_output_dir("awq", args.group_size),
        "rtn": awq_output_dir("rtn", args.group_size),
    }
    models = {name: path for name, path in candidates.items() if (Path(path) / "config.json").is_file()}
    skipped = sorted(set(candidates) - set(models))

    _, tokenizer, _ = load_model_and_tokenizer(bundled_model_dir(), dtype="float32", device="cpu")
    ids = torch.tensor(tokenizer(heldout_text(), add_special_tokens=False)["input_ids"][: args.tokens])

    rows: list[dict[str, Any]] = []
    for name, path in tqdm(models.items(), desc="perplexity"):
        model, _, _ = load_model_and_tokenizer(path, dtype="float32", device="cpu")
        ppl, scored = perplexity(model, ids, args.window)
        unique = {(t.data_ptr(), t.dtype, tuple(t.shape)): t for t in model.state_dict().values()}  # tied once
        rows.append({
            "model": name, "path": str(path), "perplexity": round(ppl, 4), "tokens_scored": scored,
            "int4_linears": sum(isinstance(m, AWQLinear) for m in model.modules()),
            "weight_bytes": sum(t.numel() * t.element_size() for t in unique.values()),
        })  # fmt: skip
        print(rows[-1], flush=True)
        if args.int8_head:  # the same model with its output projection in int8 (kvboost.models.int8_head)
            from kvboost.models.int8_head import quantize_lm_head

            ppl, scored = perplexity(quantize_lm_head(model, "int8"), ids, args.window)
            rows.append({**rows[-1], "model": f"{name} + int8 head", "perplexity": round(ppl, 4),
                         "weight_bytes": rows[-1]["weight_bytes"] + model.lm_head.qweight.numel()})  # fmt: skip
            print(rows[-1], flush=True)
        del model
    speed = [] if args.no_speed else speed_table(models, ids[:32], args.decode_tokens, args.rounds)

    result = {
        "command": command, "text": "ShareGPT conversations 120..239 of load_conversations(min_turns=1, "
        "num_conversations=240, seed=0), messages joined by blank lines", "tokens": int(ids.numel()),
        "window": args.window, "decode_tokens": args.decode_tokens, "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(), "skipped_missing": skipped, "perplexity": rows, "decode": speed,
    }  # fmt: skip
    for path in models.values():
        meta = Path(path) / "kvboost-quantize.json"
        if meta.is_file():
            result.setdefault("quantization", {})[str(path)] = json.loads(meta.read_text())
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.out_name}.json").write_text(json.dumps(result, indent=2))
    fp32 = next((r["perplexity"] for r in rows if r["model"] == "fp32"), None)
    lines = [
        f"    {command}", "",
        f"Perplexity: {result['tokens']} held-out ShareGPT tokens, windows of {args.window}, fp32 activations.", "",
        "| model | perplexity | vs fp32 | weights MB (tied once) |", "|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        rel = f"{(r['perplexity'] / fp32 - 1) * 100:+.1f}%" if fp32 else "-"
        lines.append(f"| {r['model']} | {r['perplexity']:.3f} | {rel} | {r['weight_bytes'] / 1e6:.0f} |")
    if speed:
        lines += [
            "", (f"Decode: {args.decode_tokens} greedy tokens after a 32-token prompt, HF forward + DynamicCache, "
                 f"{result['torch_threads']} threads, median of {args.rounds} interleaved rounds, load average "
                 f"{result['load_average'][0]:.1f} (shared machine: compare rows, not absolute rates)."), "",
            "| variant | decode tok/s | rounds |", "|---|---|---|",
        ]  # fmt: skip
        lines += [f"| {r['variant']} | {r['decode_tok_s']} | {r['rounds']} |" for r in speed]
    if skipped:
        lines += ["", f"Not measured (folder missing, run scripts/quantize_awq.py): {', '.join(skipped)}."]
    (RESULTS / f"{args.out_name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
