"""The engine's frontend: text in and out, on the callers' threads (never on the engine core's).

After vLLM v1's split of a frontend (tokenize, detokenize, stop strings) from the engine core (schedule, forward,
sample): the core sees token ids only. A :class:`Detokenizer` turns a request's token ids into text incrementally
(a window of tokens per call, not the whole answer), holds back what could still become a stop string, and reports
a stop string so that the request is ended (the client's thread cancels it with ``reason="stop"``; the core may have
produced a token or two more, which the text and the token ids returned leave out).

HF's fast tokenizers are not safe to use from two threads at once: every use goes through the engine's
``tokenizer_lock``, which the engine core's thread never takes.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvboost.decoding import Sampling, TokenHistory
from kvboost.engine import pipeline
from kvboost.engine.requests import RequestHandle, SamplingParams, sample_seed
from kvboost.engine.sequences import Request
from kvboost.generation import PhaseClock
from kvboost.kv.block_table import BlockTable
from kvboost.prompts import Prompt, PromptError, chat_messages, check_token_ids

_ids = itertools.count()


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt tokenized once for a request that needed its length before submitting it (the server checks
    ``max_tokens`` against the context): ``generate_request`` takes it in place of the prompt, so the prompt is
    not tokenized twice. ``clock`` started before the tokenization, so TTFT still counts it."""

    ids: list[int]
    spans: list[Any]
    messages: Any
    clock: PhaseClock


def tokenize_prompt(engine: Any, prompt: Prompt, *, chat: bool | None = None) -> TokenizedPrompt:
    """``prompt`` tokenized as a generate request tokenizes it (validated; the chunker's spans; the chat
    messages), on the caller's thread."""
    clock = PhaseClock(engine.adapter.device)
    with engine.tokenizer_lock:
        ids, spans = engine.tokenize_with_spans(prompt, chat=chat)
        messages = chat_messages(engine.tokenizer, prompt, chat=engine.chat if chat is None else chat)
    return TokenizedPrompt(ids, spans, messages, clock)


def generate_request(core: Any, prompt: Prompt | TokenizedPrompt, params: SamplingParams, *, cache_salt: str = "",
                     chat: bool | None = None, request_id: str | None = None, timeout_s: float | None = None,
                     mode: str = "reuse", store: bool = True, clock: PhaseClock | None = None,
                     score_ids: Sequence[int] | None = None) -> Request:  # fmt: skip
    """A generate request for ``core``, tokenized and validated on the caller's thread (nothing of the engine
    changes). ``mode``/``store`` as ``engine.generate``'s; ``clock``: where the request's TTFT starts (default: now,
    or a :class:`TokenizedPrompt`'s, which is then not tokenized again). ``score_ids``: as ``engine.generate``'s
    (teacher-forced rows after the prompt, always computed); with ``params.logprobs`` the completion's
    ``score_logprobs`` has each score id's log-probability and top alternatives (``n`` must be 1)."""
    engine = core.engine
    if engine._closed:
        raise RuntimeError("this engine is closed")
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if mode not in pipeline.MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {pipeline.MODES}")
    tokenized = prompt if isinstance(prompt, TokenizedPrompt) else tokenize_prompt(engine, prompt, chat=chat)
    clock = clock or tokenized.clock
    ids, spans, messages = tokenized.ids, tokenized.spans, tokenized.messages
    n = len(ids)
    max_new = min(params.max_tokens, (engine.adapter.max_positions or n + params.max_tokens) - n)
    params.check_vocab(engine.vocab_size)
    pipeline.check_memory(engine, n + max_new)
    if score_ids is not None:
        score_ids = checked_score_ids(score_ids, engine.vocab_size)
        if params.n != 1:
            raise ValueError("score_ids needs n=1")
        pipeline.check_memory(engine, n + len(score_ids), what="prompt + score_ids")
    clock.mark("tokenized")
    sampling = Sampling(do_sample=not params.greedy, temperature=params.temperature or 1.0, top_k=params.top_k,
                        top_p=params.top_p, **params.processors())  # fmt: skip
    deadline = core.deadline(timeout_s)
    samples: list[Request] = []
    for index in range(params.n):
        seed = sample_seed(params.seed, index)
        generator = engine.generator
        if seed is not None:
            generator = torch.Generator(device=engine.adapter.device).manual_seed(seed)
        request = Request("generate", ids, spans, BlockTable(engine.pool), sampling=sampling, max_new_tokens=max_new,
                          mode=mode, salt=cache_salt, store=store, generator=generator,
                          clock=clock if index == 0 else clock.fork(), deadline=deadline)  # fmt: skip
        request.messages, request.logprobs, request.sample_index = messages, params.logprobs, index
        request.score_ids = score_ids
        if sampling.processed:  # penalties read this sample's own tokens
            request.sampling = dataclasses.replace(sampling, history=TokenHistory(ids, request.tokens, engine.eos_ids))
        rid = request_id if index == 0 or request_id is None else f"{request_id}-{index}"
        _attach_handle(core, request, rid, Detokenizer(engine.tokenizer, engine.tokenizer_lock, params.stop,
                                                       params.stop_token_ids, params.skip_special_tokens))
        request.handle.index = index
        samples.append(request)
    first = samples[0]
    first.forks = samples[1:]  # scheduled when the first is prefilled: they fork its blocks (EngineCore._fork)
    handles = [r.handle for r in samples]
    for handle in handles:
        handle.samples = handles
    return first


def store_request(core: Any, ids: list[int], spans: list, *, salt: str = "", pin: bool = False, kind: str = "store",
                  timeout_s: float | None = None) -> Request:  # fmt: skip
    """A prefill-only request that computes (reusing exact cached prefixes) and stores the KV of ``ids``: ``warm``
    (``kind="warm"``, optionally pinned) and the canonical store (``kind="store"``)."""
    engine = core.engine
    if engine._closed:
        raise RuntimeError("this engine is closed")
    request = Request(kind, list(ids), list(spans), BlockTable(engine.pool), salt=salt, pin=pin,
                      clock=PhaseClock(engine.adapter.device), deadline=core.deadline(timeout_s))  # fmt: skip
    request.clock.mark("tokenized")
    _attach_handle(core, request, None, None)
    return request


def _attach_handle(core: Any, request: Request, request_id: str | None, detokenizer: Any) -> None:
    handle = RequestHandle(request_id or f"req-{next(_ids)}", len(request.ids), core.cancel, detokenizer=detokenizer)
    handle._request = request  # type: ignore[attr-defined]
    request.handle = handle


class Detokenizer:
    """Incremental text of one request's tokens, with its stop strings.

    Args:
        tokenizer: the engine's tokenizer.
        lock: the lock every use of ``tokenizer`` takes.
        stop: stop strings (the text ends before the first one; the request finishes with ``"stop"``).
        stop_token_ids: the request's stop tokens (``SamplingParams.stop_token_ids``): one ends the answer, and
            adds no text (vLLM's rule without ``include_stop_str_in_output``; its id stays in the output ids).
        skip_special_tokens: leave special tokens out of the text (vLLM's default); False keeps them.
    """

    def __init__(self, tokenizer: Any, lock: threading.RLock, stop: Sequence[str] = (),
                 stop_token_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:  # fmt: skip
        self.tokenizer, self.lock, self.stop = tokenizer, lock, tuple(stop)
        self.skip_special_tokens = skip_special_tokens
        self.stop_token_ids = frozenset(stop_token_ids)
        self.tokens: list[int] = []
        self.text = ""
        self.emitted = 0  # characters of ``text`` handed out
        self.stopped_at: int | None = None  # tokens kept when a stop string ended the text
        self._prefix = self._read = 0

    def feed(self, tokens: Sequence[int], *, final: bool = False) -> str:
        """Add generated ``tokens``; returns the text they add that can be sent now (empty while a character is
        incomplete or the text could still become a stop string). ``final``: no more tokens come (flush)."""
        if self.stopped_at is not None:
            return ""
        for token in tokens:
            if token in self.stop_token_ids:  # the answer's last token (the core stops at it): no text
                break
            self.tokens.append(int(token))
            self._decode(final=False)
            if self._find_stop() is not None:
                break
        if final:
            self._decode(final=True)
        cut = self._find_stop()
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped_at = len(self.tokens)
        done = final or self.stopped_at is not None
        hold = 0 if done else max((len(s) - 1 for s in self.stop), default=0)
        upto = max(self.emitted, len(self.text) - hold)
        delta, self.emitted = self.text[self.emitted : upto], upto
        return delta

    def _find_stop(self) -> int | None:
        found = [i for i in (self.text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def _decode(self, *, final: bool) -> None:
        """The text of ``tokens[prefix:]`` minus that of ``tokens[prefix:read]`` is what the new tokens add, once it
        does not end in an incomplete character."""
        with self.lock:
            decode = self.tokenizer.decode
            skip = self.skip_special_tokens
            before = decode(self.tokens[self._prefix : self._read], skip_special_tokens=skip)
            after = decode(self.tokens[self._prefix :], skip_special_tokens=skip)
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.tokens)


def canonical_store_request(engine: Any, request: Any) -> Any | None:
    """The ``store`` request that stores a finished chat request's answer as the next turn will tokenize it
    (``kvboost.reuse.canonical``), or None when there is nothing to store (no chat messages, nothing stored, the
    generated ids are already the canonical ones). Runs on the frontend: it decodes and tokenizes."""
    from kvboost.reuse.canonical import canonical_turn

    if not wants_canonical(engine, request):
        return None
    with engine.tokenizer_lock:
        turn = canonical_turn(engine, request.messages, request.ids, request.tokens)
    extra = request.result.extra if request.result is not None else request.extra
    if turn is None:
        extra["canonical_skipped"] = "the chat template cannot render the answered turn"
        return None
    if turn.shared >= len(turn.ids) and getattr(engine, "generated_rows_exact", True):
        extra.update(canonical_prefill_tokens=0, canonical_chunks_stored=0, canonical_store_ms=0.0,
                     canonical_skipped="the generated ids are the canonical ones")  # fmt: skip
        return None
    job = store_request(engine.core, turn.ids, turn.spans, salt=request.salt)
    job.parent = request
    return job


def wants_canonical(engine: Any, request: Any) -> bool:
    """Whether a finished request gets a canonical store: a chat request that stored its generated tokens (not
    ``cold``, ``store=False``, ``store_generated=False``, a ``score_ids`` request), whose rows were all exact (the
    canonical prefill runs on the exact prefix; a content-hit request's approximate rows are its own)."""
    return bool(
        getattr(engine, "store_canonical", False) and engine.store_generated and request.messages
        and request.kind == "generate" and request.mode != "cold" and request.store and request.score_ids is None
        and request.approx_from is None and request.finish_reason in ("stop", "length") and request.tokens
    )  # fmt: skip


def checked_score_ids(score_ids: Any, vocab_size: int | None) -> list[int]:
    """``score_ids`` as a list of token ids, or a PromptError saying what is wrong with it."""
    if isinstance(score_ids, (str, bytes)) or not isinstance(score_ids, Sequence):
        raise PromptError(f"score_ids must be a sequence of token ids, got {type(score_ids).__name__}")
    ids = list(score_ids)
    if not ids:
        raise PromptError("score_ids is empty: give the token ids of the answer to score")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise PromptError(f"score_ids must hold ints (token ids), got {sorted({type(t).__name__ for t in ids})}")
    check_token_ids(ids, vocab_size)
    return ids
