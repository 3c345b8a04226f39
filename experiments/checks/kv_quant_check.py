"""KV quantization check: bytes per stored token, and quality figures collected from run.py outputs.

Two steps, results merged into ``experiments/results/kv_quant/kv_quant.json``:

1. ``bytes``: the store's used bytes (``engine.cache_stats()``) per stored token for quant none / kivi8 / kivi4 /
   kivi2 (and kivi4 at KIVI's group 32) on the bundled SmolLM2-135M in fp32, after warming a few real ShareGPT chat
   prompts (chat template applied, the project's default 64-token fixed chunks), against the model's own fp32
   KV and an fp16 KV of the same shape::

       python -m experiments.checks.kv_quant_check bytes

2. ``collect``: the quality numbers of finished runs (their ``summary.json``)::

       python run.py quant=kivi4 workload.num_conversations=8 workload.max_turns=6 \\
           'workload.modes=[baseline,kvboost]' logger=none hydra.run.dir=outputs/kv_quant/replay_kivi4
       python run.py experiment=reuse_accuracy quant=kivi4 logger=none hydra.run.dir=outputs/kv_quant/accuracy_kivi4
       python -m experiments.checks.kv_quant_check collect outputs/kv_quant

   ``replay_NAME`` folders give greedy match rate and first-token KL of ``kvboost`` vs ``baseline``;
   ``accuracy_NAME`` folders the teacher-forced perplexity of the ``kvboost`` (history served from the quantized
   cache) vs ``kvboost_cold`` rows of the ``accuracy_by_reuse`` table (kvboost/lab/accuracy_table.py), over all
   requests (``all``) and per reuse bucket.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parents[1] / "results" / "kv_quant"
QUANTS: dict[str, Any] = {
    "none": "none",
    "kivi8": {"name": "kivi8"},
    "kivi4": {"name": "kivi4"},  # group_size 64 (its default)
    "kivi2": {"name": "kivi2"},
    "kivi4_g32": {"name": "kivi4", "group_size": 32},
}


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def _save(update: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "kv_quant.json"
    data = _load(out)
    data.update(update)
    out.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return out


# ---------------------------------------------------------------------------------------------- bytes
def _prompts(num: int, tokenizer) -> list[str]:
    from kvboost.lab.sharegpt_data import load_conversations

    convs = load_conversations(min_turns=3, max_turns=4, num_conversations=num, seed=0, max_user_chars=1500,
                               max_assistant_chars=1500, max_prompt_chars=6000)  # fmt: skip
    prompts = []
    for c in convs:
        messages = [{"role": "system", "content": c.system}] if c.system else []
        for turn in c.turns:
            messages += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": turn.assistant}]
        prompts.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False))
    return prompts


def measure_bytes(num_prompts: int = 4, quants: dict[str, Any] = QUANTS) -> dict[str, Any]:
    import torch

    from experiments.common import compose_run_config
    from kvboost.build import build_engine
    from kvboost.models.loading import load_model_and_tokenizer

    model, tokenizer, path = load_model_and_tokenizer(None, dtype="float32")
    prompts = _prompts(num_prompts, tokenizer)
    rows: dict[str, Any] = {}
    for name, spec in quants.items():
        cfg = compose_run_config(quant=spec, chunker={"name": "fixed", "chunk_size": 64})
        engine = build_engine(cfg, model, tokenizer, model_identity=str(path))
        start = time.perf_counter()
        with torch.inference_mode():
            for p in prompts:
                engine.warm(p)
        tier = engine.store.tiers[0]
        entries = [tier.peek(k) for k in list(tier.keys())]
        tokens = sum(e.num_tokens for e in entries if e is not None)
        used = int(engine.cache_stats()["tiers"][0]["used_bytes"])
        shape = engine.adapter.kv_shape
        fp32_per_token = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4
        per_token = used / tokens
        rows[name] = {
            "quant": spec,
            "fingerprint": engine.quantizer.fingerprint(),
            "stored_tokens": tokens,
            "stored_chunks": len(entries),
            "used_bytes": used,
            "bytes_per_token": per_token,
            "x_smaller_than_fp32": fp32_per_token / per_token,
            "x_smaller_than_fp16": fp32_per_token / 2 / per_token,
            "warm_s": time.perf_counter() - start,
        }
        engine.close()
        row = rows[name]
        print(f"{name:>10}: {per_token:8.1f} B/token  {row['x_smaller_than_fp32']:.2f}x vs fp32  "
              f"{row['x_smaller_than_fp16']:.2f}x vs fp16  ({tokens} tokens, {len(entries)} chunks)")  # fmt: skip
    shape = engine.adapter.kv_shape
    return {
        "model": str(path),
        "dtype": "float32",
        "kv_shape": {"layers": shape.num_layers, "kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim},
        "fp32_bytes_per_token": 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4,
        "fp16_bytes_per_token": 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 2,
        "prompts": len(prompts),
        "chunker": {"name": "fixed", "chunk_size": 64},
        "rows": rows,
    }


# ---------------------------------------------------------------------------------------------- collect
def _replay(summary: dict[str, Any], records_file: Path) -> dict[str, Any]:
    q = summary.get("quality", {}).get("kvboost", {})
    overall = summary.get("modes", {}).get("kvboost", {}).get("overall", {})
    out = {
        "greedy_match_rate": q.get("greedy_match_rate"),
        "first_token_kl_mean": q.get("first_token_kl_mean"),
        "first_token_kl_max": q.get("first_token_kl_max"),
        "n": q.get("n"),
        "reuse_ratio": overall.get("reuse_ratio"),
        "max_new_tokens": summary.get("config", {}).get("workload", {}).get("max_new_tokens"),
    }
    if records_file.exists():  # per request: did the first token agree, where did the greedy outputs part
        rows = [json.loads(line) for line in records_file.read_text().splitlines() if line.strip()]
        warm = [r for r in rows if r.get("mode") == "kvboost" and r.get("repeat", 0) == 0 and "greedy_match" in r]
        reused = [r for r in warm if r.get("cached_tokens", 0) > 0]
        diverged = sorted(r["first_divergence"] for r in reused if r.get("first_divergence") is not None)
        out.update({
            "requests_with_reuse": len(reused),
            "greedy_match_rate_with_reuse": (
                sum(bool(r["greedy_match"]) for r in reused) / len(reused) if reused else None),
            "first_token_agreement_with_reuse": (
                sum(r.get("first_divergence") != 0 for r in reused) / len(reused) if reused else None),
            "first_divergence_median": diverged[len(diverged) // 2] if diverged else None,
        })  # fmt: skip
    return out


def _accuracy(summary: dict[str, Any]) -> dict[str, Any]:
    table = summary.get("accuracy_by_reuse") or {}
    rows = table.get("modes", {}).get("kvboost", {})
    out: dict[str, Any] = {"reference_mode": table.get("reference_mode")}
    for bucket, cell in rows.items():  # "all" and every reuse bucket the run filled
        if not cell or cell.get("perplexity") is None:
            continue
        ppl, ref_ppl = cell["perplexity"], cell.get("perplexity_ref")
        out[bucket] = {
            "n_scored": cell.get("n_scored"),
            "scored_tokens": cell.get("scored_tokens"),
            "reuse_ratio": cell.get("reuse_ratio"),
            "perplexity": ppl,
            "perplexity_cold": ref_ppl,
            "perplexity_rel_change": (ppl / ref_ppl - 1) if ref_ppl else None,
            "logprob_delta_per_token": cell.get("logprob_delta_per_token"),
        }
    return out


def collect(root: Path) -> dict[str, Any]:
    found: dict[str, Any] = {"replay": {}, "reuse_accuracy": {}}
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        summary_file = folder / "summary.json"
        if not summary_file.exists():
            continue
        summary = json.loads(summary_file.read_text())
        kind, _, name = folder.name.partition("_")
        if kind == "replay":
            found["replay"][name] = _replay(summary, folder / "records.jsonl")
        elif kind == "accuracy":
            found["reuse_accuracy"][name] = _accuracy(summary)
    for kind, rows in found.items():
        for name, row in rows.items():
            print(kind, name, json.dumps(row, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))
    return found


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    b = sub.add_parser("bytes", help="bytes per stored token on the bundled SmolLM2 (fp32)")
    b.add_argument("--prompts", type=int, default=4)
    c = sub.add_parser("collect", help="quality figures from run.py output folders replay_NAME / accuracy_NAME")
    c.add_argument("root", type=Path)
    args = parser.parse_args(argv)
    if args.step == "bytes":
        out = _save({"bytes_per_token": measure_bytes(args.prompts)})
    else:
        found = collect(args.root)
        data = _load(RESULTS / "kv_quant.json")
        for kind, rows in found.items():
            data.setdefault(kind, {}).update(rows)
        out = _save({k: data[k] for k in found})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
