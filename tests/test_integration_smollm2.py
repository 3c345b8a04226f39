"""Integration on the bundled SmolLM2-135M-Instruct (marked: deselect with -m 'not integration')."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvboost.quality import reuse_logit_bound

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine():
    from kvboost import KVBoost

    return KVBoost.from_pretrained(dtype="float32")  # the exactness guarantee (1e-4) is fp32's


def test_bundled_model_answers(engine):
    r = engine.generate([{"role": "user", "content": "What is the capital of France?"}], max_new_tokens=12, mode="cold")
    assert "Paris" in r.output_text


def test_exact_reuse_on_the_real_model(engine):
    report = engine.verify_correctness(max_new_tokens=12)
    assert report.passed, report.to_dict()
    # 1e-4 over prefilled rows in fp32; the int16 prefill's own bound where the bundled model prefills from its blocks
    bound = reuse_logit_bound(engine)
    assert all(c.max_abs_logit_diff <= bound for c in report.checks), [c.max_abs_logit_diff for c in report.checks]
    assert all(c.reuse_ratio > 0.5 for c in report.checks)


def test_chat_turns_reuse_history(engine):
    engine.reset_cache()
    history = [{"role": "user", "content": "Give me three tips for writing clear Python code."}]
    r1 = engine.generate(history, max_new_tokens=24)
    history += [{"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "Now one more tip."}]
    cold = engine.generate(history, max_new_tokens=16, mode="cold")
    r2 = engine.generate(history, max_new_tokens=16)
    assert r2.output_ids == cold.output_ids
    assert r2.kv_reuse_ratio > 0.6  # the whole first turn, answer included


def test_run_py_end_to_end(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "run.py", "workload.num_conversations=1", "workload.max_turns=2",
           "workload.max_new_tokens=4", "logger=none", "model.dtype=float32", f"hydra.run.dir={out}"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TTFT" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["quality"]["kvboost"]["greedy_match_rate"] == 1.0
    assert (out / "records.jsonl").exists() and (out / "ttft_by_turn.png").exists()
