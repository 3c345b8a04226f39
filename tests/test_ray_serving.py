"""Scale-out on Ray Serve (kvboost/serving/ray.py). Most of it is tested without Ray: the in-process ASGI bridge (also
over the real server app and engine loop), the routing keys of a request, the routers' state, the replicas' command
line and the shared-tier refresher, the app builder's arguments and the bundled Serve config, check_health on a real
engine loop. Two tests deploy two replicas on a real (local) Ray (a conversation kept on one replica; a replica whose
engine loop is killed, replaced while traffic goes on); they skip without Ray."""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import Future

import pytest
from fastapi import FastAPI, Request  # module level: FastAPI resolves the routes' annotations here
from fastapi.responses import JSONResponse, StreamingResponse

from kvboost.serving import ray as kray
from kvboost.serving.routing import text_chunk_keys


async def _collect(gen):
    start, parts, times = None, [], []
    async for item in gen:
        if isinstance(item, dict):
            start = item
        else:
            parts.append(item)
            times.append(time.perf_counter())
    return start, parts, times


# ================================================================================================ ASGI bridge
def _toy_app(state: dict) -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request):
        body = await request.json()
        return JSONResponse({"got": body, "q": request.query_params.get("x"), "auth": request.headers.get("authorization")},
                            status_code=201)

    @app.get("/stream")
    async def stream():
        async def gen():
            try:
                for i in range(3):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.2)
            finally:
                state["stream_closed"] = True

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom():
        raise RuntimeError("kaput")

    return app


def test_bridge_returns_status_headers_and_body():
    app = _toy_app({})
    start, parts, _ = asyncio.run(_collect(kray.call_asgi(app, "POST", "/echo", query=b"x=7", body=b'{"a": 1}',
                                                          headers=[("Authorization", "Bearer k"),
                                                                   ("content-type", "application/json")])))
    assert start["status"] == 201 and ("content-type", "application/json") in start["headers"]
    assert json.loads(b"".join(parts)) == {"got": {"a": 1}, "q": "7", "auth": "Bearer k"}


def test_bridge_streams_pieces_as_they_come_and_a_closed_reader_disconnects():
    state: dict = {}
    app = _toy_app(state)
    t0 = time.perf_counter()
    start, parts, times = asyncio.run(_collect(kray.call_asgi(app, "GET", "/stream")))
    assert start["status"] == 200 and parts == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert times[0] - t0 < 0.15 and times[2] - times[0] >= 0.35  # not buffered until the end

    async def read_one_then_leave():
        gen = kray.call_asgi(app, "GET", "/stream")
        await gen.__anext__()
        first = await gen.__anext__()
        await gen.aclose()
        await asyncio.sleep(0.5)
        return first

    state.clear()
    assert asyncio.run(read_one_then_leave()) == b"data: 0\n\n"
    assert state.get("stream_closed"), "the app's stream did not end when the reader left"


def test_bridge_answers_500_in_openai_shape_when_the_app_fails_before_answering():
    async def raw_app(scope, receive, send):
        raise RuntimeError("kaput")

    start, parts, _ = asyncio.run(_collect(kray.call_asgi(raw_app, "GET", "/")))
    assert start["status"] == 500
    assert "kaput" in json.loads(b"".join(parts))["error"]["message"]
    # an app that answered its own 500 first keeps its answer
    start, parts, _ = asyncio.run(_collect(kray.call_asgi(_toy_app({}), "GET", "/boom")))
    assert start["status"] == 500 and b"".join(parts) == b"Internal Server Error"


def test_bridge_over_the_real_server_app_and_engine_loop():
    """What a replica does with a request, without Ray: the server's create_app over an EngineLoop."""
    from kvboost_testkit.tiny import make_engine

    from kvboost.engine.loop import EngineLoop
    from kvboost.serving.server import create_app

    engine = make_engine("llama", decode="eager")  # eager: no compile of the decode step on the test's clock
    loop = EngineLoop(engine).start()
    try:
        app = create_app(loop, model_name="tiny", server_secret="s")
        messages = [{"role": "user", "content": "hello there, a prompt long enough for a few chunks " * 3}]
        body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 5, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()

        def ask():
            return asyncio.run(_collect(kray.call_asgi(app, "POST", "/v1/chat/completions", body=body,
                                                       headers=[("content-type", "application/json")])))

        start, parts, _ = ask()
        assert start["status"] == 200
        events = [json.loads(line[6:]) for line in b"".join(parts).decode().splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == 5 and usage["prompt_tokens_details"]["cached_tokens"] == 0
        again = ask()[1]
        usage2 = [json.loads(line[6:]) for line in b"".join(again).decode().splitlines()
                  if line.startswith("data: {")][-1]["usage"]  # fmt: skip
        assert usage2["prompt_tokens_details"]["cached_tokens"] > 0  # the replica's cache is the engine's
        bad = asyncio.run(_collect(kray.call_asgi(app, "POST", "/v1/chat/completions", body=b"{nope",
                                                  headers=[("content-type", "application/json")])))
        assert bad[0]["status"] == 400 and "error" in json.loads(b"".join(bad[1]))
    finally:
        loop.shutdown()
        engine.close()


# ============================================================================================ keys and routers
def test_route_keys_of_generation_requests_only_salted_by_key_and_cache_salt():
    turn1 = [{"role": "user", "content": "a question about python packaging " * 6}]
    turn2 = turn1 + [{"role": "assistant", "content": "an answer " * 10}, {"role": "user", "content": "more " * 20}]
    chat = lambda m, **kw: json.dumps({"model": "x", "messages": m, **kw}).encode()
    k1 = kray.request_route_keys("/v1/chat/completions", chat(turn1), "Bearer a")
    k2 = kray.request_route_keys("/v1/chat/completions", chat(turn2), "Bearer a")
    assert k1 and k2[: len(k1)] == k1
    assert kray.request_route_keys("/v1/chat/completions", chat(turn1), "Bearer b")[0] != k1[0]
    assert kray.request_route_keys("/v1/chat/completions", chat(turn1, cache_salt="s"), "Bearer a")[0] != k1[0]
    completion = json.dumps({"model": "x", "prompt": "p" * 200}).encode()
    assert kray.request_route_keys("/v1/completions", completion, None) == text_chunk_keys(
        "p" * 200, salt=f"{__import__('hashlib').sha256(b'').hexdigest()[:16]}|")
    assert kray.request_route_keys("/v1/models", b"", None) is None
    assert kray.request_route_keys("/v1/chat/completions", b"{broken", None) is None
    assert kray.request_route_keys("/v1/chat/completions", b'{"prompt": "no messages"}', None) is None


def test_route_book_prefix_policy_sticks_then_balances_on_in_flight_requests():
    book = kray.RouteBook("prefix", max_imbalance=1)
    keys = text_chunk_keys("x" * 640)
    first = book.rank(keys, ["b", "a"])[0]
    other = "a" if first == "b" else "b"
    assert book.rank(keys, ["a", "b"])[0] == first  # recorded: the same prefix goes back there
    book.sent(first)
    book.sent(first)  # two in flight there, none on the other: more than max_imbalance apart
    assert book.rank(keys, ["a", "b"]) == [other, first]
    book.completed(first)
    # the overflow request was recorded on the other replica: both hold the prefix now, the shorter queue wins
    assert book.rank(keys, ["a", "b"])[0] == other
    assert book.queue_len(first, 7) == 7  # Ray's reported queue length counts when it is larger
    book.forget(first)
    assert first not in book.prefix.indexes and book.in_flight[first] == 0


def test_route_book_round_robin_rotates_in_a_fixed_order():
    book = kray.RouteBook("round_robin")
    firsts = [book.rank(["k"], order)[0] for order in (["b", "a", "c"], ["c", "b", "a"], ["a", "c", "b"], ["a", "b", "c"])]
    assert firsts == ["a", "b", "c", "a"]
    assert book.rank(None, []) == []
    with pytest.raises(ValueError, match="unknown router"):
        kray.RouteBook("random")


def test_replica_command_line_adds_the_shared_redis_tier_unless_the_cache_is_set():
    argv = kray.replica_argv(["model=tiny_random"], redis_url="redis://h:1/0", namespace="ns", salt_secret="s3")
    assert argv[:1] == ["model=tiny_random"]
    assert {"cache=[memory,redis]", "cache.1.url=redis://h:1/0", "cache.1.namespace=ns",
            "cache.1.write_through=true"} <= set(argv)  # fmt: skip
    assert argv[argv.index("--salt-secret") + 1] == "s3"
    assert kray.replica_argv(["cache=memory"], redis_url="redis://h:1/0") == ["cache=memory"]
    assert kray.replica_argv(["--disk-cache-dir", "/d"], redis_url="redis://h:1/0") == ["--disk-cache-dir", "/d"]
    assert kray.replica_argv(["model=tiny_random"], redis_url=None) == ["model=tiny_random"]
    # the replicas' command line is a valid kvboost-server command line (the config composes)
    from kvboost.serving.cli import build_parser, compose_config

    cfg = compose_config(build_parser().parse_args(kray.replica_argv(["model=tiny_random"], redis_url="redis://h:1/0")))
    assert [t["name"] for t in cfg["cache"]] == ["memory", "redis"] and cfg["cache"][1]["write_through"] is True


class _FakeLoop:
    running = True

    def __init__(self, tiers):
        self.engine = type("E", (), {})()
        self.engine.store = type("S", (), {"tiers": tiers, "refresh": lambda s: 2})()
        self.calls = 0

    def call(self, fn):
        self.calls += 1
        future: Future = Future()
        future.set_result(fn(self.engine))
        return future


def test_main_without_ray_says_how_to_install(monkeypatch, capsys):
    monkeypatch.setattr(kray, "ray", None)
    assert kray.main(["--replicas", "2"]) == 2
    assert "pip install -e '.[cluster]'" in capsys.readouterr().err


# ================================================================================= app builder and health (no Ray)
def test_app_options_type_defaults_and_clear_errors(monkeypatch):
    """What ``serve run kvboost.serving.ray:app_builder k=v ...`` / a Serve config file's ``args:`` become: typed
    (Ray passes strings), defaults filled, the replicas' command line prepared and checked before any replica."""
    monkeypatch.delenv("KVBOOST_API_KEYS", raising=False)
    monkeypatch.delenv("KVBOOST_SALT_SECRET", raising=False)
    opts = kray.app_options({"replicas": "3", "router": "events", "no_redis": "true", "max_imbalance": 2,
                             "server_args": "model=tiny_random threads=1"})  # fmt: skip
    assert opts["replicas"] == 3 and opts["router"] == "events" and opts["max_imbalance"] == 2
    assert opts["server_argv"] == ["model=tiny_random", "threads=1"]  # no Redis tier added
    with_redis = kray.app_options({"server_args": ["model=tiny_random"], "redis_url": "redis://h:1/0"})
    assert "cache.1.url=redis://h:1/0" in with_redis["server_argv"] and with_redis["replicas"] == 2
    keyed = kray.app_options({"no_redis": True, "server_args": "model=tiny_random --api-key k1"})
    assert keyed["server_argv"][keyed["server_argv"].index("--salt-secret") + 1]  # one secret for all replicas
    for bad, message in (({"replica": 2}, "unknown app argument"), ({"replicas": "two"}, "expected int"),
                         ({"router": "random"}, "choose one of"), ({"no_redis": "maybe"}, "true or false"),
                         ({"replicas": 0}, ">= 1"),
                         ({"no_redis": True, "server_args": "model=tiny_random recompute=nope"}, "server_args")):
        with pytest.raises(ValueError, match=message):
            kray.app_options(bad)


def test_app_builder_without_ray_says_how_to_install(monkeypatch):
    monkeypatch.setattr(kray, "ray", None)
    with pytest.raises(ImportError, match="cluster"):
        kray.app_builder({"replicas": 1})


def test_replica_health_fails_once_the_engine_loop_died():
    """check_health's logic on a real engine loop: healthy while it runs; after its thread died of an error in a
    step (as a crashed kernel would end it; the replicas' fault hook) and after a shutdown, it raises, so Serve
    replaces the replica."""
    from kvboost_testkit.tiny import make_engine

    from kvboost.engine.loop import EngineLoop

    from kvboost.serving.server import create_app

    engine = make_engine("llama", decode="eager")
    loop = EngineLoop(engine).start()
    try:
        asyncio.run(kray.replica_health(loop, probe_s=10))  # healthy: no error
        kray._fail_next_step(loop, "kernel fault")  # what KVBoostReplica.inject_loop_fault does
        deadline = time.monotonic() + 10
        while loop.running and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="kernel fault"):
            asyncio.run(kray.replica_health(loop, probe_s=10))
        # what the dead replica's server answers: a refusal the ingress may re-send to another replica
        body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        start, parts, _ = asyncio.run(_collect(kray.call_asgi(create_app(loop, model_name="tiny"), "POST",
                                                              "/v1/chat/completions", body=body.encode(),
                                                              headers=[("content-type", "application/json")])))
        assert start["status"] == 503 and kray.refusal_reason(503, b"".join(parts)) == "loop_stopped"
    finally:
        loop.shutdown()
        engine.close()
    stopped = EngineLoop(make_engine("llama", decode="eager")).start()
    stopped.shutdown()
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(kray.replica_health(stopped, probe_s=10))
    stopped.engine.close()


def test_replica_health_fails_when_the_loop_hangs():
    """A loop whose step never returns answers no probe: unhealthy after ``probe_s``."""

    class Hung:
        error, running = None, True

        def call(self, fn):
            return Future()  # never run

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not answer"):
        asyncio.run(kray.replica_health(Hung(), probe_s=0.2))
    assert time.monotonic() - start < 5


def test_refusal_reason_only_for_requests_that_never_started():
    refused = json.dumps({"error": {"message": "the engine loop is not running", "type": "service_unavailable",
                                    "param": None, "code": "loop_stopped"}}).encode()  # fmt: skip
    assert kray.refusal_reason(503, refused) == "loop_stopped"
    assert kray.refusal_reason(500, refused) is None
    busy = json.dumps({"error": {"message": "full", "code": "queue_full"}}).encode()
    assert kray.refusal_reason(503, busy) is None  # not "never started": the client's to see (and retry)
    assert kray.refusal_reason(503, b"<html>bad gateway</html>") is None
    assert kray.refusal_reason(503, b'{"error": "flat"}') is None


def test_route_book_retain_forgets_the_replicas_ray_dropped():
    """A replica Serve replaced (failed health check) leaves the running set: its prefix index and in-flight count
    go, so the router neither ranks it by what it held nor counts its requests against the new one."""
    book = kray.RouteBook("prefix")
    keys = text_chunk_keys("y" * 640)
    first = book.rank(keys, ["a", "b"])[0]
    book.sent(first)
    book.rank(["other"], ["a", "b"])
    assert book.retain({"a", "b"}) == []
    survivor = "a" if first == "b" else "b"
    assert book.retain({survivor, "c"}) == [first]
    assert first not in book.prefix.indexes and book.in_flight[first] == 0
    assert book.rank(keys, [survivor, "c"])[0] in (survivor, "c")


def test_router_hub_follows_the_running_set():
    from kvboost.serving.ray_metrics import RouterHub

    hub = RouterHub()
    hub.seen(["r1", "r2"])
    hub.seen(["r2"])
    assert hub.replicas() == ["r1", "r2"]
    hub.sync(["r2", "r3"])  # r1 was replaced by r3
    assert hub.replicas() == ["r2", "r3"]
    hub.gone("r2")
    assert hub.replicas() == ["r3"]


def test_merged_metrics_carry_the_ingress_series():
    from prometheus_client import CollectorRegistry, Counter, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from kvboost.serving.ray_metrics import ingress_families

    reg = CollectorRegistry()
    Counter("vllm:prompt_tokens", "Prompt tokens.", registry=reg).inc(5)
    text = kray.merge_metrics({"r1": generate_latest(reg).decode()},
                              ingress_families(1, 1, {"loop_stopped": 3}))  # fmt: skip
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip
    assert samples[("vllm:prompt_tokens_total", (("replica", "r1"),))] == 5
    assert samples[("kvboost:ray_replicas", (("state", "answered"),))] == 1
    assert samples[("kvboost:ray_replicas", (("state", "failed"),))] == 1
    assert samples[("kvboost:ray_ingress_retries_total", (("reason", "loop_stopped"),))] == 3


def test_replicas_publishing_kv_events_each_bind_their_own_port():
    """Replicas share a node and one command line: with events on and no endpoint given, each binds an ephemeral
    port (reported in its metadata), not the config's 5557 that only the first could bind; on the node's address."""
    from kvboost.serving.cli import build_parser, compose_config

    argv = kray.replica_events_argv(["model=tiny_random", "engine.kv_events.enabled=true"], "10.0.0.7")
    cfg = compose_config(build_parser().parse_args(argv))
    events = cfg["engine"]["kv_events"]
    assert events["endpoint"] == "tcp://*:*" and events["host"] == "10.0.0.7"
    for enabled in ("+engine.kv_events.enabled=true", "engine.kv_events.enabled=True"):
        assert "engine.kv_events.endpoint=tcp://*:*" in kray.replica_events_argv([enabled], "h")
    # what the user named stays (a fixed port: one replica per node, as a pod); events off: nothing added
    fixed = ["engine.kv_events.enabled=true", "engine.kv_events.endpoint=tcp://*:6000", "--kv-events-host", "h2"]
    assert kray.replica_events_argv(fixed, "h") == fixed
    assert kray.replica_events_argv(["model=tiny_random"], "h") == ["model=tiny_random"]
    # two publishers from that config on one machine: two ports
    from kvboost.cache.events import ZmqEventPublisher

    pubs = [ZmqEventPublisher(events["endpoint"], host="127.0.0.1") for _ in range(2)]
    try:
        ports = {p.endpoint.rsplit(":", 1)[1] for p in pubs}
        assert len(ports) == 2 and "*" not in ports, [p.endpoint for p in pubs]
    finally:
        for p in pubs:
            p.shutdown()


def test_bundled_serve_config_is_valid_for_the_app_builder():
    """The example Serve config file (in the wheel; ``--print-serve-config``): every application imports
    ``kvboost.serving.ray:app`` and its ``args`` pass the builder's checks (Ray's own schema too, where installed)."""
    import yaml

    text = kray.serve_config_text()
    config = yaml.safe_load(text)
    apps = config["applications"]
    assert len(apps) >= 2 and len({a["route_prefix"] for a in apps}) == len(apps)
    for app in apps:
        assert app["import_path"] == "kvboost.serving.ray:app"
        opts = kray.app_options(app["args"])
        assert opts["replicas"] >= 1 and opts["router"] in kray.ROUTERS
    try:
        from ray.serve.schema import ServeDeploySchema
    except ImportError:
        return
    schema = ServeDeploySchema.model_validate(config)  # what `serve run` / `serve deploy` check first
    assert [a.import_path for a in schema.applications] == [a["import_path"] for a in apps]


def test_console_script_prints_the_serve_config_without_ray(monkeypatch, capsys):
    monkeypatch.setattr(kray, "ray", None)
    assert kray.main(["--print-serve-config"]) == 0
    assert capsys.readouterr().out == kray.serve_config_text()


# ====================================================================================== a real (local) Ray Serve
def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_replicas_on_ray_serve_keep_a_conversation_on_one_replica():
    """A local Ray, two tiny-model replicas, the prefix router: a 3-turn chat streams through the ingress, every
    turn lands on the same replica and reuses the previous turn's prompt; errors keep OpenAI's envelope."""
    ray = pytest.importorskip("ray")
    import httpx
    import openai
    from ray import serve

    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        argv = ["model=tiny_random", "threads=1", "warmup=false", "engine.decode=eager"]
        serve.run(kray.build_app(argv, replicas=2, router="prefix", num_cpus=1), name="kvboost", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "tell me about the history of the printing press " * 4}]
        cached = []
        for turn in range(3):
            stream = client.chat.completions.create(model=model, messages=messages, max_tokens=6, temperature=0,
                                                    stream=True, stream_options={"include_usage": True})
            text, usage = "", None
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
                usage = chunk.usage or usage
            assert usage is not None and usage.completion_tokens == 6
            cached.append(usage.prompt_tokens_details.cached_tokens)
            messages += [{"role": "assistant", "content": text or "ok"}, {"role": "user", "content": f"and {turn}?"}]
        assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
        served = httpx.get(f"{base}/kvboost/routing", timeout=30).json()
        assert served["router"] == "prefix" and sorted(served["served"].values()) == [3], served
        with pytest.raises(openai.NotFoundError, match="does not exist"):
            client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=2)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_serve_replaces_a_replica_whose_engine_loop_died_and_traffic_recovers():
    """``serve run kvboost.serving.ray:app ...``'s path (Ray's own builder call on the import path), two tiny-model
    replicas: one replica's engine loop is killed (its fault hook); requests keep succeeding (the ingress re-sends
    the dead replica's refusals), Serve's health check fails it and starts a new replica, the router and /metrics
    follow the new running set, and the new replica serves."""
    ray = pytest.importorskip("ray")
    import httpx
    from ray import serve
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray._common.utils import import_attr

    port = _free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        args = {"replicas": "2", "router": "round_robin", "no_redis": "true", "num_cpus": "0.5",
                "health_check_period_s": "1", "health_check_timeout_s": "10",
                "server_args": "model=tiny_random threads=1 warmup=false engine.decode=eager"}  # fmt: skip
        app = call_user_app_builder_with_args_if_necessary(import_attr("kvboost.serving.ray:app"), args)
        serve.run(app, name="kvboost", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        http = httpx.Client(base_url=base, timeout=60)

        model = http.get("/v1/models").json()["data"][0]["id"]

        def chat(i: int) -> int:
            body = {"model": model, "messages": [{"role": "user", "content": f"question {i}: " + "words " * 20}],
                    "max_tokens": 3}  # fmt: skip
            return http.post("/v1/chat/completions", json=body).status_code

        assert [chat(i) for i in range(4)] == [200] * 4
        before = http.get("/kvboost/routing").json()
        assert len(before["replicas"]) == 2 and sorted(before["served"].values()) == [2, 2], before
        victim = before["replicas"][0]

        engines = serve.get_deployment_handle("KVBoostReplica", "kvboost")
        assert engines.options(method_name="inject_loop_fault").remote("drill", route_to=victim).result() == victim
        # the dead replica refuses unstarted (503 loop_stopped): the ingress re-sends to the other one
        codes = [chat(10 + i) for i in range(6)]
        assert codes == [200] * 6, codes

        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            now = http.get("/kvboost/routing").json()["replicas"]
            if len(now) == 2 and victim not in now:
                break
            time.sleep(0.5)
        assert len(now) == 2 and victim not in now, now
        status = serve.status().applications["kvboost"].deployments["KVBoostReplica"]
        assert status.replica_states.get("RUNNING") == 2, status
        fresh = next(r for r in now if r not in before["replicas"])

        assert [chat(20 + i) for i in range(4)] == [200] * 4
        after = http.get("/kvboost/routing").json()
        assert after["served"].get(fresh, 0) >= 1, after  # round robin: the new replica serves
        metrics = http.get("/metrics").text
        assert f'replica="{fresh}"' in metrics and f'replica="{victim}"' not in metrics
        assert 'kvboost:ray_replicas{state="answered"} 2.0' in metrics
    finally:
        serve.shutdown()
        ray.shutdown()


# ============================================================== the router's replica book under Ray's announcements
from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402

_REPLICAS = ("r1", "r2", "r3", "r4")


class ReplicaBookMachine(RuleBasedStateMachine):
    """A router's :class:`RouteBook` and the process's :class:`RouterHub` as Ray drives them: requests sent and
    completed (in any order, completions of unknown replicas too), routing decisions, and announcements of the
    running set (``update_replicas``: retain + sync) or a dead actor (forget + gone). The model: per replica the
    requests in flight, and the running set. Checked: counts never negative and equal to the model's, a replica
    gone from the running set has no state left anywhere (its prefix index, its count, the hub), the ranking
    lists exactly the candidates offered."""

    def __init__(self) -> None:
        super().__init__()
        from kvboost.serving.ray_metrics import RouterHub

        self.book = kray.RouteBook("prefix", max_imbalance=2)
        self.hub = RouterHub()
        self.running: set[str] = set()
        self.in_flight: dict[str, int] = {}

    @rule(replicas=st.sets(st.sampled_from(_REPLICAS)))
    def announce(self, replicas):
        self.book.retain(replicas)
        self.hub.sync(sorted(replicas))
        self.in_flight = {r: n for r, n in self.in_flight.items() if r in replicas}
        self.running = set(replicas)

    @rule(replica=st.sampled_from(_REPLICAS))
    def actor_died(self, replica):
        self.book.forget(replica)
        self.hub.gone(replica)
        self.in_flight.pop(replica, None)
        self.running.discard(replica)

    @rule(prompt=st.integers(0, 3))
    def route_and_send(self, prompt):
        if not self.running:
            assert self.book.rank(["k"], []) == []
            return
        ranking = self.book.rank(text_chunk_keys(f"prompt {prompt} " * 40), sorted(self.running))
        assert sorted(ranking) == sorted(self.running)
        self.book.sent(ranking[0])
        self.in_flight[ranking[0]] = self.in_flight.get(ranking[0], 0) + 1

    @rule(replica=st.sampled_from(_REPLICAS))
    def completed(self, replica):
        self.book.completed(replica)  # also for a replica forgotten meanwhile: nothing to take back
        if self.in_flight.get(replica, 0) > 0:
            self.in_flight[replica] -= 1

    @invariant()
    def counts_and_membership_agree(self):
        for replica in _REPLICAS:
            assert self.book.in_flight[replica] == self.in_flight.get(replica, 0) >= 0
        known = {*self.book.prefix.indexes, *(r for r, n in self.book.in_flight.items() if n)}
        assert known <= self.running, (known, self.running)
        assert set(self.hub.replicas()) <= self.running


TestReplicaBook = ReplicaBookMachine.TestCase
TestReplicaBook.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
