"""The rag_reorder corpus: real-text documents with planted facts, queries, prompt layout, answer checking.

Fast: no model weights (the bundled SmolLM2's tokenizer only, for the chat template and token counts).
"""

from __future__ import annotations

import re

import pytest

from kvboost.lab import rag_corpus as rc


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    from kvboost.models.loading import bundled_model_dir

    return AutoTokenizer.from_pretrained(bundled_model_dir())


@pytest.fixture(scope="module")
def count(tok):
    return lambda text: len(tok(text, add_special_tokens=False)["input_ids"])


@pytest.fixture(scope="module")
def corpus(count):
    return rc.build_corpus(num_documents=24, seed=0, doc_tokens=280, count_tokens=count)


@pytest.fixture(scope="module")
def queries(corpus):
    return rc.build_queries(corpus, num_queries=60, docs_per_query=5, seed=0)


def test_corpus_is_deterministic_per_seed(corpus, count):
    again = rc.build_corpus(num_documents=24, seed=0, doc_tokens=280, count_tokens=count)
    assert again == corpus
    other = rc.build_corpus(num_documents=24, seed=1, doc_tokens=280, count_tokens=count)
    assert [d.text for d in other] != [d.text for d in corpus]


def test_queries_are_deterministic_and_extend(corpus, queries):
    assert rc.build_queries(corpus, num_queries=60, docs_per_query=5, seed=0) == queries
    assert rc.build_queries(corpus, num_queries=10, docs_per_query=5, seed=0) == queries[:10]
    assert rc.build_queries(corpus, num_queries=60, docs_per_query=5, seed=1) != queries


def test_documents(corpus, count):
    assert len(corpus) == 24
    assert len({d.doc_id for d in corpus}) == 24
    assert len({d.subject for d in corpus}) == 24, "subjects must be unique"
    assert len({d.answer for d in corpus}) == 24, "answers must be unique"
    all_text = "\n".join(d.text for d in corpus)
    for d in corpus:
        assert "\n\n" not in d.text and d.text == d.text.strip()
        assert d.text.count(d.fact) == 1 and d.answer in d.fact and d.subject in d.fact
        assert d.relation in d.fact and d.relation in d.question
        assert d.subject in d.question and d.answer_prefix.startswith("Project " + d.subject)
        # the answer occurs once in the whole corpus (never as part of another number), the subject only in d
        assert len(re.findall(rf"(?<!\d){d.answer}(?!\d)", all_text)) == 1 and d.answer.isdigit()
        assert sum(re.search(rf"\b{d.subject}\b", o.text) is not None for o in corpus) == 1
        # the fact is planted between two sentences, never first or last
        assert not d.text.startswith(d.fact) and not d.text.endswith(d.fact)
        assert 0.7 * 280 <= count(d.text) <= 280
    assert len({d.source for d in corpus}) == 24


def test_fact_placement_varies(corpus):
    relative = [d.text.index(d.fact) / len(d.text) for d in corpus]
    assert min(relative) < 0.35 and max(relative) > 0.6


def test_queries(corpus, queries):
    by_id = {d.doc_id: d for d in corpus}
    positions = [q.target_position for q in queries]
    assert sorted(set(positions)) == [0, 1, 2, 3, 4]
    assert max(positions.count(p) for p in range(5)) <= 13  # balanced: 12 each for 60 queries
    targets = [q.target_doc for q in queries]
    assert set(targets) == set(by_id)  # every document is a target
    for q in queries:
        assert len(q.doc_ids) == 5 and len(set(q.doc_ids)) == 5
        assert q.target_doc in q.doc_ids
        t = by_id[q.target_doc]
        assert (q.answer, q.question, q.answer_prefix) == (t.answer, t.question, t.answer_prefix)
    assert len({tuple(q.doc_ids) for q in queries}) == 60  # fresh orders


def test_prompt_layout(tok, corpus, queries, count):
    by_id = {d.doc_id: d for d in corpus}
    lengths = []
    for q in queries[:20]:
        text = rc.render_prompt(tok, q, by_id)
        pieces = text.split("\n\n")
        for d in q.doc_ids:
            assert pieces.count(by_id[d].text) == 1, "every document is exactly one separator-delimited piece"
        doc_pieces = [i for i, p in enumerate(pieces) if p in {by_id[d].text for d in q.doc_ids}]
        assert [pieces[i] for i in doc_pieces] == [by_id[d].text for d in q.doc_ids]  # in query order
        assert doc_pieces == list(range(doc_pieces[0], doc_pieces[0] + 5))  # adjacent
        before, after = "\n\n".join(pieces[: doc_pieces[0]]), "\n\n".join(pieces[doc_pieces[-1] + 1 :])
        assert q.question in before and q.question in after
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n" + q.answer_prefix)
        assert q.answer not in before and q.answer not in after
        lengths.append(count(text))
    assert 1200 <= min(lengths) and max(lengths) <= 1800


def test_prompt_with_other_separator_and_without_documents(tok, corpus, queries):
    by_id = {d.doc_id: d for d in corpus}
    q = queries[0]
    text = rc.render_prompt(tok, q, by_id, separator="\n###\n", system_prompt="Be brief.")
    pieces = text.split("\n###\n")
    assert all(pieces.count(by_id[d].text) == 1 for d in q.doc_ids) and "Be brief." in text
    bare = rc.render_prompt(tok, q, by_id, include_documents=False)
    assert q.answer not in bare and all(by_id[d].text not in bare for d in q.doc_ids)
    assert q.question in bare and bare.endswith(q.answer_prefix)


def test_prompt_rejects_separator_inside_a_document(tok, corpus, queries):
    by_id = {d.doc_id: d for d in corpus}
    q = queries[0]
    broken = dict(by_id)
    d = by_id[q.doc_ids[1]]
    broken[d.doc_id] = rc.Document(d.doc_id, d.text.replace(". ", ".\n\n", 1), d.subject, d.answer)
    with pytest.raises(ValueError, match="separator"):
        rc.render_prompt(tok, q, broken)
    with pytest.raises(ValueError, match="separator"):
        rc.render_prompt(tok, q, by_id, system_prompt="two\n\nparagraphs")


def test_default_token_estimate_builds_without_a_tokenizer():
    docs = rc.build_corpus(num_documents=6, seed=0)
    assert len(docs) == 6 and all("\n\n" not in d.text for d in docs)


def test_argument_checks(corpus):
    with pytest.raises(ValueError):
        rc.build_corpus(num_documents=0)
    with pytest.raises(ValueError):
        rc.build_corpus(num_documents=len(rc.SUBJECT_NAMES) + 1)
    with pytest.raises(ValueError):
        rc.build_queries(corpus, num_queries=3, docs_per_query=25)
    with pytest.raises(ValueError):
        rc.build_queries(corpus, num_queries=3, docs_per_query=0)


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (" 4817.", True),
        ("4817", True),
        (" 4817. The document says", True),
        ("\n 4817\nsomething else", True),  # the first non-empty line
        (" 4,817.", True),  # digit grouping
        (" is 4817 (from the second document)", True),
        (" 48170.", False),  # a longer number
        (" 14817", False),
        (" 4817.5", False),
        (" 481", False),  # a truncated one
        (" 1234 or 4817", False),  # hedging: the first number counts
        (" 1234.\n4817", False),  # only the first line counts
        ("", False),
        (" The document does not say.", False),
    ],
)
def test_is_correct_numeric(output, expected):
    assert rc.is_correct(output, "4817") is expected


def test_is_correct_text_answers():
    assert rc.is_correct(" Paris, of course.", "Paris")
    assert rc.is_correct(" paris", "Paris")
    assert not rc.is_correct(" Parisian food", "Paris")
    assert not rc.is_correct("\nNope\nParis", "Paris")
    assert not rc.is_correct(" Paris", "")
