"""Record the HTTP request bodies LangChain's and LlamaIndex's OpenAI classes send (``framework_requests.json``).

Usage (in an environment of its own: kvboost is not needed, and llama-index-llms-openai pins ``openai<3``, which would
downgrade the development environment's client)::

    python -m venv /tmp/fw && /tmp/fw/bin/pip install langchain-openai llama-index-llms-openai
    /tmp/fw/bin/python tests/data/record_framework_requests.py > tests/data/framework_requests.json

Each library's OpenAI class is pointed at a capturing server on loopback that records every request (method, path,
JSON body) and answers with a canned OpenAI reply (whole, or streamed as SSE when the body asks for it; the reply
has the fields kvboost's own replies have, ``"refusal": null`` included, so a library's multi-turn idiom sends back
what it parsed from a kvboost-like reply). The scenarios are each library's documented everyday use: a one-shot
chat, a streamed chat, a multi-turn chat with a system message (the library's reply appended to the history, as its
docs do), a tool call's history sent back without tools, tools bound, and the legacy completions class.
``tests/test_request_examples.py`` sends the recorded bodies to kvboost-server.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MODEL = "gpt-4o-mini"  # a name both libraries know (LlamaIndex looks up its context size); the tests replace it
REPLY = "Hi there."
CALL_ID = "call_1"

recorded: list[dict[str, Any]] = []
scenario: dict[str, str] = {}


def _chat_reply() -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": REPLY, "refusal": None},
                         "logprobs": None, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                      "prompt_tokens_details": {"cached_tokens": 0}}}  # fmt: skip


def _chunks(chat: bool, usage: bool) -> list[dict[str, Any]]:
    def chunk(delta_text: str | None, finish: str | None, role: bool = False) -> dict[str, Any]:
        if chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if delta_text is not None:
                delta["content"] = delta_text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
        body = {"id": "chatcmpl-1" if chat else "cmpl-1", "object": "chat.completion.chunk" if chat else
                "text_completion", "created": 0, "model": MODEL, "choices": [choice]}  # fmt: skip
        if usage:
            body["usage"] = None
        return body

    out = [chunk("", None, role=True)] if chat else []
    out += [chunk("Hi", None), chunk(" there.", None), chunk(None if chat else "", "stop")]
    if usage:
        out.append({**out[-1], "choices": [], "usage": _chat_reply()["usage"]})
    return out


class _Capture(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        recorded.append({**scenario, "method": "POST", "path": self.path, "body": body})
        chat = self.path.endswith("/chat/completions")
        if body.get("stream"):
            usage = bool((body.get("stream_options") or {}).get("include_usage"))
            events = "".join(f"data: {json.dumps(c)}\n\n" for c in _chunks(chat, usage)) + "data: [DONE]\n\n"
            self._send(events.encode(), "text/event-stream")
        elif chat:
            self._send(json.dumps(_chat_reply()).encode(), "application/json")
        else:
            reply = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
                     "choices": [{"index": 0, "text": REPLY, "logprobs": None, "finish_reason": "stop"}],
                     "usage": _chat_reply()["usage"]}  # fmt: skip
            self._send(json.dumps(reply).encode(), "application/json")


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return "18 C, sunny"


def run(library: str, name: str, fn: Any) -> None:
    scenario.clear()
    scenario.update(library=library, scenario=name)
    fn()


def langchain(base: str) -> None:
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI, OpenAI

    llm = ChatOpenAI(model=MODEL, base_url=base, api_key="none", temperature=0, max_tokens=8, max_retries=0)
    run("langchain-openai", "invoke", lambda: llm.invoke("Hello"))
    run("langchain-openai", "stream", lambda: list(llm.stream("Hello")))

    def multi_turn() -> None:
        history: list[Any] = [SystemMessage("You are a helpful assistant."), HumanMessage("Hello")]
        history.append(llm.invoke(history))
        history.append(HumanMessage("Tell me more."))
        llm.invoke(history)

    run("langchain-openai", "multi_turn_system", multi_turn)
    tool_history = [HumanMessage("What is the weather in Paris?"),
                    AIMessage("", tool_calls=[{"name": "get_weather", "args": {"city": "Paris"}, "id": CALL_ID}]),
                    ToolMessage("18 C, sunny", tool_call_id=CALL_ID)]  # fmt: skip
    run("langchain-openai", "tool_call_history", lambda: llm.invoke(tool_history))
    run("langchain-openai", "bind_tools", lambda: llm.bind_tools([get_weather]).invoke("Weather in Paris?"))
    legacy = OpenAI(model="gpt-3.5-turbo-instruct", base_url=base, api_key="none", temperature=0, max_tokens=8,
                    max_retries=0)  # fmt: skip
    run("langchain-openai", "completions_invoke", lambda: legacy.invoke("Say this is a test"))
    run("langchain-openai", "completions_stream", lambda: list(legacy.stream("Say this is a test")))


def llama_index(base: str) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.openai import OpenAI

    llm = OpenAI(model=MODEL, api_base=base, api_key="none", temperature=0, max_tokens=8, max_retries=0)
    run("llama-index-llms-openai", "chat", lambda: llm.chat([ChatMessage(role="user", content="Hello")]))
    run("llama-index-llms-openai", "stream_chat",
        lambda: list(llm.stream_chat([ChatMessage(role="user", content="Hello")])))
    run("llama-index-llms-openai", "complete", lambda: llm.complete("Say this is a test"))

    def multi_turn() -> None:
        history = [ChatMessage(role="system", content="You are a helpful assistant."),
                   ChatMessage(role="user", content="Hello")]  # fmt: skip
        history.append(llm.chat(history).message)
        history.append(ChatMessage(role="user", content="Tell me more."))
        llm.chat(history)

    run("llama-index-llms-openai", "multi_turn_system", multi_turn)
    call = {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    tool_history = [ChatMessage(role="user", content="What is the weather in Paris?"),
                    ChatMessage(role="assistant", content=None, additional_kwargs={"tool_calls": [call]}),
                    ChatMessage(role="tool", content="18 C, sunny", additional_kwargs={"tool_call_id": CALL_ID})]
    run("llama-index-llms-openai", "tool_call_history", lambda: llm.chat(tool_history))
    tool = FunctionTool.from_defaults(fn=get_weather)
    run("llama-index-llms-openai", "chat_with_tools",
        lambda: llm.chat_with_tools([tool], user_msg="Weather in Paris?"))


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}/v1"
    try:
        langchain(base)
        llama_index(base)
    finally:
        server.shutdown()
    packages = ("langchain-openai", "langchain-core", "llama-index-llms-openai", "llama-index-core", "openai")
    versions = {p: importlib.metadata.version(p) for p in packages}
    out = {"$comment": "Request bodies LangChain's and LlamaIndex's OpenAI classes sent to a capturing server, "
           "recorded by record_framework_requests.py (see its docstring for the scenarios).",
           "versions": versions, "python": sys.version.split()[0], "model": MODEL, "requests": recorded}  # fmt: skip
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
