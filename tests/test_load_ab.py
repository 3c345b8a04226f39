"""experiments/bench/load_ab.py: after / before ratios of ABBA load-test runs."""

from __future__ import annotations

import json

from experiments.bench.load_ab import main


def summary(throughput: float, tpot_p50: float, ttft_p50: float) -> dict:
    return {"request_throughput": throughput, "output_token_throughput": 32 * throughput,
            "tpot_ms": {"p50": tpot_p50}, "ttft_ms": {"p50": ttft_p50, "p99": 2 * ttft_p50},
            "itl_ms": {"p50": tpot_p50}, "e2e_ms": {"p50": 10 * ttft_p50}, "output_tokens": 100,
            "cached": {"fraction": 0.5}}  # fmt: skip


def test_ratios_of_the_means_and_their_spread_over_run_pairs(tmp_path):
    files = {}
    for name, s in {"b1": summary(1.0, 500, 1000), "b2": summary(2.0, 500, 3000),
                    "a1": summary(3.0, 250, 1000), "a2": summary(3.0, 250, 1000)}.items():  # fmt: skip
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps({"summary": s}))
    text = main(["--before", str(files["b1"]), str(files["b2"]), "--after", str(files["a1"]), str(files["a2"]),
                 "--out", str(tmp_path / "t.md")])  # fmt: skip
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines()[2:]}
    # throughput: mean 3.0 / mean 1.5 = 2.0; per pair 3/1 = 3.0 and 3/2 = 1.5
    assert "| 2.000 [1.500-3.000] |" in rows["request throughput (req/s)"]
    # decode tok/s per request = 1000 / TPOT p50: 4 vs 2 -> 2.0 on every pair
    assert "| 2.000 [2.000-2.000] |" in rows["decode tok/s per request (1000 / TPOT p50)"]
    # TTFT p50: mean 1000 / mean 2000 = 0.5; pairs 1000/1000 = 1.0, 1000/3000 = 0.333
    assert "| 0.500 [0.333-1.000] |" in rows["TTFT p50 (ms)"]
    assert (tmp_path / "t.md").read_text().strip() == text.strip()
