"""lm-evaluation-harness's ``local-completions`` requests against kvboost-server: prompt logprobs with ``echo``,
``max_tokens: 0``, batched prompts, and vLLM's ``skip_special_tokens``.

The request bodies are the ones lm-evaluation-harness builds (facts from its source, EleutherAI/lm-evaluation-harness
``lm_eval/models/openai_completions.py``, ``LocalCompletionsAPI._create_payload`` with ``generate=False``): ``model``,
``prompt`` (a batch: lists of token ids, context + continuation, with the default ``tokenized_requests``; or texts),
``temperature: 0``, ``max_tokens: 1``, ``logprobs: 1``, ``seed: 1234``, ``echo: true``. Its ``parse_logprobs``
sorts the choices by ``index`` (one per prompt), sums ``logprobs.token_logprobs[ctxlen:-1]`` (the continuation;
the last entry is the generated token) and calls the continuation greedy when every such logprob equals
``max(top_logprobs[i].values())``. The test does the same, and compares every prompt logprob with the log_softmax
of one plain forward of the tiny model (fp32)."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import torch
from kvboost_testkit.tiny import ToyTokenizer, random_ids, tiny_model
from test_openai_conformance import check_body
from test_server import MODEL, Served, assert_envelope, data_events, sample, served_engine, slowed


#: fp32 logprobs of the engine (chunked prefill, KV cache) against one plain forward
ATOL = 1e-4
#: a special token of SpecialTokenizer: "<s>" in the text unless skipped
SPECIAL = 1
#: ToyTokenizer's ids below this all decode to "?"
PRINTABLE = 35


class SpecialTokenizer(ToyTokenizer):
    """ToyTokenizer with one special token (id :data:`SPECIAL`), dropped when ``skip_special_tokens``."""

    all_special_ids = [SPECIAL]

    def decode(self, ids, skip_special_tokens=True):
        out = []
        for i in ids:
            if i == SPECIAL:
                out.append("" if skip_special_tokens else "<s>")
            else:
                out.append(super().decode([i]))
        return "".join(out)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    from kvboost import KVBoost

    engine = KVBoost(tiny_model("llama"), SpecialTokenizer(), model_identity="tiny-llama", decode="eager",
                     chunker={"name": "fixed", "chunk_size": 16})  # fmt: skip
    with served_engine(engine) as s:
        yield s


def reference(served: Served, ids: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward over ``ids``: row ``j`` is log p(. | ids[: j + 1])."""
    with torch.no_grad():
        logits = served.engine.model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def loglikelihood_body(prompts: list[Any], **over: Any) -> dict[str, Any]:
    """lm-evaluation-harness's loglikelihood request (``_create_payload(generate=False)``)."""
    return {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True, **over}  # fmt: skip


def parse_logprobs(out: dict[str, Any], ctxlens: list[int], generated: int = 1) -> list[tuple[float, bool]]:
    """lm-evaluation-harness's ``parse_logprobs`` (re-implemented from its documented behaviour): the continuation's
    summed logprob and whether it is greedy, per prompt. ``generated``: entries after the prompt (its ``[:-1]``
    drops the one generated token; with ``max_tokens: 0`` there is none to drop)."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens, strict=True):
        end = len(choice["logprobs"]["token_logprobs"]) - generated
        tokens_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:end]
        top = choice["logprobs"]["top_logprobs"][ctxlen:end]
        greedy = all(lp == max(t.values()) for lp, t in zip(tokens_logprobs, top, strict=True))
        res.append((sum(tokens_logprobs), greedy))
    return res


def expected(served: Served, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    ref = reference(served, context + continuation)
    rows = ref[len(context) - 1 : len(context) + len(continuation) - 1]
    picked = rows.gather(-1, torch.tensor(continuation).unsqueeze(-1)).squeeze(-1)
    return float(picked.sum()), bool((rows.argmax(-1) == torch.tensor(continuation)).all())


def check_prompt_logprobs(served: Served, ids: list[int], logprobs: dict[str, Any], top: int) -> None:
    """Entry 0 null; entry j (j >= 1): the plain forward's log p(ids[j] | ids[:j]) and its ``top`` likeliest."""
    ref = reference(served, ids)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    got = torch.tensor(logprobs["token_logprobs"][1 : len(ids)])
    want = ref[:-1].gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    tok = served.engine.tokenizer
    assert logprobs["tokens"][: len(ids)] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    for j in range(1, len(ids)):
        values, indices = torch.topk(ref[j - 1], top)
        entry = logprobs["top_logprobs"][j]
        for t, v in zip(indices.tolist(), values.tolist(), strict=True):
            if t < PRINTABLE:  # ToyTokenizer prints these all as "?": the dict keeps one of them
                continue
            assert abs(entry[tok.decode([t], skip_special_tokens=False)] - v) <= ATOL, (j, entry)
        assert len(entry) <= top + 1  # the top ones and the prompt's own token


# ---------------------------------------------------------------------- lm-eval's loglikelihood requests
def test_loglikelihood_batch_of_token_ids(served):
    """lm-eval's default: a batch of token-id prompts (context + continuation), raw HTTP as its client sends them.
    The summed continuation logprob and the greedy flag equal those of a plain forward."""
    pairs = [(random_ids(20, seed=1), random_ids(4, seed=2)), (random_ids(9, seed=3), random_ids(1, seed=4)),
             (random_ids(40, seed=5), random_ids(7, seed=6))]  # fmt: skip
    # a continuation the model itself would pick, so one greedy flag is True
    context = random_ids(12, seed=7)
    greedy = [int(reference(served, context)[-1].argmax())]
    pairs.append((context, greedy))
    with served.http(key=None) as c:
        r = c.post("/v1/completions", json=loglikelihood_body([ctx + cont for ctx, cont in pairs]))
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == list(range(len(pairs)))
    got = parse_logprobs(out, [len(ctx) for ctx, _ in pairs])
    for (ctx, cont), (logprob, is_greedy), choice in zip(pairs, got, out["choices"], strict=True):
        want_lp, want_greedy = expected(served, ctx, cont)
        assert abs(logprob - want_lp) <= ATOL * len(cont), (logprob, want_lp)
        assert is_greedy == want_greedy
        check_prompt_logprobs(served, ctx + cont, choice["logprobs"], top=1)
        assert len(choice["logprobs"]["tokens"]) == len(ctx + cont) + 1  # the prompt, then one generated token
    assert got[-1][1] is True
    assert out["usage"]["prompt_tokens"] == sum(len(a + b) for a, b in pairs)
    assert out["usage"]["completion_tokens"] == len(pairs)


def test_max_tokens_zero_returns_the_prompt_alone(served):
    """``max_tokens: 0`` with ``echo``: the prompt's text and logprobs, nothing generated."""
    ids = random_ids(30, seed=11)
    with served.http(key=None) as c:
        r = c.post("/v1/completions", json=loglikelihood_body([ids], max_tokens=0, logprobs=3))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == served.engine.tokenizer.decode(ids, skip_special_tokens=False)
    assert choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    check_prompt_logprobs(served, ids, choice["logprobs"], top=3)
    assert r.json()["usage"]["completion_tokens"] == 0
    (logprob, _), = parse_logprobs(r.json(), [10], generated=0)
    assert abs(logprob - expected(served, ids[:10], ids[10:])[0]) <= ATOL * 20


def test_text_prompts_through_the_openai_client(served):
    """The official client, a batch of text prompts (lm-eval with ``tokenized_requests=False``)."""
    prompts = ["the quick brown fox", "jumps over the lazy dog, twice"]
    client = served.client(key=None)
    resp = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=1, logprobs=2,
                                     echo=True, seed=1234)  # fmt: skip
    assert len(resp.choices) == 2
    for prompt, choice in zip(prompts, sorted(resp.choices, key=lambda c: c.index), strict=True):
        ids = served.engine.tokenizer(prompt)["input_ids"]
        assert choice.text.startswith(prompt) and len(choice.text) > len(prompt) - 1
        check_prompt_logprobs(served, ids, choice.logprobs.model_dump(), top=2)


def test_a_cached_prefix_still_gives_computed_logprobs(served):
    """A prompt whose prefix is in the cache (warmed first): its logprobs are still the plain forward's (the rows
    are computed: a cached prefix has no logits)."""
    ids = random_ids(48, seed=21)
    with served.http(key=None) as c:
        assert c.post("/v1/cache/warm", json={"text": ids[:32]}).status_code == 200
        r = c.post("/v1/completions", json=loglikelihood_body([ids], max_tokens=0))
    assert r.status_code == 200, r.text
    check_prompt_logprobs(served, ids, r.json()["choices"][0]["logprobs"], top=1)


def test_echo_with_an_answer(served):
    """``echo`` and ``max_tokens`` 4 (greedy): the prompt's text and logprobs, then the answer's, which are the
    plain forward's over prompt + answer; the answer is the one without echo."""
    ids = random_ids(14, seed=31)
    with served.http(key=None) as c:
        plain = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0,
                                                 "return_token_ids": True}).json()["choices"][0]  # fmt: skip
        r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 4, "temperature": 0, "echo": True,
                                            "logprobs": 0, "return_token_ids": True})  # fmt: skip
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    answer = choice["token_ids"]
    assert answer == plain["token_ids"] and len(answer) == 4
    assert choice["text"] == served.engine.tokenizer.decode(ids, skip_special_tokens=False) + plain["text"]
    full = ids + answer
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(full)
    ref = reference(served, full)
    want = ref[:-1].gather(-1, torch.tensor(full[1:]).unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:]), want, atol=ATOL, rtol=0)
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0


def test_batched_prompts_without_echo(served):
    """A batch of prompts without echo: prompt i's samples are choices i*n..i*n+n-1, each the answer the prompt
    gets alone."""
    prompts = ["alpha beta", "gamma delta epsilon", "zeta"]
    client = served.client(key=None)
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
             for p in prompts]  # fmt: skip
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2)
    assert sorted(c.index for c in resp.choices) == list(range(6))
    for c in resp.choices:
        assert c.text == alone[c.index // 2]


# ---------------------------------------------------------------------- streamed
def without_first_null(chunk: dict[str, Any]) -> dict[str, Any]:
    """``chunk`` without the null logprob of an echoed prompt's first token (nothing precedes it). OpenAI's API and
    vLLM send that null, but the published schema and the client's types have only numbers in ``token_logprobs`` and
    objects in ``top_logprobs``: the entry is dropped from the four lists before the chunk is checked against them."""
    out = copy.deepcopy(chunk)
    for choice in out["choices"]:
        lp = choice["logprobs"]
        if lp and lp["token_logprobs"] and lp["token_logprobs"][0] is None:
            assert lp["top_logprobs"][0] is None and lp["text_offset"][0] == 0, lp
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                lp[key] = lp[key][1:]
    return out


def streamed_choices(served: Served, body: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], dict[str, Any] | None]:
    """A streamed /v1/completions request put together per choice index (text, logprobs lists, finish_reason), and
    its usage chunk's usage; every chunk is checked against OpenAI's schema and the client's types."""
    out: dict[int, dict[str, Any]] = {}
    usage = None
    with served.http(key=None) as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]", events
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        check_body(without_first_null(chunk), "completion_chunk")
        if not chunk["choices"]:
            usage = chunk["usage"]
        for choice in chunk["choices"]:
            acc = out.setdefault(choice["index"], {"text": "", "finish_reason": None, "logprobs": None})
            assert acc["finish_reason"] is None, f"choice {choice['index']}: a chunk after its finish_reason"
            acc["text"] += choice["text"]
            acc["finish_reason"] = choice["finish_reason"]
            if choice["logprobs"] is not None:
                lp = acc["logprobs"] = acc["logprobs"] or {k: [] for k in choice["logprobs"]}
                for key, values in choice["logprobs"].items():
                    lp[key] += values
    return out, usage


STREAMED = [
    ("echo_logprobs_greedy", {"prompt": random_ids(14, seed=61), "max_tokens": 4, "temperature": 0, "echo": True,
                              "logprobs": 2}),
    ("echo_max_tokens_zero", loglikelihood_body([random_ids(12, seed=62), random_ids(7, seed=63)], max_tokens=0,
                                                logprobs=1)),
    ("lm_eval_batch", loglikelihood_body([random_ids(9, seed=64), random_ids(5, seed=65)])),
    ("echo_text_no_logprobs", {"prompt": "the quick brown fox", "max_tokens": 3, "temperature": 0, "echo": True}),
    ("batch_samples_seeded", {"prompt": ["alpha beta", "gamma"], "max_tokens": 3, "temperature": 0.8, "seed": 3,
                              "n": 2}),
    ("one_token_prompt_echo", {"prompt": [40], "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 0}),
]  # fmt: skip


@pytest.mark.parametrize("body", [b for _, b in STREAMED], ids=[i for i, _ in STREAMED])
def test_streamed_echo_and_batches_equal_whole(served, body):
    """``stream: true`` with ``echo`` or a batch of prompts (vLLM's stream: each choice's first chunk carries its
    echoed prompt, with the prompt's logprobs): per choice, the chunks add up to the whole answer's text, logprobs
    (text offsets included) and finish_reason; the usage chunk equals the whole answer's usage."""
    with served.http(key=None) as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    whole = r.json()
    got, usage = streamed_choices(served, {**body, "stream_options": {"include_usage": True}})
    assert sorted(got) == [ch["index"] for ch in whole["choices"]]
    for ch in whole["choices"]:
        mine = got[ch["index"]]
        assert (mine["text"], mine["finish_reason"]) == (ch["text"], ch["finish_reason"]), ch["index"]
        assert (mine["logprobs"] is None) == (ch["logprobs"] is None)
        if ch["logprobs"] is not None:  # the same tokens; logprobs equal up to fp32 batching noise
            lp, want = mine["logprobs"], ch["logprobs"]
            assert (lp["tokens"], lp["text_offset"]) == (want["tokens"], want["text_offset"])
            assert lp["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=ATOL)
            for top, want_top in zip(lp["top_logprobs"], want["top_logprobs"], strict=True):
                assert top == (None if want_top is None else pytest.approx(want_top, abs=ATOL))
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: the whole request cached some
    assert {k: usage[k] for k in counts} == {k: whole["usage"][k] for k in counts}
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"]


def test_a_streamed_batch_whose_client_leaves_frees_its_blocks(served):
    """A streamed batch with echo and logprobs whose client reads two chunks and hangs up: its answers and its
    prompts' score requests are cancelled (not run to their 300 tokens), and the referenced blocks come back to where
    they were (the loop slowed, so nothing can end while the test looks)."""
    served.wait_idle()
    pool = served.engine.pool
    before = pool.num_referenced
    cancelled = sample(served.metrics(), "vllm:request_success_total", finished_reason="cancelled") or 0.0
    body = {**loglikelihood_body([random_ids(20, seed=71), random_ids(30, seed=72)], max_tokens=300),
            "ignore_eos": True, "stream": True}  # fmt: skip
    with slowed(served.loop):
        with served.http(key=None) as c, c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = data_events(r)  # held: the connection stays open until the with block leaves
            first = [json.loads(next(events)) for _ in range(2)]
            assert all(chunk["choices"][0]["finish_reason"] is None for chunk in first)
            assert pool.num_referenced > before
    served.wait_idle()
    deadline = time.monotonic() + 10
    while pool.num_referenced != before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert pool.num_referenced == before
    pool.verify()
    time.sleep(0.1)  # the server counts a cancelled request when the loop hands back its completion
    # the two answers, cancelled (the score requests behind them are not client requests: not counted)
    assert sample(served.metrics(), "vllm:request_success_total", finished_reason="cancelled") == cancelled + 2


def test_streamed_echo_through_the_openai_client(served):
    prompt = "jumps over the lazy dog"
    client = served.client(key=None)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                            logprobs=1, stream=True))  # fmt: skip
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


# ---------------------------------------------------------------------- refusals
def test_max_tokens_zero_needs_echo(served):
    with served.http(key=None) as c:
        assert_envelope(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400,
                        code="invalid_value", param="max_tokens")  # fmt: skip
        assert_envelope(c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                             "max_tokens": 0}), 400, param="max_tokens")  # fmt: skip
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        served.client(key=None).completions.create(model=MODEL, prompt="x", max_tokens=0)


# ---------------------------------------------------------------------- skip_special_tokens
def test_skip_special_tokens(served):
    """vLLM's ``skip_special_tokens``: true (the default) leaves the special token out of the text, false keeps
    it; the token ids are the same (``logit_bias`` makes the model pick it)."""
    client = served.client(key=None)
    base = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0}
    bias = {"logit_bias": {str(SPECIAL): 100}, "return_token_ids": True}
    skipped = client.completions.create(**base, extra_body=bias).choices[0]
    kept = client.completions.create(**base, extra_body={**bias, "skip_special_tokens": False}).choices[0]
    assert skipped.model_extra["token_ids"] == kept.model_extra["token_ids"] == [SPECIAL] * 3
    assert skipped.text == "" and kept.text == "<s><s><s>"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          temperature=0, extra_body={**bias, "skip_special_tokens": False})
    assert chat.choices[0].message.content == "<s><s>"
    with served.http(key=None) as c:
        assert_envelope(c.post("/v1/completions", json={"prompt": "x", "skip_special_tokens": "no"}), 400,
                        param="skip_special_tokens")  # fmt: skip


def test_echo_with_samples(served):
    """``n`` samples with ``echo`` and ``logprobs``: every choice starts with the prompt and its (one) prompt
    logprobs; the samples' answers are their own."""
    ids = random_ids(18, seed=41)
    with served.http(key=None) as c:
        r = c.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0.9, "seed": 5, "n": 2,
                                            "echo": True, "logprobs": 1})  # fmt: skip
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [ch["index"] for ch in choices] == [0, 1]
    prompt_text = served.engine.tokenizer.decode(ids, skip_special_tokens=False)
    for ch in choices:
        assert ch["text"].startswith(prompt_text)
        assert len(ch["logprobs"]["tokens"]) == len(ids) + 3
        check_prompt_logprobs(served, ids, ch["logprobs"], top=1)


def test_loop_score_requests_refuse_bad_input(served):
    """``loop.submit(score_ids=...)``: one sample only, token ids of the vocabulary only."""
    from kvboost.engine.requests import SamplingParams
    from kvboost.prompts import PromptError

    with pytest.raises(ValueError, match="n=1"):
        served.loop.submit([5], SamplingParams(max_tokens=1, n=2), score_ids=[6, 7])
    with pytest.raises(PromptError):
        served.loop.submit([5], SamplingParams(max_tokens=1), score_ids=[6, 10_000])
    with pytest.raises(PromptError, match="empty"):
        served.loop.submit([5], SamplingParams(max_tokens=1), score_ids=[])
    done = served.loop.submit([5], SamplingParams(max_tokens=1, logprobs=2), score_ids=[6, 7]).result(60)
    ref = reference(served, [5, 6, 7])
    assert [len(e.top) for e in done.score_logprobs] == [2, 2]
    torch.testing.assert_close(torch.tensor([e.logprob for e in done.score_logprobs]),
                               torch.stack([ref[0, 6], ref[1, 7]]), atol=ATOL, rtol=0)  # fmt: skip


def test_metrics_count_the_answers_not_the_score_requests(served):
    """A batch of 3 echo + logprobs prompts with one answer each is 3 finished requests in ``/metrics``: the
    prompt-logprob score requests behind them are not counted as client requests."""

    def finished() -> float:
        text = served.metrics()
        return sum(sample(text, "vllm:request_success_total", finished_reason=r) or 0.0 for r in ("stop", "length"))

    before = finished()
    with served.http(key=None) as c:
        r = c.post("/v1/completions", json=loglikelihood_body([random_ids(10, seed=s) for s in (51, 52, 53)]))
    assert r.status_code == 200, r.text
    assert finished() - before == 3
