"""AWQ prefill through torch's int4 CPU kernel vs dense copies (``model.awq_prefill: dense``): TTFT, decode, perplexity.

    python scripts/quantize_awq.py                        # once: the AWQ copy of the bundled model
    python -m experiments.bench.bench_awq_prefill --threads 2   # ~3 min on 2 cores

Two engines on the same AWQ folder, same dtype (default bf16) and LM head (default int8, ``--lm-head none`` for
the stored one), differing only in ``awq_prefill`` (``int4``: every row count through the int4 kernel; ``dense``:
forwards of 12+ rows through dequantized copies). Speed: cold requests (``mode="cold"``: nothing read from or
written to the cache) of ``--lengths`` prompt tokens taken from held-out ShareGPT text (a new slice per round),
``--new-tokens`` greedy tokens each; per round both engines serve the same prompts, the engine order alternating
by round. Reported per length: TTFT median [min-max] of each engine and the per-round paired ratio int4 / dense
(median [min-max]), and decode tokens/s. Quality: perplexity of each engine's model (HF's forward, teacher-forced
windows of ``--window`` tokens over ``--tokens`` held-out tokens, the text of ``experiments/checks/awq_perplexity.py``)
beside the float model in the same dtype.

Writes ``experiments/results/awq/awq_prefill_<dtype>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]  # the repository root

from experiments.checks.awq_perplexity import heldout_text, perplexity
from experiments.common import median_range
from kvboost.lab.environment import describe_environment

RESULTS = ROOT / "experiments" / "results" / "awq"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from experiments.common import script_module

    awq_output_dir = script_module("quantize_awq").awq_output_dir

    from experiments.common import compose_run_config
    from kvboost.build import build_engine
    from kvboost.models.loading import bundled_model_dir, load_model_and_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="AWQ folder (default: scripts/quantize_awq.py's output)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--lm-head", default="int8", choices=["int8", "none"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[42, 128, 300])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=4096, help="held-out tokens scored for perplexity")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    from experiments.common import set_threads

    set_threads(args.threads)
    command = "python -m experiments.bench.bench_awq_prefill " + " ".join(argv if argv is not None else sys.argv[1:])
    folder = Path(args.model or awq_output_dir("awq", 64))
    if not (folder / "config.json").is_file():
        raise SystemExit(f"no AWQ folder at {folder}: run `python scripts/quantize_awq.py` first (or pass --model)")

    head = None if args.lm_head == "none" else args.lm_head
    engines = {kind: build_engine(compose_run_config(name_or_path=str(folder), dtype=args.dtype, lm_head=head,
                                                     awq_prefill=None if kind == "int4" else kind))
               for kind in ("int4", "dense")}  # fmt: skip
    for engine in engines.values():
        engine.warmup()
    tokenizer = engines["int4"].tokenizer
    text_ids = tokenizer(heldout_text(), add_special_tokens=False)["input_ids"]
    need = args.rounds * sum(args.lengths)
    if len(text_ids) < need:
        raise SystemExit(f"the held-out text has {len(text_ids)} tokens; {need} are needed (fewer rounds or lengths)")

    records: list[dict[str, Any]] = []
    offset = 0
    total = args.rounds * len(args.lengths) * len(engines)
    with tqdm(total=total, desc="awq prefill", unit="req") as progress:
        for round_ in range(args.rounds):
            order = list(engines) if round_ % 2 == 0 else list(engines)[::-1]
            for length in args.lengths:
                prompt = text_ids[offset : offset + length]
                offset += length
                for kind in order:
                    r = engines[kind].generate(prompt, max_new_tokens=args.new_tokens, mode="cold")
                    records.append({"engine": kind, "round": round_, "prompt_tokens": length, "ttft_ms": r.ttft_ms,
                                    "decode_tok_s": r.tokens_per_sec, "output_ids": r.output_ids})  # fmt: skip
                    progress.update(1)

    speed = []
    for length in args.lengths:
        row: dict[str, Any] = {"prompt_tokens": length}
        for kind in engines:
            rs = [r for r in records if r["engine"] == kind and r["prompt_tokens"] == length]
            row[kind] = {"ttft_ms": [r["ttft_ms"] for r in rs], "decode_tok_s": [r["decode_tok_s"] for r in rs]}
        pairs = [(a, b) for a in records for b in records
                 if a["engine"] == "int4" and b["engine"] == "dense" and a["round"] == b["round"]
                 and a["prompt_tokens"] == b["prompt_tokens"] == length]  # fmt: skip
        row["ttft_ratio_int4_over_dense"] = [a["ttft_ms"] / b["ttft_ms"] for a, b in pairs]
        row["same_tokens"] = sum(a["output_ids"] == b["output_ids"] for a, b in pairs) / len(pairs)
        speed.append(row)

    ids = torch.tensor(text_ids[: args.tokens])
    quality = {kind: perplexity(engine.model, ids, args.window)[0] for kind, engine in engines.items()}
    float_model = load_model_and_tokenizer(bundled_model_dir(), dtype=args.dtype, device="cpu")[0]
    if head is not None:
        from kvboost.models.int8_head import quantize_lm_head

        quantize_lm_head(float_model, head)
    quality["float"] = perplexity(float_model, ids, args.window)[0]
    for engine in engines.values():
        engine.close()

    result = {
        "command": command,
        "model": str(folder),
        "dtype": args.dtype,
        "lm_head": args.lm_head,
        "threads": torch.get_num_threads(),
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "speed": speed,
        "perplexity": quality,
        "perplexity_tokens": int(ids.numel()),
        "environment": describe_environment(),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"awq_prefill_{args.dtype}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        f"# AWQ prefill: int4 kernel vs dense copies ({args.dtype}, LM head {args.lm_head})", "",
        "```", command, "```", "",
        (f"Cold requests, {args.new_tokens} greedy tokens, {args.rounds} rounds (engine order alternating), "
         f"{torch.get_num_threads()} threads. Median [min-max]."), "",
        ("| prompt tokens | TTFT ms int4 | TTFT ms dense | int4 / dense (paired) | decode tok/s int4 | decode tok/s dense "
         "| same greedy tokens |"),
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    for row in speed:
        lines.append(
            f"| {row['prompt_tokens']} | {median_range(row['int4']['ttft_ms'])} | {median_range(row['dense']['ttft_ms'])} | "
            f"{median_range(row['ttft_ratio_int4_over_dense'], 2)}x | {median_range(row['int4']['decode_tok_s'])} | "
            f"{median_range(row['dense']['decode_tok_s'])} | {row['same_tokens']:.2f} |"
        )
    lines += ["", (f"Perplexity ({ids.numel()} held-out tokens, windows of {args.window}, {args.dtype}): "
                   f"float {quality['float']:.3f}, AWQ int4 prefill {quality['int4']:.3f}, AWQ dense prefill "
                   f"{quality['dense']:.3f}."), ""]  # fmt: skip
    stem.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
