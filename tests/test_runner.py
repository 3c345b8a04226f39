"""The runner end to end through Hydra's compose API, on a tiny random model and real ShareGPT data."""

from __future__ import annotations

import json

import pytest
from kvboost_testkit.compose import compose
from kvboost_testkit.tiny import tiny_model

from kvboost.lab.runner import run_experiment


def test_compose_overrides_reach_the_config():
    cfg = compose(["workload.num_conversations=3", "workload.max_turns=5", "logger=none", "recompute=full", "chunker.chunk_size=32"])
    assert cfg.workload.num_conversations == 3 and cfg.workload.max_turns == 5
    assert cfg.logger.name == "none" and cfg.recompute.name == "full" and cfg.chunker.chunk_size == 32


@pytest.mark.parametrize("history_source", ["dataset", "model"])
def test_tiny_end_to_end(tmp_path, smollm_tokenizer, history_source):
    cfg = compose(
        ["workload.num_conversations=2", "workload.max_turns=2", "workload.max_new_tokens=3", "logger=none",
         f"workload.history_source={history_source}", "workload.max_prompt_tokens=400"]  # fmt: skip
    )
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048)
    summary = run_experiment(cfg, out_dir=tmp_path, model=model, tokenizer=smollm_tokenizer)

    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    modes = {"baseline", "hf_prefix", "kvboost_cold", "kvboost"}
    assert {r["mode"] for r in records} == modes
    for r in records:
        for key in ("request_id", "conversation_id", "turn", "repeat", "prompt_tokens", "ttft_ms", "reuse_ratio",
                    "output_text"):  # fmt: skip
            assert key in r
        if r["mode"] in ("baseline", "kvboost_cold"):
            assert r["reuse_ratio"] == 0.0
    # every mode served the very same token counts (the engine's tokenizer for all)
    by_request: dict = {}
    for r in records:
        by_request.setdefault(r["request_id"], set()).add(r["prompt_tokens"])
    assert all(len(v) == 1 for v in by_request.values())
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    for mode in modes:
        turn1 = on_disk["modes"][mode]["by_turn"]["1"]
        assert {"ttft_ms_p50", "ttft_ms_p90", "reuse_ratio", "n"} <= set(turn1)
        assert "overall" in on_disk["modes"][mode]
    assert on_disk["quality"]["kvboost"]["greedy_match_rate"] == 1.0
    assert on_disk["quality"]["kvboost"]["first_token_kl_max"] < 1e-6
    assert on_disk["environment"]["versions"]["torch"]
    assert on_disk["config"]["workload"]["history_source"] == history_source
    assert on_disk["attention"]["backend"] == "sdpa" and on_disk["attention"]["kernel_calls"] > 0
    assert (tmp_path / "ttft_by_turn.png").stat().st_size > 1000
    # Turn 2 reuses turn 1. With the dataset's history, exact reuse can never beat the common-prefix bound that
    # hf_prefix reports; with the model's, the canonical store (kvboost.reuse.canonical) also holds the answer as
    # this prompt re-tokenizes it, end-of-turn markup included: at least hf_prefix's carried prefix.
    by_key = {(r["conversation_id"], r["turn"], r["mode"]): r for r in records}
    for (conv, turn, mode), r in by_key.items():
        if mode == "kvboost" and turn == 2:
            hf_prefix = by_key[(conv, turn, "hf_prefix")]["reuse_ratio"]
            if history_source == "dataset":
                assert r["reuse_ratio"] <= hf_prefix + 1e-9
            else:
                assert r["reuse_ratio"] >= hf_prefix - 1e-9
            assert r["reuse_ratio"] > 0.3
    assert summary["modes"]["kvboost"]["overall"]["n"] == len(records) // 4
    assert on_disk["quality"]["kvboost_cold"]["greedy_match_rate"] == 1.0


def test_wandb_logger_offline(tmp_path, smollm_tokenizer, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = compose(["workload.num_conversations=1", "workload.max_turns=2", "workload.max_new_tokens=2", "logger=wandb"])
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=4096)
    run_experiment(cfg, out_dir=tmp_path, model=model, tokenizer=smollm_tokenizer)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert runs, "wandb offline run folder missing"


def test_unknown_workload_and_mode_are_clear_errors(tmp_path):
    # object() as the model: the config is refused before anything touches a model
    cfg = compose(["logger=none", "workload.name=nope"])
    with pytest.raises(KeyError, match="unknown workload plugin 'nope'; registered workload plugins: .*sharegpt_replay"):
        run_experiment(cfg, out_dir=tmp_path, model=object(), tokenizer=object())
    cfg = compose(["logger=none", "workload.modes=[baseline,vllm]"])
    with pytest.raises(ValueError, match="unknown modes"):
        run_experiment(cfg, out_dir=tmp_path, model=object(), tokenizer=object())


@pytest.mark.parametrize(
    "override, message",
    [("+chunker.chunk_szie=32", "unknown argument.*chunk_szie"), ("+workload.num_convs=3", "unknown field.*num_convs"),
     ("recompute=cacheblend", None), ("+recompute.ratoi=0.2", "unknown argument.*ratoi"),
     ("workload.repeats=0", "repeats"), ("+engine.store_generatd=false", "store_generatd"),
     ("workload=rag_reorder", None), ("workload=rag_reorder workload.doc_tokens=10", "doc_tokens"),
     ("workload=rag_reorder +workload.num_docs=3", "unknown field.*num_docs"),
     ("model.lm_head=int4", "lm_head must be null or int8"), ("model.lm_head=int8", None),
     ("model.awq_prefill=int2", "awq_prefill must be null, int4 or dense"), ("model.awq_prefill=dense", None),
     ("engine.prefill=turbo", "engine.prefill must be"), ("engine.prefill=hf", None),
     ("engine.prefill_weights=packed", "engine.prefill_weights must be"), ("engine.prefill_weights=plain", None)],
)  # fmt: skip
def test_config_typos_fail_before_the_model_is_loaded(tmp_path, override, message):
    from kvboost.lab.config_check import check_config

    cfg = compose(["logger=none", *override.split()])
    plain = __import__("omegaconf").OmegaConf.to_container(cfg, resolve=True)
    if message is None:
        check_config(plain)
        return
    with pytest.raises((ValueError, KeyError), match=message):
        run_experiment(cfg, out_dir=tmp_path, model=object(), tokenizer=object())


def test_rag_reorder_end_to_end(tmp_path, smollm_tokenizer):
    """The RAG workload on a tiny model: documents found as content hits anywhere, hf_prefix gets only the
    shared head of the prompt, the results contract is filled, and repeats measure without storing twice."""
    cfg = compose(
        ["workload=rag_reorder", "recompute=cacheblend", "logger=none", "workload.num_documents=6",
         "workload.num_queries=3", "workload.docs_per_query=3", "workload.doc_tokens=64", "workload.max_new_tokens=2",
         "workload.repeats=2"]  # fmt: skip
    )
    assert cfg.chunker.name == "separator"  # the workload's config selects it
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048, num_hidden_layers=4)
    summary = run_experiment(cfg, out_dir=tmp_path, model=model, tokenizer=smollm_tokenizer)
    assert not hasattr(model, "_kvboost_engine")  # the run gave the model back
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 4 * 2 and {r["repeat"] for r in records} == {0, 1}
    kv = summary["modes"]["kvboost"]["overall"]
    assert kv["n"] == 3
    assert kv["content_ratio"] > 0.5  # the documents (warmed as shared context) are content hits
    assert summary["modes"]["hf_prefix"]["overall"]["reuse_ratio"] < kv["reuse_ratio"]
    assert 0.0 < kv["recompute_ratio"] < 0.5
    for mode in ("baseline", "hf_prefix", "kvboost_cold", "kvboost"):
        acc = summary["accuracy"][mode]
        assert acc["n"] == 3 and 0.0 <= acc["accuracy"] <= 1.0
    assert summary["quality"]["kvboost_cold"]["greedy_match_rate"] == 1.0
    assert {"greedy_match_rate", "first_token_kl_mean"} <= set(summary["quality"]["kvboost"])
    assert all("correct" in r for r in records if r["repeat"] == 0)


def test_a_failed_run_gives_the_model_back(tmp_path, smollm_tokenizer, monkeypatch):
    from kvboost.lab.workloads.sharegpt_replay import SharegptReplay

    def broken(self):
        raise RuntimeError("workload failed mid-run")
        yield  # pragma: no cover

    monkeypatch.setattr(SharegptReplay, "requests", broken)
    cfg = compose(["workload.num_conversations=1", "workload.max_turns=1", "logger=none"])
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048)
    with pytest.raises(RuntimeError, match="workload failed mid-run"):
        run_experiment(cfg, out_dir=tmp_path, model=model, tokenizer=smollm_tokenizer)
    assert not hasattr(model, "_kvboost_engine")
    assert model.config._attn_implementation == "sdpa"


def test_mode_order_is_shuffled_per_request_and_seeded(tmp_path, smollm_tokenizer, monkeypatch):
    """No mode is always measured first: the order changes between requests, and the same seed repeats it."""
    import kvboost.lab.runner as runner

    def orders(out):
        seen: list[str] = []
        original = runner.MODES.get

        def recording(name):
            factory = original(name)

            def build(engine):
                mode = factory(engine)
                generate = mode.generate

                def tracked(*a, **k):
                    seen.append(name)
                    return generate(*a, **k)

                mode.generate = tracked
                return mode

            return build

        monkeypatch.setattr(runner.MODES, "get", recording)
        cfg = compose(["workload.num_conversations=3", "workload.max_turns=2", "workload.max_new_tokens=1",
                       "logger=none", "warmup=false", "workload.max_prompt_tokens=300"])  # fmt: skip
        model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048)
        run_experiment(cfg, out_dir=out, model=model, tokenizer=smollm_tokenizer)
        monkeypatch.undo()
        return [tuple(seen[i : i + 4]) for i in range(0, len(seen), 4)]

    first = orders(tmp_path / "a")
    assert len(first) == 6 and len(set(first)) > 1  # 6 requests, not all in one order
    assert len({o[0] for o in first}) > 1  # not always the same mode first
    assert orders(tmp_path / "b") == first  # seeded


def test_random_model_run_with_an_int8_head_reports_it(tmp_path):
    """model.lm_head=int8 reaches the model the runner builds, and summary.json says so."""
    cfg = compose(["model=tiny_random", "model.lm_head=int8", "workload.num_conversations=1", "workload.max_turns=2",
                   "workload.max_new_tokens=3", "logger=none", "workload.max_prompt_tokens=200",
                   "workload.modes=[baseline,kvboost]"])  # fmt: skip
    summary = run_experiment(cfg, out_dir=tmp_path)
    assert summary["run"]["lm_head"] == "int8"


def test_rag_reorder_warms_documents_after_the_shared_head(tmp_path, smollm_tokenizer):
    """warm_context=head: each document is warmed after the prompts' shared head; its segment key is unchanged,
    so the documents are still content hits in every query."""
    from kvboost.lab.workloads.base import WorkloadEnv
    from kvboost.lab.workloads.rag_reorder import RagReorder

    env = WorkloadEnv(tokenizer=smollm_tokenizer, count_tokens=lambda t: len(smollm_tokenizer(t)["input_ids"]))
    fields = {"num_documents": 4, "num_queries": 3, "docs_per_query": 2, "doc_tokens": 64}
    head_workload = RagReorder(env=env, warm_context="head", **fields)
    head = head_workload.shared_head()
    assert head.startswith("<|im_start|>system") and head.endswith("Question: ")
    plain = RagReorder(env=env, warm_context="document", **fields).shared_context()
    assert head_workload.shared_context() == [head + "\n\n" + doc for doc in plain]
    with pytest.raises(ValueError, match="warm_context"):
        RagReorder(env=env, warm_context="prefix", **fields)
    cfg = compose(
        ["workload=rag_reorder", "recompute=cacheblend", "logger=none", "workload.num_documents=6",
         "workload.num_queries=3", "workload.docs_per_query=3", "workload.doc_tokens=64", "workload.max_new_tokens=2",
         "workload.warm_context=head", "workload.modes=[baseline,kvboost]"]  # fmt: skip
    )
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048, num_hidden_layers=4)
    summary = run_experiment(cfg, out_dir=tmp_path, model=model, tokenizer=smollm_tokenizer)
    assert summary["modes"]["kvboost"]["overall"]["content_ratio"] > 0.5


def test_batch_workload_end_to_end(tmp_path, smollm_tokenizer):
    """workload=batch: every mode serves each batch in one generate_batch call; one record per row with the
    batch's tokens/s; kvboost's rows equal the baseline's (HF one by one) greedy tokens in fp32; every row
    generates max_new_tokens tokens (EOS ignored)."""
    cfg = compose(["workload=batch", "workload.batch_sizes=[1,3]", "workload.max_new_tokens=3", "logger=none",
                   "workload.modes=[baseline,kvboost]", "warmup=false"])  # fmt: skip
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048)
    summary = run_experiment(cfg, out_dir=tmp_path, model=model, tokenizer=smollm_tokenizer)
    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    assert len(records) == 2 * (1 + 3)  # two modes, one record per row of each batch
    assert {r["batch_size"] for r in records} == {1, 3}
    assert all(r["generated_tokens"] == 3 for r in records)
    kvboost = [r for r in records if r["mode"] == "kvboost"]
    assert all(r["greedy_match"] for r in kvboost)
    assert set(summary["batch"]) == {"baseline", "kvboost"}
    assert all(cell["tokens_per_s"] > 0 for cell in summary["batch"]["kvboost"].values())
