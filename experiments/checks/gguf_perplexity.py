"""Perplexity of a GGUF model run as shipped (``weights=gguf_int4``) against the same model dense, on held-out text.

    python -m experiments.checks.gguf_perplexity --models smollm2 qwen_coder_0_5b --threads 2

For each model, each activation dtype (fp32, bf16) and each weight format (``dense``: the dequantized copy
transformers loads; ``gguf_int4``: the file's Q4_0 / Q4_1 / Q4_K tensors in torch's int4 CPU kernel, the rest
dense, ``kvboost.models.gguf_weights``): the perplexity of the same held-out ShareGPT text as
``experiments/checks/awq_perplexity.py`` (conversations 120..239 of its fixed sample, never used to calibrate
anything), the first ``--tokens`` tokens of the model's own tokenization, teacher-forced in windows of
``--window`` tokens. The dense model is the GGUF's own dequantization, so the two formats hold the same weights:
any difference is the arithmetic of the int4 kernel (where it runs), not quantization.

Writes ``experiments/results/gguf_int4/perplexity.json`` and ``perplexity.md`` (the command on top).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from tqdm import tqdm

from experiments.checks.awq_perplexity import heldout_text, perplexity
from experiments.common import RESULTS_DIR, add_threads_arg, set_threads, write_json, write_markdown

MODELS = {"smollm2": None, "qwen_coder_0_5b": "gguf:qwen_coder_0_5b"}
OUT = RESULTS_DIR / "gguf_int4"


def measure(name: str, dtype: str, weights: str, text: str, tokens: int, window: int) -> dict[str, Any]:
    """One row: load ``name`` as ``from_pretrained`` would, with ``weights``, score ``text``."""
    from kvboost.models.gguf_weights import weight_format_counts
    from kvboost.models.options import LoadOptions, load_for_engine

    model, tokenizer, _, _ = load_for_engine(MODELS[name], dtype=dtype, device="cpu",
                                             options=LoadOptions(weights=weights))  # fmt: skip
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:tokens])
    ppl, scored = perplexity(model, ids, window)
    unique = {(t.data_ptr(), t.dtype, tuple(t.shape)): t for t in [*model.parameters(), *model.buffers()]}
    return {"model": name, "dtype": dtype, "weights": weights, "perplexity": round(ppl, 4), "tokens_scored": scored,
            "weight_formats": weight_format_counts(model),
            "weight_bytes": sum(t.numel() * t.element_size() for t in unique.values())}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--out-name", default="perplexity")
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    command = "python -m experiments.checks.gguf_perplexity " + " ".join(argv if argv is not None else sys.argv[1:])
    text = heldout_text()
    plan = [(m, d, w) for m in args.models for d in args.dtypes for w in ("dense", "gguf_int4")]
    rows = [measure(m, d, w, text, args.tokens, args.window) for m, d, w in tqdm(plan, desc="perplexity")]
    write_json(OUT / f"{args.out_name}.json", {"command": command, "threads": threads, "tokens": args.tokens,
                                                "window": args.window, "rows": rows})  # fmt: skip
    lines = [
        f"    {command}", "",
        f"Held-out ShareGPT text (awq_perplexity's), first {args.tokens} tokens of each model's tokenization, windows "
        f"of {args.window}. Dense = the GGUF's own dequantization, so both formats hold the same weights.", "",
        "| model | activations | weights | perplexity | vs dense, same dtype | weight MB | formats |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for r in rows:
        dense = next(x["perplexity"] for x in rows if (x["model"], x["dtype"], x["weights"]) ==
                     (r["model"], r["dtype"], "dense"))  # fmt: skip
        formats = ", ".join(f"{k}: {v}" for k, v in r["weight_formats"].items())
        lines.append(f"| {r['model']} | {r['dtype']} | {r['weights']} | {r['perplexity']:.4f} | "
                     f"{(r['perplexity'] / dense - 1) * 100:+.2f}% | {r['weight_bytes'] / 1e6:.0f} | {formats} |")  # fmt: skip
    write_markdown(OUT / f"{args.out_name}.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows


if __name__ == "__main__":
    main()
