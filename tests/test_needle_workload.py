"""workload=needle: a RULER-style needle in ~4k tokens of generated filler passages (issue 45).

Prompts are built with the bundled model's tokenizer (no weights); the end-to-end runs use a tiny random model
with that tokenizer and a shorter context.
"""

from __future__ import annotations

import json
import re
from statistics import mean

import pytest
from kvboost_testkit.compose import compose
from omegaconf import OmegaConf
from kvboost_testkit.tiny import tiny_model

from kvboost.lab.config_check import check_config
from kvboost.lab.runner import run_experiment
from kvboost.lab.workloads import WORKLOADS
from kvboost.lab.workloads import needle as nd
from kvboost.lab.workloads.base import WorkloadEnv
from kvboost.lab.workloads.musique import token_f1


def _env(tokenizer):
    return WorkloadEnv(tokenizer=tokenizer, count_tokens=lambda p: len(tokenizer(p)["input_ids"]))


def _needle(tokenizer, **fields):
    fields.setdefault("context_tokens", 1200)
    fields.setdefault("num_queries", 4)
    return nd.Needle(env=_env(tokenizer), **fields)


# ------------------------------------------------------------------------------------------------ prompts


def test_prompt_layout_instruction_passages_question_and_answer_prefix(smollm_tokenizer):
    w = _needle(smollm_tokenizer)
    head = w.shared_head()
    assert head.startswith("<|im_start|>system\n" + nd.DEFAULT_SYSTEM_PROMPT) and head.endswith(nd.INSTRUCTION)
    for request, item in zip(w.requests(), w.items, strict=True):
        pieces = request.prompt.split("\n\n")
        assert pieces[0] == head
        assert pieces[1:-1] == item.passages  # each passage exactly one separator-delimited piece
        question = nd.QUESTION_TEMPLATE.format(key=item.key)
        assert pieces[-1] == (f"{question}<|im_end|>\n<|im_start|>assistant\n"
                              f"The special magic number for {item.key} mentioned in the provided text is")  # fmt: skip
        needle = nd.NEEDLE_TEMPLATE.format(key=item.key, value=item.value)
        assert request.prompt.count(needle) == 1 and needle in item.passages[item.needle_passage]
        assert re.findall(r"\d+", request.prompt) == [item.value]  # the filler is digit-free: one number
        assert request.expected == item.value and len(item.value) == 7
        assert request.info["needle_key"] == item.key and request.info["num_passages"] == len(item.passages)
        assert smollm_tokenizer.decode(request.score_ids).strip() == item.value
    no_prefix = _needle(smollm_tokenizer, answer_prefix=False)
    assert next(no_prefix.requests()).prompt.endswith("<|im_start|>assistant\n")


def test_context_tokens_is_met_with_the_models_tokenizer_and_never_exceeded(smollm_tokenizer):
    for context_tokens in (800, 4000):
        w = _needle(smollm_tokenizer, context_tokens=context_tokens)
        counts = [len(smollm_tokenizer(r.prompt)["input_ids"]) for r in w.requests()]
        assert all(context_tokens - 40 <= c <= context_tokens for c in counts), (context_tokens, counts)
        stats = w.stats()
        assert stats["prompt_tokens_max"] == max(counts) and stats["num_passages"] == len(w.bank)
    assert len(w.bank) >= 14 and all(len(smollm_tokenizer(p)["input_ids"]) <= 250 for p in w.bank)  # 4000 tokens
    with pytest.raises(ValueError, match="context_tokens"):
        _needle(smollm_tokenizer, context_tokens=100)


def test_every_query_shows_the_whole_bank_in_its_own_order(smollm_tokenizer):
    w = _needle(smollm_tokenizer, num_queries=6)
    needles = [nd.NEEDLE_TEMPLATE.format(key=i.key, value=i.value) for i in w.items]
    orders = []
    for item, needle in zip(w.items, needles, strict=True):
        without = [p.replace(" " + needle, "").replace(needle + " ", "") for p in item.passages]
        assert sorted(without) == sorted(w.bank)  # the same filler passages, needle taken out
        orders.append(without)
    assert len({tuple(o) for o in orders}) > 1  # the filler order is drawn per query
    assert len({i.key for i in w.items}) == 6 and len(set(w.bank)) == len(w.bank)  # distinct keys and passages


@pytest.mark.parametrize("depth, passage, first", [(0.0, 0, True), (1.0, -1, False), (0.5, None, None)])
def test_depths_place_the_needle(smollm_tokenizer, depth, passage, first):
    w = _needle(smollm_tokenizer, depths=[depth], num_queries=2)
    for item in w.items:
        needle = nd.NEEDLE_TEMPLATE.format(key=item.key, value=item.value)
        k = len(item.passages)
        assert item.depth == depth and item.needle_passage == (passage % k if passage is not None else k // 2)
        text = item.passages[item.needle_passage]
        if first is True:
            assert text.startswith(needle)
        elif first is False:
            assert text.endswith(needle)
        else:
            assert not text.startswith(needle) or not text.endswith(needle)


def test_a_list_of_depths_cycles_and_null_draws_them(smollm_tokenizer):
    w = _needle(smollm_tokenizer, depths=[0.0, 0.25, 0.75], num_queries=5)
    assert [i.depth for i in w.items] == [0.0, 0.25, 0.75, 0.0, 0.25]
    drawn = _needle(smollm_tokenizer, num_queries=6)
    assert len({i.depth for i in drawn.items}) == 6 and all(0.0 <= i.depth <= 1.0 for i in drawn.items)
    fixed = _needle(smollm_tokenizer, num_queries=6, depths=[0.5])  # same seed: same needles, only the depth set
    assert [(i.key, i.value) for i in fixed.items] == [(i.key, i.value) for i in drawn.items]


def test_a_seed_is_a_draw_deterministic_and_different(smollm_tokenizer):
    a, again, b = (_needle(smollm_tokenizer, seed=s) for s in (1, 1, 2))
    assert [r.prompt for r in a.requests()] == [r.prompt for r in again.requests()]
    assert [i.key for i in a.items] != [i.key for i in b.items] and a.bank != b.bank
    assert [i.value for i in a.items] != [i.value for i in b.items]
    assert [i.depth for i in a.items] != [i.depth for i in b.items]


def test_warm_passages(smollm_tokenizer):
    w = _needle(smollm_tokenizer)
    request, item = next(w.requests()), w.items[0]
    head = w.shared_head() + "\n\n"
    assert w.shared_context() == [] and w.request_context(request) == [head + p for p in item.passages]
    every = _needle(smollm_tokenizer, warm_passages="all")
    warmed = every.shared_context()
    assert every.request_context(request) == [] and len(warmed) == len(set(warmed))
    assert all(head + p in warmed for i in every.items for p in i.passages)  # the bank and each needle passage
    assert len(warmed) == len(every.bank) + len(every.items)
    none = _needle(smollm_tokenizer, warm_passages="none")
    assert none.shared_context() == [] and none.request_context(request) == []
    assert w.smaller_overrides(0.5) == {"num_queries": 2}


# ------------------------------------------------------------------------------------------------ scores


@pytest.mark.parametrize(
    "output, correct, f1",
    [
        (" 4829183.", True, 1.0),
        ("4,829,183", True, 1.0),  # thousands separators: the same number (F1 drops punctuation too)
        (" 4829183 is the number", True, 0.5),  # normalised [4829183, is, number]: p = 1/3, r = 1
        ("\n4829183\nor maybe 1234567", True, 1.0),
        (" 1234567 or 4829183", False, 0.5),  # the first number counts
        (" unknown", False, 0.0),
        ("", False, 0.0),
    ],
)
def test_scores(smollm_tokenizer, output, correct, f1):
    w = _needle(smollm_tokenizer, num_queries=1)
    request = next(w.requests())
    request.expected = "4829183"
    assert w.is_correct(request, output) is correct
    assert w.score(request, output)["f1"] == pytest.approx(f1)
    assert nd.first_number("a 1,234 b 5") == "1234" and nd.first_number("none") is None


@pytest.mark.parametrize(
    "fields, error, match",
    [
        ({"depths": [0.5, 1.5]}, ValueError, "workload.depths"),
        ({"depths": []}, ValueError, "workload.depths"),
        ({"warm_passages": "some"}, ValueError, "workload.warm_passages"),
        ({"num_queries": 0}, ValueError, "workload.num_queries"),
        ({"passage_tokens": 8}, ValueError, "workload.passage_tokens"),
        ({"seed": "x"}, TypeError, "workload.seed"),
    ],
)
def test_config_values_are_checked(fields, error, match):
    with pytest.raises(error, match=match):
        nd.NeedleConfig(**fields)


# ------------------------------------------------------------------------------------------------ config


def test_the_config_composes_selects_the_separator_chunker_and_mirrors_the_dataclass():
    cfg = OmegaConf.to_container(compose(["workload=needle", "workload.depths=[0.0,0.5]"]), resolve=True)
    check_config(cfg)
    assert cfg["chunker"]["name"] == "separator" and cfg["chunker"]["separator"] == cfg["workload"]["separator"]
    fields = {f for f in cfg["workload"] if f not in ("name", "modes", "repeats")}
    assert fields == set(nd.NeedleConfig.__dataclass_fields__)
    assert "needle" in WORKLOADS.names()
    bad = OmegaConf.to_container(compose(["workload=needle", "workload.depths=[2.0]"]), resolve=True)
    with pytest.raises(ValueError, match="workload.depths"):
        check_config(bad)


# ------------------------------------------------------------------------------------------------ end to end


def _records(out):
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recompute", ["none", "full", "cacheblend"])
def test_needle_end_to_end_through_the_runner(recompute, tmp_path, smollm_tokenizer):
    """Records carry correct and f1; every query's passages are content hits; full equals the cold prefill."""
    cfg = compose(["workload=needle", "workload.context_tokens=700", "workload.num_queries=2",
                   "workload.passage_tokens=120", "workload.max_new_tokens=4", f"recompute={recompute}",
                   "logger=none", "warmup=false", "engine.decode=eager"]
                  + (["recompute.check_layers=[0]"] if recompute == "cacheblend" else []))  # 2 layers  # fmt: skip
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048)
    out = tmp_path / "run"
    summary = run_experiment(cfg, out_dir=out, model=model, tokenizer=smollm_tokenizer)
    records = _records(out)
    assert len(records) == 2 * 3
    for r in records:
        assert isinstance(r["correct"], bool) and 0.0 <= r["f1"] <= 1.0
        assert r["f1"] == pytest.approx(token_f1(nd.answer_line(r["output_text"]), [r["needle_value"]]))
        assert r["prompt_tokens"] <= 700
    for mode in ("baseline", "kvboost_cold", "kvboost"):
        acc = summary["accuracy"][mode]
        assert acc["f1_n"] == 2 and acc["f1_mean"] == pytest.approx(mean(r["f1"] for r in records if r["mode"] == mode))
    kvboost = [r for r in records if r["mode"] == "kvboost"]
    assert all(r["cached_tokens"] > 0 and r["content_ratio"] > 0.5 for r in kvboost), kvboost
    if recompute == "none":
        assert all(r["recompute_ratio"] == 0 and r["prefill_tokens"] < 0.3 * r["prompt_tokens"] for r in kvboost)
    elif recompute == "full":
        assert all(r["recompute_ratio"] == pytest.approx(r["content_ratio"]) for r in kvboost)
        assert all(r["greedy_match_vs_cold"] for r in kvboost)
    else:
        assert all(0 < r["recompute_ratio"] < r["content_ratio"] for r in kvboost)
    assert summary["workload"]["name"] == "needle" and summary["workload"]["queries"] == 2
