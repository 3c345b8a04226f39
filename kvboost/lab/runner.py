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

from kvboost.build import build_engine
from kvboost.engine import InferenceEngine
from kvboost.lab.accuracy_table import add_accuracy_by_reuse, format_accuracy_table
from kvboost.lab.config_check import check_config, split_workload_config
from kvboost.lab.environment import describe_environment
from kvboost.lab.fidelity import field_means, fidelity_fields, recompute_fraction, reference_answer
from kvboost.lab.loggers import build_logger
from kvboost.lab.modes import MODES
from kvboost.lab.report import explain_hf_prefix, format_overhead, format_table, plot_summary, summarize, write_summary
from kvboost.lab.run_control import RecordSink, RunEstimate, RunInterrupted, interruptible
from kvboost.lab.workloads import WORKLOADS
from kvboost.lab.workloads.base import Request, WorkloadEnv
from kvboost.models.compute import describe as describe_compute
from kvboost.models.gguf_weights import weight_format_counts
from kvboost.quality import capture_teacher_forced, compare_generations
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


def quality_fields(reference: GenerationResult, result: GenerationResult) -> dict[str, Any]:
    """A record's quality fields against the reference (greedy match, first-token KL, divergence, logit
    difference, and the answer log-probability delta where both scored an answer)."""
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
    parts = ("tokenize_ms", "lookup_ms", "assemble_ms", "prefill_ms", "store_ms", "prefill_tokens", "cached_tokens",
             "content_ratio")
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
            # what each side reused: the difference above is only overhead where these agree
            "kvboost_cached_tokens_mean": k.get("cached_tokens_mean"),
            "hf_prefix_cached_tokens_mean": h.get("cached_tokens_mean"),
            "kvboost_content_ratio_mean": k.get("content_ratio_mean"),
            "kvboost_lookup_assemble_ms_mean": k.get("lookup_ms_mean", 0.0) + k.get("assemble_ms_mean", 0.0),
            "prefill_ms_mean_diff": k.get("prefill_ms_mean", 0.0) - h.get("prefill_ms_mean", 0.0),
        }
    return out


def _warm_up(engine: InferenceEngine, runners: dict[str, Any], max_len: int, max_new_tokens: int = 0) -> dict[str, float]:
    """Kernels, not the cache: one unrelated request per mode, kernel tuning for the run's lengths, then forget.

    A progress bar shows the steps (attention kernels, the decode step's compilation, each mode's request):
    with ``attn=triton`` on a CPU each step runs under Triton's interpreter and takes minutes."""
    cfg = engine.model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    steps = ["attention kernels", "decode step", *(f"{mode} request" for mode in runners)]
    seconds: dict[str, float] = {}
    with tqdm(total=len(steps), desc="warm-up", unit="step") as bar:
        bar.set_postfix_str(steps[0])
        engine.attention.warmup(
            num_q_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim, dtype=engine.adapter.dtype, device=engine.adapter.device, max_len=max_len,
        )  # fmt: skip
        bar.update(1)
        bar.set_postfix_str(steps[1])
        # compiles the decode step, and on CUDA captures the graphs of the run's lengths (summary run.decode_compile_s)
        engine.warmup(max_tokens=max_len + max_new_tokens)
        bar.update(1)
        for mode, runner in runners.items():
            bar.set_postfix_str(f"{mode} request")
            start = time.perf_counter()
            runner.generate(WARMUP_MESSAGES, 4)
            seconds[mode] = time.perf_counter() - start
            bar.update(1)
    for runner in runners.values():
        runner.reset()
    return seconds


def run_experiment(
    cfg: Any, *, out_dir: str | Path, model: Any = None, tokenizer: Any = None, run_info: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run the configured workload in every mode; write records, summary and plots into ``out_dir``.

    ``run_info``: how the run was launched (``run.py`` passes Hydra's overrides, experiment name and sweep
    folder); it goes into ``summary["run"]`` and names the W&B run.

    ``records.jsonl`` grows as requests finish. Interrupted (Ctrl-C, or SIGTERM in the main thread), the run
    writes ``summary.json`` and prints the table of what finished (``summary["run"]["interrupted"]``), then
    raises :class:`~kvboost.lab.run_control.RunInterrupted` (a KeyboardInterrupt).
    """
    cfg = _plain(cfg)
    check_config(cfg)  # before any model is loaded: a typo or a bad value fails now, naming the field
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seed = int(cfg.get("seed", 0))
    torch.manual_seed(seed)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))

    with interruptible():
        try:
            t_load = time.perf_counter()
            engine = build_engine(cfg, model, tokenizer)
            load_s = time.perf_counter() - t_load
        except KeyboardInterrupt as exc:  # nothing measured yet: nothing to summarise
            raise RunInterrupted(getattr(exc, "signal_name", "SIGINT"), out) from None
        try:
            return _run(engine, cfg, out, load_s=load_s, seed=seed, run_info=dict(run_info or {}))
        finally:  # a failed run still gives the caller's model back as it was (attention uninstalled)
            engine.close()


def _interpreted_triton(cfg: dict[str, Any], engine: InferenceEngine) -> bool:
    attn = cfg.get("attn") or "sdpa"
    name = attn if isinstance(attn, str) else dict(attn).get("name")
    return name == "triton" and engine.adapter.device.type != "cuda"


def _run(
    engine: InferenceEngine, cfg: dict[str, Any], out: Path, *, load_s: float, seed: int, run_info: dict[str, Any]
) -> dict[str, Any]:
    workload_name, workload_fields, modes, repeats = split_workload_config(cfg)
    env = WorkloadEnv(tokenizer=engine.tokenizer, count_tokens=lambda prompt: len(engine.tokenize(prompt)))
    workload = WORKLOADS.build({"name": workload_name, **workload_fields}, env=env)
    runners = {mode: MODES.get(mode)(engine) for mode in modes}
    max_new_tokens = int(workload.max_new_tokens)
    sink = RecordSink(out / "records.jsonl")
    records: list[dict[str, Any]] = []
    shared: list[str] = []
    state: dict[str, Any] = {"shared_s": 0.0}
    batched = getattr(workload, "batched", False)
    total = workload.num_requests_upper_bound()
    estimate = RunEstimate(
        requests=total, modes=modes, repeats=repeats, smaller=workload.smaller_overrides,
        overrides=run_info.get("overrides"), interpreted_triton=_interpreted_triton(cfg, engine), emit=tqdm.write,
    )  # fmt: skip
    try:
        if cfg.get("warmup", True):
            estimate.warmup(_warm_up(engine, runners, max_len=int(workload_fields.get("max_prompt_tokens") or 4096),
                                     max_new_tokens=max_new_tokens))  # fmt: skip
        engine.attention.reset_stats()
        engine.reseed()
        shared = workload.shared_context()
        t_shared = time.perf_counter()
        for text in shared:  # declared shared context (invariant 5): stored before timing, never a measured prompt
            for runner in runners.values():
                runner.warm(text)
        state["shared_s"] = time.perf_counter() - t_shared
        logger = build_logger(cfg.get("logger"), out_dir=out, config=cfg, run_info=run_info)
        state["logger"] = logger
        order_rng = random.Random(seed)
        progress = tqdm(total=total * len(modes) * repeats, desc=workload_name, unit="req")
        try:
            if batched:
                _run_batched(workload, runners, modes, repeats, max_new_tokens, order_rng, logger, progress,
                             records, sink)  # fmt: skip
            else:
                _run_requests(workload, runners, modes, repeats, max_new_tokens, order_rng, logger, progress,
                              records, sink, estimate, engine=engine)  # fmt: skip
        finally:
            progress.close()
    except KeyboardInterrupt as exc:
        signal_name = getattr(exc, "signal_name", "SIGINT")
        interrupted = {"signal": signal_name, "records": len(records),
                       "requests": len({r["request_id"] for r in records})}  # fmt: skip
        tqdm.write(f"interrupted ({signal_name}): writing the summary of {interrupted['records']} finished record(s)")
        _finish(engine, cfg, out, records, workload_name, workload, modes, repeats, shared, load_s=load_s,
                state=state, run_info=run_info, interrupted=interrupted)  # fmt: skip
        raise RunInterrupted(signal_name, out) from None
    return _finish(engine, cfg, out, records, workload_name, workload, modes, repeats, shared, load_s=load_s,
                   state=state, run_info=run_info)  # fmt: skip


def _run_requests(workload: Any, runners: dict[str, Any], modes: list[str], repeats: int, max_new_tokens: int,
                  order_rng: random.Random, logger: Any, progress: Any, records: list[dict[str, Any]],
                  sink: RecordSink, estimate: RunEstimate, engine: InferenceEngine | None = None) -> None:  # fmt: skip
    """Every request in every mode (shuffled order per request and repeat); each request's records, with quality
    vs the baseline, go to ``records`` and ``records.jsonl`` when its last mode finishes. Interrupted, the modes
    of the request in progress that finished are kept too (``partial_request: true``).

    A workload with ``fidelity_reference`` (``workload=musique``) also gets, per request, the engine's cold full
    prefill's greedy answer as the reference (untimed, not a mode) and each mode's first repeat scored on it
    (:func:`_fidelity_generate`): the record's ``fidelity`` dict."""
    fidelity = bool(getattr(workload, "fidelity_reference", False)) and engine is not None
    num_layers = engine.model.config.get_text_config(decoder=True).num_hidden_layers if fidelity else 0
    reference: tuple[Any, list[int], Any] | None = None
    reference_for_history = "baseline" if "baseline" in modes else modes[0]
    first: dict[str, GenerationResult] = {}
    scored: dict[str, dict[str, Any]] = {}  # mode: its fidelity fields (first repeat)
    pending: list[dict[str, Any]] = []
    request: Request | None = None

    def finish(partial: bool) -> None:
        assert request is not None
        done = []
        for record in pending:
            if record["repeat"] == 0:
                mode = record["mode"]
                if mode != "baseline" and "baseline" in first:
                    record.update(quality_fields(first["baseline"], first[mode]))
                if mode == "kvboost" and "kvboost_cold" in first:
                    # Reuse against the engine's own cold prefill: same kernels, only the reuse differs
                    # (the bf16 exactness question of issue 11, apart from HF-vs-engine arithmetic).
                    record["greedy_match_vs_cold"] = first["kvboost_cold"].output_ids == first[mode].output_ids
                correct = workload.is_correct(request, first[mode].output_text)
                if correct is not None:
                    record["correct"] = correct
                record.update(workload.score(request, first[mode].output_text))  # e.g. f1 (workload=musique)
                if mode in scored:
                    record["fidelity"] = scored[mode]
            if partial:
                record["partial_request"] = True
            done.append(record)
            logger.log_request(record, len(records))
            records.append(record)
        sink.write(done)
        pending.clear()

    try:
        for request in workload.requests():
            first.clear()
            scored.clear()
            for text in workload.request_context(request):  # untimed, before every mode (only kvboost stores)
                for runner in runners.values():
                    runner.warm(text)
            if fidelity and request.score_ids:
                # cold: reads and writes no cache, so it warms nothing a mode then measures (None: EOS first)
                reference = reference_answer(engine, request.prompt, max_new_tokens, list(request.score_ids))
            else:
                reference = None
            for repeat in range(repeats):
                order = list(modes)
                order_rng.shuffle(order)
                for mode in order:
                    start = time.perf_counter()
                    commit = repeat == repeats - 1
                    if reference is not None and repeat == 0:
                        result, scored[mode] = _fidelity_generate(
                            runners[mode], request, max_new_tokens, commit, reference, engine, num_layers)
                    else:
                        result = runners[mode].generate(
                            request.prompt, max_new_tokens, score_ids=request.score_ids if repeat == 0 else None,
                            commit=commit,
                        )  # fmt: skip
                    if repeat == 0:
                        first[mode] = result
                        estimate.add(mode, time.perf_counter() - start, getattr(result, "prompt_tokens", None))
                    pending.append(_record(mode, request, result, repeat))
                    progress.update(1)
            finish(partial=False)
            progress.set_postfix(req=request.request_id[:16])
            workload.record_answer(request, first[reference_for_history].output_text)
    except KeyboardInterrupt:
        if pending:
            finish(partial=True)
        raise


def _fidelity_generate(runner: Any, request: Request, max_new_tokens: int, commit: bool,
                       reference: tuple[Any, list[int], Any], engine: InferenceEngine,
                       num_layers: int) -> tuple[GenerationResult, dict[str, Any]]:  # fmt: skip
    """A mode's timed request of a fidelity run, and its fidelity to the reference (``kvboost.lab.fidelity``).

    The timed request is the mode's own, whole (TTFT from the call to its first token, as in every run), scored
    teacher-forced on the reference answer instead of the gold one (scoring runs after the request, untimed); it
    gives ``answer_kl``, ``first_token_kl`` and the mode's own greedy answer (``greedy_match``, ``f1``). The gold
    answer's log-probability needs a second forward. Run before the timed request it would warm what that
    request measures (a lookup promotes rows between tiers and touches LRU order), and run after a request that
    stored its prompt (``kvboost`` commits its repaired rows) it would read an exact hit of those rows instead of
    the cache the timed request saw. So the timed request runs with ``commit=False`` (it writes nothing; storing
    is not part of TTFT), and the second call, scored on the gold answer, runs after it on the same cache
    contents and does the commit the timed request would have done (same state and greedy ids, so it stores
    what that request would have stored; its ``store_ms`` is recorded as ``fidelity.commit_store_ms``). Without
    a commit it needs only its first token. The timed result's ``answer_logprob`` is then set to the gold one, so
    the fields computed from it (``answer_logprob_delta`` vs ``baseline``) keep their meaning."""
    ref_result, answer, ref_rows = reference
    with capture_teacher_forced() as rows:
        result = runner.generate(request.prompt, max_new_tokens, score_ids=answer, commit=False)
    if len(rows) != 1:
        raise RuntimeError(f"fidelity: {len(rows)} teacher-forced row sets captured for one request, expected 1")
    on_gold = runner.generate(request.prompt, max_new_tokens if commit else 1, score_ids=request.score_ids,
                              commit=commit)  # fmt: skip
    fields = fidelity_fields(ref_result, answer, ref_rows, result, rows[0], on_gold)
    result.extra["reference_answer_logprob"] = result.extra.get("answer_logprob")
    result.extra["answer_logprob"] = fields["gold_logprob"]
    strategy = getattr(getattr(runner, "engine", None), "recompute", None)
    return result, {
        **fields,
        "recompute_fraction": recompute_fraction(result, strategy, num_layers),
        "answer_tokens": len(answer), "reference_text": ref_result.output_text,
        "commit_store_ms": on_gold.store_ms if commit else 0.0,
    }  # fmt: skip


def fidelity_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``summary["fidelity"]``: per mode, the means over its first-repeat records of the fidelity fields
    (``kvboost.lab.fidelity.SUMMARY_FIELDS``: ``f1``, ``f1_ref``, ``answer_kl``, ``first_token_kl``,
    ``greedy_match``, ``gold_logprob_delta``, ``recompute_fraction``), ``n``, and the mode's ``ttft_ms_mean`` /
    ``ttft_ms_p50`` over the same records. Empty when no record has fidelity fields."""
    from statistics import mean, median

    by_mode: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r.get("fidelity"):
            by_mode[r["mode"]].append(r)
    return {mode: {"n": len(rs), **field_means({**r["fidelity"], "f1": r.get("f1"), "f1_ref": r.get("f1_ref")}
                                               for r in rs),
                   "ttft_ms_mean": mean(r["ttft_ms"] for r in rs), "ttft_ms_p50": median(r["ttft_ms"] for r in rs)}
            for mode, rs in by_mode.items()}  # fmt: skip


def _finish(engine: InferenceEngine, cfg: dict[str, Any], out: Path, records: list[dict[str, Any]],
            workload_name: str, workload: Any, modes: list[str], repeats: int, shared: list[str], *, load_s: float,
            state: dict[str, Any], run_info: dict[str, Any], interrupted: dict[str, Any] | None = None,
            ) -> dict[str, Any]:  # fmt: skip
    """Summary, plots, W&B and the printed table of ``records`` (all of them, or what finished before an
    interrupt)."""
    reference_modes = (REFERENCE_MODE,) if REFERENCE_MODE in modes else ()
    summary = summarize(records, baseline_mode="baseline", reference_modes=reference_modes)
    summary["config"] = cfg
    summary["environment"] = describe_environment()
    summary["attention"] = engine.attention.stats()
    summary["cache"] = engine.cache_stats()
    summary["ttft_breakdown"] = _breakdown(records)
    summary["workload"] = {"name": workload_name, **workload.stats()}
    if fidelity := fidelity_summary(records):
        summary["fidelity"] = fidelity
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
        "shared_context_s": state.get("shared_s", 0.0),
        **describe_compute(engine.adapter.dtype, engine.adapter.device, (cfg.get("model") or {}).get("dtype")),
        **engine.decode_info(),
        "lm_head": getattr(engine.model, "_kvboost_lm_head", None) or "model dtype",
        "weight_formats": weight_format_counts(engine.model),  # {format: linears}: gguf_int4:Q4_1, dense:float32...
        "device": str(engine.adapter.device),
        "fingerprint": engine.fingerprint,
        **run_info,
        **({"interrupted": interrupted} if interrupted else {}),
    }
    accuracy_table = add_accuracy_by_reuse(summary, records)  # only when something was scored
    write_summary(summary, out / "summary.json")
    logger = state.get("logger")
    plots = plot_summary(summary, out) if records else []
    if logger is not None:
        logger.log_summary(summary, plots)
    if interrupted:
        print(f"INTERRUPTED ({interrupted['signal']}): the table covers the {interrupted['requests']} request(s) "
              "that finished, in part or whole")  # fmt: skip
    print(format_table(summary))
    if accuracy_table:
        print(format_accuracy_table(accuracy_table))
    for mode, row in (summary.get("fidelity") or {}).items():
        print(f"fidelity of {mode} to the cold full prefill's greedy answer (n={row['n']}): answer KL "
              f"{row['answer_kl']:.3g}, first-token KL {row['first_token_kl']:.3g}, greedy match "
              f"{row['greedy_match']:.0%}, gold log-prob delta {row['gold_logprob_delta']:+.3g}, recompute "
              f"fraction {row['recompute_fraction']:.3f}")  # fmt: skip
    if hf_prefix_note := explain_hf_prefix(summary):
        print(hf_prefix_note)
    overhead = summary["ttft_breakdown"].get("kvboost_overhead_vs_hf_prefix")
    if overhead:
        print(format_overhead(overhead))
    for mode, spec in (summary.get("speculative") or {}).items():
        tpf = spec["tokens_per_target_forward"]
        print(f"speculative ({spec['strategy']}) in {mode}: acceptance {spec['acceptance_rate']:.1%} of "
              f"{spec['drafted_tokens']} drafted, {tpf if tpf is None else round(tpf, 2)} tokens per target forward")
    for mode, by_size in (summary.get("batch") or {}).items():
        print(f"{mode}: generated tokens/s by batch size: "
              + ", ".join(f"{size}: {cell['tokens_per_s']:.1f}" for size, cell in by_size.items()))  # fmt: skip
    print(f"attention backend: {summary['attention'].get('backend')}, kernel calls: {summary['attention'].get('kernel_calls')}")
    print(f"results: {out}")
    if logger is not None:
        logger.finish()  # last: an offline W&B run prints its `wandb sync` line here
    return summary


def _run_batched(workload: Any, runners: dict[str, Any], modes: list[str], repeats: int, max_new_tokens: int,
                 order_rng: random.Random, logger: Any, progress: Any, records: list[dict[str, Any]],
                 sink: RecordSink) -> list[dict[str, Any]]:  # fmt: skip
    """``workload=batch``: each request is a batch of prompts every mode serves in one ``generate_batch`` call
    (modes in a shuffled order per batch and repeat); one record per row, with the batch's wall time and tokens
    per second; rows compared with the baseline's rows (greedy match) where it ran. Rows go to ``records`` and
    ``records.jsonl`` as each batch call finishes."""
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
                        record.update(quality_fields(first["baseline"][i], result))
                    records.append(record)
                    logger.log_request(record, len(records))
                sink.write(records[-len(results):] if results else [])
                progress.update(1)
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
