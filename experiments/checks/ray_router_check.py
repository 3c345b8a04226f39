"""Prefix-aware routing vs round robin on Ray Serve: two kvboost replicas, an interleaved multi-user chat trace.

One process, one machine, one run: a local Ray, a private ``redis-server`` on a free loopback port, and for each
cache layout (``memory``: every replica its own memory tier; ``memory+redis``: a memory tier over the shared Redis
tier) and each router (``round_robin``, then ``prefix``) a fresh deployment of ``--replicas`` replicas
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

Run::

    python -m experiments.checks.ray_router_check                          # tiny random model, ~2 min on 2 cores
    python -m experiments.checks.ray_router_check --server-args "threads=1"  # the bundled SmolLM2 (slower)

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

from experiments.bench import load_test as lt
from experiments.checks.redis_tier_check import start_redis
from experiments.redis_process import redis_unavailable_reason

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "serving"
DEFAULT_SERVER_ARGS = "model=tiny_random threads=1 warmup=false engine.decode=eager"
LAYOUTS = ("memory", "memory+redis")
ROUTER_ORDER = ("round_robin", "prefix")


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


def run_one(layout: str, router: str, trace: list[lt.TraceRequest], redis_url: str, args: argparse.Namespace,
            http_port: int) -> dict[str, Any]:  # fmt: skip
    """Deploy, serve the trace, read the routing counts, delete the deployment."""
    import httpx
    from ray import serve

    from kvboost.serving.ray import build_app, replica_argv

    namespace = f"rrc-{router}-{int(time.time())}"
    argv = replica_argv(shlex.split(args.server_args), redis_url=redis_url if layout == "memory+redis" else None,
                        namespace=namespace)  # fmt: skip
    t0 = time.perf_counter()
    serve.run(build_app(argv, replicas=args.replicas, router=router, num_cpus=args.num_cpus), name="kvboost",
              route_prefix="/")  # fmt: skip
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


def format_markdown(payload: dict[str, Any]) -> str:
    """The command, the setting, and one table row per (cache layout, router)."""
    env = payload["environment"]
    setting = (f"{payload['replicas']} replicas, {payload['users']} users x {payload['turns']} turns of ShareGPT "
               f"(interleaved, history from the dataset), concurrency {payload['concurrency']}, max_tokens "
               f"{payload['max_tokens']}; replica arguments `{payload['server_args']}`; Ray {payload['ray']}; CPU: "
               f"{env['cpu']} ({env['cpu_count']} cores). Each row is a fresh deployment (cold replicas, new "
               "Redis namespace). Ideal = the previous turn's whole prompt reused (one replica holding everything).")
    header = ("| cache | router | cached fraction | cached fraction, turns >= 2 (ideal) | TTFT p50 turns >= 2 (ms) | "
              "requests per replica | errors |")
    lines = ["# Prefix-aware routing vs round robin on Ray Serve", "", "```", payload["command"], "```", "", setting,
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
    p.add_argument("--name", default="ray_router")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    command = shlex.join(["python", "experiments/checks/ray_router_check.py", *(sys.argv[1:] if argv is None else argv)])

    try:
        import ray
        from ray import serve
    except ImportError:
        print("ray_router_check: Ray Serve is not installed: pip install -e '.[cluster]'", file=sys.stderr)
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
    # logical CPUs: replicas reserve num_cpus each, the ingress none; the real cores are shared by all of them
    ray.init(num_cpus=max(os.cpu_count() or 1, int(args.replicas * args.num_cpus) + 1), include_dashboard=False,
             log_to_driver=False)  # fmt: skip
    runs = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        for layout in args.layouts:
            for router in ROUTER_ORDER:
                row = run_one(layout, router, trace, redis_url, args, http_port)
                runs.append(row)
                print(f"{layout:13s} {router:12s} cached {lt._fmt(row['cached_fraction'], 3)} (turns >= 2: "
                      f"{lt._fmt(row['cached_fraction_turn2plus'], 3)}) served {row['served']} "
                      f"errors {row['summary']['errors'] or 'none'}", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        if redis is not None:
            redis.stop()
    payload = {"name": args.name, "command": command, "replicas": args.replicas, "users": args.users,
               "turns": args.turns, "concurrency": args.concurrency, "max_tokens": args.max_tokens,
               "server_args": args.server_args, "ray": ray.__version__, "environment": lt.environment(),
               "sessions": [s.conversation_id for s in sessions], "runs": runs}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    (args.out / f"{args.name}.md").write_text(format_markdown(payload))
    print(format_markdown(payload))
    print(f"wrote {args.out / (args.name + '.json')} and {args.out / (args.name + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
