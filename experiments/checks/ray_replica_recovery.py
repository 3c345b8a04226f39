"""A replica's engine loop killed on Ray Serve: how long until Serve notices, until a new replica serves, and what the
clients saw meanwhile.

One process, a local Ray: for each ``--max-attempts`` value a fresh Serve application of ``--replicas`` kvboost
replicas, built the way ``serve run kvboost.serving.ray:app key=value ...`` builds it (Ray's builder call on that
import path, string arguments). Clients send chat requests without pause (``--clients`` in flight) for the whole
run. After ``--warm-s`` seconds one replica's engine loop is killed (``KVBoostReplica.inject_loop_fault``: its next
step raises, as a crashed kernel would); its ``check_health`` then fails every ``--health-period-s`` seconds, and
Serve stops routing to it and starts a new replica. The run goes on ``--after-s`` seconds after the new replica is
in the running set.

Times from the kill (``t = 0``), by polling the ingress's ``/kvboost/routing`` every 0.1 s:
- ``detect_s``: the killed replica has left the running set the router sees (Serve's health check failed it);
- ``replace_s``: the running set has ``--replicas`` members again, the new one among them;
- ``first_ok_new_s``: the first answered request counted on the new replica.
Requests: answered / failed before the kill, between the kill and ``replace_s``, and after; ``retried``: requests the
ingress re-sent to another replica because the dead one refused them unstarted (``max_attempts`` 1: never).

Run::

    python -m experiments.checks.ray_replica_recovery                     # tiny random model, both 3 and 1 attempts
    python -m experiments.checks.ray_replica_recovery --server-args "threads=1"   # the bundled SmolLM2

Writes ``<out>/<name>.json`` and ``<name>.md`` (default ``experiments/results/serving/ray_replica_recovery``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "serving"
DEFAULT_SERVER_ARGS = "model=tiny_random threads=1 warmup=false engine.decode=eager"
APP_IMPORT_PATH = "kvboost.serving.ray:app"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Traffic:
    """``clients`` threads sending chat requests back to back; every request's (sent, done, status) recorded."""

    def __init__(self, base: str, model: str, clients: int, max_tokens: int) -> None:
        import httpx

        self.base, self.model, self.max_tokens = base, model, max_tokens
        self.records: list[tuple[float, float, int]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._clients = [httpx.Client(base_url=base, timeout=120) for _ in range(clients)]
        self._threads = [threading.Thread(target=self._run, args=(c, i), daemon=True)
                         for i, c in enumerate(self._clients)]  # fmt: skip

    def _run(self, client: Any, who: int) -> None:
        i = 0
        while not self._stop.is_set():
            body = {"model": self.model, "max_tokens": self.max_tokens,
                    "messages": [{"role": "user", "content": f"client {who} request {i}: " + "tell me more " * 12}]}
            sent = time.monotonic()
            try:
                status = client.post("/v1/chat/completions", json=body).status_code
            except Exception:  # noqa: BLE001 - a connection error is a failed request
                status = 0
            with self._lock:
                self.records.append((sent, time.monotonic(), status))
            i += 1

    def start(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> list[tuple[float, float, int]]:
        self._stop.set()
        for t in self._threads:
            t.join(180)
        for c in self._clients:
            c.close()
        with self._lock:
            return list(self.records)


def window(records: list[tuple[float, float, int]], start: float, end: float) -> dict[str, int]:
    """Requests sent in [start, end): answered (200) and failed (anything else)."""
    return _count([status for sent, _, status in records if start <= sent < end])


def _count(statuses: list[int]) -> dict[str, int]:
    return {"ok": sum(s == 200 for s in statuses), "failed": sum(s != 200 for s in statuses)}


def windows(records: list[tuple[float, float, int]], t0: float, t_replaced: float, t_end: float) -> dict[str, Any]:
    """Requests done before the kill, in flight at the kill (sent before, done after: one running on the killed
    replica fails, as the loop aborts what it runs), sent between the kill and the replacement, and after."""
    return {"before_kill": _count([s for _, done, s in records if done < t0]),
            "in_flight_at_kill": _count([s for sent, done, s in records if sent < t0 <= done]),
            "kill_to_replaced": window(records, t0, t_replaced), "after_replaced": window(records, t_replaced, t_end)}


def run_once(args: argparse.Namespace, max_attempts: int, port: int, app_name: str) -> dict[str, Any]:
    import httpx
    from ray import serve
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    app_args = {"replicas": str(args.replicas), "router": args.router, "no_redis": "true",
                "num_cpus": str(args.num_cpus), "health_check_period_s": str(args.health_period_s),
                "health_check_timeout_s": str(args.health_timeout_s), "max_attempts": str(max_attempts),
                "server_args": args.server_args}  # fmt: skip
    t_deploy = time.monotonic()
    app = call_user_app_builder_with_args_if_necessary(import_attr(APP_IMPORT_PATH), app_args)
    serve.run(app, name=app_name, route_prefix="/")
    deploy_s = time.monotonic() - t_deploy
    base = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=base, timeout=60)
    model = http.get("/v1/models").json()["data"][0]["id"]
    traffic = Traffic(base, model, args.clients, args.max_tokens).start()
    time.sleep(args.warm_s)
    before = http.get("/kvboost/routing").json()
    victim = before["replicas"][0]
    engines = serve.get_deployment_handle("KVBoostReplica", app_name)
    t0 = time.monotonic()
    engines.options(method_name="inject_loop_fault").remote("recovery drill", route_to=victim).result()
    detect = replace = first_ok_new = None
    fresh = None
    deadline = t0 + args.timeout_s
    while time.monotonic() < deadline:
        now = time.monotonic()
        routing = http.get("/kvboost/routing").json()
        running = routing["replicas"]
        if detect is None and victim not in running:
            detect = now - t0
        if replace is None and victim not in running and len(running) == args.replicas:
            replace = now - t0
            fresh = next(r for r in running if r not in before["replicas"])
        if fresh is not None and first_ok_new is None and routing["served"].get(fresh, 0) > 0:
            first_ok_new = now - t0
        if replace is not None and first_ok_new is not None:
            break
        time.sleep(0.1)
    t_replaced = t0 + replace if replace is not None else time.monotonic()
    time.sleep(args.after_s)
    t_end = time.monotonic()
    records = traffic.stop()
    routing = http.get("/kvboost/routing").json()
    metrics = http.get("/metrics").text
    http.close()
    serve.delete(app_name)
    return {
        "max_attempts": max_attempts, "deploy_s": round(deploy_s, 2), "victim": victim, "new_replica": fresh,
        "detect_s": None if detect is None else round(detect, 2),
        "replace_s": None if replace is None else round(replace, 2),
        "first_ok_new_s": None if first_ok_new is None else round(first_ok_new, 2),
        "requests": windows(records, t0, t_replaced, t_end),
        "retried": routing.get("retried", {}), "served": routing.get("served", {}),
        "metrics_has_new_replica": fresh is not None and f'replica="{fresh}"' in metrics,
        "metrics_has_victim": f'replica="{victim}"' in metrics,
        "statuses": sorted({s for _, _, s in records}),
    }


def format_markdown(payload: dict[str, Any]) -> str:
    lines = ["# A replica's engine loop killed on Ray Serve", "", "```", payload["command"], "```", "",
             f"ray {payload['ray']}, {payload['replicas']} replicas of `{payload['server_args']}`, router "
             f"`{payload['router']}`, {payload['clients']} clients sending back to back, health check every "
             f"{payload['health_period_s']} s; {payload['cpu_count']} cores, load average before the run "
             f"{payload['loadavg_before']} (a shared machine: times are indicative).", "",
             "| max_attempts | detect_s | replace_s | first_ok_new_s | ok / failed before kill | in flight at the kill "
             "| kill -> replaced | after | retried |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for run in payload["runs"]:
        r = run["requests"]
        cell = lambda w: f"{w['ok']} / {w['failed']}"  # noqa: E731
        lines.append(f"| {run['max_attempts']} | {run['detect_s']} | {run['replace_s']} | {run['first_ok_new_s']} | "
                     f"{cell(r['before_kill'])} | {cell(r['in_flight_at_kill'])} | {cell(r['kill_to_replaced'])} | "
                     f"{cell(r['after_replaced'])} | "
                     f"{sum(run['retried'].values())} |")  # fmt: skip
    lines += ["", "Requests as ok / failed. Times in seconds from the kill. `detect_s`: the killed replica left the "
              "running set the router sees (Serve failed its check_health); `replace_s`: a new replica in its place; "
              "`first_ok_new_s`: the new replica answered a request. In flight at the kill: sent before, answered "
              "after (a request running on the killed replica fails: the loop aborts what it runs). `retried`: "
              "requests the ingress re-sent to another replica after the dead one's `503 loop_stopped` "
              "(max_attempts 1: the client gets that 503).", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--router", default="round_robin", choices=("round_robin", "prefix", "events"))
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS)
    p.add_argument("--num-cpus", type=float, default=0.5, help="Ray CPUs per replica")
    p.add_argument("--max-attempts", type=int, nargs="+", default=[3, 1], help="one run per value")
    p.add_argument("--clients", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--health-period-s", type=float, default=1.0)
    p.add_argument("--health-timeout-s", type=float, default=10.0)
    p.add_argument("--warm-s", type=float, default=5.0, help="traffic before the kill")
    p.add_argument("--after-s", type=float, default=5.0, help="traffic after the new replica is in")
    p.add_argument("--timeout-s", type=float, default=180.0, help="give up waiting for the replacement")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--name", default="ray_replica_recovery")
    args = p.parse_args(argv)
    command = shlex.join(["python", "-m", "experiments.checks.ray_replica_recovery",
                          *(sys.argv[1:] if argv is None else argv)])  # fmt: skip
    import ray
    from ray import serve

    loadavg = [round(x, 2) for x in os.getloadavg()]
    port = _free_port()
    ray.init(num_cpus=max(2, int(args.replicas * args.num_cpus) + 1), include_dashboard=False, log_to_driver=False)
    runs = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for i, attempts in enumerate(args.max_attempts):
            run = run_once(args, attempts, port, f"kvboost{i}")
            print(json.dumps(run), flush=True)
            runs.append(run)
    finally:
        serve.shutdown()
        ray.shutdown()
    payload = {"name": args.name, "command": command, "ray": ray.__version__, "replicas": args.replicas,
               "router": args.router, "server_args": args.server_args, "clients": args.clients,
               "max_tokens": args.max_tokens, "health_period_s": args.health_period_s,
               "health_timeout_s": args.health_timeout_s, "cpu_count": os.cpu_count(), "loadavg_before": loadavg,
               "loadavg_after": [round(x, 2) for x in os.getloadavg()], "runs": runs}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(payload, indent=1) + "\n")
    (args.out / f"{args.name}.md").write_text(format_markdown(payload))
    print(format_markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
