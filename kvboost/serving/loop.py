"""One engine thread for many clients: :class:`EngineLoop` runs :class:`~kvboost.serving.core.EngineCore` steps on
its own thread while any thread (or asyncio task) submits requests and reads their handles.

The engine (model, pool, cache) is touched by the loop thread only; clients hand it requests through an inbox, and
other engine work (``warm``, ``cache_stats``) through :meth:`EngineLoop.call`. Tokenization and validation run on
the submitting thread (a bad prompt fails its caller at once), under one lock that the loop thread holds while it
steps (it detokenizes): HF's fast tokenizers are not safe to use from two threads at once, and a submitter waits at
most one step.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from kvboost.prompts import Prompt
from kvboost.serving.core import EngineCore
from kvboost.serving.requests import LoopStopped, QueueFull, RequestHandle, SamplingParams

log = logging.getLogger(__name__)


class EngineLoop:
    """Serve an engine from one thread; see the module docstring. ``max_waiting`` bounds the queue (``submit``
    raises :class:`QueueFull` past it), ``request_timeout_s`` is the default per-request deadline.
    ``refresh_shared_s``: how often the store looks for entries other processes wrote to its shared tiers (Redis:
    a tier indexes what it holds at start; without a refresh, replicas sharing one Redis would see only that)."""

    def __init__(self, engine: Any, *, max_running: int = 64, max_batch_tokens: int = 2048,
                 max_waiting: int | None = 256, request_timeout_s: float | None = None,
                 refresh_shared_s: float | None = 1.0) -> None:  # fmt: skip
        self.engine = engine
        self.core = EngineCore(engine, max_running=max_running, max_batch_tokens=max_batch_tokens,
                               max_waiting=None, request_timeout_s=request_timeout_s, isolate_errors=True)  # fmt: skip
        self.max_waiting = max_waiting
        shared = any(hasattr(tier, "refresh") for tier in getattr(engine.store, "tiers", ()))
        self.refresh_shared_s = refresh_shared_s if shared and refresh_shared_s else None
        self.shared_entries_found = 0
        self._tok_lock = threading.RLock()
        self._cond = threading.Condition()
        self._inbox: deque[Any] = deque()
        self._calls: deque[tuple[Callable[[Any], Any], concurrent.futures.Future]] = deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._running = False
        self._stats: dict[str, Any] = self.core.stats()
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EngineLoop:
        if self._thread is not None:
            raise RuntimeError("this engine loop was started already")
        self._running = True
        self._thread = threading.Thread(target=self._run, name="kvboost-engine-loop", daemon=True)
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the thread; requests still in flight end with ``finish_reason="shutdown"``. The engine stays open."""
        with self._cond:
            if self._thread is None or self._stopping:
                return
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._running and not self._stopping

    # ------------------------------------------------------------------ clients
    def submit(self, prompt: Prompt, params: SamplingParams | None = None, *, cache_salt: str = "",
               chat: bool | None = None, request_id: str | None = None, timeout_s: float | None = None) -> RequestHandle:  # fmt: skip
        """Queue a request (thread-safe). Raises on a bad prompt (``PromptError`` / ``ValueError``), ``QueueFull``,
        ``LoopStopped``."""
        if not self.running:
            raise LoopStopped("the engine loop is not running" + (f" (it failed: {self.error!r})" if self.error else ""))
        with self._tok_lock:
            seq = self.core.prepare(prompt, params or SamplingParams(), cache_salt=cache_salt, chat=chat,
                                    request_id=request_id, timeout_s=timeout_s, canceller=self._cancel)  # fmt: skip
        with self._cond:
            if not self.running:
                raise LoopStopped("the engine loop is shutting down")
            # read live (a snapshot could still count requests that the step in progress has just started)
            waiting = len(self._inbox) + len(self.core.scheduler.waiting)
            if self.max_waiting is not None and waiting >= self.max_waiting:
                raise QueueFull(f"{waiting} requests are waiting (max_waiting={self.max_waiting}); retry later",
                                retry_after_s=self._retry_after(waiting))  # fmt: skip
            self._inbox.append(seq)
            self._cond.notify_all()
        return seq.handle

    def tokenize(self, prompt: Prompt, *, chat: bool | None = None) -> list[int]:
        with self._tok_lock:
            return self.engine.tokenize_with_spans(prompt, chat=chat)[0]

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the loop thread between steps; its result (or exception) in the future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            if not self.running:
                future.set_exception(LoopStopped("the engine loop is not running"))
                return future
            self._calls.append((fn, future))
            self._cond.notify_all()
        return future

    def stats(self) -> dict[str, Any]:
        """A snapshot (updated after every step): queue lengths, KV use, prefix-cache counters."""
        with self._cond:
            return {**self._stats, "running": self.running}

    def _cancel(self, handle: RequestHandle) -> None:
        handle._seq.cancelled = True  # type: ignore[attr-defined]
        with self._cond:
            self._cond.notify_all()

    def _retry_after(self, waiting: int) -> float:
        latencies = self.core.recent_latencies
        typical = statistics.median(latencies) if latencies else 1.0
        return max(1.0, math.ceil(typical * max(1, waiting) / self.core.scheduler.max_running))

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        core = self.core
        last_refresh = time.monotonic()
        try:
            while True:
                if self.refresh_shared_s and time.monotonic() - last_refresh >= self.refresh_shared_s:
                    try:
                        with self._tok_lock:
                            self.shared_entries_found += self.engine.store.refresh()
                    except Exception as exc:  # noqa: BLE001 - a Redis hiccup: serve on, look again next time
                        log.warning("kvboost: refreshing the shared cache tiers failed: %r", exc)
                    last_refresh = time.monotonic()
                with self._cond:
                    while not (self._inbox or self._calls or self._stopping or core.has_work()):
                        if not self._cond.wait(self.refresh_shared_s) and self.refresh_shared_s:
                            break  # time to look at the shared tiers again
                    if self._stopping:
                        break
                    incoming, self._inbox = list(self._inbox), deque()
                    calls, self._calls = list(self._calls), deque()
                with self._tok_lock:
                    for seq in incoming:
                        core.add(seq)
                    for fn, future in calls:
                        if future.set_running_or_notify_cancel():
                            try:
                                future.set_result(fn(self.engine))
                            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                                future.set_exception(exc)
                    if core.has_work():
                        core.step()
                with self._cond:
                    self._stats = {**core.stats(), "num_waiting": len(core.scheduler.waiting) + len(self._inbox)}
        except BaseException as exc:
            log.exception("kvboost engine loop failed")
            self.error = exc
        finally:
            with self._cond:
                self._running = False
                incoming, self._inbox = list(self._inbox), deque()
                calls, self._calls = list(self._calls), deque()
            for seq in incoming:
                core.add(seq)
            reason = "error" if self.error else "shutdown"
            try:
                with self._tok_lock:
                    core.abort_all(reason)
            except Exception:
                log.exception("kvboost engine loop: ending the requests in flight failed")
            for _, future in calls:
                future.set_exception(LoopStopped("the engine loop stopped"))
            with self._cond:
                self._stats = {**core.stats(), "num_waiting": 0}
