"""experiments/bench/bench_quant_products.py and bench_step_ab.py, the kernels against another revision's: tiny runs
against this commit's own kernels (built a second time from git), which must find the two builds equal and write
both reports; a bench_step_ab baseline whose kernels read the packed weights otherwise is refused; the layouts' A/B
(tiles of 8 against the default packing) gives the same logits and the same products."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from experiments.bench import bench_step_ab
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


def test_the_layouts_products_are_bit_equal(tmp_path):
    from kvboost.runtime.quant_step import quant_isa

    if quant_isa() != "avx512_vnni":
        pytest.skip("wide tiles are read by the avx512_vnni build only")
    assert main(["--layout", "tiles8-vs-wide", "--act", "int8", "--rows", "1", "9", "--rounds", "1", "--repeats", "1",
                 "--threads", "1", "--out", str(tmp_path)]) == 0  # fmt: skip
    saved = json.loads((tmp_path / "products.json").read_text())
    assert saved["mismatches"] == [] and saved["layout"] == "tiles8-vs-wide"
    assert saved["baseline_rev"] == "this tree (tiles of 8)"


@pytest.mark.skipif(not _git_ok(), reason="not a git checkout")
def test_an_unknown_revision_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="'no-such-revision-xyz' is not a commit"):
        main(["--baseline-rev", "no-such-revision-xyz", "--out", str(tmp_path)])


@pytest.mark.skipif(not _git_ok(), reason="not a git checkout")
def test_a_step_ab_run_against_head_writes_reports(tmp_path):
    assert bench_step_ab.main(["--baseline-rev", "HEAD", "--rows", "1", "2", "--prompts", "16", "--rounds", "2", "--tokens", "2",
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
    assert saved["packing"].startswith("both: ")  # HEAD's kernels on a packing they read


def test_a_layouts_ab_times_this_trees_kernels_on_both_packings(tmp_path):
    assert bench_step_ab.main(["--baseline-layout", "tiles8", "--rows", "1", "--prompts", "16", "--rounds", "2",
                               "--tokens", "2", "--threads", "1", "--out", str(tmp_path)]) == 0  # fmt: skip
    saved = json.loads((tmp_path / "step_ab.json").read_text())
    assert saved["baseline_rev"] == "this tree" and saved["packing"].startswith("baseline: tiles of 8; tree: ")
    assert saved["logits_max_diff_between_builds"] == 0.0  # both layouts give the same bits


class _Shifted:
    """An extension whose head negates every logit: what a baseline with another packing looks like."""

    def __init__(self, ext: Any) -> None:
        self._ext = ext

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ext, name)

    def q8_matmul(self, *args: Any) -> Any:
        return -self._ext.q8_matmul(*args)


def test_a_baseline_with_other_logits_is_refused():
    from kvboost import KVBoost

    engine = KVBoost.from_pretrained(chunked_prompts=True)
    try:
        step = engine.runner.quantized
        ext = step.ext
        assert bench_step_ab.check_same_packing(engine, {"baseline": (step, ext), "tree": (step, ext)}) == 0.0
        with pytest.raises(SystemExit, match="packing differs"):
            bench_step_ab.check_same_packing(engine, {"baseline": (step, _Shifted(ext)), "tree": (step, ext)})
    finally:
        bench_step_ab.use(engine, (step, ext))
        engine.close()


def test_words_repack_as_the_quads_of_the_same_codes():
    """bench_step_ab --baseline-layout quads: an int16 rows' wide weight (words) repacked is the int8 rows' packing
    of the same codes (quads), which revisions 74accc5-75455f5 read for int16 rows too."""
    import torch

    from kvboost.runtime.quant_step import Q4Weight

    g = torch.Generator().manual_seed(5)
    q = torch.randint(0, 16, (32, 96), generator=g, dtype=torch.uint8)
    scale, minv = torch.rand(32, 3, generator=g), torch.randn(32, 3, generator=g)
    words, quads = Q4Weight(q, scale, minv, wide_for="int16"), Q4Weight(q, scale, minv, wide_for="int8")
    assert not torch.equal(words.codes.reshape(quads.codes.shape), quads.codes)  # the two byte orders differ
    assert torch.equal(bench_step_ab.words_as_quads(words.codes), quads.codes)


def test_a_small_run_of_every_build_matches_the_scalar_bits_and_writes_reports(tmp_path):
    """bench_quant_isas: every build this CPU runs (those it lacks listed as skipped with the reason) gives the
    scalar build's bits on the bench's weights, and the report holds each build's cost against one row."""
    from experiments.bench.bench_quant_isas import main as isas_main
    from kvboost.runtime.quant_step import QUANT_ISAS

    assert isas_main(["--rows", "1", "2", "--rounds", "1", "--repeats", "1", "--threads", "1",
                      "--out", str(tmp_path)]) == 0  # fmt: skip
    saved = json.loads((tmp_path / "isas.json").read_text())
    assert saved["mismatches_vs_scalar"] == []
    assert set(saved["builds"]) | set(saved["skipped"]) == set(QUANT_ISAS) and "scalar" in saved["builds"]
    for per_rows in saved["builds"].values():
        assert per_rows["1"]["layer_vs_one_row"] == [1.0, 1.0, 1.0] and per_rows["2"]["layer_ms"][0] > 0
    assert "| scalar | 2 |" in (tmp_path / "isas.md").read_text()
