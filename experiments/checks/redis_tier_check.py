"""The redis tier's must-shows (issue 9 item 4): processes sharing one Redis, fingerprints, load latency.

On the bundled SmolLM2-135M-Instruct (fp32, CPU), ``cache={"name": "redis", ...}``, against a private
``redis-server`` this script starts on a free loopback port (``--url`` to use another server instead):

(a) sharing: ``build_trace(num_conversations=N, max_turns=4, min_turns=4)`` (ShareGPT). Process A replays turns
    1-2 and exits; process B, a separate process with nothing in common with A but the Redis namespace, replays
    turns 3-4. B's first request must reuse what A stored. Compared, request by request: B's reuse against one
    process replaying all four turns on a private namespace, and every greedy output against
    ``generate(mode="cold")``.
(b) fingerprints: processes C, on the same namespace, replay B's turn-3 prompts with another KV quantizer
    (``quant=kivi8``: another fingerprint) and with ``cache_salt="tenant-2"``; each is also run on an empty
    namespace (an engine reuses its own earlier requests' chunks, e.g. the chat template's system prompt): equal
    reuse in both means 0 hits on A's or B's entries.
(c) latency: records of 16-1024 tokens of the model's KV shape are put into Redis; ``get`` (GET + checksum +
    decode) of each one by one (one round trip each) and of chains of 8 prefetched (pipelines of at most 4 MiB:
    the tier's default ``pipeline_bytes``; and the whole chain in one pipeline), in ms per
    MiB, next to the cold prefill time of the same model (ms per MiB of KV it computes), and the server's PING
    round trip (what a pipeline saves per record).

Example (about 3 minutes on 2 busy CPU cores)::

    python -m experiments.checks.redis_tier_check --out experiments/results/redis_tier

Writes ``redis_tier_check.json`` (the command, the environment, every figure, per-request tables) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.redis_process import RedisProcess

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "redis_tier"
MAX_NEW_TOKENS = 8
NAMESPACE = "kvcheck"


# ---------------------------------------------------------------------------------------------- helpers
def _cache(args: argparse.Namespace, namespace: str = NAMESPACE) -> dict[str, Any]:
    return {"name": "redis", "url": args.url, "namespace": namespace, "capacity": args.capacity}


def _load_trace(work: Path) -> list[dict[str, Any]]:
    return json.loads((work / "trace.json").read_text())


def _engine(cache: Any, **options: Any):
    from experiments.common import compose_run_config
    from kvboost.build import build_engine
    from kvboost.models.loading import load_model_and_tokenizer

    model, tok, path = load_model_and_tokenizer(None)
    return build_engine(compose_run_config(cache=cache, **options), model, tok, model_identity=path)


def _replay(engine: Any, requests: list[dict[str, Any]], *, cold: bool = False, salt: str = "") -> list[dict]:
    rows = []
    for req in requests:
        r = engine.generate(req["ids"], max_new_tokens=MAX_NEW_TOKENS, mode="cold" if cold else "reuse",
                            cache_salt=salt)  # fmt: skip
        rows.append({
            "conversation": req["conversation"], "turn": req["turn"], "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "exact_hit_tokens": r.exact_hit_tokens,
            "ttft_ms": round(r.ttft_ms, 2), "prefill_ms": round(r.extra["prefill_ms"], 2),
            "lookup_ms": round(r.extra["lookup_ms"], 2), "store_ms": round(r.store_ms, 2),
            "output_ids": r.output_ids,
        })  # fmt: skip
    return rows


def _tier_stats(engine: Any) -> dict[str, Any]:
    stats = engine.cache_stats()
    keep = ("entries", "stored", "evicted", "per_tier_hits", "corrupt_entries_dropped", "tiers", "reuse_ratio",
            "requests")  # fmt: skip
    return {k: stats[k] for k in keep}


def _write(work: Path, name: str, data: Any) -> None:
    (work / f"{name}.json").write_text(json.dumps(data, indent=1, default=str))


# ---------------------------------------------------------------------------------------------- phases
def phase_single(args: argparse.Namespace, work: Path) -> None:
    """One process, all four turns, a private namespace; then cold outputs of every request (the baseline)."""
    trace = _load_trace(work)
    engine = _engine(_cache(args, NAMESPACE + "single"))
    engine.generate(list(range(1000, 1032)), max_new_tokens=2, mode="cold")  # warm-up (kernels, buffers)
    reuse = _replay(engine, trace)
    stats = _tier_stats(engine)
    cold = _replay(engine, trace, cold=True)
    engine.close()
    _write(work, "single", {"reuse": reuse, "cold": cold, "stats": stats})


def phase_a(args: argparse.Namespace, work: Path) -> None:
    trace = [r for r in _load_trace(work) if r["turn"] <= 2]
    with _engine(_cache(args)) as engine:  # close(): the write queue is flushed into Redis
        rows = _replay(engine, trace)
        stats = _tier_stats(engine)
    _write(work, "A", {"rows": rows, "stats": stats, "pid": os.getpid()})


def phase_b(args: argparse.Namespace, work: Path) -> None:
    trace = [r for r in _load_trace(work) if r["turn"] >= 3]
    engine = _engine(_cache(args))
    start = {"entries_indexed_at_start": len(engine.store), "redis": engine.store.tiers[0].stats()}
    with engine:
        rows = _replay(engine, trace)
        stats = _tier_stats(engine)
    _write(work, "B", {"rows": rows, "stats": stats, "at_start": start, "pid": os.getpid()})


def phase_c(args: argparse.Namespace, work: Path) -> None:
    """Another fingerprint (KV quantizer kivi8), then another cache salt, on B's turn-3 prompts: each run on the
    shared namespace and, as the reference, on an empty one (an engine reuses its own earlier requests' chunks,
    e.g. the chat template's system prompt; equal figures mean nothing came from A's or B's entries)."""
    trace = [r for r in _load_trace(work) if r["turn"] == 3]
    out: dict[str, Any] = {}
    for variant, options, salt in (("quant_kivi8", {"quant": "kivi8"}, ""), ("salt", {}, "tenant-2")):
        for where in ("shared", "empty"):
            ns = NAMESPACE if where == "shared" else f"{NAMESPACE}empty{variant.replace('_', '')}"
            with _engine(_cache(args, ns), **options) as engine:
                indexed = len(engine.store)
                rows = _replay(engine, trace, salt=salt)
                out.setdefault(variant, {})[where] = {"rows": rows, "stats": _tier_stats(engine),
                                                      "indexed_at_start": indexed,
                                                      "fingerprint": engine.fingerprint}  # fmt: skip
    _write(work, "C", out)


def _content(key: str, tokens: int, shape: tuple[int, int, int], parent: str) -> Any:
    import numpy as np
    import torch
    import xxhash

    from kvboost.cache import KVEntry
    from kvboost.quant.none import RawKV

    layers, heads, dim = shape
    rng = np.random.default_rng(xxhash.xxh64_intdigest(f"{key}/{tokens}".encode()))
    k = torch.from_numpy(rng.standard_normal((layers, heads, tokens, dim), dtype=np.float32))
    v = torch.from_numpy(rng.standard_normal((layers, heads, tokens, dim), dtype=np.float32))
    ids = tuple(int(x) for x in rng.integers(0, 49152, tokens))
    return KVEntry(key, "s-" + key, parent, ids, 0, RawKV(k, v))


def phase_latency(args: argparse.Namespace, work: Path) -> None:
    """Redis load (GET + checksum + decode) in ms/MiB, one round trip per record and pipelined, vs cold prefill."""
    import torch

    from kvboost.cache import RedisTier

    engine = _engine({"name": "memory"})
    shape = (engine.adapter.num_layers, engine.adapter.kv_shape.num_kv_heads, engine.adapter.kv_shape.head_dim)
    kv_bytes_per_token = engine.adapter.kv_bytes_per_token()
    engine.generate(list(range(1000, 1064)), max_new_tokens=1, mode="cold")
    prefill = []
    for n in (128, 256, 512, 1024):
        ids = [1000 + (i * 7919) % 40000 for i in range(n)]
        ms = statistics.median(
            engine.generate(ids, max_new_tokens=1, mode="cold").extra["prefill_ms"] for _ in range(3)
        )
        prefill.append({"tokens": n, "prefill_ms": round(ms, 2), "ms_per_token": round(ms / n, 3),
                        "ms_per_mib_of_kv": round(ms / (n * kv_bytes_per_token / 2**20), 2)})  # fmt: skip
    engine.close()

    ns = NAMESPACE + "latency"
    writer = RedisTier(url=args.url, namespace=ns, capacity="8GiB")
    chain_len = 8
    loads = []
    for tokens in (16, 64, 256, 1024):
        n_chain = chain_len if tokens <= 256 else 4
        keys = [f"lat-{tokens}-{i}" for i in range(n_chain)]
        t0 = time.perf_counter()
        for i, key in enumerate(keys):
            writer.put(_content(key, tokens, shape, "root" if i == 0 else keys[i - 1]))
        writer.flush()
        write_s = time.perf_counter() - t0
        one_by_one, pipelined, one_pipeline, round_trip_only = [], [], [], []
        for _ in range(5):
            plain = RedisTier(url=args.url, namespace=ns, capacity="8GiB", readahead=0)
            t = time.perf_counter()
            got = [plain.get(k) for k in keys]
            one_by_one.append((time.perf_counter() - t) * 1e3)
            assert all(g is not None and g.num_tokens == tokens for g in got)
            plain.close()
            fetched = RedisTier(url=args.url, namespace=ns, capacity="8GiB", readahead=0)
            t = time.perf_counter()
            fetched.prefetch(keys)
            got = [fetched.get(k) for k in keys]
            pipelined.append((time.perf_counter() - t) * 1e3)
            assert all(g is not None and g.num_tokens == tokens for g in got)
            trips_4mib = fetched.stats()["round_trips"]
            fetched.close()
            whole = RedisTier(url=args.url, namespace=ns, capacity="8GiB", readahead=0, pipeline_bytes="1TiB")
            t = time.perf_counter()
            whole.prefetch(keys)
            got = [whole.get(k) for k in keys]
            one_pipeline.append((time.perf_counter() - t) * 1e3)
            trips = whole.stats()["round_trips"]
            whole.close()
            client = writer.client
            t = time.perf_counter()
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.get(f"{ns}:{k}")
            pipe.execute()
            round_trip_only.append((time.perf_counter() - t) * 1e3)
        mib = n_chain * tokens * kv_bytes_per_token / 2**20
        record_bytes = sum(len(writer.client.get(f"{ns}:{k}")) for k in keys)
        loads.append({
            "tokens_per_record": tokens, "records": n_chain, "payload_mib": round(mib, 3),
            "record_bytes_total": record_bytes,
            "get_one_by_one_ms": round(statistics.median(one_by_one), 3),
            "get_prefetched_pipeline_ms": round(statistics.median(pipelined), 3),
            "round_trips_4MiB_pipelines": trips_4mib,
            "get_prefetched_one_pipeline_ms": round(statistics.median(one_pipeline), 3),
            "round_trips_one_pipeline": trips,
            "raw_pipelined_GET_ms_no_decode": round(statistics.median(round_trip_only), 3),
            "ms_per_mib_one_by_one": round(statistics.median(one_by_one) / mib, 3),
            "ms_per_mib_pipelined": round(statistics.median(pipelined) / mib, 3),
            "ms_per_mib_one_pipeline": round(statistics.median(one_pipeline) / mib, 3),
            "ms_per_mib_raw_GET": round(statistics.median(round_trip_only) / mib, 3),
            "write_ms_per_mib_encode_and_send": round(write_s * 1e3 / mib, 3),
        })  # fmt: skip
    pings = []
    for _ in range(200):
        t = time.perf_counter()
        writer.client.ping()
        pings.append((time.perf_counter() - t) * 1e3)
    writer.clear()
    writer.close()
    _write(work, "latency", {"kv_bytes_per_token": kv_bytes_per_token, "prefill": prefill, "redis_get": loads,
                             "ping_rtt_ms_median": round(statistics.median(pings), 4),
                             "round_trips_per_chain": {"one_by_one": "one per record", "pipelined": 1},
                             "torch_threads": torch.get_num_threads()})  # fmt: skip


PHASES = {"single": phase_single, "A": phase_a, "B": phase_b, "C": phase_c, "latency": phase_latency}


# ---------------------------------------------------------------------------------------------- redis-server
def start_redis(work: Path, maxmemory: str) -> RedisProcess:
    """A private redis-server in ``work`` (no persistence; maxmemory + allkeys-lru as the tier's backstop)."""
    return RedisProcess("--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru", folder=work).start()


# ---------------------------------------------------------------------------------------------- driver
def _run_phase(args: argparse.Namespace, work: Path, phase: str) -> float:
    cmd = [sys.executable, "-m", "experiments.checks.redis_tier_check", "--phase", phase, "--workdir", str(work),
           "--url", args.url, "--capacity", str(args.capacity), "--threads", str(args.threads)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    print(f"[redis_tier_check] phase {phase} ...", flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=Path(__file__).resolve().parents[2])
    seconds = time.perf_counter() - t0
    print(f"[redis_tier_check] phase {phase}: {seconds:.0f} s", flush=True)
    return seconds


def _by_request(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["conversation"], r["turn"]): r for r in rows}


def summarize(work: Path, args: argparse.Namespace, seconds: dict[str, float], server: dict) -> dict[str, Any]:
    from kvboost.lab.environment import describe_environment

    single, a, b, c, latency = (json.loads((work / f"{n}.json").read_text())
                                for n in ("single", "A", "B", "C", "latency"))  # fmt: skip
    one, cold = _by_request(single["reuse"]), _by_request(single["cold"])
    table, per_turn = [], {}
    for r in b["rows"]:
        key = (r["conversation"], r["turn"])
        ref = one[key]
        table.append({"conversation": key[0], "turn": key[1], "prompt_tokens": r["prompt_tokens"],
                      "cached_single_process": ref["cached_tokens"], "cached_process_B": r["cached_tokens"],
                      "greedy_equal_cold": r["output_ids"] == cold[key]["output_ids"],
                      "ttft_ms_single": ref["ttft_ms"], "ttft_ms_B": r["ttft_ms"],
                      "ttft_ms_cold": cold[key]["ttft_ms"], "lookup_ms_B": r["lookup_ms"]})  # fmt: skip
        t = per_turn.setdefault(key[1], {"prompt_tokens": 0, "cached_single": 0, "cached_B": 0})
        t["prompt_tokens"] += r["prompt_tokens"]
        t["cached_single"] += ref["cached_tokens"]
        t["cached_B"] += r["cached_tokens"]
    for t in per_turn.values():
        t["reuse_single"] = round(t["cached_single"] / t["prompt_tokens"], 4)
        t["reuse_B"] = round(t["cached_B"] / t["prompt_tokens"], 4)
    a_equal = sum(r["output_ids"] == cold[(r["conversation"], r["turn"])]["output_ids"] for r in a["rows"])
    first = table[0]
    sharing = {
        "pids": {"A": a["pid"], "B": b["pid"]},
        "requests_A": len(a["rows"]), "requests_B": len(b["rows"]),
        "A_greedy_equal_cold": f"{a_equal}/{len(a['rows'])}",
        "A_stats": a["stats"], "B_at_start": b["at_start"],
        "B_first_request": first,
        "B_reuse_equal_single_process_every_request": all(
            x["cached_single_process"] == x["cached_process_B"] for x in table),
        "B_greedy_equal_cold": f"{sum(x['greedy_equal_cold'] for x in table)}/{len(table)}",
        "reuse_per_turn": {str(k): v for k, v in sorted(per_turn.items())},
        "B_ttft_ms_median": statistics.median(x["ttft_ms_B"] for x in table),
        "single_ttft_ms_median_same_requests": statistics.median(x["ttft_ms_single"] for x in table),
        "cold_ttft_ms_median_same_requests": statistics.median(x["ttft_ms_cold"] for x in table),
        "B_stats": b["stats"], "single_process_stats": single["stats"], "requests": table,
    }  # fmt: skip
    fp: dict[str, Any] = {}
    for variant, runs in c.items():
        shared, empty = runs["shared"], runs["empty"]
        fp[variant] = {
            "indexed_at_start_shared": shared["indexed_at_start"],
            "cached_tokens_shared_namespace": [r["cached_tokens"] for r in shared["rows"]],
            "cached_tokens_empty_namespace": [r["cached_tokens"] for r in empty["rows"]],
            "prompt_tokens": sum(r["prompt_tokens"] for r in shared["rows"]),
            "hits_from_A_or_B_entries": sum(r["cached_tokens"] for r in shared["rows"])
            - sum(r["cached_tokens"] for r in empty["rows"]),
            "first_request_cached": shared["rows"][0]["cached_tokens"],
            "foreign_skipped": shared["stats"]["tiers"][0]["foreign_skipped"],
            "greedy_equal_empty_namespace_run": all(
                a["output_ids"] == b["output_ids"] for a, b in zip(shared["rows"], empty["rows"])),
        }  # fmt: skip
    fp["same_prompts_same_fingerprint_unsalted_in_B"] = sum(x["cached_process_B"] for x in table if x["turn"] == 3)
    per_mib_prefill = statistics.median(p["ms_per_mib_of_kv"] for p in latency["prefill"])
    lat = {**latency, "prefill_ms_per_mib_of_kv_median": per_mib_prefill,
           "prefill_ms_per_mib_over_redis_ms_per_mib": {
               str(x["tokens_per_record"]): {"one_by_one": round(per_mib_prefill / x["ms_per_mib_one_by_one"], 1),
                                             "pipelined": round(per_mib_prefill / x["ms_per_mib_pipelined"], 1)}
               for x in latency["redis_get"]}}  # fmt: skip
    return {
        "command": "python -m experiments.checks.redis_tier_check " + shlex.join(sys.argv[1:]),
        "config": {"model": "bundled SmolLM2-135M-Instruct fp32 CPU", "max_new_tokens": MAX_NEW_TOKENS,
                   "trace": {"num_conversations": args.conversations, "max_turns": 4, "min_turns": 4,
                             "max_prompt_tokens": args.max_prompt_tokens},
                   "cache": _cache(args), "torch_threads": args.threads, "redis_server": server},  # fmt: skip
        "environment": describe_environment(),
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "sharing": sharing, "fingerprints": fp, "latency": lat,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp dir, removed)")
    p.add_argument("--url", default=None, help="an existing Redis server (default: start a private one)")
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--max-prompt-tokens", type=int, default=768)
    p.add_argument("--capacity", default="2GiB", help="the tier's byte budget")
    p.add_argument("--maxmemory", default="3gb", help="the private server's maxmemory (allkeys-lru)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is faster on 2 shared cores)")
    p.add_argument("--phase", choices=sorted(PHASES), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)


    from experiments.common import set_threads


    set_threads(args.threads)
    if args.phase is not None:
        PHASES[args.phase](args, args.workdir)
        return

    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvboost-redis-check-"))
    work.mkdir(parents=True, exist_ok=True)
    private = None
    server: dict[str, Any] = {"url": args.url}
    if args.url is None:
        private = start_redis(work, args.maxmemory)
        args.url = private.url
        server = {"private": True, "argv": private.argv[1:]}
    else:
        import redis  # an existing server: start from an empty namespace

        client = redis.Redis.from_url(args.url)
        for key in client.scan_iter(match=f"{NAMESPACE}*"):
            client.delete(key)
    try:
        import redis

        server["version"] = redis.Redis.from_url(args.url).info("server")["redis_version"]
        seconds: dict[str, float] = {}
        t0 = time.perf_counter()
        from experiments.sims.token_trace import build_trace

        trace = build_trace(num_conversations=args.conversations, max_turns=4, min_turns=4,
                            max_prompt_tokens=args.max_prompt_tokens)  # fmt: skip
        (work / "trace.json").write_text(json.dumps(
            [{"conversation": r.conversation_id, "turn": r.turn, "ids": list(r.token_ids)} for r in trace]))
        seconds["trace"] = time.perf_counter() - t0
        for phase in ("single", "A", "B", "C", "latency"):
            seconds[phase] = _run_phase(args, work, phase)
        out = summarize(work, args, seconds, server)
        memory = redis.Redis.from_url(args.url).info("memory")
        out["redis_memory_after"] = {k: memory[k] for k in ("used_memory_human", "maxmemory_human",
                                                              "maxmemory_policy")}  # fmt: skip
    finally:
        if private is not None:
            private.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "redis_tier_check.json").write_text(json.dumps(out, indent=1, default=str))
    s, f = out["sharing"], out["fingerprints"]
    print(json.dumps({
        "B_first_request": {k: s["B_first_request"][k] for k in ("prompt_tokens", "cached_single_process",
                                                                 "cached_process_B", "greedy_equal_cold")},
        "B_reuse_equal_single_process": s["B_reuse_equal_single_process_every_request"],
        "reuse_per_turn": s["reuse_per_turn"], "B_greedy_equal_cold": s["B_greedy_equal_cold"],
        "kivi8_hits_from_A_B": f["quant_kivi8"]["hits_from_A_or_B_entries"],
        "salt_hits_from_A_B": f["salt"]["hits_from_A_or_B_entries"],
        "latency_ms_per_mib": [(x["tokens_per_record"], x["ms_per_mib_one_by_one"], x["ms_per_mib_pipelined"])
                               for x in out["latency"]["redis_get"]],
        "prefill_ms_per_mib": out["latency"]["prefill_ms_per_mib_of_kv_median"],
    }, indent=1))  # fmt: skip
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
