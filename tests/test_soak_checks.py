"""The soak test's verdicts (experiments/bench/soak.py): a wrong answer, an overtaken aged request and a leaked block
each fail their check; equal answers and clean books pass. No server: the checks read what the run collected."""

from __future__ import annotations

import asyncio

import pytest

from experiments.bench import soak


def result(key: str, tokens: dict[int, list[int]], *, status: str = "ok", finish: str = "length",
           top2: list[list[float]] | None = None) -> soak.Result:  # fmt: skip
    r = soak.Result(key=key, action="complete", stream=True, status=status)
    for i, toks in tokens.items():
        r.samples[i] = {"tokens": toks, "top2": top2 or [[-0.1, -2.0]] * len(toks), "finish": finish, "text": ""}
    return r


def test_equal_answers_pass_and_a_different_token_fails_with_its_position_and_gap():
    alone = {"a": result("a", {0: [1, 2, 3]}, top2=[[-0.1, -3.0], [-0.5, -0.505], [-0.1, -3.0]]),
             "b": result("b", {0: [4, 5], 1: [6, 7]})}
    same = soak.compare([result("a", {0: [1, 2, 3]}), result("b", {0: [4, 5], 1: [6, 7]})], alone)
    assert same["passed"] and same["compared"] == 2 == same["equal"]
    diff = soak.compare([result("a", {0: [1, 9, 3]}), result("b", {0: [4, 5], 1: [6, 8]})], alone)
    assert not diff["passed"] and diff["mismatch_count"] == 2
    first = diff["mismatches"][0]
    assert first["first_diff_token"] == 1 and first["alone_top2_gap_at_diff"] == pytest.approx(0.005)
    assert diff["mismatches_at_near_tie"] == 1  # a's gap 0.005; b's sample 1 differs where alone was sure (1.9)


def test_incomplete_requests_are_not_compared_and_nothing_compared_fails():
    alone = {"a": result("a", {0: [1, 2]})}
    out = soak.compare([result("a", {0: [1]}, status="cancelled"), result("a", {0: [1, 2]}, finish=None)], alone)
    assert out["compared"] == 0 and not out["passed"]


def test_a_shorter_answer_is_a_mismatch():
    alone = {"a": result("a", {0: [1, 2, 3]})}
    out = soak.compare([result("a", {0: [1, 2]})], alone)
    assert not out["passed"] and out["mismatches"][0]["first_diff_token"] == 2


def test_aging_check_fails_on_an_overtaken_request_and_counts_first_admissions_only():
    waits = [{"kind": "generate", "steps": s, "resumed": r, "place": 2, "preemptions": int(r), "time": 0.0}
             for s, r in ((0, False), (3, False), (40, False), (500, True))]  # fmt: skip
    clean = soak.aging_check({"waits": waits, "overtaken": [], "aging_steps": 32, "step": 600})
    assert clean["passed"] and clean["wait_steps_max"] == 40 and clean["first_admissions_after_aging"] == 1
    assert clean["resumed_admissions"] == 1
    overtaken = [{"admitted_place": [2, 45], "waiting_place": [1, 10]}]
    assert not soak.aging_check({"waits": waits, "overtaken": overtaken, "aging_steps": 32})["passed"]


@pytest.mark.parametrize(("after", "passed"), [
    ({"referenced": 0, "verify": "ok", "pinned_keys": 0}, True),
    ({"referenced": 2, "verify": "ok", "pinned_keys": 0}, False),  # a block nobody should hold
    ({"referenced": 0, "verify": "failed: block 3", "pinned_keys": 0}, False),
    ({"referenced": 0, "verify": "ok", "pinned_keys": 1}, False),  # a pin that survived unpinning
])  # fmt: skip
def test_leak_check_verdict(monkeypatch, after, passed):
    books = iter([{"quiescent": True, "referenced": 5}, {"quiescent": True, **after}])

    async def fake_get_json(url, path, method="GET", body=None):
        return {"unpinned": 1} if path == "/soak/unpin" else next(books)

    monkeypatch.setattr(soak, "get_json", fake_get_json)
    out = asyncio.run(soak.leak_check("http://x", [[1, 2, 3]]))
    assert out["passed"] is passed and out["leaked_blocks"] == after["referenced"]
