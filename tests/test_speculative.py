"""Speculative decoding (``DRAFT`` family): greedy output equals plain decoding, the cache is rolled back exactly,
rejection sampling reproduces the target's distribution, every registered strategy meets the contract."""

from __future__ import annotations

import pytest
import torch
from kvboost_testkit.tiny import ToyTokenizer, make_engine, random_ids, tiny_model

from kvboost import KVBoost
from kvboost.decoding import Sampling
from kvboost.registry import DRAFT, UnknownPluginError
from kvboost.speculative.base import Draft, DraftLength
from kvboost.speculative.prompt_lookup import find_continuation
from kvboost.speculative.verify import accept_or_resample, verify_draft


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from a second thread, and on a shared, busy machine two threads spin-wait on
    every small op (measured: 100x slower decoding); restore the session's setting afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


FUSED_ARCHS = ("llama", "qwen2", "mistral")  # the fused decode step (and so layer_skip) covers these
STATS = ("drafted_tokens", "accepted_tokens", "acceptance_rate", "target_forwards", "tokens_per_target_forward")


def spec_for(name: str, arch: str, **fields):
    """A buildable config of ``name`` for a tiny model of ``arch`` (a draft model must share the vocabulary, so
    ``draft_model`` gets the tiny target's weights plus noise: close enough to be accepted often, not always)."""
    if name == "draft_model" and "model" not in fields:
        draft = tiny_model(arch, seed=0)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in draft.parameters():
                param.add_(torch.randn(param.shape, generator=g) * 0.3 * param.std().nan_to_num(0.0))
        fields["model"] = draft
    if name == "layer_skip":
        fields.setdefault("layers", 1)
    return {"name": name, **fields}


def quoting_prompt(seed: int = 0) -> list[int]:
    """A prompt that repeats itself (what prompt lookup can draft from) with fresh tokens between."""
    base = random_ids(40, seed=seed)
    return base + base[:20] + random_ids(10, seed=seed + 100) + base[:15]


def supported(name: str, arch: str) -> bool:
    return name != "layer_skip" or arch in FUSED_ARCHS


# ---------------------------------------------------------------------------------------------- greedy identity
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "phi3"])
@pytest.mark.parametrize("name", ["prompt_lookup", "layer_skip", "draft_model"])
def test_greedy_equals_plain_decoding_with_reuse(name, arch):
    if not supported(name, arch):
        pytest.skip("layer_skip needs the fused decode step (tested to refuse in test_bad_inputs)")
    plain = make_engine(arch, decode="eager" if arch in FUSED_ARCHS else "auto")
    spec = make_engine(arch, decode="eager" if arch in FUSED_ARCHS else "auto", speculative=spec_for(name, arch))
    prompt = quoting_prompt()
    results = []
    for engine in (plain, spec):
        first = engine.generate(prompt, max_new_tokens=24)
        # Second request: the first one's prompt and answer are exact hits, then more text.
        follow = prompt + first.output_ids + random_ids(9, seed=7) + prompt[:12]
        second = engine.generate(follow, max_new_tokens=24)
        repeat = engine.generate(follow, max_new_tokens=24)  # an exact hit of the whole prompt but one token
        results.append((first, second, repeat))
    for a, b in zip(*results):
        assert a.output_ids == b.output_ids
        assert a.cached_tokens == b.cached_tokens
        assert float((a.first_token_logits - b.first_token_logits).abs().max()) <= 1e-4
    first, second, repeat = results[1]
    assert second.cached_tokens == len(prompt) + len(first.output_ids) - 1  # the rolled-back cache was stored
    for r in (first, second, repeat):
        assert set(STATS) <= set(r.extra)
        assert r.extra["drafted_tokens"] >= r.extra["accepted_tokens"] >= 0
        assert r.extra["target_forwards"] * r.extra["tokens_per_target_forward"] == pytest.approx(
            r.generated_tokens - 1
        )
    assert sum(r.extra["accepted_tokens"] for r in (first, second, repeat)) > 0  # it did speculate


def test_greedy_equals_plain_with_the_compiled_step_in_fp32():
    """The engine's default decode (the compiled step where inductor works; compiled once per process) stays
    equal in fp32 on tiny models; layer_skip drafts through the same compiled graphs."""
    plain = make_engine("llama")
    prompt = quoting_prompt(seed=3)
    expected = plain.generate(prompt, max_new_tokens=20).output_ids
    for name in ("prompt_lookup", "layer_skip"):
        # the same model (its weights and attention backend); a pool, a runner and a request loop of its own
        spec = KVBoost(plain.model, ToyTokenizer(), model_identity="tiny-llama", share_model=True,
                       chunker={"name": "fixed", "chunk_size": 16}, speculative=spec_for(name, "llama"))  # fmt: skip
        assert spec.attention is plain.attention and spec.pool is not plain.pool and spec.core is not plain.core
        assert spec.generate(prompt, max_new_tokens=20).output_ids == expected


@pytest.mark.parametrize("name", ["prompt_lookup", "layer_skip", "draft_model"])
def test_stops_like_plain_decoding(name):
    """EOS inside an accepted draft, max_new_tokens of 1 and 2, and the context end."""
    plain = make_engine("llama", decode="eager")
    spec = make_engine("llama", decode="eager", speculative=spec_for(name, "llama", num_draft=6))
    prompt = quoting_prompt(seed=5)
    for engine in (plain, spec):
        engine.eos_ids = set()  # the tiny model's own EOS (id 2) may come early or never: choose one instead
    reference = plain.generate(prompt, max_new_tokens=30, mode="cold").output_ids
    for engine in (plain, spec):
        engine.eos_ids = {reference[7]}  # a token the answer reaches mid-way
    a, b = (e.generate(prompt, max_new_tokens=30, mode="cold") for e in (plain, spec))
    assert a.output_ids == b.output_ids and b.output_ids[-1] == reference[7]
    for engine in (plain, spec):
        engine.eos_ids = set()
    for budget in (1, 2, 3):
        a, b = (e.generate(prompt, max_new_tokens=budget, mode="cold") for e in (plain, spec))
        assert a.output_ids == b.output_ids and len(b.output_ids) == budget
    # Context end: 80 positions, a 66-token prompt, 40 tokens asked: 14 fit.
    short = [tiny_model("llama", max_position_embeddings=80)]
    engines = [KVBoost(short[0], ToyTokenizer(), model_identity="short", decode="eager", share_model=True,
                       chunker={"name": "fixed", "chunk_size": 16}, **extra)
               for extra in ({}, {"speculative": spec_for(name, "llama", num_draft=6)})]  # fmt: skip
    a, b = (e.generate(prompt[:66], max_new_tokens=40) for e in engines)
    assert a.output_ids == b.output_ids and len(b.output_ids) == 14


def test_rollback_leaves_the_cache_plain_decoding_leaves():
    """After rejections, the stored KV of prompt + answer equals plain decoding's: a follow-up request's logits
    from those chunks match, and so does every stored row."""
    plain = make_engine("llama", decode="eager")
    spec = make_engine("llama", decode="eager", speculative=spec_for("layer_skip", "llama", num_draft=6))
    prompt = quoting_prompt(seed=11)
    a, b = plain.generate(prompt, max_new_tokens=40), spec.generate(prompt, max_new_tokens=40)
    assert a.output_ids == b.output_ids
    assert b.extra["accepted_tokens"] < b.extra["drafted_tokens"]  # something was rolled back
    ta, tb = plain.store.tiers[0], spec.store.tiers[0]
    assert set(ta.keys()) == set(tb.keys())
    for key in set(ta.keys()):
        ka, va = ta.peek(key).payload.materialize()  # the entries reference pool blocks
        kb, vb = tb.peek(key).payload.materialize()
        assert float((ka - kb).abs().max()) <= 1e-4 and float((va - vb).abs().max()) <= 1e-4
    follow = prompt + a.output_ids + random_ids(5, seed=12)
    fa, fb = plain.generate(follow, max_new_tokens=4), spec.generate(follow, max_new_tokens=4)
    assert fa.cached_tokens == fb.cached_tokens == len(prompt) + len(a.output_ids) - 1
    assert float((fa.first_token_logits - fb.first_token_logits).abs().max()) <= 1e-4


# ---------------------------------------------------------------------------------------------- rejection sampling
def _chi_square(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` against ``p``, bins with expected count < 5 merged; (stat, dof)."""
    total = float(counts.sum())
    expected = p.double() * total
    order = torch.argsort(expected, descending=True)
    big = order[expected[order] >= 5]
    small = order[expected[order] < 5]
    obs = [float(counts[i]) for i in big] + ([float(counts[small].sum())] if small.numel() else [])
    exp = [float(expected[i]) for i in big] + ([float(expected[small].sum())] if small.numel() else [])
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    return stat, len(obs) - 1


def _critical(dof: int) -> float:
    from scipy.stats import chi2

    return float(chi2.ppf(1 - 1e-3, dof))  # a false alarm once in a thousand runs (seeded: deterministic here)


def _sample_through(accept, p: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """Counts of the tokens ``accept`` emits for ``n`` drafts drawn from ``q``."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.numel(), dtype=torch.long)
    for _ in range(n):
        token = int(torch.multinomial(q, 1, generator=g))
        counts[accept(p, q, token, g)[1]] += 1
    return counts


def _always_accept(p, q, token, generator):
    return True, token


def _accept_without_residual(p, q, token, generator):
    """A plausible bug: on rejection resample from p itself instead of max(0, p - q)."""
    q_tok = 1.0 if q is None else float(q[token])
    if float(torch.rand((), generator=generator)) < min(1.0, float(p[token]) / q_tok):
        return True, token
    return False, int(torch.multinomial(p, 1, generator=generator))


def test_rejection_sampling_reproduces_the_target_distribution():
    p = torch.tensor([0.30, 0.05, 0.20, 0.01, 0.14, 0.10, 0.15, 0.05])
    q = torch.tensor([0.05, 0.30, 0.10, 0.20, 0.14, 0.01, 0.15, 0.05])
    stat, dof = _chi_square(_sample_through(accept_or_resample, p, q, 20000, seed=0), p)
    assert stat < _critical(dof), (stat, dof)
    # A deterministic draft (q one-hot on token 0): the output is still distributed as p.
    counts = torch.zeros(8, dtype=torch.long)
    g = torch.Generator().manual_seed(1)
    for _ in range(20000):
        counts[accept_or_resample(p, None, 0, g)[1]] += 1
    stat, dof = _chi_square(counts, p)
    assert stat < _critical(dof), (stat, dof)


@pytest.mark.parametrize("wrong", [_always_accept, _accept_without_residual])
def test_the_chi_square_check_catches_a_wrong_acceptance_rule(wrong):
    p = torch.tensor([0.30, 0.05, 0.20, 0.01, 0.14, 0.10, 0.15, 0.05])
    q = torch.tensor([0.05, 0.30, 0.10, 0.20, 0.14, 0.01, 0.15, 0.05])
    stat, dof = _chi_square(_sample_through(wrong, p, q, 20000, seed=0), p)
    assert stat > _critical(dof), (stat, dof)


def test_rejection_sampling_on_a_tiny_models_distributions():
    """p from the tiny target, q from its layer-skip draft (one layer of two), at temperature 0.05 (peaked enough
    for most mass to sit in bins with counts): the verified tokens follow p, and q alone would not."""
    engine = make_engine("llama", decode="eager", speculative=spec_for("layer_skip", "llama"))
    sampling = Sampling(do_sample=True, temperature=0.05)
    ids = random_ids(30, seed=21)
    with torch.inference_mode():
        target = engine.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        half = engine.model.model.layers[1:]
        engine.model.model.layers = engine.model.model.layers[:1]
        engine.model.config.num_hidden_layers = 1
        try:
            draft = engine.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
        finally:
            engine.model.model.layers.extend(half)
            engine.model.config.num_hidden_layers = 2
    from kvboost.speculative.base import draft_distribution

    p, q = draft_distribution(target, sampling), draft_distribution(draft, sampling)
    assert float((p - q).abs().sum()) > 0.2  # the draft really differs from the target
    counts = _sample_through(accept_or_resample, p, q, 20000, seed=3)
    stat, dof = _chi_square(counts, p)
    assert stat < _critical(dof), (stat, dof)
    stat_q, dof_q = _chi_square(_sample_through(_always_accept, p, q, 20000, seed=3), p)
    assert stat_q > _critical(dof_q)


def test_verify_draft_greedy_and_sampling_shapes():
    logits = torch.full((4, 10), -10.0)
    logits[0, 3] = logits[1, 5] = logits[2, 7] = logits[3, 1] = 10.0
    assert verify_draft(logits, Draft([3, 5, 7]), Sampling()) == (3, 1)  # all accepted + bonus
    assert verify_draft(logits, Draft([3, 6, 7]), Sampling()) == (1, 5)  # rejected at the second: correction
    accepted, token = verify_draft(logits, Draft([3, 5, 7]), Sampling(do_sample=True), torch.Generator().manual_seed(0))
    assert accepted == 3 and token == 1  # p is nearly one-hot on the drafts


def test_sampling_through_the_engine_runs_and_reports():
    engine = make_engine("llama", decode="eager", speculative=spec_for("layer_skip", "llama"))
    r = engine.generate(quoting_prompt(), max_new_tokens=20, do_sample=True, temperature=0.8)
    assert len(r.output_ids) == 20 and all(0 <= t < 128 for t in r.output_ids)
    assert r.extra["drafted_tokens"] > 0 and r.extra["target_forwards"] < 19 + 1


# ---------------------------------------------------------------------------------------------- pieces
def test_prompt_lookup_finds_the_latest_continuation():
    ctx = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    assert find_continuation(ctx, 3, 3, 1) == [5, 6, 7]  # the most recent earlier "1 2 3"
    assert find_continuation(ctx, 10, 3, 1) == [5, 6, 7, 1, 2, 3]
    assert find_continuation([1, 2, 3, 4], 3, 3, 1) == []
    assert find_continuation([8, 1, 8], 2, 3, 2) == []  # no 2-gram repeats; 1-grams not allowed
    assert find_continuation([8, 1, 8], 2, 3, 1) == [1, 8]


def test_adaptive_draft_length_rule():
    length = DraftLength(4, 8)
    length.update(4, 4)
    assert length.current == 6
    length.update(6, 6)
    length.update(8, 8)
    assert length.current == 8  # capped
    length.update(8, 2)
    assert length.current == 7
    for _ in range(10):
        length.update(3, 0)
    assert length.current == 1  # floor
    fixed = DraftLength(4, 8, adaptive=False)
    fixed.update(4, 4)
    assert fixed.current == 4


# ---------------------------------------------------------------------------------------------- conformance
@pytest.mark.parametrize("name", DRAFT.names())
def test_every_draft_strategy_meets_the_contract(name):
    """Every registered strategy (built-ins and plugins), unchanged: proposals are valid and at most k tokens,
    greedy output equals plain decoding, stats are consistent (``none`` keeps the plain path: no stats)."""
    spec = spec_for(name, "llama")
    plain = make_engine("llama", decode="eager")
    engine = make_engine("llama", decode="eager", speculative=spec)
    prompt = quoting_prompt(seed=31)
    a, b = plain.generate(prompt, max_new_tokens=25), engine.generate(prompt, max_new_tokens=25)
    assert a.output_ids == b.output_ids
    strategy = engine.speculative
    assert isinstance(strategy.fingerprint(), str) and strategy.fingerprint()
    if not strategy.enabled:
        assert not set(STATS) & set(b.extra)
        return
    assert b.extra["speculative"] == name
    assert 0 <= b.extra["accepted_tokens"] <= b.extra["drafted_tokens"]
    assert 1 <= b.extra["target_forwards"] <= b.generated_tokens - 1
    # propose() directly: at most k valid ids, the context untouched.
    from kvboost.kv.block_table import BlockTable
    from kvboost.runtime.batch import ForwardBatch, SeqInput
    from kvboost.speculative.base import DraftRequest

    table = BlockTable(engine.pool)
    with torch.inference_mode():
        engine.runner.run(ForwardBatch.build([SeqInput(table, prompt[:-1])]))
    before = engine.pool.read(table.slots(0, table.length))
    strategy.begin(DraftRequest(prompt_len=len(prompt) - 1, table=table, runner=engine.runner))
    context = list(prompt)
    for k in (1, 3):
        for sampling in (Sampling(), Sampling(do_sample=True)):
            draft = strategy.propose(context, k, sampling, torch.Generator().manual_seed(0))
            assert len(draft) <= k and all(0 <= t < 128 for t in draft.tokens)
            if draft.probs is not None:
                assert draft.probs.shape == (len(draft), 128)
                assert torch.allclose(draft.probs.sum(-1), torch.ones(len(draft)), atol=1e-4)
            # the target's cache is as it was: its length, and the context's rows
            assert table.length == len(prompt) - 1
            after = engine.pool.read(table.slots(0, table.length))
            assert all(torch.equal(x, y) for x, y in zip(before, after))
    assert context == list(prompt)
    strategy.end()
    table.release()


# ---------------------------------------------------------------------------------------------- bad inputs
def test_unknown_strategy_lists_the_registered_ones():
    with pytest.raises(UnknownPluginError) as err:
        make_engine("llama", speculative="prompt_lokup")
    message = str(err.value)
    assert all(n in message for n in ("prompt_lookup", "layer_skip", "draft_model", "none"))


@pytest.mark.parametrize(
    "spec, field",
    [
        ({"name": "prompt_lookup", "num_draft": 0}, "num_draft"),
        ({"name": "layer_skip", "num_draft": -2}, "num_draft"),
        ({"name": "prompt_lookup", "num_draft": 8, "max_draft": 4}, "max_draft"),
        ({"name": "prompt_lookup", "min_ngram": 3, "max_ngram": 2}, "min_ngram"),
        ({"name": "layer_skip", "layers": 2}, "layers"),  # the tiny model has 2 layers: nothing skipped
        ({"name": "layer_skip", "layers": 0}, "layers"),
    ],
)
def test_bad_fields_are_refused_with_their_name(spec, field):
    with pytest.raises(ValueError, match=field):
        make_engine("llama", speculative=spec)


def test_draft_model_with_another_vocabulary_is_refused():
    other = tiny_model("llama", vocab_size=64)
    with pytest.raises(ValueError, match="vocabulary"):
        make_engine("llama", speculative={"name": "draft_model", "model": other})


def test_layer_skip_runs_on_the_hf_generic_runner_too():
    """phi3 runs on the HF-generic runner, which stops after the draft's layers too: greedy output equals plain."""
    plain = make_engine("phi3", layers=4)
    spec = make_engine("phi3", layers=4, speculative={"name": "layer_skip", "layers": 2, "num_draft": 4})
    assert spec.decode_info()["runner"] == "hf"
    prompt = quoting_prompt(seed=13)
    a, b = plain.generate(prompt, max_new_tokens=16, mode="cold"), spec.generate(prompt, max_new_tokens=16, mode="cold")
    assert a.output_ids == b.output_ids and b.extra["drafted_tokens"] > 0


@pytest.mark.parametrize("decode", ["eager", "compiled"])
def test_layer_skip_with_an_int8_head(decode):
    """The draft's head is the target's head, an int8 one included (it crashed before the runner: the old step
    read ``lm_head.weight``, which an Int8Linear does not have); greedy output equals plain decoding's."""
    from kvboost.models.int8_head import Int8Linear, quantize_lm_head

    def engine(**extra):
        model = quantize_lm_head(tiny_model("llama", num_hidden_layers=4), "int8")
        assert isinstance(model.lm_head, Int8Linear)
        return KVBoost(model, ToyTokenizer(), model_identity="tiny-int8", decode=decode,
                       chunker={"name": "fixed", "chunk_size": 16}, **extra)  # fmt: skip

    plain, spec = engine(), engine(speculative={"name": "layer_skip", "layers": 2, "num_draft": 4})
    prompt = quoting_prompt(seed=17)
    a, b = plain.generate(prompt, max_new_tokens=16, mode="cold"), spec.generate(prompt, max_new_tokens=16, mode="cold")
    assert a.output_ids == b.output_ids and b.extra["drafted_tokens"] > 0


def test_config_check_refuses_bad_speculative_fields():
    from kvboost.build import engine_options
    from kvboost.lab.config_check import check_config

    cfg = {"speculative": {"name": "prompt_lookup", "num_draft": 0}}
    with pytest.raises(ValueError, match="num_draft"):
        check_config(cfg)
    with pytest.raises(ValueError, match="unknown argument"):
        check_config({"speculative": {"name": "prompt_lookup", "ngram": 3}})
    assert engine_options({"speculative": {"name": "layer_skip"}})["speculative"] == {"name": "layer_skip"}
