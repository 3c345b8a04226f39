"""The runner as a person waiting for it sees it: the estimate after the first request, records written as
requests finish, the summary of what finished after Ctrl-C / SIGTERM, the greedy-match legend, cache stacks on
the command line (run.py and kvboost-server alike), and plugin values checked before any weights load."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kvboost_testkit.compose import compose
from kvboost_testkit.tiny import tiny_model

from kvboost.cache_stack import CacheOverrideError, cache_stack, split_cache_overrides
from kvboost.lab import run_control
from kvboost.lab.run_control import RunEstimate, RunInterrupted, exit_code
from kvboost.lab.runner import run_experiment

ROOT = Path(__file__).resolve().parents[1]




TINY = ["workload.num_conversations=2", "workload.max_turns=2", "workload.max_new_tokens=3", "logger=none",
        "workload.max_prompt_tokens=400"]  # fmt: skip


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------------------ interrupt
def _interrupt_after(monkeypatch, calls: int, exc: BaseException) -> None:
    """Make the ``calls``-th measured generate (after warm-up) raise ``exc`` (a Ctrl-C or SIGTERM mid-run)."""
    from kvboost.lab import modes

    count = {"n": 0}
    for cls in (modes._HFMode, modes._EngineMode):
        original = cls.generate

        def wrapped(self, prompt, max_new_tokens, *a, _orig=original, **kw):
            if prompt is not modes_warmup():
                count["n"] += 1
                if count["n"] == calls:
                    raise exc
            return _orig(self, prompt, max_new_tokens, *a, **kw)

        monkeypatch.setattr(cls, "generate", wrapped)


def modes_warmup():
    from kvboost.lab.runner import WARMUP_MESSAGES

    return WARMUP_MESSAGES


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), RunInterrupted("SIGTERM")], ids=["sigint", "sigterm"])
def test_an_interrupted_run_keeps_records_and_writes_the_summary(tmp_path, smollm_tokenizer, monkeypatch, capsys, exc):
    # 4 modes per request: the 7th call is the third mode of the second request
    _interrupt_after(monkeypatch, 7, exc)
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048)
    with pytest.raises(RunInterrupted) as info:
        run_experiment(compose(TINY), out_dir=tmp_path, model=model, tokenizer=smollm_tokenizer)
    assert info.value.signal_name == ("SIGTERM" if isinstance(exc, RunInterrupted) else "SIGINT")
    assert exit_code(info.value) == (143 if isinstance(exc, RunInterrupted) else 130)
    records = _records(tmp_path / "records.jsonl")
    assert len(records) == 6  # the first request whole (4 modes) and two modes of the second
    assert sum(bool(r.get("partial_request")) for r in records) == 2
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["run"]["interrupted"] == {"signal": info.value.signal_name, "records": 6, "requests": 2}
    assert summary["run"]["records"] == 6
    out = capsys.readouterr().out
    assert "INTERRUPTED" in out and "TTFT ms" in out and "greedy match:" in out


def test_records_are_on_disk_as_requests_finish(tmp_path, smollm_tokenizer, monkeypatch):
    from kvboost.lab import runner

    seen: list[int] = []
    original = runner.RecordSink.write

    def write(self, records):
        original(self, records)
        seen.append(len(_records(self.path)))  # read back from disk, not from memory

    monkeypatch.setattr(runner.RecordSink, "write", write)
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048)
    run_experiment(compose(TINY), out_dir=tmp_path, model=model, tokenizer=smollm_tokenizer)
    assert seen == [4, 8, 12, 16]  # one request (4 modes) at a time


def test_sigterm_handler_raises_run_interrupted():
    previous = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunInterrupted) as info, run_control.interruptible():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(10**6):  # the handler runs between bytecodes
            pass
    assert info.value.signal_name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) == previous  # restored


# ------------------------------------------------------------------------------------------ estimate
def test_estimate_after_the_first_request_names_the_smaller_command():
    lines: list[str] = []
    est = RunEstimate(requests=16, modes=["baseline", "kvboost"], repeats=1,
                      smaller=lambda f: {"num_conversations": 1, "max_turns": 2},
                      overrides=["recompute=cacheblend", "attn=triton"], interpreted_triton=True, emit=lines.append)  # fmt: skip
    est.add("baseline", 10.0, 120)
    assert "first request, mode baseline: 10 s (120 prompt tokens)" in lines[0]
    est.add("kvboost", 350.0)
    text = "\n".join(lines)
    assert "estimated run: ~1 h 36 min for 16 request(s) x 2 mode(s)" in text  # (10 + 350) x 16
    assert "python run.py recompute=cacheblend attn=triton workload.num_conversations=1 workload.max_turns=2" in text
    assert "python run.py recompute=cacheblend attn=sdpa" in text
    assert est.done and est.estimate_s == pytest.approx(360 * 16)
    est.add("kvboost", 1.0)  # later requests print nothing
    assert text == "\n".join(lines)


def test_the_warm_up_gives_a_lower_bound_before_the_first_request():
    lines: list[str] = []
    est = RunEstimate(requests=16, modes=["baseline", "kvboost"], repeats=1, smaller=lambda f: {"num_queries": 1},
                      overrides=["attn=triton"], interpreted_triton=True, emit=lines.append)  # fmt: skip
    est.warmup({"baseline": 40.0, "kvboost": 80.0})
    text = "\n".join(lines)
    assert "baseline 40 s, kvboost 1 min 20 s" in text and "at least ~32 min" in text
    assert "python run.py attn=triton workload.num_queries=1" in text and "python run.py attn=sdpa" in text


def test_a_short_run_gets_the_estimate_without_the_hint():
    lines: list[str] = []
    est = RunEstimate(requests=4, modes=["kvboost"], repeats=2, smaller=lambda f: {}, overrides=[],
                      interpreted_triton=False, emit=lines.append)  # fmt: skip
    est.add("kvboost", 2.0)
    assert lines[-1].startswith("estimated run: ~16 s for 4 request(s) x 1 mode(s) x 2 repeats")
    assert "shrink" not in "\n".join(lines)


def test_workloads_say_how_to_keep_a_fraction_of_their_requests(smollm_tokenizer):
    from kvboost.lab.workloads import WORKLOADS
    from kvboost.lab.workloads.base import WorkloadEnv

    env = WorkloadEnv(tokenizer=smollm_tokenizer, count_tokens=lambda p: 10)
    replay = WORKLOADS.build({"name": "sharegpt_replay", "num_conversations": 4, "max_turns": 4}, env=env)
    assert replay.smaller_overrides(0.5) == {"num_conversations": 2, "max_turns": 4}
    assert replay.smaller_overrides(0.01) == {"num_conversations": 1, "max_turns": 2}
    rag = WORKLOADS.build({"name": "rag_reorder", "num_queries": 20, "num_documents": 6, "doc_tokens": 64,
                           "docs_per_query": 2}, env=env)  # fmt: skip
    assert rag.smaller_overrides(0.25) == {"num_queries": 5}


def test_the_runner_prints_the_estimate_and_a_warm_up_bar(tmp_path, smollm_tokenizer, capsys):
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048)
    run_experiment(compose(TINY), out_dir=tmp_path, model=model, tokenizer=smollm_tokenizer)
    captured = capsys.readouterr()
    assert "first request:" in captured.out and "estimated run: ~" in captured.out
    assert "warm-up request (short prompt, 4 new tokens): " in captured.out
    assert "warm-up" in captured.err  # tqdm writes its bar to stderr


# ------------------------------------------------------------------------------------------ legend
def test_the_table_says_what_greedy_match_means():
    from kvboost.lab.report import greedy_match_legend

    def legend(summary):
        text = greedy_match_legend(summary)
        assert max(len(line) for line in text.splitlines()) <= 160  # the table's width
        return " ".join(text.split())

    bf16 = legend({"config": {"workload": {"max_new_tokens": 32}}, "run": {"dtype": "bfloat16"}})
    assert "over all 32 generated tokens" in bf16 and "round differently" in bf16
    fp32 = legend({"config": {"workload": {"max_new_tokens": 8}}, "run": {"dtype": "float32"}})
    assert "over all 8 generated tokens" in fp32 and "round differently" not in fp32


def test_rag_figures_come_with_their_explanation():
    from kvboost.lab.report import explain_hf_prefix, format_overhead

    slow = {"modes": {"hf_prefix": {"overall": {"speedup_vs_baseline_p50": 0.53, "reuse_ratio": 0.02}}}}
    assert "0.53x" in explain_hf_prefix(slow) and "causal mask" in explain_hf_prefix(slow)
    assert explain_hf_prefix({"modes": {"hf_prefix": {"overall": {"speedup_vs_baseline_p50": 2.0,
                                                                    "reuse_ratio": 0.8}}}}) is None  # fmt: skip
    rag = format_overhead({"lookup_ms_mean_diff": 418.0, "extra_prefill_tokens_mean": -1336.0,
                           "kvboost_cached_tokens_mean": 1371.0, "hf_prefix_cached_tokens_mean": 35.0,
                           "kvboost_content_ratio_mean": 0.95, "prefill_ms_mean_diff": -9000.0})  # fmt: skip
    assert "not overhead on the same work" in rag and "reused 1371 tokens" in rag and "hf_prefix 35" in rag
    chat = format_overhead({"lookup_ms_mean_diff": 3.0, "extra_prefill_tokens_mean": 0.0,
                            "kvboost_cached_tokens_mean": 500.0, "hf_prefix_cached_tokens_mean": 498.0})  # fmt: skip
    assert chat.startswith("kvboost lookup+assembly overhead vs hf_prefix crop: +3.00 ms/request")


# ------------------------------------------------------------------------------------------ cache stacks
def test_tier_names_and_mappings_make_a_stack():
    rest, spec = split_cache_overrides(["recompute=none", "cache=[memory,disk]", "cache.1.path=/data/kv", "-m"])
    assert rest == ["recompute=none", "-m"]
    stack = cache_stack(spec)
    assert [t["name"] for t in stack] == ["memory", "disk"]
    assert stack[1]["path"] == "/data/kv" and stack[0]["capacity"] == "2GiB"
    rest, spec = split_cache_overrides(["cache=[{name: memory, capacity: 1GiB}, {name: disk, path: /d, capacity: 64GiB}]"])
    stack = cache_stack(spec)
    assert rest == [] and stack[0]["capacity"] == "1GiB" and stack[1]["capacity"] == "64GiB"
    assert stack[1]["fsync"] is True  # the rest of the disk tier's yaml


def test_single_tier_overrides_stay_with_hydra():
    rest, spec = split_cache_overrides(["cache=disk", "cache.capacity=1GiB", "cache=memory,disk"])
    assert rest == ["cache=disk", "cache.capacity=1GiB", "cache=memory,disk"] and not spec


@pytest.mark.parametrize("overrides, message", [
    (["cache.1.path=/x"], "need a stack"),
    (["cache=[memory]", "cache.3.path=/x"], "the stack has 1 tier"),
    (["cache=[memory,nosuch]"], "tier 'nosuch' has no config; tiers: disk, memory, redis"),
])  # fmt: skip
def test_bad_stacks_are_clear_errors(overrides, message):
    with pytest.raises(CacheOverrideError, match=message):
        cache_stack(split_cache_overrides(overrides)[1])


@pytest.mark.parametrize("form", ["cache=[memory,disk]", "cache=[{name: memory}, {name: disk}]"])
def test_kvboost_server_composes_both_forms(form, tmp_path):
    from kvboost.serving.cli import build_parser, compose_config

    cfg = compose_config(build_parser().parse_args([form, f"cache.1.path={tmp_path}", "model=tiny_random"]))
    assert [t["name"] for t in cfg["cache"]] == ["memory", "disk"] and cfg["cache"][1]["path"] == str(tmp_path)


def _run_py(args: list[str], tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """run.py in a subprocess with the model loader replaced by one that fails loudly (nothing may load)."""
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        "import kvboost.engine as e\n"
        "def _no(*a, **k):\n    raise SystemExit('MODEL LOAD ATTEMPTED')\n"
        "e.InferenceEngine.from_pretrained = classmethod(_no)\n"
        "import kvboost.models.loading as l\nl.random_model_and_tokenizer = _no\n"
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": f"{shim}{os.pathsep}{ROOT}", "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *args, "logger=none", f"hydra.run.dir={tmp_path / 'out'}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip


def test_kvboost_server_feeds_chunked_prompts_unless_told_otherwise():
    """The server's step budget cuts prompts into chunks, so its engine is built with engine.chunked_prompts=true
    (kvboost.runtime.config.choose_runner then prefers the quantized prefill where decode is quantized); an explicit
    value from the command line is kept, and a value that is not a boolean is refused before any model loads."""
    from kvboost.serving.cli import UsageError, build_parser, compose_config, serving_config

    cfg = compose_config(build_parser().parse_args(["model=tiny_random"]))
    assert cfg["engine"]["chunked_prompts"] is None  # the yaml's default: the caller decides
    assert serving_config(cfg)["engine"]["chunked_prompts"] is True
    assert cfg["engine"]["chunked_prompts"] is None  # the composed config is not changed in place
    kept = compose_config(build_parser().parse_args(["model=tiny_random", "engine.chunked_prompts=false"]))
    assert serving_config(kept)["engine"]["chunked_prompts"] is False
    with pytest.raises(UsageError, match="chunked_prompts must be true, false or null"):
        compose_config(build_parser().parse_args(["model=tiny_random", "engine.chunked_prompts=sometimes"]))


def test_run_py_reads_a_cache_stack_and_checks_values_before_loading(tmp_path):
    """Both cache forms reach the run (the loader is reached, i.e. the config passed every check), and
    recompute.ratio=1.5 fails before it."""
    for form in ("cache=[memory,disk]", "cache=[{name: memory, capacity: 1GiB}, {name: disk, path: /tmp/kvb}]"):
        proc = _run_py([form], tmp_path)
        assert "MODEL LOAD ATTEMPTED" in proc.stderr, proc.stderr[-2000:]
        assert "TypeError" not in proc.stderr
    proc = _run_py(["recompute=cacheblend", "recompute.ratio=1.5"], tmp_path)
    assert proc.returncode != 0 and "MODEL LOAD ATTEMPTED" not in proc.stderr
    assert "ratio" in proc.stderr and "1.5" in proc.stderr


def test_an_objective_mode_that_is_not_run_fails_a_sweep_before_loading(tmp_path):
    """A sweep needs its objective: objective.mode missing from workload.modes exits before any weight loads.
    (A single run writes its results and notes that it has no objective: run.py's objective_mode_not_run.)"""
    proc = _run_py(["-m", "workload.modes=[baseline]", f"hydra.sweep.dir={tmp_path / 'sweep'}"], tmp_path)
    assert proc.returncode != 0 and "MODEL LOAD ATTEMPTED" not in proc.stderr, proc.stderr[-2000:]
    assert "objective.mode 'kvboost' is not among workload.modes ['baseline']" in proc.stderr
    proc = _run_py(["-m", "workload.modes=[baseline,kvboost]", f"hydra.sweep.dir={tmp_path / 'sweep2'}"], tmp_path)
    assert "MODEL LOAD ATTEMPTED" in proc.stderr, proc.stderr[-2000:]


# ------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize("override, message", [
    (["recompute=cacheblend", "recompute.ratio=1.5"], "ratio"),
    (["recompute=query_aware", "recompute.ratio=-0.1"], "ratio"),
    (["quant=kivi8", "quant.bits=3"], "bits"),
])  # fmt: skip
def test_plugin_values_fail_before_the_model_loads(tmp_path, monkeypatch, override, message):
    from kvboost.lab import runner

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the config was checked")

    monkeypatch.setattr(runner, "build_engine", no_load)
    with pytest.raises((ValueError, TypeError), match=message):
        run_experiment(compose(override + ["logger=none"]), out_dir=tmp_path)


def test_a_typo_from_python_lists_the_accepted_fields():
    from kvboost.registry import RECOMPUTE

    with pytest.raises(ValueError, match=r"unknown .*\['ratoi'\]; accepted: .*ratio"):
        RECOMPUTE.build({"name": "cacheblend", "ratoi": 0.2})
    with pytest.raises(ValueError, match=r"unknown .*\['ratoi'\]; accepted: .*ratio"):
        RECOMPUTE.build("cacheblend", ratoi=0.2)
    with pytest.raises(ValueError, match="ratio"):
        RECOMPUTE.validate({"name": "cacheblend", "ratio": 1.5})



def test_kvboost_server_flags_and_stack_errors(tmp_path):
    from kvboost.serving.cli import UsageError, build_parser, compose_config

    cfg = compose_config(build_parser().parse_args(["--disk-cache-dir", str(tmp_path), "model=tiny_random"]))
    assert [t["name"] for t in cfg["cache"]] == ["memory", "disk"]
    assert cfg["cache"][1]["path"] == str(tmp_path.resolve()) and cfg["cache"][1]["write_through"] is True
    with pytest.raises(UsageError, match="need a stack"):
        compose_config(build_parser().parse_args(["cache.1.path=/x", "model=tiny_random"]))
    with pytest.raises(UsageError, match="--disk-cache-dir"):
        compose_config(build_parser().parse_args(["--disk-cache-dir", str(tmp_path), "cache=[memory,disk]"]))
