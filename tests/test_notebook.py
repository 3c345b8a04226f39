"""notebooks/analysis.ipynb executed end to end (nbclient) on real results of two tiny runs.

The runs are made the way tests/test_runner.py makes them (Hydra compose, a tiny random model, the bundled
tokenizer): a multi-turn ShareGPT replay and a single-turn RAG run (which measures accuracy), laid out as a Hydra
multirun sweep. The notebook runs in a Jupyter kernel of this very interpreter: a kernel spec written into a
temporary JUPYTER_PATH by ipykernel, so nothing depends on which kernels (if any) the machine has registered.
"""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest

from kvboost.paths import CONFIG_DIR

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "analysis.ipynb"
KERNEL = "kvboost-test-python"
PNG = b"\x89PNG\r\n\x1a\n"

SHAREGPT = "0_workload=sharegpt_replay"
RAG = "1_workload=rag_reorder"
RUNS = {
    SHAREGPT: ["workload=sharegpt_replay", "workload.num_conversations=2", "workload.max_turns=2",
               "workload.max_new_tokens=2", "workload.max_prompt_tokens=300"],
    RAG: ["workload=rag_reorder", "workload.num_documents=4", "workload.num_queries=2", "workload.docs_per_query=2",
          "workload.doc_tokens=64", "workload.max_new_tokens=2"],
}  # fmt: skip
SHARED = ["logger=none", "warmup=false"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A multirun-like folder with two tiny runs, each with the .hydra/overrides.yaml Hydra would write."""
    from hydra import compose, initialize_config_dir
    from kvboost_testkit.tiny import tiny_model
    from transformers import AutoTokenizer

    from kvboost.lab.runner import run_experiment
    from kvboost.models.loading import bundled_model_dir

    tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir())
    root = tmp_path_factory.mktemp("multirun") / "2025-01-01" / "12-00-00"
    for name, overrides in RUNS.items():
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*overrides, *SHARED])
        model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048)
        run_experiment(cfg, out_dir=root / name, model=model, tokenizer=tokenizer)
        (root / name / ".hydra").mkdir()
        (root / name / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in [*SHARED, overrides[0]]))
    return root


@pytest.fixture(scope="module")
def jupyter_dir(tmp_path_factory) -> Path:
    """A JUPYTER_PATH entry holding a kernel spec that runs this interpreter (ipykernel writes its argv)."""
    from ipykernel.kernelspec import write_kernel_spec

    path = tmp_path_factory.mktemp("jupyter")
    spec = write_kernel_spec(path / "kernels" / KERNEL, overrides={"display_name": "kvboost tests"})
    argv = json.loads((Path(spec) / "kernel.json").read_text())["argv"]
    assert argv[0] == sys.executable
    return path


def execute(jupyter_dir: Path, tmp_path: Path, **env: str):
    """Execute the notebook in a fresh kernel with the given KVBOOST_* variables; returns the executed notebook."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    with pytest.MonkeyPatch.context() as mp:  # the kernel inherits os.environ when it starts
        for name in ("KVBOOST_RESULTS", "KVBOOST_FIGURES", "KVBOOST_MODE", "KVBOOST_REFERENCE", "KVBOOST_X"):
            mp.delenv(name, raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        mp.setenv("JUPYTER_PATH", str(jupyter_dir))
        mp.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "jupyter-runtime"))
        mp.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
        client = nbclient.NotebookClient(nb, timeout=180, kernel_name=KERNEL,
                                         resources={"metadata": {"path": str(ROOT)}})
        client.execute()
    return nb


def cell_text(cell) -> str:
    """Everything a code cell printed or displayed as text."""
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] in ("display_data", "execute_result"):
            parts += [out["data"].get("text/plain", ""), out["data"].get("text/markdown", "")]
    return "".join(parts)


def tagged(nb, tag: str):
    cells = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"one cell tagged {tag!r} expected"
    return cells[0]


def images(cell) -> int:
    return sum("image/png" in out.get("data", {}) for out in cell.get("outputs", []))


def assert_png(path: Path) -> None:
    assert path.is_file(), f"figure missing: {path}"
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 5000, f"not a drawn PNG: {path} ({len(data)} bytes)"


def test_committed_notebook_is_valid_and_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "commit the notebook with outputs cleared"
    params = nb.cells[1]
    assert "parameters" in params.metadata.get("tags", [])
    assert 'os.environ.get("KVBOOST_RESULTS"' in params.source


def test_notebook_draws_every_figure_of_a_sweep(sweep, jupyter_dir, tmp_path):
    from kvboost.lab.report import fmt_speedup, fmt_spread

    figures = tmp_path / "figures"
    nb = execute(jupyter_dir, tmp_path, KVBOOST_RESULTS=str(sweep), KVBOOST_FIGURES=str(figures))
    errors = [out for c in nb.cells for out in c.get("outputs", []) if out["output_type"] == "error"]
    assert not errors

    # every figure saved, as a real PNG; per run in a folder named after its overrides, the comparison apart
    expected = {
        SHAREGPT: ["ttft_by_turn.png", "speedup.png", "reuse_by_turn.png", "reuse_split.png", "quality.png"],
        RAG: ["ttft_by_mode.png", "speedup.png", "reuse_split.png", "quality.png", "accuracy.png"],
        "comparison": ["ttft_by_turn.png", "reuse_by_turn.png", "quality_vs_ttft.png", "quality_scatter.png"],
    }
    for folder, names in expected.items():
        for name in names:
            assert_png(figures / folder / name)
    assert not (figures / SHAREGPT / "accuracy.png").exists()  # ShareGPT has no answers: no accuracy figure
    assert "no accuracy measured" in cell_text(tagged(nb, "accuracy"))
    n_figures = sum(len(v) for v in expected.values())
    assert sum(images(c) for c in nb.cells) == n_figures  # each displayed once, inline
    listing = cell_text(tagged(nb, "saved"))
    assert f"{n_figures} figure(s)" in listing and f"{RAG}/accuracy.png" in listing

    # the numbers printed under the figures are the summaries' own
    for run in (SHAREGPT, RAG):
        summary = json.loads((sweep / run / "summary.json").read_text())
        kv = summary["modes"]["kvboost"]
        overall = kv["overall"]
        assert fmt_spread(overall["ttft_ms_p50"], overall["ttft_ms_p10"], overall["ttft_ms_p90"]) in cell_text(
            tagged(nb, "tables"))
        turn1 = kv["by_turn"]["1"]
        assert f"turn 1 {fmt_spread(turn1['ttft_ms_p50'], turn1['ttft_ms_p10'], turn1['ttft_ms_p90'])}" in cell_text(
            tagged(nb, "ttft"))
        speedup = fmt_speedup(overall["speedup_vs_baseline_p50"], overall["speedup_vs_baseline_ci95"])
        assert f"kvboost vs baseline: {speedup}" in cell_text(tagged(nb, "speedup"))
        assert f"kvboost: reuse {overall['reuse_ratio']:.1%}" in cell_text(tagged(nb, "reuse"))
        quality = summary["quality"]["kvboost"]
        assert f"kvboost: greedy match {quality['greedy_match_rate']:.1%} of {quality['n']} requests" in cell_text(
            tagged(nb, "quality"))
    accuracy = json.loads((sweep / RAG / "summary.json").read_text())["accuracy"]["kvboost"]
    assert f"kvboost: accuracy {accuracy['accuracy']:.1%} ({accuracy['n_correct']} of {accuracy['n']}" in cell_text(
        tagged(nb, "accuracy"))
    for tag in ("ttft", "speedup", "reuse", "quality"):
        assert images(tagged(nb, tag)) >= 2, tag

    # the comparison: labelled by the overrides that differ, the table's numbers from build_rows
    comparison = cell_text(tagged(nb, "comparison"))
    assert "workload=sharegpt_replay" in comparison and "workload=rag_reorder" in comparison
    with (figures / "comparison" / "comparison.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == ["workload=sharegpt_replay", "workload=rag_reorder"]
    for row, run in zip(rows, (SHAREGPT, RAG)):
        summary = json.loads((sweep / run / "summary.json").read_text())
        assert float(row["ttft_ms_p50"]) == pytest.approx(summary["modes"]["kvboost"]["overall"]["ttft_ms_p50"])
    assert (figures / "comparison" / "comparison.md").read_text().count("| workload=") == 2


def test_one_run_and_the_default_figures_folder(sweep, jupyter_dir, tmp_path):
    run = tmp_path / "outputs" / "2025-01-01" / "12-00-00"
    shutil.copytree(sweep / SHAREGPT, run)
    nb = execute(jupyter_dir, tmp_path, KVBOOST_RESULTS=str(run))
    figures = run / "figures"  # default: inside the results folder, no per-run subfolder for a single run
    for name in ("ttft_by_turn.png", "speedup.png", "reuse_by_turn.png", "reuse_split.png", "quality.png"):
        assert_png(figures / name)
    assert "one run: nothing to compare" in cell_text(tagged(nb, "comparison"))
    assert not (figures / "comparison").exists()


def test_no_results_is_a_clear_error(jupyter_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(nbclient.exceptions.CellExecutionError) as caught:
        execute(jupyter_dir, tmp_path, KVBOOST_RESULTS=str(empty))
    message = str(caught.value)
    assert "FileNotFoundError" in message and "no summary.json" in message and "KVBOOST_RESULTS" in message
    assert str(empty) in message
