"""The accuracy workload (planted facts, held-out replies) and the accuracy-by-reuse table."""

from __future__ import annotations

import json
import math

import pytest
from kvboost_testkit.tiny import tiny_model

from kvboost.lab.accuracy_table import (
    accuracy_by_reuse,
    add_accuracy_by_reuse,
    bucket_labels,
    bucket_of,
    format_accuracy_table,
)
from kvboost.lab.workloads import WORKLOADS
from kvboost.lab.workloads.accuracy import TEMPLATES, is_correct, make_facts, normalize_answer
from kvboost.lab.workloads.base import WorkloadEnv
from kvboost.paths import CONFIG_DIR

SMALL = {"perplexity_conversations": 2, "perplexity_turns": 3, "recall_tasks": 6, "filler_turns": 2,
         "max_prompt_tokens": 1500}  # fmt: skip


@pytest.fixture(scope="module")
def tok():
    """The bundled model's tokenizer (chat template) without its weights."""
    from transformers import AutoTokenizer

    from kvboost.models.loading import bundled_model_dir

    return AutoTokenizer.from_pretrained(bundled_model_dir())


def _ids(tok, prompt) -> list[int]:
    text = prompt if isinstance(prompt, str) else tok.apply_chat_template(list(prompt), tokenize=False,
                                                                           add_generation_prompt=True)  # fmt: skip
    return tok(text, add_special_tokens=False)["input_ids"]


def _build(tok, **fields):
    env = WorkloadEnv(tokenizer=tok, count_tokens=lambda p: len(_ids(tok, p)))
    return WORKLOADS.build({"name": "accuracy", **{**SMALL, **fields}}, env=env)


def _contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


# --------------------------------------------------------------------------------------------- workload
def test_perplexity_turns_score_the_held_out_reply_as_the_next_prompt_tokenizes_it(tok):
    w = _build(tok, recall_tasks=0, score_tokens=40)
    requests = list(w.requests())
    assert requests and all(r.info["task"] == "perplexity" for r in requests)
    by_conv: dict = {}
    for r in requests:
        by_conv.setdefault(r.conversation_id, []).append(r)
    assert len(by_conv) == 2
    checked = 0
    for turns in by_conv.values():
        assert [r.turn for r in turns] == list(range(1, len(turns) + 1))
        for r, nxt in zip(turns, turns[1:]):
            assert r.expected is None and r.score_ids and len(r.score_ids) <= 40
            assert r.info["score_tokens"] == len(r.score_ids)
            # the next turn's prompt = this prompt + the held-out reply (+ template tokens) + the next message:
            # its tokens continue this prompt's tokens with exactly the scored tokens
            here, there = _ids(tok, r.prompt), _ids(tok, nxt.prompt)
            assert there[: len(here)] == here
            assert there[len(here) : len(here) + len(r.score_ids)] == r.score_ids
            assert nxt.prompt[-2]["role"] == "assistant"
            assert r.score_ids == tok(nxt.prompt[-2]["content"], add_special_tokens=False)["input_ids"][:40]
            checked += 1
    assert checked >= 2


def test_recall_chats_plant_the_fact_first_and_ask_for_it_last(tok):
    w = _build(tok, perplexity_conversations=0)
    requests = list(w.requests())
    chats: dict = {}
    for r in requests:
        chats.setdefault(r.conversation_id, []).append(r)
    assert len(chats) == 6
    for (conv_id, turns), fact in zip(chats.items(), w.facts):
        plant, *fillers, bridge, question = turns
        assert plant.info["task"] == "plant" and plant.score_ids is None and plant.expected is None
        assert fact.value in plant.prompt[-1]["content"]
        assert [f.info["task"] for f in fillers] == ["perplexity"] * len(fillers) and len(fillers) == 2
        assert bridge.info["task"] == "bridge" and bridge.score_ids is None and bridge.expected is None
        assert question.info["task"] == "recall" and question.expected == fact.value
        assert question.turn == len(turns) and question.request_id == f"{conv_id}/{question.turn}"
        # answer_prefix: the prompt is text ending with the answer's start; the value is scored after it
        assert isinstance(question.prompt, str) and question.prompt.endswith(fact.answer_start)
        assert question.score_ids == tok(" " + fact.value, add_special_tokens=False)["input_ids"]
        assert question.info["score_tokens"] == len(question.score_ids)
        # the fact is in the question's history exactly once (in the first user turn), nowhere else
        assert question.prompt.count(fact.value) == 1
        assert question.prompt.index(fact.statement) < question.prompt.index(fillers[0].prompt[-1]["content"])
        # each filler turn's prompt is a prefix of the question's (its history comes from the cache when warm)
        # each earlier turn's prompt is a prefix of the question's (its history comes from the cache when warm);
        # the bridge's leaves only its short reply and the question uncached
        q_ids = _ids(tok, question.prompt)
        for f in [plant, *fillers, bridge]:
            assert q_ids[: len(_ids(tok, f.prompt))] == _ids(tok, f.prompt)
        assert len(q_ids) - len(_ids(tok, bridge.prompt)) < 40
    assert w.stats()["recall_tasks"] == 6 and w.stats()["unscored_requests"] == 12


def test_recall_without_answer_prefix_or_bridge_asks_in_chat_messages(tok):
    w = _build(tok, perplexity_conversations=0, recall_tasks=2, answer_prefix=False, bridge_turn=False)
    requests = list(w.requests())
    assert [r.info["task"] for r in requests] == ["plant", "perplexity", "perplexity", "recall"] * 2
    questions = [r for r in requests if r.info["task"] == "recall"]
    for q in questions:
        assert q.prompt[-1]["role"] == "user" and q.prompt[-1]["content"].endswith("?")
        assert q.score_ids == tok(q.expected, add_special_tokens=False)["input_ids"]


def test_planted_facts_are_deterministic_per_seed_and_unguessable():
    a, b, c = make_facts(24, seed=3), make_facts(24, seed=3), make_facts(24, seed=4)
    assert [f.__dict__ for f in a] == [f.__dict__ for f in b]
    assert [f.value for f in a] != [f.value for f in c]
    assert [f.template for f in a] == [TEMPLATES[i % len(TEMPLATES)].name for i in range(24)]
    assert len({f.value for f in a}) == 24  # unique answers
    for f in a:
        assert f.value in f.statement and f.value not in f.question and f.value not in f.answer_start
        template = next(t for t in TEMPLATES if t.name == f.template)
        if template.kind == "number":
            assert f.value.isdigit() and len(f.value) == 4
    # a value found in the chat's other text is never drawn
    first = make_facts(1, seed=3)[0].value
    assert make_facts(1, seed=3, avoid=[f"the year {first} was long"])[0].value != first


def test_workload_is_deterministic_and_fillers_are_dropped_to_fit(tok):
    ids = lambda w: [(r.request_id, r.expected, r.score_ids) for r in w.requests()]  # noqa: E731
    assert ids(_build(tok)) == ids(_build(tok))
    tight = _build(tok, perplexity_conversations=0, max_prompt_tokens=300)
    for r in tight.requests():
        assert len(_ids(tok, r.prompt)) <= 300
    assert tight.stats().get("fillers_dropped_over_max_prompt_tokens", 0) > 0


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


def test_yaml_composes_passes_the_startup_check_and_matches_the_dataclass():
    from dataclasses import fields

    from omegaconf import OmegaConf

    from kvboost.lab.config_check import check_config
    from kvboost.lab.workloads.accuracy import AccuracyConfig

    cfg = OmegaConf.to_container(_compose(["workload=accuracy"]), resolve=True)
    check_config(cfg)
    yaml_fields = {k: v for k, v in cfg["workload"].items() if k not in ("name", "modes", "repeats")}
    assert yaml_fields == {f.name: f.default for f in fields(AccuracyConfig)}  # one set of defaults
    assert cfg["workload"]["modes"] == ["baseline", "kvboost_cold", "kvboost"]
    with pytest.raises(Exception, match="recal_tasks"):
        check_config(OmegaConf.to_container(_compose(["workload=accuracy", "+workload.recal_tasks=3"])))


def test_config_errors_name_the_field(tok):
    with pytest.raises(ValueError, match="score_tokens"):
        _build(tok, score_tokens=0)
    with pytest.raises(ValueError, match="nothing to measure"):
        _build(tok, perplexity_conversations=0, recall_tasks=0)
    with pytest.raises(TypeError):
        _build(tok, recal_tasks=3)


@pytest.mark.parametrize("output, expected, ok", [
    (" 4821.", "4821", True),
    ("The code is 4,821!", "4821", True),
    ("4821", "4821", True),
    (" 48213.", "4821", False),
    (" 14821", "4821", False),
    (" 4281.", "4821", False),
    ("", "4821", False),
    (' "Ocelot".', "Ocelot", True),
    (" OCELOT", "Ocelot", True),
    (" Ocelots", "Ocelot", False),
    (" the dog is called Juniper", "Juniper", True),
])  # fmt: skip
def test_is_correct_normalizes_case_punctuation_and_grouping(output, expected, ok):
    assert is_correct(output, expected) is ok


def test_normalize_answer():
    assert normalize_answer("  The PIN: 4,821. ") == "the pin 4821"
    assert normalize_answer("Ｏｃｅｌｏｔ") == "ocelot"  # NFKC full-width


# ------------------------------------------------------------------------------------------------ table
def test_bucket_edges_and_labels():
    assert bucket_labels() == ["0", "(0, 0.25]", "(0.25, 0.5]", "(0.5, 0.75]", "(0.75, 0.9]", "(0.9, 1]"]
    assert bucket_of(0.0) == "0"
    assert bucket_of(0.01) == "(0, 0.25]" and bucket_of(0.25) == "(0, 0.25]"
    assert bucket_of(0.2501) == "(0.25, 0.5]" and bucket_of(0.9) == "(0.75, 0.9]" and bucket_of(1.0) == "(0.9, 1]"
    with pytest.raises(ValueError):
        bucket_labels([0.5, 0.25])


def _rec(mode, rid, reuse, *, lp=None, tokens=None, correct=None, repeat=0):
    r = {"mode": mode, "request_id": rid, "conversation_id": rid.split("/")[0], "turn": 1, "repeat": repeat,
         "reuse_ratio": reuse}  # fmt: skip
    if lp is not None:
        r["answer_logprob"] = lp
    if tokens is not None:
        r["score_tokens"] = tokens
    if correct is not None:
        r["correct"] = correct
    return r


def _records():
    """Three requests: a reply at kvboost reuse 0.3 and one at 0.95 (quality lost there), a task at 0.8 that
    kvboost gets wrong; cold modes at reuse 0; a repeat that must be ignored."""
    out = []
    for mode in ("baseline", "kvboost_cold"):
        out += [_rec(mode, "a/1", 0.0, lp=-20.0, tokens=10), _rec(mode, "b/2", 0.0, lp=-30.0, tokens=10),
                _rec(mode, "c/3", 0.0, lp=-1.0, tokens=5, correct=True)]  # fmt: skip
    out += [_rec("kvboost", "a/1", 0.3, lp=-20.0, tokens=10), _rec("kvboost", "b/2", 0.95, lp=-40.0, tokens=10),
            _rec("kvboost", "c/3", 0.8, lp=-6.0, tokens=5, correct=False)]  # fmt: skip
    return [_rec("kvboost", "b/2", 0.1, lp=-99.0, tokens=10, repeat=1)] + out  # a repeat, listed first


def test_table_buckets_cold_modes_by_kvboosts_reuse_and_reports_the_loss():
    table = accuracy_by_reuse(_records())
    assert table["bucket_mode"] == "kvboost" and table["reference_mode"] == "kvboost_cold"
    assert list(table["modes"]) == ["baseline", "kvboost_cold", "kvboost"]
    for mode in ("baseline", "kvboost_cold", "kvboost"):
        cells = table["modes"][mode]
        # every mode's records land in kvboost's bucket for that request; "0" is empty (kvboost reused all)
        assert set(cells) == {"(0.25, 0.5]", "(0.75, 0.9]", "(0.9, 1]", "all"}
        assert cells["all"]["n"] == 3
    warm, cold = table["modes"]["kvboost"], table["modes"]["kvboost_cold"]
    assert cold["(0.9, 1]"]["reuse_ratio"] == 0.0 and warm["(0.9, 1]"]["reuse_ratio"] == 0.95
    # no loss at 0.3
    low = warm["(0.25, 0.5]"]
    assert low["logprob_delta_per_token"] == 0.0 and low["perplexity"] == pytest.approx(math.exp(2.0))
    # loss at 0.95: 10 nats over 10 tokens; the repeat (-99) is ignored
    high = warm["(0.9, 1]"]
    assert high["logprob_delta_per_token"] == pytest.approx(-1.0)
    assert high["perplexity"] == pytest.approx(math.exp(4.0)) and high["perplexity_ref"] == pytest.approx(math.exp(3.0))
    assert high["n_tasks"] == 0 and high["accuracy"] is None
    # the task: accuracy 0 vs 1 at matched requests, one flip to wrong, answer log-prob delta -5
    task = warm["(0.75, 0.9]"]
    assert task["accuracy"] == 0.0 and task["accuracy_ref"] == 1.0
    assert task["flipped_to_wrong"] == 1 and task["flipped_to_right"] == 0
    assert task["answer_logprob_delta"] == pytest.approx(-5.0) and task["n_scored"] == 0  # a task is not a reply
    overall = warm["all"]
    assert overall["scored_tokens"] == 20 and overall["logprob_delta_per_token"] == pytest.approx(-0.5)
    assert overall["perplexity"] == pytest.approx(math.exp(3.0))
    assert overall["perplexity_ref"] == pytest.approx(math.exp(2.5))
    # the reference against itself: no delta
    assert cold["all"]["logprob_delta_per_token"] == 0.0 and cold["all"]["flipped_to_wrong"] == 0
    text = format_accuracy_table(table)
    assert "| kvboost | (0.9, 1] | 1 | 0.95 | - | - | - | 54.598 (10 tok) | 20.086 | -1 | - |" in text
    assert "kvboost (mean reuse 0.68) vs kvboost_cold: accuracy 0.0% vs 100.0% (1 lost, 0 gained)" in text


def test_table_reference_falls_back_to_baseline_and_without_kvboost_buckets_own_reuse():
    records = [r for r in _records() if r["mode"] != "kvboost_cold"]
    table = accuracy_by_reuse(records)
    assert table["reference_mode"] == "baseline"
    assert table["modes"]["kvboost"]["(0.9, 1]"]["logprob_delta_per_token"] == pytest.approx(-1.0)
    only_cold = accuracy_by_reuse([r for r in _records() if r["mode"] == "baseline"])
    assert only_cold["bucket_mode"] is None and set(only_cold["modes"]["baseline"]) == {"0", "all"}
    with pytest.raises(ValueError, match="reference mode"):
        accuracy_by_reuse(records, reference_mode="kvboost_cold")


def test_add_to_summary_only_when_something_was_scored():
    summary: dict = {}
    assert add_accuracy_by_reuse(summary, [_rec("kvboost", "a/1", 0.5)]) is None and summary == {}
    assert add_accuracy_by_reuse(summary, _records()) is summary["accuracy_by_reuse"]


# ----------------------------------------------------------------------------------------- end to end
def test_tiny_end_to_end_writes_the_table(tmp_path, tok):
    from kvboost.lab.runner import run_experiment

    cfg = _compose([
        "workload=accuracy", "logger=none", "warmup=false", "workload.perplexity_conversations=1",
        "workload.perplexity_turns=3", "workload.recall_tasks=2", "workload.filler_turns=1",
        "workload.max_new_tokens=2", "workload.score_tokens=16", "workload.max_prompt_tokens=700",
    ])  # fmt: skip
    assert list(cfg.workload.modes) == ["baseline", "kvboost_cold", "kvboost"]
    model = tiny_model("llama", vocab_size=len(tok), max_position_embeddings=2048)
    summary = run_experiment(cfg, out_dir=tmp_path, model=model, tokenizer=tok)

    records = [json.loads(line) for line in (tmp_path / "records.jsonl").read_text().splitlines()]
    recall = [r for r in records if r.get("task") == "recall"]
    assert len(recall) == 2 * 3 and all(isinstance(r["correct"], bool) and r["score_tokens"] > 0 for r in recall)
    replies = [r for r in records if r.get("task") == "perplexity"]
    assert replies and all(r["answer_logprob"] < 0 and 0 < r["score_tokens"] <= 16 for r in replies)
    # a later turn's history comes from the cache in kvboost mode: at least the previous turn's prompt (its
    # whole chunks; the held-out reply after it was never served); cold modes reuse nothing
    chunk = cfg.chunker.chunk_size
    warm = {(r["conversation_id"], r["turn"]): r for r in records if r["mode"] == "kvboost"}
    later = [(r, warm[(c, t - 1)]) for (c, t), r in warm.items() if t >= 2]
    assert later and all(r["reuse_ratio"] > 0 and r["cached_tokens"] >= prev["prompt_tokens"] // chunk * chunk
                         for r, prev in later)  # fmt: skip
    questions = [r for r in recall if r["mode"] == "kvboost"]
    assert all(r["reuse_ratio"] > 0.8 for r in questions)  # the bridge turn stored all but its short reply
    assert all(r["reuse_ratio"] == 0.0 for r in records if r["mode"] != "kvboost")

    table = summary.get("accuracy_by_reuse") or accuracy_by_reuse(records)  # the runner may not add it itself
    assert table["reference_mode"] == "kvboost_cold" and table["bucket_mode"] == "kvboost"
    warm_cells = table["modes"]["kvboost"]
    assert warm_cells["all"]["n"] == len({r["request_id"] for r in records})
    assert warm_cells["all"]["n_tasks"] == 2
    assert warm_cells["all"]["scored_tokens"] == sum(r["score_tokens"] for r in replies if r["mode"] == "kvboost")
    # exact prefix reuse in fp32: the same log-probabilities as the cold prefill (DESIGN.md invariant 1)
    assert abs(warm_cells["all"]["logprob_delta_per_token"]) < 1e-4
    assert warm_cells["all"]["accuracy"] == warm_cells["all"]["accuracy_ref"]
    # cold rows sit in kvboost's bucket of the same request: the same buckets with the same counts
    for mode in ("baseline", "kvboost_cold"):
        assert {b: c["n"] for b, c in table["modes"][mode].items()} == {b: c["n"] for b, c in warm_cells.items()}
    assert len([b for b in warm_cells if b != "all"]) >= 2  # turns spread over several reuse buckets
    if "accuracy_by_reuse" in summary:
        on_disk = json.loads((tmp_path / "summary.json").read_text())
        assert on_disk["accuracy_by_reuse"]["modes"]["kvboost"]["all"]["n"] == warm_cells["all"]["n"]
