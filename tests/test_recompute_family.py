"""The recompute family on the scores contract: ``epic``, ``key_temperature``, ``key_norm``, the ``compose`` wrapper,
and the base (a strategy scores a ``LayerView``, the base keeps the top of the budget).

Hand-built plans check each selection rule against an independent statement of it; the warmed tiny engine of the
narrowing tests (``test_recompute_narrowing``) checks the strategies through the engine's prefill. The narrowing
equivalence (selecting S equals the fixed schedule of S) for the new selectors is in ``test_recompute_narrowing``.
"""

from __future__ import annotations

import sys

import pytest
import torch
from test_recompute_narrowing import content_plan, diff, prefill, recording, warmed

from kvboost.cache.entry import approximate_segment_key, segment_only_key
from kvboost.paths import CONFIG_DIR
from kvboost.plan import KIND_CODES, ComputeSchedule, Placement, ReusePlan
from kvboost.recompute.base import LayerView, RecomputeStrategy
from kvboost.recompute.cacheblend import CacheBlend
from kvboost.recompute.compose import Compose
from kvboost.recompute.epic import EpicRecompute, first_chunk
from kvboost.recompute.key_temperature import KeyTemperature
from kvboost.recompute.none import NoRecompute
from kvboost.recompute.query_aware import QueryAware
from kvboost.recompute.selective import SelectiveRecompute
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


class ByScore(RecomputeStrategy):
    """A strategy with given scores per content position (the base does the rest)."""

    registry_name = "test_by_score"

    def __init__(self, scores: torch.Tensor, ratio: float, check_layers: tuple[int, ...] = ()) -> None:
        self.scores, self.ratio, self.check_layers = scores, ratio, check_layers

    def score(self, view):
        content = view.plan.positions("content")
        return self.scores[torch.searchsorted(content, view.candidates)]


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
    view = LayerView(plan, content, 4, layer=1)
    assert checked.select(view).tolist() == expected
    assert checked.token_scores(plan, 4, view).tolist() == scores.tolist()
    # a threshold budget instead: every candidate scoring at least it, whatever their number
    threshold = ByScore(scores, ratio)
    threshold.ratio, threshold.threshold = None, float(content.numel() - k)
    assert content_of(threshold.schedule(plan, num_layers=4), plan) == expected


def test_every_registered_strategy_is_one_scored_contract():
    for name in RECOMPUTE.names():
        strategy = RECOMPUTE.build(name)
        assert isinstance(strategy, RecomputeStrategy), name
        assert (strategy.ratio is None) != (strategy.threshold is None), name  # one budget, the base's
        for method in ("schedule", "select", "keep"):  # the engine-facing half is the base's only
            assert getattr(type(strategy), method) is getattr(RecomputeStrategy, method), (name, method)


def test_a_score_of_the_wrong_length_is_refused():
    plan = hand_plan([("exact", 2), ("content", 6), ("new", 2)])
    wrong = ByScore(torch.zeros(3), 0.5)
    wrong.score = lambda view: torch.zeros(3)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="3 values for 6 candidates"):
        wrong.schedule(plan, 4)


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
    # a lead-in (chat-template head, system prompt) then the first document: that document is the first chunk
    later = hand_plan([("exact", 2), ("content", 6), ("new", 2)])
    assert content_of(EpicRecompute(k=2, skip_first_chunk=True).schedule(later, 4), later) == []
    for bad in ({"k": -1}, {"k": 1.5}, {"k": True}, {"skip_first_chunk": 1}):
        with pytest.raises(ValueError):
            EpicRecompute(**bad)
    assert EpicRecompute(k=3).fingerprint() != EpicRecompute(k=4).fingerprint()


def _chat_plan(first_passage: str) -> ReusePlan:
    """A chat-template prompt's layout: lead-in (3 tokens), separator, passage 1 (``first_passage``: content in the
    independent layout, exact in the shared-prefix one), separator, passage 2 (content), separator, question."""
    layout = [("exact", 3), ("exact", 1), (first_passage, 6), ("new", 1), ("content", 6), ("new", 1), ("new", 4)]
    plan = hand_plan(layout)
    ids = plan.prompt_ids
    for sep in (3, 10, 17):  # the separators carry the same id
        ids[sep] = 999
    return plan


def test_epic_skip_first_chunk_holds_on_chat_template_prompts():
    independent = _chat_plan("content")  # passage 1 cached alone: the lead-in and a separator precede it
    assert first_chunk(independent).nonzero().flatten().tolist() == list(range(4, 10))
    assert content_of(EpicRecompute(k=2, skip_first_chunk=True).schedule(independent, 4), independent) == [11, 12]
    assert content_of(EpicRecompute(k=2).schedule(independent, 4), independent) == [4, 5, 11, 12]
    shared = _chat_plan("exact")  # passage 1 an exact hit before the first reused passage: nothing skipped
    assert not first_chunk(shared).any()
    assert content_of(EpicRecompute(k=2, skip_first_chunk=True).schedule(shared, 4), shared) == [11, 12]
    # a new (uncached) text between the lead-in and passage 1: passage 1 is not the prompt's first chunk
    other = hand_plan([("exact", 3), ("exact", 1), ("new", 2), ("exact", 1), ("content", 6), ("new", 2)])
    other.prompt_ids[3] = other.prompt_ids[6] = 999
    assert not first_chunk(other).any()


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
    qa_scores = QueryAware().score(LayerView.before_forward(plan, 4))
    if budget >= len(epic):
        assert set(epic) <= set(chosen)
        rest = [(float(s), int(p)) for p, s in zip(content, qa_scores) if int(p) not in epic]
        fill = sorted(p for _, p in sorted(rest, reverse=True)[: budget - len(epic)])
        assert sorted(set(chosen) - set(epic)) == fill
    else:  # the first's choice is larger than the budget: its own best (earliest in each chunk) are kept
        assert set(chosen) <= set(epic) and all(int(plan.kinds[p]) == 1 for p in chosen)
        assert chosen == sorted(p for p in epic if p in (3, 16))  # offset 0 of each document
    scores = both.token_scores(plan, 4)
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
    with pytest.raises(ValueError, match="change the assembled K/V"):
        Compose(first="key_temperature")
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


# ----------------------------------------------------------------------------------------------- key_temperature


def test_key_temperature_one_is_none_bit_for_bit():
    engine = warmed("llama")
    logits, keys, values, _, _ = prefill(engine, KeyTemperature(temperature=1.0))
    n_logits, n_keys, n_values, _, _ = prefill(engine, NoRecompute())
    assert torch.equal(logits, n_logits) and torch.equal(keys, n_keys) and torch.equal(values, n_values)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_key_temperature_divides_the_reused_keys_by_the_temperature_and_nothing_else(arch):
    engine = warmed(arch)
    t = 0.5
    logits, keys, values, plan, counts = prefill(engine, KeyTemperature(temperature=t))
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


def test_key_temperature_tempers_a_copy_and_never_an_entry_it_stored():
    plan = hand_plan([("exact", 2), ("content", 4), ("content", 4), ("new", 1)])
    strategy = KeyTemperature(temperature=0.5)
    before = [p.keys.clone() for p in plan.placements if p.kind == "content"]
    stored = plan.placements[2]
    stored.entry_key = segment_only_key(approximate_segment_key(plan.keys[2].segment_key, strategy.fingerprint()))
    plan.placements[1].entry_key = "an exact entry"
    assert content_of(strategy.schedule(plan, 4), plan) == []
    keys, values = strategy.content_kv(plan, plan.placements[1])
    assert torch.equal(keys, before[0] / 0.5) and values is plan.placements[1].values
    assert torch.equal(strategy.content_kv(plan, stored)[0], before[1])  # its own approximate entry: tempered already
    after = [p.keys for p in plan.placements if p.kind == "content"]
    assert all(torch.equal(o, b) for o, b in zip(after, before))  # the plan (the cache's tensors): untouched
    for bad in (0, -1.0, True, "hot"):
        with pytest.raises(ValueError):
            KeyTemperature(temperature=bad)


# ----------------------------------------------------------------------------------------------- configs


@pytest.mark.parametrize("name", ["epic", "key_temperature", "compose", "key_norm", "cacheblend"])
def test_each_strategy_has_a_config_and_a_cited_paper(name):
    import yaml

    cfg = yaml.safe_load((CONFIG_DIR / "recompute" / f"{name}.yaml").read_text())
    assert cfg["name"] == name and cfg.get("description")
    RECOMPUTE.validate(cfg)
    strategy = RECOMPUTE.build(cfg)
    doc = __import__(type(strategy).__module__, fromlist=["_"]).__doc__
    cited = {"epic": "EPIC", "key_temperature": "APE", "compose": "kvpress", "key_norm": "Devoto",
             "cacheblend": "CacheBlend"}[name]  # fmt: skip
    assert cited in doc
    if name != "compose":  # a paper's strategy says where it departs from the paper
        assert "departs" in doc or "not implemented" in doc or "not reproduced" in doc or "not been measured" in doc


def test_dropped_and_renamed_names_are_gone():
    """``relevance`` (within 0.003 KL of ``query_aware``, neither ProphetKV nor CacheClip) is dropped; ``ape`` is
    ``key_temperature`` (one of APE's three parts); ``oracle`` is ``true_deviation`` (not an upper bound)."""
    names = set(RECOMPUTE.names())
    assert not {"relevance", "ape", "oracle"} & names
    assert {"key_temperature", "true_deviation", "key_norm"} <= names
    assert not [p.name for p in (CONFIG_DIR / "recompute").glob("*.yaml") if p.stem not in names]


@pytest.mark.parametrize("deviation", ["kv", "key", "value"])
def test_cacheblend_ranks_by_the_deviation_part_it_names(deviation):
    plan = hand_plan([("exact", 2), ("content", 8), ("new", 2)])
    content = plan.positions("content")
    g = torch.Generator().manual_seed(5)
    fresh_k, fresh_v = torch.randn(2, 8, 4, generator=g), torch.randn(2, 8, 4, generator=g)
    view = LayerView(plan, content, 4, layer=1, keys=fresh_k, values=fresh_v,
                     cached_keys=torch.zeros(2, 8, 4), cached_values=torch.zeros(2, 8, 4))  # fmt: skip
    by_hand = {"key": fresh_k.pow(2).mean(dim=(0, 2)), "value": fresh_v.pow(2).mean(dim=(0, 2))}
    by_hand["kv"] = by_hand["key"] + by_hand["value"]
    strategy = CacheBlend(ratio=0.25, deviation=deviation)
    assert torch.allclose(strategy.score(view), by_hand[deviation])
    expected = sorted(content[torch.topk(by_hand[deviation], 2).indices].tolist())
    assert strategy.select(view).tolist() == expected


# ----------------------------------------------------------------------------------------------- one module + one yaml


def test_a_module_in_the_package_registers_with_no_other_edit(tmp_path, monkeypatch):
    """The registry imports every module of a ``package.*`` entry (kvboost's recompute family is one): a new module
    registers itself, named nowhere else."""
    from kvboost.registry import Registry

    package = tmp_path / "scan_me"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "alpha.py").write_text("from tests_registry_target import REG\n@REG.register('alpha')\nclass A: pass\n")
    (package / "beta.py").write_text("from tests_registry_target import REG\n@REG.register('beta')\nclass B: pass\n")
    registry = Registry("scan", ("scan_me.*",))
    target = type(sys)("tests_registry_target")
    target.REG = registry
    monkeypatch.setitem(sys.modules, "tests_registry_target", target)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert {"alpha", "beta"} <= set(registry.names())


def test_the_original_enum_accepts_any_registered_name():
    from kvboost.engine import RecomputeStrategy as Enum
    from kvboost.original_api import recompute_plugin

    for name in RECOMPUTE.names():
        assert Enum(name).plugin == name and recompute_plugin(name) == name
    assert Enum("key_norm") is Enum("key_norm")
    with pytest.raises(ValueError):
        Enum("not_a_strategy")


def test_key_norm_written_from_scratch_is_selected_by_name_and_keeps_the_lowest_key_norms():
    """The contract's example: ``recompute=key_norm`` by name; at check layer 1 its candidates' fresh keys are the
    cold prefill's (every non-exact row was computed through layer 0), so the selection is the content rows of lowest
    mean key norm there, by an independent computation. Written from scratch: ``kvboost/recompute/key_norm.py`` and
    ``kvboost/configs/recompute/key_norm.yaml``, nothing else."""
    from test_recompute_narrowing import references

    engine = warmed("llama")
    strategy = RECOMPUTE.build({"name": "key_norm", "ratio": 0.1})
    assert type(strategy).__name__ == "KeyNorm" and strategy.check_layers == (1,)
    log = recording(strategy)
    _, _, _, plan, counts = prefill(engine, strategy)
    content = plan.positions("content")
    cold_keys = references("llama")[0]  # [layers, kv_heads, n, head_dim]
    norms = cold_keys[1][:, content].norm(dim=-1).mean(dim=0)
    k = round(0.1 * content.numel())
    selected = torch.isin(content, log["selected"][1])
    assert int(selected.sum()) == k == log["selected"][1].numel()
    # every kept row's norm is at most every other's, up to rounding (ties may break either way on another CPU)
    assert float(norms[selected].max()) <= float(norms[~selected].min()) + 1e-4
    view = log["views"][1]
    assert view.queries is not None and view.hidden_states is not None  # the layer's queries and output reach it
    assert view.queries.shape[1] == view.hidden_states.shape[0] == content.numel()
    assert counts.extra["content_recompute_fraction"] == pytest.approx(k / content.numel())


@pytest.mark.parametrize("layout", ["independent", "shared_prefix"])
def test_epic_skip_first_chunk_on_a_real_chat_template_prompt(layout, smollm_tokenizer):
    """SmolLM2's chat template, MuSiQue's prompt shape (system prompt, "Passages:", passages, question) and its two
    layouts' warm texts: in ``independent`` (each passage cached after BOS only) passage 1 is the first reused chunk
    and only the lead-in precedes it, so ``skip_first_chunk`` leaves it and repairs passage 2; in ``shared_prefix``
    passage 1 is an exact hit and nothing is skipped. Before issue 59 the rule never fired on such prompts."""
    from kvboost_testkit.tiny import tiny_model

    from kvboost import KVBoost
    from kvboost.lookup import lookup

    sep = "\n\n"
    passages = ["Rivers flow to the sea and carry sand.", "Mountains rise high and hold snow all year.",
                "Deserts are dry and hot in the day."]  # fmt: skip
    user = sep.join(["Passages:", *passages, "Question: which one is wet?"])
    prompt = smollm_tokenizer.apply_chat_template(
        [{"role": "system", "content": "You answer from the passages."}, {"role": "user", "content": user}],
        tokenize=False, add_generation_prompt=True)  # fmt: skip
    model = tiny_model("llama", vocab_size=len(smollm_tokenizer), max_position_embeddings=1024, num_hidden_layers=4)
    engine = KVBoost(model, smollm_tokenizer, chunker={"name": "separator", "separator": sep, "chunk_size": 64})
    head = prompt.split(sep)[0]
    for p in passages:
        engine.warm((smollm_tokenizer.bos_token + sep + p) if layout == "independent" else head + sep + p)
    ids, spans = engine.tokenize_with_spans(prompt)
    keys = engine.hasher.chunk_keys(ids, spans, engine.fingerprint)
    plan = lookup(ids, spans, keys, engine.store, engine.quantizer, max_reuse=len(ids) - 1, content=True,
                  approx_tag=engine.approx_tag)  # fmt: skip
    try:
        content = plan.positions("content")
        assert content.numel() and int(content[0]) > 0  # nothing reused starts the prompt: the template comes first
        skipped = first_chunk(plan)
        with_skip = set(content_of(EpicRecompute(k=2, skip_first_chunk=True).schedule(plan, 4), plan))
        every = set(content_of(EpicRecompute(k=2).schedule(plan, 4), plan))
        if layout == "independent":
            first_ids = smollm_tokenizer(passages[0], add_special_tokens=False)["input_ids"]
            assert [ids[i] for i in skipped.nonzero().flatten().tolist()] == first_ids  # exactly passage 1
            assert with_skip == every - set(skipped.nonzero().flatten().tolist()) and with_skip
        else:
            assert not skipped.any() and with_skip == every
    finally:
        plan.release()


def test_a_view_before_the_forward_holds_the_stored_rows_and_the_plan_signals():
    plan = hand_plan([("exact", 2), ("content", 4), ("new", 1), ("content", 3), ("new", 2)])
    plan.reader_attention = torch.rand(2, 3, plan.content_tokens)
    plan.reference_deviation = torch.rand(plan.content_tokens)
    candidates = torch.tensor([3, 8, 9])  # content indices 1, 5, 6 (content at 2..5 and 7..9)
    view = LayerView.before_forward(plan, 2, candidates)
    assert view.layer is None and view.keys is None and view.queries is None
    assert torch.equal(view.reader_attention, plan.reader_attention[:, :, [1, 5, 6]])
    assert torch.equal(view.reference_deviation, plan.reference_deviation[[1, 5, 6]])
    keys, values = view.stored(1)
    first, second = plan.placements[1], plan.placements[3]
    assert torch.equal(keys, torch.cat([first.keys[1][:, [1]], second.keys[1][:, [1, 2]]], dim=1))
    assert torch.equal(values, torch.cat([first.values[1][:, [1]], second.values[1][:, [1, 2]]], dim=1))
    with pytest.raises(ValueError, match="check layer"):
        view.deviation()
