"""The scheduler and engine loop (kvboost.engine.core / loop / scheduler): every request gives the tokens it gives
alone, whatever it was batched, chunked or preempted with; cancellation, timeouts, a full queue, stop strings, seeds
and tenants' salts behave as documented; blocks always come back."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from kvboost_testkit.tiny import make_engine, random_ids

from kvboost.engine import EngineLoop, LoopStopped, QueueFull, SamplingParams
from kvboost.engine.scheduler import Scheduler

PROMPT_LENGTHS = (20, 45, 70, 33, 90, 300)


def run_all(engine, handles):
    steps = 0
    while engine.core.has_work():
        engine.step()
        steps += 1
        assert steps < 10_000
    return [h.result(0) for h in handles]


def singles_of(engine, prompts, max_new=12):
    out = [engine.generate(p, max_new_tokens=max_new, mode="cold").output_ids for p in prompts]
    return out


@pytest.mark.parametrize("budget", [2048, 40])
def test_scheduled_requests_give_their_single_run_tokens(budget):
    """fp32: six prompts through the scheduler (one flat forward per step mixing decode rows and prompt chunks of at
    most ``budget`` tokens) give the greedy tokens of each prompt run alone, cold and then again with its cache."""
    engine = make_engine("llama", decode="eager")
    engine.core.scheduler.max_batch_tokens = engine.core.scheduler.idle_prefill_tokens = budget
    prompts = [random_ids(n, seed=n) for n in PROMPT_LENGTHS]
    alone = singles_of(engine, prompts)
    first = run_all(engine, [engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts])
    assert [c.output_ids for c in first] == alone
    assert all(c.finish_reason in ("stop", "length") for c in first)
    again = run_all(engine, [engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts])
    assert [c.output_ids for c in again] == alone
    assert all(c.cached_tokens >= (n // 16) * 16 - 16 for c, n in zip(again, PROMPT_LENGTHS))
    assert engine.core.stats()["prefix_hit_tokens"] > 0
    engine.reset_cache()
    assert engine.pool.num_used == 0
    engine.close()


def test_a_long_prompt_is_prefilled_in_chunks_while_others_decode():
    """Token budget 32: a 300-token prompt takes several steps, and a short request admitted with it produces
    tokens in those steps."""
    engine = make_engine("llama", decode="eager")
    engine.core.scheduler.max_batch_tokens = engine.core.scheduler.idle_prefill_tokens = 32
    engine.eos_ids = set()
    short = engine.add_request(random_ids(10, seed=1), SamplingParams(max_tokens=6))
    long = engine.add_request(random_ids(300, seed=2), SamplingParams(max_tokens=2))
    engine.step()
    engine.step()
    assert len(short._request.tokens) >= 2 and not long._request.tokens
    run_all(engine, [short, long])
    assert long.result(0).output_ids == singles_of(engine, [random_ids(300, seed=2)], 2)[0]
    engine.close()


def test_preemption_when_the_pool_runs_out_gives_the_same_tokens():
    """A pool of 40 blocks (640 rows) and six requests that need more together: the newest are preempted (blocks
    freed, recomputed later with their tokens so far), none crashes, each gives its single-run tokens."""
    probe = make_engine("llama", decode="eager")
    block_bytes = probe.pool.block_bytes
    probe.close()
    engine = make_engine("llama", decode="eager", cache={"name": "memory", "capacity": block_bytes * 4},
                         kv={"pool_bytes": block_bytes * 40})  # fmt: skip
    engine.eos_ids = set()
    prompts = [random_ids(n, seed=n) for n in (150, 140, 130, 120, 110, 100)]
    alone = singles_of(engine, prompts, max_new=40)
    engine.reset_cache()
    done = run_all(engine, [engine.add_request(p, SamplingParams(max_tokens=40)) for p in prompts])
    assert engine.core.stats()["preemptions"] > 0
    assert sum(c.preemptions for c in done) == engine.core.stats()["preemptions"]
    assert [c.output_ids for c in done] == alone
    engine.reset_cache()
    assert engine.pool.num_used == 0
    engine.close()


def test_cancel_and_timeout_free_the_blocks():
    engine = make_engine("llama", decode="eager")
    engine.eos_ids = set()
    cancelled = engine.add_request(random_ids(40, seed=3), SamplingParams(max_tokens=50))
    timed = engine.add_request(random_ids(50, seed=4), SamplingParams(max_tokens=50), timeout_s=1e-6)
    kept = engine.add_request(random_ids(30, seed=5), SamplingParams(max_tokens=5))
    engine.step()
    engine.step()
    cancelled.cancel()
    run_all(engine, [cancelled, timed, kept])
    assert cancelled.result(0).finish_reason == "cancelled"
    assert timed.result(0).finish_reason == "timeout" and "timeout" in timed.result(0).error
    assert kept.result(0).finish_reason == "length" and len(kept.result(0).output_ids) == 5
    engine.reset_cache()
    assert engine.pool.num_used == 0
    engine.close()


def test_stop_strings_end_the_request_and_are_not_sent():
    engine = make_engine("llama", decode="eager")
    engine.eos_ids = set()
    prompt = random_ids(25, seed=9)
    full = run_all(engine, [engine.add_request(prompt, SamplingParams(max_tokens=20))])[0]
    stop = full.text[6:8]
    cut = full.text.find(stop)
    handle = engine.add_request(prompt, SamplingParams(max_tokens=20, stop=(stop,)))
    done = run_all(engine, [handle])[0]
    assert done.finish_reason == "stop" and done.text == full.text[:cut]
    assert "".join(e.text for e in handle) == done.text
    engine.close()


def test_seeded_sampling_does_not_depend_on_the_batch():
    engine = make_engine("llama", decode="eager")
    engine.eos_ids = set()
    prompt = random_ids(30, seed=11)
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=20, seed=1234)
    alone = run_all(engine, [engine.add_request(prompt, params)])[0].output_ids
    others = [engine.add_request(random_ids(n, seed=n), SamplingParams(max_tokens=10, temperature=1.0, seed=n))
              for n in (12, 40)]  # fmt: skip
    together = engine.add_request(prompt, params)
    run_all(engine, [*others, together])
    assert together.result(0).output_ids == alone
    engine.close()


def test_n_samples_fork_one_prefill_and_equal_separately_seeded_requests():
    """``SamplingParams(n=3, seed=s)``: the prompt is prefilled once (``prefill_tokens``), the other samples fork its
    table (``forked_samples``; the shared partial last block copied on write by all writers but the last), and
    sample ``i`` equals a separate request seeded ``sample_seed(s, i)``; logprobs are the log-softmax of the
    logits the token was picked from (the first token: the engine's own first_token_logits)."""
    import torch

    from kvboost.engine.requests import sample_seed

    engine = make_engine("llama", decode="eager")
    engine.eos_ids = set()
    prompt = random_ids(37, seed=21)  # 2 full blocks and a partial one
    params = SamplingParams(max_tokens=6, temperature=0.8, seed=99, n=3, logprobs=2)
    before, cow = dict(engine.core.counters), engine.pool.stats.copy_on_write
    handle = engine.add_request(prompt, params)
    assert [h.index for h in handle.samples] == [0, 1, 2] and handle.samples[0] is handle
    done = run_all(engine, handle.samples)
    delta = {k: engine.core.counters[k] - before[k] for k in before}
    assert delta["prefill_tokens"] == delta["prompt_tokens"] == 37
    assert delta["forked_samples"] == 2 and delta["forked_prompt_tokens"] == 74
    assert engine.pool.stats.copy_on_write - cow == 2
    assert [c.index for c in done] == [0, 1, 2]
    for i, completion in enumerate(done):
        alone = run_all(engine, [engine.add_request(prompt, SamplingParams(max_tokens=6, temperature=0.8,
                                                                           seed=sample_seed(99, i)))])[0]  # fmt: skip
        assert alone.output_ids == completion.output_ids
        assert len(completion.logprobs) == 6 and all(len(lp.top) == 2 for lp in completion.logprobs)
    first = engine.generate(prompt, max_new_tokens=1, mode="cold", keep_logits=True).first_token_logits
    own = torch.log_softmax(first.float(), -1)
    for completion in done:
        assert abs(completion.logprobs[0].logprob - float(own[completion.output_ids[0]])) <= 1e-4
        assert [t for t, _ in completion.logprobs[0].top] == torch.topk(own, 2).indices.tolist()
    # a sample cancelled before its fork ends at the fork; the first ending before its prefill ends them all
    handle = engine.add_request(prompt + [5], SamplingParams(max_tokens=4, n=3))
    handle.samples[2].cancel()
    done = run_all(engine, handle.samples)
    assert [c.finish_reason for c in done] == ["length", "length", "cancelled"]
    handle = engine.add_request(prompt + [6], SamplingParams(max_tokens=4, n=2))
    handle.cancel()
    assert [c.finish_reason for c in run_all(engine, handle.samples)] == ["cancelled", "cancelled"]
    engine.reset_cache()
    engine.pool.verify()
    assert engine.pool.num_used == 0
    engine.close()


def test_max_running_counts_every_sample_of_a_request():
    """A request with n samples takes n places once it forks: with max_running=4 two n=3 requests never run
    together (6 sequences); alone, a request with n > max_running still runs. Fails if admission counts requests."""
    engine = make_engine("llama", decode="eager")
    engine.eos_ids = set()
    core = engine.core
    core.scheduler.max_running = 4
    first = engine.add_request(random_ids(20, seed=1), SamplingParams(max_tokens=5, n=3, seed=1))
    second = engine.add_request(random_ids(20, seed=2), SamplingParams(max_tokens=5, n=3, seed=2))
    handles = [*first.samples, *second.samples]
    most = 0
    for _ in range(200):
        core.step()
        most = max(most, len(core.scheduler.running))
        if not core.has_work():
            break
    assert all(h.done for h in handles) and most == 3
    lone = engine.add_request(random_ids(20, seed=3), SamplingParams(max_tokens=3, n=6, seed=3))
    assert [c.finish_reason for c in run_all(engine, lone.samples)] == ["length"] * 6
    engine.close()


def test_a_salt_never_hits_another_salts_entries():
    engine = make_engine("llama", decode="eager")
    prompt = random_ids(64, seed=12)
    a1 = run_all(engine, [engine.add_request(prompt, SamplingParams(max_tokens=4), cache_salt="tenant-a")])[0]
    b1 = run_all(engine, [engine.add_request(prompt, SamplingParams(max_tokens=4), cache_salt="tenant-b")])[0]
    a2 = run_all(engine, [engine.add_request(prompt, SamplingParams(max_tokens=4), cache_salt="tenant-a")])[0]
    assert (a1.cached_tokens, b1.cached_tokens) == (0, 0) and a2.cached_tokens >= 48
    engine.close()


def test_engine_loop_serves_threads_and_asyncio_with_single_run_tokens():
    engine = make_engine("llama", decode="eager")
    prompts = [random_ids(n, seed=n) for n in PROMPT_LENGTHS]
    alone = singles_of(engine, prompts)
    loop = EngineLoop(engine, max_running=4).start()
    results: dict[int, list[int]] = {}

    def client(i):
        results[i] = loop.submit(prompts[i], SamplingParams(max_tokens=12)).result(60).output_ids

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(prompts))] == alone

    async def streamed():
        handle = loop.submit(prompts[2], SamplingParams(max_tokens=12))
        pieces = [event.text async for event in handle.stream()]
        return "".join(pieces), await handle.aresult()

    text, completion = asyncio.run(streamed())
    assert text == completion.text and completion.output_ids == alone[2]
    assert loop.call(lambda e: e.cache_stats()["requests"]).result(10) >= 7
    loop.shutdown()
    with pytest.raises(LoopStopped):
        loop.submit(prompts[0], SamplingParams())
    engine.close()


def test_a_full_queue_refuses_with_retry_after_and_keeps_serving():
    engine = make_engine("llama", decode="eager")
    loop = EngineLoop(engine, max_waiting=2)
    loop._running = True  # accepting, its thread not yet started: submissions stay in the inbox
    held = [loop.submit(random_ids(10, seed=i), SamplingParams(max_tokens=2)) for i in range(2)]
    with pytest.raises(QueueFull) as refused:
        loop.submit(random_ids(10, seed=3), SamplingParams(max_tokens=2))
    assert refused.value.retry_after_s >= 1
    loop.start()
    assert all(h.result(60).finish_reason in ("stop", "length") for h in held)
    assert loop.submit(random_ids(10, seed=4), SamplingParams(max_tokens=2)).result(60).output_ids
    loop.shutdown()
    engine.close()


def test_shutdown_ends_requests_in_flight():
    engine = make_engine("llama", decode="eager")
    engine.eos_ids = set()
    loop = EngineLoop(engine).start()
    handle = loop.submit(random_ids(10, seed=1), SamplingParams(max_tokens=500))
    next(iter(handle))  # it runs
    loop.shutdown()
    assert handle.result(30).finish_reason == "shutdown"
    engine.close()


def test_bad_requests_fail_their_caller_at_submit():
    engine = make_engine("llama", decode="eager")
    loop = EngineLoop(engine).start()
    with pytest.raises(ValueError, match="max_tokens"):
        loop.submit([1, 2, 3], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        loop.submit([10**9], SamplingParams())
    with pytest.raises(ValueError):
        loop.submit(random_ids(engine.adapter.max_positions + 5), SamplingParams())
    assert loop.submit([1, 2, 3], SamplingParams(max_tokens=2)).result(30).output_ids  # still serving
    loop.shutdown()
    engine.close()


def _seq(cached, preempted=False, arrival=0):
    return SimpleNamespace(cached_prefix=cached, preempted=preempted, arrival_step=arrival)


def test_waiting_order_is_cache_aware_then_fcfs():
    s = Scheduler(cache_aware_limit=4)
    seqs = [_seq(0), _seq(64), _seq(16), _seq(64, preempted=False)]
    for q in seqs:
        s.add(q)
    s.order_waiting(step=0)
    assert list(s.waiting) == [seqs[1], seqs[3], seqs[2], seqs[0]]  # longest cached first, ties by arrival
    preempted = _seq(0, preempted=True)
    s.requeue(preempted)
    s.order_waiting(step=0)
    assert s.waiting[0] is preempted  # beyond the limit (5 > 4): FCFS, the preempted one stays in front
    long_queue = Scheduler(cache_aware_limit=2)
    fcfs = [_seq(0), _seq(10), _seq(20)]
    for q in fcfs:
        long_queue.add(q)
    long_queue.order_waiting(step=0)
    assert list(long_queue.waiting) == fcfs


def test_a_request_that_waited_long_enough_goes_first():
    """Aging (issue 42, D6): past ``aging_steps`` a request is served before every longer cached prefix."""
    s = Scheduler(cache_aware_limit=8, aging_steps=10)
    cold = _seq(0, arrival=0)
    hot = [_seq(64, arrival=step) for step in range(1, 5)]
    for q in [cold, *hot]:
        s.add(q)
    s.order_waiting(step=5)
    assert s.waiting[-1] is cold  # not old enough: the cached prefixes first
    s.order_waiting(step=10)
    assert s.waiting[0] is cold


def test_a_failing_request_ends_alone_and_the_loop_keeps_serving(monkeypatch):
    """An exception while one request samples (here a planted one) ends that request with finish_reason "error";
    the requests batched with it finish normally and the loop goes on serving."""
    import kvboost.engine.core as core_module

    real = core_module.pick_token

    def planted(logits, sampling, generator=None):
        if sampling.top_k == 7:
            raise RuntimeError("planted sampling failure")
        return real(logits, sampling, generator)

    monkeypatch.setattr(core_module, "pick_token", planted)
    engine = make_engine("llama", decode="eager")
    loop = EngineLoop(engine).start()
    bad = loop.submit(random_ids(20, seed=1), SamplingParams(max_tokens=4, temperature=1.0, top_k=7))
    good = loop.submit(random_ids(30, seed=2), SamplingParams(max_tokens=4))
    assert bad.result(30).finish_reason == "error" and "planted" in bad.result(30).error
    assert good.result(30).finish_reason in ("stop", "length")
    assert loop.submit(random_ids(10, seed=3), SamplingParams(max_tokens=2)).result(30).output_ids
    assert loop.running and loop.error is None
    loop.shutdown()
    monkeypatch.setattr(core_module, "pick_token", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("planted")))
    with pytest.raises(RuntimeError, match="planted"):  # generate() lets it reach its caller
        engine.generate(random_ids(20, seed=1), 4)
    engine.reset_cache()
    assert engine.pool.num_used == 0
    engine.close()


def test_extreme_sampling_values_do_not_fail():
    from kvboost.decoding import Sampling, pick_token

    logits = __import__("torch").randn(50)
    for sampling in (Sampling(True, 1e-300), Sampling(True, 1.0, top_k=10**6), Sampling(True, 1.0, top_p=5e-324)):
        assert 0 <= pick_token(logits, sampling) < 50


def test_the_loop_looks_for_other_processes_entries_only_with_a_shared_tier(monkeypatch):
    """A store with a shared tier (one with ``refresh``, as redis) is refreshed every ``refresh_shared_s`` on the
    loop thread, idle or not; a memory-only store never is."""
    import time

    engine = make_engine("llama", decode="eager")
    assert EngineLoop(engine).refresh_shared_s is None  # memory only
    calls = []
    monkeypatch.setattr(engine.store.tiers[0], "refresh", list, raising=False)
    monkeypatch.setattr(engine.store, "refresh", lambda: calls.append(threading.current_thread().name) or 1)
    loop = EngineLoop(engine, refresh_shared_s=0.05).start()
    time.sleep(0.4)
    loop.shutdown()
    assert len(calls) >= 3 and set(calls) == {"kvboost-engine-loop"} and loop.shared_entries_found == len(calls)
    engine.close()
