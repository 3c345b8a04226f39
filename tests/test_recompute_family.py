"""The recompute family of issue 45 on the scores contract: ``epic``, ``ape``, ``relevance``, the ``compose`` wrapper,
and the ``ScoredStrategy`` base (a strategy scores tokens, the base keeps the top of the budget).

Hand-built plans check each selection rule against an independent statement of it; the warmed tiny engine of the
narrowing tests (``test_recompute_narrowing``) checks the strategies through the engine's prefill. The narrowing
equivalence (selecting S equals the fixed schedule of S) for the new selectors is in ``test_recompute_narrowing``.
"""

from __future__ import annotations

import pytest
import torch
from test_recompute_narrowing import content_plan, diff, prefill, recording, warmed

from kvboost.cache.entry import approximate_segment_key, segment_only_key
from kvboost.paths import CONFIG_DIR
from kvboost.plan import KIND_CODES, ComputeSchedule, Placement, ReusePlan
from kvboost.recompute import (
    AdaptiveParallelEncoding,
    CacheBlend,
    Compose,
    EpicRecompute,
    NoRecompute,
    QueryAware,
    RelevanceRecompute,
    ScoredStrategy,
    SelectiveRecompute,
)
from kvboost.registry import RECOMPUTE
from kvboost.types import ChunkKey, ChunkSpan

# ----------------------------------------------------------------------------------------------- hand-built plans


def hand_plan(layout: list[tuple[str, int]], segments: list[tuple[int, int, int]] | None = None) -> ReusePlan:
    """A plan of placements ``(kind, length)`` in order; ``segments``: ``(start, end, segment_start)`` spans (default:
    one span per placement, each its own segment)."""
    placements, pos = [], 0
    for kind, length in layout:
        kv = {"keys": torch.randn(2, 1, length, 4), "values": torch.randn(2, 1, length, 4)} if kind != "new" else {}
        placements.append(Placement(pos, pos + length, kind, stored_start=0 if kind == "content" else None, **kv))
        pos += length
    spans = [ChunkSpan(a, b, s) for a, b, s in segments] if segments else [
        ChunkSpan(p.start, p.end, p.start) for p in placements]  # fmt: skip
    keys = [ChunkKey(prefix_key=f"p{i}", segment_key=f"s{i}", parent_key="") for i in range(len(spans))]
    return ReusePlan(list(range(pos)), placements, spans=spans, keys=keys)


def content_of(schedule: ComputeSchedule, plan: ReusePlan) -> list[int]:
    initial = torch.as_tensor(schedule.initial)
    return initial[plan.kinds[initial] == KIND_CODES["content"]].tolist()


def first_tokens_by_hand(plan: ReusePlan, k: int) -> list[int]:
    """The first ``k`` positions of every maximal run of content positions inside one segment, by a plain loop."""
    segment = {}
    for span in plan.spans:
        for i in range(span.start, span.end):
            segment[i] = span.segment_start
    out, run_start = [], None
    for i in range(len(plan)):
        if int(plan.kinds[i]) != KIND_CODES["content"]:
            run_start = None
            continue
        if run_start is None or segment[i] != segment[i - 1]:
            run_start = i
        if i - run_start < k:
            out.append(i)
    return out


class ByScore(ScoredStrategy):
    """A scored strategy with given scores per content position (the base does the rest)."""

    registry_name = "test_by_score"

    def __init__(self, scores: torch.Tensor, ratio: float, check_layers: tuple[int, ...] = ()) -> None:
        self.scores, self.ratio, self.check_layers = scores, ratio, check_layers

    def score(self, plan, candidates, deviation=None):
        content = plan.positions("content")
        return self.scores[torch.searchsorted(content, candidates)]


# ----------------------------------------------------------------------------------------------- the base


@pytest.mark.parametrize("ratio", [0.0, 0.1, 0.25, 0.5, 1.0])
def test_the_base_keeps_the_top_ratio_of_scored_tokens(ratio):
    plan = hand_plan([("exact", 3), ("content", 10), ("new", 2), ("content", 10), ("new", 3)])
    content = plan.positions("content")
    scores = torch.randperm(content.numel(), generator=torch.Generator().manual_seed(3)).float()
    k = round(ratio * content.numel())
    expected = sorted(content[torch.argsort(scores, descending=True)[:k]].tolist())
    schedule = ByScore(scores, ratio).schedule(plan, num_layers=4)
    assert content_of(schedule, plan) == expected
    assert set(plan.positions("new").tolist()) <= set(torch.as_tensor(schedule.initial).tolist())
    assert not schedule.check_layers and not schedule.full_prefill_cost
    # scored at a check layer instead: every non-exact token first, then the same top through select()
    checked = ByScore(scores, ratio, check_layers=(1,))
    s2 = checked.schedule(plan, num_layers=4)
    assert s2.check_layers == (1,) and torch.as_tensor(s2.initial).tolist() == torch.nonzero(
        plan.kinds != KIND_CODES["exact"]).flatten().tolist()  # fmt: skip
    assert checked.select(plan, 1, content, {}).tolist() == expected
    assert checked.token_scores(plan, (content, {})).tolist() == scores.tolist()


def test_todays_strategies_are_scored_strategies():
    for name in ("none", "selective", "cacheblend", "query_aware", "oracle", "full", "epic", "relevance", "compose"):
        assert isinstance(RECOMPUTE.build(name), ScoredStrategy), name
    assert not isinstance(RECOMPUTE.build("ape"), ScoredStrategy)  # it selects nothing: it tempers attention


# ----------------------------------------------------------------------------------------------- epic


@pytest.mark.parametrize("k", [0, 1, 3, 7, 50])
def test_epic_selects_exactly_the_first_k_tokens_of_each_reused_chunk(k):
    # two documents back to back with no new token between them (two segments), a document stored as two chunks
    # of one segment (one EPIC chunk), then a new separator and a third document
    plan = hand_plan([("exact", 4), ("content", 9), ("content", 6), ("content", 5), ("content", 5), ("new", 1),
                      ("content", 8), ("new", 3)],
                     segments=[(0, 4, 0), (4, 13, 4), (13, 19, 13), (19, 24, 19), (24, 29, 19), (29, 30, 29),
                               (30, 38, 30), (38, 41, 38)])  # fmt: skip
    chosen = content_of(EpicRecompute(k=k).schedule(plan, 4), plan)
    assert chosen == first_tokens_by_hand(plan, k)
    starts = [4, 13, 19, 30]  # the reused chunks: 4..13, 13..19, 19..29 (two stored chunks), 30..38
    ends = [13, 19, 29, 38]
    assert chosen == [p for a, b in zip(starts, ends) for p in range(a, min(a + k, b))]
    if 1 <= k < 10:  # selective counts from the start of each run of content hits: it merges 4..29 into one run
        assert content_of(SelectiveRecompute(r=k).schedule(plan, 4), plan) != chosen


def test_epic_skip_first_chunk_and_bad_settings():
    plan = hand_plan([("content", 6), ("content", 6), ("new", 2)], segments=[(0, 6, 0), (6, 12, 6), (12, 14, 12)])
    assert content_of(EpicRecompute(k=2).schedule(plan, 4), plan) == [0, 1, 6, 7]
    assert content_of(EpicRecompute(k=2, skip_first_chunk=True).schedule(plan, 4), plan) == [6, 7]
    later = hand_plan([("exact", 2), ("content", 6), ("new", 2)])  # the first reused chunk does not start the prompt
    assert content_of(EpicRecompute(k=2, skip_first_chunk=True).schedule(later, 4), later) == [2, 3]
    for bad in ({"k": -1}, {"k": 1.5}, {"k": True}, {"skip_first_chunk": 1}):
        with pytest.raises(ValueError):
            EpicRecompute(**bad)
    assert EpicRecompute(k=3).fingerprint() != EpicRecompute(k=4).fingerprint()


def test_epic_on_the_engine_recomputes_each_documents_first_tokens():
    engine = warmed("llama")
    strategy = EpicRecompute(k=3)
    log = recording(strategy)
    prefill(engine, strategy)
    plan = content_plan(engine)
    initial = log["initial"]
    assert initial[plan.kinds[initial] == KIND_CODES["content"]].tolist() == first_tokens_by_hand(plan, 3)
    plan.release()


# ----------------------------------------------------------------------------------------------- compose


def _qa_plan(seed: int = 0) -> ReusePlan:
    plan = hand_plan([("exact", 3), ("content", 12), ("new", 1), ("content", 12), ("new", 4)])
    g = torch.Generator().manual_seed(seed)
    plan.reader_attention = torch.rand(2, 3, plan.content_tokens, generator=g)
    return plan


def test_compose_epic_and_query_aware_selects_the_union_at_their_own_budgets():
    plan = _qa_plan()
    epic = set(content_of(EpicRecompute(k=2).schedule(plan, 4), plan))
    qa = set(content_of(QueryAware(ratio=0.25).schedule(plan, 4), plan))
    both = Compose(first={"name": "epic", "k": 2}, second={"name": "query_aware", "ratio": 0.25})
    chosen = content_of(both.schedule(plan, 4), plan)
    assert chosen == sorted(epic | qa)
    assert len(chosen) < len(epic) + len(qa) or not epic & qa


@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.5])
def test_compose_with_a_budget_takes_the_first_then_fills_with_the_seconds_top(ratio):
    plan = _qa_plan(1)
    content = plan.positions("content")
    budget = round(ratio * content.numel())
    epic = content_of(EpicRecompute(k=2).schedule(plan, 4), plan)  # 4 tokens: 2 per document
    both = Compose(first={"name": "epic", "k": 2}, second={"name": "query_aware", "ratio": 0.2}, ratio=ratio)
    chosen = content_of(both.schedule(plan, 4), plan)
    assert len(chosen) == budget
    qa_scores = QueryAware().score(plan, content)
    if budget >= len(epic):
        assert set(epic) <= set(chosen)
        rest = [(float(s), int(p)) for p, s in zip(content, qa_scores) if int(p) not in epic]
        fill = sorted(p for _, p in sorted(rest, reverse=True)[: budget - len(epic)])
        assert sorted(set(chosen) - set(epic)) == fill
    else:  # the first's choice is larger than the budget: its own best (earliest in each chunk) are kept
        assert set(chosen) <= set(epic) and all(int(plan.kinds[p]) == 1 for p in chosen)
        assert chosen == sorted(p for p in epic if p in (3, 16))  # offset 0 of each document
    scores = both.token_scores(plan)
    assert scores.shape == (content.numel(),)
    assert float(scores[torch.isin(content, torch.tensor(epic))].min()) > float(
        scores[~torch.isin(content, torch.tensor(epic))].max())  # fmt: skip


def test_compose_reads_each_sides_own_reader_layers():
    both = Compose(first={"name": "query_aware", "from_layer": 0.0, "to_layer": 0.25, "ratio": 0.1},
                   second={"name": "query_aware", "from_layer": 0.75, "ratio": 0.1})  # fmt: skip
    assert both.needs_reader_attention and both.reader_layers(8) == (0, 1, 6, 7)
    plan = _qa_plan(2)
    plan.reader_attention = torch.rand(4, 3, plan.content_tokens)
    low, high = plan.reader_attention[:2], plan.reader_attention[2:]
    chosen = content_of(both.schedule(plan, 8), plan)
    expected = set()
    for attention in (low, high):
        side = hand_plan([("exact", 3), ("content", 12), ("new", 1), ("content", 12), ("new", 4)])
        side.reader_attention = attention
        expected |= set(content_of(QueryAware(ratio=0.1, from_layer=0.0).schedule(side, 8), side))
    assert chosen == sorted(expected)
    assert plan.reader_attention.shape[0] == 4  # restored after each side's view


def test_compose_checks_its_sides():
    with pytest.raises(ValueError, match="scored strategy"):
        Compose(first="ape")
    with pytest.raises(ValueError, match="put it second"):
        Compose(first="cacheblend", second="epic")
    with pytest.raises(ValueError):
        Compose(ratio=1.5)
    assert Compose().fingerprint() != Compose(ratio=0.2).fingerprint()


def test_compose_with_cacheblend_second_keeps_the_first_choice_at_the_check_layer():
    engine = warmed("llama")
    both = Compose(first={"name": "epic", "k": 2}, second={"name": "cacheblend", "ratio": 0.15, "check_layers": [0]},
                   ratio=0.15)  # fmt: skip
    log = recording(both)
    _, _, _, plan, counts = prefill(engine, both)
    content = plan.positions("content")
    epic = first_tokens_by_hand(plan, 2)
    assert log["check_layers"] == (0,)
    kept = log["selected"][0]
    assert kept.numel() == round(0.15 * content.numel()) and set(epic) <= set(kept.tolist())
    assert counts.extra["content_recompute_fraction"] == pytest.approx(kept.numel() / content.numel())
    # without the first, cacheblend alone at check layer 0 ranks by rounding noise: the epic tokens are not forced
    alone = CacheBlend(ratio=0.15, check_layers=[0])
    log2 = recording(alone)
    prefill(engine, alone)
    assert log2["selected"][0].numel() == kept.numel()


# ----------------------------------------------------------------------------------------------- relevance


def test_relevance_fuses_layers_with_equal_weight_where_query_aware_sums_raw_attention():
    plan = hand_plan([("exact", 2), ("content", 8), ("new", 2)])
    attention = torch.full((2, 1, 8), 0.001)
    attention[0, 0, 3] = 0.9  # layer 0 puts a lot of mass on the documents, mostly on token 3
    attention[0, 0, 4] = 0.05
    attention[1, 0, 5] = 0.02  # layer 1 puts little mass on the documents, all of it on token 5
    plan.reader_attention = attention
    qa = QueryAware(ratio=0.25).schedule(plan, 4)
    rel = RelevanceRecompute(ratio=0.25, skip_first=0).schedule(plan, 4)
    assert content_of(qa, plan) == [2 + 3, 2 + 4]  # raw sums: 0.901, 0.051 beat 0.021
    assert content_of(rel, plan) == [2 + 3, 2 + 5]  # per-layer shares: token 5 holds most of layer 1's


def test_relevance_ranks_each_chunks_sinks_last_and_groups_neighbours():
    plan = hand_plan([("exact", 2), ("content", 8), ("new", 1), ("content", 8), ("new", 2)])
    attention = (0.01 + 0.0001 * torch.arange(16.0)).reshape(1, 1, 16)  # distinct: no ties
    attention[0, 0, 0] = attention[0, 0, 8] = 0.5  # each document's first token: a sink
    attention[0, 0, 5] = 0.3
    plan.reader_attention = attention
    assert content_of(QueryAware(ratio=1 / 8).schedule(plan, 4), plan) == [2, 11]  # the two sinks
    # the sinks rank last: token 5 (position 7), then the best of the rest (content index 15: position 18)
    assert content_of(RelevanceRecompute(ratio=1 / 8, skip_first=1).schedule(plan, 4), plan) == [7, 18]
    # grouping: token 5 (position 7) brings its neighbours within the window, in its own chunk only
    grouped = content_of(RelevanceRecompute(ratio=3 / 16, skip_first=1, window=1).schedule(plan, 4), plan)
    assert grouped == [6, 7, 8]
    scores = RelevanceRecompute(skip_first=1).token_scores(plan)
    sinks = torch.tensor([0, 8])
    assert float(scores[sinks].max()) < float(scores[torch.tensor([i for i in range(16) if i not in (0, 8)])].min())


def test_relevance_settings_are_checked():
    for bad in ({"skip_first": -1}, {"window": 1.5}, {"ratio": 2.0}, {"heads": "sum"}):
        with pytest.raises(ValueError, match="relevance"):
            RelevanceRecompute(**bad)
    assert RelevanceRecompute(window=1).fingerprint() != RelevanceRecompute(window=2).fingerprint()


# ----------------------------------------------------------------------------------------------- ape


def test_ape_at_temperature_one_is_none_bit_for_bit():
    engine = warmed("llama")
    logits, keys, values, _, _ = prefill(engine, AdaptiveParallelEncoding(temperature=1.0))
    n_logits, n_keys, n_values, _, _ = prefill(engine, NoRecompute())
    assert torch.equal(logits, n_logits) and torch.equal(keys, n_keys) and torch.equal(values, n_values)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_ape_divides_the_reused_keys_by_the_temperature_and_nothing_else(arch):
    engine = warmed(arch)
    t = 0.5
    logits, keys, values, plan, counts = prefill(engine, AdaptiveParallelEncoding(temperature=t))
    n_logits, n_keys, n_values, _, _ = prefill(engine, NoRecompute())
    content = plan.kinds == KIND_CODES["content"]
    new = plan.kinds == KIND_CODES["new"]
    leading = torch.arange(len(plan)) < int(plan.positions("content")[0])
    assert counts.recomputed_pairs == 0  # nothing recomputed
    # every layer: the reused rows' keys are none's divided by T; their values are untouched
    assert diff(keys[:, :, content], n_keys[:, :, content] / t) <= 1e-5
    assert torch.equal(values[:, :, content], n_values[:, :, content])
    # rows before the first reused chunk never see it; layer 0 of the new rows depends on the token only
    assert diff(keys[:, :, leading], n_keys[:, :, leading]) <= 1e-6
    assert diff(keys[0][:, new], n_keys[0][:, new]) <= 1e-6
    # the new rows after the documents read the tempered keys: they (and the first token) change
    after = new & ~leading
    assert diff(keys[1:][:, :, after], n_keys[1:][:, :, after]) > 1e-4
    assert diff(logits, n_logits) > 1e-4
    # the cache was not written: none again gives what it gave before
    again = prefill(engine, NoRecompute())
    assert torch.equal(again[1], n_keys) and torch.equal(again[0], n_logits)


def test_ape_tempers_a_plan_once_and_never_an_entry_it_stored():
    plan = hand_plan([("exact", 2), ("content", 4), ("content", 4), ("new", 1)])
    ape = AdaptiveParallelEncoding(temperature=0.5)
    before = [p.keys.clone() for p in plan.placements if p.kind == "content"]
    originals = [p.keys for p in plan.placements if p.kind == "content"]
    stored = plan.placements[2]
    stored.entry_key = segment_only_key(approximate_segment_key(plan.keys[2].segment_key, ape.fingerprint()))
    plan.placements[1].entry_key = "an exact entry"
    assert content_of(ape.schedule(plan, 4), plan) == []
    ape.schedule(plan, 4)  # a second call on the same plan: not tempered twice
    assert torch.equal(plan.placements[1].keys, before[0] / 0.5)
    assert torch.equal(plan.placements[2].keys, before[1])  # its own approximate entry: tempered already
    assert all(torch.equal(o, b) for o, b in zip(originals, before))  # the cache's tensors: untouched
    for bad in (0, -1.0, True, "hot"):
        with pytest.raises(ValueError):
            AdaptiveParallelEncoding(temperature=bad)


# ----------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("name", ["epic", "ape", "relevance", "compose"])
def test_each_new_strategy_has_a_config_and_a_cited_paper(name):

    import yaml

    cfg = yaml.safe_load((CONFIG_DIR / "recompute" / f"{name}.yaml").read_text())
    assert cfg["name"] == name and cfg.get("description")
    RECOMPUTE.validate(cfg)
    strategy = RECOMPUTE.build(cfg)
    doc = __import__(type(strategy).__module__, fromlist=["_"]).__doc__
    cited = {"epic": "EPIC", "ape": "APE", "relevance": "ProphetKV", "compose": "kvpress"}[name]
    assert cited in doc
    if name == "relevance":
        assert "CacheClip" in doc
