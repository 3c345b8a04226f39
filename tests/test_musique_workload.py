"""workload=musique (the CacheBlend paper's protocol, token F1) and rag_reorder's ``layout`` (issue 45).

The workload runs on a 3-question fixture file written into tmp_path (same format as
../shared/data/musique_s_dev.json); one test checks that the real file parses, where it exists.
"""

from __future__ import annotations

import json
from statistics import mean

import pytest
from kvboost_testkit.compose import compose
from kvboost_testkit.tiny import tiny_model

from kvboost.lab.config_check import check_config
from kvboost.lab.runner import run_experiment
from kvboost.lab.workloads import musique as mq
from kvboost.lab.workloads.base import WorkloadEnv

# ------------------------------------------------------------------------------------------ token F1


@pytest.mark.parametrize(
    "text, expected",
    [
        ("The Exeter College.", "exeter college"),
        ("  An  apple,  a PEAR and the plum!", "apple pear and plum"),
        ("Sir Francis Baring, 1st Baronet", "sir francis baring 1st baronet"),
        ("Exeter-College", "exetercollege"),  # punctuation is deleted, not replaced by a space (SQuAD)
        ("theatre another", "theatre another"),  # articles only as whole words
        ("", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert mq.normalize_answer(text) == expected


@pytest.mark.parametrize(
    "prediction, gold, expected",
    [
        ("Exeter College", "Exeter College", 1.0),
        ("Exeter College, Oxford", "Exeter College", 0.8),  # p = 2/3, r = 1
        ("the cat sat", "a cat", 2 / 3),  # [cat, sat] vs [cat]: p = 1/2, r = 1
        ("cat cat cat", "cat dog", 0.4),  # multisets: 1 in common, p = 1/3, r = 1/2
        ("Charles", "Charles County", 2 / 3),  # p = 1, r = 1/2
        ("London", "Paris", 0.0),
        ("", "Paris", 0.0),
        ("the", "a", 1.0),  # both empty after normalisation
    ],
)
def test_f1_score_hand_computed(prediction, gold, expected):
    assert mq.f1_score(prediction, gold) == pytest.approx(expected)


def test_token_f1_takes_the_best_gold_answer_and_exact_match_normalises():
    assert mq.token_f1("Paris France", ["London", "Paris"]) == pytest.approx(2 / 3)
    assert mq.token_f1("Paris", ["Paris, France", "Paris"]) == 1.0
    assert mq.token_f1("anything", []) == 0.0
    assert mq.exact_match("The Jackson 5!", ["Jackson 5"]) is True
    assert mq.exact_match("Jackson Five", ["Jackson 5"]) is False
    assert mq.answer_line("\n  Exeter College \nBecause the passage says so") == "Exeter College"
    assert mq.answer_line("") == ""


# --------------------------------------------------------------------------------------------- data

FIXTURE = [
    {
        "question": "Which river flows through the capital of Norland?",
        "answers": ["The Silver River", "Silver"],
        "ctxs": [
            {
                "title": "",
                "text": "Norland is a small made-up country in the far north. Its capital is the city of "
                "Vellmar, founded by fishermen at the mouth of a wide river.",
            },
            {
                "title": "Vellmar",
                "text": "Vellmar lies on both banks of the Silver River, whose water is said to "
                "shine in the winter sun.\n\nThe old town sits on the east bank.",
            },
            {"title": "", "text": "The Copper Hills rise to the south of Norland and are known for their mines."},
            {"title": "", "text": "A passage that is never used: it is the fourth of this question's list."},
        ],
    },
    {
        "question": "Who founded the city of Vellmar?",
        "answers": ["fishermen"],
        "ctxs": [
            {
                "title": "",
                "text": "Norland is a small made-up country in the far north. Its capital is the city of "
                "Vellmar, founded by fishermen at the mouth of a wide river.",
            },  # shared passage
            {"title": "", "text": "Fishing boats leave the harbour of Vellmar every morning before dawn."},
            {"title": "", "text": "The Copper Hills rise to the south of Norland and are known for their mines."},
        ],
    },
    {
        "question": "What are the Copper Hills known for?",
        "answers": ["their mines", "mining"],
        "ctxs": [
            {"title": "", "text": "The Copper Hills rise to the south of Norland and are known for their mines."},
            {"title": "", "text": "Miners of the Copper Hills sell their ore in the markets of Vellmar."},
            {"title": "", "text": "Sheep graze on the lower slopes of the hills in summer."},
        ],
    },
]


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "musique_fixture.json"
    path.write_text(json.dumps(FIXTURE))
    return path


def _env(tokenizer):
    return WorkloadEnv(tokenizer=tokenizer, count_tokens=lambda p: len(tokenizer(p)["input_ids"]))


def test_load_items_takes_the_first_passages_in_file_order(data_file):
    items = mq.load_items(data_file, num_passages=3)
    assert [i.question for i in items] == [e["question"] for e in FIXTURE]
    assert items[0].answers == ["The Silver River", "Silver"]
    assert len(items[0].passages) == 3 and items[0].passages[0] == FIXTURE[0]["ctxs"][0]["text"]
    # a title goes on its own line before the text; blank lines are folded so a passage stays one chunk
    assert items[0].passages[1].startswith("Vellmar\nVellmar lies") and "\n\n" not in items[0].passages[1]
    assert [i.item_id for i in mq.load_items(data_file, num_passages=2, num_queries=2)] == ["musique000", "musique001"]


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"question": "q?", "ctxs": [{"title": "", "text": "t"}] * 3}, "'answers'"),
        ({"question": "", "answers": ["a"], "ctxs": [{"title": "", "text": "t"}] * 3}, "'question'"),
        ({"question": "q?", "answers": ["a"], "ctxs": [{"title": ""}] * 3}, "'ctxs'"),
        ({"question": "q?", "answers": ["a"], "ctxs": [{"title": "", "text": "t"}] * 2}, "num_passages=3"),
    ],
)
def test_malformed_entries_name_the_file_the_entry_and_the_field(tmp_path, entry, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([FIXTURE[0], entry]))
    with pytest.raises(ValueError, match=message) as info:
        mq.load_items(path, num_passages=3)
    assert str(path) in str(info.value) and "entry 1" in str(info.value)
    with pytest.raises(ValueError, match="num_queries"):
        mq.load_items(path, num_passages=3, num_queries=5)


def test_prompt_layout_passages_then_the_question(data_file, smollm_tokenizer):
    w = mq.Musique(env=_env(smollm_tokenizer), data_path=str(data_file), num_passages=3)
    item = w.items[0]
    prompt = next(w.requests()).prompt
    head = w.shared_head()
    assert head.startswith("<|im_start|>system\n" + mq.DEFAULT_SYSTEM_PROMPT) and head.endswith("user\nPassages:")
    pieces = prompt.split("\n\n")
    assert pieces[0] == head
    assert pieces[1:4] == item.passages  # each passage exactly one separator-delimited piece, top first
    assert pieces[4] == ("Answer the question based on the passages above, in at most 5 words.\nQuestion: "
                         f"{item.question}<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip
    assert prompt.count(item.question) == 1  # only after the passages
    # per_query (default): each question's passages after the shared head, right before it; nothing up front
    assert w.shared_context() == []
    assert w.request_context(next(w.requests())) == [head + "\n\n" + p for p in item.passages]
    # all: every distinct passage of the run once, before timing
    every = mq.Musique(env=_env(smollm_tokenizer), data_path=str(data_file), num_passages=3, warm_passages="all")
    distinct = list(dict.fromkeys(p for i in w.items for p in i.passages))
    assert every.shared_context() == [head + "\n\n" + p for p in distinct] and len(distinct) < 3 * 3
    assert every.request_context(next(every.requests())) == []
    none = mq.Musique(env=_env(smollm_tokenizer), data_path=str(data_file), num_passages=3, warm_passages="none")
    assert none.shared_context() == [] and none.request_context(next(none.requests())) == []
    with pytest.raises(ValueError, match="workload.warm_passages"):
        mq.Musique(env=_env(smollm_tokenizer), data_path=str(data_file), warm_passages=True)
    assert w.smaller_overrides(0.5) == {"num_queries": 1}


def test_a_seed_other_than_0_shuffles_each_questions_top_passages(data_file, smollm_tokenizer):
    base = mq.Musique(env=_env(smollm_tokenizer), data_path=str(data_file), num_passages=3)
    draws = [mq.Musique(env=_env(smollm_tokenizer), data_path=str(data_file), num_passages=3, seed=s)
             for s in (1, 2, 3)]  # fmt: skip
    for k, item in enumerate(base.items):
        orders = [d.items[k].passages for d in draws]
        assert all(sorted(o) == sorted(item.passages) for o in orders)  # the same top passages
    assert any(d.items[k].passages != base.items[k].passages for d in draws for k in range(3))
    again = mq.Musique(env=_env(smollm_tokenizer), data_path=str(data_file), num_passages=3, seed=1)
    assert [i.passages for i in again.items] == [i.passages for i in draws[0].items]  # deterministic


def test_a_relative_data_path_is_resolved_against_the_project_root():
    from kvboost.paths import project_root

    assert mq.resolve_data_path("../shared/data/x.json") == project_root() / "../shared/data/x.json"
    assert mq.resolve_data_path("/abs/x.json").as_posix() == "/abs/x.json"


def test_a_bad_data_path_fails_at_the_config_check_before_any_model_loads(tmp_path, monkeypatch):
    missing = tmp_path / "nowhere" / "musique.json"
    cfg = compose(["workload=musique", f"workload.data_path={missing}", "logger=none", "model=tiny_random"])
    with pytest.raises(FileNotFoundError, match="workload.data_path") as info:
        check_config(dict(cfg))
    assert str(missing) in str(info.value)

    from kvboost.lab import runner

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the data path was checked")

    monkeypatch.setattr(runner, "build_engine", no_model)
    with pytest.raises(FileNotFoundError, match="workload.data_path"):
        run_experiment(cfg, out_dir=tmp_path / "out")


def test_the_real_file_parses_where_it_exists(smollm_tokenizer):
    path = mq.resolve_data_path(mq.DEFAULT_DATA_PATH)
    if not path.is_file():
        pytest.skip(f"{path} is not on this machine")
    items = mq.load_items(mq.DEFAULT_DATA_PATH, num_passages=6)
    assert len(items) == 100 and all(len(i.passages) == 6 and i.answers for i in items)
    w = mq.Musique(env=_env(smollm_tokenizer), num_queries=3)  # the default data_path, every passage one chunk
    for request, item in zip(w.requests(), w.items, strict=True):
        pieces = request.prompt.split("\n\n")
        assert pieces[1:7] == item.passages and item.question in pieces[7]


# ------------------------------------------------------------------------------------- end to end


def _records(out):
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("recompute, warm", [("none", "per_query"), ("full", "per_query"), ("none", "all")])
def test_musique_end_to_end_through_the_runner(recompute, warm, data_file, tmp_path, smollm_tokenizer):
    """Each record has its F1; the summary's F1 is their mean; the passages were content hits on every query."""
    cfg = compose(["workload=musique", f"workload.data_path={data_file}", "workload.num_passages=3",
                   f"workload.warm_passages={warm}",
                   "workload.max_new_tokens=4", f"recompute={recompute}", "logger=none", "warmup=false", "engine.decode=eager",
                   "workload.modes=[baseline,kvboost_cold,kvboost]"])  # fmt: skip
    assert cfg.chunker.name == "separator" and cfg.workload.max_new_tokens == 4
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048)
    out = tmp_path / "run"
    summary = run_experiment(cfg, out_dir=out, model=model, tokenizer=smollm_tokenizer)
    records = _records(out)
    assert len(records) == 3 * 3
    for r in records:
        assert 0.0 <= r["f1"] <= 1.0 and isinstance(r["correct"], bool)
        assert r["f1"] == pytest.approx(mq.token_f1(mq.answer_line(r["output_text"]), r["gold_answers"]))
    for mode in ("baseline", "kvboost_cold", "kvboost"):
        acc = summary["accuracy"][mode]
        assert acc["f1_n"] == 3
        assert acc["f1_mean"] == pytest.approx(mean(r["f1"] for r in records if r["mode"] == mode))
    kvboost = [r for r in records if r["mode"] == "kvboost"]
    # every query's passages were warmed: found in the cache, by content (not only as a prefix), in every query
    assert all(r["cached_tokens"] > 0 and r["content_ratio"] > 0.1 for r in kvboost), kvboost
    assert all(r["cached_tokens"] == 0 for r in records if r["mode"] == "kvboost_cold")
    if recompute == "none":  # computed: the question and the passages' separators, at most
        assert all(r["prefill_tokens"] < 0.4 * r["prompt_tokens"] and r["recompute_ratio"] == 0 for r in kvboost)
    else:  # every content hit recomputed: the engine's cold prefill's tokens
        assert all(r["recompute_ratio"] == pytest.approx(r["content_ratio"]) for r in kvboost)
        assert all(r["greedy_match_vs_cold"] for r in kvboost)
    assert summary["workload"]["name"] == "musique" and summary["workload"]["queries"] == 3
    assert summary["run"]["shared_context_items"] == (6 if warm == "all" else 0)  # 6 distinct passages


# ------------------------------------------------------------------------------------ rag_reorder layout

RAG_FIELDS = {"num_documents": 4, "num_queries": 3, "docs_per_query": 3, "doc_tokens": 64}


def test_rag_reorder_layouts(smollm_tokenizer):
    """question_both (default): the question before and after the documents; question_after: only after them,
    and the shared head (what documents are warmed after) ends with "Documents:"."""
    from kvboost.lab.workloads.rag_reorder import RagReorder

    both = RagReorder(env=_env(smollm_tokenizer), **RAG_FIELDS)
    after = RagReorder(env=_env(smollm_tokenizer), layout="question_after", **RAG_FIELDS)
    assert both.cfg.layout == "question_both"
    for rb, ra, q in zip(both.requests(), after.requests(), both.queries, strict=True):
        docs = [both.by_id[d].text for d in q.doc_ids]
        assert rb.prompt.count(q.question) == 2 and ra.prompt.count(q.question) == 1
        assert rb.prompt.index(q.question) < rb.prompt.index(docs[0])
        assert ra.prompt.index(q.question) > ra.prompt.index(docs[-1])
        assert ra.prompt.split("\n\n")[1 : 1 + len(docs)] == docs  # the documents right after the head
        assert rb.expected == ra.expected and rb.score_ids == ra.score_ids
    assert both.shared_head().endswith("Question: ")
    head = after.shared_head()
    assert head.endswith("user\nDocuments:") and "\n\n" not in head
    assert after.shared_context() == [head + "\n\n" + d.text for d in after.documents]
    with pytest.raises(ValueError, match="workload.layout"):
        RagReorder(env=_env(smollm_tokenizer), layout="question_first", **RAG_FIELDS)


@pytest.mark.parametrize("layout", ["question_both", "question_after"])
def test_rag_reorder_runs_in_both_layouts(layout, tmp_path, smollm_tokenizer):
    cfg = compose(["workload=rag_reorder", f"workload.layout={layout}", "recompute=none", "logger=none",
                   "warmup=false", "engine.decode=eager", "workload.num_documents=4", "workload.num_queries=2", "workload.docs_per_query=3",
                   "workload.doc_tokens=64", "workload.max_new_tokens=2", "workload.modes=[baseline,kvboost]"])  # fmt: skip
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048)
    summary = run_experiment(cfg, out_dir=tmp_path, model=model, tokenizer=smollm_tokenizer)
    assert summary["config"]["workload"]["layout"] == layout
    kvboost = summary["modes"]["kvboost"]["overall"]
    # the documents are found in every query (question_after: the first one is an exact hit, the head before it
    # being the one it was warmed after; the others are content hits)
    assert kvboost["reuse_ratio"] > 0.75 and kvboost["content_ratio"] > 0.3, kvboost
    assert summary["accuracy"]["kvboost"]["n"] == 2


# ------------------------------------------------------------------ issue 59: reference F1 and layouts


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\n\nExeter College\nbecause", "Exeter College"),  # leading newlines dropped, first line kept
        ("yes, it is", "Yes"),
        ("Yes.", "Yes"),
        ("Nope, never", "No"),  # the first word starts with "No"
        ("Norway", "No"),  # the reference folds this too (a fact of its code, kept)
        ("not at all", "not at all"),
        ("", ""),
    ],
)
def test_parse_generation_as_the_reference_code(text, expected):
    assert mq.parse_generation(text) == expected


def test_tokenizer_f1_counts_tokenizer_ids_of_the_parsed_first_line(smollm_tokenizer):
    tok = smollm_tokenizer

    def ids(t):
        return tok(t, add_special_tokens=False)["input_ids"]

    gold = "Exeter College"
    assert mq.tokenizer_f1("Exeter College\nmore text", [gold], tok) == 1.0
    pred = "Exeter College, Oxford"
    p, g = ids(pred), ids(gold)
    same = sum(1 for t in set(g) if t in p)  # no repeated ids here: checked below
    assert len(set(p)) == len(p) and len(set(g)) == len(g)
    expected = 2 * (same / len(p)) * (same / len(g)) / (same / len(p) + same / len(g))
    assert mq.tokenizer_f1(pred, ["Paris", gold], tok) == pytest.approx(expected) and 0 < expected < 1
    assert mq.tokenizer_f1("yes indeed", ["Yes"], tok) == 1.0  # folded before scoring
    assert mq.tokenizer_f1("London", ["Paris"], tok) == 0.0 and mq.tokenizer_f1("x", [], tok) == 0.0


def test_independent_layout_encodes_each_passage_alone_after_bos(data_file, smollm_tokenizer):
    w = mq.Musique(env=_env(smollm_tokenizer), data_path=str(data_file), layout="independent")
    item = w.items[0]
    assert w.cfg.num_passages is None and len(item.passages) == len(FIXTURE[0]["ctxs"])  # every passage
    request = next(w.requests())
    pieces = request.prompt.split("\n\n")
    assert pieces[1 : 1 + len(item.passages)] == item.passages
    assert pieces[-1].split("<|im_end|>")[0].endswith(f"Question: {item.question}\nAnswer:")
    bos = smollm_tokenizer.bos_token
    assert bos and w.request_context(request) == [bos + "\n\n" + p for p in item.passages]
    # the default layout: after the shared head, 6 passages (num_passages null)
    shared = mq.Musique(env=_env(smollm_tokenizer), data_path=str(data_file), num_passages=3)
    assert shared.cfg.layout == "shared_prefix"
    assert shared.request_context(next(shared.requests()))[0].startswith(shared.shared_head() + "\n\n")
    assert w.score(request, "The Silver River") == {"f1": 1.0, "f1_ref": 1.0}
    with pytest.raises(ValueError, match="workload.layout"):
        mq.Musique(env=_env(smollm_tokenizer), data_path=str(data_file), layout="apart")


def test_independent_layout_without_a_bos_token_warms_the_passage_alone(data_file, smollm_tokenizer):
    import copy

    tok = copy.deepcopy(smollm_tokenizer)
    tok.bos_token = None
    w = mq.Musique(env=_env(tok), data_path=str(data_file), layout="independent", num_passages=2)
    assert w.request_context(next(w.requests())) == w.items[0].passages


# ------------------------------------------------------------------------- fidelity in the runner (issue 59)

FIDELITY_FIELDS = ("f1", "answer_kl", "first_token_kl", "greedy_match", "gold_logprob_delta", "recompute_fraction")


@pytest.mark.parametrize("recompute", ["full", "none"])
def test_musique_run_writes_fidelity_to_the_cold_full_prefill(recompute, data_file, tmp_path, smollm_tokenizer):
    """Every mode's record carries its fidelity to the cold full prefill's greedy answer and summary.json their
    means; the cold mode reads ~0 (it is the reference's computation), and kvboost reusing the passages, cached
    alone after BOS and read in another context, without repair deviates (recompute=none) while recomputing every
    reused row (recompute=full) reads ~0 as well. The runner and experiments.bench.fidelity share one
    implementation (kvboost.lab.fidelity), so the numbers agree with a direct call of it."""
    from kvboost.lab.fidelity import SUMMARY_FIELDS

    cfg = compose(["workload=musique", f"workload.data_path={data_file}", "workload.num_passages=3",
                   "workload.layout=independent", "workload.num_queries=2", "workload.max_new_tokens=4",
                   f"recompute={recompute}", "logger=none", "warmup=false", "engine.decode=eager",
                   "workload.modes=[kvboost_cold,kvboost]"])  # fmt: skip
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048)
    out = tmp_path / "run"
    summary = run_experiment(cfg, out_dir=out, model=model, tokenizer=smollm_tokenizer)
    records = _records(out)
    assert len(records) == 2 * 2
    for r in records:
        fid = r["fidelity"]
        assert {"answer_kl", "first_token_kl", "greedy_match", "gold_logprob_delta", "recompute_fraction"} <= set(fid)
        assert fid["answer_tokens"] >= 1 and fid["answer_kl"] >= 0 and fid["first_token_kl"] >= 0
    by_mode = {m: [r for r in records if r["mode"] == m] for m in ("kvboost_cold", "kvboost")}
    for r in by_mode["kvboost_cold"]:
        fid = r["fidelity"]
        assert fid["answer_kl"] < 1e-6 and fid["first_token_kl"] < 1e-6 and fid["greedy_match"] is True, fid
        assert abs(fid["gold_logprob_delta"]) < 1e-3 and fid["recompute_fraction"] == 0.0
    kv = [r["fidelity"] for r in by_mode["kvboost"]]
    assert all(r["cached_tokens"] > 0 for r in by_mode["kvboost"])  # the passages were reused
    if recompute == "none":
        assert max(f["answer_kl"] for f in kv) > 1e-4 and all(f["recompute_fraction"] == 0.0 for f in kv)
    else:
        assert all(f["answer_kl"] < 1e-6 and f["greedy_match"] and f["recompute_fraction"] > 0 for f in kv), kv
    written = json.loads((out / "summary.json").read_text())["fidelity"]
    assert written == json.loads(json.dumps(summary["fidelity"]))
    for mode, rs in by_mode.items():
        row = written[mode]
        assert row["n"] == 2
        for name in (*FIDELITY_FIELDS, *SUMMARY_FIELDS, "ttft_ms_mean", "ttft_ms_p50"):
            assert row[name] is not None, (mode, name)
        assert row["answer_kl"] == pytest.approx(mean(r["fidelity"]["answer_kl"] for r in rs))
        assert row["greedy_match"] == pytest.approx(mean(float(r["fidelity"]["greedy_match"]) for r in rs))
        assert row["f1"] == pytest.approx(mean(r["f1"] for r in rs))
        assert row["ttft_ms_p50"] == pytest.approx(summary["modes"][mode]["overall"]["ttft_ms_p50"])


@pytest.mark.parametrize("warm", ["none", "per_query"])
def test_fidelity_scoring_changes_nothing_a_timed_request_sees(warm, data_file, tmp_path, smollm_tokenizer,
                                                               monkeypatch):  # fmt: skip
    """The same run with and without the fidelity scoring: every timed request finds the same cache (hits, rows
    computed) and answers the same. With ``warm_passages=none`` a passage is found only where an earlier question
    stored it, so this also checks that the store the timed request leaves out is still done (by the untimed
    gold-scoring call after it), and that no scoring call warms a prompt before it is measured."""
    cfg = compose(["workload=musique", f"workload.data_path={data_file}", "workload.num_passages=3",
                   f"workload.warm_passages={warm}", "workload.max_new_tokens=4", "recompute=cacheblend",
                   "recompute.check_layers=[0]", "logger=none", "warmup=false", "engine.decode=eager",
                   "workload.modes=[kvboost_cold,kvboost]"])  # fmt: skip
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=2048)
    seen = ("cached_tokens", "prefill_tokens", "exact_ratio", "content_ratio", "recompute_ratio", "output_text")

    def timed_view(out):
        return {(r["request_id"], r["mode"]): {k: r.get(k) for k in seen} for r in _records(out)}

    run_experiment(cfg, out_dir=tmp_path / "with", model=model, tokenizer=smollm_tokenizer)
    monkeypatch.setattr(mq.Musique, "fidelity_reference", False)
    run_experiment(cfg, out_dir=tmp_path / "without", model=model, tokenizer=smollm_tokenizer)
    with_fidelity, without = timed_view(tmp_path / "with"), timed_view(tmp_path / "without")
    assert all("fidelity" in r for r in _records(tmp_path / "with"))
    assert not any("fidelity" in r for r in _records(tmp_path / "without"))
    assert with_fidelity == without
    if warm == "none":  # the check has teeth: later questions read what earlier ones stored (shared passages)
        assert any(v["content_ratio"] > 0 for (_, mode), v in without.items() if mode == "kvboost")
