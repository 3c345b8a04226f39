"""A request in flight (:class:`Request`) and the batched decode step every generation path shares.

``generate`` runs one request, ``generate_batch`` many: their prompts' prefills, then one decode forward per step
for every running row (:func:`decode_step`); a row that reaches end-of-sequence, its ``max_new_tokens`` or the
model's context leaves the batch. Each row samples with its own settings and generator, so a row's tokens do not
depend on which other rows share its forwards (greedy rows: the same tokens as alone, up to the arithmetic of a
batched GEMM; exactly under ``attn=batch_invariant``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvboost.decoding import Sampling, pick_token
from kvboost.generation import PhaseClock, ReuseCounts
from kvboost.kv.block_table import BlockTable
from kvboost.plan import ReusePlan
from kvboost.runtime.batch import ForwardBatch, SeqInput
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


def decode_step(runner: Any, requests: list[Request], eos_ids: set[int], max_positions: int | None) -> None:
    """One decode forward for every running request: each feeds its last token (not yet in its cache) and gets
    its next one."""
    running = [r for r in requests if not r.done]
    if not running:
        return
    batch = ForwardBatch.build([SeqInput(r.table, [r.tokens[-1]]) for r in running])
    logits = runner.run(batch)
    for row, request in enumerate(running):
        request.accept(pick_token(logits[row], request.sampling, request.generator), eos_ids, max_positions)
