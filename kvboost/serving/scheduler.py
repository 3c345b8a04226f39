"""The iteration-level scheduler's policy: which waiting requests start, in which order, and what each running one
computes this step, under a token budget and the KV pool's free blocks.

Pure bookkeeping over :class:`ScheduledSeq`-like objects (no model, no engine): :mod:`kvboost.serving.core`
executes what it decides. The rules, after SGLang's cache-aware scheduling and vLLM's v1 scheduler:

- Waiting order: while at most ``cache_aware_limit`` requests wait, the one with the longest cached prefix first
  (ties: arrival order), so a request whose prefix is cached starts while its blocks are still cached; past that
  queue size, first come first served (sorting a long queue costs more than it saves, and no request starves).
- Admission: a request starts when ``max_running`` allows and the pool has the blocks for its uncached prompt
  plus one for its first decoded tokens (asking the cache to give back blocks first).
- Per step: every decoding request gets one token, then prefilling requests get chunks of their prompts in
  admission order until ``max_batch_tokens`` (a long prompt is prefilled over several steps, so decoding requests
  keep getting tokens while it runs).
- Preemption: when the step's rows need more blocks than are free (after the cache gave back what it could), the
  most recently admitted running request is preempted (its blocks freed; it goes back to the front of the queue
  and is recomputed later, its generated tokens appended to its prompt), never a crash.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepPlan:
    """What one step computes: ``(seq, token count)`` per sequence (decode rows have 1), and who was preempted."""

    rows: list[tuple[Any, int]] = field(default_factory=list)
    preempted: list[Any] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.rows)


class Scheduler:
    """Waiting and running queues and the per-step decision (see the module docstring).

    Each sequence object provides: ``pending_tokens()`` (tokens to compute before its next logits: the rest of its
    prefill, or 1 when decoding), ``decoding`` (bool), ``blocks_needed(n)`` (new pool blocks to compute ``n`` more
    tokens, copy-on-write included), ``admit_blocks()`` (blocks its admission needs), ``cached_prefix`` (the tokens
    a lookup would serve, for ordering) and ``admitted_at`` (set here).
    """

    def __init__(self, *, max_running: int = 64, max_batch_tokens: int = 2048, max_waiting: int | None = 256,
                 cache_aware_limit: int = 64) -> None:  # fmt: skip
        for name, value in (("max_running", max_running), ("max_batch_tokens", max_batch_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if max_waiting is not None and (not isinstance(max_waiting, int) or max_waiting < 1):
            raise ValueError(f"max_waiting must be a positive integer or None, got {max_waiting!r}")
        self.max_running, self.max_batch_tokens, self.max_waiting = max_running, max_batch_tokens, max_waiting
        self.cache_aware_limit = cache_aware_limit
        self.waiting: deque[Any] = deque()
        self.running: list[Any] = []
        self._admissions = 0

    # ------------------------------------------------------------------ queues
    @property
    def full(self) -> bool:
        return self.max_waiting is not None and len(self.waiting) >= self.max_waiting

    def add(self, seq: Any) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Any) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def order_waiting(self) -> None:
        """Cache-aware order while the queue is short (longest cached prefix first, stable), FCFS past it;
        preempted requests stay in front."""
        if 1 < len(self.waiting) <= self.cache_aware_limit:
            ranked = sorted(enumerate(self.waiting), key=lambda p: (not p[1].preempted, -p[1].cached_prefix, p[0]))
            self.waiting = deque(seq for _, seq in ranked)

    # ------------------------------------------------------------------ one step
    def admit(self, free_blocks: Callable[[], int], make_room: Callable[[int], None], start: Callable[[Any], None]) -> None:
        """Start waiting requests while ``max_running`` and the free blocks allow. ``make_room(n)`` asks the cache
        to give back blocks until ``n`` are free; ``start(seq)`` does the lookup and assembly."""
        self.order_waiting()
        while self.waiting and len(self.running) < self.max_running:
            seq = self.waiting[0]
            need = seq.admit_blocks()
            if free_blocks() < need:
                make_room(need)
            if free_blocks() < need:
                break  # wait for running requests to finish (a request that fits no pool is refused at submit)
            self.waiting.popleft()
            self._admissions += 1
            seq.admitted_at = self._admissions
            self.running.append(seq)  # before start(): a request that ends at its first token leaves through remove()
            start(seq)

    def plan_step(self, free_blocks: Callable[[], int], make_room: Callable[[int], None]) -> StepPlan:
        """The rows of this step; preempts (newest first) while their blocks cannot be had."""
        plan = StepPlan()
        while True:
            rows = self._rows()
            need = sum(seq.blocks_needed(n) for seq, n in rows)
            if free_blocks() < need:
                make_room(need)
            if free_blocks() >= need or not rows:
                plan.rows = rows
                return plan
            victim = max(self.running, key=lambda s: s.admitted_at)
            self.running.remove(victim)
            plan.preempted.append(victim)
            if not self.running:  # the last one alone does not fit: its rows are refused by the caller
                plan.rows = []
                return plan

    def requeue(self, seq: Any) -> None:
        """Put a preempted request back at the front of the queue."""
        self.waiting.appendleft(seq)

    def _rows(self) -> list[tuple[Any, int]]:
        rows: list[tuple[Any, int]] = []
        budget = self.max_batch_tokens
        for seq in self.running:  # decode rows first: one token each, whatever the budget
            if seq.decoding:
                rows.append((seq, 1))
                budget -= 1
        for seq in sorted((s for s in self.running if not s.decoding), key=lambda s: s.admitted_at):
            if budget <= 0:
                break
            n = min(seq.pending_tokens(), budget)
            rows.append((seq, n))
            budget -= n
        return rows
