"""kvboost-server against OpenAI's API as published (issue 43, "OpenAI conformance"), on a tiny random fp32 model:

- defaults: an omitted ``temperature`` is 1.0 and ``top_p`` 1.0 (OpenAI's), not greedy;
- limits: prompt + ``max_tokens`` beyond the context is a 400 naming the limit (vLLM's message), and the server goes
  on serving; a request that fits exactly is served;
- ``n``: the n samples of a seed-fixed request equal n separate requests seeded ``seed + i``
  (:func:`kvboost.engine.requests.sample_seed`), whole or streamed, completions or chat, and the prompt was
  prefilled once: the core's counters (``prompt_tokens``, ``prefill_tokens``, ``forked_samples``) and the pool's
  copy-on-write count say so;
- ``logprobs`` / ``top_logprobs``: equal to the log-softmax of the logits of the same model run by HF (teacher forced
  over prompt + answer, 1e-4), to the engine's own ``first_token_logits`` and to its own teacher-forced score
  (``engine.generate(score_ids=...)``); raw logprobs (before temperature), whatever the sampling settings;
- every response body (whole, every SSE chunk, every error) is valid against OpenAI's published OpenAPI schema
  (``tests/data/openai_response_schemas.json``, extracted from github.com/openai/openai-openapi, MIT) and against the
  official ``openai`` client's pydantic types with no field those types do not know.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
import torch
from openai.types import Completion as OpenAICompletion
from openai.types import CompletionChoice
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.shared import ErrorObject
from test_server import MODEL, sample, served
from kvboost_testkit.tiny import ToyTokenizer, tiny_model

from kvboost.engine.requests import sample_seed
from kvboost.serving import protocol as P

CONTEXT = 96  # the server's max_model_len: small, so a request that fills it exactly stays quick
TOL = 1e-4
SCHEMAS = json.loads((Path(__file__).parent / "data" / "openai_response_schemas.json").read_text())
#: kvboost's documented extension (vLLM's): generated token ids in each choice, only when return_token_ids is set
EXTENSIONS = {"token_ids"}


# ---------------------------------------------------------------------- harness
@pytest.fixture(scope="module")
def server():
    with served(max_model_len=CONTEXT) as s:
        yield s


@pytest.fixture(scope="module")
def hf_model():
    return tiny_model("llama", seed=0)  # the weights make_engine("llama") serves


def _validator(name: str, *, streamed: bool = False) -> jsonschema.protocols.Validator:
    schema = copy.deepcopy(SCHEMAS)
    if streamed:
        # The published CreateCompletionResponse (which the streamed completions chunks share) has no null
        # finish_reason and no null usage, but OpenAI's API sends "finish_reason": null on every chunk but a choice's
        # last and, with stream_options.include_usage, "usage": null on every chunk but the usage chunk (as the chat
        # chunk schema allows for both): for completions chunks only, null is admitted there too.
        props = schema["components"]["schemas"][name]["properties"]
        reason = props["choices"]["items"]["properties"]["finish_reason"]
        reason["enum"] = [*reason["enum"], None]
        reason["type"] = ["string", "null"]
        props["usage"] = {"anyOf": [props["usage"], {"type": "null"}]}
    root = {**schema, "$ref": f"#/components/schemas/{name}"}
    cls = jsonschema.validators.validator_for({"$schema": "https://json-schema.org/draft/2020-12/schema"})
    return cls(root)


VALIDATORS = {
    "chat": _validator("CreateChatCompletionResponse"),
    "chat_chunk": _validator("CreateChatCompletionStreamResponse"),
    "completion": _validator("CreateCompletionResponse"),
    "completion_chunk": _validator("CreateCompletionResponse", streamed=True),
    "error": _validator("ErrorResponse"),
}


class _StreamedCompletionChoice(CompletionChoice):
    """The client's ``CompletionChoice`` with a null ``finish_reason`` allowed: the client parses streamed
    completions chunks into ``Completion`` without validating them, and OpenAI's API sends null on every chunk but a
    choice's last (the type, like the published schema, has no null)."""

    finish_reason: Literal["stop", "length", "content_filter"] | None = None  # type: ignore[assignment]


class _StreamedCompletion(OpenAICompletion):
    choices: list[_StreamedCompletionChoice]  # type: ignore[assignment]


TYPES = {"chat": ChatCompletion, "chat_chunk": ChatCompletionChunk, "completion": OpenAICompletion,
         "completion_chunk": _StreamedCompletion}  # fmt: skip


def _no_unknown_fields(model: Any, where: str, extensions: set[str]) -> None:
    """Every field of the validated body is one the openai type declares (its ``model_extra`` is empty), down the
    tree; ``extensions`` are allowed on choices."""
    if isinstance(model, pydantic.BaseModel):
        extra = set(model.model_extra or ()) - (extensions if where.endswith("]") else set())
        assert not extra, f"{where}: fields the openai types do not know: {extra}"
        for name in type(model).model_fields:
            _no_unknown_fields(getattr(model, name), f"{where}.{name}", extensions)
    elif isinstance(model, list):
        for i, item in enumerate(model):
            _no_unknown_fields(item, f"{where}[{i}]", extensions)
    elif isinstance(model, dict):
        for key, item in model.items():
            _no_unknown_fields(item, f"{where}[{key!r}]", extensions)


def check_body(body: dict[str, Any], kind: str, *, token_ids: bool = False) -> None:
    """``body`` against OpenAI's published schema and against the openai client's type (strict: no unknown field,
    every required one there)."""
    errors = sorted(VALIDATORS[kind].iter_errors(body), key=lambda e: list(e.path))
    assert not errors, f"{kind} not valid against OpenAI's schema: {errors[0].message} at {list(errors[0].path)}"
    if kind == "error":
        ErrorObject.model_validate(body["error"])
        assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
        return
    model = TYPES[kind].model_validate(body)
    _no_unknown_fields(model, kind, EXTENSIONS if token_ids else set())
    if token_ids:
        assert all("token_ids" in c for c in body["choices"]), body


def post(server, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    """A whole (non-streamed) request; the body is checked against the schemas (response or error)."""
    with server.http(key=None) as c:
        r = c.post(path, json=body)
    data = r.json()
    if r.status_code == 200:
        check_body(data, "chat" if "chat" in path else "completion", token_ids=bool(body.get("return_token_ids")))
    else:
        check_body(data, "error")
    return r.status_code, data


def stream(server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed request's chunks, each checked against the schemas; the stream ends with [DONE]."""
    chat = "chat" in path
    chunks, done = [], False
    with server.http(key=None) as c, c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            assert not done, "data after [DONE]"
            if data == "[DONE]":
                done = True
                continue
            chunk = json.loads(data)
            assert "error" not in chunk, chunk
            check_body(chunk, "chat_chunk" if chat else "completion_chunk",
                       token_ids=bool(body.get("return_token_ids")) and bool(chunk["choices"]))  # fmt: skip
            chunks.append(chunk)
    assert done
    return chunks


def by_index(chunks: list[dict[str, Any]], chat: bool) -> dict[int, dict[str, Any]]:
    """Per choice index: text, token ids and logprobs put together from the chunks, and its finish_reason."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            acc = out.setdefault(choice["index"], {"text": "", "token_ids": [], "logprobs": [], "finish": None})
            acc["text"] += (choice["delta"].get("content") or "") if chat else choice["text"]
            acc["token_ids"] += choice.get("token_ids") or []
            lp = choice["logprobs"]
            if lp is not None:
                acc["logprobs"] += (
                    lp["content"]
                    if chat
                    else [
                        {"token": t, "logprob": v, "top": top, "offset": o}
                        for t, v, top, o in zip(
                            lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"], strict=True
                        )
                    ]
                )
            if choice["finish_reason"] is not None:
                assert acc["finish"] is None, "two finish reasons"
                acc["finish"] = choice["finish_reason"]
    return out


def counters(server) -> dict[str, int]:
    server.wait_idle()
    return dict(server.engine.core.counters)


def hf_logprobs(model, prompt_ids: list[int], answer: list[int]) -> torch.Tensor:
    """log_softmax of HF's logits that predict each answer token (teacher forced): ``[len(answer), vocab]``."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt_ids + answer])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(answer)], dim=-1)


def tokens_of(server, *, prompt: str | None = None, messages: list | None = None) -> list[int]:
    with server.http(key=None) as c:
        body = {"prompt": prompt} if prompt is not None else {"messages": messages}
        return c.post("/tokenize", json=body).json()["tokens"]


# ---------------------------------------------------------------------- defaults
def test_omitted_temperature_and_top_p_are_openais_defaults(server):
    body = P.ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    params = body.sampling_params(8)
    assert (params.temperature, params.top_p, params.n, params.logprobs) == (1.0, 1.0, 1, None)
    assert P.CompletionRequest(prompt="x", temperature=0).sampling_params(8).greedy
    prompt = "Defaults test: what does an omitted temperature mean?"
    base = {"prompt": prompt, "max_tokens": 8, "return_token_ids": True}
    greedy = post(server, "/v1/completions", {**base, "temperature": 0})[1]["choices"][0]["token_ids"]
    differs = 0
    for seed in range(4):
        omitted = post(server, "/v1/completions", {**base, "seed": seed})[1]["choices"][0]["token_ids"]
        explicit = post(server, "/v1/completions", {**base, "seed": seed, "temperature": 1.0, "top_p": 1.0})[1]
        assert omitted == explicit["choices"][0]["token_ids"]  # omitted == OpenAI's defaults, sent
        differs += omitted != greedy
    assert differs >= 3, "an omitted temperature decoded greedily"


# ---------------------------------------------------------------------- limits
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_max_tokens_beyond_the_context_is_a_400_naming_the_limit(server, chat):
    client = server.client(None)
    if chat:
        messages = [{"role": "user", "content": "Limits test: how long may my answer be?"}]
        n = len(tokens_of(server, messages=messages))
        path, body, where = "/v1/chat/completions", {"messages": messages}, "messages"
    else:
        prompt = "Limits test: how long may my answer be?"
        n = len(tokens_of(server, prompt=prompt))
        path, body, where = "/v1/completions", {"prompt": prompt}, "prompt"
    for field in ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",):
        for requested in (CONTEXT - n + 1, 100_000):
            status, error = post(server, path, {**body, field: requested, "temperature": 0})
            assert status == 400
            assert error["error"]["message"] == (
                f"This model's maximum context length is {CONTEXT} tokens. However, you requested {n + requested} "
                f"tokens ({n} in the {where}, {requested} in the completion). Please reduce the length of the "
                f"{where} or completion.")  # fmt: skip
            assert error["error"]["param"] == field and error["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="maximum context length is 96 tokens"):
        if chat:
            client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=CONTEXT)
        else:
            client.completions.create(model=MODEL, prompt=body["prompt"], max_tokens=CONTEXT)
    # exactly the context: served (and the server kept serving after the 400s)
    status, ok = post(server, path, {**body, "max_tokens": CONTEXT - n, "temperature": 0})
    assert status == 200 and ok["usage"]["prompt_tokens"] == n
    assert ok["usage"]["total_tokens"] <= CONTEXT
    with server.http(key=None) as c:
        assert c.get("/health").status_code == 200


def test_a_prompt_checked_against_max_tokens_is_tokenized_once(server, monkeypatch):
    """The server tokenizes a prompt to check ``max_tokens`` against the context; the request it submits takes those
    tokens (``TokenizedPrompt``) instead of tokenizing the prompt again. Fails if the engine tokenizes it twice."""
    calls = []
    original = server.engine.tokenize_with_spans

    def counting(prompt, **kwargs):
        calls.append(prompt)
        return original(prompt, **kwargs)

    monkeypatch.setattr(server.engine, "tokenize_with_spans", counting)
    messages = [{"role": "user", "content": "Tokenize me once, please."}]
    status, body = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, "temperature": 0})
    assert status == 200 and len(calls) == 1
    assert body["usage"]["prompt_tokens"] == len(tokens_of(server, messages=messages))


# ---------------------------------------------------------------------- n
def test_n_samples_equal_separate_requests_seeded_by_sample_seed_and_prefill_once(server):
    prompt = "n test: one prefill, then four samples share its blocks."
    ids = tokens_of(server, prompt=prompt)
    assert len(ids) % 16, "the prompt must end in a partial block for the copy-on-write check"
    n, seed = 4, 20260101
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0.9, "top_p": 0.95, "seed": seed,
            "return_token_ids": True}  # fmt: skip
    pool = server.engine.pool
    before, cow = counters(server), pool.stats.copy_on_write
    status, whole = post(server, "/v1/completions", {**body, "n": n})
    after = counters(server)
    assert status == 200 and [c["index"] for c in whole["choices"]] == list(range(n))
    delta = {k: after[k] - before[k] for k in after}
    # the prompt was prefilled once: its tokens counted and computed once, the other samples forked its table
    assert delta["prompt_tokens"] == len(ids) and delta["prefix_query_tokens"] == len(ids)
    assert delta["prefill_tokens"] == len(ids) and delta["prefix_hit_tokens"] == 0  # a new prompt: all computed
    assert delta["forked_samples"] == n - 1 and delta["forked_prompt_tokens"] == (n - 1) * len(ids)
    assert pool.stats.copy_on_write - cow == n - 1  # the shared partial block: copied by all writers but the last
    text = server.metrics()  # the same counters on /metrics
    assert sample(text, "kvboost:forked_samples_total", model_name=MODEL) >= n - 1
    assert sample(text, "kvboost:prefill_tokens_total", model_name=MODEL) == after["prefill_tokens"]
    usage = whole["usage"]
    assert usage["prompt_tokens"] == len(ids)
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in whole["choices"])
    samples = [c["token_ids"] for c in whole["choices"]]
    assert len({tuple(s) for s in samples}) > 1, "the samples are not independent"
    # each sample equals a separate request with the seed sample_seed gives
    for i in range(n):
        alone = post(server, "/v1/completions", {**body, "seed": sample_seed(seed, i)})[1]["choices"][0]
        assert alone["token_ids"] == samples[i], i
        assert alone["text"] == whole["choices"][i]["text"]
    # streamed: the same samples, each chunk with its index; a repeat is a full prefix hit, still forked
    streamed = by_index(stream(server, "/v1/completions", {**body, "n": n}), chat=False)
    assert sorted(streamed) == list(range(n))
    for i in range(n):
        assert streamed[i]["token_ids"] == samples[i] and streamed[i]["text"] == whole["choices"][i]["text"]
        assert streamed[i]["finish"] == whole["choices"][i]["finish_reason"]
    pool.verify()
    assert pool.num_referenced == 0 or server.engine.store.pinned_keys(), "blocks leaked after n samples"


def test_n_chat_through_the_official_client(server):
    client = server.client(None)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "n chat test: say something"}]
    args = {"model": MODEL, "messages": messages, "max_tokens": 8, "seed": 77, "extra_body": {"return_token_ids": True}}
    whole = client.chat.completions.create(n=3, **args)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    check_body(whole.to_dict(), "chat", token_ids=True)
    for i, choice in enumerate(whole.choices):
        alone = client.chat.completions.create(**{**args, "seed": sample_seed(77, i)}).choices[0]
        assert alone.message.content == choice.message.content
    chunks = list(client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **args))
    for chunk in chunks:
        check_body(chunk.to_dict(), "chat_chunk", token_ids=bool(chunk.choices))
    texts = by_index([c.to_dict() for c in chunks], chat=True)
    assert [texts[i]["text"] for i in range(3)] == [c.message.content for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]  # every sample's first chunk carries the role
    unseeded = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=2)
    assert [c.index for c in unseeded.choices] == [0, 1]


# ---------------------------------------------------------------------- logprobs
@pytest.mark.parametrize("temperature", [0.0, 0.7], ids=["greedy", "sampled"])
def test_completion_logprobs_are_the_models_log_softmax(server, hf_model, temperature):
    """Legacy completions logprobs (an int): each token's logprob and its top 5 equal the log-softmax of the
    model's logits (HF, teacher forced): raw, before temperature; the top_logprobs dicts hold the alternatives and
    the sampled token; text_offset walks the text."""
    prompt = f"Logprobs test ({temperature}): the model's own log-softmax, token by token."
    ids = tokens_of(server, prompt=prompt)
    _, body = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": temperature,
                                               "seed": 5, "logprobs": 5, "return_token_ids": True})  # fmt: skip
    choice = body["choices"][0]
    answer, lp = choice["token_ids"], choice["logprobs"]
    ref = hf_logprobs(hf_model, ids, answer)
    tok = ToyTokenizer()
    assert lp["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in answer]
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(answer))]
    for j, token in enumerate(answer):
        assert abs(lp["token_logprobs"][j] - float(ref[j, token])) <= TOL, j
        top_v, top_i = torch.topk(ref[j], 5)
        expected = {tok.decode([int(t)]): float(v) for t, v in zip(top_i, top_v, strict=True)}
        got = lp["top_logprobs"][j]
        assert lp["tokens"][j] in got and len(got) <= 6
        for text, value in expected.items():
            assert abs(got[text] - value) <= TOL, (j, text)
    if temperature == 0:
        assert all(lp["token_logprobs"][j] >= max(lp["top_logprobs"][j].values()) - TOL for j in range(len(answer)))
        # the engine's own numbers: its first-token logits and its teacher-forced score of the same answer
        result = server.engine.generate(ids, max_new_tokens=1, mode="cold", keep_logits=True, score_ids=answer)
        own = torch.log_softmax(result.first_token_logits.float(), -1)
        assert abs(lp["token_logprobs"][0] - float(own[answer[0]])) <= TOL
        assert abs(sum(lp["token_logprobs"]) - result.extra["answer_logprob"]) <= TOL * len(answer)


def test_chat_logprobs_whole_and_streamed(server, hf_model):
    messages = [{"role": "user", "content": "Chat logprobs test: tell me a secret"}]
    ids = tokens_of(server, messages=messages)
    base = {"messages": messages, "max_tokens": 8, "seed": 11, "logprobs": True, "top_logprobs": 3, "n": 2,
            "return_token_ids": True}  # fmt: skip
    _, whole = post(server, "/v1/chat/completions", base)
    tok = ToyTokenizer()
    for choice in whole["choices"]:
        answer, content = choice["token_ids"], choice["logprobs"]["content"]
        assert choice["logprobs"]["refusal"] is None and len(content) == len(answer)
        ref = hf_logprobs(hf_model, ids, answer)
        for j, (token, entry) in enumerate(zip(answer, content, strict=True)):
            assert entry["token"] == tok.decode([token]) and entry["bytes"] == list(entry["token"].encode())
            assert abs(entry["logprob"] - float(ref[j, token])) <= TOL
            top_v, top_i = torch.topk(ref[j], 3)
            assert [t["token"] for t in entry["top_logprobs"]] == [tok.decode([int(t)]) for t in top_i]
            assert all(abs(t["logprob"] - float(v)) <= TOL for t, v in zip(entry["top_logprobs"], top_v, strict=True))
    streamed = by_index(stream(server, "/v1/chat/completions", base), chat=True)
    for i, choice in enumerate(whole["choices"]):
        got = streamed[i]["logprobs"]
        assert [e["token"] for e in got] == [e["token"] for e in choice["logprobs"]["content"]]
        assert all(abs(a["logprob"] - b["logprob"]) <= TOL for a, b in zip(got, choice["logprobs"]["content"],
                                                                          strict=True))  # fmt: skip
        assert streamed[i]["text"] == choice["message"]["content"]
    # logprobs: true alone: the tokens' own logprobs, no alternatives; off: null
    _, plain = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 3, "logprobs": True})
    assert all(e["top_logprobs"] == [] for e in plain["choices"][0]["logprobs"]["content"])
    _, off = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 3})
    assert off["choices"][0]["logprobs"] is None


def test_logprobs_through_the_official_client(server):
    client = server.client(None)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "client logprobs"}],
                                       max_tokens=4, logprobs=True, top_logprobs=2, temperature=0)  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in content)
    assert "".join(e.token for e in content) == r.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt="client logprobs", max_tokens=4, logprobs=0, temperature=0)
    assert len(c.choices[0].logprobs.token_logprobs) == c.usage.completion_tokens
    assert all(len(top) == 1 for top in c.choices[0].logprobs.top_logprobs)  # logprobs=0: the sampled token only


# ---------------------------------------------------------------------- every response against the schema
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_every_response_is_valid_against_openais_schema(server, chat):
    """A matrix of requests (n, logprobs, stop strings, usage chunks, token ids): every whole body and every chunk
    is checked by ``post`` / ``stream`` against the published schema and the client's types."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    prompt = {"messages": [{"role": "user", "content": "Schema test"}]} if chat else {"prompt": "Schema test"}
    logprob_options = [{}, {"logprobs": True, "top_logprobs": 2}] if chat else [{}, {"logprobs": 2}]
    for n in (1, 3):
        for lp in logprob_options:
            for extra in ({}, {"stop": ["e"], "return_token_ids": True}):
                body = {**prompt, "max_tokens": 6, "n": n, "seed": 3, **lp, **extra}
                status, _ = post(server, path, body)
                assert status == 200
                stream(server, path, body)
                stream(server, path, {**body, "stream_options": {"include_usage": True}})
    for bad in ({"n": 0}, {"max_tokens": 100_000}, {"temperature": 5}, {"logprobs": 99}, {"repetition_penalty": 0}):
        status, _ = post(server, path, {**prompt, **bad})
        assert status == 400
    with server.http(key=None) as c:
        assert c.get("/health").status_code == 200


def test_a_late_stream_error_is_a_valid_error_event():
    """A stream that fails after its headers (here: its deadline) ends with an error event in OpenAI's envelope."""
    with served(eos=False, request_timeout_s=0.05) as s, s.http(key=None) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "late error", "max_tokens": 400, "n": 2,
                                                       "stream": True}) as r:  # fmt: skip
            events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        check_body(error, "error")
        assert error["error"]["code"] == "request_timeout"
        s.wait_idle()
        assert s.engine.pool.num_referenced == 0


def test_schema_file_names_its_source_and_license():
    comment = SCHEMAS["$comment"]
    assert "github.com/openai/openai-openapi" in comment and "MIT" in comment
    assert re.search(r"commit [0-9a-f]{40}", comment)
    assert (Path(__file__).parent / "data" / "openai-openapi.LICENSE").read_text().startswith("The MIT License")
