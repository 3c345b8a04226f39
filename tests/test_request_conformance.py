"""kvboost-server against requests as OpenAI's and vLLM's clients send them (issue 62, the request side), on a tiny
random fp32 model:

- the official ``openai`` client's multi-turn idiom (``messages.append(resp.choices[0].message)``, then a second
  request) is answered, also under ``--strict-requests``;
- every message shape of OpenAI's chat request schema is answered: an assistant's ``content: null`` with
  ``tool_calls`` or ``function_call``, ``refusal`` (null, a string, refusal parts), ``annotations``, ``audio: null``,
  ``name``; ``tool`` / ``function`` / ``developer`` messages; text parts with extra keys. The tool calls reach the
  chat template as Hugging Face templates take them (arguments parsed), and a template that would drop them is a 400;
- what kvboost cannot serve is a 400 naming the field: image / audio / file parts, a previous ``audio`` answer,
  ``tools``, a ``tool_choice`` that requires a call;
- unknown fields are ignored with the ``X-Kvboost-Ignored-Fields`` header and a log line (a 400 under strict mode);
- each sampling field of vLLM's that kvboost does not implement is a 400 naming it, its neutral value is accepted
  (the implemented ones, penalties, ``min_p``, ``logit_bias``...: ``tests/test_sampling_fields.py``);
- served model aliases (vLLM's ``--served-model-name A B``) and the default name (the full model id).

The published spec's request examples are few (``tests/test_request_examples.py`` replays every one, with the
request bodies LangChain and LlamaIndex send), so the bodies below are written by hand with the field names of
OpenAI's request schema (``ChatCompletionRequestAssistantMessage`` and its siblings, as the official client's types
``openai.types.chat.*MessageParam`` spell them, generated from that spec); each message is checked against those
types first, and ``test_request_examples`` checks them against the spec's request schema too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
from collections.abc import Iterator
from typing import Any

import pydantic
import pytest
from kvboost_testkit.tiny import ToyTokenizer, tiny_model
from openai.types.chat import ChatCompletionMessageParam
from test_server import SECRET, Served, assert_envelope, serve_app

from kvboost.engine.loop import EngineLoop
from kvboost.serving import protocol as P
from kvboost.serving.cli import BUNDLED_NAME, build_parser, served_names
from kvboost.serving.server import create_app

MODEL = "kvboost-test/tiny-llama"  # an org/name id, reported in responses
ALIAS = "tiny"
HEADER = P.IGNORED_FIELDS_HEADER
USER = {"role": "user", "content": "What is the weather in Paris?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


class ToolTokenizer(ToyTokenizer):
    """The toy tokenizer with a chat template that renders an assistant's ``tool_calls`` as Hugging Face templates
    do (``function.name`` and ``function.arguments | tojson``); ``renders_tools = False``: one that drops them."""

    renders_tools = True

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True):
        text = ""
        for m in messages:
            calls = m.get("tool_calls") or () if self.renders_tools else ()
            text += f"<{m['role']}>{m['content']}" + "".join(
                f"<call {c['function']['name']} {json.dumps(c['function']['arguments'], sort_keys=True)}>"
                for c in calls
            ) + "</>"
        text += "<assistant>" if add_generation_prompt else ""
        return self(text)["input_ids"] if tokenize else text


@contextlib.contextmanager
def _servers() -> Iterator[tuple[Served, Served]]:
    """One engine loop behind two apps: the default one (two served names) and one with ``strict_requests``."""
    from kvboost import KVBoost

    engine = KVBoost(tiny_model("llama"), ToolTokenizer(), model_identity="tiny-llama", decode="eager",
                     chunker={"name": "fixed", "chunk_size": 16})  # fmt: skip
    loop = EngineLoop(engine).start()
    lenient = create_app(loop, model_name=[MODEL, ALIAS], server_secret=SECRET)
    strict = create_app(loop, model_name=MODEL, server_secret=SECRET, strict_requests=True)
    try:
        with serve_app(lenient) as base, serve_app(strict) as strict_base:
            yield Served(base, loop, engine, lenient), Served(strict_base, loop, engine, strict)
    finally:
        loop.shutdown()
        engine.close()


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Served, Served]]:
    with _servers() as both:
        yield both


@pytest.fixture
def server(servers) -> Served:
    return servers[0]


@pytest.fixture
def strict(servers) -> Served:
    return servers[1]


def chat(server: Served, messages: list[dict[str, Any]], **fields: Any) -> Any:
    body = {"model": MODEL, "messages": messages, "max_tokens": 3, "temperature": 0, **fields}
    with server.http(key=None) as c:
        return c.post("/v1/chat/completions", json=body)


def answered(response: Any) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL, body
    assert body["choices"][0]["message"]["role"] == "assistant"
    return body


def rendered(server: Served, messages: list[dict[str, Any]]) -> str:
    """The prompt text the server renders for ``messages`` (``/tokenize``, decoded by the toy tokenizer)."""
    with server.http(key=None) as c:
        r = c.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    return ToyTokenizer().decode(r.json()["tokens"])


# ---------------------------------------------------------------------- the official client's multi-turn idiom
@pytest.mark.parametrize("which", ["lenient", "strict"])
def test_official_client_multi_turn_idiom(servers, which):
    """``messages.append(resp.choices[0].message)``: the client sends the reply back as it parsed it (with
    ``"refusal": null``); the second request is answered, with no ignored field, also under strict mode."""
    s = servers[0] if which == "lenient" else servers[1]
    client = s.client(key=None)
    messages: list[Any] = [{"role": "user", "content": "Tell me a joke."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    messages.append(first.choices[0].message)
    messages.append({"role": "user", "content": "Another one."})
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages, max_tokens=4,
                                                           temperature=0)  # fmt: skip
    second = raw.parse()
    assert second.choices[0].message.role == "assistant" and second.model == MODEL
    assert HEADER.lower() not in {k.lower() for k in raw.headers}
    # the reply's every field, as model_dump() writes it (None values included), is accepted as a message too
    dumped = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(dumped)
    r = chat(s, [USER, dumped, {"role": "user", "content": "Thanks."}])
    answered(r)
    assert HEADER not in r.headers


# ---------------------------------------------------------------------- every message shape
#: (id, messages): bodies written from OpenAI's request schema (the field names of ChatCompletionRequest*Message)
SHAPES = [
    ("assistant_tool_calls_null_content", [USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                           {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]),
    ("assistant_tool_calls_no_content", [USER, {"role": "assistant", "tool_calls": [CALL], "refusal": None},
                                         {"role": "tool", "tool_call_id": "call_1",
                                          "content": [{"type": "text", "text": "18 C, sunny"}]}]),
    ("assistant_legacy_function_call", [USER, {"role": "assistant", "content": None,
                                               "function_call": {"name": "get_weather", "arguments": "{}"}},
                                        {"role": "function", "name": "get_weather", "content": "18 C"}]),
    ("assistant_refusal_string", [USER, {"role": "assistant", "content": None, "refusal": "I can't help."}, USER]),
    ("assistant_refusal_part", [USER, {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
                                USER]),
    ("assistant_every_field", [USER, {"role": "assistant", "content": "Sunny.", "refusal": None, "name": "bot",
                                      "annotations": [], "audio": None, "function_call": None},
                               USER]),
    ("developer_and_system", [{"role": "developer", "content": "Be brief."},
                              {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]}, USER]),
    ("user_name_and_parts", [{"role": "user", "name": "alice", "content": [
        {"type": "text", "text": "Part one. "},
        {"type": "text", "text": "Part two.", "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "30m"}}]}]),
]  # fmt: skip


@pytest.mark.parametrize("messages", [m for _, m in SHAPES], ids=[i for i, _ in SHAPES])
def test_every_message_shape_is_answered(server, messages):
    for m in messages:  # each one a message of OpenAI's published request types
        pydantic.TypeAdapter(ChatCompletionMessageParam).validate_python(m)
    r = chat(server, messages)
    answered(r)
    assert HEADER not in r.headers, r.headers[HEADER]  # every field above is OpenAI's: none is unknown


def test_text_parts_with_extra_keys(server):
    """A text part's extra keys (Anthropic-style ``cache_control``, sent by LiteLLM and others) are accepted and
    reported as ignored; the text is what the template gets."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello ", "cache_control": {"type": "x"}},
                                             {"type": "text", "text": "there"}]}]  # fmt: skip
    r = chat(server, messages)
    answered(r)
    assert r.headers[HEADER] == "messages[0].content[0].cache_control"
    assert rendered(server, messages) == "<user>Hello there</><assistant>"


def test_tool_calls_reach_the_template(server):
    """An assistant's tool calls go to the chat template as Hugging Face templates take them: ``arguments`` parsed
    from OpenAI's JSON string into a dict (as vLLM does); a null content renders as empty, not "None"; a legacy
    ``function_call`` is one tool call and a ``function`` message a ``tool`` one."""
    text = rendered(server, SHAPES[0][1])
    assert "<assistant><call get_weather " in text and "city" in text and "Paris" in text, text
    assert "None" not in text and '"{' not in text  # content null -> "", arguments not a JSON string in JSON
    assert "<tool>18 C, sunny</>" in text
    legacy = rendered(server, SHAPES[2][1])
    assert "<assistant><call get_weather " in legacy and "<tool>18 C</>" in legacy, legacy
    refusal = rendered(server, SHAPES[3][1])
    assert "<assistant>I can't help.</>" in refusal


def test_template_that_drops_tool_calls_is_refused(server):
    """A chat template that does not render tool calls would answer another conversation: a 400 naming them."""
    server.engine.tokenizer.renders_tools = False
    try:
        r = chat(server, SHAPES[0][1])
    finally:
        server.engine.tokenizer.renders_tools = True
    error = assert_envelope(r, 400, code="unsupported_value", param="messages[1].tool_calls")
    assert "does not render tool_calls" in error["message"]


REFUSED_MESSAGES = [
    # (id, messages, param)
    ("image_part", [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                 {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}}]}],
     "messages[0].content[1].type"),
    ("audio_part", [{"role": "user", "content": [{"type": "input_audio",
                                                  "input_audio": {"data": "AAAA", "format": "wav"}}]}],
     "messages[0].content[0].type"),
    ("file_part", [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}],
     "messages[0].content[0].type"),
    ("previous_audio_answer", [USER, {"role": "assistant", "content": None, "audio": {"id": "audio_1"}}, USER],
     "messages[1].audio"),
    ("custom_tool_call", [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "custom", "custom": {"name": "grep", "input": "x"}}]}], "messages[1].tool_calls[0].type"),
    ("user_without_content", [{"role": "user"}], "messages[0].content"),
]  # fmt: skip


@pytest.mark.parametrize("messages,param", [(m, p) for _, m, p in REFUSED_MESSAGES],
                         ids=[i for i, _, _ in REFUSED_MESSAGES])  # fmt: skip
def test_what_kvboost_cannot_serve_is_refused(server, messages, param):
    error = assert_envelope(chat(server, messages), 400, type_="invalid_request_error", param=param)
    if param != "messages[0].content":
        assert "not supported by kvboost" in error["message"], error


@pytest.mark.parametrize("fields,param", [
    ({"tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
])  # fmt: skip
def test_tools_are_refused(server, fields, param):
    assert_envelope(chat(server, [USER], **fields), 400, code="unsupported_value", param=param)


@pytest.mark.parametrize("fields", [{"tool_choice": "none"}, {"tool_choice": "auto"}, {"tools": []},
                                    {"parallel_tool_calls": False}])  # fmt: skip
def test_tool_fields_that_call_nothing_are_accepted(server, fields):
    answered(chat(server, [USER], **fields))


# ---------------------------------------------------------------------- unknown fields
def test_unknown_fields_are_ignored_with_a_header(server, caplog):
    caplog.set_level(logging.WARNING, logger="kvboost.serving.server")
    messages = [{"role": "user", "content": "x", "bar": 2}]
    r = chat(server, messages, foo=1, vllm_xargs={"a": 1})
    answered(r)
    assert r.headers[HEADER] == "foo, vllm_xargs, messages[0].bar"
    assert any("were present in the request but ignored: foo, vllm_xargs, messages[0].bar" in rec.getMessage()
               for rec in caplog.records), caplog.text  # fmt: skip
    with server.http(key=None) as c:  # completions, whole and streamed
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "foo": 1})
        assert r.status_code == 200 and r.headers[HEADER] == "foo", r.text
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "stream": True, "baz": None,
                                            "stream_options": {"include_usage": True, "qux": 1}})  # fmt: skip
        assert r.status_code == 200 and r.headers[HEADER] == "baz, stream_options.qux", r.text
        assert r.text.rstrip().endswith("data: [DONE]")
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 200 and HEADER not in r.headers


def test_ignored_field_names_are_header_safe(server):
    """Any name a client sends makes a valid header: JSON-escaped (ASCII, no line breaks), at most 16 named."""
    odd = {"caf\u00e9": 1, "a\r\nX-Injected: 1": 2, **{f"f{i:02d}": i for i in range(20)}}
    r = chat(server, [USER], **odd)
    answered(r)
    value = r.headers[HEADER]
    assert "X-Injected" not in r.headers and value.isascii() and "\n" not in value
    assert value.startswith("caf\\u00e9, a\\r\\nX-Injected: 1, f00") and value.endswith("... (6 more)"), value


def test_ignored_field_names_that_are_empty_padded_or_hold_commas_are_quoted(server):
    """An empty name made the header end in ", " (a value h11 refuses: the server dropped the connection; found by
    tests/test_server_schema.py's fuzzing): such names are sent as JSON strings."""
    r = chat(server, [USER], **{"": 1, " pad ": 2, "a, b": 3, "plain": 4})
    answered(r)
    assert r.headers[HEADER] == '"", " pad ", "a, b", plain', r.headers[HEADER]
    with server.http(key=None) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "": None})
        assert r.status_code == 200 and r.headers[HEADER] == '""', r.text


def test_strict_requests_refuse_unknown_fields(strict):
    r = chat(strict, [USER], foo=1)
    error = assert_envelope(r, 400, code="unknown_field", param="foo")
    assert "--strict-requests" in error["message"]
    assert_envelope(chat(strict, [{"role": "user", "content": "x", "bar": 1}]), 400, code="unknown_field",
                    param="messages[0].bar")  # fmt: skip
    answered(chat(strict, [USER], user="u", prompt_cache_key="k", store=True))  # known fields: accepted


# ---------------------------------------------------------------------- sampling fields kvboost does not implement
#: (field, a value that changes the answer, its neutral value); every DEFAULT_ONLY field kvboost sends to both
#: endpoints, plus the chat-only ones
NOT_IMPLEMENTED = [
    ("spaces_between_special_tokens", False, True),
    ("include_stop_str_in_output", True, False), ("bad_words", ["x"], []), ("allowed_token_ids", [5, 6], None),
    ("logits_processors", ["m.P"], None), ("truncate_prompt_tokens", 8, None), ("prompt_logprobs", 1, None),
    ("use_beam_search", True, False), ("length_penalty", 0.5, 1), ("return_tokens_as_token_ids", True, False),
    ("guided_json", {"type": "object"}, None), ("guided_regex", "a+", None), ("guided_choice", ["a", "b"], None),
    ("guided_grammar", "root ::= 'a'", None), ("structured_outputs", {"regex": "a+"}, None), ("echo", True, False),
    ("best_of", 2, 1), ("suffix", "x", ""),  # suffix: completions only
    # chat only
    ("add_generation_prompt", False, True), ("continue_final_message", True, False),
    ("add_special_tokens", True, False), ("chat_template", "{{ messages }}", None),
    ("chat_template_kwargs", {"enable_thinking": False}, {}), ("documents", [{"text": "d"}], []),
    ("mm_processor_kwargs", {"x": 1}, None), ("reasoning_effort", "low", None), ("verbosity", "low", None),
    ("audio", {"voice": "alloy", "format": "wav"}, None), ("web_search_options", {"search_context_size": "low"}, {}),
    ("moderation", {"model": "m"}, None), ("response_format", {"type": "json_object"}, {"type": "text"}),
    ("modalities", ["text", "audio"], ["text"]),
]  # fmt: skip


CHAT_FIELDS = [f for f in NOT_IMPLEMENTED if f[0] in P.ChatCompletionRequest.model_fields]
#: echo is implemented by /v1/completions (tests/test_lm_eval_requests.py), not by chat
COMPLETION_FIELDS = [f for f in NOT_IMPLEMENTED if f[0] in P.CompletionRequest.model_fields and f[0] != "echo"]


@pytest.mark.parametrize("field,bad,neutral", CHAT_FIELDS, ids=[f for f, _, _ in CHAT_FIELDS])
def test_unimplemented_fields_refused_unless_neutral(server, field, bad, neutral):
    error = assert_envelope(chat(server, [USER], **{field: bad}), 400, code="unsupported_value", param=field)
    assert "kvboost" in error["message"], error
    if field in P.DEFAULT_ONLY:
        assert "not implemented" in error["message"], error
    r = chat(server, [USER], **{field: neutral})
    answered(r)
    assert HEADER not in r.headers


@pytest.mark.parametrize("field,bad,neutral", COMPLETION_FIELDS, ids=[f for f, _, _ in COMPLETION_FIELDS])
def test_unimplemented_fields_refused_on_completions(server, field, bad, neutral):
    with server.http(key=None) as c:
        assert_envelope(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, field: bad}), 400,
                        code="unsupported_value", param=field)  # fmt: skip
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, field: neutral})
    assert r.status_code == 200 and HEADER not in r.headers, r.text


def test_implemented_and_no_effect_fields_are_accepted(server):
    """``top_k`` is implemented (vLLM's "off" values too); the fields of NO_EFFECT are accepted without a header."""
    for top_k in (-1, 0, 5):
        answered(chat(server, [USER], top_k=top_k, temperature=0.7, seed=1))
    no_effect = {"user": "u", "safety_identifier": "s", "metadata": {"k": "v"}, "store": True, "service_tier": "auto",
                 "parallel_tool_calls": True, "prompt_cache_key": "k", "prompt_cache_retention": "24h",
                 "prompt_cache_options": {"mode": "implicit"}, "prediction": {"type": "content", "content": "x"},
                 "priority": 3, "request_id": "r1"}  # fmt: skip
    assert set(no_effect) == set(P.NO_EFFECT)
    r = chat(server, [USER], **no_effect)
    answered(r)
    assert HEADER not in r.headers


def test_the_field_lists_match_the_request_models():
    """Each listed field is declared where a client sends it, so none of them falls through as "unknown"."""
    declared = set(P.ChatCompletionRequest.model_fields) | set(P.CompletionRequest.model_fields) \
        | set(P.StreamOptions.model_fields)
    assert set(P.DEFAULT_ONLY) <= declared, set(P.DEFAULT_ONLY) - declared
    assert set(P.NO_EFFECT) <= set(P.ChatCompletionRequest.model_fields)
    assert set(P.NO_EFFECT) - {"parallel_tool_calls"} <= set(P.CompletionRequest.model_fields)
    tested = {f for f, _, _ in NOT_IMPLEMENTED}
    assert set(P.DEFAULT_ONLY) - tested == {"tools", "functions", "tool_choice", "function_call",
                                            "continuous_usage_stats"}  # tested above / in test_server.py


# ---------------------------------------------------------------------- model names
def test_served_model_aliases(server):
    with server.http(key=None) as c:
        listed = c.get("/v1/models").json()
        assert [m["id"] for m in listed["data"]] == [MODEL, ALIAS]
        for name in (MODEL, ALIAS):
            assert c.get(f"/v1/models/{name}").json()["id"] == name
            r = c.post("/v1/chat/completions", json={"model": name, "messages": [USER], "max_tokens": 2})
            assert r.json()["model"] == MODEL, r.text  # responses report the first name
        assert_envelope(c.get("/v1/models/tiny-llama"), 404, code="model_not_found", param="model")
        r = c.post("/v1/chat/completions", json={"model": "tiny-llama", "messages": [USER], "max_tokens": 2})
        error = assert_envelope(r, 404, code="model_not_found", param="model")
        assert MODEL in error["message"] and ALIAS in error["message"]


@pytest.mark.parametrize("argv,names", [
    (["--model", "Qwen/Qwen2.5-0.5B-Instruct"], ["Qwen/Qwen2.5-0.5B-Instruct"]),
    (["--model", "/models/qwen/"], ["/models/qwen"]),
    ([], [BUNDLED_NAME]),
    (["model=tiny_random"], ["tiny-random"]),
    (["--served-model-name", "qwen", "Qwen/Qwen2.5-0.5B-Instruct", "model=tiny_random", "--port", "9"],
     ["qwen", "Qwen/Qwen2.5-0.5B-Instruct"]),
    (["--served-model-name=a", "--served-model-name", "b", "a"], ["a", "b"]),
])  # fmt: skip
def test_served_names_from_the_command_line(argv, names):
    """vLLM's rules: the model's id as given (organisation kept) unless ``--served-model-name NAME [NAME ...]``;
    the names stop at the next flag or KEY=VALUE override."""
    args = build_parser().parse_args(argv)
    model: dict[str, Any] = {"name_or_path": args.model}
    if "model=tiny_random" in args.overrides:
        model = {"name_or_path": None, "random_init": {"num_hidden_layers": 2}}
    assert served_names(args, {"model": model}) == names
    assert BUNDLED_NAME == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert isinstance(args, argparse.Namespace) and args.strict_requests is False
    assert build_parser().parse_args(["--strict-requests"]).strict_requests is True
