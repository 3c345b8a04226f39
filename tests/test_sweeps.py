"""Sweeps through ``run.py`` itself: a joblib multirun of two tiny jobs, a two-trial Optuna search, and the W&B
offline run folder (group, job type, run name, summary metrics, per-turn table, plots)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvboost_testkit.tiny import tiny_model

from kvboost.lab.runner import run_experiment
from kvboost.paths import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[1]
TINY = ["model=tiny_random", "logger=none", "warmup=false", "workload.num_conversations=1", "workload.max_turns=2",
        "workload.max_new_tokens=2", "workload.max_prompt_tokens=400", "threads=1"]  # fmt: skip

pytestmark = pytest.mark.slow


def _run_py(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "run.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_a_joblib_multirun_of_two_jobs_writes_two_result_folders(tmp_path):
    sweep = tmp_path / "sweep"
    _run_py(["-m", "hydra/launcher=local", *TINY, "seed=0,1", f"hydra.sweep.dir={sweep}"], tmp_path)
    summaries = sorted(sweep.glob("*/summary.json"))
    names = [p.parent.name for p in summaries]
    assert len(names) == 2 and names[0].startswith("0_") and names[1].startswith("1_")
    assert "seed=0" in names[0] and "seed=1" in names[1]
    for number, path in enumerate(summaries):
        run = json.loads(path.read_text())["run"]
        assert run["overrides"][-1] == f"seed={number}" and run["job_num"] == number
        assert run["sweep_dir"] == str(sweep)
    # the runs compare with one command
    subprocess.run([sys.executable, "-m", "kvboost.lab.compare", str(sweep)], cwd=ROOT, check=True, capture_output=True)
    table = (sweep / "comparison.md").read_text()
    assert "seed=0" in table and "seed=1" in table


def test_a_two_trial_optuna_search(tmp_path):
    sweep = tmp_path / "optuna"
    rag = ["workload.num_documents=4", "workload.num_queries=2", "workload.docs_per_query=2", "workload.doc_tokens=64",
           "workload.max_new_tokens=2"]  # fmt: skip
    _run_py(["-m", "experiment=tune_rag", *[t for t in TINY if not t.startswith("workload.")], *rag,
             "hydra.sweeper.n_trials=2", f"hydra.sweep.dir={sweep}"], tmp_path)  # fmt: skip
    result = (sweep / "optimization_results.yaml").read_text()
    assert "best_value" in result and "chunker.chunk_size" in result
    assert len(list(sweep.glob("*/summary.json"))) == 2


def _wandb_payloads(data: bytes) -> bytes:
    """The record payloads of a ``.wandb`` file, joined: the file is a LevelDB-style log (a 7-byte header, then
    32 KiB blocks of chunks with a 7-byte header each: CRC32, length, type), and a record that crosses a block
    boundary is split in two chunks: a string searched in the raw bytes can straddle a chunk header."""
    block, pos, parts = 32768, 7, []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # the block's trailer: padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        if length == 0 and data[pos + 6] == 0:  # zero padding to the block's end
            pos += left
            continue
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
    return b"".join(parts)


def test_wandb_offline_run_folder(tmp_path, capsys, monkeypatch):
    """Offline W&B: the run folder holds the group (sweep folder), job type (experiment), name (overrides), the
    summary metrics under their stable names, the per-turn table and the plots; the sync line is printed."""
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer

    from kvboost.models.loading import bundled_model_dir

    monkeypatch.delenv("WANDB_MODE", raising=False)
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir())
    overrides = ["experiment=chat_replay", "workload.num_conversations=2", "workload.max_turns=2",
                 "workload.max_new_tokens=2", "workload.max_prompt_tokens=400", "warmup=false", "logger=wandb"]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    run_info = {"overrides": overrides, "experiment": "chat_replay", "sweep_dir": "multirun/sweep-under-test", "job_num": 0}
    model = tiny_model("llama", vocab_size=len(tokenizer), max_position_embeddings=2048)
    summary = run_experiment(cfg, out_dir=tmp_path, model=model, tokenizer=tokenizer, run_info=run_info)

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "one offline run folder (W&B defaults to offline)"
    run_dir = runs[0]
    assert f"wandb sync {run_dir}" in capsys.readouterr().out
    # the run's records (protobuf, strings stored as they are): group, job type, name, summary metric names
    records = _wandb_payloads(next(run_dir.glob("run-*.wandb")).read_bytes())
    for expected in ("multirun/sweep-under-test", "chat_replay", "experiment=chat_replay workload.num_conversations=2",
                     "overall/kvboost/ttft_ms_p50", "overall/kvboost/speedup_vs_baseline_p50",
                     "quality/kvboost/greedy_match_rate", "kvboost/ttft_ms"):  # fmt: skip
        assert expected.encode() in records, expected
    assert b"logger=wandb" not in records.split(b"experiment=chat_replay workload")[1][:200]  # not in the name
    # the per-turn table: one row per mode and turn
    table = json.loads(next((run_dir / "files" / "media" / "table").glob("per_turn_*.table.json")).read_text())
    assert table["columns"][:3] == ["mode", "turn", "n"]
    assert len(table["data"]) == sum(len(m["by_turn"]) for m in summary["modes"].values())
    kv_turn2 = next(r for r in table["data"] if r[0] == "kvboost" and r[1] == "2")
    assert kv_turn2[table["columns"].index("ttft_ms_p50")] == pytest.approx(summary["modes"]["kvboost"]["by_turn"]["2"]["ttft_ms_p50"])
    # every plot of the run folder, as an image (files named <plot>_<step>_<hash>.png)
    logged = sorted((run_dir / "files" / "media" / "images" / "plots").glob("*.png"))
    plots = sorted(p.stem for p in tmp_path.glob("*.png"))
    assert plots and [p.name.startswith(f"{stem}_") for p, stem in zip(logged, plots)] == [True] * len(plots)
    assert len(logged) == len(plots)
