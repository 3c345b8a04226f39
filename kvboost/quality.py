"""Quality of a generation against a reference (a cold prefill of the same prompt).

Used by ``verify_correctness``, the runner's per-request quality fields and the accuracy workloads:
greedy match and first divergence, first-token KL, and teacher-forced log-probability of a known answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvboost.lookup import common_prefix_length
from kvboost.types import GenerationResult, PromptCheck


def first_token_kl(p_logits: torch.Tensor | None, q_logits: torch.Tensor | None) -> tuple[float, float]:
    """KL(softmax(p) || softmax(q)) in float64 and the max abs logit difference (NaN when either is missing)."""
    if p_logits is None or q_logits is None:
        return float("nan"), float("nan")
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    kl = float(torch.sum(p.exp() * (p - q)).clamp_min(0.0))
    return kl, float((p_logits.double() - q_logits.double()).abs().max())


def compare_generations(prompt: Any, reference: GenerationResult, candidate: GenerationResult) -> PromptCheck:
    """Quality of ``candidate`` against ``reference`` (same prompt): greedy match, KL, divergence."""
    ref_ids, cand_ids = reference.output_ids, candidate.output_ids
    divergence = common_prefix_length(ref_ids, cand_ids)
    first_divergence = None if divergence == len(ref_ids) == len(cand_ids) else divergence
    kl, max_diff = first_token_kl(reference.first_token_logits, candidate.first_token_logits)
    return PromptCheck(
        prompt=prompt if isinstance(prompt, str) else repr(prompt)[:200],
        greedy_match=first_divergence is None,
        first_token_kl=kl,
        first_divergence=first_divergence,
        reuse_ratio=candidate.kv_reuse_ratio,
        max_abs_logit_diff=max_diff,
    )


def continuation_logprob(
    first_logits: torch.Tensor, answer_ids: Sequence[int], forward: Callable[[list[int]], torch.Tensor]
) -> float:
    """Teacher-forced log p(answer | prompt), natural log, summed over the answer's tokens.

    ``first_logits`` are the logits after the prompt (they score the answer's first token);
    ``forward(tokens)`` runs ``tokens`` after the prompt over the request's cache and returns their logits
    ``[len(tokens), vocab]`` (they score the answer's next tokens).
    """
    if not answer_ids:
        raise ValueError("continuation_logprob needs at least one answer token")
    total = float(torch.log_softmax(first_logits.double(), -1)[answer_ids[0]])
    if len(answer_ids) > 1:
        logits = forward(list(answer_ids[:-1])).double()
        logp = torch.log_softmax(logits, -1)
        total += float(logp[torch.arange(len(answer_ids) - 1), torch.tensor(answer_ids[1:])].sum())
    return total


def verify_correctness(
    engine: Any, prompts: Sequence[Any] | None = None, *, max_new_tokens: int = 16, prefix_fraction: float = 0.6,
    kl_tolerance: float = 1e-4,
) -> Any:  # fmt: skip
    """Check that exact reuse reproduces a cold prefill, prompt by prompt.

    For each prompt: a ``cold`` generation; then, in a scratch store (the engine's own cache is left untouched),
    the first ``prefix_fraction`` of its tokens is stored and the prompt is generated with ``reuse`` (exact hits, a
    frontier partial hit, a suffix prefill, the configured quantizer and strategy). Compared: greedy tokens,
    first-token KL(cold || reuse), first divergence, max abs logit difference.
    """
    from kvboost.cache.store import KVStore
    from kvboost.registry import CACHE_TIERS
    from kvboost.types import CorrectnessReport

    prompts = list(prompts) if prompts is not None else list(DEFAULT_VERIFY_PROMPTS)
    if not prompts:
        raise ValueError("verify_correctness needs at least one prompt")
    saved_store, saved_counters = engine.store, (engine._requests, engine._prompt_tokens, engine._cached_tokens)
    checks = []
    try:
        for prompt in prompts:
            engine.store = KVStore([CACHE_TIERS.build({"name": "memory", "capacity": "4GiB"})])
            try:
                cold = engine.generate(prompt, max_new_tokens=max_new_tokens, mode="cold")
                ids = cold.prompt_ids
                cut = max(1, int(len(ids) * prefix_fraction))
                engine.warm(ids[:cut])
                warm = engine.generate(ids, max_new_tokens=max_new_tokens, mode="reuse")
                checks.append(compare_generations(prompt, cold, warm))
            finally:
                engine.store.clear()  # its entries' pool blocks go back
    finally:
        engine.store = saved_store
        engine._requests, engine._prompt_tokens, engine._cached_tokens = saved_counters
    return CorrectnessReport(checks=checks, kl_tolerance=kl_tolerance)


DEFAULT_VERIFY_PROMPTS = (
    "The quick brown fox jumps over the lazy dog. " * 6 + "Write one sentence about foxes.",
    "You are a helpful assistant. Answer briefly and precisely.\n\nQuestion: what is the boiling point of water "
    "at sea level, in degrees Celsius and Fahrenheit? Explain why it changes with altitude.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "# Explain what this function returns for n = 10 and why.\n",
)
