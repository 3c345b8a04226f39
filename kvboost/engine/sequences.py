"""The one request type of the engine core (:class:`Request`): a prompt, its block table, what is left to compute and
what it produced.

Every forward of the engine belongs to a request that the core schedules (``kvboost.engine.core``):

- ``generate``: prefill (exact hits by reference, content hits repaired), then decode (one row per step, or
  ``k + 1`` rows when a draft strategy proposes ``k`` tokens), then, with ``score_ids``, the teacher-forced rows of a
  known answer;
- ``warm``: prefill only, then store (and pin) the chunks (``engine.warm``);
- ``store``: prefill only, then store (the canonical store of a finished chat turn, ``kvboost.reuse.canonical``).

Each request samples with its own settings and generator, so its tokens do not depend on which others share its
forwards (greedy: the same tokens as alone, up to the arithmetic of a batched GEMM; exactly under
``attn=batch_invariant``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from kvboost.decoding import Sampling, stop_reason
from kvboost.generation import PhaseClock, ReuseCounts
from kvboost.kv.block_table import BlockTable
from kvboost.plan import ReusePlan
from kvboost.types import ChunkSpan

#: What a request is for (see the module docstring).
KINDS = ("generate", "warm", "store")


class Request:
    """One unit of engine work and its state (see the module docstring). Built by the frontend
    (``EngineCore.prepare``), then owned by the engine core's thread."""

    def __init__(self, kind: str, ids: list[int], spans: list[ChunkSpan], table: BlockTable, *,
                 sampling: Sampling | None = None, max_new_tokens: int = 0, mode: str = "reuse", salt: str = "",
                 store: bool = True, pin: bool = False, generator: torch.Generator | None = None,
                 clock: PhaseClock | None = None, handle: Any = None, deadline: float | None = None) -> None:  # fmt: skip
        if kind not in KINDS:
            raise ValueError(f"unknown request kind {kind!r}; use one of {KINDS}")
        self.kind, self.ids, self.spans, self.table = kind, ids, spans, table
        self.sampling = sampling or Sampling()
        self.max_new_tokens, self.mode, self.salt, self.store, self.pin = max_new_tokens, mode, salt, store, pin
        self.generator, self.clock, self.handle, self.deadline = generator, clock or PhaseClock(), handle, deadline
        # reuse and results
        self.plan: ReusePlan | None = None
        self.counts = ReuseCounts()
        self.approx_from: int | None = None
        self.first_logits: torch.Tensor | None = None
        self.tokens: list[int] = []
        self.done = False
        self.decode_started = 0.0
        self.decode_seconds = 0.0
        self.extra: dict[str, Any] = {}
        self.result: Any = None
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.parent: Request | None = None  # a canonical store: the finished request it stores the turn of
        self.cached_prefix = 0
        self.stored_chunks = 0
        # scheduling state
        self.phase = "waiting"  # waiting | prefill | decode | score | finished
        self.fed: list[int] = []  # tokens to run before the next logits (prompt rest, or score rows)
        self.fed_pos = 0
        self.started = False
        self.preempted = False
        self.preemptions = 0
        self.admitted_at = 0
        self.arrival_step = 0
        self.cancelled = False
        self.cancel_reason = "cancelled"
        self.first_token_at: float | None = None
        self.token_times: list[float] = []
        self.keys: list | None = None  # chunk keys (hashed once, for the queue order)
        # options of generate()
        self.keep_logits = False
        self.score_ids: Sequence[int] | None = None
        self.score_logits: list[torch.Tensor] = []
        #: per position of ``score_ids`` (a request with ``logprobs``): the server's prompt logprobs
        self.score_logprobs: list[Any] | None = None
        self.scoring = False  # its decoding is over and its score rows are queued (they stay so across preemption)
        self.messages: list[dict[str, str]] | None = None  # chat messages of the prompt (canonical store)
        self.own_canonical = False  # its caller (generate) stores its canonical turn, not the core's hook
        # OpenAI's n and logprobs (kvboost.serving): the other samples of the prompt, which fork this request's blocks
        # once it is prefilled (not scheduled before); top alternatives to report per token (None: no logprobs)
        self.forks: list[Request] = []
        self.sample_index = 0
        self.logprobs: int | None = None
        self.token_logprobs: list[Any] = []
        # speculative decoding (a per-request copy of the engine's draft strategy)
        self.draft: Any = None
        self.draft_length: Any = None
        self.spec_stats: Any = None
        self.proposal: Any = None

    def __repr__(self) -> str:
        return (f"Request({self.kind}, id={self.request_id}, prompt={len(self.ids)}, tokens={len(self.tokens)}, "
                f"phase={self.phase}, table={self.table.length})")  # fmt: skip

    @property
    def request_id(self) -> str:
        return self.handle.request_id if self.handle is not None else "?"

    @property
    def prompt_len(self) -> int:
        return len(self.ids)

    @property
    def decoding(self) -> bool:
        return self.phase == "decode"

    def pending_tokens(self) -> int:
        """Rows to compute before its next logits: the rest of its prefill (or score rows), or its decode row(s)."""
        if self.phase == "decode":
            return 1 + (len(self.proposal.tokens) if self.proposal is not None else 0)
        return len(self.fed) - self.fed_pos

    def accept(self, tokens: list[int], eos_ids: set[int], max_positions: int | None) -> str | None:
        """Append generated ``tokens`` (one, or a verified draft's); returns the stop reason when the request stops
        (:func:`kvboost.decoding.stop_reason`), which also ends its decoding. Tokens past the stop are dropped."""
        reason, eos_ids = None, self.sampling.stop_ids(eos_ids)  # the request's stop_token_ids, ignore_eos
        for token in tokens:
            self.tokens.append(int(token))
            reason = stop_reason(self.tokens, max_new_tokens=self.max_new_tokens, eos_ids=eos_ids,
                                 prompt_len=self.prompt_len, max_positions=max_positions)  # fmt: skip
            if reason is not None:
                self.finish_decoding()
                break
        now = time.perf_counter()
        self.token_times.extend([now] * (len(self.tokens) - len(self.token_times)))
        return reason

    def start_decoding(self) -> None:
        self.decode_started = time.perf_counter()

    def finish_decoding(self) -> None:
        if not self.done:
            self.done = True
            if self.decode_started:
                self.decode_seconds = time.perf_counter() - self.decode_started

    def rows_with_kv(self) -> list[int]:
        """The token ids whose K/V the table holds: the prompt, then every generated token but the last."""
        return (self.ids + self.tokens[:-1])[: self.table.length] if self.tokens else self.ids[: self.table.length]
