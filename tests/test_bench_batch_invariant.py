"""experiments/bench/bench_batch_invariant.py on the bundled model: a tiny run, and its shape parser."""

from __future__ import annotations

import json

import pytest

from experiments.bench.bench_batch_invariant import main

pytestmark = pytest.mark.integration


def test_a_small_run_finds_invariant_reuse_exact(tmp_path):
    result = main(["--dtype", "bfloat16", "--shapes", "70:9", "--rounds", "2", "--tokens", "3", "--threads", "1",
                   "--out", str(tmp_path)])  # fmt: skip
    row = result["shapes"][0]
    assert len(row["ttft_ms"]["sdpa"]) == len(row["ttft_ms"]["batch_invariant"]) == 2
    assert row["reuse_equals_cold_logits"]["batch_invariant"] == 1.0
    assert row["reuse_equals_cold_tokens"]["batch_invariant"] == 1.0
    assert result["decode_info"]["batch_invariant"]["decode"] == "eager"
    saved = json.loads((tmp_path / "bench_bfloat16.json").read_text())
    assert saved["shapes"][0]["cached"] == 70 and (tmp_path / "bench_bfloat16.md").is_file()


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        main(["--tokens", "1", "--out", str(tmp_path)])
