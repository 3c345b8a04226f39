"""What a client of the engine loop holds: sampling settings in, a handle out (token events, then a completion).

A :class:`RequestHandle` is filled by the engine core (token ids) and read from any thread or event loop: iterate it
(blocking) or ``async for`` over :meth:`RequestHandle.stream`; :meth:`~RequestHandle.result` /
:meth:`~RequestHandle.aresult` wait for the :class:`Completion`. The text is made on the reading side.
``cancel()`` is safe from anywhere; the core frees the request's blocks at its next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

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


#: Most log-probabilities of alternatives a request may ask for per token (OpenAI's chat ``top_logprobs`` bound).
MAX_LOGPROBS = 20


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample ``index`` of a request with ``seed`` and ``n`` samples: ``seed + index`` (sample 0 has the
    request's own seed). The ``n`` samples of a request with seed ``s`` are the answers of ``n`` separate requests
    with seeds ``s, s + 1, ..., s + n - 1`` (best-effort determinism, as OpenAI's ``seed``; None: no seed)."""
    return None if seed is None else seed + index


@dataclass(frozen=True)
class SamplingParams:
    """Per-request settings. ``temperature`` 0 is greedy; ``top_p`` / ``top_k`` filter before sampling; ``seed``
    gives the request its own generator (same seed, same tokens, whatever else is batched with it).

    ``n``: samples of the prompt (one prefill; the samples fork its blocks, see ``kvboost.engine.core``), sample
    ``i`` seeded with :func:`sample_seed` ``(seed, i)``. ``logprobs``: None (off), or how many of the likeliest
    alternatives to report with each generated token's own log-probability (0: the token's only). Log-probabilities
    are the model's raw ``log_softmax`` of the logits, before any penalty, bias, temperature, top-k / top-p / min-p
    (vLLM's default).

    vLLM's and OpenAI's logit processors (:class:`kvboost.decoding.Sampling` applies them, greedy requests
    included): ``min_p`` in [0, 1]; ``frequency_penalty`` / ``presence_penalty`` in [-2, 2] (OpenAI's, over the
    answer so far); ``repetition_penalty`` > 0 (vLLM's / HF's, over prompt + answer; 1 off); ``logit_bias``
    {token id: bias in [-100, 100]}; ``min_tokens`` (no stop token before that many); ``stop_token_ids`` (end the
    answer, finish reason ``stop``); ``ignore_eos`` (generate past the model's end-of-sequence tokens)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    n: int = 1
    logprobs: int | None = None
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Any = ()  # {token id: bias} or (id, bias) pairs; kept as sorted pairs
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    #: vLLM's: False keeps special tokens (end-of-sequence, chat markers) in the generated text
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self._check_processors()
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
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n must be a positive integer, got {self.n!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):  # fmt: skip
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    def _check_processors(self) -> None:
        def number(name: str, low: float, high: float, *, open_low: bool = False) -> None:
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
                and (value > low if open_low else value >= low) and value <= high  # fmt: skip
            if not ok:
                raise ValueError(f"{name} must be a number in {'(' if open_low else '['}{low}, {high}], got {value!r}")

        number("min_p", 0, 1)
        number("frequency_penalty", -2, 2)
        number("presence_penalty", -2, 2)
        number("repetition_penalty", 0, math.inf, open_low=True)
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            pairs = sorted((token, bias) for token, bias in pairs)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to biases, got {self.logit_bias!r}") from None
        for token, bias in pairs:
            if not _is_int(token) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
            if not (isinstance(bias, (int, float)) and not isinstance(bias, bool) and -100 <= bias <= 100):
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {token}")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in pairs))
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        stop_ids = tuple(self.stop_token_ids)
        if any(not _is_int(t) or t < 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {list(stop_ids)!r}")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")

    def check_vocab(self, vocab_size: int) -> None:
        """ValueError naming the field when ``logit_bias`` or ``stop_token_ids`` holds an id outside the model's
        vocabulary."""
        for name, ids in (("logit_bias", [t for t, _ in self.logit_bias]), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the model's vocabulary (0-{vocab_size - 1})")

    def processors(self) -> dict[str, Any]:
        """The :class:`kvboost.decoding.Sampling` fields of the logit processors and stop rule."""
        return {"min_p": float(self.min_p), "frequency_penalty": float(self.frequency_penalty),
                "presence_penalty": float(self.presence_penalty), "repetition_penalty": float(self.repetition_penalty),
                "logit_bias": self.logit_bias, "min_tokens": self.min_tokens, "stop_token_ids": self.stop_token_ids,
                "ignore_eos": self.ignore_eos}  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability (the model's raw ``log_softmax``) and the ``top`` likeliest tokens'
    ``(id, log-probability)``, likeliest first (as many as the request asked for)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenEvent:
    """One generated token: its id, the text it adds (may be empty while a multi-byte character is incomplete,
    or held back while it could start a stop string) and its index among the generated tokens; ``logprob`` when the
    request asked for log-probabilities."""

    token_id: int
    text: str
    index: int
    logprob: TokenLogprob | None = None


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
    #: one per output id when the request asked for log-probabilities, else None
    logprobs: list[TokenLogprob] | None = None
    #: which of the request's ``n`` samples this is
    index: int = 0
    #: a ``score_ids`` request with log-probabilities: one per score id (its teacher-forced log-probability after
    #: the prompt and the ids before it, with the likeliest alternatives), else None
    score_logprobs: list[TokenLogprob] | None = None

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.arrival


class RequestHandle:
    """The client's side of one request: the engine core pushes token ids and the completion; the handle makes the
    text on the reading thread (``kvboost.engine.frontend.Detokenizer``: incremental, stop strings; a stop string
    ends the request through ``cancel(reason="stop")``)."""

    def __init__(self, request_id: str, prompt_tokens: int, canceller, *, detokenizer: Any = None) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.arrival = time.perf_counter()
        self._ids: list[int] = []  # token ids pushed by the core
        self._logprobs: list[TokenLogprob | None] = []
        self._events: list[TokenEvent] = []  # with their text, made by the first reader that gets there
        self._raw: Completion | None = None  # the core's completion (no text)
        self._completion: Completion | None = None
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
        self._canceller = canceller
        self._detok = detokenizer
        self.cancel_requested = False
        #: the handles of every sample of the request (``SamplingParams.n``), in order; this one's place in it
        self.samples: list[RequestHandle] = [self]
        self.index = 0

    # ------------------------------------------------------------------ core side
    @property
    def num_events(self) -> int:
        return len(self._ids)

    @property
    def completion(self) -> Completion | None:
        """The core's completion (token ids; ``text`` empty): what ``engine.step()`` returns."""
        return self._raw

    def _push(self, event: TokenEvent | None = None, completion: Completion | None = None) -> None:
        with self._cond:
            if event is not None:
                self._ids.append(event.token_id)
                self._logprobs.append(event.logprob)
            if completion is not None:
                self._raw = completion
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for loop, ev in waiters:
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:  # that event loop is closed: its reader is gone
                pass

    # ------------------------------------------------------------------ text (the reader's thread)
    def _process(self) -> None:
        """Text for the token ids pushed so far (under the handle's lock); a stop string cancels the request; with
        the core's completion in, the final completion (text, ids and reason cut at a stop string)."""
        detok = self._detok
        new = self._ids[len(self._events) :]
        raw = self._raw
        if detok is None:
            self._events += [TokenEvent(t, "", len(self._events) + i, self._logprobs[len(self._events) + i])
                             for i, t in enumerate(new)]  # fmt: skip
        else:
            for token in new:
                if detok.stopped_at is not None:
                    break
                final = raw is not None and len(self._events) + 1 == len(self._ids)
                index = len(self._events)
                self._events.append(TokenEvent(token, detok.feed([token], final=final), index, self._logprobs[index]))
            if detok.stopped_at is not None and raw is None and not self.cancel_requested:
                self.cancel_requested = True
                self._canceller(self, "stop")
        if raw is not None and self._completion is None and (len(self._events) == len(self._ids) or
                                                             (detok is not None and detok.stopped_at is not None)):
            self._completion = self._final(raw)

    def _final(self, raw: Completion) -> Completion:
        detok = self._detok
        if detok is None:
            return raw
        if not raw.output_ids:
            return dataclasses.replace(raw, text=detok.text)
        if detok.stopped_at is None:
            if len(detok.tokens) < len(raw.output_ids):
                detok.feed(raw.output_ids[len(detok.tokens) :], final=True)
            return dataclasses.replace(raw, text=detok.text)
        kept = detok.stopped_at
        reason = "stop" if raw.finish_reason in ("stop", "length") else raw.finish_reason
        logprobs = None if raw.logprobs is None else list(raw.logprobs[:kept])
        return dataclasses.replace(raw, text=detok.text, output_ids=list(raw.output_ids[:kept]), finish_reason=reason,
                                   token_times=list(raw.token_times[:kept]), logprobs=logprobs)  # fmt: skip

    def _ready(self, index: int) -> tuple[list[TokenEvent], bool]:
        """Events from ``index`` on that carry text, and whether the stream ended (under the lock)."""
        self._process()
        pending = self._events[index:]
        if self._detok is not None and self._detok.stopped_at is not None:
            pending = [e for e in pending if e.index < self._detok.stopped_at]
        return pending, self._completion is not None

    # ------------------------------------------------------------------ client side
    @property
    def done(self) -> bool:
        return self._raw is not None

    def cancel(self, reason: str = "cancelled") -> None:
        """Ask the core to stop this request and free its blocks (idempotent; a finished request stays finished)."""
        if not self.done and not self.cancel_requested:
            self.cancel_requested = True
            self._canceller(self, reason)

    def wait(self, timeout: float | None = None) -> Completion:
        """Wait for the core's completion (token ids, no text)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._raw is not None, timeout=timeout):
                raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
            return self._raw  # type: ignore[return-value]

    def __iter__(self) -> Iterator[TokenEvent]:
        index = 0
        while True:
            with self._cond:
                while True:
                    pending, finished = self._ready(index)
                    if pending or finished:
                        break
                    self._cond.wait()
            yield from pending
            index += len(pending)
            if finished and not pending:
                return

    async def stream(self) -> AsyncIterator[TokenEvent]:
        """The token events as they come, from an asyncio event loop."""
        loop = asyncio.get_running_loop()
        index = 0
        while True:
            with self._cond:
                pending, finished = self._ready(index)
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
        """Wait for the completion, with its text (``TimeoutError`` after ``timeout`` seconds of waiting)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._process()
                if self._completion is not None:
                    return self._completion
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"request {self.request_id} not finished after {timeout} s")
                self._cond.wait(left)

    async def aresult(self) -> Completion:
        async for _ in self.stream():
            pass
        return self._completion  # type: ignore[return-value]
