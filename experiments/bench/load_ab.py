"""After / before ratios of ``load_test`` runs made in ABBA order (before, after, after, before) on one machine.

    # one server at a time on port 8123, each load test against it (the old side: a worktree of the old commit)
    (cd /tmp/kvboost-before && PYTHONPATH=$PWD python -m kvboost.serving --port 8123) &   # ... then kill it
    python -m experiments.bench.load_test --url http://127.0.0.1:8123/v1 --users 32 --turns 4 --concurrency 32 \
        --max-tokens 32 --warmup 4 --name before_1 --out OUT
    python -m experiments.bench.load_ab --before OUT/before_1.json OUT/before_2.json \
        --after OUT/after_1.json OUT/after_2.json --out OUT/load_ab.md

Per metric: each side's runs, and after / before of the sides' means (throughput, decode tok/s: > 1 is better after;
latencies: < 1 is better after), with the lowest and highest ratio over the run pairs (every after run against every
before run) as its spread. Output tokens and the cached fraction are printed for both sides: they should be equal.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

METRICS = [  # (label, how to read it from a summary, higher is better)
    ("request throughput (req/s)", lambda s: s["request_throughput"], True),
    ("output token throughput (tok/s)", lambda s: s["output_token_throughput"], True),
    ("decode tok/s per request (1000 / TPOT p50)", lambda s: 1000.0 / s["tpot_ms"]["p50"], True),
    ("TTFT p50 (ms)", lambda s: s["ttft_ms"]["p50"], False),
    ("TTFT p99 (ms)", lambda s: s["ttft_ms"]["p99"], False),
    ("ITL p50 (ms)", lambda s: s["itl_ms"]["p50"], False),
    ("end-to-end p50 (ms)", lambda s: s["e2e_ms"]["p50"], False),
    ("output tokens", lambda s: s["output_tokens"], True),
    ("cached fraction of prompt tokens", lambda s: s["cached"]["fraction"], True),
]


def table(before: list[dict], after: list[dict]) -> str:
    rows = ["| metric | before runs | after runs | after / before (means) [min-max over run pairs] |",
            "|---|---|---|---|"]  # fmt: skip
    for label, read, _ in METRICS:
        b, a = [read(s) for s in before], [read(s) for s in after]
        pairs = [x / y for x, y in itertools.product(a, b) if y]
        ratio = statistics.mean(a) / statistics.mean(b) if statistics.mean(b) else float("nan")
        fmt = (lambda v: f"{v:.3f}") if max(b + a) < 10 else (lambda v: f"{v:.1f}")
        rows.append(f"| {label} | {', '.join(map(fmt, b))} | {', '.join(map(fmt, a))} | {ratio:.3f} "
                    f"[{min(pairs):.3f}-{max(pairs):.3f}] |")  # fmt: skip
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", nargs="+", required=True, help="load_test JSON files of the old side")
    parser.add_argument("--after", nargs="+", required=True, help="load_test JSON files of the new side")
    parser.add_argument("--out", help="also write the table here (markdown)")
    args = parser.parse_args(argv)
    summaries = {side: [json.loads(Path(f).read_text())["summary"] for f in getattr(args, side)]
                 for side in ("before", "after")}  # fmt: skip
    text = table(summaries["before"], summaries["after"])
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return text


if __name__ == "__main__":
    main()
