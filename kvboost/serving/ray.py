"""Scale-out on Ray Serve: N kvboost replicas behind one OpenAI-compatible ingress, routed by prompt prefix.

::

    ingress (FastAPI, @serve.ingress)  --handle + request router-->  KVBoostReplica x N
      parses /v1/(chat/)completions,                                  InferenceEngine + EngineLoop + the server's
      computes the prompt's chunk keys                                 create_app(), driven in process (ASGI)

- :class:`KVBoostReplica` builds its engine exactly as ``kvboost-server`` does, from the same command line (flags and
  Hydra overrides, :func:`kvboost.serving.cli.compose_config`), and answers through the server's own
  :func:`~kvboost.serving.server.create_app`: the request and error formats, SSE streaming, API keys and tenant
  salts are the server's. Every replica is on the shared Redis tier (``cache=[memory,redis]`` with write-through,
  unless the command line sets the cache), so a prefix computed on one replica is found by the others: each replica
  looks for the entries the others wrote every ``--refresh-s`` seconds (the engine loop's ``refresh_shared_s``).
- The ingress forwards each HTTP request to a replica through a streaming handle. For the two generation routes it
  passes the prompt's chunk keys (:func:`kvboost.serving.routing.text_chunk_keys` over the messages or prompt, salted
  by the API key and ``cache_salt``) as the keyword ``route_keys``.
- :class:`PrefixAwareRouter` (Ray Serve's ``RequestRouter`` API) ranks the replicas with
  :func:`kvboost.serving.routing.choose_replica`: longest prefix sent there before, unless that replica's queue is
  ``max_imbalance`` longer than the shortest; ties and misses go to the least loaded. :class:`RoundRobinRouter` is
  the baseline. A router lives in the process that holds the handle (the ingress replica): with several ingress
  replicas each keeps its own index.
- :class:`EventsRouter` (``--router events``) ranks by what the replicas' caches *hold*, not by where requests were
  sent: every replica publishes its KV events (``engine.kv_events``, an ephemeral port each, with a replay socket;
  :data:`EVENTS_ARGV`) and reports the two addresses in its replica metadata (``record_replica_metadata``; the
  routing stats on a Ray without it); the router subscribes to each (:class:`~kvboost.cache.events.
  KVEventSubscriber`, the batches so far replayed from sequence 0), applies what arrived before each decision to a
  :class:`~kvboost.serving.event_routing.ClusterKVIndex`, and ranks with :class:`~kvboost.serving.event_routing.
  EventRouter` (longest chain of the request's chunks held by the replica, a block in the shared Redis tier counting
  for every replica; the same ``max_imbalance`` guard). For that the ingress passes the request's token ids, chunk
  spans and tenant salt (:func:`request_route_tokens`: the served model's tokenizer and chat template and the
  engine's chunker, loaded once in the ingress; :class:`~kvboost.serving.event_routing.RequestTokenizer`).
- ``GET /kvboost/routing`` on the ingress: the router name, how many generation requests each replica answered,
  how many requests were re-sent to another replica (below) and the replicas routed to now.
- ``GET /metrics`` on the ingress: every replica's ``/metrics``, each series with a ``replica`` label added, plus the
  ingress's own series (:mod:`kvboost.serving.ray_metrics`; sum with ``sum without (replica) (...)`` in PromQL),
  fetched by requests the router sends to one given replica each (``route_to``).
- Healing: every replica's ``check_health`` (:func:`replica_health`) raises when its engine loop failed, stopped or
  does not answer a probe, so Serve stops routing to the replica and starts another; the router forgets a replica
  when Ray's controller drops it from the running set. Until then a request the broken replica refuses unstarted
  (the server's ``503 loop_stopped``) is re-sent by the ingress to another replica (``route_avoid``, at most
  :data:`MAX_ATTEMPTS` tries), so clients see no error. ``KVBoostReplica.inject_loop_fault`` kills a replica's
  loop on purpose (fault drills, ``experiments/checks/ray_replica_recovery.py``).

Run (one machine: a local Ray; a cluster: ``--address auto`` on its head node, see the README)::

    kvboost-ray-serve --replicas 2 --router prefix --redis-url redis://127.0.0.1:6379/0  # python -m kvboost.serving.ray
    kvboost-ray-serve --replicas 2 --router round_robin --no-redis model=tiny_random threads=1
    kvboost-ray-serve --replicas 2 --router events --redis-url redis://127.0.0.1:6379/0

Everything not an option of this entry (``--dtype``, ``--max-running``, ``recompute=...``) goes to every replica's
``kvboost-server`` command line. The entry prints that command line with its secrets as ``***`` and filters them out
of its log lines (:mod:`kvboost.serving.redact`).

As a Serve application (``serve run``, ``serve deploy``, KubeRay's RayService): :data:`app` (= :func:`app_builder`,
Ray's application-builder pattern: a function of the ``args`` that returns the bound ingress)::

    serve run kvboost.serving.ray:app replicas=2 router=events no_redis=true "server_args=model=tiny_random threads=1"
    kvboost-ray-serve --print-serve-config > serve.yaml && serve run serve.yaml   # two models, replicas, routers

Ray is an optional dependency (extra ``cluster``); this module imports without it, and :func:`main` / the
deployments say how to install it.
"""

# No `from __future__ import annotations`: FastAPI must see the ingress route's real `Request` annotation (Ray Serve
# rebuilds the class, and string annotations then fail to resolve: every request would be answered 422).
import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Collection, Hashable, Sequence
from typing import Any

from kvboost.serving.event_routing import EventRouter, RequestTokenizer
from kvboost.serving.ray_metrics import HUB, RouterHub, ingress_families, merge_metrics  # noqa: F401 - re-exported
from kvboost.serving.ray_metrics import hub as _hub
from kvboost.serving.routing import (
    DEFAULT_CHUNK_CHARS,
    DEFAULT_INDEX_CAPACITY,
    DEFAULT_MAX_IMBALANCE,
    PrefixRouter,
    text_chunk_keys,
)

log = logging.getLogger("kvboost.serving.ray")

try:  # Ray is optional: the pure parts below (the ASGI bridge, the keys, the ranking) work without it
    import ray
    from ray import serve
    from ray.serve.request_router import RequestRouter
except ImportError:  # pragma: no cover - depends on the environment
    ray = serve = RequestRouter = None  # type: ignore[assignment]

RAY_HINT = ("Ray Serve is not installed: pip install -e '.[cluster]' (ray[serve]; the custom request router API "
            "is alpha and was tested with ray 2.60)")
ROUTE_KEYS = "route_keys"
ROUTE_TO = "route_to"  # a request for one given replica (the ingress's /metrics fan-out)
ROUTE_AVOID = "route_avoid"  # a retry: the replicas that refused the request before
#: how many replicas the ingress tries for one request whose replica refused it unstarted (its engine loop stopped)
MAX_ATTEMPTS = 3
DEFAULT_REFRESH_S = 0.5
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: Serve's health-check defaults (seconds); the replica's own probe (:func:`replica_health`) waits 20 s, within them
DEFAULT_HEALTH_PERIOD_S = 10.0
DEFAULT_HEALTH_TIMEOUT_S = 30.0
ROUTERS = ("prefix", "round_robin", "events")
#: the replicas' KV-event sockets for the events router: an ephemeral port each (reported to the router)
EVENTS_ARGV = ("engine.kv_events.enabled=true", "engine.kv_events.endpoint=tcp://*:*",
               "engine.kv_events.replay_endpoint=tcp://*:*")  # topic: kv@<replica id>@<model>, llm-d's form
# hop-by-hop / length headers: the ingress re-streams the body, so it sets its own framing
_DROP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection"})


def require_ray() -> None:
    if ray is None:
        raise ImportError(RAY_HINT)


# ====================================================================================== ASGI bridge (no Ray)
async def call_asgi(app: Any, method: str, path: str, *, query: bytes = b"", headers: Sequence[tuple[str, str]] = (),
                    body: bytes = b"") -> AsyncIterator[dict[str, Any] | bytes]:  # fmt: skip
    """Serve one HTTP request with an ASGI ``app`` in this process: yields ``{"status", "headers"}`` first, then
    the body's pieces as the app sends them (SSE events arrive one by one, not buffered). Closing the generator
    early (the client left) tells the app ``http.disconnect``, which cancels the request in the engine loop."""
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method.upper(), "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": query, "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80),
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]}  # fmt: skip
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    request_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal request_sent
        if not request_sent:
            request_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()  # the app asks again only to learn about a disconnect
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        await messages.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    started = False
    try:
        while True:
            message = await messages.get()
            if message is None:  # the app returned (or failed) without finishing the body
                if not started:
                    exc = task.exception() if not task.cancelled() else None
                    yield {"status": 500, "headers": [("content-type", "application/json")]}
                    yield json.dumps({"error": {"message": f"replica failed: {exc!r}", "type": "server_error",
                                                "param": None, "code": None}}).encode()  # fmt: skip
                return
            if message["type"] == "http.response.start":
                started = True
                yield {"status": message["status"],
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if task.done() and not task.cancelled() and task.exception() is not None:  # retrieved: logged once, here
            log.debug("the app raised after answering: %r", task.exception())
        if not task.done():
            # let the app see the disconnect and clean up (cancel the engine request); do not wait on it forever
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), timeout=5.0)


def refusal_reason(status: int, body: bytes) -> str | None:
    """The error code of a replica's answer that says the request never started, so another replica may serve it
    (``loop_stopped``: the server's 503 when its engine loop is not running); None for any other answer (an error
    the request itself caused, or one after it ran, is the client's to see)."""
    if status != 503:
        return None
    try:
        code = json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None
    return code if code == "loop_stopped" else None


# ================================================================================= keys and ranking (no Ray)
def request_route_keys(path: str, body: bytes, authorization: str | None,
                       chunk_chars: int = DEFAULT_CHUNK_CHARS) -> list[str] | None:  # fmt: skip
    """Chunk keys of a generation request's prompt, salted by its API key and ``cache_salt`` (the server salts its
    cache the same way, so two tenants never share a route); None when the body is not a generation request the
    router can read (it then goes to the least-loaded replica and the replica answers the error)."""
    if path not in GENERATION_PATHS:
        return None
    try:
        data = json.loads(body)
        prompt = data["messages"] if path.endswith("chat/completions") else data["prompt"]
        tenant = hashlib.sha256((authorization or "").encode()).hexdigest()[:16]
        return text_chunk_keys(prompt, chunk_chars, salt=f"{tenant}|{data.get('cache_salt') or ''}")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


#: the published salt of a request whose salt the router cannot hash (no key): matches no replica's blocks
UNKNOWN_SALT = "kvboost-salt:unknown"


def request_route_tokens(path: str, body: bytes, authorization: str | None, tokenize: RequestTokenizer,
                         tenancy: Any = None, salt_key: str | bytes | None = None) -> dict[str, Any] | None:  # fmt: skip
    """What the events router matches: the prompt's token ids and chunk spans as the engine computes them, and the
    cache salt the server derives (``tenancy``: a :class:`kvboost.serving.tenancy.Tenancy` with the replicas' keys
    and secret; None: the open tenant) in the form the replicas publish it (:func:`kvboost.cache.events.salt_tag`
    with their ``kv_events.salt_key``; without the key a salted request matches nothing). None when the body is not
    a generation request the router can read, or its key is unknown (the replica answers the error)."""
    if path not in GENERATION_PATHS:
        return None
    try:
        data = json.loads(body)
        chat = path.endswith("chat/completions")
        prompt = data["messages"] if chat else data["prompt"]
        if chat:  # the server renders the plain messages (content parts joined): the same text here
            from kvboost.serving.protocol import ChatCompletionRequest

            prompt = ChatCompletionRequest(**data).plain_messages()
        ids, spans = tokenize(prompt, chat=chat)
        from kvboost.serving.tenancy import OPEN_TENANT

        tenant = tenancy.authenticate(authorization) if tenancy is not None else OPEN_TENANT
        salt = tenant.cache_salt(data.get("cache_salt"))
    except Exception:  # noqa: BLE001 - anything unreadable is the replica's to refuse, with its own error
        return None
    if salt:
        from kvboost.cache.events import salt_tag

        salt = salt_tag(salt, salt_key) if salt_key else UNKNOWN_SALT
    return {"ids": ids, "spans": [(sp.start, sp.end) for sp in spans], "salt": salt}


def load_request_tokenizer(cfg: dict[str, Any]) -> RequestTokenizer:
    """The served model's tokenizer and the engine's chunker, from a replica's composed config (the model's
    weights are not loaded: a random-init model uses the bundled tokenizer, a named one its own)."""
    from transformers import AutoTokenizer

    from kvboost.models.loading import bundled_model_dir, resolve_model_path

    model_cfg = dict(cfg.get("model") or {})
    path = bundled_model_dir() if model_cfg.get("random_init") else resolve_model_path(model_cfg.get("name_or_path"))
    engine = dict(cfg.get("engine") or {})
    return RequestTokenizer.from_config(AutoTokenizer.from_pretrained(path), cfg.get("chunker", "fixed"),
                                        engine.get("chat"), published_block_size(engine))  # fmt: skip


def published_block_size(engine_cfg: dict[str, Any]) -> int | None:
    """The block size the replicas publish (``engine.kv_events.block_size``; unset: the KV pool's ``kv.block_size``,
    16 by default; ``"chunk"``: None, one block per chunk), as :class:`kvboost.cache.events.KVEventSink` resolves
    it for a pool-backed first tier."""
    from kvboost.cache.events import DEFAULT_EVENT_BLOCK_SIZE

    size = (engine_cfg.get("kv_events") or {}).get("block_size")
    if size == "chunk":
        return None
    return int(size or (engine_cfg.get("kv") or {}).get("block_size") or DEFAULT_EVENT_BLOCK_SIZE)


class _ReplicaFeed:
    """The ``index`` a :class:`~kvboost.cache.events.KVEventSubscriber` applies batches to, forwarding them to the
    cluster index under one replica's name."""

    def __init__(self, index: Any, replica: Hashable) -> None:
        self.index, self.replica = index, replica

    def apply(self, batch: Any) -> None:
        self.index.apply(self.replica, batch)


def connect_events(index: Any, replica: Hashable, endpoint: str, replay_endpoint: str | None,
                   topic: str = "") -> Any:  # fmt: skip
    """A subscriber to one replica's KV events feeding ``index`` (a ClusterKVIndex) under ``replica``, caught up
    with what the replay buffer holds (the replica published its opening snapshot before anyone listened)."""
    from kvboost.cache.events import KVEventSubscriber

    sub = KVEventSubscriber(endpoint, replay_endpoint=replay_endpoint, topic=topic)
    sub.index = _ReplicaFeed(index, replica)  # type: ignore[assignment]
    for seq, batch in sub.request_replay(0):
        if seq > sub.last_seq:
            sub._apply(seq, batch)
    return sub


def reachable(endpoint: str, host: str) -> str:
    """A bound address (``tcp://0.0.0.0:port``, ``tcp://*:port``) as another process reaches it on ``host``."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host}:{endpoint[len(wildcard):]}"
    return endpoint


class RouteBook:
    """A router's state, Ray-free: the policy (``prefix``, ``round_robin`` or ``events``), the prefix index per
    replica (``prefix``), the KV-event subscribers and the index they feed (``events``), and the requests each
    replica has in flight (sent, not completed) as this router counted them."""

    def __init__(self, policy: str = "prefix", *, max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                 capacity: int = DEFAULT_INDEX_CAPACITY) -> None:  # fmt: skip
        if policy not in ROUTERS:
            raise ValueError(f"unknown router {policy!r}; choose one of {list(ROUTERS)}")
        self.policy = policy
        self.prefix = PrefixRouter(capacity=capacity, max_imbalance=max_imbalance)
        self.events = EventRouter(max_imbalance=max_imbalance)
        self.subscribers: dict[Hashable, Any] = {}
        self.in_flight: Counter[Hashable] = Counter()
        self._turn = 0

    # -------------------------------------------------------------- events policy
    def subscribe(self, replica: Hashable, info: dict[str, Any] | None) -> bool:
        """Follow ``replica``'s KV events (``info``: ``{"endpoint", "replay_endpoint", "topic"}`` as the replica
        reported them), once; False when there is nothing to follow (yet)."""
        if replica in self.subscribers:
            return True
        if not info or not info.get("endpoint"):
            return False
        try:
            self.subscribers[replica] = connect_events(self.events.index, replica, info["endpoint"],
                                                       info.get("replay_endpoint"), info.get("topic", ""))
        except Exception as exc:  # noqa: BLE001 - a replica we cannot follow is ranked as holding nothing
            log.warning("cannot follow the KV events of replica %s: %r", replica, exc)
            return False
        return True

    def drain(self) -> int:
        """Apply every batch that arrived from every followed replica (non-blocking); returns how many."""
        applied = 0
        for replica, sub in list(self.subscribers.items()):
            try:
                applied += sub.poll(0)
            except Exception as exc:  # noqa: BLE001 - a broken stream: rebuild it from scratch next time
                log.warning("KV events of replica %s failed: %r", replica, exc)
                self._unsubscribe(replica)
        return applied

    def _unsubscribe(self, replica: Hashable) -> None:
        sub = self.subscribers.pop(replica, None)
        if sub is not None:
            with contextlib.suppress(Exception):
                sub.close()
        self.events.forget(replica)

    def queue_len(self, replica: Hashable, reported: int | None) -> int:
        """The larger of what Ray's queue-length cache says (``reported``; None = unknown) and our own count."""
        return max(self.in_flight[replica], reported or 0)

    def rank(self, keys: Sequence[str] | dict[str, Any] | None, replicas: Sequence[Hashable],
             reported: dict[Hashable, int | None] | None = None) -> list[Hashable]:  # fmt: skip
        """Replicas best first. ``prefix``: :func:`~kvboost.serving.routing.choose_replica`'s ranking (the keys are
        recorded on the first, where the request almost always goes); ``round_robin``: the next in turn first;
        ``events``: the followed replicas' events applied first, then :class:`~kvboost.serving.event_routing.
        EventRouter`'s ranking (``keys``: :func:`request_route_tokens`' dict; None ranks by load only)."""
        replicas = sorted(replicas, key=str)  # Ray's candidate order varies; rotation needs a fixed one
        if not replicas:
            return []
        if self.policy == "round_robin":
            start = self._turn % len(replicas)
            self._turn += 1
            return replicas[start:] + replicas[:start]
        queues = {r: self.queue_len(r, (reported or {}).get(r)) for r in replicas}
        if self.policy == "events":
            self.drain()
            tokens = keys if isinstance(keys, dict) else {}
            decision = self.events.choose(tokens.get("ids"), tokens.get("spans"), replicas, queues,
                                          tokens.get("salt", ""))  # fmt: skip
            return list(decision.ranking)
        decision = self.prefix.choose(list(keys or ()), replicas, queues)
        return list(decision.ranking)

    def sent(self, replica: Hashable) -> None:
        self.in_flight[replica] += 1

    def completed(self, replica: Hashable) -> None:
        if self.in_flight[replica] > 0:
            self.in_flight[replica] -= 1

    def forget(self, replica: Hashable) -> None:
        self.in_flight.pop(replica, None)
        self.prefix.forget(replica)
        self._unsubscribe(replica)

    def retain(self, replicas: Collection[Hashable]) -> list[Hashable]:
        """Forget every replica not in ``replicas`` (the running set: a replaced replica's cache died with it, and
        its replacement starts empty under a new id); returns those forgotten."""
        gone = [r for r in {*self.in_flight, *self.prefix.indexes, *self.subscribers} if r not in replicas]
        for replica in gone:
            self.forget(replica)
        return gone

    def close(self) -> None:
        for replica in list(self.subscribers):
            self._unsubscribe(replica)


# ============================================================================================ entry arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvboost-ray-serve",
        description="kvboost replicas on Ray Serve behind one OpenAI-compatible ingress with a prefix-aware router "
                    "(by where requests were sent, or by the replicas' KV events). "
                    "Other arguments (flags and KEY=VALUE overrides) go to every replica's kvboost-server command line.",
    )  # fmt: skip
    p.add_argument("--replicas", type=int, default=2, help="engine replicas (default 2)")
    p.add_argument("--router", choices=ROUTERS, default="prefix")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address of Serve's proxy (0.0.0.0 on a cluster)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", default=None, help="Ray cluster address (auto = the running cluster; default: a "
                   "local Ray, or the cluster when RAY_ADDRESS is set)")  # fmt: skip
    p.add_argument("--redis-url", default=os.environ.get("KVBOOST_REDIS_URL", "redis://127.0.0.1:6379/0"),
                   help="the shared Redis tier every replica uses (also $KVBOOST_REDIS_URL)")  # fmt: skip
    p.add_argument("--redis-namespace", default="kvboost")
    p.add_argument("--no-redis", action="store_true", help="memory tier only (each replica its own cache)")
    p.add_argument("--refresh-s", type=float, default=DEFAULT_REFRESH_S,
                   help="seconds between a replica's looks for entries other replicas wrote to Redis (0: never)")
    p.add_argument("--num-cpus", type=float, default=1.0, help="Ray CPUs reserved per replica (default 1)")
    p.add_argument("--num-gpus", type=float, default=0.0, help="Ray GPUs per replica (1 on a GPU cluster)")
    p.add_argument("--max-ongoing", type=int, default=64, help="requests in flight per replica (default 64)")
    p.add_argument("--max-imbalance", type=int, default=DEFAULT_MAX_IMBALANCE,
                   help="prefix / events routers: skip a replica whose queue exceeds the shortest by more (default 4)")
    p.add_argument("--chunk-chars", type=int, default=DEFAULT_CHUNK_CHARS, help="characters per routing chunk")
    p.add_argument("--app-name", default="kvboost")
    p.add_argument("--health-check-period-s", type=float, default=DEFAULT_HEALTH_PERIOD_S,
                   help="seconds between Serve's check_health calls on each replica (default 10)")
    p.add_argument("--health-check-timeout-s", type=float, default=DEFAULT_HEALTH_TIMEOUT_S,
                   help="a check_health taking longer fails (default 30)")
    p.add_argument("--max-attempts", type=int, default=MAX_ATTEMPTS,
                   help="replicas the ingress tries for a request refused unstarted (a dead engine loop; default 3, "
                        "1: never re-send)")  # fmt: skip
    p.add_argument("--print-serve-config", action="store_true",
                   help="print the example Ray Serve config file (serve run / serve deploy / KubeRay) and exit")
    return p


def replica_argv(server_argv: Sequence[str], *, redis_url: str | None, namespace: str = "kvboost",
                 salt_secret: str | None = None, events: bool = False) -> list[str]:  # fmt: skip
    """Every replica's ``kvboost-server`` command line: the user's, plus the shared Redis tier (unless the cache is
    set there already) and one salt secret for all (tenant salts must agree for replicas to share entries);
    ``events``: KV events on, on ephemeral ports (:data:`EVENTS_ARGV`), unless the command line sets them."""
    argv = list(server_argv)
    if events and not any(a.split("=", 1)[0].lstrip("+~").startswith("engine.kv_events") for a in argv):
        argv += list(EVENTS_ARGV)
    sets_cache = any(a.split("=", 1)[0].lstrip("+~").startswith("cache") for a in argv if "=" in a and
                     not a.startswith("-")) or "--disk-cache-dir" in argv  # fmt: skip
    if redis_url and not sets_cache:
        # write-through: every new entry reaches Redis at once, so another replica finds it (without it an entry
        # goes down only when evicted from this replica's memory, and the replicas share almost nothing)
        argv += ["cache=[memory,redis]", f"cache.1.url={redis_url}", f"cache.1.namespace={namespace}",
                 "cache.1.write_through=true"]
    if salt_secret and "--salt-secret" not in argv:
        argv += ["--salt-secret", salt_secret]
    return argv


def _override_keys(server_argv: Sequence[str]) -> set[str]:
    return {a.split("=", 1)[0].lstrip("+~") for a in server_argv if "=" in a and not a.startswith("-")}


def replica_events_argv(server_argv: Sequence[str], node_ip: str) -> list[str]:
    """A Ray replica's command line when it publishes KV events (``engine.kv_events.enabled=true``): its sockets
    bind this node's address (``node_ip``; loopback, the default, is unreachable from a router on another node;
    not every interface) unless the host is given, and -- unless the endpoint is given -- an ephemeral port of its
    own (``tcp://*:*``): replicas share a node and one command line, so the configured default port (5557) would
    be bound by the first replica only. The replica reports the bound addresses in its metadata (and log)."""
    argv = list(server_argv)
    if not any(a.lower().lstrip("+~") == "engine.kv_events.enabled=true" for a in argv):
        return argv
    named = _override_keys(argv)
    if "engine.kv_events.host" not in named and "--kv-events-host" not in argv:
        argv.append(f"engine.kv_events.host={node_ip}")
    if "engine.kv_events.endpoint" not in named:
        argv.append("engine.kv_events.endpoint=tcp://*:*")
    return argv


def _has_api_keys(server_argv: Sequence[str]) -> bool:
    return "--api-key" in server_argv or bool(os.environ.get("KVBOOST_API_KEYS"))


# =========================================================================================== Ray deployments
if ray is not None:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    # on_request_completed is a later addition to the (alpha) RequestRouter API than the class itself
    _HAS_COMPLETION_HOOK = hasattr(RequestRouter, "on_request_completed")

    class _KVBoostRouter(RequestRouter):
        """Ray Serve adapter around :class:`RouteBook` (``policy`` set by the subclass)."""

        policy = "prefix"

        def initialize_state(self, max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                             capacity: int = DEFAULT_INDEX_CAPACITY, **_: Any) -> None:  # fmt: skip
            self.book = RouteBook(self.policy, max_imbalance=max_imbalance, capacity=capacity)

        def _book(self) -> RouteBook:
            if not hasattr(self, "book"):  # initialize_state is called only when the config has kwargs
                self.initialize_state()
            return self.book

        async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None) -> list[list]:
            if not candidate_replicas:
                return []
            kwargs = (pending_request.kwargs or {}) if pending_request is not None else {}
            keys = kwargs.get(ROUTE_KEYS)
            by_id = {r.replica_id: r for r in candidate_replicas}
            if not _hub().replicas():  # before Ray's first announcement (update_replicas), which is the authority
                _hub().seen([rid.unique_id for rid in by_id])
            avoid = set(kwargs.get(ROUTE_AVOID) or ())
            if avoid:  # a retry: any replica but those that refused it (all of them refused: try them again)
                by_id = {rid: r for rid, r in by_id.items() if rid.unique_id not in avoid} or by_id
            target = kwargs.get(ROUTE_TO)
            if target is not None:  # the ingress asks one given replica (its /metrics fan-out)
                chosen = [r for rid, r in by_id.items() if rid.unique_id == target]
                if pending_request is not None:
                    pending_request.routing_context.should_backoff = True
                return [chosen] if chosen else []
            book = self._book()
            if book.policy == "events":
                for rid, replica in by_id.items():
                    book.subscribe(rid, _events_info(replica))
            cache = getattr(self, "replica_queue_len_cache", None)
            reported = {rid: cache.get(rid) if cache is not None else None for rid in by_id}
            if pending_request is not None:
                # every replica full: back off between rounds instead of spinning
                pending_request.routing_context.should_backoff = True
            # one replica per rank: Ray tries them in this order (the next only if one is full)
            return [[by_id[rid]] for rid in self._book().rank(keys, list(by_id), reported)]

        def on_send_request(self, replica_id: Any) -> None:
            super().on_send_request(replica_id)
            if _HAS_COMPLETION_HOOK:  # without the hook a count would only grow: use Ray's queue lengths alone
                self._book().sent(replica_id)

        def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
            self._book().completed(replica_id)

        def on_replica_actor_died(self, replica_id: Any) -> None:
            super().on_replica_actor_died(replica_id)
            self._book().forget(replica_id)
            _hub().gone(replica_id.unique_id)

        def update_replicas(self, replicas: list) -> None:
            """Ray's controller announces the running set (a replica that failed its health check is left out of
            it, and its replacement added once started): the book and the hub forget the ones gone."""
            super().update_replicas(replicas)
            current = {r.replica_id for r in replicas}
            self._book().retain(current)
            _hub().sync([rid.unique_id for rid in current])

    def _events_info(replica: Any) -> dict[str, Any] | None:
        """The KV-event addresses a replica reported (its metadata on Ray >= 2.5x, else its routing stats)."""
        for attr in ("replica_metadata", "routing_stats"):
            with contextlib.suppress(Exception):
                info = (getattr(replica, attr, None) or {}).get("kv_events")
                if info:
                    return info
        return None

    class PrefixAwareRouter(_KVBoostRouter):
        """Longest prefix sent before, balanced against queue length (:mod:`kvboost.serving.routing`)."""

        policy = "prefix"

    class RoundRobinRouter(_KVBoostRouter):
        """Each replica in turn (the baseline)."""

        policy = "round_robin"

    class EventsRouter(_KVBoostRouter):
        """Longest prefix the replica's cache holds, from its KV events (:mod:`kvboost.serving.event_routing`),
        balanced against queue length."""

        policy = "events"

    ROUTER_CLASSES = {"prefix": PrefixAwareRouter, "round_robin": RoundRobinRouter, "events": EventsRouter}

    @serve.deployment
    class KVBoostReplica:
        """One engine, its loop and the server's app, built from a ``kvboost-server`` command line."""

        def __init__(self, server_argv: list[str], refresh_s: float = DEFAULT_REFRESH_S) -> None:
            from kvboost.serving.cli import build_parser as server_parser
            from kvboost.serving.cli import build_served, compose_config, tenant_keys

            server_argv = replica_events_argv(server_argv, ray.util.get_node_ip_address())
            context = serve.get_replica_context()
            self.replica = context.replica_id.unique_id if context is not None else "local"
            if "--kv-events-pod" not in server_argv:  # the topic kv@<pod>@<model> names this replica
                server_argv = [*server_argv, "--kv-events-pod", self.replica]
            args = server_parser().parse_args(server_argv)
            self.engine, self.loop, self.app = build_served(args, compose_config(args), *tenant_keys(args),
                                                            refresh_shared_s=refresh_s)  # fmt: skip
            self.kv_events = None
            publisher = getattr(getattr(self.engine, "kv_events", None), "publisher", None)
            if getattr(publisher, "endpoint", None):  # the events router subscribes here (bound: a wildcard address)
                host = ray.util.get_node_ip_address()
                self.kv_events = {"endpoint": reachable(publisher.endpoint, host), "topic": getattr(publisher, "topic", ""),
                                  "replay_endpoint": reachable(publisher.replay_endpoint, host)
                                  if publisher.replay_endpoint else None}  # fmt: skip
                log.info("replica %s publishes KV events on %s (replay %s, topic %s)", self.replica,
                         self.kv_events["endpoint"], self.kv_events["replay_endpoint"], self.kv_events["topic"])

        async def check_health(self) -> None:
            """Ray Serve calls it every ``health_check_period_s``: raising (the engine loop died, stopped or hangs,
            :func:`replica_health`) makes Serve replace this replica and stop routing to it."""
            await replica_health(self.loop)

        def inject_loop_fault(self, reason: str = "injected fault", route_to: str | None = None) -> str:
            """Chaos hook (operators' and tests' fault drills; reachable through a deployment handle only, never
            over HTTP; ``route_to``: the replica's id, for the router): the engine loop's next step raises
            ``RuntimeError(reason)``, so the loop dies as it would of a crashed kernel; ``check_health`` then fails
            and Serve replaces this replica. Returns this replica's id."""
            _fail_next_step(self.loop, reason)
            return self.replica

        def record_replica_metadata(self) -> dict[str, Any]:
            """Static metadata the request router reads (Ray >= 2.5x): where this replica's KV events are."""
            return {"kv_events": self.kv_events} if self.kv_events else {}

        def record_routing_stats(self) -> dict[str, Any]:
            """The same, through routing stats (Rays without replica metadata)."""
            return self.record_replica_metadata()

        async def handle(self, request: dict[str, Any], route_keys: Any = None, route_to: str | None = None,
                         route_avoid: Sequence[str] | None = None) -> AsyncIterator[Any]:  # fmt: skip
            """Stream one HTTP request through the server's app (``route_keys`` / ``route_to`` / ``route_avoid``
            are for the router only)."""
            first = True
            async for part in call_asgi(self.app, request["method"], request["path"], query=request["query"],
                                        headers=request["headers"], body=request["body"]):  # fmt: skip
                if first:
                    part = {**part, "replica": self.replica}
                    first = False
                yield part

        def stats(self) -> dict[str, Any]:
            return {**self.loop.stats(), "replica": self.replica}

        def __del__(self) -> None:  # Serve calls it when the replica stops: finish the loop, flush the tiers
            loop, engine = getattr(self, "loop", None), getattr(self, "engine", None)
            if loop is not None:
                loop.shutdown()
            if engine is not None:
                engine.close()

    ingress_app = FastAPI(title="kvboost on Ray Serve", docs_url=None, redoc_url=None)

    @serve.deployment(ray_actor_options={"num_cpus": 0})
    @serve.ingress(ingress_app)
    class OpenAIIngress:
        """Forwards every HTTP request to a replica; generation requests carry their prompt's chunk keys."""

        def __init__(self, replicas: Any, router: str = "prefix", chunk_chars: int = DEFAULT_CHUNK_CHARS,
                     server_argv: list[str] | None = None, max_attempts: int = MAX_ATTEMPTS) -> None:  # fmt: skip
            self.replicas = replicas.options(stream=True)
            self.max_attempts = max(1, int(max_attempts))
            self.router = router
            self.chunk_chars = chunk_chars
            self.served: Counter[str] = Counter()
            self.retried: Counter[str] = Counter()  # requests re-sent to another replica, by the refusal's code
            self.tokenize: RequestTokenizer | None = None
            self.tenancy = None
            self.salt_key: str | None = None
            if router == "events":  # the events router matches token ids: the replicas' tokenizer and chunker
                from kvboost.serving.cli import build_parser as server_parser
                from kvboost.serving.cli import compose_config, tenant_keys
                from kvboost.serving.tenancy import Tenancy

                args = server_parser().parse_args(list(server_argv or []))
                cfg = compose_config(args)
                self.tokenize = load_request_tokenizer(cfg)
                self.salt_key = ((cfg.get("engine") or {}).get("kv_events") or {}).get("salt_key")
                keys, secret = tenant_keys(args)
                self.tenancy = Tenancy(keys, secret) if keys else None

        @ingress_app.get("/kvboost/routing")
        def routing(self) -> dict[str, Any]:
            return {"router": self.router, "served": dict(self.served), "retried": dict(self.retried),
                    "replicas": _hub().replicas()}

        @ingress_app.get("/metrics")
        async def metrics(self, request: Request) -> Any:
            """Every replica's /metrics, a ``replica`` label on each series (:func:`merge_metrics`)."""
            from fastapi.responses import PlainTextResponse

            if not _hub().replicas():  # no request routed yet: one through the router shows it the replicas
                with contextlib.suppress(Exception):
                    await self._fetch(request, "/health", None)
            texts, failed = {}, []
            for rid in _hub().replicas():
                try:
                    status, body = await asyncio.wait_for(self._fetch(request, "/metrics", rid), timeout=10)
                except Exception as exc:  # noqa: BLE001 - a replica gone or busy: the others still answer
                    status, body = 0, repr(exc).encode()
                if status == 200:
                    texts[rid] = body.decode()
                else:
                    failed.append(f"# kvboost: replica {rid} did not answer /metrics ({status}: {body[:200]!r})\n")
                    log.warning("replica %s did not answer /metrics (%s)", rid, status)
            merged = merge_metrics(texts, ingress_families(len(texts), len(failed), self.retried))
            return PlainTextResponse("".join(failed) + merged,
                                     media_type="text/plain; version=0.0.4; charset=utf-8")  # fmt: skip

        async def _fetch(self, request: Request, path: str, replica: str | None) -> tuple[int, bytes]:
            message = {"method": "GET", "path": path, "query": b"", "headers": list(request.headers.items()),
                       "body": b""}  # fmt: skip
            stream = self.replicas.handle.remote(message, **({ROUTE_TO: replica} if replica else {}))
            start, parts = None, []
            async for part in stream:
                if start is None:
                    start = part
                else:
                    parts.append(part)
            return (start or {}).get("status", 502), b"".join(parts)

        @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
        async def forward(self, path: str, request: Request) -> Any:
            body = await request.body()
            path = "/" + path
            if self.tokenize is not None:
                keys = request_route_tokens(path, body, request.headers.get("authorization"), self.tokenize,
                                            self.tenancy, self.salt_key)  # fmt: skip
            else:
                keys = request_route_keys(path, body, request.headers.get("authorization"), self.chunk_chars)
            message = {"method": request.method, "path": path, "query": request.url.query.encode("latin-1"),
                       "headers": list(request.headers.items()), "body": body}  # fmt: skip
            avoid: list[str] = []
            for attempt in range(1, self.max_attempts + 1):
                stream = self.replicas.handle.remote(message, **{ROUTE_KEYS: keys},
                                                     **({ROUTE_AVOID: list(avoid)} if avoid else {}))  # fmt: skip
                buffered: bytes | None = None
                try:
                    start = await stream.__anext__()
                except Exception as exc:  # noqa: BLE001 - a replica that died or failed to start
                    start, reason = None, "replica_unavailable"
                    error = f"no replica answered: {exc}"
                else:
                    reason = None
                    if start["status"] == 503:  # a short error body: read it to see whether the request ran
                        buffered = b"".join([part async for part in stream])
                        reason = refusal_reason(start["status"], buffered)
                if reason is None or attempt == self.max_attempts:
                    break
                # refused before it started (the replica's engine loop stopped, or the replica is gone): nothing
                # ran, so another replica may serve it; Serve replaces the broken one once check_health fails
                self.retried[reason] += 1
                if start is not None and start.get("replica"):
                    avoid.append(start["replica"])
                log.warning("ingress: a replica refused a request unstarted (%s); trying another (attempt %d)",
                            reason, attempt + 1)  # fmt: skip
            if start is None:
                return JSONResponse({"error": {"message": error, "type": "server_error", "param": None,
                                               "code": "replica_unavailable"}}, status_code=503)  # fmt: skip
            if path in GENERATION_PATHS and reason is None:  # count the work, not /v1/models, /health, refusals
                self.served[start.get("replica", "?")] += 1
            headers = {k: v for k, v in start["headers"] if k.lower() not in _DROP_HEADERS}
            if buffered is not None:
                return Response(buffered, status_code=start["status"], headers=headers)

            async def rest() -> AsyncIterator[bytes]:
                try:
                    async for part in stream:
                        yield part
                finally:
                    stream.cancel()  # the client left early: the replica's generator stops, the request is cancelled

            return StreamingResponse(rest(), status_code=start["status"], headers=headers)


def build_app(server_argv: Sequence[str], *, replicas: int = 2, router: str = "prefix", num_cpus: float = 1.0,
              num_gpus: float = 0.0, max_ongoing: int = 64, max_imbalance: int = DEFAULT_MAX_IMBALANCE,
              chunk_chars: int = DEFAULT_CHUNK_CHARS, refresh_s: float = DEFAULT_REFRESH_S,
              health_check_period_s: float = DEFAULT_HEALTH_PERIOD_S,
              health_check_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S,
              max_attempts: int = MAX_ATTEMPTS) -> Any:  # fmt: skip
    """The Serve application: the ingress over ``replicas`` engine replicas routed by ``router``; Serve calls each
    replica's ``check_health`` every ``health_check_period_s`` seconds (a failure, or no answer within
    ``health_check_timeout_s``, and Serve replaces the replica); the ingress tries up to ``max_attempts`` replicas
    for a request refused unstarted (1: never re-sends)."""
    require_ray()
    from ray.serve.config import RequestRouterConfig

    if router not in ROUTERS:
        raise ValueError(f"unknown router {router!r}; choose one of {list(ROUTERS)}")
    if router == "events":
        server_argv = replica_argv(server_argv, redis_url=None, events=True)
        if not any(a.split("=", 1)[0].lstrip("+~") == "engine.kv_events.salt_key" for a in server_argv):
            # one key for every replica and the ingress: the router matches a request's salt to what they publish
            server_argv = [*server_argv, f"engine.kv_events.salt_key={secrets.token_hex(32)}"]
    router_config = RequestRouterConfig(request_router_class=ROUTER_CLASSES[router],
                                        request_router_kwargs={"max_imbalance": max_imbalance},
                                        request_routing_stats_period_s=1.0)  # fmt: skip
    engines = KVBoostReplica.options(num_replicas=replicas, max_ongoing_requests=max_ongoing,
                                     ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
                                     health_check_period_s=health_check_period_s,
                                     health_check_timeout_s=health_check_timeout_s,
                                     request_router_config=router_config).bind(list(server_argv), refresh_s)  # fmt: skip
    return OpenAIIngress.bind(engines, router, chunk_chars, list(server_argv), max_attempts)


def deployment_argv(server_argv: Sequence[str], *, redis_url: str | None, namespace: str = "kvboost",
                    redaction: Any = None) -> list[str]:  # fmt: skip
    """:func:`replica_argv` plus, with API keys and no salt secret given, one secret generated for every replica
    (tenant salts must agree across replicas to share Redis entries; ``redaction``, a
    :class:`~kvboost.serving.redact.RedactingFilter`, learns it so that no log line shows it)."""
    secret = None
    if _has_api_keys(server_argv) and "--salt-secret" not in server_argv and not os.environ.get("KVBOOST_SALT_SECRET"):
        secret = secrets.token_hex(32)
        if redaction is not None:
            redaction.add(secret)
        log.warning("one salt secret generated for this deployment; pass --salt-secret to keep salts across restarts")
    return replica_argv(server_argv, redis_url=redis_url, namespace=namespace, salt_secret=secret)


#: app_builder's arguments: name -> (type, default); ``server_args`` is the replicas' kvboost-server command line
APP_ARGS: dict[str, tuple[Any, Any]] = {
    "replicas": (int, 2), "router": (str, "prefix"), "redis_url": (str, None), "redis_namespace": (str, "kvboost"),
    "no_redis": (bool, False), "refresh_s": (float, DEFAULT_REFRESH_S), "num_cpus": (float, 1.0),
    "num_gpus": (float, 0.0), "max_ongoing": (int, 64), "max_imbalance": (int, DEFAULT_MAX_IMBALANCE),
    "chunk_chars": (int, DEFAULT_CHUNK_CHARS), "server_args": (list, ()),
    "health_check_period_s": (float, DEFAULT_HEALTH_PERIOD_S),
    "health_check_timeout_s": (float, DEFAULT_HEALTH_TIMEOUT_S), "max_attempts": (int, MAX_ATTEMPTS),
}  # fmt: skip


def _coerce(name: str, kind: Any, value: Any) -> Any:
    import shlex

    if kind is list:
        return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes", "on"):
            return True
        if str(value).lower() in ("0", "false", "no", "off", ""):
            return False
        raise ValueError(f"app argument {name}: expected true or false, got {value!r}")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"app argument {name}: expected {kind.__name__}, got {value!r}") from None


def app_options(args: dict[str, Any] | None) -> dict[str, Any]:
    """:func:`app_builder`'s arguments checked and typed (Ray passes ``serve run ... key=value`` as strings, a config
    file's ``args:`` as YAML values): every name of :data:`APP_ARGS`, defaults filled in; the replicas' command line
    prepared as ``python -m kvboost.serving.ray`` prepares it (:func:`deployment_argv`) and checked by composing
    its config, so a bad one fails the deploy, not every replica."""
    from kvboost.serving.cli import UsageError, compose_config
    from kvboost.serving.cli import build_parser as server_parser

    args = dict(args or {})
    unknown = sorted(set(args) - set(APP_ARGS))
    if unknown:
        raise ValueError(f"unknown app argument(s) {unknown}; accepted: {sorted(APP_ARGS)}")
    opts = {name: _coerce(name, kind, args[name]) if name in args else default
            for name, (kind, default) in APP_ARGS.items()}  # fmt: skip
    if opts["router"] not in ROUTERS:
        raise ValueError(f"app argument router: choose one of {list(ROUTERS)}, got {opts['router']!r}")
    if opts["replicas"] < 1:
        raise ValueError(f"app argument replicas must be >= 1, got {opts['replicas']}")
    for name in ("health_check_period_s", "health_check_timeout_s", "max_attempts"):
        if opts[name] <= 0:
            raise ValueError(f"app argument {name} must be > 0, got {opts[name]}")
    redis_url = None if opts["no_redis"] else (opts["redis_url"] or os.environ.get("KVBOOST_REDIS_URL")
                                                or "redis://127.0.0.1:6379/0")  # fmt: skip
    server_argv = deployment_argv(opts["server_args"], redis_url=redis_url, namespace=opts["redis_namespace"])
    try:
        compose_config(server_parser().parse_args(server_argv))
    except (UsageError, ValueError) as exc:
        from kvboost.serving.redact import RedactingFilter, secret_values

        raise ValueError(f"app argument server_args: {RedactingFilter(secret_values(server_argv)).redact(str(exc))}"
                         ) from None  # fmt: skip
    return {"server_argv": server_argv, "replicas": opts["replicas"], "router": opts["router"],
            "num_cpus": opts["num_cpus"], "num_gpus": opts["num_gpus"], "max_ongoing": opts["max_ongoing"],
            "max_imbalance": opts["max_imbalance"], "chunk_chars": opts["chunk_chars"],
            "refresh_s": opts["refresh_s"], "health_check_period_s": opts["health_check_period_s"],
            "health_check_timeout_s": opts["health_check_timeout_s"], "max_attempts": opts["max_attempts"]}  # fmt: skip


def app_builder(args: dict[str, Any] | None = None) -> Any:
    """Ray Serve's application builder: the ingress over the engine replicas, from arguments (:data:`APP_ARGS`).

    ``serve run kvboost.serving.ray:app_builder replicas=2 router=events no_redis=true "server_args=model=tiny_random
    threads=1"``, or a Serve config file (``serve deploy``, KubeRay's RayService ``serveConfigV2``) with
    ``import_path: kvboost.serving.ray:app_builder`` and these names under ``args:``. API keys and the salt secret
    are best given as ``KVBOOST_API_KEYS`` / ``KVBOOST_SALT_SECRET`` in the application's ``runtime_env``
    (``env_vars``) than in ``server_args``, which Serve shows in its status."""
    require_ray()
    opts = app_options(args)
    return build_app(opts.pop("server_argv"), **opts)


#: ``serve run kvboost.serving.ray:app [key=value ...]`` / ``import_path: kvboost.serving.ray:app``: the builder
#: (Ray calls a builder function with the arguments; a bound application would take none)
app = app_builder

#: an example Serve config file (two models, their replicas and routers), in the wheel beside this module:
#: ``kvboost-ray-serve --print-serve-config > serve.yaml``, then ``serve run serve.yaml``
SERVE_CONFIG = "ray_serve.yaml"


def serve_config_text() -> str:
    """The bundled example Serve config file (:data:`SERVE_CONFIG` in ``kvboost/serving``)."""
    from importlib.resources import files

    return files("kvboost.serving").joinpath(SERVE_CONFIG).read_text()


def _fail_next_step(loop: Any, reason: str) -> None:
    """Make ``loop``'s engine loop fail at its next step (:meth:`KVBoostReplica.inject_loop_fault`). The core is
    patched on the loop thread itself (a call runs between steps), so no step is in flight while it changes."""

    def crash() -> None:
        raise RuntimeError(reason)

    def patch(_engine: Any) -> None:
        loop.core.has_work = lambda: True
        loop.core.step = crash

    loop.call(patch).result(timeout=60)


async def replica_health(loop: Any, probe_s: float = 20.0) -> None:
    """Raise ``RuntimeError`` when a replica's engine loop cannot serve (Ray Serve's ``check_health`` then marks
    the replica unhealthy, stops routing to it and starts another): the loop failed (``loop.error``), stopped, or
    did not run a probe call within ``probe_s`` seconds (a step that hangs; calls run between steps, so this must
    exceed the longest step)."""
    if getattr(loop, "error", None) is not None:
        raise RuntimeError(f"the engine loop failed: {loop.error!r}")
    if not loop.running:
        raise RuntimeError("the engine loop is not running")
    try:
        await asyncio.wait_for(asyncio.wrap_future(loop.call(lambda _engine: True)), timeout=probe_s)
    except asyncio.TimeoutError:
        raise RuntimeError(f"the engine loop did not answer a probe within {probe_s:g} s") from None
    except Exception as exc:  # LoopStopped: it died while the probe waited
        raise RuntimeError(f"the engine loop stopped: {exc!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args, server_argv = build_parser().parse_known_args(argv)
    if args.print_serve_config:
        sys.stdout.write(serve_config_text())
        return 0
    if ray is None:
        print(f"kvboost.serving.ray: {RAY_HINT}", file=sys.stderr)
        return 2
    from kvboost.serving.cli import UsageError, compose_config
    from kvboost.serving.cli import build_parser as server_parser

    from kvboost.serving.redact import install_redaction, redact_argv, secret_values

    # Every secret of the command line (and those generated below) is replaced by *** in every log line
    redaction = install_redaction(secret_values(server_argv))
    server_argv = deployment_argv(server_argv, redis_url=None if args.no_redis else args.redis_url,
                                  namespace=args.redis_namespace, redaction=redaction)  # fmt: skip
    try:
        compose_config(server_parser().parse_args(server_argv))  # a bad command line fails before Ray starts
    except (UsageError, ValueError) as exc:
        print(f"kvboost.serving.ray: error: {redaction.redact(str(exc))}", file=sys.stderr)
        return 2
    ray.init(address=args.address, ignore_reinit_error=True)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build_app(server_argv, replicas=args.replicas, router=args.router, num_cpus=args.num_cpus,
                    num_gpus=args.num_gpus, max_ongoing=args.max_ongoing, max_imbalance=args.max_imbalance,
                    chunk_chars=args.chunk_chars, refresh_s=args.refresh_s,
                    health_check_period_s=args.health_check_period_s,
                    health_check_timeout_s=args.health_check_timeout_s, max_attempts=args.max_attempts)  # fmt: skip
    serve.run(app, name=args.app_name, route_prefix="/")
    print(f"kvboost on Ray Serve ready: http://{args.host}:{args.port}/v1 ({args.replicas} replicas, router "
          f"{args.router}; replica command line: {' '.join(redact_argv(server_argv))})", flush=True)
    # Ctrl-C or SIGTERM (also when started in the background, where SIGINT may be ignored) removes the application
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _raise_interrupt)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("kvboost.serving.ray: stopping", flush=True)
        serve.delete(args.app_name)
        serve.shutdown()
    return 0


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
