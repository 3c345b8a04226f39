"""experiments/bench/bench_prefill_paths.py on the bundled model: a tiny run, and its shape parser."""

from __future__ import annotations

import argparse
import json

import pytest

from experiments.bench.bench_prefill_paths import main
from kvboost.lab.report import cached_new_shape

pytestmark = pytest.mark.integration


def test_shapes_are_parsed_and_checked():
    assert cached_new_shape("1000:255") == (1000, 255)
    for bad in ("10", "a:3", "5:0"):
        with pytest.raises(argparse.ArgumentTypeError):
            cached_new_shape(bad)


def test_a_small_run_writes_both_paths_and_finds_them_bit_equal(tmp_path):
    results = main(["--dtypes", "float32", "--shapes", "16:5", "0:7", "--rounds", "2", "--threads", "1",
                    "--out", str(tmp_path)])  # fmt: skip
    row = results["float32"]["shapes"][0]
    assert len(row["ttft_ms"]["hf"]) == len(row["ttft_ms"]["fused"]) == 2
    assert all(r["bit_equal_logits"] == 1.0 for r in results["float32"]["shapes"])
    saved = json.loads((tmp_path / "prefill_paths_float32.json").read_text())
    assert saved["prefill_reason"] == "requested" and (tmp_path / "prefill_paths_float32.md").is_file()
