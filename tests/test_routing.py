"""The prefix-aware replica choice (kvboost/serving/routing.py): keys, the per-replica index, the rule."""

from __future__ import annotations

import pytest

from kvboost.serving.routing import (
    PrefixIndex,
    PrefixRouter,
    choose_replica,
    chunk_keys,
    prompt_text,
    text_chunk_keys,
    token_chunk_keys,
)


def test_keys_are_prefix_chained_and_cover_full_chunks_only():
    ids = list(range(100))
    keys = token_chunk_keys(ids, chunk_size=16)
    assert len(keys) == 6  # 96 tokens in full chunks; the 4-token tail has no key
    assert token_chunk_keys(ids[:40], chunk_size=16) == keys[:2]  # a prefix has the prefix's keys
    changed = [999] + ids[1:]
    assert all(a != b for a, b in zip(token_chunk_keys(changed, 16), keys))  # chained: an early change moves all
    assert token_chunk_keys(ids, 16, salt="tenant-b")[0] != keys[0]
    assert token_chunk_keys(ids[:15], 16) == []
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_keys(ids, 0)


def test_text_keys_of_a_chat_extend_with_the_conversation():
    turn1 = [{"role": "system", "content": "be brief " * 20}, {"role": "user", "content": "hello there " * 10}]
    turn2 = turn1 + [{"role": "assistant", "content": "hi " * 30}, {"role": "user", "content": "more " * 30}]
    k1, k2 = text_chunk_keys(turn1, 32), text_chunk_keys(turn2, 32)
    assert len(k2) > len(k1) > 0 and k2[: len(k1)] == k1
    assert prompt_text("plain") == "plain"
    assert prompt_text([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]) \
        == prompt_text([{"role": "user", "content": "ab"}])
    # role is part of the rendering: the same words from another role are another prompt
    assert text_chunk_keys([{"role": "user", "content": "x" * 64}], 32) != \
        text_chunk_keys([{"role": "assistant", "content": "x" * 64}], 32)


def test_index_match_is_the_deepest_present_key_and_capacity_evicts_oldest():
    index = PrefixIndex(capacity=4)
    keys = token_chunk_keys(list(range(16 * 6)), 16)
    index.add(keys[:3])
    assert index.match(keys) == 3
    assert index.match(keys[:2]) == 2
    assert index.match(token_chunk_keys([7] * 64, 16)) == 0
    index.add(keys[3:5])  # 5 keys into 4 slots: keys[0] goes
    assert len(index) == 4 and keys[0] not in index
    assert index.match(keys) == 5  # the chain still vouches for the evicted root
    with pytest.raises(ValueError):
        PrefixIndex(0)


def _indexes(**served):
    out = {}
    for name, keys in served.items():
        out[name] = PrefixIndex()
        out[name].add(keys)
    return out


def test_longest_cached_prefix_wins():
    a = token_chunk_keys(list(range(128)), 16)
    indexes = _indexes(r0=a[:2], r1=a[:6], r2=[])
    d = choose_replica(a, ["r0", "r1", "r2"], indexes, {"r0": 0, "r1": 1, "r2": 0})
    assert d.replica == "r1" and d.matched == 6
    assert d.ranking[0] == "r1" and d.ranking[1] == "r0"  # then by match


def test_nothing_cached_goes_to_the_least_loaded_and_ties_rotate():
    keys = token_chunk_keys(list(range(64)), 16)
    d = choose_replica(keys, ["r0", "r1", "r2"], {}, {"r0": 3, "r1": 1, "r2": 2})
    assert d.replica == "r1" and d.matched == 0
    # all equal: the rotation picks in turn, so equal replicas share the work
    picks = [choose_replica(keys, ["r0", "r1", "r2"], {}, {}, rotation=i).replica for i in range(3)]
    assert picks == ["r0", "r1", "r2"]
    # equal matches: the shorter queue wins
    indexes = _indexes(r0=keys, r1=keys)
    assert choose_replica(keys, ["r0", "r1"], indexes, {"r0": 2, "r1": 1}).replica == "r1"


def test_an_overloaded_replica_is_skipped_despite_its_prefix():
    keys = token_chunk_keys(list(range(128)), 16)
    indexes = _indexes(r0=keys, r1=[])
    d = choose_replica(keys, ["r0", "r1"], indexes, {"r0": 5, "r1": 0}, max_imbalance=4)
    assert d.replica == "r1" and d.skipped == ("r0",) and d.ranking == ("r1", "r0")
    # within the threshold the prefix wins
    assert choose_replica(keys, ["r0", "r1"], indexes, {"r0": 4, "r1": 0}, max_imbalance=4).replica == "r0"
    with pytest.raises(ValueError):
        choose_replica(keys, [], indexes, {})


def test_router_records_choices_so_a_conversation_sticks_and_users_spread():
    router = PrefixRouter(max_imbalance=4)
    replicas = ["r0", "r1"]
    users = {u: [{"role": "system", "content": f"user {u} " * 40}] for u in range(4)}
    placed: dict[int, set] = {u: set() for u in users}
    for turn in range(3):
        for u, msgs in users.items():
            msgs.append({"role": "user", "content": f"question {turn} of {u} " * 8})
            placed[u].add(router.choose(text_chunk_keys(msgs, 32), replicas, {}).replica)
            msgs.append({"role": "assistant", "content": "answer " * 10})
    assert all(len(p) == 1 for p in placed.values())  # every conversation stays on one replica
    assert {next(iter(p)) for p in placed.values()} == {"r0", "r1"}  # and the users are spread over both
    router.forget("r0")
    assert "r0" not in router.indexes
