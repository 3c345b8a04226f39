"""The sampling fields of OpenAI's and vLLM's requests (issue 62): ``frequency_penalty``, ``presence_penalty``,
``repetition_penalty``, ``min_p``, ``logit_bias``, ``min_tokens``, ``stop_token_ids``, ``ignore_eos``.

Each is checked against its formula (OpenAI's penalties by hand on the logits; vLLM's repetition penalty as HF's
``RepetitionPenaltyLogitsProcessor``, written out here), through the engine loop's public API on a tiny random fp32
model (the generated tokens re-checked against a teacher-forced forward of the same model), with requests of
different settings batched together, and through kvboost-server with the official ``openai`` client (vLLM's fields
in ``extra_body``); bad values are a 400 in OpenAI's error format naming the field, and the server goes on serving.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import openai
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvboost_testkit.tiny import ToyTokenizer, tiny_model
from test_server import MODEL, Served, assert_envelope, served_engine

from kvboost.decoding import Sampling, TokenHistory, openai_penalties, pick_token
from kvboost.engine.frontend import tokenize_prompt
from kvboost.engine.requests import SamplingParams

PROMPT = "the quick brown fox jumps over the lazy dog"


# ---------------------------------------------------------------------- the formulas, on logits
def test_openai_penalties_by_hand():
    vocab = 11
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0))
    output = [3, 3, 5, 3, 9]
    sampling = Sampling(frequency_penalty=0.7, presence_penalty=0.4, history=TokenHistory([1, 2, 3], output))
    got = sampling.process(logits)
    expected = logits.clone()
    for token in set(output):  # OpenAI: count * frequency + (count > 0) * presence, over the answer only
        expected[token] -= output.count(token) * 0.7 + 0.4
    torch.testing.assert_close(got, expected)
    assert got[1] == logits[1] and got[2] == logits[2]  # prompt tokens are not penalised
    torch.testing.assert_close(openai_penalties(logits, [], 0.7, 0.4), logits)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 9), max_size=12), st.lists(st.integers(0, 9), max_size=6),
       st.floats(-2, 2), st.floats(-2, 2), st.floats(0.5, 3), st.integers(0, 2**16))
def test_processors_match_the_hand_formula(output, prompt, frequency, presence, repetition, seed):
    """Penalties together (repetition over prompt + answer first, then OpenAI's over the answer), on random logits."""
    logits = torch.randn(10, generator=torch.Generator().manual_seed(seed))
    sampling = Sampling(frequency_penalty=frequency, presence_penalty=presence, repetition_penalty=repetition,
                        history=TokenHistory(prompt, output))  # fmt: skip
    expected = logits.clone()
    for t in set(prompt + output):
        expected[t] = expected[t] * repetition if expected[t] < 0 else expected[t] / repetition
    for t in set(output):
        expected[t] -= output.count(t) * frequency + presence
    torch.testing.assert_close(sampling.process(logits), expected)


def test_repetition_penalty_as_vllm_and_hf():
    logits = torch.tensor([2.0, -1.0, 0.5, -3.0, 1.0])
    sampling = Sampling(repetition_penalty=2.0, history=TokenHistory([0, 1], [3]))
    # over prompt + output: positive logits divided, negative ones multiplied
    torch.testing.assert_close(sampling.process(logits), torch.tensor([1.0, -2.0, 0.5, -6.0, 1.0]))


def test_logit_bias_min_tokens_min_p():
    logits = torch.tensor([0.0, 5.0, 1.0, 4.9, -2.0])
    assert pick_token(logits, Sampling(logit_bias=((4, 100.0),))) == 4
    assert pick_token(logits, Sampling(logit_bias=((1, -100.0),))) == 3
    history = TokenHistory([0], [], eos_ids={1})
    early = Sampling(min_tokens=2, history=history)
    assert early.process(logits)[1] == float("-inf") and pick_token(logits, early) == 3
    history.output.extend([2, 2])  # two tokens out: end-of-sequence allowed again
    assert pick_token(logits, early) == 1
    # min_p 0.5: only tokens at least half as likely as the likeliest survive (1 and 3 here), whatever the seed
    kept = {pick_token(logits, Sampling(do_sample=True, min_p=0.5), torch.Generator().manual_seed(s)) for s in
            range(40)}  # fmt: skip
    assert kept <= {1, 3} and len(kept) == 2
    everything = {pick_token(logits, Sampling(do_sample=True, temperature=5.0), torch.Generator().manual_seed(s))
                  for s in range(200)}  # fmt: skip
    assert len(everything) > 2  # without min_p the others are drawn too


def test_neutral_fields_keep_the_fast_path():
    assert not Sampling().processed and not Sampling(do_sample=True, min_p=0.1, ignore_eos=True).processed
    assert Sampling(frequency_penalty=0.1, history=TokenHistory([], [])).processed
    params = SamplingParams(max_tokens=4)
    assert not Sampling(**params.processors()).processed
    assert Sampling().stop_ids({2}) == {2}
    assert Sampling(stop_token_ids=(5,), ignore_eos=True).stop_ids({2}) == {5}


@pytest.mark.parametrize("kwargs,field", [
    ({"frequency_penalty": 2.5}, "frequency_penalty"), ({"presence_penalty": -3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {5: 101}}, "logit_bias"), ({"logit_bias": {-1: 1}}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"), ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 9}, "min_tokens"),
    ({"stop_token_ids": [-2]}, "stop_token_ids"), ({"ignore_eos": 1}, "ignore_eos"),
])  # fmt: skip
def test_sampling_params_refuse_bad_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=4, **kwargs)


# ---------------------------------------------------------------------- through the engine loop
@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    from kvboost import KVBoost

    engine = KVBoost(tiny_model("llama"), ToyTokenizer(), model_identity="tiny-llama", decode="eager",
                     chunker={"name": "fixed", "chunk_size": 16})  # fmt: skip
    with served_engine(engine) as s:
        yield s


def run(served: Served, **fields) -> tuple[list[int], str]:
    completion = served.loop.submit(PROMPT, SamplingParams(**{"max_tokens": 8, **fields}), chat=False).result(60)
    return completion.output_ids, completion.finish_reason


def teacher_logits(served: Served, tokens: list[int]) -> tuple[list[int], torch.Tensor]:
    """The prompt ids and the model's logits [len(tokens), vocab] before each generated token (one forward)."""
    ids = tokenize_prompt(served.engine, PROMPT, chat=False).ids
    model = served.engine.model
    with torch.no_grad():
        out = model(torch.tensor([ids + tokens])).logits[0].float()
    return ids, out[len(ids) - 1 : len(ids) - 1 + len(tokens)]


@pytest.mark.parametrize("fields", [
    {"frequency_penalty": 1.5}, {"presence_penalty": 2.0}, {"repetition_penalty": 1.8},
    {"frequency_penalty": 0.8, "presence_penalty": -0.5, "logit_bias": {7: 3.0}},
])  # fmt: skip
def test_greedy_answers_follow_the_formula(served, fields):
    """Every greedy token is the argmax of the step's logits after the request's processors (checked on a
    teacher-forced forward, with the formulas written out here), and the setting changes what a plain greedy
    answer repeats."""
    tokens, _ = run(served, temperature=0, **fields)
    prompt, logits = teacher_logits(served, tokens)
    for j, token in enumerate(tokens):
        row = logits[j].clone()
        for t, b in fields.get("logit_bias", {}).items():
            row[t] += b
        penalty = fields.get("repetition_penalty", 1.0)
        for t in set(prompt + tokens[:j]):
            row[t] = row[t] * penalty if row[t] < 0 else row[t] / penalty
        for t in set(tokens[:j]):
            row[t] -= tokens[:j].count(t) * fields.get("frequency_penalty", 0) + fields.get("presence_penalty", 0)
        assert row[token] >= row.max() - 1e-3, (j, token, int(row.argmax()))


def test_penalties_change_a_repetitive_greedy_answer(served):
    plain, _ = run(served, temperature=0, max_tokens=12, ignore_eos=True)
    assert len(set(plain)) < len(plain), "the tiny model's greedy answer repeats a token (precondition)"
    penalised, _ = run(served, temperature=0, max_tokens=12, ignore_eos=True, presence_penalty=2.0,
                       frequency_penalty=2.0)  # fmt: skip
    assert penalised != plain and len(set(penalised)) > len(set(plain))


def test_logit_bias_forces_and_bans(served):
    plain, _ = run(served, temperature=0)
    forced, _ = run(served, temperature=0.9, seed=3, logit_bias={11: 100})
    assert forced == [11] * 8
    banned, _ = run(served, temperature=0, logit_bias={plain[0]: -100})
    assert plain[0] not in banned


def test_stop_token_ids_end_the_answer(served):
    plain, _ = run(served, temperature=0, ignore_eos=True)
    stop = plain[3]
    tokens, reason = run(served, temperature=0, ignore_eos=True, stop_token_ids=[stop])
    assert reason == "stop" and tokens == plain[: plain.index(stop) + 1]


def test_ignore_eos_and_min_tokens(served):
    eos = min(served.engine.eos_ids)
    tokens, reason = run(served, temperature=0, logit_bias={eos: 100})
    assert (tokens, reason) == ([eos], "stop")
    tokens, reason = run(served, temperature=0, logit_bias={eos: 100}, ignore_eos=True)
    assert (tokens, reason) == ([eos] * 8, "length")
    tokens, reason = run(served, temperature=0, logit_bias={eos: 100}, min_tokens=3)
    assert reason == "stop" and len(tokens) == 4 and tokens[-1] == eos and eos not in tokens[:3]


def test_batched_requests_keep_their_own_settings(served):
    """Requests decoded in the same steps (one engine core, all queued before its first step), each with its own
    fields (one neutral, on the fast path; one sampled), get the answers they get alone."""
    from kvboost import KVBoost

    settings = [{"logit_bias": {11: 100}}, {"logit_bias": {12: 100}}, {}, {"presence_penalty": 2.0},
                {"temperature": 0.8, "seed": 5, "frequency_penalty": 1.0}]  # fmt: skip
    alone = [run(served, **{"temperature": 0, **f})[0] for f in settings]
    engine = KVBoost(tiny_model("llama"), ToyTokenizer(), model_identity="tiny-llama", decode="eager",
                     chunker={"name": "fixed", "chunk_size": 16})  # fmt: skip
    try:
        handles = [engine.core.add(PROMPT, SamplingParams(**{"max_tokens": 8, "temperature": 0, **f}), chat=False)
                   for f in settings]  # fmt: skip
        while not all(h.done for h in handles):
            engine.core.step()
            counts = {h.num_events for h in handles}
            assert len(counts) == 1, counts  # every request got its token in this step: they are batched
        together = [h.completion.output_ids for h in handles]
    finally:
        engine.close()
    assert together == alone
    assert together[0] == [11] * 8 and together[1] == [12] * 8


def test_each_of_n_samples_has_its_own_history(served):
    """``n`` samples of a penalised request are the answers of separate requests seeded seed, seed + 1 (each
    sample's penalties count its own tokens)."""
    fields = {"max_tokens": 8, "temperature": 0.9, "frequency_penalty": 1.5, "ignore_eos": True}
    handle = served.loop.submit(PROMPT, SamplingParams(n=2, seed=4, **fields), chat=False)
    together = [h.result(60).output_ids for h in handle.samples]
    assert together == [run(served, seed=4, **fields)[0], run(served, seed=5, **fields)[0]]


# ---------------------------------------------------------------------- through the server, with the openai client
def test_openai_client_fields(served):
    client = served.client(key=None)
    eos = min(served.engine.eos_ids)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=5,
                                       temperature=0, logit_bias={"11": 100})  # fmt: skip
    assert r.choices[0].message.content == ToyTokenizer().decode([11] * 5)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(eos): 100},
                                  extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    assert r.choices[0].finish_reason == "length"
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, "stop_token_ids": [11], "logit_bias": {"11": 100},
                                              "min_tokens": 2})  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=5,
                                       temperature=0.8, seed=1, frequency_penalty=1.0, presence_penalty=0.5,
                                       extra_body={"repetition_penalty": 1.3, "min_p": 0.1})  # fmt: skip
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_stop_token_adds_no_text(served):
    """vLLM's rule: the stop token's id ends the output ids, its text is not in the answer (streamed or not)."""
    client = served.client(key=None)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True})  # fmt: skip
    ids = plain.choices[0].model_extra["token_ids"]
    stop = ids[2]
    cut = ids[: ids.index(stop) + 1]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "extra_body": {"ignore_eos": True, "stop_token_ids": [stop], "return_token_ids": True}}  # fmt: skip
    r = client.completions.create(**body)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["token_ids"] == cut
    assert r.choices[0].text == ToyTokenizer().decode(cut[:-1])
    streamed = "".join(chunk.choices[0].text for chunk in client.completions.create(**body, stream=True)
                       if chunk.choices)  # fmt: skip
    assert streamed == r.choices[0].text


@pytest.mark.parametrize("fields,param", [
    ({"logit_bias": {"999999": 5}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.1}, "presence_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.1}, "min_p"), ({"min_tokens": 50}, "min_tokens"), ({"min_tokens": True}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": [10**7]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])  # fmt: skip
def test_bad_values_are_400s_naming_the_field(served, fields, param):
    client = served.client(key=None)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=4,
                                       extra_body=fields)  # fmt: skip
    error = info.value.body  # param: the field, or a path in it (logit_bias.5)
    assert re.split(r"[.\[]", error["param"])[0] == param and error["type"] == "invalid_request_error", error
    with served.http(key=None) as c:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, **fields}
        assert re.split(r"[.[]", assert_envelope(c.post("/v1/completions", json=body), 400)["param"])[0] == param
    # the server goes on serving
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("name", ["prompt_lookup", "layer_skip"])
def test_speculative_engines_apply_the_processors(served, name):
    """Draft verification knows no processors, so a request with any skips drafting: its answer is the plain one."""
    from test_speculative import spec_for

    from kvboost import KVBoost

    fields = {"max_tokens": 16, "temperature": 0, "ignore_eos": True, "presence_penalty": 1.5,
              "repetition_penalty": 1.3}  # fmt: skip
    expected, _ = run(served, **fields)
    spec = KVBoost(tiny_model("llama"), ToyTokenizer(), model_identity="tiny-llama", decode="eager",
                   chunker={"name": "fixed", "chunk_size": 16}, speculative=spec_for(name, "llama"))  # fmt: skip
    try:
        handle = spec.core.add(PROMPT, SamplingParams(**fields), chat=False)
        while not handle.done:
            spec.core.step()
        assert handle.completion.output_ids == expected
        plain = spec.core.add(PROMPT, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), chat=False)
        while not plain.done:
            spec.core.step()
        assert plain.completion.output_ids != expected  # the processors changed the answer
    finally:
        spec.close()
