"""Regression tests for the engine's edge defects of issue 61, one test per defect, named after it.

Each drives a tiny random fp32 model through the public engine API (``warm``, ``generate``, ``add_request`` /
``step``, ``verify_correctness``, ``engine.pool`` / ``engine.store``) and failed on the tree before its fix for the
reason its docstring gives. Step loops are bounded, so none of them can hang on a regression.
"""

from __future__ import annotations

import functools

import pytest
import torch
from kvboost_testkit import pools
from kvboost_testkit.pools import BLOCK, block_bytes, one_thread  # noqa: F401 - one_thread: autouse fixture
from kvboost_testkit.tiny import make_engine, random_ids

from kvboost.engine import SamplingParams

# eos=False: a random model may sample EOS; every request here decodes its max_new_tokens
pool_engine = functools.partial(pools.pool_engine, eos=False)


def drain(engine, limit: int, what: str) -> int:
    """Step until no work is left, at most ``limit`` steps; returns the steps taken."""
    steps = 0
    while engine.core.has_work():
        assert steps < limit, f"{what}: still work after {limit} steps ({engine.core.stats()})"
        engine.step()
        steps += 1
    return steps


# ---------------------------------------------------------------------------------------------------------- defect 4
def test_defect4_pin_below_the_pool_survives_reuse(tmp_path):
    """A pinned entry below the pool (here: pinned, spilled to disk by ``close``, found there by the next engine)
    keeps its pin when the first request that reuses it stores it again as a run of its blocks. Before the fix
    ``store_sequence`` re-stored it with the request's ``pin=False``: the pool tier held it unpinned (evictable,
    ``pinned_keys()`` empty) and the disk record's pin was gone with it."""
    cache = [{"name": "memory"}, {"name": "disk", "path": str(tmp_path), "capacity": "64MiB", "fsync": False}]
    doc = random_ids(3 * BLOCK, seed=1)
    engine = pool_engine(40, chat=False, cache=cache)
    engine.warm(doc, pin=True, chat=False)
    assert len(engine.store.pinned_keys()) == 3
    engine.close()

    engine = pool_engine(40, chat=False, cache=cache)  # a restart: the pinned chunks are disk records now
    disk = engine.store.tiers[1]
    pinned = [key for key in disk.keys() if disk.peek_meta(key).pinned]
    assert len(pinned) == 3
    result = engine.generate(doc + random_ids(5, seed=2), 3)
    assert result.cached_tokens == len(doc)  # the request reused them (and stored them again, as runs)
    moved = [key for key in pinned if engine.store.in_first_tier(key)]
    assert moved, "the reusing request moved no chunk up into the pool"
    lost = [key[:12] for key in pinned if not engine.store.peek_meta(key).pinned]
    assert not lost, f"the reusing request re-stored pinned chunks unpinned: {lost}"
    assert set(moved) <= set(engine.store.pinned_keys())  # pinned in the pool: a reference on their blocks
    engine.store.reclaim(engine.pool.num_blocks)  # pool pressure: a pinned chunk is never evicted
    assert all(key in engine.store for key in pinned)
    engine.unpin(doc, chat=False)
    assert not engine.store.pinned_keys()
    engine.close()


# ---------------------------------------------------------------------------------------------------------- defect 5
def test_defect5_verify_correctness_with_a_full_pool():
    """``verify_correctness`` on an engine whose pool is full of cached chunks runs (the pool reclaims idle entries
    for it as for any request), passes (fp32), and leaves none of its own entries behind. Before the fix it built a
    second cache over the same pool: that cache could evict none of the engine's entries, and the check failed with
    ``PoolExhausted`` ("0 free, 8 cached and not evictable")."""
    engine = pool_engine(8)
    for seed in range(5):  # 2 chunks each: the 8 blocks end up cached, none free
        engine.generate(random_ids(2 * BLOCK, seed=10 + seed), 2)
    assert engine.pool.num_free == 0 and engine.pool.num_cached == engine.pool.num_blocks
    before = set(engine.store.tiers[0].keys())
    hits = engine.store.stats.hit_tokens
    report = engine.verify_correctness([random_ids(40, seed=3)], max_new_tokens=4)
    assert report.passed, str(report)
    assert report.checks[0].greedy_match
    assert set(engine.store.tiers[0].keys()) <= before, "the check's own entries were left in the cache"
    assert engine.store.stats.hit_tokens == hits  # the store's counters are the engine's, not the check's
    engine.pool.verify()
    engine.store.verify()
    assert engine.pool.num_referenced == 0


# ---------------------------------------------------------------------------------------------------------- defect 6
def record_puts(engine) -> list:
    """Every entry offered to the store from now on (the store's ``put``, wrapped)."""
    offered = []
    real = engine.store.put

    def put(entry):
        offered.append(entry)
        return real(entry)

    engine.store.put = put
    return offered


@pytest.mark.parametrize("why", ["store_generated=False", "int8-decoded rows"])
def test_defect6_preemption_stores_only_what_a_finish_would(why):
    """Two requests decode past what a 6-block pool holds: the newer is preempted (the public path: the scheduler
    runs out of blocks), and its rows are cached by the rule every store follows. With ``store_generated=False``, or
    with a decode step whose rows a prefill would not give (``generated_rows_exact`` False: int8 activations), no
    generated row may be stored, and the preempted request still produces the tokens it produces alone. Before the
    fix ``_preempt`` called ``store_rows(resume=True)``, which stored the generated rows under exact keys anyway
    (entries at rows 16-32 and 32-48 of a 16-token prompt)."""
    prompts = [random_ids(BLOCK, seed=s) for s in (1, 2)]
    alone = pool_engine(16, store_generated=why != "store_generated=False")
    expected = [alone.generate(p, 40, mode="cold").output_ids for p in prompts]
    engine = pool_engine(6, store_generated=why != "store_generated=False")
    if why == "int8-decoded rows":
        engine.generated_rows_exact = False  # what decode=quantized with int8 activations sets
    offered = record_puts(engine)
    handles = [engine.add_request(p, SamplingParams(max_tokens=40)) for p in prompts]
    drain(engine, 400, why)
    assert engine.core.counters["preemptions"] > 0, "the scenario no longer preempts"
    past_prompt = [(e.start, e.start + e.num_tokens) for e in offered if e.start + e.num_tokens > BLOCK]
    assert not past_prompt, f"generated rows stored ({why}): rows {past_prompt}"
    for handle, want in zip(handles, expected, strict=True):
        assert handle.result(0).output_ids == want


# ---------------------------------------------------------------------------------------------------------- defect 7
def test_defect7_preempted_score_request_resumes_its_score_rows():
    """A ``score_ids`` request whose teacher-forced rows do not fit beside an older decoding request is preempted in
    its score phase (the scheduler, a 6-block pool). It must resume with its prompt and run its score rows again:
    its tokens, its ``answer_logprob`` and the other request's tokens as alone, counted once. Before the fix it
    resumed as a prefill, picked a token past ``max_new_tokens``, finished (and was counted) again and went back to
    its score rows, round after round: ``cache_stats()["requests"]`` was 39 for the two requests."""
    prompt, other, answer = random_ids(BLOCK, seed=1), random_ids(BLOCK, seed=2), random_ids(60, seed=3)
    alone = pool_engine(16)
    want = alone.generate(prompt, 2, score_ids=answer, mode="cold")
    want_other = alone.generate(other, 40, mode="cold").output_ids
    engine = pool_engine(6)
    handle = engine.add_request(other, SamplingParams(max_tokens=40))
    engine.step()  # the other request runs first (older): the score request is the one preempted
    got = engine.generate(prompt, 2, score_ids=answer)
    assert engine.core.counters["preemptions"] > 0, "the scenario no longer preempts"
    assert got.output_ids == want.output_ids
    assert abs(got.extra["answer_logprob"] - want.extra["answer_logprob"]) <= 1e-4 * abs(want.extra["answer_logprob"])
    drain(engine, 200, "the other request")
    assert handle.result(0).output_ids == want_other
    assert engine.cache_stats()["requests"] == 2
    assert engine.pool.num_referenced == 0


@pytest.mark.timeout(60)
def test_defect7_score_ids_checked_against_the_pool():
    """Score rows that cannot fit the pool are refused before any compute, with the numbers (they follow the prompt
    in its table). Before the fix nothing checked them: the request preempted itself forever (a hang, ended by
    the timeout)."""
    from kvboost.prompts import PromptError

    engine = pool_engine(6)
    with pytest.raises(PromptError, match=r"prompt \+ score_ids"):
        engine.generate(random_ids(BLOCK, seed=1), 2, score_ids=random_ids(150, seed=4))
    with pytest.raises(PromptError, match="empty"):
        engine.generate(random_ids(BLOCK, seed=1), 2, score_ids=[])
    with pytest.raises(PromptError, match="vocabulary"):
        engine.generate(random_ids(BLOCK, seed=1), 2, score_ids=[1, 10**6])
    assert not engine.core.has_work() and engine.pool.num_referenced == 0


# ---------------------------------------------------------------------------------------------------------- defect 8
SEPARATOR = {"name": "separator", "separator": "\n\n", "chunk_size": BLOCK}
DOCS = ["The keeper's cat is called Miso and sleeps on the stairs all day long.",
        "The ferry leaves at noon from pier nine, unless the sea is rough.",
        "Bread is baked at dawn in the old stone oven by the harbour wall."]  # fmt: skip


def test_defect8_preemption_mid_prefill_with_the_separator_chunker(caplog):
    """With the ``separator`` chunker, a request preempted in its prefill (a 16-block pool, a 16-token step budget:
    its prompt runs 15 tokens a step beside an older decoding request, which then needs a block) caches the rows it
    computed, cut at the preemption point inside its third document, resumes and gives the tokens it gives alone.
    Before the fix ``store_sequence`` extended the prompt's spans over the shorter sequence (``extend`` continues
    the last segment): spans past the table remained, storing one raised (IndexError on an empty chunk) and
    ``_preempt`` logged and dropped the error."""
    prompt = "\n\n".join(DOCS) + "\n\nCat?"
    older = random_ids(30, seed=1)
    alone = pool_engine(40, chat=False, chunker=SEPARATOR)
    want_older = alone.generate(older, 60, mode="cold").output_ids
    want = alone.generate(prompt, 4, mode="cold").output_ids
    engine = pool_engine(16, chat=False, chunker=SEPARATOR)
    engine.core.scheduler.max_batch_tokens = 16
    offered = record_puts(engine)
    first = engine.add_request(older, SamplingParams(max_tokens=60))
    engine.step()
    second = engine.add_request(prompt, SamplingParams(max_tokens=4))
    with caplog.at_level("ERROR", logger="kvboost"):
        drain(engine, 400, "two requests")
    assert second.result(0).preemptions > 0, "the scenario no longer preempts the prompt"
    prompt_len = len(second._request.ids)
    cut = [(e.start, e.start + e.num_tokens) for e in offered if 0 < e.start + e.num_tokens < prompt_len
           and (e.start + e.num_tokens) % 15 == 0]  # fmt: skip
    assert cut, "no chunk cut at the preemption point was cached (the prefill runs 15 tokens a step)"
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert not errors, errors
    assert second.result(0).finish_reason == "length" and second.result(0).output_ids == want
    assert first.result(0).output_ids == want_older
    engine.pool.verify()
    engine.store.verify()
    assert engine.pool.num_referenced == 0


# ---------------------------------------------------------------------------------------------------------- defect 9
def test_defect9_layer_skip_after_preemption_drafts_over_the_live_table(monkeypatch):
    """Two layer-skip speculative requests decode past a 6-block pool: one is preempted and resumes with a new
    block table. Every proposal must run over the request's live table, and both give the tokens they give alone.
    Before the fix the draft kept the table of ``begin`` (a ``DraftRequest`` field): after the preemption it
    drafted over the released table (24 of 37 proposals here), forwards into blocks no request owned."""
    from kvboost.speculative.layer_skip import LayerSkip

    spec = {"name": "layer_skip", "layers": 2, "num_draft": 3}
    prompts = [random_ids(BLOCK, seed=s) for s in (1, 2)]
    alone = pool_engine(16, layers=4, speculative=spec)
    want = [alone.generate(p, 40, mode="cold").output_ids for p in prompts]
    engine = pool_engine(6, layers=4, speculative=spec)
    seen = []
    real = LayerSkip.propose

    def propose(self, *args, **kwargs):
        table = self._request.table
        seen.append(table is not None and not table._released)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(LayerSkip, "propose", propose)
    handles = [engine.add_request(p, SamplingParams(max_tokens=40)) for p in prompts]
    drain(engine, 400, "two speculative requests")
    assert engine.core.counters["preemptions"] > 0, "the scenario no longer preempts"
    assert seen and all(seen), f"{seen.count(False)} of {len(seen)} proposals drafted over a released table"
    assert [h.result(0).output_ids for h in handles] == want
    assert engine.pool.num_referenced == 0


# ---------------------------------------------------------------------------------------------------------- defect 2
def test_defect2_scheduler_preempts_only_what_it_needs():
    """The issue's case on the scheduler alone: A (older) needs 1 block for its decode row, B holds 5, none is
    free. Preempting B frees 5: A must run, alone preempted is B. Before the fix ``plan_step`` asked the pool for
    room again before B's blocks were released, so it preempted A too and planned an empty step."""
    from kvboost.engine.scheduler import Scheduler

    class Req:
        def __init__(self, name: str, blocks: int, admitted_at: int) -> None:
            self.name, self.blocks, self.admitted_at, self.phase = name, blocks, admitted_at, "decode"
            self.decoding = True

        def pending_tokens(self) -> int:
            return 1

    pool = {"free": 0}
    a, b = Req("A", 2, 1), Req("B", 5, 2)
    needs = {"A": 1, "B": 0}  # A's next row starts a block; B's fits its last one

    def preempt(victim):
        pool["free"] += victim.blocks  # what the core's _preempt does: the victim's blocks go back
        victim.blocks = 0

    scheduler = Scheduler(max_running=4, max_batch_tokens=64)
    scheduler.running = [a, b]
    plan = scheduler.plan_step(lambda r, n: needs[r.name], lambda n: pool["free"], preempt)
    assert [r.name for r in plan.preempted] == ["B"]
    assert [(r.name, n) for r, n in plan.rows] == [("A", 1)]


def test_defect2_engine_preempts_one_request_not_both():
    """The same through the engine: an older request (22-token prompt) and a newer one (66 tokens) decode in a
    7-block pool; when the older needs a block, only the newer is preempted and the step still runs the older's
    row; both give the tokens they give alone. Before the fix both were preempted in that step (the older too:
    ``preemptions`` 1 and 2) and the step ran nothing."""
    older, newer = random_ids(22, seed=1), random_ids(66, seed=2)
    alone = pool_engine(16)
    want = [alone.generate(p, 30, mode="cold").output_ids for p in (older, newer)]
    engine = pool_engine(7)
    first = engine.add_request(older, SamplingParams(max_tokens=30))
    engine.step()
    second = engine.add_request(newer, SamplingParams(max_tokens=30))
    empty_steps = 0
    progress = (0, 0)
    for _ in range(300):
        if not engine.core.has_work():
            break
        engine.step()
        now = (engine.core.counters["prefill_tokens"], sum(len(h._request.tokens) for h in (first, second)))
        empty_steps += now == progress  # no prompt row and no token: the step computed nothing
        progress = now
    assert not engine.core.has_work()
    assert second.result(0).preemptions > 0, "the scenario no longer preempts"
    assert first.result(0).preemptions == 0, "the older request was preempted as well"
    assert [first.result(0).output_ids, second.result(0).output_ids] == want
    assert empty_steps == 0, f"{empty_steps} steps computed nothing"


# ------------------------------------------------------------------------------------------------------- threading
def test_threading_shared_tier_refresh_runs_under_the_step_lock(tmp_path):
    """The loop's look for entries other processes wrote to a shared tier (``store.refresh``, Redis) changes the
    store's books: it must hold the core's step lock, as ``unpin``, ``reset_cache`` and ``close`` do (here a disk
    tier with a recording ``refresh``: the only thread is the loop's, so ``core.stepping`` > 0 means the lock).
    Before the fix it ran on the loop thread outside the lock."""
    import time

    from kvboost.engine import EngineLoop

    cache = [{"name": "memory"}, {"name": "disk", "path": str(tmp_path), "capacity": "64MiB", "fsync": False}]
    engine = pool_engine(16, cache=cache)
    held = []

    def refresh():
        held.append(engine.core.stepping > 0)
        return []

    engine.store.tiers[1].refresh = refresh
    loop = EngineLoop(engine, refresh_shared_s=0.01).start()
    deadline = time.monotonic() + 20
    while len(held) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    loop.shutdown()
    assert len(held) >= 3, "the loop never refreshed the shared tier"
    assert all(held), f"{held.count(False)} of {len(held)} refreshes ran outside the step lock"
    engine.close()


def test_threading_finished_loop_keeps_the_canonical_store():
    """After an ``EngineLoop`` ends, a chat request added with ``add_request`` and stepped by its caller still gets
    its canonical store (the core's ``on_finished`` hook is the engine's again). Before the fix the loop set the
    hook to None when it stopped: no canonical prefill ran."""
    from kvboost_testkit.tiny import ToyTokenizer, tiny_model

    from kvboost import KVBoost
    from kvboost.engine import EngineLoop

    class ChatToyTokenizer(ToyTokenizer):
        chat_template = "toy"

    engine = KVBoost(tiny_model("llama"), ChatToyTokenizer(), model_identity="tiny", decode="eager",
                     chunker={"name": "fixed", "chunk_size": BLOCK})  # fmt: skip
    engine.eos_ids = set()
    EngineLoop(engine).start().shutdown()
    engine.add_request([{"role": "user", "content": "Name three fruits, please."}], SamplingParams(max_tokens=6))
    drain(engine, 100, "a chat request and its canonical store")
    assert engine.core.counters["canonical_prefill_tokens"] > 0, "the chat turn got no canonical store"
    engine.close()


def test_threading_server_warm_tokenizes_off_the_loop_thread():
    """The server's ``POST /v1/cache/warm`` tokenizes on a worker thread (``EngineLoop.warm``), never on the loop
    thread (a long document tokenized there stalled every decode), and stores the text as ``engine.warm`` does.
    Before the fix the route ran ``engine.warm`` on the loop thread through ``loop.call``: the tokenizer ran on
    ``kvboost-engine-loop``."""
    import threading

    from fastapi.testclient import TestClient

    from kvboost.engine import EngineLoop
    from kvboost.serving.server import create_app

    engine = pool_engine(16, chat=False)
    threads = []
    cls = type(engine.tokenizer)

    def tokenize(self, text, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return cls.__call__(self, text, *args, **kwargs)

    engine.tokenizer.__class__ = type("RecordingTokenizer", (cls,), {"__call__": tokenize})
    loop = EngineLoop(engine).start()
    try:
        with TestClient(create_app(loop, model_name="tiny", server_secret="test-secret")) as client:
            text = "A shared system prompt, long enough for two chunks of sixteen tokens."
            response = client.post("/v1/cache/warm", json={"text": text})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["chunks_stored"] >= 2 and body["tokens_stored"] == body["prompt_tokens"]
        assert threads, "warm tokenized nothing"
        assert "kvboost-engine-loop" not in threads, f"tokenized on the loop thread: {threads}"
    finally:
        loop.shutdown()
    engine.close()


# ---------------------------------------------------------------------------------------------------------- defect 1
def draft_engine(**draft_options):
    """A tiny llama with a 1-layer tiny llama (same vocabulary, other weights) as its speculative draft model."""
    from kvboost_testkit.tiny import tiny_model

    draft = tiny_model("llama", seed=1, num_hidden_layers=1)
    return pool_engine(64, speculative={"name": "draft_model", "model": draft, "num_draft": 3, **draft_options})


def test_defect1_draft_model_serves_a_batch():
    """``generate_batch`` of six 120-token prompts with ``speculative=draft_model`` gives the tokens of plain
    decoding and leaves the draft's pool empty. Before the fix the draft's pool was sized for one sequence of the
    context (33 blocks) and shared by every request: the batch failed with ``PoolExhausted`` (an error about
    ``kv.pool_bytes``, which is the target's)."""
    prompts = [random_ids(120, seed=s) for s in range(6)]
    want = [r.output_ids for r in pool_engine(64).generate_batch(prompts, 30, mode="cold")]
    engine = draft_engine()
    got = engine.generate_batch(prompts, 30)
    assert [r.output_ids for r in got] == want
    assert all(r.extra["drafted_tokens"] > 0 for r in got)
    assert engine.speculative._runtime.pool.num_referenced == 0


def test_defect1_a_full_draft_pool_means_no_draft_this_step():
    """More requests than the draft's pool holds contexts (``sequences=1``): the others decode without a draft
    while it is full (counted in ``failed_drafts``), none fails, all give plain decoding's tokens."""
    prompts = [random_ids(120, seed=s) for s in range(6)]
    want = [r.output_ids for r in pool_engine(64).generate_batch(prompts, 30, mode="cold")]
    engine = draft_engine(sequences=1)
    got = engine.generate_batch(prompts, 30)
    assert [r.output_ids for r in got] == want
    assert engine.core.counters["failed_drafts"] > 0, "the draft pool never ran short"
    assert engine.speculative._runtime.pool.num_referenced == 0


def test_defect1_every_end_of_a_request_releases_its_draft():
    """A request aborted while it decodes with a draft (``core.abort``: its caller was interrupted; ``abort_all``:
    a loop shutting down) gives its draft table back. Before the fix only ``_finish`` ended drafts, ``_complete``
    did not: the aborted request's draft rows stayed held in the draft's pool for good."""
    engine = draft_engine()
    draft_pool = engine.speculative._runtime.pool
    for abort in (lambda r: engine.core.abort([r]), lambda r: engine.core.abort_all()):
        handle = engine.add_request(random_ids(30, seed=9), SamplingParams(max_tokens=30))
        for _ in range(4):
            engine.step()
        assert handle._request.draft is not None and draft_pool.num_referenced > 0
        abort(handle._request)
        assert handle.done
        assert draft_pool.num_referenced == 0, f"{draft_pool.num_referenced} draft blocks leaked"
    assert engine.pool.num_referenced == 0


# ---------------------------------------------------------------------------------------------------------- defect 3
@pytest.mark.parametrize("point", ["assembly", "content repair"])
def test_defect3_interrupt_during_admission_leaves_the_request_waiting(monkeypatch, point):
    """A KeyboardInterrupt while a request is admitted (its exact assembly, or the repair of its content hits)
    reaches the caller, and the request is back in the queue as before the step, holding no block: the next steps
    run it to the tokens it gives alone. Before the fix the interrupt was rolled back only inside the forward: the
    request stayed in ``running`` with nothing to compute, and ``while core.has_work(): step()`` never ended."""
    from kvboost.engine import core as core_module
    from kvboost.engine import pipeline

    options = dict(chat=False, chunker=SEPARATOR, recompute={"name": "cacheblend", "ratio": 0.3, "check_layers": [1]})
    prompt = "\n\n".join(reversed(DOCS)) + "\n\nWhere does the cat sleep?"
    engine = pool_engine(40, layers=4, **options)
    for doc in DOCS:
        engine.warm(doc, chat=False)
    want = pool_engine(40, layers=4, **options)
    for doc in DOCS:
        want.warm(doc, chat=False)
    expected = want.generate(prompt, 5)
    if point == "content repair":
        assert expected.content_hit_tokens > 0, "the prompt no longer gets content hits"
    module, name = (core_module, "assemble_exact") if point == "assembly" else (pipeline, "prefill_with_repair")
    real = getattr(module, name)
    state = {"raised": False}

    def interrupted(*args, **kwargs):
        if not state["raised"]:
            state["raised"] = True
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, interrupted)
    other = engine.add_request(random_ids(20, seed=5), SamplingParams(max_tokens=4))
    text = prompt if point == "content repair" else random_ids(40, seed=6)
    handle = engine.add_request(text, SamplingParams(max_tokens=5))
    with pytest.raises(KeyboardInterrupt):
        for _ in range(5):
            engine.step()
    assert state["raised"], f"the {point} never ran"
    request = handle._request
    assert request in engine.core.scheduler.waiting and not request.table.blocks
    drain(engine, 50, f"after an interrupt in {point}")
    if point == "content repair":
        assert handle.result(0).output_ids == expected.output_ids
    else:
        assert handle.result(0).output_ids == want.generate(text, 5, mode="cold").output_ids
    assert other.result(0).finish_reason == "length"
    engine.pool.verify()
    assert engine.pool.num_referenced == 0


# ------------------------------------------------------------------------------ found by the widened state machine
def test_aborting_a_sample_not_forked_yet_leaves_the_others_to_finish():
    """``core.abort`` of the second of ``n=2`` samples before the first's prompt is prefilled ends it, and the
    first sample never forks it later (it finishes alone, with its tokens). Before the fix the aborted sample
    stayed in the first's ``forks``: at the first token it was forked (``forked_samples`` 1), adopted into the
    running set although finished, and decoded for nothing."""
    engine = pool_engine(16)
    prompt = random_ids(40, seed=3)
    want = engine.generate(prompt, 4, mode="cold").output_ids
    first = engine.add_request(prompt, SamplingParams(max_tokens=4, n=2))
    second = first.samples[1]
    engine.core.abort([second._request])
    assert second.done and second.result(0).finish_reason == "cancelled"
    drain(engine, 50, "the first sample")
    assert first.result(0).output_ids == want
    assert engine.core.counters["forked_samples"] == 0, "the aborted sample was forked and computed anyway"
    assert second.result(0).finish_reason == "cancelled" and not second.result(0).output_ids
    assert engine.pool.num_referenced == 0
