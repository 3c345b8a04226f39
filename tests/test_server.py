"""kvboost-server over a real engine loop on a tiny random model, through the official ``openai`` client and raw HTTP:
streamed and whole answers agree, usage and cached tokens, every error in OpenAI's envelope, tenants that never share
cache entries, overload (429 + Retry-After), a client that leaves frees its blocks, and the greedy tokens served over
HTTP equal ``engine.generate`` of the same prompt alone (fp32)."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from kvboost_testkit.tiny import ToyTokenizer, make_engine

from kvboost.engine.loop import EngineLoop
from kvboost.serving.server import create_app
from kvboost.serving.tenancy import Tenancy

MODEL = "tiny"
KEY_A, KEY_B = "key-tenant-a", "key-tenant-b"
SECRET = "test-secret"


# ---------------------------------------------------------------------- harness
@contextlib.contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """Run ``app`` under a real uvicorn server on a free loopback port (in a thread); yields its base URL."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=5)  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive(), "uvicorn failed to start"
        assert time.monotonic() < deadline, "uvicorn did not start in 30 s"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


@dataclass
class Served:
    base: str
    loop: EngineLoop
    engine: Any
    app: Any

    def client(self, key: str | None = KEY_A, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key or "none", max_retries=0, timeout=60, **options)

    def http(self, key: str | None = KEY_A, **options: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.base, headers=headers, timeout=options.pop("timeout", 60), **options)

    def wait_idle(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            s = self.loop.stats()
            if s["num_running"] == 0 and s["num_waiting"] == 0:
                return
            assert time.monotonic() < deadline, f"the loop did not go idle: {s}"
            time.sleep(0.02)

    def metrics(self) -> str:
        with self.http() as c:
            r = c.get("/metrics")
        assert r.status_code == 200
        return r.text


@contextlib.contextmanager
def served(*, keys: list[str] | None = None, eos: bool = True, max_model_len: int | None = None,
           **loop_options: Any) -> Iterator[Served]:  # fmt: skip
    engine = make_engine("llama", decode="eager")
    if not eos:
        engine.eos_ids = set()  # every request runs to max_tokens: long enough to overload, disconnect, time out
    with served_engine(engine, keys=keys, max_model_len=max_model_len, **loop_options) as s:
        yield s


@contextlib.contextmanager
def served_engine(engine: Any, *, keys: list[str] | None = None, max_model_len: int | None = None,
                  **loop_options: Any) -> Iterator[Served]:  # fmt: skip
    """``engine`` behind an ``EngineLoop`` and the app on a real server; the loop stops and the engine closes after."""
    loop = EngineLoop(engine, **loop_options).start()
    app = create_app(loop, model_name=MODEL, api_keys=keys, server_secret=SECRET, max_model_len=max_model_len)
    try:
        with serve_app(app) as base:
            yield Served(base, loop, engine, app)
    finally:
        loop.shutdown()
        engine.close()


def data_events(response: httpx.Response) -> Iterator[str]:
    """The payloads of a streamed response's ``data:`` events, as the client reads them.

    Keep the returned iterator referenced for as long as the stream should stay open, and read it with ``next``:
    breaking out of ``for line in response.iter_lines()`` drops that generator, and closing it runs httpcore's
    ``PoolByteStream.__iter__`` ``except BaseException: self.close()`` on the ``GeneratorExit``, which closes the
    half-read connection (``HTTP11Connection._response_closed``). The server then rightly sees a disconnect and
    cancels the request, while the test still holds the ``with`` block."""
    return (line[5:].strip() for line in response.iter_lines() if line.startswith("data:"))


@contextlib.contextmanager
def slowed(loop: EngineLoop, step_s: float = 0.02) -> Iterator[None]:
    """Make ``loop`` sleep ``step_s`` between steps (a call that posts itself again) while the block runs, so no long
    request can run to its end while a test looks at it."""
    on = True

    def pause(engine: Any) -> None:
        time.sleep(step_s)
        if on:
            loop.call(pause)

    loop.call(pause)
    try:
        yield
    finally:
        on = False


@pytest.fixture(scope="module")
def keyed() -> Iterator[Served]:
    """Two tenants (two API keys); most tests use tenant A with prompts of their own."""
    with served(keys=[KEY_A, KEY_B]) as s:
        yield s


@pytest.fixture(scope="module")
def busy() -> Iterator[Served]:
    """No keys, no end-of-sequence token, one running request and one waiting at most."""
    with served(eos=False, max_running=1, max_waiting=1) as s:
        yield s


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a Prometheus text exposition (None if absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return None


def assert_envelope(response: httpx.Response, status: int, *, type_: str | None = None, code: str | None = None,
                    param: str | None = None) -> dict[str, Any]:  # fmt: skip
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body  # never FastAPI's {"detail": ...}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if type_ is not None:
        assert error["type"] == type_, error
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    return error


# ---------------------------------------------------------------------- answers
def test_completion_streamed_equals_whole_and_cached_tokens(keyed):
    """/v1/completions: the streamed deltas add up to the whole answer; usage is complete; the first request of a
    prompt has cached_tokens 0 (present, not omitted) and its repeat > 0."""
    client = keyed.client()
    prompt = "Completions test: the quick brown fox jumps over the lazy dog, twice over."
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert first.object == "text_completion" and first.model == MODEL
    assert first.choices[0].finish_reason in ("stop", "length")
    u = first.usage
    assert u.prompt_tokens == len(prompt) and u.completion_tokens >= 1
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is not None and u.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == first.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == first.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == u.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the repeat reused the first's prefix
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_streamed_equals_whole(keyed):
    client = keyed.client()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Chat test: hello!"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens_details.cached_tokens == 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk
    # the prompt as /tokenize sees it is the prompt the engine got
    with keyed.http() as c:
        tok = c.post("/tokenize", json={"messages": messages}).json()
    assert tok["count"] == whole.usage.prompt_tokens
    assert tok["tokens"] == ToyTokenizer().apply_chat_template(messages)


def test_stop_strings_end_the_answer_streamed_or_not(keyed):
    client = keyed.client()
    prompt = "Stop-string test prompt: abcdefghij"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0).choices[0].text
    stop = next((full[i : i + 2] for i in range(3, len(full) - 2) if full[i : i + 2].strip()), None)
    assert stop, full
    expected = full[: full.find(stop)]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].text == expected and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True))  # fmt: skip
    assert streamed == expected


def test_seeded_sampling_repeats(keyed):
    client = keyed.client()
    args = {"model": MODEL, "prompt": "Sampling test: once upon a time", "max_tokens": 16, "temperature": 1.0,
            "top_p": 0.9, "seed": 1234, "extra_body": {"top_k": 20}}  # fmt: skip
    a = client.completions.create(**args).choices[0].text
    b = "".join(c.choices[0].text for c in client.completions.create(**args, stream=True))
    assert a == b


def test_sampling_edges_are_served_not_fatal(keyed):
    """Values at the sampler's edges (found by the schema fuzzer: top_k above the vocabulary, or top_p = 5e-324, made
    the sampler raise on the loop thread, which then stopped for every client): top_k >= vocabulary is no filter, a
    temperature too small to divide by is greedy, a vanishing top_p keeps the likeliest token."""
    client = keyed.client()
    prompt = "Edge test: sampling settings at their limits"
    greedy = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    tiny_t = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1e-300)
    assert tiny_t.choices[0].text == greedy
    big_k = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.7, seed=3,
                                      extra_body={"top_k": 100_000})  # fmt: skip
    assert big_k.usage.completion_tokens >= 1
    tiny_p = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.3, top_p=5e-324)
    assert tiny_p.choices[0].text == greedy  # the nucleus of a vanishing top_p is the likeliest token
    with keyed.http() as c:
        assert c.get("/health").status_code == 200


def test_greedy_over_http_equals_engine_generate_alone(keyed):
    """fp32: three prompts sent together (batched by the loop, some prefixes cached) give the token ids that a
    separate engine on the same weights gives each prompt alone, cold."""
    reference = make_engine("llama", decode="eager")
    prompts = [f"Reference test {i}: " + "lorem ipsum dolor sit amet " * (i + 1) for i in range(3)]
    alone = [reference.generate(p, max_new_tokens=20, mode="cold") for p in prompts]
    reference.close()
    client = keyed.client()

    def ask(prompt: str) -> Any:
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                         extra_body={"return_token_ids": True})  # fmt: skip

    ask(prompts[0])  # the first prompt's prefix is then cached: its second serving reuses it
    with ThreadPoolExecutor(3) as pool:
        served_ = list(pool.map(ask, prompts))
    for response, expected in zip(served_, alone, strict=True):
        choice = response.choices[0]
        assert choice.token_ids == expected.output_ids
        assert choice.text == ToyTokenizer().decode(expected.output_ids)
    assert served_[0].usage.prompt_tokens_details.cached_tokens > 0


def test_models_tokenize_warm_health(keyed):
    client = keyed.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    with keyed.http() as c:
        assert c.post("/tokenize", json={"prompt": "abc"}).json() == {"tokens": [100, 101, 102], "count": 3,
                                                                       "max_model_len": 512}  # fmt: skip
        shared = "Warm test: a shared system prompt that many requests start with. " * 2
        warm = c.post("/v1/cache/warm", json={"text": shared, "pin": True})
        assert warm.status_code == 200, warm.text
        assert warm.json()["tokens_stored"] == len(shared) and warm.json()["already_cached_tokens"] == 0
        again = c.post("/v1/cache/warm", json={"text": shared})
        assert again.json()["already_cached_tokens"] > 0
        assert c.get("/health").json() == {"status": "ok"}
    r = client.completions.create(model=MODEL, prompt=shared + "Question?", max_tokens=4)
    assert r.usage.prompt_tokens_details.cached_tokens >= len(shared) // 16 * 16  # whole warmed chunks reused
    # another tenant does not see tenant A's warmed text
    other = keyed.client(KEY_B).completions.create(model=MODEL, prompt=shared + "Question?", max_tokens=4)
    assert other.usage.prompt_tokens_details.cached_tokens == 0


# ---------------------------------------------------------------------- tenants
def test_two_tenants_never_share_cache_entries(keyed):
    """The same prompt from two keys: tenant A's repeat hits, tenant B's first request has cached_tokens 0, and
    /metrics shows no hit for tenant B at all (0 cross-tenant hits). A request's own cache_salt only narrows."""
    ids = dict(zip((KEY_A, KEY_B), Tenancy([KEY_A, KEY_B], SECRET).tenant_ids, strict=True))
    prompt = "Tenant test: a prompt that both tenants send, long enough for several chunks of sixteen."
    a, b = keyed.client(KEY_A), keyed.client(KEY_B)
    assert a.completions.create(model=MODEL, prompt=prompt, max_tokens=4).usage.prompt_tokens_details.cached_tokens == 0
    assert a.completions.create(model=MODEL, prompt=prompt, max_tokens=4).usage.prompt_tokens_details.cached_tokens > 0
    assert b.completions.create(model=MODEL, prompt=prompt, max_tokens=4).usage.prompt_tokens_details.cached_tokens == 0
    salted = a.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body={"cache_salt": "project-x"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    text = keyed.metrics()
    hits_a = sample(text, "kvboost:tenant_prefix_cache_hits_total", tenant=ids[KEY_A])
    hits_b = sample(text, "kvboost:tenant_prefix_cache_hits_total", tenant=ids[KEY_B])
    assert hits_a is not None and hits_a > 0
    assert hits_b == 0.0
    assert sample(text, "kvboost:tenant_prefix_cache_queries_total", tenant=ids[KEY_B]) > 0
    assert KEY_A not in text and KEY_B not in text  # keys (and salts) never appear


def test_tenant_salts_come_from_a_stored_secret(tmp_path, monkeypatch):
    """Without --salt-secret the secret lives in the kvboost cache folder (0600, made once), so a restarted server
    derives the same salts; a secret file others can read is refused; a request's cache_salt only extends a salt."""
    import os

    from kvboost.serving.tenancy import AuthError, keys_from_env

    monkeypatch.setenv("KVBOOST_CACHE_DIR", str(tmp_path))
    Tenancy([])  # no keys: nothing to salt, no file
    assert not (tmp_path / "server_secret").exists()
    first = Tenancy(["k1", "k2"])
    secret = tmp_path / "server_secret"
    assert secret.stat().st_mode & 0o777 == 0o600
    t1, t2 = first.authenticate("Bearer k1"), first.authenticate("Bearer k2")
    assert t1.salt != t2.salt and len(t1.salt) == 64 and t1.tenant_id not in t1.salt
    assert Tenancy(["k1"]).authenticate("Bearer k1") == t1  # a restart: the same salt
    assert Tenancy(["k1"], "other secret").authenticate("Bearer k1").salt != t1.salt
    assert t1.cache_salt("x").startswith(t1.salt) and t1.cache_salt("x") != t1.salt and t1.cache_salt(None) == t1.salt
    for header in (None, "", "Bearer", "Basic k1", "Bearer k3"):
        with pytest.raises(AuthError):
            first.authenticate(header)
    os.chmod(secret, 0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        Tenancy(["k1"])
    assert keys_from_env({"KVBOOST_API_KEYS": " a, ,b "}) == ["a", "b"]


# ---------------------------------------------------------------------- errors
# fmt: off
BAD_REQUESTS = [
    # (path, raw body, status, code, param)
    ("/v1/completions", "{not json", 400, "invalid_json", None),
    ("/v1/completions", "", 400, None, None),
    # unknown fields are ignored (with a header) unless --strict-requests: tests/test_request_conformance.py
    ("/v1/completions", json.dumps({"model": MODEL}), 400, "missing_field", "prompt"),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 0}), 400, "invalid_value", "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": -3}), 400, "invalid_value", "max_tokens"),
    ("/v1/completions", json.dumps({"prompt": "x", "n": 0}), 400, "invalid_value", "n"),
    ("/v1/completions", json.dumps({"prompt": "x", "n": 129}), 400, "invalid_value", "n"),
    ("/v1/completions", json.dumps({"prompt": "x", "n": True}), 400, "invalid_value", "n"),
    ("/v1/completions", json.dumps({"prompt": "x", "logprobs": 6}), 400, "invalid_value", "logprobs"),
    ("/v1/completions", json.dumps({"prompt": "x", "logprobs": True}), 400, "invalid_value", "logprobs"),
    ("/v1/completions", json.dumps({"prompt": "x", "max_tokens": 512}), 400, "context_length_exceeded", "max_tokens"),
    (
        "/v1/completions",
        json.dumps({"prompt": "x", "frequency_penalty": 2.5}),  # OpenAI's range is [-2, 2]
        400,
        "invalid_value",
        "frequency_penalty",
    ),
    ("/v1/completions", json.dumps({"prompt": "x", "echo": 3}), 400, "invalid_value", "echo"),
    ("/v1/completions", json.dumps({"prompt": "x", "temperature": 3}), 400, "invalid_value", "temperature"),
    ("/v1/completions", json.dumps({"prompt": ["a"] * 257}), 400, "invalid_value", "prompt"),  # MAX_PROMPTS
    ("/v1/completions", json.dumps({"prompt": ["a", "   "]}), 400, "invalid_prompt", "prompt"),
    ("/v1/completions", json.dumps({"prompt": "   "}), 400, "invalid_prompt", "prompt"),
    ("/v1/completions", json.dumps({"prompt": [5, 999]}), 400, "invalid_prompt", "prompt"),
    ("/v1/completions", json.dumps({"prompt": "x" * 600}), 400, "context_length_exceeded", "prompt"),
    (
        "/v1/completions",
        json.dumps({"prompt": "x", "stream_options": {"include_usage": True}}),
        400,
        "invalid_value",
        None,
    ),
    ("/v1/completions", json.dumps({"prompt": "x", "stream": True, "stream_options": {"include_usage": "zz"}}), 400,
     "invalid_value", "stream_options.include_usage"),
    ("/v1/completions", json.dumps({"model": "gpt-4", "prompt": "x"}), 404, "model_not_found", "model"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "min_p": 1.5}), 400,
     "invalid_value", "min_p"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}], "best_of": 2}), 400,
     "unsupported_value", "best_of"),
    ("/v1/chat/completions", json.dumps({"messages": []}), 400, "invalid_value", "messages"),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "critic", "content": "x"}]}),
        400,
        "invalid_value",
        "messages[0].role",
    ),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
        400,
        "invalid_value",
        None,
    ),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}),
        400,
        "invalid_value",
        "top_logprobs",
    ),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 100000}),
        400,
        "context_length_exceeded",
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "x"}], "tools": [{}]}),
        400,
        "unsupported_value",
        "tools",
    ),
    (
        "/tokenize",
        json.dumps({"prompt": "x", "messages": [{"role": "user", "content": "x"}]}),
        400,
        "invalid_value",
        None,
    ),
    ("/v1/cache/warm", json.dumps({"text": "x" * 600}), 400, "context_length_exceeded", "text"),
]
# fmt: on


@pytest.mark.parametrize("path,body,status,code,param", BAD_REQUESTS)
def test_bad_requests_get_the_envelope(keyed, path, body, status, code, param):
    with keyed.http() as c:
        r = c.post(path, content=body, headers={"Content-Type": "application/json"})
    assert_envelope(r, status, code=code, param=param)


def test_routes_methods_and_keys(keyed):
    with keyed.http() as c:
        assert_envelope(c.get("/v1/nothing-here"), 404, type_="not_found_error")
        r = c.get("/v1/completions")
        assert_envelope(r, 405, type_="method_not_allowed")
        assert "POST" in r.headers["allow"]
    with keyed.http(key=None) as c:
        r = c.post("/v1/completions", json={"prompt": "x"})
        assert_envelope(r, 401, type_="authentication_error")
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200  # open paths
    with keyed.http(key="wrong-key") as c:
        assert_envelope(c.post("/v1/completions", json={"prompt": "x"}), 401, type_="authentication_error")
        assert_envelope(c.post("/v1/completions", content="{bad json"), 401)  # the key is checked first
    with pytest.raises(openai.AuthenticationError):
        keyed.client("wrong-key").completions.create(model=MODEL, prompt="x", max_tokens=2)


def test_unexpected_exception_is_a_500_envelope_and_the_server_goes_on(keyed, monkeypatch):
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(keyed.loop, "tokenize", boom)
    with keyed.http() as c:
        error = assert_envelope(c.post("/tokenize", json={"prompt": "x"}), 500, type_="server_error")
        assert "simulated bug" not in error["message"]  # no internals leak to clients
        monkeypatch.undo()
        assert c.post("/tokenize", json={"prompt": "x"}).status_code == 200
        assert c.post("/v1/completions", json={"prompt": "after the 500", "max_tokens": 2}).status_code == 200


def test_max_model_len_limits_prompts_and_default_budget():
    with served(max_model_len=48) as s, s.http() as c:
        assert_envelope(c.post("/v1/completions", json={"prompt": "y" * 48}), 400, code="context_length_exceeded")
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "short"}]})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["total_tokens"] <= 48


def test_stopped_loop_is_503_with_retry_after():
    with served() as s, s.http() as c:
        s.loop.shutdown()
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert_envelope(r, 503, type_="service_unavailable")
        assert int(r.headers["retry-after"]) >= 1
        assert_envelope(c.get("/health"), 503)
        assert_envelope(c.post("/v1/cache/warm", json={"text": "x"}), 503)


def test_request_timeout_is_504_whole_or_streamed():
    with served(eos=False, request_timeout_s=0.05) as s, s.http() as c:
        r = c.post("/v1/completions", json={"prompt": "timeout test", "max_tokens": 480})
        assert_envelope(r, 504, type_="timeout", code="request_timeout")
        with pytest.raises(openai.APIError, match="timeout"):
            list(s.client().completions.create(model=MODEL, prompt="timeout test", max_tokens=480, stream=True))
        s.wait_idle()
        text = s.metrics()
        assert sample(text, "vllm:request_success_total", finished_reason="timeout") == 2


# ---------------------------------------------------------------------- load and disconnects
def test_overload_answers_429_with_retry_after_then_recovers(busy):
    n = 16
    barrier = threading.Barrier(n)

    def post(i: int) -> httpx.Response:
        with busy.http(key=None) as c:
            barrier.wait()
            return c.post("/v1/completions", json={"prompt": f"overload {i}", "max_tokens": 40})

    with ThreadPoolExecutor(n) as pool:
        responses = list(pool.map(post, range(n)))
    statuses = sorted(r.status_code for r in responses)
    limited = [r for r in responses if r.status_code == 429]
    assert limited and set(statuses) <= {200, 429}, statuses
    for r in limited:
        assert_envelope(r, 429, type_="rate_limit_error", code="queue_full")
        assert int(r.headers["retry-after"]) >= 1
    assert any(r.status_code == 200 for r in responses)
    busy.wait_idle()
    ok = busy.client().completions.create(model=MODEL, prompt="after the storm", max_tokens=3)
    assert ok.usage.completion_tokens == 3
    assert sample(busy.metrics(), "kvboost:requests_rejected_total", reason="queue_full") >= len(limited)


def test_client_that_disconnects_frees_its_blocks(busy):
    """A streaming client that reads two chunks and hangs up, and a non-streaming client that times out: each
    request is cancelled (not run to its 480 tokens) and the blocks requests hold come back to where they were.

    Counted as referenced blocks, not free ones: caching a prompt may evict an older idle entry, so the free count
    can stay put while a request holds a block (CI saw exactly that). The loop is slowed so the stream cannot run to
    its end while the test looks (unslowed it takes ~0.6 s, which a loaded CI machine can spend between two reads)."""
    busy.wait_idle()
    pool = busy.engine.pool
    before = pool.num_referenced
    cancelled = sample(busy.metrics(), "vllm:request_success_total", finished_reason="cancelled") or 0.0
    body = {"prompt": "disconnect test, streaming", "max_tokens": 480, "stream": True}
    with slowed(busy.loop):
        with busy.http(key=None) as c, c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = data_events(r)  # held: the connection stays open until the with block leaves
            chunks = [json.loads(next(events)) for _ in range(2)]
            assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks)
            assert pool.num_referenced > before  # the request holds blocks while it streams
        with busy.http(key=None, timeout=httpx.Timeout(0.05)) as c, pytest.raises(httpx.ReadTimeout):
            c.post("/v1/completions", json={"prompt": "disconnect test, whole", "max_tokens": 480})
    busy.wait_idle()
    deadline = time.monotonic() + 10
    while pool.num_referenced != before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.num_referenced == before
    time.sleep(0.1)  # the server counts a cancelled request when the loop hands back its completion
    after = sample(busy.metrics(), "vllm:request_success_total", finished_reason="cancelled")
    assert after >= cancelled + 2
    pool.verify()


def test_a_stream_goes_on_while_its_client_pauses(busy):
    """A streaming client that read two chunks and then stays connected without reading keeps its request: it is
    neither cancelled nor freed while the client waits, and the stream goes on where it stopped once it reads again
    (the early 'cancelled' once blamed on the server was the test's client closing its connection, see
    :func:`data_events`). The loop is slowed so the request cannot end by itself while the client waits."""
    busy.wait_idle()
    pool = busy.engine.pool
    before = pool.num_referenced
    body = {"prompt": "pausing client", "max_tokens": 480, "stream": True, "return_token_ids": True}
    with slowed(busy.loop), busy.http(key=None) as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = data_events(r)
        first = [json.loads(next(events)) for _ in range(2)]
        time.sleep(0.5)  # a disconnect reaches the server, and the loop frees its blocks, within a few ms
        assert busy.loop.stats()["num_running"] == 1
        assert pool.num_referenced > before
        more = [json.loads(next(events)) for _ in range(2)]
        assert all(chunk["choices"][0]["finish_reason"] is None for chunk in first + more)
        assert len({chunk["id"] for chunk in first + more}) == 1
    busy.wait_idle()


def test_metrics_names(keyed):
    keyed.client().completions.create(model=MODEL, prompt="Metrics test prompt", max_tokens=3)
    text = keyed.metrics()
    families = {f.name for f in text_string_to_metric_families(text)}
    expected = {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens", "vllm:generation_tokens",
        "vllm:request_success", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
        "vllm:num_preemptions", "kvboost:content_hit_tokens", "kvboost:recompute_ratio", "kvboost:tier_hits",
        "kvboost:tier_bytes", "kvboost:tenant_prefix_cache_hits",
    }  # fmt: skip
    assert expected <= families, expected - families
    assert sample(text, "vllm:prefix_cache_queries_total", model_name=MODEL) > 0
    assert sample(text, "kvboost:tier_bytes", tier="memory") > 0
    assert sample(text, "vllm:request_success_total", finished_reason="length") > 0
    # the step budget in force (kvboost.engine.budget), as the core describes it
    budget = keyed.loop.core.budget_info()
    assert sample(text, "kvboost:step_budget_max_batch_tokens", model_name=MODEL) > 0
    for rows in ("1", "8", "32"):
        value = sample(text, "kvboost:step_budget_prompt_tokens", decode_rows=rows)
        assert value > 0 and value == budget.get(f"chunk_at_{rows}", budget["max_batch_tokens"] - int(rows))
