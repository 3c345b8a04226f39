"""Named experiments (kvboost/configs/experiment/*.yaml), launchers and the sweep objective.

Every experiment composes with Hydra's compose API, passes the start-up check and runs shrunk to a tiny size on
a tiny random model (lightning-hydra-template's tests/test_sweeps.py habit); every launcher config composes.
"""

from __future__ import annotations

import importlib.util

import pytest
from kvboost_testkit.compose import CONFIG_DIR, compose
from omegaconf import OmegaConf
from kvboost_testkit.tiny import tiny_model

from kvboost.lab.config_check import check_config
from kvboost.lab.objective import BROKEN_CONSTRAINT, ObjectiveError, sweep_objective
from kvboost.lab.runner import run_experiment

EXPERIMENTS = sorted(p.stem for p in (CONFIG_DIR / "experiment").glob("*.yaml"))
LAUNCHERS = sorted(p.stem for p in (CONFIG_DIR / "hydra" / "launcher").glob("*.yaml"))

#: per workload, the overrides that shrink it to seconds (a new workload must add its own here)
SHRINK = {
    "sharegpt_replay": ["workload.num_conversations=2", "workload.max_turns=2", "workload.max_new_tokens=2",
                        "workload.max_prompt_tokens=400"],
    "rag_reorder": ["workload.num_documents=4", "workload.num_queries=2", "workload.docs_per_query=2",
                    "workload.doc_tokens=64", "workload.max_new_tokens=2"],
    "accuracy": ["workload.perplexity_conversations=1", "workload.perplexity_turns=2", "workload.recall_tasks=1",
                 "workload.filler_turns=1", "workload.max_new_tokens=2", "workload.score_tokens=8",
                 "workload.max_prompt_tokens=700"],
    "musique": ["workload.num_queries=1", "workload.num_passages=2", "workload.max_new_tokens=2"],
}  # fmt: skip




def test_the_experiments_the_docs_name_exist():
    assert {"chat_replay", "chat_replay_interleaved", "rag_blend", "cache_policies", "tune_rag", "reuse_accuracy",
            "musique_blend"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes_and_checks(experiment):
    cfg = compose([f"experiment={experiment}"], hydra=True)
    assert cfg.hydra.runtime.choices.experiment == experiment
    plain = OmegaConf.to_container(cfg, resolve=False)
    plain.pop("hydra")
    check_config(OmegaConf.to_container(OmegaConf.create(plain), resolve=True))
    # a sweep an experiment declares names only overrides that compose
    for key, values in (OmegaConf.to_container(cfg.hydra.sweeper, resolve=False).get("params") or {}).items():
        values = str(values)
        if "(" in values:  # an Optuna distribution, choice(32, 64) or interval(0.05, 0.3): its first bound
            choices = [values.split("(", 1)[1].rstrip(")").split(",")[0].strip()]
        else:
            choices = [v.strip() for v in values.split(",")]
        for value in choices:
            check_config(OmegaConf.to_container(compose([f"experiment={experiment}", f"{key}={value}"]), resolve=True))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_runs_shrunk_on_a_tiny_model(experiment, tmp_path, smollm_tokenizer):
    workload = compose([f"experiment={experiment}"]).workload.name
    assert workload in SHRINK, f"add the overrides that shrink workload {workload!r} to SHRINK"
    cfg = compose([f"experiment={experiment}", "logger=none", "warmup=false", *SHRINK[workload]])
    # 4 layers: cacheblend (musique_blend) checks at layer 1 and needs later layers to save
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048, num_hidden_layers=4)
    summary = run_experiment(cfg, out_dir=tmp_path, model=model, tokenizer=smollm_tokenizer,
                             run_info={"experiment": experiment})  # fmt: skip
    assert summary["run"]["experiment"] == experiment
    assert set(summary["modes"]) == set(cfg.workload.modes)
    assert (tmp_path / "summary.json").exists() and (tmp_path / "records.jsonl").exists()


def test_the_interleaved_experiment_interleaves():
    cfg = compose(["experiment=chat_replay_interleaved"])
    assert cfg.workload.interleave is True and cfg.workload.users == 8
    assert compose(["experiment=chat_replay"]).workload.interleave is False


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_launcher_config_composes(launcher):
    cfg = compose([f"hydra/launcher={launcher}"], hydra=True)
    target = cfg.hydra.launcher._target_
    plugin_module = target.rsplit(".", 2)[0]  # hydra_plugins.<plugin>
    if launcher == "ray_cluster" and importlib.util.find_spec("hydra_plugins.hydra_ray_launcher") is None:
        pytest.skip("hydra-ray-launcher is not installed (pip install -e '.[cluster]'): composed, fields unchecked")
    assert importlib.util.find_spec(plugin_module) is not None, f"{plugin_module} is not installed"


def test_launcher_defaults():
    assert compose(["hydra/launcher=local"], hydra=True).hydra.launcher.n_jobs == 2
    slurm = compose(["hydra/launcher=slurm"], hydra=True).hydra.launcher
    assert slurm._target_.endswith("SlurmLauncher") and slurm.gpus_per_node == 1 and slurm.timeout_min == 120


def test_the_optuna_experiment_searches_chunk_size_and_ratio_under_a_quality_constraint():
    cfg = compose(["experiment=tune_rag"], hydra=True)
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper") and cfg.hydra.sweeper.direction == "minimize"
    assert set(cfg.hydra.sweeper.params) == {"chunker.chunk_size", "recompute.ratio"}
    assert cfg.objective.constraint.metric == "accuracy_drop" and cfg.objective.constraint.max == 0.03


# ------------------------------------------------------------------------------------------ the objective
def _summary(ttft=100.0, acc_base=0.9, acc_kv=0.88, greedy=0.5):
    return {
        "baseline_mode": "baseline",
        "modes": {"kvboost": {"overall": {"ttft_ms_p50": ttft, "reuse_ratio": 0.5}}, "baseline": {"overall": {}}},
        "accuracy": {"baseline": {"accuracy": acc_base}, "kvboost": {"accuracy": acc_kv}},
        "quality": {"kvboost": {"greedy_match_rate": greedy, "first_token_kl_mean": 0.01}},
    }


def test_objective_is_the_metric_when_the_constraint_holds():
    objective = {"mode": "kvboost", "metric": "ttft_ms_p50", "constraint": {"metric": "accuracy_drop", "max": 0.03}}
    assert sweep_objective(_summary(), objective) == 100.0
    assert sweep_objective(_summary(), None) is None


def test_a_broken_constraint_ranks_the_run_after_every_valid_one():
    objective = {"mode": "kvboost", "metric": "ttft_ms_p50", "constraint": {"metric": "accuracy_drop", "max": 0.03}}
    broken = sweep_objective(_summary(ttft=10.0, acc_kv=0.8), objective)
    assert broken == BROKEN_CONSTRAINT + 10.0 and broken > sweep_objective(_summary(ttft=5000.0), objective)
    greedy = {"metric": "ttft_ms_p50", "constraint": {"metric": "greedy_mismatch", "max": 0.2}}
    assert sweep_objective(_summary(greedy=0.5), greedy) > BROKEN_CONSTRAINT
    assert sweep_objective(_summary(greedy=0.9), greedy) == 100.0


@pytest.mark.parametrize("objective, message", [
    ({"mode": "nope"}, "was not run"),
    ({"metric": "ttft_typo"}, "available: reuse_ratio, ttft_ms_p50"),
    ({"constraint": {"metric": "bleu", "max": 1}}, "unknown constraint metric"),
])  # fmt: skip
def test_objective_errors_name_the_cause(objective, message):
    with pytest.raises(ObjectiveError, match=message):
        sweep_objective(_summary(), objective)
