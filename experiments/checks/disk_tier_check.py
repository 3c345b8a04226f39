"""The disk tier's must-shows (issue 9): restart reuse, crash safety, damage handling, load latency vs prefill.

Each part runs in its own processes (the point is what survives a process), on the bundled SmolLM2-135M-Instruct
(fp32, CPU), with ``cache=[memory, disk]``:

(a) restart: ``build_trace(num_conversations=8, max_turns=6, min_turns=6)`` (ShareGPT, 48 requests). Process A
    replays turns 1-3 with ``cache=[memory, disk]`` and exits; process B, on the same folder with an empty memory
    tier, replays turns 4-6. Compared, request by request: B's kvboost reuse against one process that replays all
    six turns with the same tiers (its own folder), and every greedy output (8 new tokens) against
    ``generate(mode="cold")``.
(b) crash: ``--crash-writers`` processes (forked) write records of the model's KV shape into one folder in a loop
    and are SIGKILLed at random moments; then the tier opens: how many temp files the kills left (torn writes),
    how many records it found, and that each one it serves decodes and equals what was written (content is a
    function of the key). Then damage: records that B's turns need are bit-flipped (tensor and header
    sections), truncated, overwritten with garbage or emptied; process C replays turns 4-6: every damaged record
    is dropped and counted (``cache_stats()["corrupt_entries_dropped"]``), its chunks recomputed, outputs equal
    to cold.
(c) latency: ``get`` (read + checksum + decode) of records of 16-1024 tokens, page cache dropped before each read
    (``posix_fadvise(DONTNEED)``) and warm, in ms per MiB, next to the prefill time the record saves (cold
    prefill of the bundled model at 128-1024 tokens: ms per token and ms per MiB of KV).

Example (about 4 minutes on 2 busy CPU cores)::

    python -m experiments.checks.disk_tier_check --out experiments/results/disk_tier

Writes ``disk_tier_check.json`` (the command, the environment, every figure, per-request tables) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "disk_tier"
MAX_NEW_TOKENS = 8
DAMAGE_KINDS = ("flip_tensor", "flip_header", "truncate", "garbage", "empty")


# ---------------------------------------------------------------------------------------------- helpers
def _tiers(args: argparse.Namespace, folder: Path) -> list[dict[str, Any]]:
    return [
        {"name": "memory", "capacity": args.memory_capacity},
        {"name": "disk", "path": str(folder), "capacity": args.disk_capacity},
    ]


def _load_trace(work: Path) -> list[dict[str, Any]]:
    return json.loads((work / "trace.json").read_text())


def _engine(args: argparse.Namespace, cache: Any, model_and_tok: tuple[Any, Any, str] | None = None):
    from experiments.common import compose_run_config
    from kvboost.build import build_engine
    from kvboost.models.loading import load_model_and_tokenizer

    model, tok, path = model_and_tok or load_model_and_tokenizer(None)
    return build_engine(compose_run_config(cache=cache), model, tok, model_identity=path), (model, tok, path)


def _replay(engine: Any, requests: list[dict[str, Any]], *, cold: bool = False) -> list[dict[str, Any]]:
    rows = []
    for req in requests:
        r = engine.generate(req["ids"], max_new_tokens=MAX_NEW_TOKENS, mode="cold" if cold else "reuse")
        rows.append({
            "conversation": req["conversation"], "turn": req["turn"], "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens, "exact_hit_tokens": r.exact_hit_tokens,
            "content_hit_tokens": r.content_hit_tokens, "ttft_ms": round(r.ttft_ms, 2),
            "prefill_ms": round(r.extra["prefill_ms"], 2), "lookup_ms": round(r.extra["lookup_ms"], 2),
            "store_ms": round(r.store_ms, 2), "output_ids": r.output_ids,
        })  # fmt: skip
    return rows


def _tier_stats(engine: Any) -> dict[str, Any]:
    stats = engine.cache_stats()
    keep = ("entries", "stored", "demoted", "promoted", "evicted", "per_tier_hits", "corrupt_entries_dropped",
            "tiers", "reuse_ratio", "requests")  # fmt: skip
    return {k: stats[k] for k in keep}


def _write(work: Path, name: str, data: Any) -> None:
    (work / f"{name}.json").write_text(json.dumps(data, indent=1))


# ---------------------------------------------------------------------------------------------- phases
def phase_single(args: argparse.Namespace, work: Path) -> None:
    """One process, all six turns, the same tiers; then cold outputs of every request (the baseline)."""
    trace = _load_trace(work)
    engine, _ = _engine(args, _tiers(args, work / "kv_single"))
    engine.generate(list(range(1000, 1032)), max_new_tokens=2, mode="cold")  # warm-up (kernels, buffers)
    t0 = time.perf_counter()
    reuse = _replay(engine, trace)
    stats = _tier_stats(engine)
    cold = _replay(engine, trace, cold=True)
    engine.close()
    _write(work, "single", {"reuse": reuse, "cold": cold, "stats": stats, "seconds": time.perf_counter() - t0})


def phase_a(args: argparse.Namespace, work: Path) -> None:
    trace = [r for r in _load_trace(work) if r["turn"] <= 3]
    engine, _ = _engine(args, _tiers(args, work / "kv"))
    with engine:  # close(): the memory tier's entries are spilled into the disk tier, pending writes flushed
        rows = _replay(engine, trace)
        stats = _tier_stats(engine)
    files = sorted((work / "kv").glob("*/*.kvr"))
    _write(work, "A", {"rows": rows, "stats": stats, "files_after_exit": len(files),
                       "bytes_after_exit": sum(f.stat().st_size for f in files)})  # fmt: skip


def phase_b(args: argparse.Namespace, work: Path) -> None:
    trace = [r for r in _load_trace(work) if r["turn"] >= 4]
    engine, _ = _engine(args, _tiers(args, work / "kv"))
    start = {"memory_entries": len(engine.store.tiers[0]), "disk_entries": len(engine.store.tiers[1])}
    with engine:
        rows = _replay(engine, trace)
        stats = _tier_stats(engine)
    _write(work, "B", {"rows": rows, "stats": stats, "at_start": start})


def _damage(path: Path, kind: str) -> None:
    from kvboost.cache import payload as fmt

    data = bytearray(path.read_bytes())
    if kind == "flip_tensor":
        data[len(data) - 100] ^= 0x04  # in the tensor section: only the whole-record checksum sees it
    elif kind == "flip_header":
        data[fmt.PREFIX_SIZE + 10] ^= 0x20
    elif kind == "truncate":
        data = data[: len(data) // 2]
    elif kind == "garbage":
        data = bytearray(random.Random(len(data)).randbytes(len(data)))
    elif kind == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))


def phase_c(args: argparse.Namespace, work: Path) -> None:
    """Damage records that turns 4-6 need, then replay those turns in a new process."""
    from kvboost.cache.disk import record_name
    from kvboost.lookup import chunk_prompt

    trace = [r for r in _load_trace(work) if r["turn"] >= 4]
    probe, loaded = _engine(args, {"name": "memory"})  # keys of the prompts (no disk tier opened)
    damaged = []
    by_conv: dict[str, dict[str, Any]] = {}
    for r in trace:
        by_conv.setdefault(r["conversation"], r)  # each conversation's turn-4 prompt
    for i, (conv, req) in enumerate(sorted(by_conv.items())):
        _, keys = chunk_prompt(req["ids"], probe.chunker, probe.hasher, probe.fingerprint)
        chunk = 1 + i % max(1, len(keys) - 2)  # a chunk inside the prompt (not the last, partial one)
        name = record_name(keys[chunk].prefix_key)
        path = work / "kv" / name[:2] / name
        if not path.exists():
            continue
        kind = DAMAGE_KINDS[i % len(DAMAGE_KINDS)]
        _damage(path, kind)
        damaged.append({"conversation": conv, "chunk": chunk, "kind": kind, "file": str(path.relative_to(work))})
    probe.close()
    engine, _ = _engine(args, _tiers(args, work / "kv"), loaded)
    at_start = engine.cache_stats()["corrupt_entries_dropped"]  # header damage is caught by the scan
    with engine:
        rows = _replay(engine, trace)
        stats = _tier_stats(engine)
    left = [d for d in damaged if (work / d["file"]).exists() and _is_damaged(work / d["file"])]
    _write(work, "C", {"damaged": damaged, "rows": rows, "stats": stats, "dropped_at_start": at_start,
                       "damaged_files_still_on_disk_as_damaged": len(left)})  # fmt: skip


def _is_damaged(path: Path) -> bool:
    from kvboost.cache import payload as fmt

    try:
        fmt.decode(path.read_bytes())
        return False
    except fmt.RecordError:
        return True


def _crash_content(key: str, tokens: int, shape: tuple[int, int, int]) -> Any:
    """Deterministic KV of the model's shape for ``key`` (numpy: no torch op runs in the forked writers)."""
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
    return KVEntry(key, "s-" + key, "root", ids, 0, RawKV(k, v))


def _crash_writer(folder: str, worker: int, shape: tuple[int, int, int], log_path: str) -> None:
    import torch

    from kvboost.cache import DiskTier

    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)  # the tier's warnings (a record it judged damaged) go to the log the parent reads
    torch.set_num_threads(1)
    tier = DiskTier(path=folder, capacity="48MiB", max_pending_bytes="8MiB")
    rng = random.Random(worker)
    i = 0
    while True:
        key = f"shared-{rng.randrange(40)}" if rng.random() < 0.3 else f"w{worker}-{i}"
        tier.put(_crash_content(key, rng.choice((2, 4, 8)), shape))
        if rng.random() < 0.1 and len(tier):
            tier.remove(rng.choice(list(tier.keys())))
        i += 1


def phase_crash(args: argparse.Namespace, work: Path) -> None:
    """Forked writers SIGKILLed at random moments; then the tier opens and every record it serves is checked."""
    import multiprocessing

    from kvboost.cache import DiskTier
    from kvboost.cache.disk import TMP_PREFIX

    shape = (30, 3, 64)  # SmolLM2-135M: layers, kv heads, head dim (46,080 bytes of fp32 KV per token)
    folder = work / "kv_crash"
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    log_path = work / "crash_writers.log"
    procs = [ctx.Process(target=_crash_writer, args=(str(folder), w, shape, str(log_path)), daemon=True)
             for w in range(args.crash_writers)]  # fmt: skip
    t0 = time.monotonic()
    for p in procs:
        p.start()
    kill_at = sorted(rng.uniform(0.5, args.crash_seconds) for _ in procs)
    for p, at in zip(sorted(procs, key=lambda _: rng.random()), kill_at):
        time.sleep(max(0.0, t0 + at - time.monotonic()))
        os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(30)
    killed = sum(p.exitcode == -signal.SIGKILL for p in procs)
    tmp_left = len(list(folder.glob(f"*/{TMP_PREFIX}*")))
    records = len(list(folder.glob("*/*.kvr")))
    t1 = time.perf_counter()
    tier = DiskTier(path=folder, capacity="1TiB")
    open_s = time.perf_counter() - t1
    at_open = tier.stats()
    served = equal = 0
    for key in list(tier.keys()):
        got = tier.get(key)
        if got is None:
            continue
        served += 1
        want = _crash_content(key, got.num_tokens, shape)
        equal += int(got.token_ids == want.token_ids and bool((got.payload.keys == want.payload.keys).all())
                     and bool((got.payload.values == want.payload.values).all()))  # fmt: skip
    _write(work, "crash", {
        "writers": args.crash_writers, "killed_by_sigkill": killed, "kill_window_s": [0.5, args.crash_seconds],
        "temp_files_left_by_kills": tmp_left, "record_files_found": records, "tier_open_s": round(open_s, 3),
        "indexed_at_open": len(tier), "tmp_cleaned_at_open": at_open["tmp_cleaned"],
        "corrupt_dropped_at_open": at_open["corrupt_dropped"], "served": served, "served_equal_to_written": equal,
        "served_corrupt": served - equal, "corrupt_dropped_on_read": tier.stats()["corrupt_dropped"],
        "temp_files_after_open": len(list(folder.glob(f"*/{TMP_PREFIX}*"))),
        # what the writers' own start-up scans (racing with the others' writes) judged damaged: must be 0
        "writers_scans_false_damage": log_path.read_text().count("dropping damaged record") if log_path.exists() else 0,
    })  # fmt: skip
    tier.close()
    shutil.rmtree(folder, ignore_errors=True)


def phase_latency(args: argparse.Namespace, work: Path) -> None:
    """Disk load (get = read + checksum + decode) in ms/MiB, page cache cold and warm, vs cold prefill."""
    import torch

    from kvboost.cache import DiskTier

    engine, _ = _engine(args, {"name": "memory"})
    shape = (engine.adapter.num_layers, engine.adapter.kv_shape.num_kv_heads, engine.adapter.kv_shape.head_dim)
    kv_bytes_per_token = engine.adapter.kv_bytes_per_token()
    # prefill: cold, one request per length, the median of 3
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

    folder = work / "kv_latency"
    tier = DiskTier(path=folder, capacity="4GiB")
    loads = []
    for tokens in (16, 64, 256, 1024):
        keys = [f"lat-{tokens}-{i}" for i in range(5)]
        t0 = time.perf_counter()
        for key in keys:
            tier.put(_crash_content(key, tokens, shape))
        tier.flush()
        write_s = time.perf_counter() - t0
        cold_ms, warm_ms = [], []
        for key in keys:
            path = tier._index[key].file
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # drop it from the page cache (it is synced)
            finally:
                os.close(fd)
            tier._last = None
            t = time.perf_counter()
            got = tier.get(key)
            cold_ms.append((time.perf_counter() - t) * 1e3)
            tier._last = None
            t = time.perf_counter()
            tier.get(key)
            warm_ms.append((time.perf_counter() - t) * 1e3)
            assert got is not None and got.num_tokens == tokens
        mib = tokens * kv_bytes_per_token / 2**20
        loads.append({
            "tokens": tokens, "payload_mib": round(mib, 3),
            "get_ms_page_cache_dropped": round(statistics.median(cold_ms), 3),
            "get_ms_warm": round(statistics.median(warm_ms), 3),
            "ms_per_mib_page_cache_dropped": round(statistics.median(cold_ms) / mib, 3),
            "ms_per_mib_warm": round(statistics.median(warm_ms) / mib, 3),
            "write_ms_per_mib_encode_write_fsync": round(write_s * 1e3 / (len(keys) * mib), 3),
        })  # fmt: skip
    tier.close()
    shutil.rmtree(folder, ignore_errors=True)
    _write(work, "latency", {"kv_bytes_per_token": kv_bytes_per_token, "prefill": prefill, "disk_get": loads,
                             "torch_threads": torch.get_num_threads()})  # fmt: skip


PHASES = {"single": phase_single, "A": phase_a, "B": phase_b, "C": phase_c, "crash": phase_crash,
          "latency": phase_latency}  # fmt: skip


# ---------------------------------------------------------------------------------------------- driver
def _run_phase(args: argparse.Namespace, work: Path, phase: str) -> float:
    cmd = [sys.executable, "-m", "experiments.checks.disk_tier_check", "--phase", phase, "--workdir", str(work),
           "--memory-capacity", str(args.memory_capacity), "--disk-capacity", str(args.disk_capacity),
           "--crash-writers", str(args.crash_writers), "--crash-seconds", str(args.crash_seconds),
           "--threads", str(args.threads)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    print(f"[disk_tier_check] phase {phase} ...", flush=True)
    subprocess.run(cmd, check=True, env=env, cwd=Path(__file__).resolve().parents[2])
    seconds = time.perf_counter() - t0
    print(f"[disk_tier_check] phase {phase}: {seconds:.0f} s", flush=True)
    return seconds


def _by_request(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["conversation"], r["turn"]): r for r in rows}


def summarize(work: Path, args: argparse.Namespace, seconds: dict[str, float]) -> dict[str, Any]:
    from kvboost.lab.environment import describe_environment

    single, a, b, c = (json.loads((work / f"{n}.json").read_text()) for n in ("single", "A", "B", "C"))
    crash, latency = (json.loads((work / f"{n}.json").read_text()) for n in ("crash", "latency"))
    one, cold = _by_request(single["reuse"]), _by_request(single["cold"])
    # (a) restart
    table, per_turn = [], {}
    for r in b["rows"]:
        key = (r["conversation"], r["turn"])
        ref = one[key]
        table.append({"conversation": key[0], "turn": key[1], "prompt_tokens": r["prompt_tokens"],
                      "cached_single_process": ref["cached_tokens"], "cached_process_B": r["cached_tokens"],
                      "greedy_equal_cold": r["output_ids"] == cold[key]["output_ids"],
                      "ttft_ms_single": ref["ttft_ms"], "ttft_ms_B": r["ttft_ms"],
                      "ttft_ms_cold": cold[key]["ttft_ms"]})  # fmt: skip
        t = per_turn.setdefault(key[1], {"prompt_tokens": 0, "cached_single": 0, "cached_B": 0})
        t["prompt_tokens"] += r["prompt_tokens"]
        t["cached_single"] += ref["cached_tokens"]
        t["cached_B"] += r["cached_tokens"]
    for t in per_turn.values():
        t["reuse_single"] = round(t["cached_single"] / t["prompt_tokens"], 4)
        t["reuse_B"] = round(t["cached_B"] / t["prompt_tokens"], 4)
    a_equal = sum(r["output_ids"] == cold[(r["conversation"], r["turn"])]["output_ids"] for r in a["rows"])
    restart = {
        "requests_A": len(a["rows"]), "requests_B": len(b["rows"]),
        "A_greedy_equal_cold": f"{a_equal}/{len(a['rows'])}",
        "A_files_after_exit": a["files_after_exit"], "A_bytes_after_exit": a["bytes_after_exit"],
        "B_at_start": b["at_start"],
        "B_reuse_equal_single_process_every_request": all(
            x["cached_single_process"] == x["cached_process_B"] for x in table),
        "B_greedy_equal_cold": f"{sum(x['greedy_equal_cold'] for x in table)}/{len(table)}",
        "reuse_per_turn": {str(k): v for k, v in sorted(per_turn.items())},
        "B_ttft_ms_median": statistics.median(x["ttft_ms_B"] for x in table),
        "single_ttft_ms_median_same_requests": statistics.median(x["ttft_ms_single"] for x in table),
        "cold_ttft_ms_median_same_requests": statistics.median(x["ttft_ms_cold"] for x in table),
        "B_stats": b["stats"], "single_process_stats": single["stats"], "requests": table,
    }  # fmt: skip
    # (b) damage
    c_equal = [r["output_ids"] == cold[(r["conversation"], r["turn"])]["output_ids"] for r in c["rows"]]
    c_rows = _by_request(c["rows"])
    for d in c["damaged"]:  # the turn-4 request that needed the damaged chunk (B had cached all of it)
        row = c_rows[(d["conversation"], 4)]
        d.update(turn4_prompt_tokens=row["prompt_tokens"], turn4_cached_tokens=row["cached_tokens"],
                 turn4_exact_hit_tokens=row["exact_hit_tokens"])  # fmt: skip
    damage = {
        "note": "C replays the turns B served, so undamaged prompts are cached up to their last token; a damaged "
                "chunk ends the exact hits there (later chunks may still be content hits) and is recomputed",
        "damaged_records": c["damaged"], "dropped_and_counted": c["stats"]["corrupt_entries_dropped"],
        "dropped_at_start_by_header_scan": c["dropped_at_start"],
        "damaged_files_left_on_disk": c["damaged_files_still_on_disk_as_damaged"],
        "C_greedy_equal_cold": f"{sum(c_equal)}/{len(c_equal)}",
        "C_reuse_ratio": c["stats"]["reuse_ratio"], "B_reuse_ratio_same_turns": b["stats"]["reuse_ratio"],
    }  # fmt: skip
    # (c) latency
    per_mib_prefill = statistics.median(p["ms_per_mib_of_kv"] for p in latency["prefill"])
    lat = {**latency, "prefill_ms_per_mib_of_kv_median": per_mib_prefill,
           "speedup_of_a_disk_load_over_prefill_page_cache_dropped": {
               str(x["tokens"]): round(per_mib_prefill / x["ms_per_mib_page_cache_dropped"], 1)
               for x in latency["disk_get"]}}  # fmt: skip
    return {
        "command": "python -m experiments.checks.disk_tier_check " + shlex.join(sys.argv[1:]),
        "config": {"model": "bundled SmolLM2-135M-Instruct fp32 CPU", "max_new_tokens": MAX_NEW_TOKENS,
                   "trace": {"num_conversations": args.conversations, "max_turns": 6, "min_turns": 6,
                             "max_prompt_tokens": args.max_prompt_tokens},
                   "cache": _tiers(args, Path("<folder>")), "torch_threads": args.threads,
                   "crash_writers": args.crash_writers},  # fmt: skip
        "environment": describe_environment(),
        "seconds": {k: round(v, 1) for k, v in seconds.items()},
        "restart": restart, "crash": crash, "damage": damage, "latency": lat,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--workdir", type=Path, default=None, help="scratch folder (default: a temp dir, removed)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--memory-capacity", default="32MiB", help="memory tier budget (~730 tokens of KV)")
    p.add_argument("--disk-capacity", default="4GiB")
    p.add_argument("--crash-writers", type=int, default=50)
    p.add_argument("--crash-seconds", type=float, default=6.0, help="kills land in [0.5, this] s after start")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1 is faster on 2 shared cores)")
    p.add_argument("--phase", choices=sorted(PHASES), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)


    from experiments.common import set_threads


    set_threads(args.threads)
    if args.phase is not None:
        PHASES[args.phase](args, args.workdir)
        return

    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvboost-disk-check-"))
    work.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    from experiments.sims.token_trace import build_trace

    trace = build_trace(num_conversations=args.conversations, max_turns=6, min_turns=6,
                        max_prompt_tokens=args.max_prompt_tokens)  # fmt: skip
    (work / "trace.json").write_text(json.dumps(
        [{"conversation": r.conversation_id, "turn": r.turn, "ids": list(r.token_ids)} for r in trace]))
    seconds["trace"] = time.perf_counter() - t0
    for phase in ("crash", "single", "A", "B", "C", "latency"):
        seconds[phase] = _run_phase(args, work, phase)
    out = summarize(work, args, seconds)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "disk_tier_check.json").write_text(json.dumps(out, indent=1, default=str))
    r, d, cr = out["restart"], out["damage"], out["crash"]
    print(json.dumps({
        "restart_reuse_equal": r["B_reuse_equal_single_process_every_request"], "reuse_per_turn": r["reuse_per_turn"],
        "B_greedy_equal_cold": r["B_greedy_equal_cold"], "crash": {k: cr[k] for k in (
            "killed_by_sigkill", "temp_files_left_by_kills", "indexed_at_open", "served_corrupt",
            "corrupt_dropped_at_open")},
        "damage": {k: d[k] for k in ("dropped_and_counted", "C_greedy_equal_cold")},
        "latency_ms_per_mib": [(x["tokens"], x["ms_per_mib_page_cache_dropped"], x["ms_per_mib_warm"])
                               for x in out["latency"]["disk_get"]],
        "prefill_ms_per_mib": out["latency"]["prefill_ms_per_mib_of_kv_median"],
    }, indent=1))  # fmt: skip
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
