"""A request in flight (:class:`Request`): its prompt, block table, sampling settings and tokens so far.

The scheduler (:mod:`kvboost.serving.core`) runs requests in flat batches; a request that reaches end-of-sequence,
its ``max_new_tokens`` or the model's context leaves. Each request samples with its own settings and generator, so
its tokens do not depend on which others share its forwards (greedy: the same tokens as alone, up to the arithmetic
of a batched GEMM; exactly under ``attn=batch_invariant``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvboost.decoding import Sampling
from kvboost.generation import PhaseClock, ReuseCounts
from kvboost.kv.block_table import BlockTable
from kvboost.plan import ReusePlan
from kvboost.types import ChunkSpan


@dataclass
class Request:
    """One generation: its prompt ids, block table, settings, and what it produced so far."""

    ids: list[int]
    spans: list[ChunkSpan]
    table: BlockTable
    sampling: Sampling
    max_new_tokens: int
    mode: str = "reuse"
    salt: str = ""
    store: bool = True
    generator: torch.Generator | None = None
    clock: PhaseClock | None = None
    plan: ReusePlan | None = None
    counts: ReuseCounts = field(default_factory=ReuseCounts)
    approx_from: int | None = None
    first_logits: torch.Tensor | None = None
    tokens: list[int] = field(default_factory=list)
    done: bool = False
    decode_started: float = 0.0
    decode_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt_len(self) -> int:
        return len(self.ids)

    def accept(self, token: int, eos_ids: set[int], max_positions: int | None) -> None:
        """Append a generated token and decide whether the request stops (the rules of ``decode_loop``: EOS,
        ``max_new_tokens``, the model's context)."""
        self.tokens.append(token)
        if (
            len(self.tokens) >= self.max_new_tokens
            or token in eos_ids
            or (max_positions is not None and self.prompt_len + len(self.tokens) >= max_positions)
        ):
            self.finish_decoding()

    def start_decoding(self) -> None:
        self.decode_started = time.perf_counter()

    def finish_decoding(self) -> None:
        if not self.done:
            self.done = True
            if self.decode_started:
                self.decode_seconds = time.perf_counter() - self.decode_started
