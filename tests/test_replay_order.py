"""The ShareGPT replay's request order: sequential (one user at a time) or interleaved users."""

from __future__ import annotations

import pytest

from kvboost.lab.workloads.base import WorkloadEnv
from kvboost.lab.workloads.sharegpt_replay import SharegptReplay


def _replay(**fields) -> SharegptReplay:
    env = WorkloadEnv(tokenizer=None, count_tokens=lambda messages: sum(len(m["content"]) // 4 for m in messages))
    return SharegptReplay(env=env, num_conversations=5, max_turns=3, max_new_tokens=4, max_prompt_tokens=100_000, **fields)


def _order(workload: SharegptReplay) -> list[tuple[str, int]]:
    out = []
    for request in workload.requests():
        out.append((request.conversation_id, request.turn))
        workload.record_answer(request, "ok")
    return out


def test_sequential_finishes_each_conversation_first():
    order = _order(_replay())
    convs = [c for c, _ in order]
    assert len(order) == 15
    # every conversation's turns are contiguous and in order
    for i, (conv, turn) in enumerate(order):
        assert turn == i % 3 + 1 and conv == convs[i - i % 3]


@pytest.mark.parametrize("users, expected_groups", [(None, [5]), (2, [2, 2, 1]), (5, [5]), (7, [5])])
def test_interleaved_asks_turn_t_of_a_group_before_turn_t_plus_one(users, expected_groups):
    sequential = _order(_replay())
    order = _order(_replay(interleave=True, users=users))
    assert sorted(order) == sorted(sequential)  # the same requests, in another order
    convs = list(dict.fromkeys(c for c, _ in sequential))
    i = 0
    start = 0
    for size in expected_groups:
        group = convs[start : start + size]
        for turn in (1, 2, 3):
            assert order[i : i + size] == [(c, turn) for c in group]
            i += size
        start += size
    assert i == len(order)


def test_interleaved_prompts_equal_the_sequential_ones():
    """Only the order changes: each (conversation, turn) has the same prompt in both orders."""
    seq = {(r.conversation_id, r.turn): r.prompt for r in _replay().requests()}
    inter = {(r.conversation_id, r.turn): r.prompt for r in _replay(interleave=True, users=2).requests()}
    assert seq == inter


def test_model_history_is_asked_only_after_the_answer_is_recorded():
    workload = _replay(interleave=True, history_source="model")
    requests = workload.requests()
    first = [next(requests) for _ in range(5)]  # turn 1 of every user, no answer needed yet
    assert {r.turn for r in first} == {1}
    with pytest.raises(RuntimeError, match="no answer recorded"):
        next(requests)


@pytest.mark.parametrize("bad", [{"users": 0}, {"users": "2"}, {"interleave": "yes"}])
def test_bad_order_settings_are_refused(bad):
    with pytest.raises(ValueError, match="workload\\.(users|interleave)"):
        _replay(**bad)
