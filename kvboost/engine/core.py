"""The engine core: the one request loop of an engine (``engine.core``), one :meth:`EngineCore.step` at a time.

``generate``, ``generate_batch``, ``generate_many``, ``warm``, ``add_request`` and the HTTP server's loop all submit
:class:`~kvboost.engine.sequences.Request` objects to it (thread-safe: an inbox), and every forward of the engine's
runner happens inside a step: prompt chunks, decode rows, draft verification, content repair, warm, the canonical
store, the teacher-forced rows of ``score_ids``. Text stays outside (``kvboost.engine.frontend``).

One step: take the inbox -> end cancelled and timed-out requests -> start waiting requests (lookup, which takes its
references first, then assembly; a request with content hits is repaired here, its tokens counted in the step's
budget) -> draft proposals -> the step's rows under the token budget and the pool's blocks (preempting the newest
when blocks run out: its computed rows are cached first, so its resumption hits them) -> one forward over all rows
-> a token per finished prefill and per decode row (greedy rows picked with one device sync) -> finished requests
store their chunks and free their blocks.

``n`` samples of one prompt (``SamplingParams.n``): the first sample is scheduled alone; when its prefill gives its
first token, the others fork its block table (a reference on every block: the prompt is computed once; the partial
last block, shared, is copied on write by each sample that writes it while another still holds it), pick their first
token from the same logits with their own generators and join the running set (``forked_samples``,
``forked_prompt_tokens`` and ``prefill_tokens`` count it). Samples not forked yet end with the first if it ends
before its prefill does. Log-probabilities (``SamplingParams.logprobs``) are the raw ``log_softmax`` of the logits
each token was picked from.

Containment: a forward that raises is rolled back (every table it touched is cut back to its length before the
step) and its rows are run again one request at a time, so only the requests whose work raises fail
(``finish_reason="error"``, the exception kept for ``generate`` to raise); a ``KeyboardInterrupt`` is rolled back and
re-raised. A request that cannot be admitted while nothing else runs (the pool is too small, or pinned) fails at
once with the pool's numbers instead of waiting forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kvboost.decoding import pick_token
from kvboost.engine import pipeline
from kvboost.engine import budget as budget_rule
from kvboost.engine import frontend
from kvboost.engine.requests import Completion, QueueFull, RequestHandle, SamplingParams, TokenEvent, TokenLogprob
from kvboost.engine.scheduler import DEFAULT_AGING_STEPS, Scheduler
from kvboost.engine.sequences import Request
from kvboost.generation import ReuseCounts
from kvboost.kv.block_table import BlockTable
from kvboost.kv.pool import PoolExhausted
from kvboost.prompts import Prompt
from kvboost.reuse.assemble import assemble_exact
from kvboost.runtime.batch import ForwardBatch, SeqInput
from kvboost.speculative import verify as speculation
from kvboost.types import WarmResult

log = logging.getLogger(__name__)


class EngineCore:
    """Requests in, tokens out, one :meth:`step` at a time; see the module docstring.

    Args:
        engine: the engine (model runner, pool, store, plugins).
        max_running: sequences computed together (a request with n samples counts n once it forks).
        max_batch_tokens: a step's token budget while requests decode (prompt chunks fill what decode rows leave).
            None (the default): 2,048 on GPUs; on CPU a budget sized to the decode step
            (:mod:`kvboost.engine.budget`: decode rows + a chunk of ~1.5 decode steps' prefill), from the CPU's ISA
            and cores until :meth:`calibrate_budget` measures the runner.
        max_waiting: queued requests before ``submit`` raises :class:`QueueFull` (None: unbounded).
        request_timeout_s: the default deadline of a request (None: none).
        cache_aware_limit, aging_steps: the waiting order (``kvboost.engine.scheduler``).
    """

    def __init__(self, engine: Any, *, max_running: int = 64, max_batch_tokens: int | None = None,
                 max_waiting: int | None = None, request_timeout_s: float | None = None,
                 cache_aware_limit: int = 64, aging_steps: int = DEFAULT_AGING_STEPS) -> None:  # fmt: skip
        self.engine = engine
        adapter = getattr(engine, "adapter", None)
        device = adapter.device.type if adapter is not None else "cpu"
        step_budget = budget_rule.choose(device, max_batch_tokens)
        self.scheduler = Scheduler(max_running=max_running, cache_aware_limit=cache_aware_limit,
                                   aging_steps=aging_steps, step_budget=step_budget)  # fmt: skip
        #: the budget's choice (``budget_info()`` describes what is in force now)
        self.budget_choice = step_budget
        self.configure(max_waiting=max_waiting, request_timeout_s=request_timeout_s)
        self.counters = {"prefix_query_tokens": 0, "prefix_hit_tokens": 0, "content_hit_tokens": 0,
                         "recompute_pairs": 0, "requests_finished": 0, "preemptions": 0, "steps": 0,
                         "prompt_tokens": 0, "generation_tokens": 0, "canonical_prefill_tokens": 0,
                         "resumed_hit_tokens": 0, "failed_forwards": 0, "unadmittable": 0, "prefill_tokens": 0,
                         "forked_samples": 0, "forked_prompt_tokens": 0, "failed_drafts": 0}  # fmt: skip
        self._forked: list[Request] = []  # samples forked in this step, not yet handed out
        # end-to-end seconds of the last 64 requests, for Retry-After; replaced (never mutated) so that a submitting
        # thread reads a whole list while the core finishes requests
        self.recent_latencies: list[float] = []
        #: called with each finished chat request (on the stepping thread); the engine's stores its canonical turn
        self.on_finished: Callable[[Request], None] | None = None
        #: the thread of an EngineLoop that drives the steps (None: whoever calls ``step`` / ``generate``)
        self.driver: threading.Thread | None = None
        self._inbox: deque[Request] = deque()
        self._cond = threading.Condition()
        self._step_lock = threading.RLock()
        self.steps = 0
        #: > 0 while a step (or other engine work, :meth:`exclusive`) runs: every forward of the runner happens then
        self.stepping = 0

    def configure(self, *, max_waiting: int | None = None, request_timeout_s: float | None = None) -> None:
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {request_timeout_s!r}")
        if max_waiting is not None and (not isinstance(max_waiting, int) or max_waiting < 1):
            raise ValueError(f"max_waiting must be a positive integer or None, got {max_waiting!r}")
        self.max_waiting, self.request_timeout_s = max_waiting, request_timeout_s

    def budget_info(self) -> dict[str, Any]:
        """The step budget in force: ``mode`` (``cpu-auto`` | ``fixed``), ``max_batch_tokens``, why, and for the CPU
        rule its rates, their source and the chunk at 1 / 8 / 32 decode rows (``kvboost.engine.budget``)."""
        step_budget = self.scheduler.step_budget
        if step_budget is None:
            reason = self.budget_choice.reason if not self.budget_choice.auto else "set explicitly"
            return {"mode": "fixed", "max_batch_tokens": self.scheduler.max_batch_tokens, "reason": reason}
        return step_budget.describe()

    def calibrate_budget(self, repeats: int = 3) -> dict[str, Any]:
        """Measure the runner's prefill and decode step costs (scratch blocks; two passes, the first compiling new
        shapes: ~1 minute on 2 AVX2 cores for the bundled model)
        and size the CPU step budget from them; nothing changes when the budget is fixed (explicit, or a GPU)."""
        if self.scheduler.step_budget is None:
            return self.budget_info()
        engine = self.engine
        with self.exclusive():
            vocab = int(getattr(engine.adapter.config, "vocab_size", 0) or 1000)
            for _ in range(2):  # the first pass meets new shapes (compiles, oneDNN primitives): the second counts
                rates = budget_rule.measure_rates(engine.runner, engine.pool, vocab=vocab, repeats=repeats)
        # the measured budget keeps the backlog bound in force (set_drain_steps)
        chosen = budget_rule.choose("cpu", None, rates=rates, drain_steps=self.scheduler.step_budget.drain_steps)
        self.scheduler.set_step_budget(chosen)
        self.budget_choice = chosen
        return self.budget_info()

    def set_drain_steps(self, steps: int) -> None:
        """The CPU step budget's backlog bound (``kvboost.engine.budget``): a step carries at least the admitted
        prompts' pending tokens / ``steps`` (0: off, the chunk follows the decode rows alone). No effect on a fixed
        budget."""
        budget_rule.check_drain_steps(steps)
        if self.scheduler.step_budget is not None:
            self.scheduler.set_step_budget(dataclasses.replace(self.scheduler.step_budget, drain_steps=steps))
            self.budget_choice = self.scheduler.step_budget

    # ------------------------------------------------------------------ requests in (any thread)
    def prepare(self, prompt: Prompt, params: SamplingParams, **options: Any) -> Request:
        """A generate request, tokenized and validated on the caller's thread (``kvboost.engine.frontend``)."""
        return frontend.generate_request(self, prompt, params, **options)

    def prepare_store(self, ids: list[int], spans: list, **options: Any) -> Request:
        """A prefill-only request (``warm``, the canonical store): ``kvboost.engine.frontend.store_request``."""
        return frontend.store_request(self, ids, spans, **options)

    def deadline(self, timeout_s: float | None) -> float | None:
        """When a request submitted now with ``timeout_s`` (default: the core's) times out."""
        timeout = timeout_s if timeout_s is not None else self.request_timeout_s
        return time.perf_counter() + timeout if timeout else None

    def submit(self, request: Request, *, internal: bool = False) -> RequestHandle:
        """Queue a prepared request (thread-safe); ``QueueFull`` past ``max_waiting`` (``internal``: the engine's own
        work, a canonical store, is never refused)."""
        with self._cond:
            waiting = len(self._inbox) + len(self.scheduler.waiting)
            if self.max_waiting is not None and waiting >= self.max_waiting and not internal:
                raise QueueFull(f"{waiting} requests are waiting (max_waiting={self.max_waiting}); retry later",
                                retry_after_s=self.retry_after(waiting))  # fmt: skip
            self._inbox.append(request)
            self._cond.notify_all()
        return request.handle

    def add(self, prompt: Prompt, params: SamplingParams | None = None, **options: Any) -> RequestHandle:
        """``prepare`` + ``submit`` (``engine.add_request``)."""
        return self.submit(self.prepare(prompt, params or SamplingParams(), **options))

    def cancel(self, handle: RequestHandle, reason: str = "cancelled") -> None:
        """End a request at the next step (thread-safe): ``cancelled``, or ``stop`` (a stop string the frontend
        found: the request finishes normally)."""
        request = handle._request  # type: ignore[attr-defined]
        request.cancel_reason = reason
        request.cancelled = True
        with self._cond:
            self._cond.notify_all()

    def retry_after(self, waiting: int) -> float:
        import math
        import statistics

        latencies = self.recent_latencies
        typical = statistics.median(latencies) if latencies else 1.0
        return max(1.0, math.ceil(typical * max(1, waiting) / self.scheduler.max_running))

    def has_work(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_work()

    def num_waiting(self) -> int:
        return len(self._inbox) + len(self.scheduler.waiting)

    def wait_for_work(self, timeout: float | None, stop: Callable[[], bool]) -> None:
        """Block the driving thread until there is work, ``stop()`` is true or ``timeout`` passed."""
        with self._cond:
            self._cond.wait_for(lambda: self.has_work() or stop(), timeout=timeout)

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    # ------------------------------------------------------------------ driving (the caller's thread)
    def run_until_done(self, requests: Sequence[Request]) -> None:
        """Return once every request of ``requests`` finished: step the core on this thread, or, while an
        EngineLoop drives it from another thread, wait for them."""
        driver = self.driver
        if driver is not None and driver.is_alive() and driver is not threading.current_thread():
            for request in requests:
                request.handle.wait()
            return
        while not all(r.phase == "finished" for r in requests):
            self.step()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Engine work that is no request's (the runner's warm-up, a look at or a swap of the cache): after the step
        in flight, before the next one, as the core's own."""
        with self._step_lock:
            self.stepping += 1
            try:
                yield
            finally:
                self.stepping -= 1

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Completion]:
        """One iteration; returns the completions of the requests that finished in it."""
        with self.exclusive():
            with self._cond:
                incoming, self._inbox = list(self._inbox), deque()
            for request in incoming:
                request.arrival_step = self.steps
                self.scheduler.add(request)
            finished: list[Completion] = []
            self._end_expired(finished)
            with torch.inference_mode():
                self._admit(finished)
                self._settle_forks(finished)
                self._propose(finished)
                plan = self.scheduler.plan_step(self._blocks_needed, self.engine.pool.reclaim,
                                                lambda victim: self._preempt(victim, finished))  # fmt: skip
                if plan.rows:
                    self._run(plan.rows, finished)
                    self._settle_forks(finished)
            self.steps += 1
            self.counters["steps"] += 1
            return finished

    def _end_expired(self, finished: list[Completion]) -> None:
        now = time.perf_counter()
        for request in list(self.scheduler.waiting) + list(self.scheduler.running):
            if request.cancelled:
                _collect(finished, self._finish(request, request.cancel_reason))
            elif request.deadline is not None and now > request.deadline:
                _collect(finished, self._finish(request, "timeout", error="the request ran past its timeout"))

    # ------------------------------------------------------------------ admission
    def _admit(self, finished: list[Completion]) -> None:
        """Start waiting requests, head first, while ``max_running`` and the pool allow (see the module docstring)."""
        scheduler, engine = self.scheduler, self.engine
        if 1 < len(scheduler.waiting) <= scheduler.cache_aware_limit:  # the cache-aware order needs them
            for request in scheduler.waiting:
                if request.keys is None and request.mode != "cold":
                    request.keys = engine.hasher.chunk_keys(request.ids, request.spans, engine.fingerprint,
                                                            request.salt)  # fmt: skip
                request.cached_prefix = self._cached_prefix(request)
        scheduler.order_waiting(self.steps)
        budget = scheduler.budget()
        while scheduler.waiting:
            request = scheduler.waiting[0]
            # a request with n samples takes n places (its unforked samples join the running set at its first
            # token: EngineCore._fork); alone, it starts even when n > max_running, or it would never run
            occupied = sum(1 + len(r.forks) for r in scheduler.running)
            if scheduler.running and occupied + 1 + len(request.forks) > scheduler.max_running:
                break
            try:
                outcome = self._start(request, budget)
            except Exception as exc:
                if request.plan is not None:
                    request.plan.release()
                _collect(finished, self._fail(request, exc))
                continue
            if isinstance(outcome, int):
                budget -= outcome
                if request.phase != "finished":
                    self._emit(request)
                    if request.done and request.phase == "decode":  # (a resumed score request is in "score")
                        _collect(finished, self._finish(request, request.finish_reason or "length"))
                else:
                    _collect(finished, request.handle.completion)
                continue
            if outcome == "budget":
                break
            if scheduler.running or self._inbox:
                break  # blocks come back as running requests finish
            self.counters["unadmittable"] += 1
            _collect(finished, self._fail(request, PoolExhausted(self._unadmittable(request))))

    def _cached_prefix(self, request: Request) -> int:
        """Tokens of the prompt's leading chunks in the store now (no access counted), for the queue order."""
        cached = 0
        store = self.engine.store
        for key, span in zip(request.keys or (), request.spans, strict=False):
            if key.prefix_key not in store:
                break
            cached = span.end
        return cached

    def _start(self, request: Request, budget: int) -> int | str:
        """Lookup (references first), then assembly, or the repair of a plan with content hits. Returns the tokens
        of the step's budget it used, ``"wait"`` (its blocks cannot be had now) or ``"budget"`` (a repair that does
        not fit this step's budget)."""
        engine = self.engine
        plan = pipeline.plan_for(engine, request)
        before = _Admission.of(request, self.counters)
        try:
            return self._start_planned(request, plan, budget)
        except BaseException:
            plan.release()  # idempotent: the references the lookup took, if assembly did not take them over
            if request in self.scheduler.running:  # admitted, then interrupted (assembly, repair, first token)
                self._unadmit(request, before)
            raise

    def _unadmit(self, request: Request, before: _Admission) -> None:
        """Put a request whose admission raised back as it was before the step: at the queue's head, no blocks, no
        draft, its tokens and the counters as they were. A KeyboardInterrupt there left it in ``running`` with
        nothing to compute, and ``while core.has_work(): step()`` never ended."""
        self.scheduler.running.remove(request)
        self.scheduler.waiting.appendleft(request)
        if request.draft is not None and before.draft is None:
            request.draft.end()
            request.draft = None
        request.table.release()
        request.table = BlockTable(self.engine.pool)
        before.restore(request, self.counters)

    def _start_planned(self, request: Request, plan: Any, budget: int) -> int | str:
        engine, pool = self.engine, self.engine.pool
        prefill = len(plan) - plan.exact_prefix
        if plan.content_tokens and prefill > budget and budget < self.scheduler.budget():
            plan.release()
            return "budget"
        # new blocks for its rows (one more for the first decoded token's row), the partial shared block copied
        rows = len(plan) + (request.kind == "generate")
        need = pool.blocks_for(rows) - plan.exact_prefix // pool.block_size + bool(plan.exact_prefix % pool.block_size)
        if pool.num_available < need or pool.reclaim(need) < need:  # (nothing is evicted for a request that waits)
            plan.release()
            return "wait"
        resumed, preempted = request.started, request.preempted
        if not resumed:
            request.clock.mark("looked_up")
        request.started, request.preempted, request.plan = True, False, plan
        self.scheduler.admitted(request)
        if plan.content_tokens:
            self._count_start(request, resumed, plan)
            self.counters["prefill_tokens"] += prefill
            logits = pipeline.prefill_with_repair(engine, request)
            self._count_reuse(request)
            self._prefilled(request, logits)
            return prefill
        try:
            assembly = assemble_exact(plan, request.table, engine.quantizer)
        except PoolExhausted:  # the pool's reckoning was short (blocks cached but protected): wait, at the head
            request.table.release()
            request.table = BlockTable(pool)
            self.scheduler.running.remove(request)
            self.scheduler.waiting.appendleft(request)
            # as it was: counted when it starts, and a preempted request keeps its place ahead of the others
            request.started, request.preempted = resumed, preempted
            return "wait"
        self._count_start(request, resumed, plan)
        if not resumed:
            request.clock.mark("assembled")
        seq, _ = pipeline.sequence_of(engine, request)
        request.fed, request.fed_pos, request.phase = seq[plan.exact_prefix :], 0, "prefill"
        if not resumed:
            request.counts = ReuseCounts(cached_tokens=plan.reused_tokens, exact_tokens=plan.exact_tokens,
                                         content_tokens=0, extra={"prefill_tokens": len(plan) - plan.exact_prefix,
                                                                  "shared_blocks": assembly.shared_blocks,
                                                                  "loaded_rows": assembly.loaded_rows})  # fmt: skip
            self._count_reuse(request)
        if not request.fed:  # a warm / store request whose every token is cached already
            self._prefilled(request, None)
        return 0

    def _count_start(self, request: Request, resumed: bool, plan: Any) -> None:
        """Count a request's start once it holds its blocks (a start that waits for them is not one)."""
        if not resumed:
            self.counters["prefix_query_tokens"] += len(request.ids)
            self.counters["prompt_tokens"] += len(request.ids)
        else:
            self.counters["resumed_hit_tokens"] += plan.exact_prefix

    def _unadmittable(self, request: Request) -> str:
        pool = self.engine.pool
        rows = len(request.ids) + len(request.tokens) + 1
        return (f"request {request.request_id} cannot start: its {rows} rows need {pool.blocks_for(rows) + 1} "
                f"blocks of {pool.block_size} tokens and nothing else runs to give blocks back; the KV pool has "
                f"{pool.num_blocks} blocks ({pool.num_blocks * pool.block_bytes / 2**20:.1f} MiB), {pool.num_free} "
                f"free, {pool.num_idle} cached and not evictable, {pool.num_referenced} held (pins: "
                f"{len(self.engine.store.pinned_keys())} pinned entries); unpin entries, raise kv.pool_bytes or "
                "shorten the request")  # fmt: skip

    def _count_reuse(self, request: Request) -> None:
        counts = request.counts
        self.counters["prefix_hit_tokens"] += counts.exact_tokens
        self.counters["content_hit_tokens"] += counts.content_tokens
        self.counters["recompute_pairs"] += counts.recomputed_pairs

    # ------------------------------------------------------------------ drafts, blocks, preemption
    def _propose(self, finished: list[Completion]) -> None:
        """Each speculative decoding request's draft for this step (a layer-skip draft runs the runner's first
        layers over the request's table and leaves it as it was). A proposal that raises (a draft model's pool is
        full, a fault) means no draft this step: the request decodes its plain row and drafts again next step."""
        for request in list(self.scheduler.running):
            if request.draft is not None and request.phase == "decode" and request.proposal is None:
                length = request.table.length
                try:
                    request.proposal = speculation.propose(request, self.engine.adapter.max_positions)
                except Exception as exc:
                    self._rollback([(request, length)])
                    self.counters["failed_drafts"] += 1
                    log.debug("kvboost: no draft for request %s this step: %r", request.request_id, exc)

    def _blocks_needed(self, request: Request, n: int) -> int:
        table, pool = request.table, self.engine.pool
        need = max(0, pool.blocks_for(table.length + n) - len(table.blocks))
        if table.length % pool.block_size and table.blocks and not pool.writable(table.blocks[-1]):
            need += 1  # the shared or cached partial last block is copied before it is written
        return need

    def _preempt(self, request: Request, finished: list[Completion] | None = None) -> None:
        """Cache the request's computed rows (by ``store_rows``'s rule: those a prefill gives, generated ones only
        when the engine stores them), free its blocks, queue it again: its resumption finds those rows in the cache
        unless the pool needed them meanwhile, and computes the others again."""
        request.proposal = None
        try:
            pipeline.store_rows(self.engine, request)
        except Exception as exc:  # as when a finishing request's store fails: it ends with the error, alone (a
            # failure here used to be logged and dropped, which hid a storing bug behind a silent recomputation)
            log.exception("kvboost: caching the rows of preempted request %s failed", request.request_id)
            completion = self._fail(request, exc)
            if finished is not None:
                finished.append(completion)
            return
        request.table.release()
        request.table = BlockTable(self.engine.pool)
        request.phase, request.preempted = "waiting", True
        request.preemptions += 1
        self.counters["preemptions"] += 1
        self.scheduler.requeue(request)

    # ------------------------------------------------------------------ the step's forward
    def _run(self, rows: list[tuple[Request, int]], finished: list[Completion]) -> None:
        """One forward over ``rows``; on an exception, roll back and find the requests whose work raises."""
        before = [(request, request.table.length) for request, _ in rows]
        inputs = [self._input(request, n) for request, n in rows]
        first_chunks = [r for r, _ in rows if r.phase == "prefill" and r.fed_pos == 0 and not r.tokens]
        for request in first_chunks:
            request.counts.extra.update(batched_prefill=len(first_chunks), layerwise=False)
        prefill = sum(n for r, n in rows if r.phase == "prefill")
        try:
            logits = self.engine.runner.run(ForwardBatch.build(inputs))
        except BaseException as exc:
            self._rollback(before)
            self.counters["failed_forwards"] += 1
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt, SystemExit: the tables are consistent again; the caller decides
            if len(rows) == 1:
                _collect(finished, self._fail(rows[0][0], exc))
                return
            for row in rows:  # one request at a time: the ones whose work raises again fail, alone
                if row[0] in self.scheduler.running:
                    self._run([row], finished)
            return
        self.counters["prefill_tokens"] += prefill
        offset, per_row = 0, []
        for inp in inputs:
            k = len(inp.logits) if inp.logits is not None else 1
            per_row.append(logits[offset : offset + k])
            offset += k
        greedy = self._greedy_tokens(rows, per_row)
        for (request, n), out in zip(rows, per_row, strict=True):
            try:
                self._after_forward(request, n, out, greedy.get(id(request)))
            except Exception as exc:
                _collect(finished, self._fail(request, exc))
                continue
            if request.phase == "finished":
                _collect(finished, request.handle.completion)
                continue
            self._emit(request)
            if request.done and request.phase == "decode":
                _collect(finished, self._finish(request, request.finish_reason or "length"))

    def _input(self, request: Request, n: int) -> SeqInput:
        if request.phase == "decode":
            feed = [request.tokens[-1], *(request.proposal.tokens if request.proposal is not None else [])]
            return SeqInput(request.table, feed, logits=list(range(len(feed))) if len(feed) > 1 else None)
        chunk = request.fed[request.fed_pos : request.fed_pos + n]
        return SeqInput(request.table, chunk, logits=list(range(len(chunk))) if request.phase == "score" else None)

    def _greedy_tokens(self, rows: list[tuple[Request, int]], per_row: list[torch.Tensor]) -> dict[int, int]:
        """The next token of every plain greedy decode row, from one argmax over their logits (one device sync)."""
        picks = [(r, out) for (r, _), out in zip(rows, per_row, strict=True)
                 if r.phase == "decode" and r.proposal is None and not r.sampling.do_sample
                 and not r.sampling.processed]  # fmt: skip
        if not picks:
            return {}
        tokens = torch.argmax(torch.cat([out for _, out in picks]), dim=-1).tolist()
        return {id(r): int(t) for (r, _), t in zip(picks, tokens, strict=True)}

    def _rollback(self, before: list[tuple[Request, int]]) -> None:
        """Cut every table back to its length before the step (blocks past it go back; a block copied on write
        keeps the rows the table had)."""
        for request, length in before:
            table = request.table
            if table.length > length:
                table.truncate(length)

    def _after_forward(self, request: Request, n: int, logits: torch.Tensor, greedy: int | None) -> None:
        engine = self.engine
        if request.phase == "decode":
            if request.proposal is not None:
                tokens = speculation.verify(request, logits, engine.eos_ids)
            else:
                tokens = [greedy if greedy is not None else pick_token(logits[0], request.sampling, request.generator)]
            self._accept(request, tokens, logits)
            return
        request.fed_pos += n
        if request.phase == "score":
            request.score_logits.append(logits)
        if request.fed_pos < len(request.fed):
            return  # more chunks next step
        self._prefilled(request, logits[-1])

    def _prefilled(self, request: Request, logits: torch.Tensor | None) -> None:
        """The request's rows are all computed: its first (or, resumed, next) token; or it is done (warm, store,
        score)."""
        engine = self.engine
        if request.kind != "generate":
            self._finish(request, "stop")
            return
        if request.phase == "score":
            self._finish_score(request)
            return
        if request.scoring:  # resumed after a preemption in its score rows: its prompt is back, the rows again
            self._begin_score(request)
            return
        first = not request.tokens
        if first:  # the first token: TTFT stops here
            request.first_logits = logits
            token = pick_token(logits, request.sampling, request.generator)
            request.clock.mark("first")
            request.first_token_at = time.perf_counter()
            request.start_decoding()
        else:  # resumed after a preemption: its prefill's logits give its next token
            token = pick_token(logits, request.sampling, request.generator)
        request.phase = "decode"
        self._accept(request, [token], logits.unsqueeze(0))
        if engine.speculative.enabled and not request.done and request.draft is None:
            speculation.begin(request, engine.speculative, engine.runner)
        if first and request.forks:
            self._fork(request, logits)

    def _accept(self, request: Request, tokens: list[int], logits: torch.Tensor) -> None:
        """Append the tokens picked from ``logits`` (row ``j`` gave token ``j``), with their log-probabilities when
        the request asked for them: the raw ``log_softmax`` of the model's logits (fp32), before temperature, top-k
        and top-p (vLLM's default), and the ``request.logprobs`` likeliest tokens."""
        engine = self.engine
        before = len(request.tokens)
        request.finish_reason = request.accept(tokens, engine.eos_ids, engine.adapter.max_positions)
        if request.logprobs is None:
            return
        added = request.tokens[before:]
        request.token_logprobs.extend(token_logprobs(logits[: len(added)], added, request.logprobs))

    def _fork(self, parent: Request, logits: torch.Tensor) -> None:
        """The other samples of ``parent``'s prompt (``SamplingParams.n``), now that it is prefilled: each takes a
        reference on every block of the parent's table (the prompt's rows, computed once; the partial last block is
        copied on write by whichever sample writes it first while it is shared), picks its first token from the
        same logits with its own generator, and decodes on its own from then on."""
        forks, parent.forks = parent.forks, []
        engine = self.engine
        for child in forks:
            if child.cancelled:
                self._complete(child, child.cancel_reason)
                continue
            try:
                child.table.release()
                child.table = parent.table.fork()
                child.started, child.plan, child.keys = True, None, parent.keys
                child.arrival_step, child.approx_from = parent.arrival_step, parent.approx_from
                counts = parent.counts
                child.counts = ReuseCounts(cached_tokens=counts.cached_tokens, exact_tokens=counts.exact_tokens,
                                           content_tokens=counts.content_tokens, recomputed_pairs=0,
                                           extra={**counts.extra, "forked_from": parent.request_id})  # fmt: skip
                child.clock.marks.update(parent.clock.marks)
                child.first_logits, child.first_token_at = logits, parent.first_token_at
                child.start_decoding()
                child.phase = "decode"
                self.scheduler.adopt(child)
                token = pick_token(logits, child.sampling, child.generator)
                self._accept(child, [token], logits.unsqueeze(0))
                if engine.speculative.enabled and not child.done and child.draft is None:
                    speculation.begin(child, engine.speculative, engine.runner)
            except Exception as exc:  # noqa: BLE001 - this sample fails alone (its blocks go back); its siblings go on
                self._fail(child, exc)
                continue
            self.counters["forked_samples"] += 1
            self.counters["forked_prompt_tokens"] += child.prompt_len
            self._forked.append(child)

    def _settle_forks(self, finished: list[Completion]) -> None:
        """Hand out the first tokens of the samples forked in this step (and end those that are done already)."""
        forked, self._forked = self._forked, []
        for child in forked:
            if child.phase == "finished":
                continue
            self._emit(child)
            if child.done:
                _collect(finished, self._finish(child, child.finish_reason or "length"))

    def _begin_score(self, request: Request) -> bool:
        """Queue the teacher-forced rows of ``score_ids`` after the prompt (the table holds the prompt's rows);
        False when there are none and the request finished here. A preemption before they ran resumes the request
        with its prompt alone (``pipeline.sequence_of``) and comes back here, not to a prefill's next token."""
        request.scoring = True
        request.fed, request.fed_pos, request.phase = list(request.score_ids[:-1]), 0, "score"
        request.score_logits = []
        if request.fed:
            return True  # finishes when its score rows ran
        self._finish_score(request)
        return False

    def _finish_score(self, request: Request) -> None:
        """The teacher-forced log-probability of ``score_ids`` (after the prompt), into ``result.extra``."""
        from kvboost.quality import continuation_logprob

        rows = torch.cat(request.score_logits) if request.score_logits else None
        request.result.extra["answer_logprob"] = continuation_logprob(request.first_logits, list(request.score_ids),
                                                                      lambda _: rows)  # fmt: skip
        if request.logprobs is not None:  # per position (the server's prompt logprobs), from the same rows
            every = request.first_logits.reshape(1, -1) if rows is None else \
                torch.cat([request.first_logits.reshape(1, -1), rows])  # fmt: skip
            request.score_logprobs = token_logprobs(every, list(request.score_ids), request.logprobs)
        request.score_logits = []
        request.phase = "decode"
        self._complete(request, "stop" if request.tokens[-1] in self.engine.eos_ids else "length")

    # ------------------------------------------------------------------ tokens and requests out
    def _emit(self, request: Request) -> None:
        """Token events for the tokens not yet handed out (ids only: the frontend makes the text)."""
        handle = request.handle
        sent = handle.num_events
        logprobs = request.token_logprobs if request.logprobs is not None else None
        for i, token in enumerate(request.tokens[sent:], start=sent):
            handle._push(TokenEvent(token, "", i, logprobs[i] if logprobs is not None else None))

    def _fail(self, request: Request, exc: BaseException) -> Completion:
        log.warning("kvboost: request %s failed: %r", request.request_id, exc)
        request.error = exc
        return self._finish(request, "error", error=f"{type(exc).__name__}: {exc}")

    def _finish(self, request: Request, reason: str, *, error: str | None = None) -> Completion | None:
        """End a request: store what it computed (a request that ended normally), build its result, free its
        blocks, hand the completion to its handle. A ``score_ids`` request goes on to its score rows first (None:
        not finished yet)."""
        engine = self.engine
        if request.phase == "finished":
            return request.handle.completion
        request.finish_reason = reason
        normal = reason == "stop" or (reason == "length" and request.kind == "generate")
        try:
            self._end_draft(request)  # (before the result is built: the draft's stats go into it)
            if normal and request.kind == "generate" and request.tokens and request.phase != "score":
                request.finish_decoding()
                request.clock.mark("decoded")
                request.stored_chunks = pipeline.store_rows(engine, request)
                request.clock.mark("stored")
                request.result = pipeline.generation_result(engine, request)
                engine._requests += 1
                engine._prompt_tokens += request.prompt_len
                engine._cached_tokens += request.counts.cached_tokens
                if request.score_ids is not None:
                    request.table.truncate(request.prompt_len)
                    return None if self._begin_score(request) else request.handle.completion
            elif normal and request.kind in ("warm", "store"):
                reused = request.plan.reused_tokens if request.plan is not None else 0
                request.stored_chunks = pipeline.store_rows(engine, request, pin=request.pin)
                if request.pin:
                    pipeline.pin_prefix(engine, request)
                request.clock.mark("end")
                request.result = WarmResult(prompt_tokens=len(request.ids), chunks_stored=request.stored_chunks,
                                            tokens_stored=len(request.ids) - reused, already_cached_tokens=reused,
                                            elapsed_ms=request.clock.ms("start", "end"))  # fmt: skip
        except Exception as exc:  # storing failed: the request still ends, with the error
            log.exception("kvboost: finishing request %s failed", request.request_id)
            reason, error, request.error = "error", f"{type(exc).__name__}: {exc}", exc
        return self._complete(request, reason, error=error)

    def _end_draft(self, request: Request) -> None:
        """Release the request's speculative draft (a draft model's table in its own pool), once."""
        if request.draft is not None:
            speculation.end(request)

    def _complete(self, request: Request, reason: str, *, error: str | None = None) -> Completion:
        if request not in self.scheduler.running and request not in self.scheduler.waiting:
            for owner in (*self.scheduler.running, *self.scheduler.waiting, *self._inbox):  # a sample not forked yet:
                if request in owner.forks:  # its first sample must not fork it later
                    owner.forks.remove(request)
        self.scheduler.remove(request)
        try:  # every end (finish, abort, shutdown) releases what the request holds: its draft too
            self._end_draft(request)
        except Exception:
            log.exception("kvboost: ending the draft of request %s failed", request.request_id)
            request.draft = None
        request.table.release()
        forks, request.forks = request.forks, []
        for child in forks:  # samples that never forked (it ended before its prefill did): they end with it
            if child.phase != "finished":
                self._complete(child, reason, error=error)
        request.phase, request.finish_reason = "finished", reason
        now = time.perf_counter()
        completion = Completion(
            request_id=request.request_id, prompt_tokens=len(request.ids), output_ids=list(request.tokens),
            text="", finish_reason=reason, cached_tokens=request.counts.cached_tokens,
            content_tokens=request.counts.content_tokens, error=error, arrival=request.handle.arrival,
            first_token_at=request.first_token_at, finished_at=now, token_times=list(request.token_times),
            preemptions=request.preemptions, index=request.sample_index,
            logprobs=list(request.token_logprobs) if request.logprobs is not None else None,
            score_logprobs=request.score_logprobs,
        )  # fmt: skip
        self.counters["requests_finished"] += 1
        self.counters["generation_tokens"] += len(request.tokens)
        parent = getattr(request, "parent", None)  # set on a canonical store: the chat turn it stores
        computed = len(request.ids) - (request.plan.reused_tokens if request.plan is not None else 0)
        if request.kind == "store" and reason == "stop" and parent is not None:
            self.counters["canonical_prefill_tokens"] += computed
        self.recent_latencies = [*self.recent_latencies[-63:], now - request.handle.arrival]
        if parent is not None and parent.result is not None:  # a canonical store: its figures go to the turn's result
            parent.result.extra.update(canonical_prefill_tokens=computed if reason == "stop" else 0,
                                       canonical_chunks_stored=request.stored_chunks,
                                       canonical_store_ms=(now - request.handle.arrival) * 1e3,
                                       **({} if reason == "stop" else {"canonical_skipped": error or reason}))
        request.handle._push(completion=completion)
        if self.on_finished is not None and request.kind == "generate":
            try:
                self.on_finished(request)
            except Exception:
                log.exception("kvboost: after request %s", request.request_id)
        return completion

    def abort_all(self, reason: str = "shutdown") -> None:
        """End every request, queued or running (its blocks go back)."""
        with self.exclusive():
            with self._cond:
                incoming, self._inbox = list(self._inbox), deque()
            for request in incoming:
                self.scheduler.add(request)
            for request in list(self.scheduler.waiting) + list(self.scheduler.running):
                self._complete(request, reason, error=f"the engine loop stopped ({reason})")

    def abort(self, requests: Sequence[Request], reason: str = "cancelled") -> None:
        """End ``requests`` now (those not finished), e.g. when their caller was interrupted."""
        with self.exclusive():
            with self._cond:
                self._inbox = deque(r for r in self._inbox if r not in requests)
            for request in requests:
                if request.phase != "finished":
                    self._complete(request, reason, error=f"the request was aborted ({reason})")

    def stats(self) -> dict[str, Any]:
        pool = self.engine.pool
        return {"num_running": len(self.scheduler.running), "num_waiting": self.num_waiting(),
                "kv_usage": pool.num_referenced / pool.num_blocks if pool.num_blocks else 0.0,
                "kv_cached_blocks": pool.num_cached, "num_preempted_total": self.counters["preemptions"],
                "max_batch_tokens": self.scheduler.max_batch_tokens,
                "step_budget_auto": int(self.scheduler.step_budget is not None),
                "step_prefill_chunk_32": (self.scheduler.step_budget.chunk(32) if self.scheduler.step_budget
                                          else self.scheduler.max_batch_tokens),
                **self.counters}  # fmt: skip


@dataclasses.dataclass
class _Admission:
    """What an admission changes on a request (and the core's counters), to undo an admission that raised."""

    started: bool
    preempted: bool
    phase: str
    fed: list[int]
    fed_pos: int
    tokens: int
    token_times: int
    token_logprobs: int
    done: bool
    finish_reason: str | None
    counts: Any
    approx_from: int | None
    first_logits: Any
    first_token_at: float | None
    draft: Any
    counters: dict[str, int]

    @classmethod
    def of(cls, request: Request, counters: dict[str, int]) -> _Admission:
        return cls(request.started, request.preempted, request.phase, request.fed, request.fed_pos,
                   len(request.tokens), len(request.token_times), len(request.token_logprobs), request.done,
                   request.finish_reason, request.counts, request.approx_from, request.first_logits,
                   request.first_token_at, request.draft, dict(counters))  # fmt: skip

    def restore(self, request: Request, counters: dict[str, int]) -> None:
        request.started, request.preempted, request.phase = self.started, self.preempted, self.phase
        request.fed, request.fed_pos, request.done, request.finish_reason = self.fed, self.fed_pos, self.done, self.finish_reason
        del request.tokens[self.tokens :], request.token_times[self.token_times :]
        del request.token_logprobs[self.token_logprobs :]
        request.counts, request.approx_from, request.first_logits = self.counts, self.approx_from, self.first_logits
        request.first_token_at, request.plan = self.first_token_at, None
        counters.clear()
        counters.update(self.counters)


def _collect(finished: list[Completion], completion: Completion | None) -> None:
    if completion is not None:
        finished.append(completion)


def token_logprobs(logits: torch.Tensor, ids: Sequence[int], k: int) -> list[TokenLogprob]:
    """The log-probability of ``ids[j]`` under row ``j`` of ``logits`` (the raw ``log_softmax``, fp32) and each
    row's ``k`` likeliest tokens: a generated token's logprobs (``_accept``) and a score row's (``_finish_score``)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, torch.tensor(list(ids), device=logp.device).unsqueeze(-1)).squeeze(-1).tolist()
    k = min(k, logp.shape[-1])
    top_v, top_i = torch.topk(logp, k, dim=-1) if k else (None, None)
    return [TokenLogprob(float(value), tuple(zip(top_i[j].tolist(), top_v[j].tolist(), strict=True)) if k else ())
            for j, value in enumerate(chosen)]  # fmt: skip
