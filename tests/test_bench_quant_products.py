"""experiments/bench/bench_quant_products.py: a tiny run against this commit's own kernel (built a second time from
git), which must find the two builds bit-equal and write both reports."""

from __future__ import annotations

import json
import subprocess

import pytest

from experiments.bench.bench_quant_products import ROOT, main
from kvboost.runtime.quant_step import extension_unavailable_reason

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(extension_unavailable_reason() is not None, reason=str(extension_unavailable_reason())),
]


def _git_ok() -> bool:
    return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(not _git_ok(), reason="not a git checkout")
def test_a_small_run_against_head_is_bit_equal_and_writes_reports(tmp_path):
    assert main(["--baseline-rev", "HEAD", "--rows", "1", "3", "--rounds", "2", "--repeats", "1", "--threads", "1",
                 "--out", str(tmp_path)]) == 0  # fmt: skip
    saved = json.loads((tmp_path / "products.json").read_text())
    assert saved["mismatches"] == [] and saved["act"] == "int16"
    assert set(saved["rows"]) == {"1", "3"}
    for entry in saved["rows"].values():
        assert entry["baseline"]["layer_ms"] > 0 and entry["this tree"]["head_ms"] > 0
        assert len(entry["layer_speedup"]) == 3
    assert "| 3 |" in (tmp_path / "products.md").read_text()


@pytest.mark.skipif(not _git_ok(), reason="not a git checkout")
def test_an_unknown_revision_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="'no-such-revision-xyz' is not a commit"):
        main(["--baseline-rev", "no-such-revision-xyz", "--out", str(tmp_path)])
