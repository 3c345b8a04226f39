"""Cost of one ``KVPool.alloc`` that must evict a cached entry, against the pool's size and the number of cached
entries requests hold, on two source trees in one run (this tree and another checkout, e.g. ``/work/main``).

The scene: a pool of ``blocks`` blocks, every block cached (one entry per block, in a ``KVStore`` whose first tier
is the pool), no block free. ``held`` of the entries -- the *oldest* in the policy's order -- are referenced by a
"running request" (their blocks are in use), the rest are idle. Each measured ``alloc(1)`` must evict one entry:
the policy's first evictable one, which sits behind every held entry. Before the evictable queue (issue 61) the
victim search walked over all held entries and checked each one's blocks, on every eviction. After each
measurement the block is cached again as a new entry and released (untimed), so every measured call sees the
same scene.

Each tree runs in its own subprocess (``--tree``: the checkout whose ``kvboost`` is imported), alternating, so the
two trees see the same machine load. Writes one JSON with the per-alloc median and p90 in microseconds, and the
median cost of taking and giving back references on 64 idle cached blocks (a hit and its release: what the
queue's bookkeeping adds elsewhere).

    python experiments/bench/bench_alloc.py --trees /work/wt/freeq /work/main \
        --out experiments/results/alloc/alloc_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _measure(blocks: int, held: int, policy: str, repeats: int) -> dict[str, float]:
    """One scene, in this process (kvboost imported from the tree on ``sys.path[0]``)."""
    from kvboost.cache.block_run import BlockRun
    from kvboost.cache.entry import KVEntry
    from kvboost.cache.pool_tier import PoolTier
    from kvboost.cache.store import KVStore
    from kvboost.kv import KVPool

    pool = KVPool(num_layers=1, num_kv_heads=1, head_dim=1, num_blocks=blocks, block_size=16)
    store = KVStore([PoolTier(pool, policy)])
    serial = iter(range(10**9))

    def cache_block(block: int) -> None:
        n = next(serial)
        store.put(KVEntry(f"k{n}", f"s{n}", "root", tuple(range(16)), 0, BlockRun(pool, [block], 0, 16)))

    ids = pool.alloc(blocks)
    for b in ids:
        cache_block(b)
    running = ids[:held]  # the oldest entries: a running request holds their blocks
    pool.decref(ids[held:])  # the rest are idle
    assert pool.num_free == 0 and pool.num_idle == blocks - held
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        (b,) = pool.alloc(1)
        samples.append((time.perf_counter_ns() - t0) / 1e3)
        cache_block(b)
        pool.decref([b])
    pool.decref(running)
    samples.sort()
    # What the evictable queue costs elsewhere: a hit takes references on idle cached blocks and its request gives
    # them back (each block turning referenced / idle is reported to the pool tier). 64 blocks: a 1k-token prefix.
    idle = [b for b in range(blocks) if pool.refcount(b) == 0 and pool.is_cached(b)][:64]
    hits = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        pool.incref(idle)
        pool.decref(idle)
        hits.append((time.perf_counter_ns() - t0) / 1e3)
    return {"median_us": statistics.median(samples), "p90_us": samples[int(0.9 * (len(samples) - 1))],
            "evictions": pool.stats.reclaimed_blocks, "hit_blocks": len(idle),
            "hit_release_median_us": statistics.median(hits)}  # fmt: skip


def _child(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.tree)
    import kvboost

    assert Path(kvboost.__file__).resolve().is_relative_to(Path(args.tree).resolve()), kvboost.__file__
    rows = []
    for blocks in args.blocks:
        for frac in args.held_fractions:
            held = int(blocks * frac)
            rows.append({"blocks": blocks, "held": held, **_measure(blocks, held, args.policy, args.repeats)})
    print(json.dumps(rows))


def _git_head(tree: str) -> str:
    try:
        return subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=[str(Path(__file__).resolve().parents[2])])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--held-fractions", type=float, nargs="+", default=[0.0, 0.5, 0.9])
    ap.add_argument("--policies", nargs="+", default=["lru", "lfu", "s3fifo"])
    ap.add_argument("--repeats", type=int, default=200)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--tree", help=argparse.SUPPRESS)  # child mode: one tree, one policy, every scene
    ap.add_argument("--policy", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tree:
        _child(args)
        return
    rows = []
    for policy in args.policies:
        for tree in args.trees:  # alternating per policy: both trees under the same load
            cmd = [sys.executable, __file__, "--tree", tree, "--policy", policy, "--repeats", str(args.repeats),
                   "--blocks", *map(str, args.blocks), "--held-fractions", *map(str, args.held_fractions)]
            scenes = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True,
                                               env={**os.environ, "PYTHONPATH": tree}).stdout)  # fmt: skip
            for res in scenes:
                rows.append({"tree": tree, "commit": _git_head(tree), "policy": policy, **res})
                print(f"{policy:7s} blocks={res['blocks']:6d} held={res['held']:6d} {tree:22s} "
                      f"median {res['median_us']:9.1f} us  p90 {res['p90_us']:9.1f} us", flush=True)
    result = {"bench": "bench_alloc", "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "load_avg_at_end": os.getloadavg(), "repeats": args.repeats, "rows": rows}  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
