"""Reuse against the same engine's cold prefill, through the public API (issue 61, "Keys and promises").

    python -m experiments.checks.exactness                       # the bundled SmolLM2 + a tiny GGUF model, fp32
    KVBOOST_QUANT_ISA=avx2 python -m experiments.checks.exactness --tag avx2   # another build of the 4-bit kernels

Two walks, each on the bundled SmolLM2-135M-Instruct (``KVBoost.from_pretrained(dtype="float32")``: its default
CPU path, the 4-bit step for prompt rows and decode rows) and on a tiny random llama written to a GGUF file (the
same path on a model with other shapes: 4 heads over 2 KV heads, head dim 16):

(a) ``pinned``: per prompt, ``warm(prefix, pin=True)`` (a system prompt: its first ~60% of tokens), then
    ``generate(prompt)`` (reuse: the pinned rows, a suffix prefill, decode) against ``generate(prompt,
    mode="cold")`` of the same engine.
(b) ``disk_walk``: engine 1 over ``cache=[memory, disk]``: ``warm(system, pin=True)``, ``generate(turn 1)`` (its
    prompt and answer stored), ``close()`` (the pool's entries spill to disk); engine 2 on the same folder:
    ``generate(turn 1)`` again (its rows from disk) and ``generate(turn 2)`` (turn 1's prompt and *answer*, rows the
    decode step wrote, then a new question), each against engine 2's cold prefill.

Per check: max |first-token logit difference| (reuse - cold), the first-token KL, greedy match over
``--new-tokens`` tokens, the teacher-forced max |log-prob difference| over cold's answer (``score_ids``: every
answer position, not just the first), and the reuse ratio. Written to
``experiments/results/exactness/<cpu kind>[-<tag>].json`` with the command, the CPU, the 4-bit build
(``decode_info()["quantized"]``) and the machine's load average (a shared machine: say so when quoting).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "experiments" / "results" / "exactness"

SYSTEM = ("You are a careful assistant. Answer in two short sentences, cite no sources, and say so when you are "
          "unsure. Keep units explicit and numbers exact.")  # fmt: skip
QUESTIONS = (
    "What is the boiling point of water at sea level, and why does it change with altitude?",
    "Explain what a hash function is to a ten-year-old.",
    "Name three prime numbers larger than 100 and say how you checked them.",
)
FOLLOW_UP = "Now say it again in one sentence."


def _chat_ids(engine: Any, messages: list[dict[str, str]]) -> list[int]:
    tok = engine.tokenizer
    if getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return [int(i) for i in tok(text, add_special_tokens=False)["input_ids"]]
    return [int(i) for i in tok.apply_chat_template(messages)]


def compare(engine: Any, prompt: list[int], reuse: Any, cold: Any) -> dict[str, Any]:
    """The figures of one check: reuse ``reuse`` against cold ``cold`` of ``prompt`` (token ids)."""
    from kvboost.quality import capture_teacher_forced, compare_generations

    check = compare_generations(prompt, cold, reuse)
    answer = list(cold.output_ids)
    tf_diff = float("nan")
    if answer:  # teacher-forced log-probs of cold's answer after the prompt, each arm as it runs
        with capture_teacher_forced() as rows_reuse:
            engine.generate(prompt, max_new_tokens=1, score_ids=answer, store=False)
        with capture_teacher_forced() as rows_cold:
            engine.generate(prompt, max_new_tokens=1, score_ids=answer, mode="cold")
        if rows_reuse and rows_cold:
            tf_diff = float((rows_reuse[0].double() - rows_cold[0].double()).abs().max())
    return {"prompt_tokens": len(prompt), "cached_tokens": reuse.cached_tokens, "reuse_ratio": reuse.kv_reuse_ratio,
            "max_abs_logit_diff": check.max_abs_logit_diff, "first_token_kl": check.first_token_kl,
            "greedy_match": check.greedy_match, "first_divergence": check.first_divergence,
            "teacher_forced_max_abs_logprob_diff": tf_diff, "bit_equal_first_logits":
            bool(torch.equal(reuse.first_token_logits, cold.first_token_logits))}  # fmt: skip


def pinned(engine: Any, new_tokens: int) -> list[dict[str, Any]]:
    """(a): a pinned system prompt, then each question through generate (reuse) and generate(mode="cold")."""
    out = []
    for q in QUESTIONS:
        ids = _chat_ids(engine, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        cut = max(1, int(len(ids) * 0.6))
        engine.warm(ids[:cut], pin=True)
        reuse = engine.generate(ids, max_new_tokens=new_tokens)
        cold = engine.generate(ids, max_new_tokens=new_tokens, mode="cold")
        out.append({"question": q, **compare(engine, ids, reuse, cold)})
        engine.unpin(ids[:cut])
    return out


def disk_walk(build: Any, new_tokens: int) -> list[dict[str, Any]]:
    """(b): warm / pin / generate in engine 1 over [memory, disk]; close; engine 2 on the same folder reuses."""
    out = []
    with tempfile.TemporaryDirectory(prefix="kvboost-exactness-") as folder:
        cache = [{"name": "memory"}, {"name": "disk", "path": folder, "capacity": "4GiB"}]
        first = build(cache)
        turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
        ids1 = _chat_ids(first, turn1)
        system_ids = _chat_ids(first, turn1[:1])
        first.warm(system_ids[: max(1, len(system_ids) - 2)], pin=True)
        answer = first.generate(ids1, max_new_tokens=new_tokens)
        first.close()
        second = build(cache)
        reuse = second.generate(ids1, max_new_tokens=new_tokens)
        cold = second.generate(ids1, max_new_tokens=new_tokens, mode="cold")
        out.append({"step": "turn 1 after restart (rows from disk)", **compare(second, ids1, reuse, cold)})
        # turn 2: the prompt holds turn 1's answer as ids (the rows the decode step wrote are reused as stored)
        ids2 = ids1 + list(answer.output_ids) + _chat_ids(second, [{"role": "user", "content": FOLLOW_UP}])
        reuse = second.generate(ids2, max_new_tokens=new_tokens)
        cold = second.generate(ids2, max_new_tokens=new_tokens, mode="cold")
        out.append({"step": "turn 2 over turn 1's generated rows", **compare(second, ids2, reuse, cold)})
        second.close()
    return out


def bundled(new_tokens: int) -> dict[str, Any]:
    from kvboost import KVBoost
    from kvboost.models.loading import load_model_and_tokenizer

    model, tok, identity = load_model_and_tokenizer(None, dtype=torch.float32)

    def build(cache: Any = None) -> Any:
        return KVBoost(model, tok, model_identity=identity, share_model=True,
                       **({"cache": cache} if cache is not None else {}))  # fmt: skip

    engine = build()
    info = engine.decode_info()
    result = {"model": identity, "dtype": str(engine.adapter.dtype), "decode_info": _path_info(info),
              "pinned": pinned(engine, new_tokens)}  # fmt: skip
    engine.close()
    result["disk_walk"] = disk_walk(build, new_tokens)
    return result


def tiny(new_tokens: int, folder: Path) -> dict[str, Any]:
    """The tiny random llama (tests' kit) written to GGUF Q4_1 with a Q8_0 head: the 4-bit step's path."""
    sys.path.insert(0, str(ROOT / "tests"))
    from gguf import GGMLQuantizationType as T
    from kvboost_testkit.tiny import ToyTokenizer, tiny_model, write_gguf

    from kvboost import KVBoost

    model = tiny_model("llama", seed=3, num_hidden_layers=4, max_position_embeddings=2048)
    path = folder / "tiny-llama.gguf"
    write_gguf(model, path, "llama", {"output.weight": T.Q8_0})
    model._kvboost_gguf_file = str(path)

    def build(cache: Any = None) -> Any:
        return KVBoost(model, ToyTokenizer(), model_identity="tiny-gguf", share_model=True,
                       chunker={"name": "fixed", "chunk_size": 16},
                       **({"cache": cache} if cache is not None else {}))  # fmt: skip

    engine = build()
    result = {"model": "tiny random llama, GGUF Q4_1 (4 layers, hidden 64, 4 heads / 2 KV heads)",
              "dtype": str(engine.adapter.dtype), "decode_info": _path_info(engine.decode_info()),
              "pinned": pinned(engine, new_tokens)}  # fmt: skip
    engine.close()
    result["disk_walk"] = disk_walk(build, new_tokens)
    return result


def _path_info(info: dict[str, Any]) -> dict[str, Any]:
    keep = ("decode", "prefill", "quantized")
    return {k: info[k] for k in keep if k in info}


def summarize(model_result: dict[str, Any]) -> dict[str, Any]:
    checks = model_result["pinned"] + model_result["disk_walk"]
    return {"max_abs_logit_diff": max(c["max_abs_logit_diff"] for c in checks),
            "max_teacher_forced_logprob_diff": max(c["teacher_forced_max_abs_logprob_diff"] for c in checks),
            "greedy_match": f"{sum(c['greedy_match'] for c in checks)}/{len(checks)}",
            "bit_equal_first_logits": f"{sum(c['bit_equal_first_logits'] for c in checks)}/{len(checks)}"}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    from kvboost.env import cpu_features

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--tag", default="", help="suffix of the result file (e.g. the build or 'before')")
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--models", nargs="+", default=["bundled", "tiny"], choices=["bundled", "tiny"])
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    features = cpu_features()
    record: dict[str, Any] = {
        "command": "python -m experiments.checks.exactness " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "env": {"KVBOOST_QUANT_ISA": os.environ.get("KVBOOST_QUANT_ISA")}, "cpu": features,
        "load_average_before": os.getloadavg(), "models": {},
    }  # fmt: skip
    started = time.time()
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            result = bundled(args.new_tokens) if name == "bundled" else tiny(args.new_tokens, Path(folder))
            result["summary"] = summarize(result)
            record["models"][name] = result
            print(name, json.dumps(result["decode_info"], default=str))
            print(name, json.dumps(result["summary"]))
    record["load_average_after"] = os.getloadavg()
    record["seconds"] = round(time.time() - started, 1)
    args.out.mkdir(parents=True, exist_ok=True)
    name = features["kind"] + (f"-{args.tag}" if args.tag else "")
    path = args.out / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
