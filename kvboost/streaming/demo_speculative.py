"""Speculative decoding against plain decoding on the bundled model: ``python -m kvboost.streaming.demo_speculative``.

The original KVBoost shipped this demo under ``kvboost.streaming``; here the draft strategies are the ``DRAFT``
plugins (:mod:`kvboost.speculative`, ``kvboost/configs/speculative``) and work with or without layer streaming. One model is
loaded; a plain engine decodes a prompt greedily, then an engine with the draft strategy decodes it again over the
same model. Greedy speculative decoding gives the plain tokens (the target verifies every draft), so the demo prints
both decode speeds and whether the outputs match; it exits 1 if they do not.

    python -m kvboost.streaming.demo_speculative                          # prompt_lookup, 96 new tokens
    python -m kvboost.streaming.demo_speculative --draft layer_skip --max-new-tokens 48
    python -m kvboost.streaming.demo_speculative --model path/or/hub-id --dtype bfloat16

The default prompt asks the model to copy a passage: prompt lookup drafts well on such text (edits, summaries that
quote, code completion); on free text expect fewer accepted tokens and a smaller gain.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

PASSAGE = (
    "The lighthouse stood on the northern cliff for two hundred years. Every night the keeper climbed the ninety "
    "steps, trimmed the wick, polished the great lens and wrote the weather in a leather book. Ships passing the "
    "cape saw the beam sweep the water every twelve seconds, and they knew where the rocks were."
)


def _run(engine: Any, prompt: Any, max_new_tokens: int) -> Any:
    engine.generate(prompt, max_new_tokens=4, mode="cold", keep_logits=False)  # warm-up: allocations, kernels
    return engine.generate(prompt, max_new_tokens=max_new_tokens, mode="cold", keep_logits=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvboost.streaming.demo_speculative",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--model", default=None, help="HF id or folder (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", default="prompt_lookup",
                        help="DRAFT plugin: prompt_lookup | layer_skip | draft_model")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="float32", help="float32 (default: greedy outputs comparable bit for bit) "
                        "| bfloat16 | auto")  # fmt: skip
    parser.add_argument("--prompt", default=None, help="a user message (default: copy a passage)")
    args = parser.parse_args(argv)

    from kvboost import KVBoost

    prompt = [{"role": "user", "content": args.prompt or f"Copy this passage exactly, word for word:\n\n{PASSAGE}"}]
    plain_engine = KVBoost.from_pretrained(args.model, dtype=args.dtype)
    model, tokenizer = plain_engine.model, plain_engine.tokenizer
    plain = _run(plain_engine, prompt, args.max_new_tokens)
    plain_engine.close()  # hands the model to the next engine
    spec_engine = KVBoost(model, tokenizer, model_identity=args.model or "bundled", speculative=args.draft)
    spec = _run(spec_engine, prompt, args.max_new_tokens)
    spec_engine.close()

    match = plain.output_ids == spec.output_ids
    print(f"model: {args.model or 'bundled SmolLM2-135M-Instruct'}  dtype: {next(model.parameters()).dtype}  "
          f"draft: {args.draft}")  # fmt: skip
    for name, r in (("plain", plain), (args.draft, spec)):
        print(f"{name:>14}: {r.generated_tokens:4d} tokens  decode {r.tokens_per_sec:7.1f} tokens/s  "
              f"total {r.total_ms:8.1f} ms")  # fmt: skip
    extra = spec.extra
    print(f"{'draft':>14}: {extra.get('accepted_tokens', 0)}/{extra.get('drafted_tokens', 0)} drafted tokens accepted, "
          f"{extra.get('tokens_per_target_forward', 0.0):.2f} tokens per target forward")  # fmt: skip
    speedup = spec.tokens_per_sec / plain.tokens_per_sec if plain.tokens_per_sec else float("nan")
    print(f"{'speedup':>14}: {speedup:.2f}x decode tokens/s")
    print(f"{'outputs match':>14}: {match}")
    print(f"\n{spec.output_text.strip()[:400]}")
    return 0 if match else 1


if __name__ == "__main__":
    sys.exit(main())
