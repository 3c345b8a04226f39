"""The OpenAI wire format: request bodies (validated, unknown fields refused) and the JSON of responses and errors.

Request models forbid unknown fields, so a typo is a 400 naming the field instead of a silently ignored option. Common
OpenAI fields that change nothing at their default (``user``, ``frequency_penalty=0``, ...) are accepted; a
non-default value of a feature kvboost does not implement is refused with a 400 naming the field.

OpenAI's defaults: ``temperature`` 1.0 and ``top_p`` 1.0 when omitted (send ``temperature: 0`` for greedy decoding);
``n`` samples of one prompt (one prefill, the samples share its blocks; sample ``i`` is seeded ``seed + i``, see
:func:`kvboost.engine.requests.sample_seed`); ``logprobs`` (completions: an int 0-5, the legacy
``{tokens, token_logprobs, top_logprobs, text_offset}``; chat: ``logprobs: true`` and ``top_logprobs`` 0-20,
``{content: [{token, logprob, bytes, top_logprobs}], refusal: null}``). Log-probabilities are the model's raw
``log_softmax`` of its logits, before temperature / top-k / top-p (vLLM's default), whatever the sampling settings.
Extensions: ``top_k`` (0 or -1: off), ``cache_salt`` (vLLM's field: appended to the tenant's salt) and
``return_token_ids`` (vLLM's: the generated token ids in each choice / chunk).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from kvboost.engine.requests import Completion, SamplingParams, TokenLogprob

#: OpenAI's legacy default for /v1/completions; chat completions default to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: OpenAI accepts at most four stop sequences.
MAX_STOP_SEQUENCES = 4
INT64 = 2**63
#: temperatures below this sample greedily (vLLM's threshold)
MIN_TEMPERATURE = 1e-5
#: smaller top_p values keep only the likeliest token anyway; below float32's range they would keep none
MIN_TOP_P = 1e-6
#: OpenAI's defaults for an omitted temperature / top_p
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0
#: OpenAI's bound on ``n``
MAX_N = 128
#: OpenAI's bounds on completions' ``logprobs`` and chat's ``top_logprobs``
MAX_COMPLETION_LOGPROBS = 5
MAX_TOP_LOGPROBS = 20


#: Fields of OpenAI's API that kvboost accepts only at the value that changes nothing (``()`` = empty or null). The
#: schema says so too (``const`` / ``maximum``...), so clients and schema fuzzers see it; a before-validator gives the
#: message that names the field.
DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0), "logit_bias": (),
    "echo": (None, False), "suffix": (None, ""), "best_of": (None, 1), "tools": (), "functions": (), "tool_choice": (None, "none"),
    "function_call": (None, "none"), "store": (None, False), "reasoning_effort": (None,),
    "continuous_usage_stats": (None, False),
}  # fmt: skip


def _default_only(value: Any, info: ValidationInfo) -> Any:
    """``value`` if it changes nothing; else a ValueError naming the field and what is accepted."""
    allowed = DEFAULT_ONLY[info.field_name]
    if allowed == ():
        if value is None or (isinstance(value, (dict, list)) and not value):
            return value
        raise ValueError(f"{info.field_name} is not supported by kvboost (accepted: empty, null, or leave it out)")
    # bool is an int: true must not pass as 1, nor 0 as false
    if any(value == a and type(value) is type(a) for a in allowed if a is not None) or value is None \
            or (isinstance(value, float) and not isinstance(value, bool) and value in allowed):  # fmt: skip
        return value
    shown = ", ".join(json.dumps(a) for a in allowed if a is not None) or "null"
    raise ValueError(f"{info.field_name} is not supported by kvboost (accepted: {shown}, or leave it out)")


NonEmpty = Annotated[str, Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (and ``"usage": null`` on the others)."""

    include_usage: bool | None = False
    continuous_usage_stats: Literal[False] | None = False

    _only = field_validator("continuous_usage_stats", mode="before")(_default_only)


class _GenerationBody(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = Field(None, description="the served model name (GET /v1/models); optional")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate at most; prompt + max_tokens beyond "
                                   "the context is a 400 naming the limit")  # fmt: skip
    temperature: float | None = Field(None, ge=0, le=2, description="0 = greedy; default 1.0 (OpenAI's)")
    top_p: float | None = Field(None, gt=0, le=1, description="default 1.0")
    top_k: int | None = Field(None, ge=-1, description="kvboost/vLLM extension: keep the k likeliest tokens; 0/-1 off")
    seed: int | None = Field(None, ge=-INT64, lt=INT64, description="the request's own sampling generator")
    stop: NonEmpty | Annotated[list[NonEmpty], Field(max_length=MAX_STOP_SEQUENCES)] | None = Field(
        None, description=f"a stop string or up to {MAX_STOP_SEQUENCES}; the answer ends before it"
    )
    n: int | None = Field(1, ge=1, le=MAX_N, description="samples of the prompt (one prefill; sample i is seeded "
                          "seed + i)")  # fmt: skip
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = Field(0.0, ge=0, le=0, description="only 0 is supported")
    presence_penalty: float | None = Field(0.0, ge=0, le=0, description="only 0 is supported")
    logit_bias: dict[str, float] | None = Field(None, max_length=0, description="only empty is supported")
    cache_salt: str | None = Field(None, max_length=256, description="appended to the tenant's cache salt")
    return_token_ids: bool | None = Field(False, description="vLLM extension: generated token ids in the choices")

    _only = field_validator("frequency_penalty", "presence_penalty", "logit_bias", mode="before")(_default_only)

    @field_validator("n", "max_tokens", "seed", mode="before")
    @classmethod
    def _no_bools(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, bool):
            raise ValueError(f"{info.field_name} must be an integer, got {json.dumps(v)}")  # noqa: TRY004 (pydantic)
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stops(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are accepted, got {len(v)}")
        if v == "" or (isinstance(v, list) and any(s == "" for s in v)):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _GenerationBody:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only accepted with stream=true")
        return self

    # ------------------------------------------------------------------ to the engine loop
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_param(self) -> str:
        return "max_tokens"

    def num_logprobs(self) -> int | None:
        """Alternatives per token to report (0: the token's own log-probability only), or None: no logprobs."""
        return None

    def sampling_params(self, max_tokens: int, vocab_size: int | None = None) -> SamplingParams:
        """The loop's settings (raises ValueError with the field's name on a value the loop refuses).

        Values that mean "no filter" or "greedy" are normalised here so the sampler never sees an edge it would fail
        on: ``top_k`` -1 (vLLM's "off") or at least the vocabulary is 0; a temperature below
        :data:`MIN_TEMPERATURE` (logits / 1e-300 overflow to inf, then NaN probabilities) is greedy, as in vLLM; a
        ``top_p`` below :data:`MIN_TOP_P` (0 in float32: every token cut) keeps the likeliest token, as it means to.
        """
        stop = self.stop if self.stop is not None else ()
        top_k = max(0, self.top_k or 0)
        if vocab_size is not None and top_k >= vocab_size:
            top_k = 0
        temperature = float(self.temperature if self.temperature is not None else DEFAULT_TEMPERATURE)
        top_p = float(self.top_p if self.top_p is not None else DEFAULT_TOP_P)
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature if temperature >= MIN_TEMPERATURE else 0.0,
            top_p=max(top_p, MIN_TOP_P), top_k=top_k, seed=self.seed,
            stop=tuple([stop] if isinstance(stop, str) else stop), n=int(self.n or 1), logprobs=self.num_logprobs(),
        )  # fmt: skip

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationBody):
    """``POST /v1/completions``: one prompt (text, or token ids), no chat template."""

    prompt: (
        str
        | list[int]
        | Annotated[list[str], Field(min_length=1, max_length=1)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=1)]
    ) = Field(description="text or token ids (one prompt; a list of one is accepted)")
    echo: Literal[False] | None = False
    suffix: str | None = Field(None, max_length=0)
    best_of: int | None = Field(None, ge=1, le=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS, description="the sampled token's "
                                 "log-probability and this many likeliest alternatives per token")  # fmt: skip

    _only = field_validator("frequency_penalty", "presence_penalty", "logit_bias", "echo", "suffix", "best_of",
                            mode="before")(_default_only)  # fmt: skip

    @field_validator("logprobs", mode="before")
    @classmethod
    def _int_logprobs(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError(f"logprobs of /v1/completions is an integer 0-{MAX_COMPLETION_LOGPROBS}, got "  # noqa: TRY004
                             f"{json.dumps(v)}")  # fmt: skip
        return v

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) > 1 and all(isinstance(p, (str, list)) for p in v):
            raise ValueError("batched prompts are not supported: send one prompt per request")
        return v

    @field_validator("prompt")
    @classmethod
    def _unwrap(cls, v: Any) -> Any:
        return v[0] if isinstance(v, list) and v and isinstance(v[0], (str, list)) else v

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS


class TextPart(_Body):
    """A text part of a message's content (images and audio are not supported)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One chat message; ``developer`` is treated as ``system``. Tool calls are not supported."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def plain(self) -> dict[str, str]:
        """The ``{"role", "content"}`` dict the chat template takes."""
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class TextFormat(_Body):
    type: Literal["text"]


class ChatCompletionRequest(_GenerationBody):
    """``POST /v1/chat/completions``: messages through the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="the newer name of max_tokens")
    logprobs: bool | None = Field(False, description="the log-probability of each generated token")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description="likeliest alternatives per token "
                                     "(needs logprobs: true)")  # fmt: skip
    response_format: TextFormat | None = None
    tools: list[Any] | None = Field(None, max_length=0)
    tool_choice: Literal["none"] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = Field(None, max_length=0)
    function_call: Literal["none"] | None = None
    store: Literal[False] | None = False
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    modalities: list[Literal["text"]] | None = None
    reasoning_effort: None = None

    _only = field_validator("frequency_penalty", "presence_penalty", "logit_bias", "tools", "functions", "tool_choice",
                            "function_call", "store", "reasoning_effort", mode="before")(_default_only)  # fmt: skip

    @field_validator("top_logprobs", mode="before")
    @classmethod
    def _int_top(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError(f"top_logprobs must be an integer 0-{MAX_TOP_LOGPROBS}, got {json.dumps(v)}")  # noqa: TRY004
        return v

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("response_format", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if v is not None and v != {"type": "text"}:
            raise ValueError('response_format is not supported by kvboost beyond {"type": "text"}')
        return v

    @field_validator("modalities", mode="before")
    @classmethod
    def _text_modality(cls, v: Any) -> Any:
        if v is not None and v != ["text"]:
            raise ValueError('modalities is not supported by kvboost beyond ["text"]')
        return v

    @model_validator(mode="after")
    def _one_max(self) -> ChatCompletionRequest:
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ValueError("max_tokens and max_completion_tokens disagree; send one of them")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def plain_messages(self) -> list[dict[str, str]]:
        return [m.plain() for m in self.messages]


class TokenizeRequest(_Body):
    """``POST /tokenize``: ``prompt`` (text as is, like /v1/completions) or ``messages`` (through the chat
    template, like /v1/chat/completions): exactly one of them."""

    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt or messages")
        return self


class WarmRequest(_Body):
    """``POST /v1/cache/warm``: compute and store the KV of ``text`` (no chat template), optionally pinned."""

    model: str | None = None
    text: str | list[int] = Field(description="a shared system prompt, a document; or its token ids")
    pin: bool = Field(False, description="protect the stored entries from eviction")
    cache_salt: str | None = Field(None, max_length=256)


# ---------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(completions: list[Completion]) -> dict[str, Any]:
    """OpenAI's ``usage`` of a request's samples (the prompt counted once, the completions' tokens added up);
    ``prompt_tokens_details.cached_tokens`` is always there (0 when nothing was reused)."""
    first = completions[0]
    generated = sum(c.completion_tokens for c in completions)
    return {
        "prompt_tokens": first.prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": first.prompt_tokens + generated,
        "prompt_tokens_details": {"cached_tokens": first.cached_tokens},
    }


#: a token's text, as ``logprobs`` shows it (``TokenText(token_id) -> str``)
TokenText = Any


def chat_logprob(token_id: int, entry: TokenLogprob, text: TokenText) -> dict[str, Any]:
    """One ``ChatCompletionTokenLogprob``: the token, its log-probability, its UTF-8 bytes, the alternatives."""

    def one(tid: int, logprob: float) -> dict[str, Any]:
        token = text(tid)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {**one(token_id, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}


def chat_logprobs(token_ids: list[int], entries: list[TokenLogprob] | None, text: TokenText) -> dict[str, Any] | None:
    """A chat choice's (or chunk's) ``logprobs``: ``{"content": [...], "refusal": null}``; None without logprobs."""
    if entries is None:
        return None
    return {"content": [chat_logprob(t, e, text) for t, e in zip(token_ids, entries, strict=True)], "refusal": None}


def completion_logprobs(token_ids: list[int], entries: list[TokenLogprob] | None, text: TokenText,
                        offset: int = 0) -> dict[str, Any] | None:  # fmt: skip
    """The legacy ``logprobs`` of /v1/completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict per
    token: the alternatives and the sampled token, as OpenAI's) and ``text_offset`` (each token's character offset
    in the generated text, from ``offset``). None without logprobs."""
    if entries is None:
        return None
    tokens = [text(t) for t in token_ids]
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    tops = []
    for token_id, token, entry in zip(token_ids, tokens, entries, strict=True):
        top = {text(t): lp for t, lp in entry.top}
        top.setdefault(token, entry.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
            "text_offset": offsets}  # fmt: skip


def completion_body(rid: str, created: int, model: str, completions: list[Completion], token_ids: bool,
                    text: TokenText) -> dict[str, Any]:  # fmt: skip
    choices = []
    for c in completions:
        choice: dict[str, Any] = {"index": c.index, "text": c.text,
                                  "logprobs": completion_logprobs(c.output_ids, c.logprobs, text),
                                  "finish_reason": c.finish_reason}  # fmt: skip
        if token_ids:
            choice["token_ids"] = list(c.output_ids)
        choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(completions)}  # fmt: skip


def chat_body(rid: str, created: int, model: str, completions: list[Completion], token_ids: bool,
              text: TokenText) -> dict[str, Any]:  # fmt: skip
    choices = []
    for c in completions:
        choice: dict[str, Any] = {"index": c.index,
                                  "message": {"role": "assistant", "content": c.text, "refusal": None},
                                  "logprobs": chat_logprobs(c.output_ids, c.logprobs, text),
                                  "finish_reason": c.finish_reason}  # fmt: skip
        if token_ids:
            choice["token_ids"] = list(c.output_ids)
        choices.append(choice)
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(completions)}  # fmt: skip


def stream_chunk(rid: str, created: int, model: str, *, chat: bool, text: str | None, finish_reason: str | None,
                 token_ids: list[int] | None, include_usage: bool, role: bool = False, index: int = 0,
                 logprobs: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """One SSE chunk of a completion (``text_completion``) or chat completion (``chat.completion.chunk``): the
    choice of sample ``index``, with the ``logprobs`` of the tokens it carries (built by :func:`chat_logprobs` /
    :func:`completion_logprobs`)."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if role else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                            "created": created, "model": model, "choices": [choice]}  # fmt: skip
    if include_usage:
        body["usage"] = None  # OpenAI: null on every chunk but the last when include_usage is set
    return body


def usage_chunk(rid: str, created: int, model: str, *, chat: bool, completions: list[Completion]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(completions)}  # fmt: skip


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
