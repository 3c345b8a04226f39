"""Perplexity of held-out ShareGPT replies scored through the engine's decode path, per decode arm.

    python -m experiments.checks.decode_perplexity --threads 2 --conversations 10 --max-reply-tokens 128  # 13 min
    python -m experiments.checks.decode_perplexity --threads 2                     # defaults: ~30 min on 2 cores
    python -m experiments.checks.decode_perplexity --threads 2 --with-compiled     # + the compiled arm

Why through the decode path. ``engine.decode=quantized`` (``kvboost.runtime.quant_step``) only runs on decode
batches (one new token per sequence); prefill (several tokens at once) always multiplies the dense fp32 weights.
A teacher-forced forward over a window (``awq_perplexity.py``, ``gguf_perplexity.py``) is a prefill, so it would
never exercise the quantized step. Here every scored token but the first is predicted by a decode step.

What is measured. The held-out conversations are those of ``experiments/checks/awq_perplexity.py``
(conversations 120..239 of the fixed ShareGPT sample of ``scripts/quantize_awq.py``; 0..119 calibrate AWQ, so
nothing here was used to fit anything), in order, the first ``--conversations`` of them that are usable. From each:
its first user turn and first assistant reply only. The prompt is the user turn through the tokenizer's chat
template with the generation prompt added; the reply is the assistant text's tokens (no special tokens added, no
end-of-turn token), cut to ``--max-reply-tokens``. A conversation is skipped (and named in the JSON) when its
reply is empty or its prompt + reply would reach ``--max-context`` (2048) tokens. For each conversation, on the
engine's runner directly (no prefix cache, no sampling): one prefill forward of the prompt, whose last logits
score the first reply token; then the reply's tokens one at a time as decode steps, each step's logits scoring
the next reply token (teacher forcing through the decode path). Perplexity = exp(mean NLL over every scored
reply token of every conversation).

Arms (each its own engine, the bundled SmolLM2-135M-Instruct GGUF loaded in fp32):

- ``dense_fp32``: ``engine.decode=eager``: the reference, decode steps HF-equivalent dense fp32;
- ``quantized_fp32``: ``engine.decode=quantized``, ``engine.decode_activations=fp32``: the file's 4-bit blocks
  and the Q8_0 embedding as LM head, exact activations;
- ``quantized_int16``: ``engine.decode=quantized`` with its default ``engine.decode_activations=int16``: each
  row's 32-value activation groups rounded to int16 codes: what ``engine.decode=auto`` picks for the bundled model
  on CPU, the new default;
- ``quantized_int8``: ``engine.decode_activations=int8``: the same rounded to int8 (llama.cpp's arithmetic);
- ``compiled_fp32`` (``--with-compiled`` only; its warm-up compiles for 1-3 minutes): ``engine.decode=compiled``,
  the previous CPU default;
- ``default``: no override, what a user gets on this machine (``model.dtype=auto``: bf16 on a CPU with native bf16,
  so the prompt is prefilled on the dense bf16 weights; the decode steps from the 4-bit blocks).

Reported per arm: perplexity, mean NLL, tokens scored, the perplexity's ratio to ``dense_fp32``'s, the max and
mean absolute per-token NLL difference from ``dense_fp32``, the greedy top-1 agreement with ``dense_fp32`` over the
scored positions, the runner's forwards counts (which path ran), the wall time, and ``engine.decode_info()``'s
decode / decode_reason / quantized description.

Writes ``experiments/results/decode_perplexity/perplexity.json`` and ``perplexity.md`` (the command on top;
``--out-name`` changes the stem).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import torch
from tqdm import tqdm

from experiments.common import RESULTS_DIR, add_threads_arg, set_threads, write_json, write_markdown

OUT = RESULTS_DIR / "decode_perplexity"

ARMS: dict[str, list[str]] = {
    "dense_fp32": ["engine.decode=eager", "model.dtype=float32"],
    "quantized_fp32": ["engine.decode=quantized", "engine.decode_activations=fp32", "model.dtype=float32"],
    "quantized_int16": ["engine.decode=quantized", "engine.decode_activations=int16", "model.dtype=float32"],
    "quantized_int8": ["engine.decode=quantized", "engine.decode_activations=int8", "model.dtype=float32"],
    "compiled_fp32": ["engine.decode=compiled", "model.dtype=float32"],
    # the configuration a user gets on this machine: model.dtype=auto (bf16 where the CPU has native bf16, e.g. Zen 4
    # or AMX, so a bf16 dense prefill and the 4-bit decode), engine.decode=auto
    "default": [],
}
REFERENCE = "dense_fp32"


def heldout_samples(tokenizer: Any, conversations: int, max_reply_tokens: int,
                    max_context: int = 2048) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:  # fmt: skip
    """(samples, skipped): the first ``conversations`` usable held-out conversations as ``{"index", "prompt_ids",
    "reply_ids"}`` (index: the position in the fixed sample), and the ones passed over with the reason."""
    from experiments.common import script_module

    quantize_awq = script_module("quantize_awq")
    start = quantize_awq.CALIB_CONVERSATIONS
    samples: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for index, conv in enumerate(quantize_awq.sharegpt_sample()[start:], start=start):
        if len(samples) >= conversations:
            break
        turn = conv.turns[0]
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": turn.user}],
                                               add_generation_prompt=True, tokenize=True)  # fmt: skip
        if not isinstance(prompt, list):  # a BatchEncoding (transformers 5)
            prompt = prompt["input_ids"]
        prompt = [int(t) for t in (prompt[0] if prompt and isinstance(prompt[0], list) else prompt)]
        reply = list(tokenizer(turn.assistant, add_special_tokens=False)["input_ids"])[:max_reply_tokens]
        if not reply:
            skipped.append({"index": index, "reason": "empty reply"})
        elif len(prompt) + len(reply) >= max_context:
            skipped.append({"index": index, "reason": f"prompt {len(prompt)} + reply {len(reply)} >= {max_context}"})
        else:
            samples.append({"index": index, "prompt_ids": prompt, "reply_ids": reply})
    return samples, skipped


def score_through_decode(engine: Any, prompt_ids: list[int], reply_ids: list[int]) -> tuple[list[float], list[int]]:
    """(NLL of each reply token, the argmax at each scored position): the first reply token from the prefill's
    last logits, every later one from the decode step fed the token before it."""
    from kvboost.kv.block_table import BlockTable
    from kvboost.runtime.batch import ForwardBatch, SeqInput

    runner = engine.runner
    table = BlockTable(engine.pool)
    nll: list[float] = []
    top1: list[int] = []
    try:
        with torch.inference_mode():
            logits = runner.run(ForwardBatch.build([SeqInput(table, list(prompt_ids))]))
            for i, target in enumerate(reply_ids):
                if i > 0:
                    logits = runner.run(ForwardBatch.build([SeqInput(table, [reply_ids[i - 1]])]))
                row = logits[-1].float()
                nll.append(-torch.log_softmax(row, -1)[target].item())
                top1.append(int(row.argmax()))
    finally:
        table.release()
    return nll, top1


def score_arm(engine: Any, samples: list[dict[str, Any]], desc: str = "") -> dict[str, Any]:
    """Every sample through :func:`score_through_decode`: per-token NLL and argmax (flat, in order), perplexity,
    forwards counted on the runner while scoring, wall time."""
    before = dict(engine.runner.forwards)
    nll: list[float] = []
    top1: list[int] = []
    start = time.perf_counter()
    for sample in tqdm(samples, desc=desc or "decode perplexity", leave=False):
        n, t = score_through_decode(engine, sample["prompt_ids"], sample["reply_ids"])
        nll += n
        top1 += t
    wall = time.perf_counter() - start
    forwards = {k: v - before.get(k, 0) for k, v in engine.runner.forwards.items() if v - before.get(k, 0)}
    mean = sum(nll) / len(nll)
    return {"perplexity": math.exp(mean), "mean_nll": mean, "tokens_scored": len(nll), "nll": nll, "top1": top1,
            "forwards": forwards, "wall_s": wall}  # fmt: skip


def compare(arm: dict[str, Any], ref: dict[str, Any], targets: list[int]) -> dict[str, Any]:
    """The arm against the reference over the same scored positions."""
    diffs = [abs(a - b) for a, b in zip(arm["nll"], ref["nll"], strict=True)]
    agree = sum(a == b for a, b in zip(arm["top1"], ref["top1"], strict=True))
    return {
        "ppl_ratio": arm["perplexity"] / ref["perplexity"],
        "ppl_diff_pct": (arm["perplexity"] / ref["perplexity"] - 1) * 100,
        "nll_abs_diff_max": max(diffs),
        "nll_abs_diff_mean": sum(diffs) / len(diffs),
        "top1_agreement": agree / len(diffs),
        "top1_correct": sum(a == t for a, t in zip(arm["top1"], targets, strict=True)) / len(targets),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--max-reply-tokens", type=int, default=256)
    parser.add_argument("--max-context", type=int, default=2048, help="prompt + reply stay below this many tokens")
    parser.add_argument("--arms", nargs="+", default=None, choices=list(ARMS),
                        help="default: every arm but compiled_fp32 (which --with-compiled adds)")  # fmt: skip
    parser.add_argument("--with-compiled", action="store_true", help="add compiled_fp32 (compiles 1-3 min)")
    parser.add_argument("--out-name", default="perplexity", help="file stem in experiments/results/decode_perplexity")
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    command = "python -m experiments.checks.decode_perplexity " + " ".join(argv if argv is not None else sys.argv[1:])
    arms = args.arms or [a for a in ARMS if a != "compiled_fp32" or args.with_compiled]
    if REFERENCE not in arms:
        arms = [REFERENCE, *arms]
    arms = sorted(dict.fromkeys(arms), key=list(ARMS).index)  # the reference first

    from experiments.common import compose_run_config
    from kvboost.build import build_engine

    results: dict[str, dict[str, Any]] = {}
    samples: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    targets: list[int] = []
    for name in tqdm(arms, desc="arms"):
        load_start = time.perf_counter()
        engine = build_engine(compose_run_config(ARMS[name]))
        try:
            warmup_s = None
            if name == "compiled_fp32":
                warmup_s = engine.warmup()["decode_compile_s"]
            load_s = time.perf_counter() - load_start
            if not samples:
                samples, skipped = heldout_samples(engine.tokenizer, args.conversations, args.max_reply_tokens,
                                                   args.max_context)  # fmt: skip
                targets = [t for s in samples for t in s["reply_ids"]]
            result = score_arm(engine, samples, desc=name)
            info = engine.decode_info()
            result["decode_info"] = {k: info.get(k) for k in ("runner", "decode", "decode_reason", "decode_compile_s",
                                                              "prefill", "prefill_weights", "exact")}  # fmt: skip
            if "quantized" in info:
                result["decode_info"]["quantized"] = info["quantized"]
            result["decode_info"]["dtype"] = str(engine.adapter.dtype).removeprefix("torch.")
            result["load_s"], result["warmup_s"] = load_s, warmup_s
            results[name] = result
        finally:
            engine.close()
            del engine

    ref = results[REFERENCE]
    rows = []
    for name, r in results.items():
        row = {"arm": name, "overrides": ARMS[name], "perplexity": r["perplexity"], "mean_nll": r["mean_nll"],
               "tokens_scored": r["tokens_scored"], **compare(r, ref, targets), "forwards": r["forwards"],
               "wall_s": round(r["wall_s"], 1), "load_s": round(r["load_s"], 1), "warmup_s": r["warmup_s"],
               "decode_info": r["decode_info"]}  # fmt: skip
        rows.append(row)
    per_conversation = []
    offset = 0
    for s in samples:
        n = len(s["reply_ids"])
        per_conversation.append({
            "index": s["index"], "prompt_tokens": len(s["prompt_ids"]), "reply_tokens": n,
            **{f"mean_nll_{name}": sum(r["nll"][offset : offset + n]) / n for name, r in results.items()},
        })  # fmt: skip
        offset += n
    data = {
        "command": command, "threads": threads, "conversations": len(samples),
        "conversation_indexes": [s["index"] for s in samples], "skipped": skipped,
        "max_reply_tokens": args.max_reply_tokens, "max_context": args.max_context,
        "prompt_tokens": sum(len(s["prompt_ids"]) for s in samples), "reply_tokens": len(targets),
        "rows": rows, "per_conversation": per_conversation,
        "per_token_nll": {name: [round(x, 6) for x in r["nll"]] for name, r in results.items()},
    }  # fmt: skip
    write_json(OUT / f"{args.out_name}.json", data)

    lines = [
        f"    {command}", "",
        (f"Held-out ShareGPT conversations (awq_perplexity's: 120..239 of the fixed sample), the first {len(samples)} "
        f"usable ({', '.join(str(s['index']) for s in samples)}): first user turn through the chat template "
        f"(generation prompt added) as the prompt ({data['prompt_tokens']} tokens in all), the first assistant reply "
        f"cut to {args.max_reply_tokens} tokens scored ({len(targets)} tokens). The first reply token is scored from "
        "the prefill's last logits, every later one from a decode step fed the previous reply token (teacher "
        f"forcing through the decode path). SmolLM2-135M-Instruct (bundled Q4_1 GGUF), each arm in its "
        f"dtype (the runner lines below), {threads} threads. "
        "NLL differences and top-1 agreement are per scored position against dense_fp32."), "",
        ("| arm | perplexity | vs dense fp32 | mean NLL | tokens | NLL abs diff max | NLL abs diff mean "
         "| top-1 agreement | top-1 correct | forwards | wall s |"),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for r in rows:
        forwards = ", ".join(f"{k}: {v}" for k, v in r["forwards"].items())
        lines.append(f"| {r['arm']} | {r['perplexity']:.4f} | {r['ppl_diff_pct']:+.3f}% (x{r['ppl_ratio']:.5f}) | "
                     f"{r['mean_nll']:.5f} | {r['tokens_scored']} | {r['nll_abs_diff_max']:.2e} | "
                     f"{r['nll_abs_diff_mean']:.2e} | {r['top1_agreement'] * 100:.2f}% | "
                     f"{r['top1_correct'] * 100:.2f}% | {forwards} | {r['wall_s']:.0f} |")  # fmt: skip
    lines += ["", "Runners (`engine.decode_info()`):", ""]
    for r in rows:
        info = r["decode_info"]
        text = f"- {r['arm']}: {info.get('dtype', 'float32')}, prefill={info.get('prefill')}, decode={info['decode']} ({info['decode_reason']})"
        if "quantized" in info:
            text += f"; quantized: {info['quantized']}"
        lines.append(text)
    if skipped:
        lines += ["", "Skipped: " + "; ".join(f"{s['index']} ({s['reason']})" for s in skipped)]
    write_markdown(OUT / f"{args.out_name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return data


if __name__ == "__main__":
    main()
