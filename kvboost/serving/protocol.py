"""The OpenAI wire format: request bodies (validated) and the JSON of responses and errors.

Requests as OpenAI's and vLLM's clients send them: every message shape of OpenAI's chat schema (any role; an
assistant's ``content: null``, ``refusal``, ``tool_calls``, ``function_call``, ``annotations``; content as text parts,
extra keys on a part accepted). Unknown fields are kept aside, not refused: the server ignores them with a log line
and the :data:`IGNORED_FIELDS_HEADER` response header (``--strict-requests``: a 400 naming the field, as before).
Known fields are never silently dropped: those kvboost does not implement (:data:`DEFAULT_ONLY`, one commented list:
beam search, ``bad_words``, tools, structured output...) are accepted at their neutral value only, any other
value is a 400 naming the field; those that change nothing in the answer are accepted (:data:`NO_EFFECT`); image,
audio and file content parts are a 400 naming the part.

OpenAI's defaults: ``temperature`` 1.0 and ``top_p`` 1.0 when omitted (send ``temperature: 0`` for greedy decoding);
``n`` samples of one prompt (one prefill, the samples share its blocks; sample ``i`` is seeded ``seed + i``, see
:func:`kvboost.engine.requests.sample_seed`); ``logprobs`` (completions: an int 0-5, the legacy
``{tokens, token_logprobs, top_logprobs, text_offset}``; chat: ``logprobs: true`` and ``top_logprobs`` 0-20,
``{content: [{token, logprob, bytes, top_logprobs}], refusal: null}``). Log-probabilities are the model's raw
``log_softmax`` of its logits, before penalties, ``logit_bias``, temperature / top-k / top-p / min-p (vLLM's
default), whatever the sampling settings.

Sampling fields implemented (``kvboost.decoding.Sampling``, per request, greedy requests included; a request that
sets none of them stays on the batched-argmax fast path): OpenAI's ``frequency_penalty`` / ``presence_penalty``
([-2, 2]; ``logit -= count * frequency + (count > 0) * presence`` over the answer so far) and ``logit_bias``
({"token id": bias in [-100, 100]}; an id outside the vocabulary is a 400 naming ``logit_bias``); vLLM's
``repetition_penalty`` (> 0, over prompt + answer, HF's processor), ``min_p`` ([0, 1]), ``min_tokens`` (no
end-of-sequence / stop token before that many; at most ``max_tokens``), ``stop_token_ids`` (end the answer,
``finish_reason: stop``; its id ends the token ids, its text is not in the answer, as vLLM) and ``ignore_eos``.
Extensions: ``top_k`` (0 or -1: off), ``cache_salt`` (vLLM's field: appended to the tenant's salt),
``return_token_ids`` (vLLM's: the generated token ids in each choice / chunk) and ``skip_special_tokens`` (vLLM's,
default true: false keeps special tokens in the generated text).

Completions as evaluation harnesses send them (lm-evaluation-harness's ``local-completions``): a batch of prompts
(:data:`MAX_PROMPTS`), ``echo`` (the prompt before the answer; with ``logprobs``, the prompt tokens' teacher-forced
log-probabilities, the first one null) and ``max_tokens: 0`` with ``echo`` (the prompt's logprobs, no answer): see
:class:`CompletionRequest`. Chat's ``echo`` (vLLM's) is refused.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

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
#: prompts in one /v1/completions batch at most (each is a request of its own to the engine loop)
MAX_PROMPTS = 256


#: Every request field kvboost knows but does not implement, with the value(s) at which it changes nothing (``()``:
#: null, empty or left out). Any other value is a 400 naming the field ("... is not implemented by kvboost"), never
#: silently ignored: each would change the answer. The request models declare each field with a schema that admits
#: only these values (``const`` / ``maximum`` / ``maxItems``...), so clients and schema fuzzers see it too; a
#: before-validator (:func:`_default_only`) gives the message. This is the one list: the README and the tests read it.
DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    # ---- OpenAI's fields
    "suffix": (None, ""),  # completions: text after an insertion point
    "best_of": (None, 1),  # the best of n sampled answers, chosen on the server
    "tools": (),  # function calling: kvboost neither shows tools to the model nor parses calls from its output
    "functions": (),  # the deprecated form of tools
    "tool_choice": (None, "none", "auto"),  # without tools "auto" calls nothing; "required" or a named one would
    "function_call": (None, "none", "auto"),  # the deprecated form of tool_choice
    "reasoning_effort": (None,),  # reasoning models' effort
    "verbosity": (None,),  # asks for shorter or longer answers
    "audio": (None,),  # audio output
    "web_search_options": (),  # a web search before answering
    "moderation": (None,),  # moderation of the input and output (may block the answer)
    "continuous_usage_stats": (None, False),  # stream_options (vLLM): usage on every chunk
    # ---- vLLM's sampling extensions (vLLM's SamplingParams; kvboost implements top_k, seed, n, stop, logprobs,
    # min_p, repetition_penalty, ignore_eos, min_tokens, stop_token_ids: see _GenerationBody)
    "spaces_between_special_tokens": (None, True),  # only matters with skip_special_tokens: false
    "include_stop_str_in_output": (None, False),  # keeps the stop string in the answer
    "bad_words": (),  # words never generated
    "allowed_token_ids": (),  # the only tokens that may be generated
    "logits_processors": (),  # custom logits processors
    "truncate_prompt_tokens": (None,),  # keeps only the prompt's last k tokens
    "prompt_logprobs": (None,),  # log-probabilities of the prompt's tokens
    "use_beam_search": (None, False),  # beam search
    "length_penalty": (None, 1),  # beam search's length penalty
    "return_tokens_as_token_ids": (None, False),  # logprobs' tokens as "token_id:N"
    "guided_json": (),  # structured output: a JSON schema
    "guided_regex": (None,),  # structured output: a regular expression
    "guided_choice": (),  # structured output: one of these strings
    "guided_grammar": (None,),  # structured output: a grammar
    "structured_outputs": (),  # vLLM's newer name for the guided_* fields
    # ---- vLLM's chat-template fields (chat only)
    "add_generation_prompt": (None, True),  # kvboost always opens the assistant's turn
    "continue_final_message": (None, False),  # continues the last message instead of a new turn
    "add_special_tokens": (None, False),  # the tokenizer's BOS etc. on top of the template's
    "chat_template": (None,),  # a template of the request's own
    "chat_template_kwargs": (),  # extra variables of the template (enable_thinking...)
    "documents": (),  # documents for a RAG template
    "mm_processor_kwargs": (),  # multimodal processor options
}  # fmt: skip

#: Fields accepted and ignored because they change nothing in the answer (each declared on the request models, so
#: they are neither "unknown" nor in the ignored-fields header): the field and why it changes nothing.
NO_EFFECT: dict[str, str] = {
    "user": "an end-user id for OpenAI's abuse monitoring",
    "safety_identifier": "the newer name of user",
    "metadata": "tags OpenAI stores with a completion",
    "store": "OpenAI stores the completion for evals or distillation; kvboost keeps nothing",
    "service_tier": "OpenAI's processing tier",
    "parallel_tool_calls": "only matters with tools, which kvboost refuses",
    "prompt_cache_key": "OpenAI's cache-routing hint; kvboost's cache keys are the tokens and the tenant's salt",
    "prompt_cache_retention": "how long OpenAI keeps a cached prefix",
    "prompt_cache_options": "OpenAI's cache breakpoints and lifetime",
    "prediction": "a predicted answer speeds up OpenAI's decoding; the answer is the same",
    "priority": "vLLM's scheduling priority; kvboost schedules first come, first served",
    "request_id": "vLLM's request id; kvboost makes its own",
}

#: content-part types OpenAI defines that kvboost cannot read (text models only): refused, naming the part
UNSUPPORTED_PARTS = {"image_url": "image", "input_audio": "audio", "file": "file", "image": "image", "audio": "audio"}

#: the response header that names a request's ignored (unknown) fields
IGNORED_FIELDS_HEADER = "X-Kvboost-Ignored-Fields"


def _default_only(value: Any, info: ValidationInfo) -> Any:
    """``value`` if it changes nothing; else a ValueError naming the field and what is accepted."""
    allowed = DEFAULT_ONLY[info.field_name]
    if allowed == ():
        if value is None or (isinstance(value, (dict, list)) and not value):
            return value
        raise ValueError(f"{info.field_name} is not implemented by kvboost (accepted: empty, null, or leave it out)")
    # bool is an int: true must not pass as 1, nor 0 as false
    if any(value == a and type(value) is type(a) for a in allowed if a is not None) or value is None \
            or (isinstance(value, float) and not isinstance(value, bool) and value in allowed):  # fmt: skip
        return value
    shown = ", ".join(json.dumps(a) for a in allowed if a is not None) or "null"
    raise ValueError(f"{info.field_name} is not implemented by kvboost (accepted: {shown}, or leave it out)")


class FieldError(ValueError):
    """A request value the engine loop refuses; ``param`` names the field (OpenAI's error ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _field_of(message: str) -> str | None:
    """The field a :class:`SamplingParams` error message starts with (its messages name the field first)."""
    name = message.split(" ", 1)[0].rstrip(":")
    return name if name in _GenerationBody.model_fields else None


NonEmpty = Annotated[str, Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Open(BaseModel):
    """A body (or part of one) as OpenAI's and vLLM's clients send it: unknown fields are kept aside
    (``model_extra``), reported by :func:`unknown_fields` and ignored (or refused under ``--strict-requests``)."""

    model_config = ConfigDict(extra="allow")


class _Options(_Open):
    """Request options: the fields of :data:`DEFAULT_ONLY` a subclass declares are accepted at their neutral values
    only (a message's ``function_call`` or ``audio`` is another field of the same name)."""

    _only = field_validator(*DEFAULT_ONLY, mode="before", check_fields=False)(_default_only)


def unknown_fields(model: BaseModel, where: str = "") -> list[str]:
    """The paths of the fields ``model`` (and every model inside it) did not know: ``foo``, ``messages[2].bar``."""
    out = [f"{where}.{k}" if where else k for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        path = f"{where}.{name}" if where else name
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if isinstance(item, BaseModel):
                out += unknown_fields(item, path if i is None else f"{path}[{i}]")
    return out


#: the schema of a DEFAULT_ONLY field: only its neutral values (None: any, the validator alone decides)
Off = Literal[False] | None
On = Literal[True] | None
One = Annotated[float, Field(ge=1, le=1)] | None
Empty = Annotated[list[Any], Field(max_length=0)] | Annotated[dict[str, Any], Field(max_length=0)] | None


class StreamOptions(_Options):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (and ``"usage": null`` on the others)."""

    include_usage: bool | None = False
    continuous_usage_stats: Literal[False] | None = False


class _GenerationBody(_Options):
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
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2, description="OpenAI's: logit -= count x this, over "
                                            "the answer so far")  # fmt: skip
    presence_penalty: float | None = Field(0.0, ge=-2, le=2, description="OpenAI's: logit -= this for every token "
                                           "already in the answer")  # fmt: skip
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100], added to its logit")
    cache_salt: str | None = Field(None, max_length=256, description="appended to the tenant's cache salt")
    return_token_ids: bool | None = Field(False, description="vLLM extension: generated token ids in the choices")
    best_of: int | None = Field(None, ge=1, le=1)
    # no effect (NO_EFFECT says why)
    user: str | None = None
    safety_identifier: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    priority: int | None = None
    request_id: str | None = None
    # vLLM's sampling extensions (kvboost.decoding.Sampling)
    min_p: float | None = Field(None, ge=0, le=1, description="vLLM: drop tokens less likely than min_p x the "
                                "likeliest")  # fmt: skip
    repetition_penalty: float | None = Field(None, gt=0, description="vLLM/HF: divides (multiplies, if negative) "
                                             "the logits of prompt and answer tokens; 1 off")  # fmt: skip
    ignore_eos: bool | None = Field(None, description="vLLM: generate past the end-of-sequence token")
    min_tokens: int | None = Field(None, ge=0, description="vLLM: no end-of-sequence / stop token before this many")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, description="vLLM: token ids that end "
                                                                     "the answer (finish_reason stop)")  # fmt: skip
    skip_special_tokens: bool | None = Field(True, description="vLLM: false keeps special tokens in the text")
    # not implemented: accepted at their neutral values only (DEFAULT_ONLY)
    spaces_between_special_tokens: On = None
    include_stop_str_in_output: Off = None
    bad_words: Empty = None
    allowed_token_ids: Empty = None
    logits_processors: Empty = None
    truncate_prompt_tokens: None = None
    prompt_logprobs: None = None
    use_beam_search: Off = None
    length_penalty: One = None
    return_tokens_as_token_ids: Off = None
    guided_json: Empty = None
    guided_regex: None = None
    guided_choice: Empty = None
    guided_grammar: None = None
    structured_outputs: Empty = None

    @field_validator("n", "max_tokens", "seed", mode="before")
    @classmethod
    def _no_bools(cls, v: Any, info: ValidationInfo) -> Any:
        if isinstance(v, bool):
            raise ValueError(f"{info.field_name} must be an integer, got {json.dumps(v)}")  # noqa: TRY004 (pydantic)
        return v

    @field_validator("logit_bias", mode="after")
    @classmethod
    def _bias_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key in v or {}:
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers as strings), got {key!r}")
        return v

    @field_validator("min_tokens", "ignore_eos", "skip_special_tokens", mode="before")
    @classmethod
    def _strict_kinds(cls, v: Any, info: ValidationInfo) -> Any:
        if info.field_name == "min_tokens" and isinstance(v, bool):
            raise ValueError(f"min_tokens must be an integer, got {json.dumps(v)}")  # noqa: TRY004 (pydantic)
        if info.field_name != "min_tokens" and v is not None and not isinstance(v, bool):
            raise ValueError(f"{info.field_name} must be true or false, got {json.dumps(v)}")  # noqa: TRY004
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
        bias = {int(k): float(b) for k, b in (self.logit_bias or {}).items()}
        try:
            params = SamplingParams(
                max_tokens=max_tokens, temperature=temperature if temperature >= MIN_TEMPERATURE else 0.0,
                top_p=max(top_p, MIN_TOP_P), top_k=top_k, seed=self.seed,
                stop=tuple([stop] if isinstance(stop, str) else stop), n=int(self.n or 1),
                logprobs=self.num_logprobs(), min_p=float(self.min_p or 0.0),
                frequency_penalty=float(self.frequency_penalty or 0.0),
                presence_penalty=float(self.presence_penalty or 0.0),
                repetition_penalty=float(self.repetition_penalty if self.repetition_penalty is not None else 1.0),
                logit_bias=bias, min_tokens=int(self.min_tokens or 0), stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=bool(self.ignore_eos),
                skip_special_tokens=self.skip_special_tokens is not False,
            )  # fmt: skip
            if vocab_size is not None:
                params.check_vocab(vocab_size)
        except ValueError as exc:
            raise FieldError(str(exc), _field_of(str(exc))) from None
        return params

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationBody):
    """``POST /v1/completions``: a prompt (text, or token ids) or a batch of them, no chat template.

    A batch (a list of texts or of token-id lists; lm-evaluation-harness's ``local-completions`` sends its requests
    so) answers prompt ``i``'s ``n`` samples as choices ``i * n`` to ``i * n + n - 1``. ``echo``: each choice's text
    starts with its prompt; with ``logprobs`` its ``logprobs`` start with the prompt's tokens: the first one's
    ``token_logprobs`` / ``top_logprobs`` entry is null (nothing precedes it), every other is the model's
    teacher-forced ``log_softmax`` at that position (computed, never read from a cached prefix: see
    ``kvboost.serving.server``). ``max_tokens: 0`` (with ``echo`` only) generates nothing: the prompt's logprobs
    alone, as lm-evaluation-harness's loglikelihood requests ask. Streamed (vLLM's stream), a choice's first chunk
    is its echoed prompt with the prompt's logprobs, and a batch's choices interleave."""

    prompt: (
        str
        | list[int]
        | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)]
        | Annotated[list[list[int]], Field(min_length=1, max_length=MAX_PROMPTS)]
    ) = Field(description=f"text or token ids, or a batch of up to {MAX_PROMPTS} of them")
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate at most (0: none, with echo only); "
                                   "prompt + max_tokens beyond the context is a 400 naming the limit")  # fmt: skip
    echo: bool | None = Field(False, description="the prompt before the answer (and its tokens' logprobs)")
    suffix: str | None = Field(None, max_length=0)
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS, description="the sampled token's "
                                 "log-probability and this many likeliest alternatives per token")  # fmt: skip

    def prompts(self) -> list[str | list[int]]:
        """The batch's prompts (one for a single prompt)."""
        p = self.prompt
        return list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]  # type: ignore[list-item]

    @field_validator("logprobs", mode="before")
    @classmethod
    def _int_logprobs(cls, v: Any) -> Any:
        if isinstance(v, bool):
            raise ValueError(f"logprobs of /v1/completions is an integer 0-{MAX_COMPLETION_LOGPROBS}, got "  # noqa: TRY004
                             f"{json.dumps(v)}")  # fmt: skip
        return v

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS


class ContentPart(_Open):
    """A part of a message's content: ``text`` (extra keys such as ``prompt_cache_breakpoint`` or ``cache_control``
    accepted), or an assistant's ``refusal``. Image, audio and file parts are refused, naming the part: kvboost
    serves text models."""

    type: Literal["text", "refusal"]
    text: str | None = None
    refusal: str | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = Field(None, description="no effect (OpenAI's cache breakpoint)")

    @field_validator("type", mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if v in UNSUPPORTED_PARTS:
            raise ValueError(f"{UNSUPPORTED_PARTS[v]} input ({v!r} content parts) is not supported by kvboost: it "
                             "serves text models (send text parts only)")  # fmt: skip
        return v

    @model_validator(mode="after")
    def _has_its_text(self) -> ContentPart:
        if getattr(self, self.type) is None:
            raise ValueError(f"a {self.type!r} content part needs its {self.type!r} field")
        return self

    @property
    def value(self) -> str:
        return self.text if self.type == "text" else self.refusal  # type: ignore[return-value]


def _content_kind(v: Any) -> str:
    return "list[parts]" if isinstance(v, list) else "str"


Content = Annotated[
    Annotated[str, Tag("str")] | Annotated[list[ContentPart], Tag("list[parts]")], Discriminator(_content_kind)
]


class FunctionCall(_Open):
    """A call's function: its name and its arguments (a JSON string, as OpenAI sends it)."""

    name: str
    arguments: str | dict[str, Any] = ""


class ToolCall(_Open):
    """One of an assistant's ``tool_calls`` (function calls; OpenAI's ``custom`` tool calls are refused)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    @field_validator("type", mode="before")
    @classmethod
    def _functions_only(cls, v: Any) -> Any:
        if v == "custom":
            raise ValueError("custom tool calls are not supported by kvboost (function tool calls are)")
        return v

    def template(self) -> dict[str, Any]:
        """The call as Hugging Face chat templates take it: ``arguments`` parsed into a dict when it is a JSON object
        (templates write ``arguments | tojson``; vLLM parses them the same way), else kept as sent."""
        arguments: Any = self.function.arguments
        if isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            arguments = parsed if isinstance(parsed, dict) else arguments
        call: dict[str, Any] = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        if self.id is not None:
            call["id"] = self.id
        return call


class ChatMessage(_Open):
    """One message of OpenAI's request schema, any role. ``developer`` is rendered as ``system`` and the legacy
    ``function`` role as ``tool``; an assistant's ``tool_calls`` (or legacy ``function_call``) go to the chat template
    as Hugging Face templates take them (the server refuses a template that does not render them); its ``content``
    may be null (a refusal, or tool calls only); ``refusal`` stands in for a null content; ``annotations`` (citations
    of the content) and ``name`` where a template ignores it change nothing. A previous ``audio`` answer cannot be
    rendered: refused."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Content | None = Field(None, validate_default=True)
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None
    tool_call_id: str | None = None
    audio: None = None
    annotations: list[Any] | None = None

    @field_validator("audio", mode="before")
    @classmethod
    def _no_audio(cls, v: Any) -> Any:
        if v is not None:
            raise ValueError("audio (a previous audio answer) is not supported by kvboost: send its transcript as "
                             "content")  # fmt: skip
        return v

    @field_validator("content")
    @classmethod
    def _needs_content(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and info.data.get("role") not in ("assistant", "function", None):
            raise ValueError(f"content is required for a {info.data['role']!r} message")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.value for p in self.content)
        return self.content if self.content is not None else (self.refusal or "")

    def calls(self) -> list[ToolCall]:
        if self.tool_calls:
            return self.tool_calls
        return [ToolCall(type="function", function=self.function_call)] if self.function_call is not None else []

    def plain(self) -> dict[str, Any]:
        """The message as the chat template takes it: ``role`` and ``content`` (text; "" for a null content), and
        ``tool_calls``, ``tool_call_id`` and ``name`` where the message has them."""
        role = {"developer": "system", "function": "tool"}.get(self.role, self.role)
        out: dict[str, Any] = {"role": role, "content": self.text()}
        calls = self.calls()
        if calls:
            out["tool_calls"] = [c.template() for c in calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


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
    echo: Off = Field(False, description="vLLM's chat echo (the last message's text): not implemented")
    tools: list[Any] | None = Field(None, max_length=0)
    tool_choice: Literal["none", "auto"] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = Field(None, max_length=0)
    function_call: Literal["none", "auto"] | None = None
    modalities: list[Literal["text"]] | None = None
    reasoning_effort: None = None
    verbosity: None = None
    audio: None = None
    web_search_options: Empty = None
    moderation: None = None
    # vLLM's chat-template fields, not implemented (DEFAULT_ONLY)
    add_generation_prompt: On = None
    continue_final_message: Off = None
    add_special_tokens: Off = None
    chat_template: None = None
    chat_template_kwargs: Empty = None
    documents: Empty = None
    mm_processor_kwargs: Empty = None

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

    @field_validator("echo", mode="before")
    @classmethod
    def _no_echo(cls, v: Any) -> Any:
        if v is not None and v is not False:
            raise ValueError("echo is not implemented by kvboost for chat completions (/v1/completions has it)")
        return v

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

    def plain_messages(self) -> list[dict[str, Any]]:
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


def completion_logprobs(token_ids: list[int], entries: list[TokenLogprob | None] | None, text: TokenText,
                        offset: int = 0) -> dict[str, Any] | None:  # fmt: skip
    """The legacy ``logprobs`` of /v1/completions: ``tokens``, ``token_logprobs``, ``top_logprobs`` (a dict per
    token: the alternatives and the sampled token, as OpenAI's) and ``text_offset`` (each token's character offset
    in the generated text, from ``offset``). An entry None (an echoed prompt's first token) is null in both lists,
    as OpenAI and vLLM write it. None without logprobs."""
    if entries is None:
        return None
    tokens = [text(t) for t in token_ids]
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    tops = []
    for token, entry in zip(tokens, entries, strict=True):
        top = None if entry is None else {text(t): lp for t, lp in entry.top}
        if entry is not None:
            top.setdefault(token, entry.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": tops, "text_offset": offsets}  # fmt: skip


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


def usage_chunk(rid: str, created: int, model: str, *, chat: bool, usage: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the request's ``usage``."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage}  # fmt: skip


def error_body(message: str, type_: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
