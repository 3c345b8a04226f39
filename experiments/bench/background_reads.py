"""Background reads of a prompt's chain from the disk tier: on (``background_bytes`` 256 MiB) vs off (0).

Setting: a new process (new engine, empty memory tier) serves prompts whose KV the disk tier holds, the case the
background reader is for. The lookup hands the prompt's chain to the disk tier's reader thread before it walks
it, so reading and decoding chunk ``i + 1`` (file read, checksum, safetensors decode) overlaps what the request
thread does with chunk ``i`` (promotion into memory, which demotes older entries back to disk when memory is
small: a tensor snapshot and a hand-off to the writer).

Method: real ShareGPT chats (chat template, 3-4 turns, about 600-1500 tokens) on the bundled SmolLM2-135M (fp32,
CPU), 64-token chunks, are stored once in a master disk folder. Each trial copies the folder, syncs it and drops
the copies from the page cache (``posix_fadvise(DONTNEED)``, as a cold restart would find them), opens an engine
with ``cache=[memory 64MiB, disk]`` and the arm's ``background_bytes``, and serves every chat followed by a new
question (1 new token). Arms alternate per trial (ABBA), so both see the same files in the same state. Per
request: ``lookup_ms`` (chunking, hashing and the lookup, where the disk reads happen) and TTFT; the figures are
per-request ratios off / on (median and quartiles) and the means.

``--read-latency-ms 0,2``: besides this machine's disk as it is (0), an emulated slower medium (a network disk or a
remote store): each record read first sleeps that long (a wait that releases the GIL, as real I/O does), in both
arms alike.

    python -m experiments.bench.background_reads --trials 4 --prompts 5 --read-latency-ms 0,2

Writes ``background_reads.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from experiments.common import percentile

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "disk_tier"
ARMS = {"off": 0, "on": "256MiB"}


def _drop_page_cache(folder: Path) -> int:
    """Sync, then ask the kernel to drop every file under ``folder`` from the page cache; returns the file count."""
    os.sync()
    count = 0
    for path in folder.rglob("*.kvr"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        count += 1
    return count


def _quartiles(values: list[float]) -> dict[str, float]:
    """Median and quartiles by the project's one ``percentile`` (``experiments/common.py``)."""
    return {"median": percentile(values, 50), "p25": percentile(values, 25), "p75": percentile(values, 75),
            "min": min(values), "max": max(values)}  # fmt: skip


def run(trials: int, num_prompts: int, memory: str, work: Path, latencies: list[float]) -> dict[str, Any]:
    import torch

    from experiments.checks.kv_quant_check import _prompts
    from experiments.common import compose_run_config
    from kvboost.build import build_engine
    from kvboost.cache import disk as disk_mod
    from kvboost.models.loading import load_model_and_tokenizer

    real_read = disk_mod._read_bytes

    model, tokenizer, path = load_model_and_tokenizer(None, dtype="float32")
    chunker = {"name": "fixed", "chunk_size": 64}
    texts = _prompts(num_prompts, tokenizer)
    question = tokenizer("\nUser: Can you summarise that in one line?\nAssistant:")["input_ids"]
    master = work / "master"
    master_cfg = compose_run_config(chunker=chunker, cache={"name": "disk", "path": str(master), "capacity": "8GiB"})
    with build_engine(master_cfg, model, tokenizer, model_identity=str(path)) as engine:
        ids = [tokenizer(t)["input_ids"] for t in texts]
        with torch.inference_mode():
            for prompt_ids in ids:
                engine.warm(prompt_ids)
    stored_mib = sum(p.stat().st_size for p in master.rglob("*.kvr")) / 2**20
    prompts = [p + question for p in ids]

    rows: list[dict[str, Any]] = []
    order = [("off", "on"), ("on", "off")]
    for latency, trial in ((lat, t) for lat in latencies for t in range(trials)):

        def slow_read(file: Path, _delay: float = latency / 1e3) -> Any:
            time.sleep(_delay)
            return real_read(file)

        disk_mod._read_bytes = slow_read if latency else real_read
        for arm in order[trial % 2]:
            folder = work / f"l{latency}-t{trial}-{arm}"
            shutil.copytree(master, folder)
            dropped = _drop_page_cache(folder)
            cache = [{"name": "memory", "capacity": memory},
                     {"name": "disk", "path": str(folder), "capacity": "8GiB", "background_bytes": ARMS[arm]}]
            with build_engine(compose_run_config(chunker=chunker, cache=cache), model, tokenizer,
                              model_identity=str(path)) as engine:  # fmt: skip
                for i, prompt in enumerate(prompts):
                    r = engine.generate(prompt, max_new_tokens=1)
                    rows.append({"read_latency_ms": latency, "trial": trial, "arm": arm, "prompt": i,
                                 "prompt_tokens": len(prompt),
                                 "cached_tokens": r.cached_tokens, "ttft_ms": r.ttft_ms,
                                 "lookup_ms": r.extra["lookup_ms"], "files_dropped_from_page_cache": dropped})
                disk = engine.cache_stats()["per_tier"]["disk"]
                rows[-1]["disk_stats"] = disk
            shutil.rmtree(folder, ignore_errors=True)
            mine = [r for r in rows if (r["read_latency_ms"], r["trial"], r["arm"]) == (latency, trial, arm)]
            print(f"latency {latency} ms, trial {trial} {arm:>3}: lookup_ms {[round(r['lookup_ms'], 1) for r in mine]}",
                  flush=True)  # fmt: skip
    disk_mod._read_bytes = real_read

    def pick(latency: float, arm: str, metric: str) -> dict[tuple[int, int], float]:
        return {(r["trial"], r["prompt"]): r[metric] for r in rows if r["arm"] == arm and r["read_latency_ms"] == latency}

    out: dict[str, Any] = {}
    for latency in latencies:
        cell = out[f"read_latency_{latency:g}ms"] = {}
        for metric in ("lookup_ms", "ttft_ms"):
            off, on = pick(latency, "off", metric), pick(latency, "on", metric)
            ratios = [off[k] / on[k] for k in off]
            cell[metric] = {"off_mean": statistics.fmean(off.values()), "on_mean": statistics.fmean(on.values()),
                            "ratio_off_over_on": _quartiles(ratios), "pairs": len(ratios)}  # fmt: skip
    cached = {(r["read_latency_ms"], r["trial"], r["prompt"], r["arm"]): r["cached_tokens"] for r in rows}
    same_reuse = all(cached[(lat, t, i, "off")] == cached[(lat, t, i, "on")] for lat, t, i, _ in cached)
    return {
        "command": "python -m experiments.bench.background_reads " + shlex.join(sys.argv[1:]),
        "model": str(path),
        "dtype": "float32",
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "prompts": len(prompts),
        "prompt_tokens": [len(p) for p in prompts],
        "stored_mib": stored_mib,
        "memory_tier": memory,
        "trials": trials,
        "same_reuse_both_arms": same_reuse,
        "figures": out,
        "rows": rows,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--memory", default="64MiB", help="memory tier capacity in front of the disk tier")
    parser.add_argument("--read-latency-ms", default="0",
                        help="comma-separated emulated per-record read latencies (0: the disk as it is)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    latencies = [float(x) for x in args.read_latency_ms.split(",")]
    with tempfile.TemporaryDirectory(prefix="kvboost-bg-") as tmp:
        t0 = time.perf_counter()
        result = run(args.trials, args.prompts, args.memory, Path(tmp), latencies)
        result["seconds"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / "background_reads.json"
    target.write_text(json.dumps(result, indent=2) + "\n")
    for setting, cell in result["figures"].items():
        for metric, f in cell.items():
            r = f["ratio_off_over_on"]
            print(f"{setting} {metric}: off {f['off_mean']:.1f} ms, on {f['on_mean']:.1f} ms; off/on per request "
                  f"median {r['median']:.3f} (p25 {r['p25']:.3f}, p75 {r['p75']:.3f}), {f['pairs']} pairs")
    print(f"same reuse in both arms: {result['same_reuse_both_arms']}; wrote {target}")


if __name__ == "__main__":
    main()
