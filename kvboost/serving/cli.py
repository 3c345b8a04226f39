"""``kvboost-server``: serve one engine over the OpenAI API (``python -m kvboost.serving`` is the same command).

    kvboost-server                                            # the bundled SmolLM2 on 127.0.0.1:8000
    kvboost-server --port 8001 --api-key k1 --api-key k2      # two tenants, each its own cache salt
    kvboost-server --disk-cache-dir /data/kv --kv-cache-bits 8 recompute=cacheblend chunker=separator
    kvboost-server model=tiny_random engine.decode=eager      # a random tiny model: every path in seconds

Trailing ``key=value`` arguments are Hydra overrides of ``kvboost/configs/config.yaml``, composed exactly as ``run.py``
composes them; the flags are shorthands for the common ones (``--recompute-strategy X`` = ``recompute=X``,
``--kv-cache-bits 8`` = ``quant=kivi8``, ``--chunk-size N`` = ``chunker.chunk_size=N``, ``--model P`` =
``model.name_or_path=P``, ``--dtype D`` = ``model.dtype=D``, ``--disk-cache-dir D`` = a memory tier over a
write-through disk tier in ``D``). A flag and an override that disagree are an error. ``cache=[memory,disk]`` (a
list of tier names) builds that stack of tiers, fastest first; ``cache.1.path=...`` then sets a field of the second.
Everything is validated before the model loads.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from pathlib import Path
from typing import Any

from kvboost.engine.loop import DEFAULT_REQUEST_TIMEOUT_S
from kvboost.original_api import KV_CACHE_BITS as KV_BITS  # one table of stored KV bits: 16 / 8 / 4 / 2
from kvboost.paths import CONFIG_DIR

log = logging.getLogger("kvboost.server")

#: the bundled model's served name: its Hugging Face id, as vLLM would serve it
BUNDLED_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: seconds uvicorn waits for open connections at SIGINT/SIGTERM before cancelling them (streams end at once)
GRACEFUL_SHUTDOWN_S = 10


class UsageError(ValueError):
    """A command line that no server could run (reported before anything is loaded)."""


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _kv_events_block_size(text: str) -> int | str:
    if text == "chunk":
        return text
    return _positive_int(text)


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0-65535; 0 = any free port), got {text}")
    return value


def _one_name_each(argv: list[str]) -> list[str]:
    """``--served-model-name A B`` as ``--served-model-name=A --served-model-name=B``: its names run up to the next
    flag or ``KEY=VALUE`` override (argparse's ``nargs="+"`` would take the overrides that follow as names too)."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token != "--served-model-name":
            out.append(token)
            continue
        names = []
        while i < len(argv) and not argv[i].startswith("-") and "=" not in argv[i]:
            names.append(argv[i])
            i += 1
        out += [f"--served-model-name={name}" for name in names] or [token]  # none: argparse reports it
    return out


class _Parser(argparse.ArgumentParser):
    """Flags and ``KEY=VALUE`` overrides in any order (``parse_args`` is ``parse_intermixed_args``)."""

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        return self.parse_intermixed_args(args, namespace)

    def parse_intermixed_args(self, args: Any = None, namespace: Any = None) -> Any:  # type: ignore[override]
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_intermixed_args(_one_name_each(argv), namespace)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvboost-server", description="OpenAI-compatible HTTP server over the kvboost engine loop.",
        epilog="Trailing KEY=VALUE arguments are Hydra overrides of kvboost/configs/config.yaml (as for run.py), e.g. "
               "recompute=cacheblend quant=kivi8 'cache=[memory,redis]' engine.decode=eager model=tiny_random.",
    )  # fmt: skip
    p.add_argument("--model", help="HF id or local folder (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--served-model-name", nargs="+", action="extend", metavar="NAME",
                   help="the name(s) clients send as `model` (vLLM's flag: several are aliases, responses report the "
                        "first; default: the model's id as given, e.g. Qwen/Qwen2.5-0.5B-Instruct)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_port, default=8000, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument("--dtype", help="model dtype: auto | float32 | bfloat16 | float16 (= model.dtype)")
    p.add_argument("--recompute-strategy", help="content-reuse repair: none | selective | cacheblend | query_aware | "
                   "full | epic | compose | any registered name (= recompute=NAME)")  # fmt: skip
    p.add_argument("--kv-cache-bits", type=int, choices=sorted(KV_BITS), help="stored KV precision: 16 (quant=none), "
                   "8 (quant=kivi8), 4 (quant=kivi4), 2 (quant=kivi2)")  # fmt: skip
    p.add_argument("--chunk-size", type=_positive_int, help="tokens per cache chunk (= chunker.chunk_size=N)")
    p.add_argument("--disk-cache-dir", help="add a disk tier below memory in this folder, written through "
                   "(survives restarts and crashes; cache.1.write_through=false: written back at eviction/shutdown "
                   "only)")  # fmt: skip
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="accept this key (repeatable; each key is a tenant with its own cache salt); also "
                        "$KVBOOST_API_KEYS (comma-separated)")  # fmt: skip
    p.add_argument(
        "--salt-secret",
        help="secret the tenants' cache salts are derived from (also "
        "$KVBOOST_SALT_SECRET; default: a secret kept in $KVBOOST_CACHE_DIR/server_secret, mode 0600)",
    )
    p.add_argument("--max-running", type=_positive_int, default=64, help="requests decoding together (default 64)")
    p.add_argument("--max-batch-tokens", type=_positive_int, default=None,
                   help="tokens per engine step while requests decode (prefill chunks + decode rows). Default: 2048 "
                        "on GPUs; on CPU the decode rows + a prompt chunk of ~1.5 decode steps, measured at start "
                        "(kvboost.engine.budget); engine.core.max_batch_tokens=N also sets it")  # fmt: skip
    p.add_argument("--prefill-drain-steps", type=_non_negative_int, default=None,
                   help="CPU step budget: a step's prompt chunk is at least the admitted prompts' pending tokens / N, "
                        "so prefill keeps pace with arriving prompts under load (default "
                        "kvboost.engine.budget.DRAIN_STEPS, 6; 0 = off: the chunk follows the decode rows alone)")  # fmt: skip
    p.add_argument("--max-waiting", type=_non_negative_int, default=256,
                   help="queued requests before 429 (default 256; 0 = unbounded)")  # fmt: skip
    p.add_argument("--request-timeout", type=_non_negative_float, default=DEFAULT_REQUEST_TIMEOUT_S,
                   help=f"seconds a request may take before 504 (default {DEFAULT_REQUEST_TIMEOUT_S:.0f}; 0 = none)")  # fmt: skip
    p.add_argument("--max-model-len", type=_positive_int, help="context limit below the model's own")
    p.add_argument("--batch-window-ms", type=float, default=0.0,
                   help="accepted for compatibility, no effect: the loop batches whatever is waiting at each step "
                        "(continuous batching), so no request waits for a window")  # fmt: skip
    p.add_argument("--strict-requests", action="store_true",
                   help="refuse unknown request fields with a 400 (default: ignored, with a log line and the "
                        "X-Kvboost-Ignored-Fields response header, as vLLM ignores them)")  # fmt: skip
    p.add_argument("--kv-events-block-size", type=_kv_events_block_size, metavar="N",
                   help="KV events (engine.kv_events.enabled=true): tokens per published block, the router's block "
                        "size (llm-d's blockSize, Dynamo's --kv-block-size; default: the KV pool's, 16; 'chunk': one "
                        "block per kvboost chunk) (= engine.kv_events.block_size)")  # fmt: skip
    p.add_argument("--kv-events-host", metavar="HOST",
                   help="KV events: the interface a bound endpoint listens on (default 127.0.0.1; '*' = every "
                        "interface: the events are unauthenticated) (= engine.kv_events.host)")  # fmt: skip
    p.add_argument("--kv-events-pod", metavar="NAME", default=None,
                   help="KV events: the pod name in the topic kv@<pod>@<model> (llm-d reads the replica from it; "
                        "default $POD_NAME, else the host name); an explicit engine.kv_events.topic wins")  # fmt: skip
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="Hydra overrides of kvboost/configs/config.yaml")
    return p


# ---------------------------------------------------------------------- config
def _split(override: str) -> tuple[str, str]:
    if "=" not in override:
        raise UsageError(f"override {override!r} is not KEY=VALUE")
    key, value = override.split("=", 1)
    return key.lstrip("+~"), value.strip().strip("'\"")


def flag_overrides(args: argparse.Namespace) -> dict[str, str]:
    """The Hydra overrides the flags stand for (key -> value)."""
    out: dict[str, str] = {}
    if args.model:
        out["model.name_or_path"] = args.model
    if args.dtype:
        out["model.dtype"] = args.dtype
    if args.recompute_strategy:
        out["recompute"] = args.recompute_strategy
    if args.kv_cache_bits is not None:
        out["quant"] = KV_BITS[args.kv_cache_bits]
    if args.chunk_size is not None:
        out["chunker.chunk_size"] = str(args.chunk_size)
    if getattr(args, "kv_events_block_size", None) is not None:
        out["engine.kv_events.block_size"] = str(args.kv_events_block_size)
    if getattr(args, "kv_events_host", None):
        out["engine.kv_events.host"] = args.kv_events_host
    return out


def compose_config(args: argparse.Namespace) -> dict[str, Any]:
    """The run config of ``kvboost/configs/config.yaml`` + the flags + the overrides, checked (no model loaded)."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from kvboost.build import check_engine_config
    from kvboost.cache_stack import CacheOverrideError, apply_cache_stack, split_cache_overrides

    if not CONFIG_DIR.is_dir():
        raise UsageError(f"the config folder {CONFIG_DIR} is missing (the package is incomplete: reinstall kvboost)")
    flags = flag_overrides(args)
    for override in args.overrides:
        key, value = _split(override)
        if key in flags and flags[key] != value:
            raise UsageError(f"{override!r} disagrees with the flag that sets {key}={flags[key]}; give one of them")
        if key == "model" and args.model:
            raise UsageError(f"{override!r} and --model both choose the model; give one of them")
        if args.disk_cache_dir and (key in ("cache", "cache.1.path") or key.startswith("cache.path")):
            raise UsageError(f"{override!r}: --disk-cache-dir sets the cache tiers and the disk folder; give either "
                             "the flag or this override")  # fmt: skip
    try:  # cache=[memory,disk] and cache.1.path=...: a stack of tiers, as run.py reads them (kvboost.cache_stack)
        hydra_overrides, stack = split_cache_overrides(list(args.overrides))
    except CacheOverrideError as exc:
        raise UsageError(str(exc)) from exc
    hydra_overrides += [f"{k}={v}" for k, v in flags.items() if k not in {_split(o)[0] for o in args.overrides}]
    if args.disk_cache_dir:
        stack.tiers = ["memory", "disk"]
        # write-through: a server killed without a clean shutdown (OOM, SIGKILL) keeps what it computed; write-back
        # would spill to disk only at eviction or close (`cache.1.write_through=false` chooses it)
        stack.fields[:0] = [("cache.1.path", str(Path(args.disk_cache_dir).expanduser().resolve())),
                            ("cache.1.write_through", True)]  # fmt: skip
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=hydra_overrides)
        apply_cache_stack(cfg, stack, CONFIG_DIR)
    except CacheOverrideError as exc:
        raise UsageError(str(exc)) from exc
    except Exception as exc:  # Hydra's errors name the bad override; say which command it came from
        raise UsageError(f"config: {exc}") from exc
    plain: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    try:
        check_engine_config(plain)
    except Exception as exc:
        raise UsageError(f"config: {exc}") from exc
    return plain


def events_topic(pod: str | None, model: str) -> str:
    """llm-d's topic ``kv@<pod>@<model>`` (its vLLM adapter splits the topic on ``@`` into three parts, and takes
    the pod and the model name from it: ``pkg/kvevents/engineadapter/vllm_adapter.go``, ``parseVLLMTopic``)."""
    import socket

    pod = pod or os.environ.get("POD_NAME") or socket.gethostname()
    if "@" in pod or "@" in model:
        raise UsageError(f"the KV events topic kv@{pod}@{model} would not split in three on '@': pass --kv-events-pod "
                         "or engine.kv_events.topic")  # fmt: skip
    return f"kv@{pod}@{model}"


def with_events_topic(cfg: dict[str, Any], pod: str | None, model: str) -> dict[str, Any]:
    """``cfg`` with ``engine.kv_events.topic`` set to :func:`events_topic` when events are on and no topic is set."""
    events = dict((cfg.get("engine") or {}).get("kv_events") or {})
    if not events.get("enabled") or events.get("topic"):
        return cfg
    events["topic"] = events_topic(pod, model)
    return {**cfg, "engine": {**cfg["engine"], "kv_events": events}}


def served_names(args: argparse.Namespace, cfg: dict[str, Any]) -> list[str]:
    """The names the model is served as: ``--served-model-name``'s (the first is what responses report), else, as
    vLLM, the model's id as given (``Qwen/Qwen2.5-0.5B-Instruct``, a folder's path without a trailing slash)."""
    if args.served_model_name:
        return list(dict.fromkeys(args.served_model_name))
    model = cfg.get("model") or {}
    if model.get("name_or_path"):
        return [str(model["name_or_path"]).rstrip("/") or str(model["name_or_path"])]
    return ["tiny-random" if model.get("random_init") else BUNDLED_NAME]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bindable(host: str, port: int) -> None:
    """Fail now, not after the model loaded, if the address cannot be bound (in use, no such interface)."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise UsageError(f"--host {host}: {exc}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            sock.bind(address)
        except OSError as exc:
            raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


def _describe(cfg: dict[str, Any]) -> str:
    def name(spec: Any) -> str:
        return spec.get("name", "?") if isinstance(spec, dict) else str(spec)

    cache = cfg.get("cache")
    tiers = "+".join(name(t) for t in cache) if isinstance(cache, list) else name(cache or {"name": "memory"})
    return (f"recompute={name(cfg.get('recompute'))} quant={name(cfg.get('quant'))} chunker={name(cfg.get('chunker'))}"
            f" cache={tiers}")  # fmt: skip


# ---------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        cfg = compose_config(args)
        with_events_topic(cfg, args.kv_events_pod, served_names(args, cfg)[0])  # a topic llm-d cannot split: now
        from kvboost.serving.tenancy import SECRET_ENV, Tenancy

        keys, secret = tenant_keys(args)
        Tenancy(keys, secret)  # the secret file is read (or made) now: a bad one fails before the model loads
        check_bindable(args.host, args.port)
    except (UsageError, PermissionError, ValueError) as exc:
        print(f"kvboost-server: error: {exc}", file=sys.stderr)
        return 2
    if keys and not args.salt_secret and not os.environ.get(SECRET_ENV):
        log.info("tenant salts derive from the secret in the kvboost cache folder (server_secret)")
    if not _is_loopback(args.host) and not keys:
        log.warning("binding %s without an API key: anyone who reaches this port can use the model and its cache "
                    "(pass --api-key or KVBOOST_API_KEYS)", args.host)  # fmt: skip
    if args.batch_window_ms:
        log.info("--batch-window-ms has no effect: the loop batches whatever is waiting at each step")
    return serve(args, cfg, keys, secret)


def tenant_keys(args: argparse.Namespace) -> tuple[list[str], str | None]:
    """The API keys (``--api-key`` and ``KVBOOST_API_KEYS``) and the salt secret (``--salt-secret``, its variable,
    or None: the secret file)."""
    from kvboost.serving.tenancy import SECRET_ENV, keys_from_env

    return list(args.api_key or []) + keys_from_env(), args.salt_secret or os.environ.get(SECRET_ENV) or None


def serving_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` as the server builds its engine: ``engine.chunked_prompts`` left unset (null) becomes true, since the
    step budget feeds prompts in chunks (``kvboost.runtime.config.choose_runner``); an explicit value is kept."""
    engine = dict(cfg.get("engine") or {})
    if engine.get("chunked_prompts") is None:
        engine["chunked_prompts"] = True
    return {**cfg, "engine": engine}


def build_served(args: argparse.Namespace, cfg: dict[str, Any], keys: list[str], secret: str | None,
                 **loop_options: Any) -> tuple[Any, Any, Any]:  # fmt: skip
    """The engine (warmed up unless ``warmup=false``), its started loop and the server's app, from a composed
    config; the engine is closed again if a later step fails. ``loop_options`` go to :class:`EngineLoop`."""
    import torch

    from kvboost.build import build_engine
    from kvboost.engine.loop import EngineLoop
    from kvboost.serving.server import create_app

    if cfg.get("threads"):
        torch.set_num_threads(int(cfg["threads"]))
    torch.manual_seed(int(cfg.get("seed") or 0))
    cfg = with_events_topic(serving_config(cfg), getattr(args, "kv_events_pod", None), served_names(args, cfg)[0])
    engine = build_engine(cfg)
    try:
        if cfg.get("warmup", True):
            engine.warmup()  # compile the decode step now, not inside the first client's request
        loop = EngineLoop(engine, max_running=args.max_running, max_batch_tokens=args.max_batch_tokens,
                          max_waiting=args.max_waiting or None, request_timeout_s=args.request_timeout,
                          **loop_options)  # fmt: skip
        if args.prefill_drain_steps is not None:
            loop.core.set_drain_steps(args.prefill_drain_steps)
        if cfg.get("warmup", True) and loop.core.scheduler.step_budget is not None:
            loop.core.calibrate_budget()  # CPU default budget: measured on this machine's runner now
        step_budget = loop.core.scheduler.step_budget
        log.info("kvboost-server: %s", step_budget.summary() if step_budget is not None else
                 f"step budget fixed: max_batch_tokens={loop.core.scheduler.max_batch_tokens} "
                 f"({loop.core.budget_info()['reason']})")  # fmt: skip
        loop.start()
        app = create_app(loop, model_name=served_names(args, cfg), api_keys=keys, server_secret=secret,
                         max_model_len=args.max_model_len,
                         strict_requests=bool(getattr(args, "strict_requests", False)))  # fmt: skip
    except BaseException:
        engine.close()
        raise
    return engine, loop, app


def serve(args: argparse.Namespace, cfg: dict[str, Any], keys: list[str], secret: str | None) -> int:
    import uvicorn

    engine, loop, app = build_served(args, cfg, keys, secret)
    # uvicorn runs the lifespan's shutdown after SIGINT/SIGTERM and the open connections: stop the loop (requests
    # still in flight end with "shutdown"), then close the engine, which flushes the disk tier.
    app.state.shutdown_hooks += [loop.shutdown, engine.close]
    budget = loop.core.budget_info()
    chunks = f" chunk@1/8/32={budget['chunk_at_1']}/{budget['chunk_at_8']}/{budget['chunk_at_32']}" if (
        budget["mode"] == "cpu-auto") else ""
    paths = engine.decode_info()  # what runs, as resolved (engine.chunked_prompts: kvboost.runtime.config)
    settings = (f"{_describe(cfg)} keys={len(keys)} max_running={args.max_running} max_waiting={args.max_waiting} "
                f"decode={paths['decode']} prefill={paths['prefill']} "
                f"step_budget={budget['mode']}:{budget['max_batch_tokens']}{chunks}")  # fmt: skip

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                port = self.servers[0].sockets[0].getsockname()[1] if self.servers else args.port
                host = f"[{args.host}]" if ":" in args.host else args.host
                names = ",".join(served_names(args, cfg))
                print(f"kvboost-server ready: http://{host}:{port}/v1 model={names} {settings}", flush=True)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on")  # fmt: skip
    server = Server(config)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it handled, after the graceful shutdown
        pass
    finally:
        # the lifespan ran these already on a clean exit; both are idempotent, and a failed start needs them
        loop.shutdown()
        engine.close()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
