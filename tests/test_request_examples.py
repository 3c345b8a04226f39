"""Request-side conformance (issue 62): the request examples of OpenAI's published OpenAPI spec and the request bodies
LangChain's and LlamaIndex's OpenAI classes send, each sent to kvboost-server on a tiny random fp32 model.

- ``tests/data/openai_request_examples.json`` (extracted by ``tests/data/extract_openai_schemas.py --requests`` from
  github.com/openai/openai-openapi, MIT): every request example of the operations kvboost serves (chat completions,
  completions, the model list, one model), the ``example`` values of the request schemas' fields, and the request
  schemas. Each example is valid against OpenAI's request schema (checked: the extraction is right), and is sent with
  the model name replaced by the served one. Each is answered 200 (every response body, and every SSE chunk, valid
  against OpenAI's response schema and the official client's types), or refused with an OpenAI-format 400 naming
  the field, for what kvboost cannot serve: the expected outcome of each is in :data:`REFUSED` (anything not listed
  there must be answered). ``test_openai_examples_summary`` prints the count accepted and refused, with reasons.
- ``tests/data/framework_requests.json`` (recorded by ``tests/data/record_framework_requests.py`` with
  langchain-openai and llama-index-llms-openai, versions inside): the bodies of each library's one-shot, streamed,
  multi-turn-with-system, tool-call-history and tools-bound chats (and LangChain's legacy completions), sent as
  recorded; this needs neither library. ``test_*_live`` drive the libraries themselves against the server when
  they import (they are not dependencies of kvboost or its CI: skipped there). To run them, an environment with the
  libraries that also sees the development one (llama-index-llms-openai pins ``openai<3``)::

      python -m venv /tmp/fw && /tmp/fw/bin/pip install langchain-openai llama-index-llms-openai
      echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/fw/lib/python3.11/site-packages/zz_dev.pth
      /tmp/fw/bin/python -m pytest tests/test_request_examples.py -k live
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from kvboost_testkit.tiny import tiny_model
from test_openai_conformance import check_body
from test_request_conformance import REFUSED_MESSAGES, SHAPES, ToolTokenizer
from test_server import MODEL, SECRET, Served, serve_app, served_engine

from kvboost.serving.server import create_app

DATA = Path(__file__).parent / "data"
SPEC = json.loads((DATA / "openai_request_examples.json").read_text())
FRAMEWORKS = json.loads((DATA / "framework_requests.json").read_text())
#: the server's context: every example's answer fits (a chat without max_tokens gets the rest of it)
CONTEXT = 160

#: (method path, title) -> (param, words of the message): the examples kvboost refuses, with the field its 400 names.
#: Every other example must be answered.
REFUSED = {
    ("POST /chat/completions", "Image input"): ("messages[0].content[1].type", "image input"),
    ("POST /chat/completions", "Functions"): ("tools", "tools is not implemented"),
}
#: (path, field, example value) -> param: field examples refused (``suffix``: text after an insertion point)
FIELD_REFUSED = {("/completions", "suffix", "test."): "suffix"}
#: (library, scenario) -> param: recorded framework requests refused (tools bound: kvboost calls no tools)
FRAMEWORK_REFUSED = {
    ("langchain-openai", "bind_tools"): "tools",
    ("llama-index-llms-openai", "chat_with_tools"): "tools",
}
#: a minimal body per endpoint, for the field examples
BASE = {"/chat/completions": {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 3},
        "/completions": {"prompt": "Say this is a test", "max_tokens": 3}}  # fmt: skip
SCHEMA_OF = {"/chat/completions": "CreateChatCompletionRequest", "/completions": "CreateCompletionRequest"}


@dataclass
class Outcome:
    """What the server answered: the status; for a 400 the error's ``param`` and message; the response (whole body or
    the SSE chunks)."""

    status: int
    param: str | None = None
    message: str = ""
    body: Any = None


@pytest.fixture(scope="module")
def server() -> Iterator[Served]:
    """The tiny model behind a chat template that renders tool calls (recorded tool-call histories are answerable)."""
    from kvboost import KVBoost

    engine = KVBoost(tiny_model("llama"), ToolTokenizer(), model_identity="tiny-llama", decode="eager",
                     chunker={"name": "fixed", "chunk_size": 16})  # fmt: skip
    with served_engine(engine, max_model_len=CONTEXT) as s:
        yield s


def request_validator(path: str) -> jsonschema.protocols.Validator:
    """A validator of OpenAI's request schema of ``path`` (``/chat/completions`` or ``/completions``)."""
    root = {**SPEC, "$ref": f"#/components/schemas/{SCHEMA_OF[path]}"}
    return jsonschema.validators.validator_for({"$schema": "https://json-schema.org/draft/2020-12/schema"})(root)


VALIDATORS = {path: request_validator(path) for path in SCHEMA_OF}


def assert_openai_request(path: str, body: dict[str, Any]) -> None:
    errors = sorted(VALIDATORS[path].iter_errors(body), key=lambda e: list(e.path))
    assert not errors, f"not a valid {path} request of OpenAI's schema: {errors[0].message} at {list(errors[0].path)}"


def send(server: Served, method: str, path: str, body: dict[str, Any] | None) -> Outcome:
    """``body`` to ``/v1`` + ``path``, its model replaced by the served one. A 200's body (or each SSE chunk) is checked
    against OpenAI's response schema and the client's types, an error's against the error schema."""
    chat = path.endswith("/chat/completions")
    with server.http(key=None) as c:
        if method == "GET":
            r = c.get("/v1" + path.replace("{model}", MODEL))
            return Outcome(r.status_code, body=r.json())
        body = {**copy.deepcopy(body), "model": MODEL}
        if not body.get("stream"):
            r = c.post("/v1" + path, json=body)
            data = r.json()
            if r.status_code != 200:
                check_body(data, "error")
                return Outcome(r.status_code, data["error"]["param"], data["error"]["message"], data)
            check_body(data, "chat" if chat else "completion")
            return Outcome(200, body=data)
        with c.stream("POST", "/v1" + path, json=body) as r:
            if r.status_code != 200:
                data = json.loads(r.read())
                check_body(data, "error")
                return Outcome(r.status_code, data["error"]["param"], data["error"]["message"], data)
            events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert events and events[-1] == "[DONE]", events
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        assert "error" not in chunk, chunk
        check_body(chunk, "chat_chunk" if chat else "completion_chunk")
    return Outcome(200, body=chunks)


def answer_text(outcome: Outcome, chat: bool) -> str:
    """The first choice's text of a whole or streamed answer."""
    if isinstance(outcome.body, list):
        parts = [c["choices"][0]["delta"].get("content") or "" if chat else c["choices"][0]["text"]
                 for c in outcome.body if c["choices"] and c["choices"][0]["index"] == 0]  # fmt: skip
        return "".join(parts)
    choice = outcome.body["choices"][0]
    return choice["message"]["content"] if chat else choice["text"]


# ---------------------------------------------------------------------- OpenAI's request examples
EXAMPLES = SPEC["examples"]
EXAMPLE_IDS = [f"{e['method']} {e['path']} {e['title'][:24]}" for e in EXAMPLES]


def test_the_extraction_holds_what_the_tests_expect():
    """The examples are those of the operations kvboost serves; each refusal above names an example there; the
    request validator can fail (a message without its content, an unknown role)."""
    keys = {(f"{e['method']} {e['path']}", e["title"]) for e in EXAMPLES}
    assert set(REFUSED) <= keys
    assert {e["path"] for e in EXAMPLES} == {"/chat/completions", "/completions", "/models", "/models/{model}"}
    assert sum(e["body"] is not None for e in EXAMPLES) >= 7  # 5 chat + 2 completions at the extracted commit
    bad = {"model": "m", "messages": [{"role": "user"}]}
    assert list(VALIDATORS["/chat/completions"].iter_errors(bad))
    assert list(VALIDATORS["/chat/completions"].iter_errors({"model": "m", "messages": [{"role": "x", "content": ""}]}))


@pytest.mark.parametrize("example", EXAMPLES, ids=EXAMPLE_IDS)
def test_openai_request_example(server, example):
    """Answered (a valid OpenAI response), or refused with a 400 naming the field, as :data:`REFUSED` says."""
    path, body = example["path"], example["body"]
    if body is not None:
        assert_openai_request(path, body)
    outcome = send(server, example["method"], path, body)
    refused = REFUSED.get((f"{example['method']} {path}", example["title"]))
    if refused is not None:
        param, words = refused
        assert (outcome.status, outcome.param) == (400, param), outcome
        assert words in outcome.message and "kvboost" in outcome.message, outcome.message
        return
    assert outcome.status == 200, outcome
    if path == "/models":
        assert MODEL in [m["id"] for m in outcome.body["data"]]
    elif path == "/models/{model}":
        assert outcome.body["id"] == MODEL
    else:
        chat = path == "/chat/completions"
        assert isinstance(answer_text(outcome, chat), str)
        if body.get("logprobs"):  # the Logprobs example: top_logprobs 2
            entries = outcome.body["choices"][0]["logprobs"]["content"]
            assert entries and all(len(e["top_logprobs"]) == body["top_logprobs"] for e in entries)
        if "max_tokens" in body and not body.get("stream"):
            assert outcome.body["usage"]["completion_tokens"] <= body["max_tokens"]


#: every field example but ``model``'s (a model name of OpenAI's: each body's model is the served one)
FIELD_CASES = [(path, field, value) for path, fields in SPEC["field_examples"].items()
               for field, values in fields.items() if field != "model" for value in values]  # fmt: skip


@pytest.mark.parametrize("path,field,value", FIELD_CASES,
                         ids=[f"{p}:{f}={json.dumps(v)[:30]}" for p, f, v in FIELD_CASES])  # fmt: skip
def test_openai_field_example(server, path, field, value):
    """Each ``example`` the request schema gives a field, in a minimal body: answered, or a 400 naming the field
    (:data:`FIELD_REFUSED`)."""
    body = {**BASE[path], field: value}
    assert_openai_request(path, {"model": "m", **body})
    outcome = send(server, "POST", path, body)
    refused = FIELD_REFUSED.get((path, field, json.dumps(value) if not isinstance(value, str) else value))
    if refused is not None:
        assert (outcome.status, outcome.param) == (400, refused), outcome
        assert "not implemented by kvboost" in outcome.message
    else:
        assert outcome.status == 200, outcome


def test_openai_examples_summary(server, capsys):
    """The count of OpenAI's request examples accepted and refused (with the reasons), printed; it agrees with the
    tables above."""
    rows = []
    for e in EXAMPLES:
        o = send(server, e["method"], e["path"], e["body"])
        rows.append((f"{e['method']} {e['path']} [{e['title'][:40]}]", o))
    for path, field, value in FIELD_CASES:
        o = send(server, "POST", path, {**BASE[path], field: value})
        rows.append((f"POST {path} field example {field}={json.dumps(value)}", o))
    accepted = [name for name, o in rows if o.status == 200]
    refused = [(name, o) for name, o in rows if o.status != 200]
    with capsys.disabled():
        print(f"\nOpenAI request examples (spec examples + field examples): {len(rows)} sent, {len(accepted)} "
              f"accepted, {len(refused)} refused")  # fmt: skip
        for name, o in refused:
            print(f"  refused {o.status} param={o.param}: {name}: {o.message}")
    assert all(o.status == 400 for _, o in refused)
    assert len(refused) == len(REFUSED) + len(FIELD_REFUSED)


def test_hand_written_message_shapes_are_openai_requests():
    """The message shapes ``test_request_conformance`` sends are requests of OpenAI's published schema: those it
    answers, and those it refuses for what kvboost cannot serve (images, audio, files, a previous audio answer, a
    custom tool call), so each of those 400s refuses a valid OpenAI request; its one malformed message (a user
    message without content) is invalid there too."""
    for name, messages in SHAPES:
        assert_openai_request("/chat/completions", {"model": "m", "messages": messages})
    for name, messages, _ in REFUSED_MESSAGES:
        errors = list(VALIDATORS["/chat/completions"].iter_errors({"model": "m", "messages": messages}))
        assert bool(errors) == (name == "user_without_content"), (name, errors[:1])


# ---------------------------------------------------------------------- LangChain / LlamaIndex, as recorded
RECORDED = FRAMEWORKS["requests"]
RECORDED_IDS = [f"{r['library']}:{r['scenario']}:{i}" for i, r in enumerate(RECORDED)]


def test_recordings_cover_both_libraries():
    libraries = {r["library"] for r in RECORDED}
    assert libraries == {"langchain-openai", "llama-index-llms-openai"}, libraries
    assert set(FRAMEWORK_REFUSED) <= {(r["library"], r["scenario"]) for r in RECORDED}
    for library in libraries:
        scenarios = {r["scenario"] for r in RECORDED if r["library"] == library}
        assert {"multi_turn_system", "tool_call_history"} <= scenarios, (library, scenarios)
        assert any(r["body"].get("stream") for r in RECORDED if r["library"] == library)
    assert set(FRAMEWORKS["versions"]) >= {"langchain-openai", "llama-index-llms-openai", "openai"}


@pytest.mark.parametrize("recorded", RECORDED, ids=RECORDED_IDS)
def test_recorded_framework_request(server, recorded):
    """A body the library sent, as recorded (a valid OpenAI request): answered, or refused naming the field."""
    path = recorded["path"].removeprefix("/v1")
    assert_openai_request(path, recorded["body"])
    outcome = send(server, recorded["method"], path, recorded["body"])
    refused = FRAMEWORK_REFUSED.get((recorded["library"], recorded["scenario"]))
    if refused is not None:
        assert (outcome.status, outcome.param) == (400, refused), outcome
    else:
        assert outcome.status == 200, outcome
        assert isinstance(answer_text(outcome, path == "/chat/completions"), str)


# ---------------------------------------------------------------------- the libraries themselves, if installed
def test_langchain_live(server):
    """LangChain's ChatOpenAI against kvboost-server: invoke, stream, and its multi-turn idiom (the AIMessage appended
    to the history) with a system message."""
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.base + "/v1", api_key="none", temperature=0, max_tokens=4,
                     max_retries=0)  # fmt: skip
    history: list[Any] = [SystemMessage("You are a helpful assistant."), HumanMessage("Hello")]
    first = llm.invoke(history)
    assert isinstance(first.content, str) and first.response_metadata["model_name"] == MODEL
    history += [first, HumanMessage("Tell me more.")]
    second = llm.invoke(history)
    assert isinstance(second.content, str)
    streamed = "".join(chunk.content for chunk in llm.stream(history))
    assert streamed == second.content  # temperature 0: the same answer, streamed


def test_llama_index_live(server):
    """LlamaIndex's OpenAI LLM against kvboost-server: chat, stream_chat, and its multi-turn idiom (the response's
    message appended to the history) with a system message. LlamaIndex's ``OpenAI`` class looks its model name up
    (context size, chat or not) and fails on a name it does not know, so the model is served under such a name too
    (vLLM's ``--served-model-name``: a second app on the same loop)."""
    pytest.importorskip("llama_index.llms.openai")
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai import OpenAI

    alias = "gpt-4o-mini"
    app = create_app(server.loop, model_name=[alias, MODEL], server_secret=SECRET)
    with serve_app(app) as base:
        llm = OpenAI(model=alias, api_base=base + "/v1", api_key="none", temperature=0, max_tokens=4, max_retries=0)
        history = [ChatMessage(role="system", content="You are a helpful assistant."),
                   ChatMessage(role="user", content="Hello")]  # fmt: skip
        first = llm.chat(history)
        assert first.message.role == "assistant" and isinstance(first.message.content, str)
        history += [first.message, ChatMessage(role="user", content="Tell me more.")]
        second = llm.chat(history)
        streamed = [r.delta or "" for r in llm.stream_chat(history)]
        assert "".join(streamed) == second.message.content  # temperature 0: the same answer, streamed
        assert llm.complete("Say this is a test").text is not None
