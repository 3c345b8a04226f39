"""Routing by KV events vs by guesses vs round robin on Ray Serve: kvboost replicas, an interleaved multi-user chat trace.

One process, one machine, one run: a local Ray, a private ``redis-server`` on a free loopback port, and for each
cache layout (``memory``: every replica its own memory tier; ``memory+redis``: a memory tier over the shared Redis
tier) and each router (``round_robin``, then ``prefix``: where requests were sent, then ``events``: what the
replicas' caches hold, from their KV events) a fresh deployment of ``--replicas`` replicas
(:mod:`kvboost.serving.ray`) that serves the same trace through its OpenAI endpoint. The trace is the load test's
(``experiments/bench/load_test.py``): ``--users`` ShareGPT conversations of ``--turns`` turns, history from the dataset,
users interleaved turn by turn, at most ``--concurrency`` requests in flight. Each deployment starts cold (new
replicas, a new Redis namespace).

Reported per layout and router: the fraction of prompt tokens the replicas served from cache (``usage.
prompt_tokens_details.cached_tokens``), overall and on turns >= 2 (turn 1 has nothing to reuse), TTFT p50 on turns
>= 2, requests per replica (from the ingress's ``/kvboost/routing``) and errors.

A caveat on round robin: with users interleaved in a strict order, an even number of users puts each user's turns on
the same replica every time (request ``i`` goes to replica ``i mod 2``) and an odd number alternates them. The
concurrency loosens the order; the default 9 users is odd on purpose, so round robin is not flattered by an accident.

``--in-process``: the same trace, layouts and routers without Ray: ``--replicas`` engines built in this process
exactly as the Ray replicas build theirs (``kvboost.serving.cli.build_served``, the server's app each), behind an
in-process ingress (a FastAPI app on a loopback port) that ranks with the same :class:`kvboost.serving.ray.RouteBook`
and forwards through the same ASGI bridge; the events router follows each engine's ZMQ publisher. It measures the
routing (where the KV is), not Ray's overheads.

Run::

    python -m experiments.checks.ray_router_check                          # tiny random model, ~2 min on 2 cores
    python -m experiments.checks.ray_router_check --server-args "threads=1"  # the bundled SmolLM2 (slower)
    python -m experiments.checks.ray_router_check --in-process             # no Ray

Writes ``<out>/<name>.json`` and ``<out>/<name>.md`` (default ``experiments/results/serving/ray_router``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from fastapi import Request  # module level: FastAPI resolves the in-process ingress's (string) annotations here

from experiments.bench import load_test as lt
from experiments.checks.redis_tier_check import start_redis
from experiments.redis_process import redis_unavailable_reason
from kvboost.serving.ray import replica_argv

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "serving" / "ray_router"
DEFAULT_SERVER_ARGS = "model=tiny_random threads=1 warmup=false engine.decode=eager"
LAYOUTS = ("memory", "memory+redis")
ROUTER_ORDER = ("round_robin", "prefix", "events")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ideal_fraction(results: list[lt.RequestResult]) -> float | None:
    """What one replica holding everything would reuse on turns >= 2: the previous turn's whole prompt (it is a
    prefix of this turn's: the history comes from the dataset, so the generated answer is not), over this turn's."""
    by_turn = {(r.user, r.turn): r for r in results if r.ok and r.prompt_tokens}
    pairs = [(by_turn.get((u, t - 1)), r) for (u, t), r in by_turn.items() if t >= 2]
    pairs = [(prev, r) for prev, r in pairs if prev is not None]
    total = sum(r.prompt_tokens for _, r in pairs)
    return sum(prev.prompt_tokens for prev, _ in pairs) / total if total else None


def cached_fraction(results: list[lt.RequestResult], min_turn: int = 1) -> float | None:
    """Cached prompt tokens / prompt tokens over successful requests of turn >= ``min_turn`` that report both."""
    rows = [r for r in results if r.ok and r.turn >= min_turn and r.prompt_tokens and r.cached_tokens is not None]
    total = sum(r.prompt_tokens for r in rows)
    return sum(r.cached_tokens for r in rows) / total if total else None


async def _drive(url: str, trace: list[lt.TraceRequest], args: argparse.Namespace) -> tuple[list, float]:
    client = lt.make_client(url, None, 600.0)
    try:
        model = await lt.resolve_model(client, url, None)
        params = lt.Params(model=model, max_tokens=args.max_tokens)
        return await lt.run_load(client, params, trace, concurrency=args.concurrency, desc="trace")
    finally:
        await client.close()


def layout_argv(layout: str, redis_url: str, namespace: str, args: argparse.Namespace) -> list[str]:
    """The replicas' command line for a layout (before the router's own additions): ``--memory-capacity`` caps
    the memory tier (so that it evicts: where guessing and the caches' contents part ways)."""
    argv = replica_argv(shlex.split(args.server_args), redis_url=redis_url if layout == "memory+redis" else None,
                        namespace=namespace)  # fmt: skip
    if args.memory_capacity:
        argv.append(f"cache.0.capacity={args.memory_capacity}" if layout == "memory+redis"
                    else f"cache.capacity={args.memory_capacity}")  # fmt: skip
    return argv


def run_one(layout: str, router: str, trace: list[lt.TraceRequest], redis_url: str, args: argparse.Namespace,
            http_port: int) -> dict[str, Any]:  # fmt: skip
    """Deploy, serve the trace, read the routing counts, delete the deployment."""
    import httpx
    from ray import serve

    from kvboost.serving.ray import build_app

    namespace = f"rrc-{router}-{int(time.time())}"
    argv = layout_argv(layout, redis_url, namespace, args)
    t0 = time.perf_counter()
    serve.run(build_app(argv, replicas=args.replicas, router=router, num_cpus=args.num_cpus,
                        max_imbalance=args.max_imbalance), name="kvboost", route_prefix="/")  # fmt: skip
    deploy_s = time.perf_counter() - t0
    url = f"http://127.0.0.1:{http_port}/v1"
    try:
        results, duration = asyncio.run(_drive(url, trace, args))
        routing = httpx.get(f"http://127.0.0.1:{http_port}/kvboost/routing", timeout=30).json()
    finally:
        serve.delete("kvboost")
    summary = lt.summarize(results, duration)
    return {"layout": layout, "router": router, "replica_argv": argv, "deploy_s": deploy_s, "summary": summary,
            "cached_fraction": cached_fraction(results), "cached_fraction_turn2plus": cached_fraction(results, 2),
            "ideal_fraction_turn2plus": ideal_fraction(results),
            "served": routing.get("served", {}), "requests": [lt._record(r) for r in results]}  # fmt: skip


# ------------------------------------------------------------------------------------------- without Ray
def _inprocess_ingress(apps: dict[str, Any], book: Any, tokenize: Any, tenancy: Any, salt_key: Any = None) -> Any:
    """What OpenAIIngress + the Ray request router do, in one process: rank with ``book``, forward through the
    ASGI bridge, count requests in flight per replica (the router's queue lengths)."""
    from collections import Counter

    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse, StreamingResponse

    from kvboost.serving import ray as kray

    app = FastAPI()
    served: Counter[str] = Counter()

    @app.get("/kvboost/routing")
    def routing() -> dict[str, Any]:
        return {"router": book.policy, "served": dict(served)}

    @app.get("/metrics")
    async def metrics() -> Any:
        texts = {}
        for rid, replica in apps.items():
            parts = [p async for p in kray.call_asgi(replica, "GET", "/metrics")]
            texts[rid] = b"".join(parts[1:]).decode()
        return PlainTextResponse(kray.merge_metrics(texts))

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(path: str, request: Request) -> Any:
        body = await request.body()
        path = "/" + path
        auth = request.headers.get("authorization")
        if book.policy == "events":
            keys = kray.request_route_tokens(path, body, auth, tokenize, tenancy, salt_key)
        else:
            keys = kray.request_route_keys(path, body, auth)
        rid = book.rank(keys, list(apps))[0]
        if path in kray.GENERATION_PATHS:
            served[rid] += 1
        book.sent(rid)
        stream = kray.call_asgi(apps[rid], request.method, path, query=request.url.query.encode("latin-1"),
                                headers=list(request.headers.items()), body=body)  # fmt: skip
        start = await stream.__anext__()

        async def rest() -> Any:
            try:
                async for part in stream:
                    yield part
            finally:
                book.completed(rid)

        headers = {k: v for k, v in start["headers"] if k.lower() not in ("content-length", "transfer-encoding")}
        return StreamingResponse(rest(), status_code=start["status"], headers=headers)

    return app


def run_one_in_process(layout: str, router: str, trace: list[lt.TraceRequest], redis_url: str,
                       args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    """``--replicas`` engines and their apps built as the Ray replicas build theirs, the in-process ingress on a
    free port, the trace through it; then everything closed."""
    import threading

    import httpx
    import uvicorn

    from kvboost.serving import ray as kray
    from kvboost.serving.cli import build_parser as server_parser
    from kvboost.serving.cli import build_served, compose_config, tenant_keys
    from kvboost.serving.tenancy import Tenancy

    namespace = f"rrc-{router}-{int(time.time())}"
    argv = kray.replica_argv(layout_argv(layout, redis_url, namespace, args), redis_url=None,
                             events=router == "events")  # fmt: skip
    if router == "events":  # several publishers in one process: loopback, an ephemeral port each
        argv = [a.replace("tcp://*:*", "tcp://127.0.0.1:*") for a in argv]
        argv.append("engine.kv_events.salt_key=ray-router-check")  # one key for the replicas and the ingress
    server_args = server_parser().parse_args(argv)
    cfg = compose_config(server_args)
    keys, secret = tenant_keys(server_args)
    t0 = time.perf_counter()
    engines, loops, apps = [], [], {}
    book = kray.RouteBook(router, max_imbalance=args.max_imbalance)
    server = thread = None
    try:
        for i in range(args.replicas):
            engine, loop, app = build_served(server_args, cfg, keys, secret, refresh_shared_s=kray.DEFAULT_REFRESH_S)
            engines.append(engine)
            loops.append(loop)
            rid = f"replica-{i}"
            apps[rid] = app
            if router == "events":
                pub = engine.kv_events.publisher
                assert book.subscribe(rid, {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                                            "topic": pub.topic}), "cannot follow the replica's KV events"
        tokenize = kray.load_request_tokenizer(cfg) if router == "events" else None
        ingress = _inprocess_ingress(apps, book, tokenize, Tenancy(keys, secret) if keys else None,
                                     cfg["engine"]["kv_events"].get("salt_key"))
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(ingress, host="127.0.0.1", port=port, log_level="warning",
                                               lifespan="off"))  # fmt: skip
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        deploy_s = time.perf_counter() - t0
        url = f"http://127.0.0.1:{port}/v1"
        results, duration = asyncio.run(_drive(url, trace, args))
        routing = httpx.get(f"http://127.0.0.1:{port}/kvboost/routing", timeout=30).json()
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=60).text
    finally:
        if server is not None:
            server.should_exit = True
            thread.join(30)
        book.close()
        for loop in loops:
            loop.shutdown()
        for engine in engines:
            engine.close()
    summary = lt.summarize(results, duration)
    return {"layout": layout, "router": router, "replica_argv": argv, "deploy_s": deploy_s, "summary": summary,
            "cached_fraction": cached_fraction(results), "cached_fraction_turn2plus": cached_fraction(results, 2),
            "ideal_fraction_turn2plus": ideal_fraction(results), "served": routing.get("served", {}),
            "metrics_series": _metric_totals(metrics), "requests": [lt._record(r) for r in results]}  # fmt: skip


def _metric_totals(text: str) -> dict[str, float]:
    """A few series of the merged /metrics, summed over replicas (the prefix-cache counters, KV-event counters)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "kvboost:kv_events_batches_total",
              "kvboost:kv_events_dropped_total")  # fmt: skip
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def format_markdown(payload: dict[str, Any]) -> str:
    """The command, the setting, and one table row per (cache layout, router)."""
    env = payload["environment"]
    setting = (f"{payload['replicas']} replicas, {payload['users']} users x {payload['turns']} turns of ShareGPT "
               f"(interleaved, history from the dataset), concurrency {payload['concurrency']}, max_tokens "
               f"{payload['max_tokens']}; replica arguments `{payload['server_args']}`"
               f"{'; memory tier ' + payload['memory_capacity'] + ' per replica' if payload.get('memory_capacity') else ''}; "
               f"{'in process, no Ray' if payload.get('in_process') else 'Ray ' + str(payload['ray'])}; CPU: "
               f"{env['cpu']} ({env['cpu_count']} cores). Each row is a fresh deployment (cold replicas, new "
               "Redis namespace). Ideal = the previous turn's whole prompt reused (one replica holding everything).")
    header = ("| cache | router | cached fraction | cached fraction, turns >= 2 (ideal) | TTFT p50 turns >= 2 (ms) | "
              "requests per replica | errors |")
    title = ("# Routing by KV events vs by guesses vs round robin" +
             (" (in process, no Ray)" if payload.get("in_process") else " on Ray Serve"))  # fmt: skip
    lines = [title, "", "```", payload["command"], "```", "", setting,
             "", header, "| --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for row in payload["runs"]:
        s = row["summary"]
        served = ", ".join(str(v) for _, v in sorted(row["served"].items())) or "-"
        errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"
        lines.append(f"| {row['layout']} | {row['router']} | {lt._fmt(row['cached_fraction'], 3)} | "
                     f"{lt._fmt(row['cached_fraction_turn2plus'], 3)} ({lt._fmt(row['ideal_fraction_turn2plus'], 3)}) "
                     f"| {lt._fmt(s['ttft_ms_turn2plus_p50'])} | {served} | {errors} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--users", type=int, default=9)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-prompt-chars", type=int, default=4000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-cpus", type=float, default=1.0, help="Ray CPUs per replica (logical; Ray gets enough)")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS, help="every replica's kvboost-server arguments")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    p.add_argument("--routers", nargs="+", choices=ROUTER_ORDER, default=list(ROUTER_ORDER))
    p.add_argument("--max-imbalance", type=int, default=4, help="in-process ingress: the routers' max_imbalance")
    p.add_argument("--in-process", action="store_true", help="no Ray: engines in this process behind an in-process "
                   "ingress with the same routing classes")  # fmt: skip
    p.add_argument("--memory-capacity", default=None, help="each replica's memory tier budget (e.g. 1MiB; default: "
                   "the config's), small enough to evict")  # fmt: skip
    p.add_argument("--name", default="ray_router")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    command = shlex.join(["python", "experiments/checks/ray_router_check.py", *(sys.argv[1:] if argv is None else argv)])

    ray = serve = None
    if not args.in_process:
        try:
            import ray
            from ray import serve
        except ImportError:
            print("ray_router_check: Ray Serve is not installed: pip install -e '.[cluster]' (or --in-process)",
                  file=sys.stderr)  # fmt: skip
            return 2

    sessions = lt.load_sessions(args.users, args.turns, seed=args.seed, max_prompt_chars=args.max_prompt_chars)
    trace = lt.build_trace(sessions)
    work = Path(tempfile.mkdtemp(prefix="kvboost-ray-router-"))
    redis, redis_url = None, ""
    if "memory+redis" in args.layouts:
        if (why := redis_unavailable_reason()) is not None:
            print(f"ray_router_check: the memory+redis layout needs a Redis server: {why}; or run --layouts memory",
                  file=sys.stderr)  # fmt: skip
            return 2
        redis = start_redis(work, "1gb")  # maxmemory + allkeys-lru as the tier's backstop
        redis_url = redis.url
    http_port = _free_port()
    if not args.in_process:
        # logical CPUs: replicas reserve num_cpus each, the ingress none; the real cores are shared by all of them
        ray.init(num_cpus=max(os.cpu_count() or 1, int(args.replicas * args.num_cpus) + 1), include_dashboard=False,
                 log_to_driver=False)  # fmt: skip
    runs = []
    try:
        if not args.in_process:
            serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        for layout in args.layouts:
            for router in [r for r in ROUTER_ORDER if r in args.routers]:
                if args.in_process:
                    row = run_one_in_process(layout, router, trace, redis_url, args)
                else:
                    row = run_one(layout, router, trace, redis_url, args, http_port)
                runs.append(row)
                print(f"{layout:13s} {router:12s} cached {lt._fmt(row['cached_fraction'], 3)} (turns >= 2: "
                      f"{lt._fmt(row['cached_fraction_turn2plus'], 3)}) served {row['served']} "
                      f"errors {row['summary']['errors'] or 'none'}", flush=True)
    finally:
        if not args.in_process:
            serve.shutdown()
            ray.shutdown()
        if redis is not None:
            redis.stop()
    payload = {"name": args.name, "command": command, "replicas": args.replicas, "users": args.users,
               "turns": args.turns, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
               "server_args": args.server_args, "ray": None if ray is None else ray.__version__,
               "in_process": args.in_process, "max_imbalance": args.max_imbalance,
               "memory_capacity": args.memory_capacity, "environment": lt.environment(),
               "sessions": [s.conversation_id for s in sessions], "runs": runs}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    (args.out / f"{args.name}.md").write_text(format_markdown(payload))
    print(format_markdown(payload))
    print(f"wrote {args.out / (args.name + '.json')} and {args.out / (args.name + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
