"""The engine's request loop, one step at a time: ``add`` requests, call ``step`` until ``has_work`` is False.

Each step (on one thread; :class:`~kvboost.serving.loop.EngineLoop` runs it on its own thread for servers):
end cancelled and timed-out requests -> start waiting requests (:class:`~kvboost.serving.scheduler.Scheduler`:
lookup and assembly of their cached prefix, by reference) -> the step's rows (one token per decoding request, prompt
chunks under the token budget, preempting when blocks run out) -> one forward of the runner over all of them -> a
token per finished prefill and per decoding row, sampled with the request's own settings and generator -> finished
requests store their new chunks and free their blocks. A request whose lookup finds content hits (reordered chunks
to re-rotate and repair) is prefilled alone when it starts: its recompute strategy runs layer by layer over that
one sequence. At the end of a step, after the completions were handed out, a finished chat request's answer is
stored once more as the next turn will tokenize it (``engine.store_canonical``, :mod:`kvboost.reuse.canonical`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvboost.decoding import Sampling, pick_token
from kvboost.generation import PhaseClock, ReuseCounts
from kvboost.kv.block_table import BlockTable
from kvboost.kv.pool import PoolExhausted
from kvboost.plan import ReusePlan
from kvboost.prompts import Prompt, chat_messages
from kvboost.reuse.assemble import assemble_exact
from kvboost.runtime import pipeline
from kvboost.runtime.batch import ForwardBatch, SeqInput
from kvboost.runtime.sequences import Request
from kvboost.serving.requests import Completion, RequestHandle, SamplingParams, TokenEvent
from kvboost.serving.scheduler import Scheduler

log = logging.getLogger(__name__)
_ids = itertools.count()


class ServeSeq:
    """One request inside the loop: the runtime :class:`Request`, what is left to prefill, its client handle."""

    def __init__(self, engine: Any, handle: RequestHandle, params: SamplingParams, ids: list[int], spans: list,
                 salt: str, clock: PhaseClock, deadline: float | None, max_new: int, *, mode: str = "reuse",
                 store: bool = True) -> None:  # fmt: skip
        self.engine, self.handle, self.params, self.salt, self.deadline = engine, handle, params, salt, deadline
        self.ids, self.spans, self.clock = ids, spans, clock
        generator = engine.generator
        if params.seed is not None:
            generator = torch.Generator(device=engine.adapter.device).manual_seed(params.seed)
        sampling = Sampling(do_sample=not params.greedy, temperature=params.temperature or 1.0, top_k=params.top_k,
                            top_p=params.top_p)  # fmt: skip
        self.request = Request(ids, spans, BlockTable(engine.pool), sampling, max_new, mode=mode, salt=salt,
                               store=store, generator=generator, clock=clock)  # fmt: skip
        self.fed: list[int] = []
        self.fed_pos = 0
        self.decoding = False
        self.started = False
        self.preempted = False
        self.preemptions = 0
        self.admitted_at = 0
        self.cancelled = False
        self.finish_reason: str | None = None
        self.text = ""
        self.emitted = 0
        self.detokenize = True
        self.prefix_offset = self.read_offset = 0
        self.result: Any = None
        self.keep_logits = False
        self.token_times: list[float] = []
        self.first_token_at: float | None = None
        self._keys: list | None = None
        self.score_ids: Sequence[int] | None = None
        self.messages: list[dict[str, str]] | None = None  # the chat messages of the prompt (None: text or ids)

    # ------------------------------------------------------------------ for the scheduler
    def pending_tokens(self) -> int:
        return 1 if self.decoding else len(self.fed) - self.fed_pos

    def blocks_needed(self, n: int) -> int:
        table, pool = self.request.table, self.engine.pool
        need = max(0, pool.blocks_for(table.length + n) - len(table.blocks))
        if table.length % pool.block_size and table.blocks and pool.refcount(table.blocks[-1]) > 1:
            need += 1  # the shared partial last block is copied before it is written
        return need

    def admit_blocks(self) -> int:
        pool = self.engine.pool
        rows = len(self.ids) + len(self.request.tokens) + 1
        return max(1, pool.blocks_for(rows) - self.cached_prefix // pool.block_size + 1)

    @property
    def cached_prefix(self) -> int:
        """Tokens of the prompt's leading chunks in the store now (no access counted), for the queue order."""
        engine = self.engine
        if self._keys is None:  # hashed once, when the queue is first ordered with this request in it
            self._keys = engine.hasher.chunk_keys(self.ids, self.spans, engine.fingerprint, self.salt)
        cached = 0
        store = engine.store
        for key, span in zip(self._keys, self.spans, strict=False):
            if key.prefix_key not in store:
                break
            cached = span.end
        return cached


class EngineCore:
    """Requests in, tokens out, one :meth:`step` at a time (single-threaded; see :class:`EngineLoop` for threads)."""

    def __init__(self, engine: Any, *, max_running: int = 64, max_batch_tokens: int = 2048,
                 max_waiting: int | None = 256, request_timeout_s: float | None = None,
                 cache_aware_limit: int = 64, isolate_errors: bool = False) -> None:  # fmt: skip
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {request_timeout_s!r}")
        self.engine = engine
        self.scheduler = Scheduler(max_running=max_running, max_batch_tokens=max_batch_tokens, max_waiting=max_waiting,
                                   cache_aware_limit=cache_aware_limit)  # fmt: skip
        self.request_timeout_s = request_timeout_s
        # A server ends only the request that failed (finish_reason "error") and keeps serving the others;
        # generate() / generate_batch() let the exception reach their caller.
        self.isolate_errors = isolate_errors
        self.counters = {"prefix_query_tokens": 0, "prefix_hit_tokens": 0, "content_hit_tokens": 0,
                         "recompute_pairs": 0, "requests_finished": 0, "preemptions": 0, "steps": 0,
                         "prompt_tokens": 0, "generation_tokens": 0, "canonical_prefill_tokens": 0}  # fmt: skip
        # end-to-end seconds of the last 64 requests, for Retry-After; replaced (never mutated) so that a submitting
        # thread reads a whole list while the loop thread finishes requests
        self.recent_latencies: list[float] = []
        # finished chat requests whose answer is stored again as the next turn tokenizes it, at the end of the step:
        # (seq, a fork of its block table)
        self._canonical: list[tuple[ServeSeq, BlockTable]] = []

    # ------------------------------------------------------------------ requests in
    def prepare(self, prompt: Prompt, params: SamplingParams, *, cache_salt: str = "", chat: bool | None = None,
                request_id: str | None = None, timeout_s: float | None = None, canceller=None, mode: str = "reuse",
                store: bool = True, clock: PhaseClock | None = None) -> ServeSeq:  # fmt: skip
        """Tokenize and validate a request (no engine state changes; any thread that holds the tokenizer).
        ``mode``/``store`` as ``engine.generate``'s; ``clock``: where the request's TTFT starts (default: now)."""
        engine = self.engine
        if engine._closed:
            raise RuntimeError("this engine is closed")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if mode not in pipeline.MODES:
            raise ValueError(f"unknown mode {mode!r}; use one of {pipeline.MODES}")
        clock = clock or PhaseClock(engine.adapter.device)
        ids, spans = engine.tokenize_with_spans(prompt, chat=chat)
        n = len(ids)
        max_new = min(params.max_tokens, (engine.adapter.max_positions or n + params.max_tokens) - n)
        pipeline.check_memory(engine, n + max_new)
        clock.mark("tokenized")
        timeout = timeout_s if timeout_s is not None else self.request_timeout_s
        handle = RequestHandle(request_id or f"req-{next(_ids)}", n, canceller or self._cancel)
        deadline = time.perf_counter() + timeout if timeout else None
        seq = ServeSeq(engine, handle, params, ids, spans, cache_salt, clock, deadline, max_new, mode=mode, store=store)
        seq.messages = chat_messages(engine.tokenizer, prompt, chat=engine.chat if chat is None else chat)
        handle._seq = seq  # type: ignore[attr-defined]
        return seq

    def add(self, seq: ServeSeq) -> RequestHandle:
        self.scheduler.add(seq)
        return seq.handle

    def submit(self, prompt: Prompt, params: SamplingParams | None = None, **options: Any) -> RequestHandle:
        """``prepare`` + ``add`` (single-threaded use: ``engine.add_request``)."""
        return self.add(self.prepare(prompt, params or SamplingParams(), **options))

    @staticmethod
    def _cancel(handle: RequestHandle) -> None:
        handle._seq.cancelled = True  # type: ignore[attr-defined]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Completion]:
        """One iteration; returns the requests that finished in it."""
        finished: list[Completion] = []
        self._end_expired(finished)
        pool = self.engine.pool
        free = lambda: pool.num_free
        with torch.inference_mode():
            self.scheduler.admit(free, self._make_room, lambda seq: self._guarded(seq, finished, self._start, seq,
                                                                                  finished))  # fmt: skip
            plan = self.scheduler.plan_step(free, self._make_room)
            for seq in plan.preempted:
                self._preempt(seq)
            if plan.rows:
                try:
                    self._forward(plan.rows, finished)
                except Exception as exc:
                    if not self.isolate_errors:
                        raise
                    for seq, _ in plan.rows:  # the forward itself failed: each of its rows ends with the error
                        if seq in self.scheduler.running:
                            self._fail(seq, exc, finished)
            self._store_canonical()
        self.counters["steps"] += 1
        return finished

    def _guarded(self, seq: ServeSeq, finished: list[Completion], fn, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:
            if not self.isolate_errors:
                raise
            self._fail(seq, exc, finished)

    def _fail(self, seq: ServeSeq, exc: Exception, finished: list[Completion]) -> None:
        log.exception("kvboost: request %s failed", seq.handle.request_id, exc_info=exc)
        if not seq.handle.done:
            finished.append(self._finish(seq, "error", error=f"{type(exc).__name__}: {exc}"))

    def _make_room(self, blocks: int) -> None:
        self.engine.pool.reclaim(blocks)

    def _end_expired(self, finished: list[Completion]) -> None:
        now = time.perf_counter()
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            if seq.cancelled:
                finished.append(self._finish(seq, "cancelled"))
            elif seq.deadline is not None and now > seq.deadline:
                finished.append(self._finish(seq, "timeout", error="the request ran past its timeout"))

    def _start(self, seq: ServeSeq, finished: list[Completion]) -> None:
        """Lookup and assembly (exact hits by reference); a request with content hits is prefilled here, alone."""
        engine, request = self.engine, seq.request
        resumed = seq.started
        seq.started, seq.preempted = True, False
        plan = pipeline.plan_for(engine, request)
        request.clock.mark("looked_up")
        if plan.content_tokens and resumed:
            plan = ReusePlan.cold(request.ids, request.spans)  # a resumed request recomputes what it cannot share
        request.plan = plan
        if not resumed:
            self.counters["prefix_query_tokens"] += len(seq.ids)
            self.counters["prompt_tokens"] += len(seq.ids)
        if plan.content_tokens:
            try:
                pipeline.prefill(engine, request, looked_up=True)
            except PoolExhausted as exc:
                finished.append(self._finish(seq, "error", error=str(exc)))
                return
            self._count_reuse(seq)
            self._after_first_token(seq, finished)
            seq.decoding = not request.done
            return
        assembly = assemble_exact(plan, request.table, engine.quantizer)
        request.clock.mark("assembled")
        seq.fed = request.ids[plan.exact_prefix :] + (list(request.tokens) if resumed else [])
        seq.fed_pos = 0
        if not resumed:
            request.counts = ReuseCounts(cached_tokens=plan.reused_tokens, exact_tokens=plan.exact_tokens,
                                         content_tokens=0, extra={"prefill_tokens": len(plan) - plan.exact_prefix,
                                                                  "shared_blocks": assembly.shared_blocks,
                                                                  "loaded_rows": assembly.loaded_rows})  # fmt: skip
            self._count_reuse(seq)

    def _count_reuse(self, seq: ServeSeq) -> None:
        counts = seq.request.counts
        self.counters["prefix_hit_tokens"] += counts.exact_tokens
        self.counters["content_hit_tokens"] += counts.content_tokens
        self.counters["recompute_pairs"] += counts.recomputed_pairs

    def _preempt(self, seq: ServeSeq) -> None:
        """Free the request's blocks and queue it again; it is recomputed (prompt + tokens so far) when it restarts."""
        seq.request.table.release()
        seq.request.table = BlockTable(self.engine.pool)
        seq.decoding, seq.preempted = False, True
        seq.preemptions += 1
        self.counters["preemptions"] += 1
        self.scheduler.requeue(seq)

    def _forward(self, rows: Sequence[tuple[ServeSeq, int]], finished: list[Completion]) -> None:
        inputs = []
        for seq, n in rows:
            if seq.decoding:
                inputs.append(SeqInput(seq.request.table, [seq.request.tokens[-1]]))
            else:
                inputs.append(SeqInput(seq.request.table, seq.fed[seq.fed_pos : seq.fed_pos + n]))
        first_chunks = [seq for seq, _ in rows if not seq.decoding and seq.fed_pos == 0 and not seq.request.tokens]
        for seq in first_chunks:
            seq.request.counts.extra.update(batched_prefill=len(first_chunks), layerwise=False)
        logits = self.engine.runner.run(ForwardBatch.build(inputs))
        for row, (seq, n) in enumerate(rows):
            self._guarded(seq, finished, self._after_forward, seq, n, logits[row], finished)

    def _after_forward(self, seq: ServeSeq, n: int, logits: torch.Tensor, finished: list[Completion]) -> None:
        """The row's new token (a decode row, or a prefill whose last chunk ran), or nothing (a prompt chunk)."""
        engine, request = self.engine, seq.request
        if not seq.decoding:
            seq.fed_pos += n
            if seq.fed_pos < len(seq.fed):
                return  # a prompt chunk: the next one comes next step
            if not request.tokens:  # the prompt's last chunk: the first token (TTFT)
                pipeline.first_token(engine, request, logits, request.counts, None)
                self._after_first_token(seq, finished)
                seq.decoding = not request.done and seq.finish_reason is None
                return
            seq.decoding = True  # a resumed request: its prefill's logits give its next token
        request.accept(pick_token(logits, request.sampling, request.generator), engine.eos_ids,
                       engine.adapter.max_positions)  # fmt: skip
        self._emit(seq, finished)

    def _after_first_token(self, seq: ServeSeq, finished: list[Completion]) -> None:
        seq.first_token_at = time.perf_counter()
        self._emit(seq, finished)
        if self.engine.speculative.enabled and not seq.request.done and seq.finish_reason is None:
            pipeline.decode_speculatively(self.engine, seq.request)
            self._emit(seq, finished)

    # ------------------------------------------------------------------ tokens out
    def _emit(self, seq: ServeSeq, finished: list[Completion]) -> None:
        """Events for the tokens not yet sent; stop strings end the request; a done request finishes."""
        request = seq.request
        now = time.perf_counter()
        new = request.tokens[len(seq.token_times) :]
        seq.token_times.extend([now] * len(new))
        if seq.detokenize:
            self._detokenize(seq)
        stop_at = min((i for i in (seq.text.find(s) for s in seq.params.stop) if i >= 0), default=-1)
        if stop_at >= 0:
            seq.text = seq.text[:stop_at]
            seq.finish_reason = "stop"
        done = request.done or seq.finish_reason is not None
        if done and seq.detokenize:
            self._detokenize(seq, final=True)
            if stop_at >= 0:
                seq.text = seq.text[:stop_at]
        # hold back what could still become a stop string
        hold = 0 if done else max((len(s) - 1 for s in seq.params.stop), default=0)
        upto = max(seq.emitted, len(seq.text) - hold)
        for i, token in enumerate(new):
            last = i == len(new) - 1
            delta = seq.text[seq.emitted : upto] if last else ""
            seq.handle._push(TokenEvent(token, delta, len(request.tokens) - len(new) + i))
        seq.emitted = upto
        if done:
            reason = seq.finish_reason or ("stop" if request.tokens and request.tokens[-1] in self.engine.eos_ids
                                           else "length")  # fmt: skip
            finished.append(self._finish(seq, reason))

    def _detokenize(self, seq: ServeSeq, *, final: bool = False) -> None:
        """Incremental detokenization (a window of tokens per call, not the whole answer): the text of
        ``tokens[prefix:]`` minus that of ``tokens[prefix:read]`` is what the new tokens add, once it does not end
        in an incomplete character."""
        tokens, decode = seq.request.tokens, self.engine.tokenizer.decode
        before = decode(tokens[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
        after = decode(tokens[seq.prefix_offset :], skip_special_tokens=True)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            seq.text += after[len(before) :]
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(tokens)

    def _finish(self, seq: ServeSeq, reason: str, *, error: str | None = None) -> Completion:
        """Store (a request that ended normally), free the blocks, hand the completion to the client."""
        request = seq.request
        self.scheduler.remove(seq)
        try:
            if reason in ("stop", "length") and request.tokens:
                request.finish_decoding()
                seq.result = pipeline.finish(self.engine, request, keep_logits=seq.keep_logits, score_ids=seq.score_ids)
                self._queue_canonical(seq)
        finally:
            request.table.release()
        now = time.perf_counter()
        completion = Completion(
            request_id=seq.handle.request_id, prompt_tokens=len(seq.ids), output_ids=list(request.tokens),
            text=seq.text, finish_reason=reason, cached_tokens=request.counts.cached_tokens,
            content_tokens=request.counts.content_tokens, error=error, arrival=seq.handle.arrival,
            first_token_at=seq.first_token_at, finished_at=now, token_times=list(seq.token_times),
            preemptions=seq.preemptions,
        )  # fmt: skip
        self.counters["requests_finished"] += 1
        self.counters["generation_tokens"] += len(request.tokens)
        self.recent_latencies = [*self.recent_latencies[-63:], now - seq.handle.arrival]
        seq.handle._push(completion=completion)
        return completion

    # ------------------------------------------------------------------ the answer as the next turn sees it
    def _queue_canonical(self, seq: ServeSeq) -> None:
        """Keep the blocks of a finished chat request (by reference) for its canonical store at the end of the step.
        Only requests that stored their generated tokens (not ``cold``, ``store=False`` or ``store_generated=False``);
        a ``score_ids`` request's table was cut back to its prompt."""
        engine, request = self.engine, seq.request
        if (getattr(engine, "store_canonical", False) and engine.store_generated and seq.messages
                and request.mode != "cold" and request.store and seq.score_ids is None):  # fmt: skip
            self._canonical.append((seq, request.table.fork()))

    def _store_canonical(self) -> None:
        """Store the queued answers as the next turns will tokenize them (after the step's completions went out):
        a failure there is logged, never the request's (it has finished)."""
        from kvboost.reuse.canonical import canonical_turn, store_canonical

        queued, self._canonical = self._canonical, []
        for i, (seq, table) in enumerate(queued):
            request, extra = seq.request, seq.result.extra if seq.result is not None else {}
            try:
                turn = canonical_turn(self.engine, seq.messages, request.ids, request.tokens)
                if turn is None:
                    extra["canonical_skipped"] = "the chat template cannot render the answered turn"
                    continue
                done = store_canonical(self.engine, turn, table, approx_from=request.approx_from, salt=seq.salt)
            except Exception:
                if not self.isolate_errors:
                    for _, rest in queued[i + 1 :]:
                        rest.release()
                    raise
                log.exception("kvboost: canonical store of request %s failed", seq.handle.request_id)
                continue
            finally:
                table.release()
            self.counters["canonical_prefill_tokens"] += done.prefilled_tokens
            extra.update(done.as_extra())

    def abort_all(self, reason: str = "shutdown") -> None:
        """End every request (the loop stops)."""
        for seq in list(self.scheduler.waiting) + list(self.scheduler.running):
            self._finish(seq, reason, error=f"the engine loop stopped ({reason})")
        queued, self._canonical = self._canonical, []
        for _, table in queued:  # canonical stores not made: their block references go back
            table.release()

    def stats(self) -> dict[str, Any]:
        pool = self.engine.pool
        return {"num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
                "kv_usage": pool.num_used / pool.num_blocks if pool.num_blocks else 0.0,
                "num_preempted_total": self.counters["preemptions"], **self.counters}  # fmt: skip
