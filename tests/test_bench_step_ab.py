"""experiments/bench/bench_step_ab.py: a tiny run against this commit's own kernels (built a second time from git)
writes both reports; a baseline whose kernels read the packed weights differently is refused."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from experiments.bench.bench_step_ab import ROOT, check_same_packing, main
from kvboost.runtime.quant_step import extension_unavailable_reason

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(extension_unavailable_reason() is not None, reason=str(extension_unavailable_reason())),
]


def _git_ok() -> bool:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(not _git_ok(), reason="not a git checkout")
def test_a_small_run_against_head_writes_reports(tmp_path):
    assert main(["--baseline-rev", "HEAD", "--rows", "1", "2", "--prompts", "16", "--rounds", "2", "--tokens", "2",
                 "--threads", "1", "--out", str(tmp_path)]) == 0  # fmt: skip
    saved = json.loads((tmp_path / "step_ab.json").read_text())
    assert saved["logits_max_diff_between_builds"] == 0.0  # the same source, the same bits
    assert [r["rows"] for r in saved["decode"]] == [1, 2] and [r["tokens"] for r in saved["prefill"]] == [16]
    for r in saved["decode"]:
        assert r["baseline_ms"] > 0 and r["tree_ms"] > 0 and r["speedup"]["min"] <= r["speedup"]["max"]
    assert saved["decode"][0]["tree_cost_vs_1_rows"] == 1.0
    assert all(len(v) == 2 for v in saved["raw"]["prefill"].values())
    md = (tmp_path / "step_ab.md").read_text()
    assert "| 2 |" in md and "| 16 |" in md


class _Shifted:
    """An extension whose head adds 1 to every logit: what a baseline with another packing looks like."""

    def __init__(self, ext: Any) -> None:
        self._ext = ext

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ext, name)

    def q8_matmul(self, *args: Any) -> Any:
        return self._ext.q8_matmul(*args) + 1.0


def test_a_baseline_with_other_logits_is_refused():
    from kvboost import KVBoost

    engine = KVBoost.from_pretrained(chunked_prompts=True)
    try:
        ext = engine.runner.quantized.ext
        assert check_same_packing(engine, {"baseline": ext, "tree": ext}) == 0.0
        with pytest.raises(SystemExit, match="packing differs"):
            check_same_packing(engine, {"baseline": _Shifted(ext), "tree": ext})
    finally:
        engine.runner.quantized.ext = ext
        engine.close()
