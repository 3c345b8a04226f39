"""What every generate() shares, in the engine and in the HF baselines: phase timing and the result.

TTFT runs from the call (prompt in) to the first token id (DESIGN.md invariant 4). On CUDA the clock is read
after a device synchronisation at every phase boundary, so each phase owns the kernels it launched (without
it, lookup_ms would look free and prefill_ms would absorb its queued work).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvboost.decoding import DecodeOutput
from kvboost.types import GenerationResult


class PhaseClock:
    """Marks named instants; ``ms(a, b)`` is the time between two marks in milliseconds."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self._cuda = torch.device(device).type == "cuda" if device is not None else False
        self.marks: dict[str, float] = {}
        self.mark("start")

    def fork(self) -> PhaseClock:
        """A clock with this one's marks so far (each row of a batch has its own, started when the batch was)."""
        clock = PhaseClock.__new__(PhaseClock)
        clock._cuda, clock.marks = self._cuda, dict(self.marks)
        return clock

    def mark(self, name: str) -> float:
        if self._cuda:
            torch.cuda.synchronize()
        self.marks[name] = now = time.perf_counter()
        return now

    def ms(self, start: str, end: str) -> float:
        return (self.marks[end] - self.marks[start]) * 1e3


@dataclass
class ReuseCounts:
    """How a prompt's tokens were served: from cache (exact / content) and what was recomputed."""

    cached_tokens: int = 0
    exact_tokens: int = 0
    content_tokens: int = 0
    recomputed_pairs: int = 0  # (token, layer) pairs computed again although the cache had them
    extra: dict[str, Any] = field(default_factory=dict)


def build_result(
    *,
    tokenizer: Any,
    mode: str,
    ids: list[int],
    decoded: DecodeOutput,
    first_logits: torch.Tensor,
    clock: PhaseClock,
    counts: ReuseCounts,
    num_layers: int,
    store_ms: float = 0.0,
    keep_logits: bool = True,
    extra: dict[str, Any] | None = None,
) -> GenerationResult:
    """The ``GenerationResult`` of one request; ``clock`` needs the marks start, tokenized, first, end.
    ``tokenizer`` None: ``output_text`` is left empty (the engine's frontend decodes it)."""
    out = decoded.token_ids
    n = len(ids)
    return GenerationResult(
        output_text=tokenizer.decode(out, skip_special_tokens=True) if tokenizer is not None else "",
        output_ids=out,
        generated_tokens=len(out),
        ttft_ms=clock.ms("start", "first"),
        total_ms=clock.ms("start", "end"),
        store_ms=store_ms,
        tokens_per_sec=(len(out) - 1) / decoded.decode_seconds if decoded.decode_seconds > 0 else 0.0,
        prompt_tokens=n,
        cached_tokens=counts.cached_tokens,
        kv_reuse_ratio=counts.cached_tokens / n,
        exact_hit_tokens=counts.exact_tokens,
        content_hit_tokens=counts.content_tokens,
        mode=mode,
        recompute_ratio=counts.recomputed_pairs / (n * num_layers),
        prompt_ids=ids,
        first_token_logits=first_logits.detach().float().cpu() if keep_logits else None,
        extra={**counts.extra, **(extra or {})},
    )
