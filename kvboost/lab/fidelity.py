"""Teacher-forced fidelity of content-reuse strategies on ``workload=musique`` (issue 59).

A reuse method's job is to give the answer the full prefill gives, so fidelity to the full prefill is the primary
measure and gold-answer F1 the second. Per question (:func:`measure_question`):

1. the question's passages are cached once, as the workload's layout encodes them (``request_context``); every
   arm reads these same rows and writes nothing (``store=False``), so the encodings are shared by all arms;
2. the **reference**: the engine's cold full prefill (``mode="cold"``: cache neither read nor written), greedy,
   ``max_new_tokens`` (32) tokens; its answer is what every arm is scored on, teacher-forced, and its
   log-distributions over that answer are the reference's (one more cold call, ``score_ids`` = the answer);
3. each **arm** (a recompute strategy) serves the prompt from the cache, greedy, scored teacher-forced on the
   reference answer (its own greedy answer comes from the same call), then once more scored on the gold answer.

Per (question, arm) record: ``answer_kl`` (mean over the reference answer's tokens of KL(full || arm)),
``first_token_kl``, ``greedy_match`` (the arm's greedy answer equals the reference's token for token),
``gold_logprob_delta`` (the arm's log p(gold answer) minus the full prefill's), ``f1`` (SQuAD) and ``f1_ref``
(the reference code's), ``recompute_fraction`` (:func:`recompute_fraction`), TTFT, and what produced it
(commit, composed-config hash, machine kind, model). The ``full`` arm (recompute every reused row) is the control:
it runs the reuse path but recomputes everything, so its fidelity reads zero up to the dtype's rounding (fp32:
KL ~1e-10); ``none`` (reuse as cached) is the floor.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvboost.quality import answer_fidelity, capture_teacher_forced

#: the control arm (every reused row recomputed) and the floor (no recompute): in every run
CONTROL_ARM, FLOOR_ARM = "full", "none"
#: the means ``summary.json`` gives per arm (besides TTFT)
SUMMARY_FIELDS = ("f1", "f1_ref", "answer_kl", "first_token_kl", "greedy_match", "gold_logprob_delta",
                  "recompute_fraction")  # fmt: skip
#: what identifies a record for resuming: the same (question, arm, layout, model) is not measured again
RESUME_KEY = ("question", "arm", "layout", "model")


def recompute_fraction(result: Any, strategy: Any, num_layers: int) -> float:
    """Work a strategy spent recomputing reused rows, as a fraction of a full prefill's ``prompt_tokens x layers``.

    Counted: the (token, layer) pairs of cached rows the prefill recomputed at every layer, check layers
    included (the engine's ``recompute_ratio``, which already counts a whole prefill for strategies that run one to
    decide, ``full_prefill_cost``), plus the reader probe of a query-aware strategy (``needs_reader_attention``): it
    runs the new tokens through layers ``0..max(reader_layers)`` before the real pass computes them again, so
    those rows count as recomputed too, less the ones the prefill kept from it (``probe_kept_tokens``). The new
    tokens every arm computes once (the question) are not counted: ``none`` reads 0.
    """
    n = int(result.prompt_tokens)
    if n <= 0 or num_layers <= 0:
        raise ValueError(f"recompute_fraction: prompt_tokens ({n}) and num_layers ({num_layers}) must be positive")
    pairs = float(result.recompute_ratio) * n * num_layers
    extra = result.extra or {}
    if "probe_ms" in extra and getattr(strategy, "needs_reader_attention", False):
        probe_layers = max(strategy.reader_layers(num_layers)) + 1
        new_tokens = n - int(result.cached_tokens)
        pairs += max(0, new_tokens - int(extra.get("probe_kept_tokens", 0))) * probe_layers
    return pairs / (n * num_layers)


def config_hash(cfg: Mapping[str, Any]) -> str:
    """A short sha256 of a composed config (keys sorted): records of one setting share it."""
    text = json.dumps(cfg, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def machine_kind() -> str:
    """The CPU model and a summary of its ISA flags (``kvboost.env``), e.g. ``Intel Xeon ... (intel-amx:
    avx2 avx512f amx_bf16 ...)``, and the GPU where one is used."""
    from kvboost.env import cpu_features

    info = cpu_features()
    flags = " ".join(name for name, present in info["flags"].items() if present)
    gpu = f"; gpu {info['cuda']}" if info.get("cuda") else ""
    return f"{info['cpu']} ({info['kind']}: {flags}){gpu}"


def git_commit() -> str | None:
    """The checkout's commit, with ``+dirty`` where tracked files differ from it (None outside git)."""
    import subprocess

    from kvboost.lab.environment import _git_commit

    commit = _git_commit()
    if commit is None:
        return None
    try:
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=Path(__file__).parent,
                                capture_output=True, text=True, timeout=10).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return commit
    return commit + ("+dirty" if status.strip() else "")


def done_keys(records: Iterable[Mapping[str, Any]]) -> set[tuple[Any, ...]]:
    """The :data:`RESUME_KEY` of every record already measured."""
    return {tuple(r.get(k) for k in RESUME_KEY) for r in records}


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of a ``records.jsonl`` (none where it does not exist); a torn last line (an interrupted write)
    is skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def open_records(path: Path) -> Any:
    """``records.jsonl`` opened for appending; a torn last line (a run killed mid-write) is ended first, so the
    next record starts on its own line instead of being glued to it and lost."""
    if path.exists() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, 2)
            torn = f.read(1) != b"\n"
        if torn:
            with open(path, "a") as f:
                f.write("\n")
    return open(path, "a")


def measure_question(engine: Any, workload: Any, request: Any, arms: Mapping[str, Any], *, num_layers: int,
                     context: Mapping[str, Any]) -> list[dict[str, Any]]:  # fmt: skip
    """The records of one question for every arm in ``arms`` (``{label: built strategy}``); ``context`` is
    copied into each (layout, model, commit, machine...). The engine's strategy is left as the last arm's."""
    max_new = int(workload.max_new_tokens)
    engine.reset_cache()
    for text in workload.request_context(request):  # each passage's encoding, once for every arm
        engine.warm(text, chat=False)
    gold = list(request.score_ids or [])
    if not gold:
        raise ValueError(f"question {request.request_id}: its gold answer tokenizes to nothing")
    t0 = time.perf_counter()
    ref = reference_answer(engine, request.prompt, max_new, gold)
    reference_s = time.perf_counter() - t0
    if ref is None:
        raise ValueError(f"question {request.request_id}: the full prefill's greedy answer is empty (EOS first)")
    reference, answer, ref_rows = ref
    records = []
    for label, strategy in arms.items():
        engine.recompute = strategy
        start = time.perf_counter()
        with capture_teacher_forced() as rows:
            result = engine.generate(request.prompt, max_new_tokens=max_new, mode="reuse", score_ids=answer,
                                     store=False)  # fmt: skip
        _check_captured(rows, label)
        on_gold = engine.generate(request.prompt, max_new_tokens=1, mode="reuse", score_ids=gold, store=False)
        seconds = time.perf_counter() - start
        records.append({
            **context, "question": request.request_id, "arm": label,
            **fidelity_fields(reference, answer, ref_rows, result, rows[0], on_gold),
            **workload.score(request, result.output_text),
            "recompute_fraction": recompute_fraction(result, strategy, num_layers),
            "recompute_ratio": result.recompute_ratio, "ttft_ms": result.ttft_ms,
            "reference_ttft_ms": reference.ttft_ms, "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens, "content_ratio": result.content_ratio,
            "answer_tokens": len(answer), "output_text": result.output_text,
            "reference_text": reference.output_text, "reference_f1": workload.score(request, reference.output_text),
            "arm_s": seconds, "reference_s": reference_s,
        })  # fmt: skip
    return records


def reference_answer(engine: Any, prompt: Any, max_new_tokens: int,
                     gold: list[int]) -> tuple[Any, list[int], Any] | None:  # fmt: skip
    """The reference of one question: the engine's cold full prefill (``mode="cold"``: the cache neither read nor
    written, so it warms nothing a measured request then reads), greedy, ``max_new_tokens``, scored on ``gold``
    (its ``answer_logprob``); then one more cold call teacher-forced on that greedy answer, whose
    log-distributions every arm is compared with. Returns ``(result, answer ids, rows [len(answer), vocab])``,
    or None where the greedy answer is empty (EOS first: nothing to score on)."""
    reference = engine.generate(prompt, max_new_tokens=max_new_tokens, mode="cold", score_ids=gold)
    answer = list(reference.output_ids)
    if not answer:
        return None
    with capture_teacher_forced() as rows:
        engine.generate(prompt, max_new_tokens=1, mode="cold", score_ids=answer)
    _check_captured(rows, "the reference")
    return reference, answer, rows[0]


def fidelity_fields(reference: Any, answer: list[int], reference_rows: Any, result: Any, rows: Any,
                    on_gold: Any) -> dict[str, Any]:  # fmt: skip
    """One arm's fidelity to the reference (:func:`reference_answer`): ``answer_kl`` and ``first_token_kl``
    (:func:`~kvboost.quality.answer_fidelity` of its teacher-forced ``rows`` on the reference answer),
    ``greedy_match`` (its own greedy ids, ``result.output_ids``, equal the reference answer), ``gold_logprob``
    (``on_gold``: a call scored on the gold answer) and ``gold_logprob_delta`` (minus the reference's)."""
    gold_logprob = on_gold.extra["answer_logprob"]
    return {**answer_fidelity(reference_rows, rows), "greedy_match": list(result.output_ids) == answer,
            "gold_logprob": gold_logprob, "gold_logprob_delta": gold_logprob - reference.extra["answer_logprob"]}


def field_means(records: Iterable[Mapping[str, Any]]) -> dict[str, float | None]:
    """The mean of each :data:`SUMMARY_FIELDS` over ``records`` (None where no record has it)."""
    from statistics import mean

    rs = list(records)
    out: dict[str, float | None] = {}
    for name in SUMMARY_FIELDS:
        vals = [float(r[name]) for r in rs if r.get(name) is not None]
        out[name] = mean(vals) if vals else None
    return out


def _check_captured(rows: list[Any], who: str) -> None:
    if len(rows) != 1:
        raise RuntimeError(f"fidelity: {len(rows)} teacher-forced row sets captured for {who}, expected 1: the "
                           "engine must step its requests in the calling thread (no EngineLoop driving it)")


def summarize(records: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Per (layout, model) cell and arm: the mean of each :data:`SUMMARY_FIELDS` and the TTFT fields
    (``ttft_ms_mean``, ``ttft_ms_p50``, the reference's ``reference_ttft_ms_p50``), ``seconds_per_question``
    (the arm's two calls) and ``n`` (questions)."""
    from statistics import mean, median

    cells: dict[str, dict[str, list[Mapping[str, Any]]]] = {}
    for r in records:
        cells.setdefault(f"{r['layout']}__{r['model']}", {}).setdefault(r["arm"], []).append(r)
    out: dict[str, Any] = {}
    for cell, by_arm in cells.items():
        out[cell] = {}
        for arm, rs in by_arm.items():
            row: dict[str, Any] = {"n": len(rs), **field_means(rs)}
            row["ttft_ms_mean"] = mean(r["ttft_ms"] for r in rs)
            row["ttft_ms_p50"] = median(r["ttft_ms"] for r in rs)
            row["reference_ttft_ms_p50"] = median(r["reference_ttft_ms"] for r in rs)
            row["seconds_per_question"] = mean(r["arm_s"] for r in rs)
            out[cell][arm] = row
    return out
