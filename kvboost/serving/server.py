"""The OpenAI-compatible HTTP server: a thin FastAPI layer over :class:`~kvboost.engine.loop.EngineLoop`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (SSE when ``stream``),
``POST /tokenize``, ``POST /v1/cache/warm``, ``GET /health``, ``GET /metrics``. Every error is OpenAI's envelope
``{"error": {"message", "type", "param", "code"}}``, never FastAPI's ``{"detail": ...}``:

==========  ===========================================================================================
status      when (``type`` / ``code``)
==========  ===========================================================================================
400         bad JSON, missing field, bad value, unsupported feature, prompt over the context, or
            prompt + ``max_tokens`` over it (``context_length_exceeded``, the message names the limit as vLLM's
            does) (``invalid_request_error``; ``code`` says which); an unknown field with ``strict_requests``
401         API keys configured and the request carries none of them (``authentication_error``)
404         unknown model (``model_not_found``) or route (``not_found_error``)
405         method not allowed on a route (``method_not_allowed``; ``Allow`` header)
413         body over :data:`MAX_BODY_BYTES`
429         the loop's queue is full (``rate_limit_error`` / ``queue_full``; ``Retry-After`` in seconds)
500         anything unexpected, or a request the engine failed (``server_error``); the server keeps serving
503         the loop is stopped or shutting down (``service_unavailable``; ``Retry-After``)
504         the request ran past its deadline (``--request-timeout``) (``timeout`` / ``request_timeout``)
==========  ===========================================================================================

Unknown request fields (anywhere in the body: ``foo``, ``messages[2].bar``) are ignored, as vLLM ignores them: one
log line ("The following fields were present in the request but ignored: ...", vLLM's words) and the response header
``X-Kvboost-Ignored-Fields: foo, messages[2].bar`` (:data:`~kvboost.serving.protocol.IGNORED_FIELDS_HEADER`; names
JSON-escaped, at most :data:`MAX_NAMED_FIELDS`). ``create_app(strict_requests=True)`` (``--strict-requests``) answers
them with a 400 (``unknown_field``) instead. Known fields kvboost does not implement are never ignored: see
:data:`kvboost.serving.protocol.DEFAULT_ONLY`.

``/v1/completions`` takes a batch of prompts and ``echo`` (with ``logprobs``: the prompt's teacher-forced logprobs,
computed by a score request per prompt, see :meth:`_Service.submit_prompt_score`), whole or streamed (each choice's
first chunk is its echoed prompt, with its logprobs: :meth:`_Service.stream_prompts`). ``max_tokens: 0`` is accepted
with ``echo`` only.

A stream that already sent its headers reports a late error (timeout, shutdown, engine failure) as one
``data: {"error": {...}}`` event, then ``data: [DONE]``. With ``n`` > 1 the samples' chunks interleave, each with its
choice's ``index``; with logprobs, every generated token is in one chunk with its log-probabilities. A client that disconnects (streaming or not) cancels its
request: the loop frees its blocks at its next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvboost.engine.frontend import TokenizedPrompt
from kvboost.engine.requests import Completion, LoopStopped, QueueFull, RequestHandle, SamplingParams
from kvboost.prompts import PromptError
from kvboost.serving import protocol as P
from kvboost.serving.metrics import ServerMetrics
from kvboost.serving.tenancy import AuthError, Tenancy, Tenant

log = logging.getLogger(__name__)

#: bodies larger than this are refused (413) before they are parsed
MAX_BODY_BYTES = 16 * 2**20
#: Retry-After (seconds) when the loop is stopped: a supervisor restarting the server takes about this long
STOPPED_RETRY_AFTER_S = 5
#: paths that need no API key (probes and scrapers); everything else does when keys are configured
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json"})
#: ignored fields named at most in the header and the log line (then "... (N more)")
MAX_NAMED_FIELDS = 16

try:  # chat templates raise jinja's errors for messages they refuse (roles out of order...): a client error
    from jinja2.exceptions import TemplateError as _TemplateError
except ImportError:  # pragma: no cover - transformers depends on jinja2
    _TemplateError = ValueError  # type: ignore[assignment,misc]

CLIENT_ERRORS = (PromptError, ValueError, TypeError, _TemplateError)


class APIError(Exception):
    """An error answered with OpenAI's envelope."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        return JSONResponse(P.error_body(self.message, self.type, self.param, self.code), status_code=self.status,
                            headers=self.headers)  # fmt: skip

    def event(self) -> str:
        """The error as a stream event (the status travels as ``code`` when the envelope has none)."""
        return json.dumps(P.error_body(self.message, self.type, self.param, self.code or str(self.status)))


# ---------------------------------------------------------------------- errors
#: pydantic names a union's member in the error location ("str", "list[int]", "constrained-str"...): not a field
_TYPE_TAGS = ("str", "int", "float", "bool", "none", "constrained-str", "constrained-int")
_TYPE_TAG_PREFIXES = ("list[", "dict[", "function-", "union[", "tagged-union[", "literal[", "nullable[", "constrained-")


def _param(loc: tuple[Any, ...]) -> str | None:
    """``("body", "messages", 0, "role")`` -> ``messages[0].role`` (union member tags left out)."""
    out = ""
    for part in loc[1:] if loc and loc[0] in ("body", "query", "path", "header") else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in _TYPE_TAGS and not str(part).startswith(_TYPE_TAG_PREFIXES) and "[" not in str(part):
            out += f".{part}" if out else str(part)
    return out or None


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = list(exc.errors())
    if not errors:
        return APIError(400, "invalid request body", code="invalid_request")
    # With unions pydantic reports one error per branch; the first one names the field well enough.
    err = errors[0]
    kind, loc = err.get("type", ""), tuple(err.get("loc", ()))
    param = _param(loc)
    if kind == "json_invalid":
        detail = (err.get("ctx") or {}).get("error", "")
        return APIError(400, f"the body is not valid JSON{': ' + str(detail) if detail else ''}", code="invalid_json")
    if kind == "missing" and param is None:
        return APIError(400, "a JSON object body is required", code="missing_body")
    if kind == "extra_forbidden":
        return APIError(400, f"unknown field {param!r}", param=param, code="unknown_field")
    if kind == "missing":
        return APIError(400, f"missing required field {param!r}", param=param, code="missing_field")
    message = str(err.get("msg", "invalid value"))
    if kind == "value_error":  # our validators: the message names the field already
        message = str((err.get("ctx") or {}).get("error", message))
        unsupported = "not supported" in message or "not implemented" in message
        return APIError(400, message, param=param, code="unsupported_value" if unsupported else "invalid_value")
    return APIError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")


def _http_error(request: Request, exc: StarletteHTTPException) -> APIError:
    headers = dict(exc.headers or {})
    if exc.status_code == 404:
        return APIError(404, f"no route {request.url.path}", "not_found_error", code="not_found", headers=headers)
    if exc.status_code == 405:
        return APIError(405, f"method {request.method} is not allowed on {request.url.path}", "method_not_allowed",
                        code="method_not_allowed", headers=headers)  # fmt: skip
    kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return APIError(exc.status_code, str(exc.detail), kind, headers=headers)


class _BodyTooLarge(Exception):
    pass


class GuardMiddleware:
    """Outermost layer of the app: authenticates (the tenant goes into ``scope["state"]``), bounds the body, and
    turns any exception that escaped the handlers into a 500 envelope (logged) so one bad request never takes the
    server down or leaks a traceback."""

    def __init__(self, app: ASGIApp, tenancy: Tenancy, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app, self.tenancy, self.max_body_bytes = app, tenancy, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        async def reply(error: APIError) -> None:
            if not started:
                await error.response()(scope, receive, send)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        try:
            tenant = self.tenancy.authenticate(headers.get("authorization")) if scope["path"] not in OPEN_PATHS \
                else None  # fmt: skip
        except AuthError as exc:
            await reply(APIError(401, str(exc), "authentication_error", code="invalid_api_key",
                                 headers={"WWW-Authenticate": "Bearer"}))  # fmt: skip
            return
        scope.setdefault("state", {})["tenant"] = tenant
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await reply(self._too_large())
            return
        received = 0

        async def receive_bounded() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge
            return message

        try:
            await self.app(scope, receive_bounded, send_tracking)
        except _BodyTooLarge:
            await reply(self._too_large())
        except Exception:
            log.exception("kvboost-server: unhandled error on %s %s", scope.get("method"), scope.get("path"))
            await reply(APIError(500, "internal server error (logged on the server)", "server_error",
                                 code="internal_error"))  # fmt: skip

    def _too_large(self) -> APIError:
        return APIError(413, f"the request body is larger than {self.max_body_bytes} bytes", code="body_too_large")


# ---------------------------------------------------------------------- the app
class _Service:
    """What the routes share: the loop, the tenants, the metrics, the limits."""

    def __init__(self, loop: Any, model_names: list[str], tenancy: Tenancy, max_model_len: int | None,
                 strict_requests: bool = False) -> None:  # fmt: skip
        self.loop, self.tenancy, self.strict_requests = loop, tenancy, strict_requests
        self.model_names = model_names
        self.model_name = model_names[0]  # what responses report
        engine = loop.engine
        self.context = int(engine.adapter.max_positions)
        self.max_model_len = min(max_model_len or self.context, self.context)
        pool = engine.pool
        rows = (pool.num_blocks - 1) * pool.block_size  # pipeline.check_memory keeps one block spare
        if getattr(engine, "max_kv_bytes", None):
            rows = min(rows, int(engine.max_kv_bytes // pool.row_bytes))
        self.kv_rows = rows
        self.vocab_size = int(engine.vocab_size)
        self.metrics = ServerMetrics(loop, model_name=self.model_name, max_model_len=self.max_model_len,
                                     tenant_ids=tenancy.tenant_ids)  # fmt: skip
        self._background: set[asyncio.Task] = set()
        self._token_text: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        """A token's text as ``logprobs`` shows it (decoded alone, special tokens kept; cached)."""
        text = self._token_text.get(token_id)
        if text is None:
            engine = self.loop.engine
            with engine.tokenizer_lock:
                text = engine.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    # ------------------------------------------------------------------ checks
    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            served = " or ".join(map(repr, self.model_names))
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served}", param="model",
                           code="model_not_found")  # fmt: skip

    def ignored_fields(self, body: Any) -> list[str]:
        """The unknown fields of ``body`` (logged once, as vLLM does); a 400 naming the first under
        ``strict_requests``."""
        fields = P.unknown_fields(body)
        if fields and self.strict_requests:
            raise APIError(400, f"unknown field {fields[0]!r} (the server runs with --strict-requests)",
                           param=fields[0], code="unknown_field")  # fmt: skip
        if fields:
            log.warning("The following fields were present in the request but ignored: %s", _named(fields))
        return fields

    async def check_rendered(self, messages: list[dict[str, Any]]) -> None:
        """Refuse a conversation the chat template would change by dropping part of it: an assistant's
        ``tool_calls`` or a ``tool`` message that renders to the same text as the conversation without it (a
        template that knows no tools). Only requests with such messages are rendered here (once more each)."""
        special = [i for i, m in enumerate(messages) if m.get("tool_calls") or m["role"] == "tool"]
        if not special:
            return
        engine = self.loop.engine

        def render(conversation: list[dict[str, Any]]) -> Any:
            with engine.tokenizer_lock:
                return engine.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)

        try:
            whole = await run_in_threadpool(render, messages)
            for i in special:
                m = messages[i]
                calls = bool(m.get("tool_calls"))
                without = {k: v for k, v in m.items() if k != "tool_calls"} if calls else None
                rest = [*messages[:i], *([without] if calls else []), *messages[i + 1 :]]
                if rest and await run_in_threadpool(render, rest) == whole:
                    what, param = ("tool_calls", f"messages[{i}].tool_calls") if calls else \
                        ("tool messages", f"messages[{i}]")  # fmt: skip
                    raise APIError(400, f"the model's chat template does not render {what}: {param} would be "
                                   "dropped from the prompt", param=param, code="unsupported_value")  # fmt: skip
        except CLIENT_ERRORS as exc:
            raise _prompt_error(exc, "messages") from None

    async def tokenize(self, prompt: Any, chat: bool, param: str) -> TokenizedPrompt:
        try:
            return await run_in_threadpool(self.loop.tokenize, prompt, chat=chat)
        except CLIENT_ERRORS as exc:
            raise _prompt_error(exc, param) from None

    async def max_tokens(self, body: P._GenerationBody, prompt: Any, chat: bool,
                         param: str) -> tuple[int, TokenizedPrompt | None]:  # fmt: skip
        """The request's token budget. A ``max_tokens`` the client sent that does not fit the context after the
        prompt is a 400 naming the limit (vLLM's message); an omitted one is the rest of the context (chat) or
        OpenAI's 16 (completions), clamped to what fits. The prompt is tokenized here first only when a limit may
        apply (``max_tokens`` sent, ``max_model_len`` below the model's, a KV pool smaller than the context, or a
        chat request without ``max_tokens``, which gets the rest of what fits); the loop clamps to the model's
        context itself. Returns the budget and the tokenized prompt when it was tokenized here (``submit`` takes it,
        so the prompt is tokenized once)."""
        requested = body.requested_max_tokens()
        explicit = body.max_tokens is not None or getattr(body, "max_completion_tokens", None) is not None
        limit = min(self.max_model_len, self.kv_rows)
        if limit >= self.context and not explicit:
            return (requested if requested is not None else self.context), None
        tokenized = await self.tokenize(prompt, chat, param)
        n = len(tokenized.ids)
        if n >= self.max_model_len:
            raise APIError(400, f"the prompt has {n} tokens; this server's context is {self.max_model_len} tokens "
                           "(at least one is needed for the answer)", param=param,
                           code="context_length_exceeded")  # fmt: skip
        if explicit and requested is not None and n + requested > self.max_model_len:
            where = "messages" if chat else "prompt"
            raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                           f"requested {n + requested} tokens ({n} in the {where}, {requested} in the completion). "
                           f"Please reduce the length of the {where} or completion.", param=body.max_tokens_param(),
                           code="context_length_exceeded")  # fmt: skip
        room = max(1, limit - n)
        return (room if requested is None else min(requested, room)), tokenized

    def submit(self, prompt: Any, body: P._GenerationBody, max_tokens: int, tenant: Tenant, chat: bool, rid: str,
               param: str) -> RequestHandle:  # fmt: skip
        """``loop.submit`` with its exceptions as API errors (runs on a worker thread: tokenizing may wait a step)."""
        try:
            params = body.sampling_params(max_tokens, vocab_size=self.vocab_size)
        except ValueError as exc:
            raise APIError(400, str(exc), code="invalid_value", param=getattr(exc, "param", None)) from None
        return self.queued(param, lambda: self.loop.submit(prompt, params, cache_salt=tenant.cache_salt(body.cache_salt),
                                                           chat=chat, request_id=rid))  # fmt: skip

    def submit_prompt_score(self, ids: list[int], logprobs: int, tenant: Tenant, body: P._GenerationBody,
                            rid: str) -> RequestHandle:  # fmt: skip
        """The request that computes a prompt's logprobs (``echo`` with ``logprobs``) through the engine's one score
        path: its first token is the prompt, the rest are ``score_ids``, whose teacher-forced rows the engine always
        computes after the prompt (a cached prefix holds K/V, not logits, so no row of it could be read from the
        cache; a one-token prompt has no cached prefix to reuse). ``score_logprobs`` of its completion: token
        ``j + 1``'s log-probability and top alternatives. Its one generated token (the score path runs after a
        first token) is discarded. Runs on a worker thread."""
        params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=logprobs)
        return self.queued("prompt", lambda: self.loop.submit(ids[:1], params, request_id=f"{rid}-prompt",
                                                              cache_salt=tenant.cache_salt(body.cache_salt),
                                                              score_ids=ids[1:]))  # fmt: skip

    def queued(self, param: str, submit: Any) -> RequestHandle:
        """``submit()`` (a ``loop.submit``) with its exceptions as API errors."""
        try:
            return submit()
        except QueueFull as exc:
            self.metrics.reject("queue_full")
            retry = str(max(1, math.ceil(exc.retry_after_s)))
            raise APIError(429, str(exc), "rate_limit_error", code="queue_full",
                           headers={"Retry-After": retry}) from None  # fmt: skip
        except LoopStopped as exc:
            self.metrics.reject("loop_stopped")
            raise _stopped(str(exc)) from None
        except CLIENT_ERRORS as exc:
            raise _prompt_error(exc, param) from None

    # ------------------------------------------------------------------ completions
    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)  # a reference until it ends (the event loop keeps weak ones only)
        task.add_done_callback(self._background.discard)

    async def observe_later(self, handle: RequestHandle, tenant: Tenant) -> None:
        """Count a request whose client left once the loop has ended it."""
        self.metrics.observe(await handle.aresult(), tenant.tenant_id)

    def cancel_all(self, handles: list[RequestHandle], tenant: Tenant, uncounted: Collection[RequestHandle] = ()) -> None:
        """Cancel a request's samples (their blocks go back at the loop's next step); each is counted once it ended
        (but those in ``uncounted``: a prompt-logprobs score request is part of its client request, not one)."""
        for handle in handles:
            handle.cancel()
            if handle not in uncounted:
                self.spawn(self.observe_later(handle, tenant))

    async def wait(self, request: Request, handles: list[RequestHandle], tenant: Tenant,
                   uncounted: Collection[RequestHandle] = ()) -> list[Completion] | None:  # fmt: skip
        """The completions of the request's samples, or None if the client disconnected first (they are then
        cancelled). The metrics count each but those in ``uncounted``."""

        async def results() -> list[Completion]:
            return [await handle.aresult() for handle in handles]

        result = asyncio.ensure_future(results())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not result.done():
                result.cancel()
                self.cancel_all(handles, tenant, uncounted)
        if result in done:
            completions = result.result()
            for handle, completion in zip(handles, completions, strict=True):
                if handle not in uncounted:
                    self.metrics.observe(completion, tenant.tenant_id)
            return completions
        return None

    async def stream(self, handles: Sequence[RequestHandle | None], tenant: Tenant, *, rid: str, created: int,
                     chat: bool, body: P._GenerationBody, echoes: Sequence[Callable[[], Awaitable[Any]]] | None = None,
                     indices: Sequence[int] | None = None, scores: Sequence[RequestHandle] = (),
                     batch_usage: Callable[[list[Completion | None]], dict[str, Any]] | None = None,
                     ) -> AsyncIterator[str]:  # fmt: skip
        """SSE data lines of one request's samples (interleaved as they come, each chunk with its choice's
        ``index``); the ``finally`` cancels them if the client went away first.

        /v1/completions' batches and ``echo`` (:meth:`stream_prompts`): ``indices[i]`` is sample ``i``'s choice index;
        ``echoes[i]()`` awaits its first chunk's text and logprobs (the echoed prompt), or None when the prompt's
        score request failed (its error ends the stream); a None handle is a choice with no answer (``max_tokens:
        0``): its echo, then ``finish_reason: length``. ``scores``: the requests computing prompt logprobs (not client
        requests: not counted; their failures reported). ``batch_usage(results)``: the usage chunk's usage."""
        ids = bool(body.return_token_ids)
        usage = body.include_usage
        with_logprobs = body.num_logprobs() is not None
        observed = [h is None for h in handles]
        results: list[Completion | None] = [None] * len(handles)
        queue: asyncio.Queue[tuple[int, str | None]] = asyncio.Queue()

        def chunk(index: int, text: str | None, finish: str | None = None, token_ids: list[int] | None = None,
                  role: bool = False, logprobs: dict[str, Any] | None = None) -> str:  # fmt: skip
            return json.dumps(P.stream_chunk(rid, created, self.model_name, chat=chat, text=text, finish_reason=finish,
                                             token_ids=token_ids if ids else None, include_usage=usage,
                                             role=role, index=index, logprobs=logprobs))  # fmt: skip

        def token_logprobs(token_id: int, entry: Any, offset: int) -> dict[str, Any] | None:
            if entry is None:
                return None
            if chat:
                return P.chat_logprobs([token_id], [entry], self.token_text)
            return P.completion_logprobs([token_id], [entry], self.token_text, offset)

        async def one(pos: int, handle: RequestHandle | None) -> None:
            """The chunks of one sample, into the queue (None: it ended; its completion is then in)."""
            index = indices[pos] if indices is not None else pos
            try:
                if chat:
                    await queue.put((index, chunk(index, "", role=True, token_ids=[] if ids else None)))
                sent, offset = "", 0
                if echoes is not None:
                    echo = await echoes[pos]()
                    if echo is None:
                        return
                    text, logprobs = echo
                    offset = sum(map(len, logprobs["tokens"])) if logprobs is not None else 0
                    await queue.put((index, chunk(index, text, token_ids=[] if ids else None, logprobs=logprobs)))
                if handle is None:  # max_tokens 0: the echo is the whole answer
                    await queue.put((index, chunk(index, "", finish="length", token_ids=[] if ids else None)))
                    return
                async for event in handle.stream():
                    if event.text or ids or with_logprobs:
                        sent += event.text
                        logprobs = token_logprobs(event.token_id, event.logprob, offset)
                        if logprobs is not None and not chat:
                            offset += len(logprobs["tokens"][0])
                        await queue.put((index, chunk(index, event.text, token_ids=[event.token_id],
                                                      logprobs=logprobs)))  # fmt: skip
                completion = results[pos] = await handle.aresult()
                self.metrics.observe(completion, tenant.tenant_id)
                observed[pos] = True
                if _finish_error(completion) is None:
                    # deltas add up to the final text; should the loop have trimmed less than it held back, send
                    # the rest
                    rest = completion.text[len(sent) :] if completion.text.startswith(sent) else ""
                    await queue.put((index, chunk(index, rest if (rest or not chat) else None,
                                                  finish=completion.finish_reason,
                                                  token_ids=[] if ids else None)))  # fmt: skip
            finally:
                await queue.put((index, None))

        tasks = [asyncio.ensure_future(one(i, h)) for i, h in enumerate(handles)]
        try:
            running = len(tasks)
            while running:
                _, line = await queue.get()
                if line is None:
                    running -= 1
                else:
                    yield line
            for task in tasks:
                task.result()  # an exception of a sample's task is this stream's
            ended = [c for c in results if c is not None] + [s.completion for s in scores if s.done]
            error = next((e for e in map(_finish_error, ended) if e is not None), None)
            if error is not None:
                yield error.event()
            elif usage:
                totals = P.usage(results) if batch_usage is None else batch_usage(results)  # type: ignore[arg-type]
                yield json.dumps(P.usage_chunk(rid, created, self.model_name, chat=chat, usage=totals))
            yield "[DONE]"
        finally:
            for task in tasks:
                task.cancel()
            for score in scores:
                score.cancel()  # a no-op once it ended
            for pos, handle in enumerate(handles):
                if handle is not None and not observed[pos]:
                    handle.cancel()
                    self.spawn(self.observe_later(handle, tenant))

    async def generate(self, request: Request, body: P._GenerationBody, prompt: Any, *, chat: bool) -> Any:
        self.check_model(body.model)
        tenant: Tenant = request.state.tenant
        param = "messages" if chat else "prompt"
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        created = P.now()
        max_tokens, tokenized = await self.max_tokens(body, prompt, chat, param)
        handle = await run_in_threadpool(self.submit, tokenized or prompt, body, max_tokens, tenant, chat, rid, param)
        handles = list(handle.samples)
        if body.stream:
            return EventSourceResponse(self.stream(handles, tenant, rid=rid, created=created, chat=chat, body=body),
                                       sep="\n")  # fmt: skip
        try:
            completions = await self.wait(request, handles, tenant)
        except asyncio.CancelledError:  # the server is stopping this task: the request goes too
            for h in handles:
                h.cancel()
            raise
        if completions is None:
            return Response(status_code=499)  # nobody reads it: the client is gone
        for completion in completions:
            error = _finish_error(completion)
            if error is not None:
                raise error
        build = P.chat_body if chat else P.completion_body
        return build(rid, created, self.model_name, completions, bool(body.return_token_ids), self.token_text)


    # ------------------------------------------------------------------ /v1/completions: batches and echo
    async def completions(self, request: Request, body: P.CompletionRequest) -> Any:
        """``/v1/completions``: one prompt without ``echo`` goes through :meth:`generate` (streaming or not); a batch
        of prompts, or ``echo``, is submitted prompt by prompt (:meth:`submit_prompt`), then streamed
        (:meth:`stream_prompts`) or awaited together (one watch for the client leaving) and answered whole, prompt
        ``i``'s samples as choices ``i * n + j``, the usage added up over the prompts."""
        self.check_model(body.model)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 is accepted with echo: true only: the prompt's "
                           "logprobs without an answer)", param="max_tokens", code="invalid_value")  # fmt: skip
        prompts = body.prompts()
        if len(prompts) == 1 and not body.echo:
            return await self.generate(request, body, prompts[0], chat=False)
        tenant: Tenant = request.state.tenant
        rid, created = P.new_id("cmpl"), P.now()
        parts: list[_Submitted] = []
        try:
            for i, prompt in enumerate(prompts):
                parts.append(await self.submit_prompt(body, prompt, tenant, f"{rid}-{i}"))
        except BaseException:  # a later prompt refused: the earlier ones are not answered, so they stop
            for part in parts:
                self.cancel_all(part.handles(), tenant, [part.score] if part.score else [])
            raise
        if body.stream:
            return EventSourceResponse(self.stream_prompts(parts, body, tenant, rid, created), sep="\n")
        handles = [h for part in parts for h in part.handles()]
        scores = [part.score for part in parts if part.score is not None]
        try:
            done = await self.wait(request, handles, tenant, scores) if handles else []
        except asyncio.CancelledError:
            for h in handles:
                h.cancel()
            raise
        if done is None:
            return Response(status_code=499)  # the client is gone
        for completion in done:
            error = _finish_error(completion)
            if error is not None:
                raise error
        n = int(body.n or 1)
        choices, answers = [], []
        at = 0
        for i, part in enumerate(parts):
            mine = done[at : at + len(part.handles())]
            at += len(part.handles())
            samples = mine[: len(part.samples)]
            for choice in self.echo_choices(body, part, samples, mine[len(part.samples) :]):
                choices.append({**choice, "index": i * n + choice["index"]})
            answers.append(samples)
        return {"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                "choices": choices, "usage": _prompts_usage(parts, answers)}  # fmt: skip

    def stream_prompts(self, parts: list[_Submitted], body: P.CompletionRequest, tenant: Tenant, rid: str,
                       created: int) -> AsyncIterator[str]:  # fmt: skip
        """The stream of a batch of prompts or of ``echo`` (vLLM's): prompt ``i``'s samples as choices ``i * n + j``,
        interleaved as they come; with ``echo`` each choice's first chunk is its prompt's text (and, with
        ``logprobs``, its prompt's logprobs, once its score request ended), then the answer's chunks (text offsets
        counted after the prompt); ``max_tokens: 0``: the echo, then ``finish_reason: length``. The chunks of a
        choice add up to its whole answer's choice."""
        n = int(body.n or 1)
        handles: list[RequestHandle | None] = []
        indices: list[int] = []
        echoes: list[Callable[[], Awaitable[Any]]] = []
        for i, part in enumerate(parts):
            for j, handle in enumerate(part.samples or [None]):
                handles.append(handle)
                indices.append(i * n + j)
                echoes.append(lambda part=part: self.stream_echo(body, part))
        scores = [part.score for part in parts if part.score is not None]

        def usage(results: list[Completion | None]) -> dict[str, Any]:
            answers, at = [], 0
            for part in parts:
                answers.append([c for c in results[at : at + max(1, len(part.samples))] if c is not None])
                at += max(1, len(part.samples))
            return _prompts_usage(parts, answers)

        return self.stream(handles, tenant, rid=rid, created=created, chat=False, body=body, indices=indices,
                           echoes=echoes if body.echo else None, scores=scores, batch_usage=usage)  # fmt: skip

    async def stream_echo(self, body: P.CompletionRequest, part: _Submitted) -> tuple[str, Any] | None:
        """A streamed choice's echo: the prompt's text and (with ``logprobs``) its logprobs, the first one null, as
        the whole answer has them; None if the prompt's score request failed (the stream then reports it)."""
        entries: list[Any] = [None]
        if part.score is not None:
            score = await part.score.aresult()
            if _finish_error(score) is not None:
                return None
            entries += score.score_logprobs or []
        logprobs = None
        if body.num_logprobs() is not None:
            logprobs = P.completion_logprobs(part.ids, entries, self.token_text)
        return self.echo_text(part), logprobs

    def echo_text(self, part: _Submitted) -> str:
        """A prompt as ``echo`` shows it: the text as sent, or token ids decoded (special tokens kept)."""
        if isinstance(part.prompt, str):
            return part.prompt
        engine = self.loop.engine
        with engine.tokenizer_lock:
            return engine.tokenizer.decode(part.ids, skip_special_tokens=False)

    async def submit_prompt(self, body: P.CompletionRequest, prompt: Any, tenant: Tenant, rid: str) -> _Submitted:
        """One prompt of :meth:`completions`, submitted: its generate request (none for ``max_tokens: 0``) and, for
        ``echo`` with ``logprobs``, the request of its prompt logprobs (:meth:`submit_prompt_score`; the prompt is
        then computed twice: once for them, once, reusing the cache, for the answer)."""
        max_tokens, tokenized = await self.max_tokens(body, prompt, False, "prompt")
        if tokenized is None:
            tokenized = await self.tokenize(prompt, False, "prompt")
        part = _Submitted(prompt, list(tokenized.ids), rid)
        if max_tokens > 0:
            handle = await run_in_threadpool(self.submit, tokenized, body, max_tokens, tenant, False, rid, "prompt")
            part.samples = list(handle.samples)
        k = body.num_logprobs()
        if body.echo and k is not None and len(part.ids) > 1:
            try:
                part.score = await run_in_threadpool(self.submit_prompt_score, part.ids, k, tenant, body, rid)
            except BaseException:
                self.cancel_all(part.samples, tenant)
                raise
        return part

    def echo_choices(self, body: P.CompletionRequest, part: _Submitted, samples: list[Completion],
                     score: list[Completion]) -> list[dict[str, Any]]:  # fmt: skip
        """The choices of one prompt (``index``: the sample's): the echoed prompt (text; with ``logprobs`` its
        tokens, the first one null, then the score request's entries), then each sample's answer."""
        k = body.num_logprobs()
        prompt_entries: list[Any] = [None, *(score[0].score_logprobs or [])] if score else [None]
        echoed = self.echo_text(part) if body.echo else ""
        choices = []
        for c in samples or [part.nothing(k is not None)]:
            logprobs = None
            if k is not None and body.echo:
                logprobs = P.completion_logprobs([*part.ids, *c.output_ids], [*prompt_entries, *(c.logprobs or [])],
                                                 self.token_text)  # fmt: skip
            elif k is not None:
                logprobs = P.completion_logprobs(c.output_ids, c.logprobs, self.token_text)
            choice: dict[str, Any] = {"index": c.index, "text": echoed + c.text, "logprobs": logprobs,
                                      "finish_reason": c.finish_reason}  # fmt: skip
            if body.return_token_ids:
                choice["token_ids"] = list(c.output_ids)
            choices.append(choice)
        return choices


class _Submitted:
    """One prompt of a batch / echo request on its way: its ids, its samples' handles, its score request's."""

    def __init__(self, prompt: Any, ids: list[int], rid: str) -> None:
        self.prompt, self.ids, self.rid = prompt, ids, rid
        self.samples: list[RequestHandle] = []
        self.score: RequestHandle | None = None

    def handles(self) -> list[RequestHandle]:
        return [*self.samples, *([self.score] if self.score is not None else [])]

    def nothing(self, logprobs: bool = False) -> Completion:
        """The answer of ``max_tokens: 0``: none (finish_reason ``length``, as vLLM)."""
        return Completion(request_id=self.rid, prompt_tokens=len(self.ids), output_ids=[], text="",
                          finish_reason="length", logprobs=[] if logprobs else None)  # fmt: skip


def _prompts_usage(parts: list[_Submitted], answers: list[list[Completion]]) -> dict[str, Any]:
    """The usage of a batch of prompts: each prompt's (its samples' ``answers``; none: ``max_tokens: 0``) added up."""
    totals = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = 0
    for part, samples in zip(parts, answers, strict=True):
        used = P.usage(samples or [part.nothing()])
        for key in totals:
            totals[key] += used[key]
        cached += used["prompt_tokens_details"]["cached_tokens"]
    return {**totals, "prompt_tokens_details": {"cached_tokens": cached}}


def _finish_error(completion: Completion) -> APIError | None:
    """The API error of a request the loop ended other than by ``stop`` / ``length``."""
    reason = completion.finish_reason
    if reason in ("stop", "length"):
        return None
    detail = completion.error or f"the request ended: {reason}"
    if reason == "timeout":
        return APIError(504, detail, "timeout", code="request_timeout")
    if reason in ("shutdown", "cancelled"):
        return _stopped(detail)
    return APIError(500, detail, "server_error", code="engine_error")


def _stopped(message: str) -> APIError:
    return APIError(503, message, "service_unavailable", code="loop_stopped",
                    headers={"Retry-After": str(STOPPED_RETRY_AFTER_S)})  # fmt: skip


def _prompt_error(exc: BaseException, param: str) -> APIError:
    message = str(exc) or type(exc).__name__
    code = "context_length_exceeded" if "does not fit" in message or "more than" in message else "invalid_prompt"
    return APIError(400, message, param=param, code=code)


def _named(fields: list[str]) -> str:
    """Field names for a header or a log line: JSON-escaped (ASCII, no control characters), at most
    :data:`MAX_NAMED_FIELDS` of them. A name that would be ambiguous or invalid bare (empty, padded with spaces,
    holding a comma or starting with a quote) is sent as a JSON string: a header value may not end in whitespace."""
    shown = [_field_name(json.dumps(f)[1:-1][:200]) for f in fields[:MAX_NAMED_FIELDS]]
    if len(fields) > MAX_NAMED_FIELDS:
        shown.append(f"... ({len(fields) - MAX_NAMED_FIELDS} more)")
    return ", ".join(shown)


def _field_name(escaped: str) -> str:
    if escaped and escaped == escaped.strip() and "," not in escaped and not escaped.startswith('"'):
        return escaped
    return f'"{escaped}"'


def _with_ignored(result: Any, fields: list[str]) -> Any:
    """``result`` (a body or a response) with the :data:`~kvboost.serving.protocol.IGNORED_FIELDS_HEADER` header
    naming ``fields``, if any."""
    if not fields:
        return result
    if not isinstance(result, Response):
        result = JSONResponse(result)
    result.headers[P.IGNORED_FIELDS_HEADER] = _named(fields)
    return result


async def _disconnected(request: Request) -> None:
    """Returns when the client disconnects (the body was read already, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def create_app(
    loop: Any, *, model_name: str | Sequence[str], api_keys: list[str] | None = None,
    server_secret: str | bytes | None = None, max_model_len: int | None = None, strict_requests: bool = False,
) -> FastAPI:  # fmt: skip
    """The FastAPI app serving ``loop`` (an :class:`~kvboost.engine.loop.EngineLoop`, started by the caller).

    ``model_name``: the name clients send as ``model``, or several (aliases, as vLLM's ``--served-model-name``:
    each is served and listed, responses report the first). ``strict_requests``: unknown request fields are a 400
    instead of being ignored (with a log line and the ignored-fields header). ``api_keys``: if given, every route
    except ``/health``, ``/metrics`` and ``/openapi.json`` needs ``Authorization: Bearer <key>``, and each key is a
    tenant with its own cache salt (``HMAC-SHA256(server_secret, key)``; ``server_secret`` None: the secret stored in
    the kvboost cache folder, see :mod:`kvboost.serving.tenancy`). ``max_model_len``: a context limit below the
    model's.
    Callables appended to ``app.state.shutdown_hooks`` run, in order, when the server shuts down (the CLI stops the
    loop and closes the engine there).
    """
    names = [model_name] if isinstance(model_name, str) else list(dict.fromkeys(model_name))
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"model_name must be a non-empty name or list of names, got {model_name!r}")
    service = _Service(loop, names, Tenancy(api_keys, server_secret), max_model_len, strict_requests)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        for hook in list(app.state.shutdown_hooks):
            try:
                await run_in_threadpool(hook)
            except Exception:
                log.exception("kvboost-server: a shutdown hook failed")

    app = FastAPI(title="kvboost", summary="OpenAI-compatible server over the kvboost engine loop",
                  docs_url=None, redoc_url=None, lifespan=lifespan)  # fmt: skip
    app.state.service = service
    app.state.shutdown_hooks = []  # list[Callable[[], Any]]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _http_error(request, exc).response()

    app.add_middleware(GuardMiddleware, tenancy=service.tenancy)

    @app.get("/health", summary="200 while the engine loop runs, else 503")
    async def health() -> dict[str, str]:
        if not loop.stats().get("running", False):
            raise _stopped("the engine loop is not running")
        return {"status": "ok"}

    @app.get("/metrics", summary="Prometheus metrics (text exposition)")
    async def metrics() -> Response:
        await service.metrics.refresh()
        return Response(service.metrics.render(), media_type=service.metrics.content_type)

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "kvboost",
                "max_model_len": service.max_model_len}  # fmt: skip

    @app.get("/v1/models", summary="The served model's names (aliases: the same model)")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in names]}

    @app.get("/v1/models/{model_id:path}", summary="One model")
    async def model(model_id: str) -> dict[str, Any]:
        service.check_model(model_id)
        return model_card(model_id)

    @app.post("/v1/completions", summary="Text completion (SSE when stream=true)")
    async def completions(body: P.CompletionRequest, request: Request) -> Any:
        ignored = service.ignored_fields(body)
        return _with_ignored(await service.completions(request, body), ignored)

    @app.post("/v1/chat/completions", summary="Chat completion (SSE when stream=true)")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request) -> Any:
        ignored = service.ignored_fields(body)
        messages = body.plain_messages()
        service.check_model(body.model)
        await service.check_rendered(messages)
        return _with_ignored(await service.generate(request, body, messages, chat=True), ignored)

    @app.post("/tokenize", summary="Token ids of a prompt or of chat messages, as generation sees them")
    async def tokenize(body: P.TokenizeRequest, request: Request) -> Any:
        service.check_model(body.model)
        ignored = service.ignored_fields(body)
        chat = body.messages is not None
        prompt = [m.plain() for m in body.messages] if chat else body.prompt
        if chat:
            await service.check_rendered(prompt)
        ids = (await service.tokenize(prompt, chat, "messages" if chat else "prompt")).ids
        return _with_ignored({"tokens": ids, "count": len(ids), "max_model_len": service.max_model_len}, ignored)

    @app.post("/v1/cache/warm", summary="Compute and store the KV of a text (optionally pinned)")
    async def warm(body: P.WarmRequest, request: Request) -> dict[str, Any]:
        service.check_model(body.model)
        tenant: Tenant = request.state.tenant
        salt = tenant.cache_salt(body.cache_salt)
        text, pin = body.text, body.pin
        try:
            result = await asyncio.to_thread(loop.warm, text, pin=pin, cache_salt=salt, chat=False)
        except LoopStopped as exc:
            raise _stopped(str(exc)) from None
        except CLIENT_ERRORS as exc:
            raise _prompt_error(exc, "text") from None
        return asdict(result)

    return app
