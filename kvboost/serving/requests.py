"""What a client of the engine loop holds: sampling settings in, a handle out (token events, then a completion).

A :class:`RequestHandle` is filled by the loop's thread and read from any thread or event loop: iterate it (blocking)
or ``async for`` over :meth:`RequestHandle.stream`; :meth:`~RequestHandle.result` / :meth:`~RequestHandle.aresult`
wait for the :class:`Completion`. ``cancel()`` is safe from anywhere; the loop frees the request's blocks at its next
step.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

#: Why a request ended: ``stop`` (end-of-sequence or a stop string), ``length`` (``max_tokens`` or the model's
#: context), ``cancelled`` (the client), ``timeout`` (the request's deadline), ``error`` (see ``Completion.error``),
#: ``shutdown`` (the loop stopped first).
FINISH_REASONS = ("stop", "length", "cancelled", "timeout", "error", "shutdown")


class QueueFull(RuntimeError):
    """The loop's waiting queue is full; try again after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class LoopStopped(RuntimeError):
    """The engine loop is not running (never started, or shut down)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request settings. ``temperature`` 0 is greedy; ``top_p`` / ``top_k`` filter before sampling; ``seed``
    gives the request its own generator (same seed, same tokens, whatever else is batched with it)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):  # fmt: skip
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id, the text it adds (may be empty while a multi-byte character is incomplete,
    or held back while it could start a stop string) and its index among the generated tokens."""

    token_id: int
    text: str
    index: int


@dataclass
class Completion:
    """A finished request."""

    request_id: str
    prompt_tokens: int
    output_ids: list[int]
    text: str
    finish_reason: str
    cached_tokens: int = 0
    content_tokens: int = 0
    error: str | None = None
    arrival: float = 0.0
    first_token_at: float | None = None
    finished_at: float = 0.0
    token_times: list[float] = field(default_factory=list)
    preemptions: int = 0

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival


class RequestHandle:
    """The client's side of one request (filled by the loop thread)."""

    def __init__(self, request_id: str, prompt_tokens: int, canceller) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.arrival = time.perf_counter()
        self._events: list[TokenEvent] = []
        self._completion: Completion | None = None
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._canceller = canceller
        self.cancel_requested = False

    # ------------------------------------------------------------------ loop side
    def _push(self, event: TokenEvent | None = None, completion: Completion | None = None) -> None:
        with self._cond:
            if event is not None:
                self._events.append(event)
            if completion is not None:
                self._completion = completion
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for loop, ev in waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # that event loop is closed: its reader is gone
                pass

    # ------------------------------------------------------------------ client side
    @property
    def done(self) -> bool:
        return self._completion is not None

    def cancel(self) -> None:
        """Ask the loop to stop this request and free its blocks (idempotent; a finished request stays finished)."""
        if not self.done and not self.cancel_requested:
            self.cancel_requested = True
            self._canceller(self)

    def __iter__(self) -> Iterator[TokenEvent]:
        index = 0
        while True:
            with self._cond:
                while index >= len(self._events) and self._completion is None:
                    self._cond.wait()
                pending = self._events[index:]
                finished = self._completion is not None
            yield from pending
            index += len(pending)
            if finished and index >= len(self._events):
                return

    async def stream(self) -> AsyncIterator[TokenEvent]:
        """The token events as they come, from an asyncio event loop."""
        loop = asyncio.get_running_loop()
        index = 0
        while True:
            with self._cond:
                pending = self._events[index:]
                finished = self._completion is not None
                waiter = None
                if not pending and not finished:
                    waiter = asyncio.Event()
                    self._waiters.append((loop, waiter))
            for event in pending:
                yield event
            index += len(pending)
            if finished and not pending:
                return
            if waiter is not None:
                await waiter.wait()

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the completion (``TimeoutError`` after ``timeout`` seconds of waiting)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._completion is not None, timeout=timeout):
                raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
            return self._completion  # type: ignore[return-value]

    async def aresult(self) -> Completion:
        async for _ in self.stream():
            pass
        return self._completion  # type: ignore[return-value]
