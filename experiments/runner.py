"""The experiment runner: builds the engine from a config, replays a workload, writes the results.

Importable without Hydra (``run_experiment`` takes a plain dict or an OmegaConf config); ``run.py`` is
the Hydra entry point around it. Outputs, in ``out_dir``:

- ``records.jsonl``: one line per request and mode;
- ``summary.json``: config, environment, per-mode per-turn aggregates, quality vs the baseline,
  attention backend and kernel calls, TTFT breakdown (where kvboost's overhead goes);
- ``ttft_by_turn.png``, ``reuse_by_turn.png``;
- a table printed at the end.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from experiments.environment import describe_environment
from experiments.hf_baselines import HFNoCache, HFPrefixCache
from experiments.loggers import build_logger
from experiments.report import format_table, plot_summary, summarize, write_records, write_summary
from experiments.workloads.sharegpt_replay import build_sharegpt_replay
from kvboost.engine import InferenceEngine, compare_generations
from kvboost.prompts import tokenize_prompt
from kvboost.types import GenerationResult

log = logging.getLogger(__name__)

MODES = ("baseline", "hf_prefix", "kvboost")
WORKLOADS = {"sharegpt_replay": build_sharegpt_replay}
WARMUP_MESSAGES = [{"role": "user", "content": "Warm-up request, not measured: name three colours."}]


def _plain(cfg: Any) -> dict[str, Any]:
    if cfg is None:
        return {}
    if type(cfg).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)


def build_engine(cfg: dict[str, Any], model: Any = None, tokenizer: Any = None) -> InferenceEngine:
    """The engine described by ``cfg`` (groups model/chunker/hasher/cache/recompute/quant/attn).

    ``model``/``tokenizer`` may be given (tests pass tiny random models); otherwise ``cfg.model`` is loaded.
    """
    options = dict(
        chunker=cfg.get("chunker", "fixed"),
        hasher=cfg.get("hasher", "sha256"),
        cache=cfg.get("cache"),
        recompute=cfg.get("recompute", "none"),
        quant=cfg.get("quant", "none"),
        attn=cfg.get("attn", "sdpa"),
        **(cfg.get("engine") or {}),
    )
    if model is not None:
        return InferenceEngine(model, tokenizer, **options)
    model_cfg = dict(cfg.get("model") or {})
    return InferenceEngine.from_pretrained(
        model_cfg.get("name_or_path"), dtype=model_cfg.get("dtype", "float32"), device=model_cfg.get("device"), **options
    )


def _record(mode: str, request: Any, result: GenerationResult, quality: dict[str, Any]) -> dict[str, Any]:
    return {
        **result.metrics(),
        "mode": mode,  # the runner's name for it (the engine calls kvboost's mode "chunk_reuse")
        "conversation_id": request.conversation_id,
        "turn": request.turn,
        "output_text": result.output_text,
        **quality,
    }


def _breakdown(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean TTFT components per mode, and kvboost's per-request overhead over hf_prefix."""
    parts = ("tokenize_ms", "lookup_ms", "prefill_ms", "store_ms", "prefill_tokens")
    by_mode: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for p in parts:
            if isinstance(r.get(p), (int, float)):
                by_mode[r["mode"]][p].append(float(r[p]))
    out: dict[str, Any] = {
        mode: {f"{p}_mean": sum(v) / len(v) for p, v in values.items() if v} for mode, values in by_mode.items()
    }
    if "kvboost" in out and "hf_prefix" in out:
        k, h = out["kvboost"], out["hf_prefix"]
        out["kvboost_overhead_vs_hf_prefix"] = {
            # Chunking, hashing, lookup and assembly vs cropping a carried cache.
            "lookup_ms_mean_diff": k.get("lookup_ms_mean", 0.0) - h.get("lookup_ms_mean", 0.0),
            "extra_prefill_tokens_mean": k.get("prefill_tokens_mean", 0.0) - h.get("prefill_tokens_mean", 0.0),
        }
    return out


def run_experiment(cfg: Any, *, out_dir: str | Path, model: Any = None, tokenizer: Any = None) -> dict[str, Any]:
    """Run the configured workload in every mode; write records, summary and plots into ``out_dir``."""
    cfg = _plain(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seed = int(cfg.get("seed", 0))
    torch.manual_seed(seed)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))

    workload_cfg = dict(cfg.get("workload") or {"name": "sharegpt_replay"})
    workload_name = workload_cfg.pop("name", "sharegpt_replay")
    if workload_name not in WORKLOADS:
        raise ValueError(f"unknown workload {workload_name!r}; available: {', '.join(WORKLOADS)}")
    modes = list(workload_cfg.pop("modes", MODES))
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; available: {', '.join(MODES)}")
    max_new_tokens = int(workload_cfg.get("max_new_tokens", 32))

    t_load = time.perf_counter()
    engine = build_engine(cfg, model, tokenizer)
    load_s = time.perf_counter() - t_load
    tok = engine.tokenizer
    runners = {
        "baseline": HFNoCache(engine.model, tok),
        "hf_prefix": HFPrefixCache(engine.model, tok),
    }

    def run_mode(mode: str, messages: list[dict[str, str]]) -> GenerationResult:
        if mode == "kvboost":
            return engine.generate(messages, max_new_tokens=max_new_tokens, mode="chunk_reuse")
        return runners[mode].generate(messages, max_new_tokens=max_new_tokens)

    workload = WORKLOADS[workload_name](workload_cfg, lambda msgs: len(tokenize_prompt(tok, msgs)))

    # Warm the model's kernels (not the cache) on an unrelated prompt, then forget it: the first forward
    # of a process pays one-off allocation and dispatch costs that no mode should be charged for.
    if cfg.get("warmup", True):
        for mode in modes:
            if mode == "kvboost":
                engine.generate(WARMUP_MESSAGES, max_new_tokens=4, mode="chunk_reuse")
            else:
                runners[mode].generate(WARMUP_MESSAGES, max_new_tokens=4)
        engine.reset_cache()
        runners["hf_prefix"].reset()
    engine.attention.reset_stats()

    logger = build_logger(cfg.get("logger"), out_dir=out, config=cfg)
    records: list[dict[str, Any]] = []
    progress = tqdm(total=workload.num_requests_upper_bound() * len(modes), desc=f"{workload_name}", unit="req")
    step = 0
    try:
        for request in workload.requests():
            results: dict[str, GenerationResult] = {}
            for mode in modes:
                result = run_mode(mode, request.messages)
                results[mode] = result
                quality: dict[str, Any] = {}
                if mode != "baseline" and "baseline" in results:
                    check = compare_generations(request.messages, results["baseline"], result)
                    quality = {
                        "greedy_match": check.greedy_match,
                        "first_token_kl": check.first_token_kl,
                        "first_divergence": check.first_divergence,
                        "max_abs_logit_diff": check.max_abs_logit_diff,
                    }
                record = _record(mode, request, result, quality)
                records.append(record)
                logger.log_request(record, step)
                step += 1
                progress.update(1)
                progress.set_postfix(conv=request.conversation_id[:10], turn=request.turn)
            reference = results.get("baseline") or next(iter(results.values()))
            workload.answer(request.conversation_id, request.turn, reference.output_text)
    finally:
        progress.close()

    write_records(records, out / "records.jsonl")
    summary = summarize(records, baseline_mode="baseline")
    summary["config"] = cfg
    summary["environment"] = describe_environment()
    summary["attention"] = engine.attention.stats()
    summary["cache"] = engine.cache_stats()
    summary["ttft_breakdown"] = _breakdown(records)
    summary["run"] = {
        "model_load_s": load_s,
        "requests": len(records),
        "conversations": len(workload.conversations),
        "skipped_turns_over_max_prompt_tokens": workload.skipped_turns,
        "fingerprint": engine.fingerprint,
    }
    write_summary(summary, out / "summary.json")
    plots = plot_summary(summary, out)
    logger.log_summary(summary, plots)
    logger.finish()
    print(format_table(summary))
    overhead = summary["ttft_breakdown"].get("kvboost_overhead_vs_hf_prefix")
    if overhead:
        print(
            f"kvboost lookup+assembly overhead vs hf_prefix crop: {overhead['lookup_ms_mean_diff']:+.2f} ms/request; "
            f"extra prefill tokens: {overhead['extra_prefill_tokens_mean']:+.1f}/request"
        )
    print(f"attention backend: {summary['attention'].get('backend')}, kernel calls: {summary['attention'].get('kernel_calls')}")
    print(f"results: {out}")
    return summary
