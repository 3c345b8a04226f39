"""The iteration-level scheduler's policy: which waiting requests start, in which order, and what each running one
computes this step, under a token budget and the KV pool's free blocks.

Pure bookkeeping over request objects (no model, no engine): :mod:`kvboost.engine.core` executes what it decides.
The rules, after SGLang's cache-aware scheduling and vLLM's v1 scheduler:

- Waiting order: a request that has waited ``aging_steps`` steps or more goes first, oldest first (nothing
  starves); then, while at most ``cache_aware_limit`` requests wait, the one with the longest cached prefix first
  (ties: arrival order), so a request whose prefix is cached starts while its blocks are still cached; past that
  queue size, first come first served. Preempted requests keep their place in front.
- Admission (the core's): the head of the queue starts when ``max_running`` allows and its blocks can be had; it
  blocks the ones behind it (no request overtakes an aged one).
- Per step: every decoding request gets its row(s) (one token, or a draft to verify), then prefilling requests
  get chunks of their prompts in admission order until ``max_batch_tokens``, or, with a CPU step budget
  (``step_budget``, :mod:`kvboost.engine.budget`: the CPU default when ``max_batch_tokens`` was not set), until the
  decode rows' tokens + ``step_budget.chunk(R)`` for R decode rows (capped by ``max_batch_tokens``). While no
  request decodes, nothing waits on a prefill: the budget is then ``max(max_batch_tokens, idle_prefill_tokens)`` (a
  ``generate_batch`` of many prompts prefills them in one forward). Assigning ``max_batch_tokens`` is an explicit
  setting: it drops the step budget (a fixed budget again).
- Preemption: when the step's rows need more blocks than can be had, the most recently admitted running request
  is preempted (the core caches its computed rows, frees its blocks and queues it again in front), never a crash.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Steps a request may wait before it goes ahead of every request with a longer cached prefix.
DEFAULT_AGING_STEPS = 32
#: A step's prefill tokens while no request decodes (no inter-token latency to protect).
DEFAULT_IDLE_PREFILL_TOKENS = 16384


@dataclass
class StepPlan:
    """What one step computes: ``(request, token count)`` per request (decode rows have 1, or ``k + 1`` with a
    draft), and who was preempted."""

    rows: list[tuple[Any, int]] = field(default_factory=list)
    preempted: list[Any] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.rows)


class Scheduler:
    """Waiting and running queues and the per-step decision (see the module docstring).

    Each request provides ``pending_tokens()``, ``decoding``, ``preempted``, ``arrival_step`` and
    ``cached_prefix`` (set by the core before ordering); ``admitted_at`` is set here. ``blocks_needed(request,
    n)`` (the core's) tells the new pool blocks ``n`` more rows of a request take, copy on write included.
    """

    def __init__(self, *, max_running: int = 64, max_batch_tokens: int = 2048, cache_aware_limit: int = 64,
                 aging_steps: int = DEFAULT_AGING_STEPS, idle_prefill_tokens: int = DEFAULT_IDLE_PREFILL_TOKENS,
                 step_budget: Any = None) -> None:  # fmt: skip
        for name, value in (("max_running", max_running), ("max_batch_tokens", max_batch_tokens),
                            ("aging_steps", aging_steps), ("idle_prefill_tokens", idle_prefill_tokens)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.max_running, self.max_batch_tokens = max_running, max_batch_tokens
        #: a :class:`kvboost.engine.budget.StepBudget` with rates (the CPU default) or None (fixed budget)
        self.step_budget: Any = None
        if step_budget is not None:  # its max_batch_tokens replaces the argument's
            self.set_step_budget(step_budget)
        self.cache_aware_limit, self.aging_steps, self.idle_prefill_tokens = cache_aware_limit, aging_steps, idle_prefill_tokens
        self.waiting: deque[Any] = deque()
        self.running: list[Any] = []
        self._admissions = 0

    @property
    def max_batch_tokens(self) -> int:
        return self._max_batch_tokens

    @max_batch_tokens.setter
    def max_batch_tokens(self, value: int) -> None:
        """An explicit budget: fixed from now on (the CPU step budget, if any, is dropped)."""
        self._max_batch_tokens = value
        self.step_budget = None

    def set_step_budget(self, step_budget: Any) -> None:
        """Use ``step_budget`` (:class:`kvboost.engine.budget.StepBudget`): its ``max_batch_tokens`` caps a step,
        and, when it has rates, decode rows + ``chunk(R)`` is the budget while R requests decode."""
        self._max_batch_tokens = step_budget.max_batch_tokens
        self.step_budget = step_budget if step_budget.auto else None

    # ------------------------------------------------------------------ queues
    def add(self, request: Any) -> None:
        self.waiting.append(request)

    def remove(self, request: Any) -> None:
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def requeue(self, request: Any) -> None:
        """Put a preempted request back at the front of the queue."""
        self.waiting.appendleft(request)

    def order_waiting(self, step: int) -> None:
        """Preempted requests first, then aged ones (oldest first), then cache-aware (longest cached prefix first,
        stable) while the queue is short, else arrival order."""
        if len(self.waiting) < 2:
            return
        queue = list(self.waiting)
        aged = [r for r in queue if r.preempted or step - r.arrival_step >= self.aging_steps]
        rest = [r for r in queue if not (r.preempted or step - r.arrival_step >= self.aging_steps)]
        aged.sort(key=lambda r: (not r.preempted, r.arrival_step))
        if 1 < len(rest) <= self.cache_aware_limit:
            rest = [r for _, r in sorted(enumerate(rest), key=lambda p: (-p[1].cached_prefix, p[0]))]
        self.waiting = deque(aged + rest)

    def admitted(self, request: Any) -> None:
        """``request`` leaves the queue's head for the running set."""
        self.waiting.remove(request)
        self._admissions += 1
        request.admitted_at = self._admissions
        self.running.append(request)

    def adopt(self, request: Any) -> None:
        """``request`` joins the running set without having waited (a sample forked from a prefilled request)."""
        self._admissions += 1
        request.admitted_at = self._admissions
        self.running.append(request)

    # ------------------------------------------------------------------ one step
    def budget(self) -> int:
        """This step's token budget: ``max_batch_tokens`` (with a CPU step budget: the decode rows' tokens +
        ``chunk(R)``, at most ``max_batch_tokens``), or more while no request decodes."""
        decoding = [r for r in self.running if r.decoding]
        if not decoding:
            return max(self.max_batch_tokens, self.idle_prefill_tokens)
        if self.step_budget is None:
            return self.max_batch_tokens
        rows = sum(r.pending_tokens() for r in decoding)
        backlog = sum(r.pending_tokens() for r in self.running if not r.decoding)
        return min(self.max_batch_tokens, rows + self.step_budget.chunk(len(decoding), backlog))

    def plan_step(self, blocks_needed: Callable[[Any, int], int], make_room: Callable[[int], int],
                  preempt: Callable[[Any], None]) -> StepPlan:  # fmt: skip
        """The rows of this step; preempts (newest first) while their blocks cannot be had. ``make_room(n)`` frees
        cached blocks until ``n`` are free and returns the free count; ``preempt(victim)`` (the core's) gives the
        victim's blocks back at once, so the next look at the pool counts them: one victim's blocks are enough when
        they are (asking again before they were released preempted every running request and ran an empty step).
        Admission reads the same pool counts (``num_available``, ``reclaim``)."""
        plan = StepPlan()
        while True:
            rows = self._rows()
            need = sum(blocks_needed(r, n) for r, n in rows)
            if not rows or make_room(need) >= need:
                plan.rows = rows
                return plan
            victim = max(self.running, key=lambda r: r.admitted_at)
            self.running.remove(victim)
            preempt(victim)
            plan.preempted.append(victim)
            if not self.running:
                plan.rows = []
                return plan

    def _rows(self) -> list[tuple[Any, int]]:
        rows: list[tuple[Any, int]] = []
        budget = self.budget()
        for request in self.running:  # decode rows first, whatever the budget
            if request.decoding:
                n = request.pending_tokens()
                rows.append((request, n))
                budget -= n
        for request in sorted((r for r in self.running if not r.decoding), key=lambda r: r.admitted_at):
            pending = request.pending_tokens()
            if budget <= 0 or pending <= 0:
                continue
            n = pending if request.phase == "score" else min(pending, budget)  # score rows are not cut
            rows.append((request, n))
            budget -= n
        return rows
