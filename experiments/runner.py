"""The experiment runner: builds the engine from a config, replays a workload in every mode, writes results.

Importable without Hydra (``run_experiment`` takes a plain dict or an OmegaConf config); ``run.py`` is the
Hydra entry point around it. Outputs, in ``out_dir``:

- ``records.jsonl``: one line per request, mode and repeat;
- ``summary.json``: config, environment, per-mode aggregates with spreads and bootstrap intervals, quality and
  accuracy vs the baseline, attention backend and kernel calls, TTFT breakdown, cache stats;
- plots, and a table printed at the end.

Fairness rules (each a defect when broken): every mode serves the same token ids (the engine's tokenizer);
the mode order is shuffled per request (seeded), so no mode is always first after another's cache traffic;
each mode serves one unrelated warm-up request before timing, and the attention backend tunes its kernels
for the run's lengths then; repeats of a request (``workload.repeats``) leave every mode's state as the first
measurement found it; nothing warms a measured prompt (only the workload's declared shared context).
"""

from __future__ import annotations

import logging
import random
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from experiments.accuracy_table import add_accuracy_by_reuse, format_accuracy_table
from experiments.config_check import check_config, engine_options, split_workload_config
from experiments.environment import describe_environment
from experiments.loggers import build_logger
from experiments.modes import MODES
from experiments.report import format_table, plot_summary, summarize, write_records, write_summary
from experiments.workloads import WORKLOADS
from experiments.workloads.base import Request, WorkloadEnv
from kvboost.engine import InferenceEngine
from kvboost.models.compute import describe as describe_compute
from kvboost.quality import compare_generations
from kvboost.types import GenerationResult

log = logging.getLogger(__name__)

WARMUP_MESSAGES = [{"role": "user", "content": "Warm-up request, not measured: name three colours."}]
REFERENCE_MODE = "kvboost_cold"


def _plain(cfg: Any) -> dict[str, Any]:
    if cfg is None:
        return {}
    if type(cfg).__module__.startswith("omegaconf"):
        from omegaconf import OmegaConf

        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)


def build_engine(cfg: dict[str, Any], model: Any = None, tokenizer: Any = None) -> InferenceEngine:
    """The engine described by ``cfg`` (groups model/chunker/hasher/cache/eviction/recompute/quant/attn).

    ``model``/``tokenizer`` may be given (tests pass tiny random models); otherwise ``cfg.model`` is loaded.
    """
    options = engine_options(cfg)
    lm_head = options.pop("lm_head", None)  # from_pretrained applies it; a random model gets it below
    awq_prefill = options.pop("awq_prefill", None)  # likewise
    if model is not None:
        return InferenceEngine(model, tokenizer, **options)
    model_cfg = dict(cfg.get("model") or {})
    if model_cfg.get("random_init"):
        from kvboost.models.loading import random_model_and_tokenizer

        model, tokenizer, identity = random_model_and_tokenizer(
            dict(model_cfg["random_init"]), seed=int(model_cfg.get("random_seed") or 0),
            dtype=model_cfg.get("dtype", "float32"), device=model_cfg.get("device"),
        )  # fmt: skip
        from kvboost.models.awq import set_awq_prefill
        from kvboost.models.int8_head import quantize_lm_head

        quantize_lm_head(model, lm_head)
        set_awq_prefill(model, awq_prefill)
        return InferenceEngine(model, tokenizer, model_identity=identity, **options)
    return InferenceEngine.from_pretrained(
        model_cfg.get("name_or_path"), dtype=model_cfg.get("dtype", "float32"), device=model_cfg.get("device"),
        lm_head=lm_head, awq_prefill=awq_prefill, **options,
    )  # fmt: skip


def _quality(reference: GenerationResult, result: GenerationResult) -> dict[str, Any]:
    check = compare_generations("", reference, result)
    out: dict[str, Any] = {
        "greedy_match": check.greedy_match,
        "first_token_kl": check.first_token_kl,
        "first_divergence": check.first_divergence,
        "max_abs_logit_diff": check.max_abs_logit_diff,
    }
    if "answer_logprob" in result.extra and "answer_logprob" in reference.extra:
        out["answer_logprob_delta"] = result.extra["answer_logprob"] - reference.extra["answer_logprob"]
    return out


def _breakdown(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean TTFT components per mode, and kvboost's per-request overhead over hf_prefix."""
    parts = ("tokenize_ms", "lookup_ms", "assemble_ms", "prefill_ms", "store_ms", "prefill_tokens")
    by_mode: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for p in parts:
            if isinstance(r.get(p), (int, float)) and not isinstance(r.get(p), bool):
                by_mode[r["mode"]][p].append(float(r[p]))
    out: dict[str, Any] = {
        mode: {f"{p}_mean": sum(v) / len(v) for p, v in values.items() if v} for mode, values in by_mode.items()
    }
    if "kvboost" in out and "hf_prefix" in out:
        k, h = out["kvboost"], out["hf_prefix"]
        out["kvboost_overhead_vs_hf_prefix"] = {
            # Chunking, hashing, lookup and assembly vs cropping a carried cache.
            "lookup_ms_mean_diff": k.get("lookup_ms_mean", 0.0) + k.get("assemble_ms_mean", 0.0)
            - h.get("lookup_ms_mean", 0.0),
            "extra_prefill_tokens_mean": k.get("prefill_tokens_mean", 0.0) - h.get("prefill_tokens_mean", 0.0),
        }
    return out


def _warm_up(engine: InferenceEngine, runners: dict[str, Any], max_len: int, max_new_tokens: int = 0) -> None:
    """Kernels, not the cache: one unrelated request per mode, kernel tuning for the run's lengths, then forget."""
    cfg = engine.model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    engine.attention.warmup(
        num_q_heads=cfg.num_attention_heads, num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        head_dim=head_dim, dtype=engine.adapter.dtype, device=engine.adapter.device, max_len=max_len,
    )  # fmt: skip
    # compiles the decode step, and on CUDA captures the graphs of the run's lengths (summary run.decode_compile_s)
    engine.warmup(max_tokens=max_len + max_new_tokens)
    for runner in runners.values():
        runner.generate(WARMUP_MESSAGES, 4)
    for runner in runners.values():
        runner.reset()


def run_experiment(
    cfg: Any, *, out_dir: str | Path, model: Any = None, tokenizer: Any = None, run_info: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run the configured workload in every mode; write records, summary and plots into ``out_dir``.

    ``run_info``: how the run was launched (``run.py`` passes Hydra's overrides, experiment name and sweep
    folder); it goes into ``summary["run"]`` and names the W&B run.
    """
    cfg = _plain(cfg)
    check_config(cfg)  # before any model is loaded: a typo fails now, naming the field
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seed = int(cfg.get("seed", 0))
    torch.manual_seed(seed)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))

    t_load = time.perf_counter()
    engine = build_engine(cfg, model, tokenizer)
    load_s = time.perf_counter() - t_load
    try:
        return _run(engine, cfg, out, load_s=load_s, seed=seed, run_info=dict(run_info or {}))
    finally:  # a failed run still gives the caller's model back as it was (attention uninstalled)
        engine.close()


def _run(
    engine: InferenceEngine, cfg: dict[str, Any], out: Path, *, load_s: float, seed: int, run_info: dict[str, Any]
) -> dict[str, Any]:
    workload_name, workload_fields, modes, repeats = split_workload_config(cfg)
    env = WorkloadEnv(tokenizer=engine.tokenizer, count_tokens=lambda prompt: len(engine.tokenize(prompt)))
    workload = WORKLOADS.build({"name": workload_name, **workload_fields}, env=env)
    runners = {mode: MODES.get(mode)(engine) for mode in modes}
    max_new_tokens = int(workload.max_new_tokens)

    if cfg.get("warmup", True):
        _warm_up(engine, runners, max_len=int(workload_fields.get("max_prompt_tokens") or 4096),
                 max_new_tokens=max_new_tokens)
    engine.attention.reset_stats()
    engine.reseed()
    shared = workload.shared_context()
    t_shared = time.perf_counter()
    for text in shared:  # declared shared context (invariant 5): stored before timing, never a measured prompt
        for runner in runners.values():
            runner.warm(text)
    shared_s = time.perf_counter() - t_shared

    logger = build_logger(cfg.get("logger"), out_dir=out, config=cfg, run_info=run_info)
    order_rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    reference_for_history = "baseline" if "baseline" in modes else modes[0]
    progress = tqdm(total=workload.num_requests_upper_bound() * len(modes) * repeats, desc=workload_name, unit="req")
    step = 0
    if getattr(workload, "batched", False):
        records = _run_batched(workload, runners, modes, repeats, max_new_tokens, order_rng, logger, progress)
    try:
        for request in ([] if getattr(workload, "batched", False) else workload.requests()):
            first: dict[str, GenerationResult] = {}
            pending: list[dict[str, Any]] = []
            for repeat in range(repeats):
                order = list(modes)
                order_rng.shuffle(order)
                for mode in order:
                    result = runners[mode].generate(
                        request.prompt, max_new_tokens, score_ids=request.score_ids if repeat == 0 else None,
                        commit=repeat == repeats - 1,
                    )  # fmt: skip
                    if repeat == 0:
                        first[mode] = result
                    pending.append(_record(mode, request, result, repeat))
                    progress.update(1)
            for record in pending:
                if record["repeat"] == 0:
                    mode = record["mode"]
                    if mode != "baseline" and "baseline" in first:
                        record.update(_quality(first["baseline"], first[mode]))
                    if mode == "kvboost" and "kvboost_cold" in first:
                        # Reuse against the engine's own cold prefill: same kernels, only the reuse differs
                        # (the bf16 exactness question of issue 11, apart from HF-vs-engine arithmetic).
                        record["greedy_match_vs_cold"] = first["kvboost_cold"].output_ids == first[mode].output_ids
                    correct = workload.is_correct(request, first[mode].output_text)
                    if correct is not None:
                        record["correct"] = correct
                records.append(record)
                logger.log_request(record, step)
                step += 1
            progress.set_postfix(req=request.request_id[:16])
            workload.record_answer(request, first[reference_for_history].output_text)
    finally:
        progress.close()

    write_records(records, out / "records.jsonl")
    reference_modes = (REFERENCE_MODE,) if REFERENCE_MODE in modes else ()
    summary = summarize(records, baseline_mode="baseline", reference_modes=reference_modes)
    summary["config"] = cfg
    summary["environment"] = describe_environment()
    summary["attention"] = engine.attention.stats()
    summary["cache"] = engine.cache_stats()
    summary["ttft_breakdown"] = _breakdown(records)
    summary["workload"] = {"name": workload_name, **workload.stats()}
    if getattr(workload, "batched", False):
        summary["batch"] = _batch_summary(records)
    summary["run"] = {
        "model_load_s": load_s,
        "requests": len({r["request_id"] for r in records}),
        "records": len(records),
        "modes": modes,
        "repeats": repeats,
        "mode_order": "shuffled per request and repeat (seeded)",
        "shared_context_items": len(shared),
        "shared_context_s": shared_s,
        **describe_compute(engine.adapter.dtype, engine.adapter.device, (cfg.get("model") or {}).get("dtype")),
        **engine.decode_info(),
        "lm_head": getattr(engine.model, "_kvboost_lm_head", None) or "model dtype",
        "device": str(engine.adapter.device),
        "fingerprint": engine.fingerprint,
        **run_info,
    }
    accuracy_table = add_accuracy_by_reuse(summary, records)  # only when something was scored
    write_summary(summary, out / "summary.json")
    plots = plot_summary(summary, out)
    logger.log_summary(summary, plots)
    print(format_table(summary))
    if accuracy_table:
        print(format_accuracy_table(accuracy_table))
    overhead = summary["ttft_breakdown"].get("kvboost_overhead_vs_hf_prefix")
    if overhead:
        print(
            f"kvboost lookup+assembly overhead vs hf_prefix crop: {overhead['lookup_ms_mean_diff']:+.2f} ms/request; "
            f"extra prefill tokens: {overhead['extra_prefill_tokens_mean']:+.1f}/request"
        )
    for mode, spec in (summary.get("speculative") or {}).items():
        tpf = spec["tokens_per_target_forward"]
        print(f"speculative ({spec['strategy']}) in {mode}: acceptance {spec['acceptance_rate']:.1%} of "
              f"{spec['drafted_tokens']} drafted, {tpf if tpf is None else round(tpf, 2)} tokens per target forward")
    for mode, by_size in (summary.get("batch") or {}).items():
        print(f"{mode}: generated tokens/s by batch size: "
              + ", ".join(f"{size}: {cell['tokens_per_s']:.1f}" for size, cell in by_size.items()))  # fmt: skip
    print(f"attention backend: {summary['attention'].get('backend')}, kernel calls: {summary['attention'].get('kernel_calls')}")
    print(f"results: {out}")
    logger.finish()  # last: an offline W&B run prints its `wandb sync` line here
    return summary


def _run_batched(workload: Any, runners: dict[str, Any], modes: list[str], repeats: int, max_new_tokens: int,
                 order_rng: random.Random, logger: Any, progress: Any) -> list[dict[str, Any]]:  # fmt: skip
    """``workload=batch``: each request is a batch of prompts every mode serves in one ``generate_batch`` call
    (modes in a shuffled order per batch and repeat); one record per row, with the batch's wall time and tokens
    per second; rows compared with the baseline's rows (greedy match) where it ran."""
    records: list[dict[str, Any]] = []
    for request in workload.requests():
        first: dict[str, list[GenerationResult]] = {}
        for repeat in range(repeats):
            order = list(modes)
            order_rng.shuffle(order)
            for mode in order:
                with _eos_ignored(runners, workload.ignore_eos):
                    start = time.perf_counter()
                    results = runners[mode].generate_batch(request.prompt, max_new_tokens)
                    batch_ms = (time.perf_counter() - start) * 1e3
                if repeat == 0:
                    first[mode] = results
                tokens = sum(r.generated_tokens for r in results)
                for i, result in enumerate(results):
                    row = Request(f"{request.request_id}/{i}", request.conversation_id, request.turn, None,
                                  info=dict(request.info))  # fmt: skip
                    record = _record(mode, row, result, repeat)
                    record.update(batch_ms=batch_ms, batch_tokens_per_s=tokens / batch_ms * 1e3)
                    if repeat == 0 and mode != "baseline" and "baseline" in first:
                        record.update(_quality(first["baseline"][i], result))
                    records.append(record)
                    logger.log_request(record, len(records))
                progress.update(1)
    progress.close()
    return records


def _batch_summary(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per mode and batch size: generated tokens per second of the batch call (median over repeats) and its wall
    time."""
    from statistics import median

    out: dict[str, dict[str, dict[str, float]]] = {}
    calls: dict[tuple[str, int], dict[int, tuple[float, float]]] = {}
    for r in records:
        calls.setdefault((r["mode"], int(r["batch_size"])), {})[r["repeat"]] = (r["batch_tokens_per_s"], r["batch_ms"])
    for (mode, size), by_repeat in sorted(calls.items()):
        rates, times = zip(*by_repeat.values(), strict=True)
        out.setdefault(mode, {})[str(size)] = {"tokens_per_s": median(rates), "batch_ms": median(times),
                                              "repeats": len(rates)}  # fmt: skip
    return out


class _eos_ignored:  # noqa: N801 - a context manager used like a function
    """While active (``ignore``), the engine and the HF modes stop only at ``max_new_tokens``."""

    def __init__(self, runners: dict[str, Any], ignore: bool) -> None:
        self.targets = [t for r in runners.values() for t in (getattr(r, "engine", None), getattr(r, "runner", None))
                        if t is not None and hasattr(t, "eos_ids")] if ignore else []  # fmt: skip
        self.saved: list[set[int]] = []

    def __enter__(self) -> None:
        self.saved = [t.eos_ids for t in self.targets]
        for t in self.targets:
            t.eos_ids = set()

    def __exit__(self, *exc: object) -> None:
        for t, ids in zip(self.targets, self.saved, strict=True):
            t.eos_ids = ids


def _record(mode: str, request: Request, result: GenerationResult, repeat: int) -> dict[str, Any]:
    return {
        **result.metrics(),
        "mode": mode,
        "request_id": request.request_id,
        "conversation_id": request.conversation_id,
        "turn": request.turn,
        "repeat": repeat,
        "output_text": result.output_text,
        **request.info,
    }
