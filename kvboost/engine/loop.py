"""One engine thread for many clients: :class:`EngineLoop` drives the engine's core (``engine.core``, the only one)
on a thread of its own while any thread (or asyncio task) submits requests and reads their handles.

The engine (model, pool, cache) is touched by the loop thread only; clients hand it requests through the core's
inbox, and other engine work (``warm``, ``cache_stats``) through :meth:`EngineLoop.call`. Text stays on the clients'
side: tokenization and validation run on the submitting thread (a bad prompt fails its caller at once), the text of
the answers on the reading thread, under the engine's tokenizer lock, which the loop thread never takes. A second
thread of the loop's, the frontend worker, stores each finished chat turn as the next turn will tokenize it (it
tokenizes, then submits a store request to the core).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from kvboost.engine.frontend import TokenizedPrompt, tokenize_prompt
from kvboost.engine.requests import LoopStopped, RequestHandle, SamplingParams
from kvboost.prompts import Prompt

log = logging.getLogger(__name__)

#: The server's default deadline of a request (seconds); ``request_timeout_s=None`` keeps it, 0 turns it off.
DEFAULT_REQUEST_TIMEOUT_S = 600.0


class EngineLoop:
    """Drive ``engine.core`` from one thread; see the module docstring. ``max_waiting`` bounds the queue (``submit``
    raises :class:`QueueFull` past it), ``request_timeout_s`` is the default per-request deadline (default
    :data:`DEFAULT_REQUEST_TIMEOUT_S`; 0: none). ``refresh_shared_s``: how often the store looks for entries other
    processes wrote to its shared tiers (Redis: a tier indexes what it holds at start; without a refresh, replicas
    sharing one Redis would see only that). ``max_batch_tokens``: a fixed step budget; None (default) keeps the
    engine's (``core={"max_batch_tokens": N}``, else the device's default: :mod:`kvboost.engine.budget`)."""

    def __init__(self, engine: Any, *, max_running: int = 64, max_batch_tokens: int | None = None,
                 max_waiting: int | None = 256, request_timeout_s: float | None = None,
                 refresh_shared_s: float | None = 1.0) -> None:  # fmt: skip
        self.engine = engine
        self.core = engine.core
        if self.core.driver is not None and self.core.driver.is_alive():
            raise RuntimeError("another EngineLoop drives this engine already; shut it down first")
        timeout = DEFAULT_REQUEST_TIMEOUT_S if request_timeout_s is None else request_timeout_s
        self.core.configure(max_waiting=max_waiting, request_timeout_s=timeout or None)
        self.core.scheduler.max_running = max_running
        if max_batch_tokens is not None:  # explicit: a fixed budget; None keeps the engine's (its core option, or
            self.core.scheduler.max_batch_tokens = max_batch_tokens  # the device's default, kvboost.engine.budget)
        self.max_waiting = max_waiting
        shared = any(hasattr(tier, "refresh") for tier in getattr(engine.store, "tiers", ()))
        self.refresh_shared_s = refresh_shared_s if shared and refresh_shared_s else None
        self.shared_entries_found = 0
        self._calls: deque[tuple[Callable[[Any], Any], concurrent.futures.Future]] = deque()
        self._turns: queue.Queue = queue.Queue()  # finished chat requests for the frontend worker
        self._thread: threading.Thread | None = None
        self._frontend: threading.Thread | None = None
        self._stopping = False
        self._running = False
        self._holds_pool = False  # a hold of the quantized decode step's own pool (start until the thread ends)
        self._hook: Callable[[Any], None] | None = None  # core.on_finished before start
        self._stats: dict[str, Any] = self.core.stats()
        self._lock = threading.Lock()
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EngineLoop:
        if self._thread is not None:
            raise RuntimeError("this engine loop was started already")
        self._running = True
        self._holds_pool = getattr(getattr(self.engine, "runner_config", None), "decode", None) == "quantized"
        if self._holds_pool:
            # HTTP threads and clients share the cores with the decode step here: its own pool copes with that (held
            # until the loop's thread ends, then OpenMP again for a process that goes on alone)
            from kvboost.runtime.quant_step import hold_decode_pool

            hold_decode_pool()
        self._thread = threading.Thread(target=self._run, name="kvboost-engine-loop", daemon=True)
        self.core.driver = self._thread
        self._hook = self.core.on_finished  # the engine's own (canonical stores when nothing drives it): put back
        self.core.on_finished = self._turns.put
        self._frontend = threading.Thread(target=self._store_turns, name="kvboost-frontend", daemon=True)
        self._thread.start()
        self._frontend.start()
        return self

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the thread after the step in flight; requests still in flight end with ``finish_reason="shutdown"``.
        The engine stays open."""
        with self._lock:
            if self._thread is None or self._stopping:
                return
            self._stopping = True
        self.core.wake()
        self._thread.join(timeout)
        self._turns.put(None)
        if self._frontend is not None:
            self._frontend.join(timeout)

    @property
    def running(self) -> bool:
        return self._running and not self._stopping

    # ------------------------------------------------------------------ clients
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, cache_salt: str = "",
               chat: bool | None = None, request_id: str | None = None, timeout_s: float | None = None,
               score_ids: Sequence[int] | None = None) -> RequestHandle:  # fmt: skip
        """Queue a request (thread-safe). Raises on a bad prompt (``PromptError`` / ``ValueError``), ``QueueFull``,
        ``LoopStopped``. With ``params.n`` > 1 the handle is the first sample's; ``handle.samples`` holds all n.
        ``score_ids``: teacher-forced rows after the prompt (``kvboost.engine.frontend.generate_request``)."""
        if not self.running:
            raise LoopStopped("the engine loop is not running" + (f" (it failed: {self.error!r})" if self.error else ""))
        request = self.core.prepare(prompt, params or SamplingParams(), cache_salt=cache_salt, chat=chat,
                                    request_id=request_id, timeout_s=timeout_s, score_ids=score_ids)  # fmt: skip
        if not self.running:
            raise LoopStopped("the engine loop is shutting down")
        return self.core.submit(request)

    def tokenize(self, prompt: Prompt, *, chat: bool | None = None) -> TokenizedPrompt:
        """``prompt`` tokenized as a request would be (thread-safe); ``submit`` takes the result in its place."""
        return tokenize_prompt(self.engine, prompt, chat=chat)

    def warm(self, text: Prompt, *, pin: bool = False, cache_salt: str = "", chat: bool | None = None,
             timeout: float | None = None) -> Any:
        """``engine.warm`` through the loop (blocks the calling thread until stored): the text is tokenized here,
        never on the loop thread (a long document there stalled every decode), and the store runs in the loop's
        steps beside the other requests. Raises ``LoopStopped`` when the loop stops before it is stored."""
        from kvboost.engine.inference import warm_result

        if not self.running:
            raise LoopStopped("the engine loop is not running")
        request = self.engine.prepare_warm(text, pin=pin, cache_salt=cache_salt, chat=chat)
        if not self.running:
            raise LoopStopped("the engine loop is shutting down")
        self.core.submit(request, internal=True).wait(timeout)
        if request.finish_reason == "shutdown":
            raise LoopStopped("the engine loop stopped before the text was stored")
        return warm_result(request)

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the loop thread between steps; its result (or exception) in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.running:
                future.set_exception(LoopStopped("the engine loop is not running"))
                return future
            self._calls.append((fn, future))
        self.core.wake()
        return future

    def stats(self) -> dict[str, Any]:
        """A snapshot (updated after every step): queue lengths, KV use, prefix-cache counters."""
        with self._lock:
            return {**self._stats, "running": self.running}

    # ------------------------------------------------------------------ the threads
    def _run(self) -> None:
        core = self.core
        last_refresh = time.monotonic()
        try:
            while not self._stopping:
                if self.refresh_shared_s and time.monotonic() - last_refresh >= self.refresh_shared_s:
                    try:
                        with core.exclusive():  # the store's books: not while unpin / reset_cache / close change them
                            self.shared_entries_found += self.engine.store.refresh()
                    except Exception as exc:
                        log.warning("kvboost: refreshing the shared cache tiers failed: %r", exc)
                    last_refresh = time.monotonic()
                core.wait_for_work(self.refresh_shared_s, lambda: self._stopping or bool(self._calls))
                if self._stopping:
                    break
                with self._lock:
                    calls, self._calls = list(self._calls), deque()
                for fn, future in calls:
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn(self.engine))
                        except BaseException as exc:
                            future.set_exception(exc)
                if core.has_work():
                    core.step()
                with self._lock:
                    self._stats = core.stats()
        except BaseException as exc:
            log.exception("kvboost engine loop failed")
            self.error = exc
        finally:
            with self._lock:
                self._running = False
                calls, self._calls = list(self._calls), deque()
            try:
                core.abort_all("error" if self.error else "shutdown")
            except Exception:
                log.exception("kvboost engine loop: ending the requests in flight failed")
            for _, future in calls:
                future.set_exception(LoopStopped("the engine loop stopped"))
            core.driver = None
            # the hook the engine had: add_request turns stepped by their caller after this loop still get their
            # canonical store (None here left them without one)
            core.on_finished = self._hook
            if self._holds_pool:
                from kvboost.runtime.quant_step import release_decode_pool

                release_decode_pool()
            with self._lock:
                self._stats = {**core.stats(), "num_waiting": 0}

    def _store_turns(self) -> None:
        """The frontend worker: the canonical store of each finished chat turn (tokenizes here, computes on the
        loop thread as a store request)."""
        from kvboost.engine.frontend import canonical_store_request

        while True:
            request = self._turns.get()
            if request is None or not self.running:
                return
            if request.own_canonical:
                continue
            try:
                job = canonical_store_request(self.engine, request)
                if job is not None:
                    self.core.submit(job, internal=True)
            except Exception:
                log.exception("kvboost: the canonical store of request %s failed", request.request_id)
