"""Regression tests for the defects D1-D9 of issue 42 (the seam between the KV pool's reference counts and the cache
entries, and the extra scheduler cores an engine builds).

Each test drives a tiny random model in fp32 through the public engine API only (``make_engine`` options,
``warm``, ``generate``, ``add_request`` / ``step``, ``engine.pool``'s counters, ``engine.store``'s size), so that
the same file runs on 900b562 and on the one-KV-cache / one-engine-core design. On 900b562 every test fails for the
reason its defect describes (the docstrings say what it did there); none of them may hang there: step loops are
bounded, and the one wait that cannot be bounded by steps (``generate`` spinning inside a core of its own) runs
under a SIGALRM deadline.
"""

from __future__ import annotations

import contextlib
import signal
import time

import pytest
import torch
from kvboost_testkit.pools import BLOCK, block_bytes, one_thread, pool_engine  # noqa: F401 - one_thread: autouse
from kvboost_testkit.tiny import make_engine, random_ids

from kvboost.engine import SamplingParams

TOL = 1e-4  # fp32: reuse equals a cold prefill within this (max abs logit difference)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def held_blocks(pool) -> dict[int, int]:
    return {b: pool.refcount(b) for b in range(pool.num_blocks) if pool.refcount(b)}


def assert_no_leak(engine, what: str) -> None:
    """With no request running, after ``reset_cache`` every block's reference count is 0 and none is in use."""
    assert not engine.core.has_work(), f"{what}: requests still queued or running"
    engine.reset_cache()
    pool = engine.pool
    held = held_blocks(pool)
    assert not held and pool.num_used == 0, (
        f"{what}: after reset_cache with nothing running, blocks are still referenced (block: refcount) {held}, "
        f"pool.num_used={pool.num_used}: they are lost for good"
    )
    pool.verify()


def drain(engine, limit: int, what: str) -> int:
    """Step until no work is left, at most ``limit`` steps; returns the steps taken."""
    steps = 0
    while engine.core.has_work():
        assert steps < limit, f"{what}: still work after {limit} steps ({engine.core.stats()})"
        engine.step()
        steps += 1
    return steps


@contextlib.contextmanager
def deadline(seconds: float, what: str):
    """Raise AssertionError(what) in the main thread if the block runs longer than ``seconds`` (a call that spins
    without running any step we could count); an outer alarm (pytest-timeout's) is suspended meanwhile."""

    def expired(signum, frame):
        raise AssertionError(f"{what} (still running after {seconds:.0f} s)")

    outer = signal.getitimer(signal.ITIMER_REAL)[0]  # pytest-timeout's alarm, if any: put back afterwards
    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL, max(0.01, outer - (time.monotonic() - started)))


def count_forward_tokens(engine, monkeypatch) -> list[int]:
    """Wrap ``engine.runner.run``: the returned one-item list counts the token rows of every forward."""
    counter = [0]
    real = engine.runner.run

    def run(batch, *args, **kwargs):
        counter[0] += int(batch.input_ids.numel())
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "run", run)
    return counter


# ---------------------------------------------------------------------------------------------------------- D1
@pytest.mark.timeout(120)
def test_d1_pinning_a_cached_prefix_keeps_its_kv():
    """D1: ``warm(pin=True)`` on an already cached prefix must keep that prefix's KV.

    Scenario: warm a 48-token document, warm it again with ``pin=True``, serve six other requests (their blocks come
    from the pool's free list), then ask a question over the document: reuse's first-token logits must equal a cold
    prefill's (fp32, 1e-4), the books must hold, and nothing leaks.

    900b562: the pin put the same entry back into the store; ``KVStore.put`` removed the old key first, releasing the
    payload's block references (ref count 1 -> 0 while the entry stayed pinned), so the other requests got those
    blocks and the question's exact hit read their KV: first-token logits off by ~0.22 (greedy tokens differ too).
    """
    engine = pool_engine(64)
    doc = random_ids(48, seed=101)
    engine.warm(doc, chat=False)
    engine.warm(doc, chat=False, pin=True)
    for seed in range(6):
        engine.generate(random_ids(40, seed=200 + seed), 4)
    question = doc + random_ids(10, seed=300)
    hit = engine.generate(question, 4)
    cold = engine.generate(question, 4, mode="cold")
    assert hit.cached_tokens == 48, f"the pinned document should be reused, cached_tokens={hit.cached_tokens}"
    diff = max_diff(hit.first_token_logits, cold.first_token_logits)
    assert diff <= TOL, (
        f"D1: after warm(pin=True) of a cached prefix and six other requests, reusing the pinned prefix gives "
        f"first-token logits {diff:.4g} away from a cold prefill (greedy {hit.output_ids} vs {cold.output_ids}): "
        "the pinned entry's blocks were freed and reused by other sequences"
    )
    assert hit.output_ids == cold.output_ids
    engine.pool.verify()
    assert_no_leak(engine, "D1")
    engine.close()


# ---------------------------------------------------------------------------------------------------------- D2
@pytest.mark.timeout(120)
def test_d2_assembly_that_runs_out_of_blocks_leaks_nothing():
    """D2: assembling a request whose cached prefix must be loaded into fresh blocks (KIVI payloads here; the same
    holds for disk/Redis hits) never loses blocks, even when the pool is short.

    Scenario: ``quant=kivi8`` (cached chunks are quantized copies, loaded into fresh blocks at assembly), a pool of 10
    blocks. A 64-token prefix is warmed; request Q (100 tokens, 20 new) runs and holds 7 blocks; then request R
    (the prefix + 17 tokens, 2 new) arrives. R must wait for blocks or run, every request must end normally, and
    after ``reset_cache`` no block may stay referenced.

    900b562: R's admission counted its 4 cached blocks as free of cost; ``assemble_exact`` allocated them one by one
    into a local list, the 4th ``alloc`` raised ``PoolExhausted`` out of ``engine.step()``, and the 3 blocks already
    allocated had no owner: refcount 1 each after every request ended and the cache was cleared.
    """
    engine = pool_engine(10, quant="kivi8")
    engine.eos_ids = set()
    prefix = random_ids(64, seed=40)
    engine.warm(prefix, chat=False)
    q = engine.add_request(random_ids(100, seed=41), SamplingParams(max_tokens=20))
    engine.step()
    r = engine.add_request(prefix + random_ids(17, seed=42), SamplingParams(max_tokens=2))
    errors: list[BaseException] = []
    for _ in range(300):
        if not engine.core.has_work():
            break
        try:
            engine.step()
        except Exception as exc:  # 900b562: PoolExhausted out of assembly; end the requests, then count blocks
            errors.append(exc)
            q.cancel()
            r.cancel()
    else:
        pytest.fail(f"D2: requests still running after 300 steps ({engine.core.stats()})")
    done = [h.result(0) for h in (q, r)]
    # the leak first: it is what D2 is about (the exception is how 900b562 got there)
    engine.reset_cache()
    held = held_blocks(engine.pool)
    raised = f"; a step raised {errors[0]!r}" if errors else ""
    assert not held and engine.pool.num_used == 0, (
        f"D2: blocks lost after every holder released (block: refcount) {held}, num_used={engine.pool.num_used}"
        + raised
    )
    assert not errors, f"D2: a step raised {errors[0]!r}"
    assert [c.finish_reason for c in done] == ["length", "length"], [(c.finish_reason, c.error) for c in done]
    assert len(done[1].output_ids) == 2 and done[1].cached_tokens == 64
    engine.pool.verify()
    engine.close()


# ---------------------------------------------------------------------------------------------------------- D3
@pytest.mark.timeout(120)
def test_d3_a_hit_keeps_its_blocks_while_assembly_allocates(tmp_path):
    """D3: a cached entry a request's lookup found keeps its blocks while the same request's assembly allocates
    (the hit's reference is taken before anything allocates).

    Scenario: 48-token chunks, ``cache=[memory, disk]``, a 12-block pool. Chunk A is written to disk by one engine
    and loaded by a second one (so it must be copied into fresh blocks); a first request A+B stores chunk B in
    memory (3 blocks). A request Q (100 tokens) then runs on ``engine.core`` and holds 7 blocks, leaving 2 free;
    ``generate(A+B+x)`` must give the first-token logits of a cold prefill (fp32, 1e-4), and nothing leaks.

    900b562: admission saw 2 free blocks for the 1-block suffix; assembly's 3rd fresh block for chunk A asked the
    cache for room, ``free_pool_blocks`` evicted chunk B (the plan's next placement, held by no reference) and freed
    its blocks, and assembly then took references to freed blocks: ``RuntimeError: KV pool: incref of free block``
    (or, had the block been handed out again, another sequence's KV).
    """
    chunker = {"name": "fixed", "chunk_size": 48}
    cache = [{"name": "memory"}, {"name": "disk", "path": str(tmp_path), "capacity": "64MiB"}]
    a, b = random_ids(48, seed=50), random_ids(48, seed=51)
    writer = pool_engine(12, chunker=chunker, cache=cache)
    writer.warm(a, chat=False)
    writer.close()  # spills chunk A to disk

    engine = pool_engine(12, chunker=chunker, cache=cache)
    engine.eos_ids = set()
    first = engine.generate(a + b, 1)  # A from disk, B computed and stored
    assert first.cached_tokens == 48
    q = engine.add_request(random_ids(100, seed=52), SamplingParams(max_tokens=8))
    engine.step()
    prompt = a + b + random_ids(1, seed=53)
    try:
        with deadline(60, "D3: generate() did not return"):
            hit = engine.generate(prompt, 1)
    except RuntimeError as exc:
        pytest.fail(f"D3: generate() over a disk-loaded chunk followed by a memory chunk raised {exc!r}: the memory "
                    "chunk's entry was evicted (its blocks freed) by the assembly's own allocation before the "
                    "request took its reference")  # fmt: skip
    drain(engine, 100, "D3")
    assert q.result(0).finish_reason == "length"
    cold = engine.generate(prompt, 1, mode="cold")
    diff = max_diff(hit.first_token_logits, cold.first_token_logits)
    assert diff <= TOL, f"D3: reuse's first-token logits are {diff:.4g} away from a cold prefill"
    engine.pool.verify()
    assert_no_leak(engine, "D3")
    engine.close()


# ---------------------------------------------------------------------------------------------------------- D4
@pytest.mark.timeout(120)
def test_d4a_a_request_that_cannot_be_admitted_fails_with_a_pool_error():
    """D4 (pinned blocks): a request that can never be admitted ends, within a bounded number of steps, with an
    error that names the KV pool, instead of waiting forever.

    Scenario: an 8-block pool, 80 pinned tokens (5 blocks no one may evict), nothing running; a 60-token request
    with 4 new tokens needs 5 blocks (it passes the submit-time size check: the pool has 8).

    900b562: the request stayed in the waiting queue for ever: after 50 steps it had not started nor failed
    (``num_waiting`` 1, nothing running); ``generate()`` of the same prompt would spin for ever.
    """
    engine = pool_engine(8)
    engine.warm(random_ids(80, seed=7), chat=False, pin=True)
    prompt = random_ids(60, seed=8)
    try:
        handle = engine.add_request(prompt, SamplingParams(max_tokens=4))
        for _ in range(50):
            if handle.done or not engine.core.has_work():
                break
            engine.step()
    except Exception as exc:  # refused at once is as good as failed by a step, if the message names the pool
        assert "pool" in str(exc).lower(), f"D4: refused with an error that does not name the KV pool: {exc!r}"
    else:
        assert handle.done, (
            f"D4: a request that cannot fit beside 5 pinned blocks of an 8-block pool neither started nor failed in "
            f"50 steps ({engine.core.stats()}): it waits for ever"
        )
        done = handle.result(0)
        assert done.finish_reason == "error" and "pool" in (done.error or "").lower(), (
            f"D4: expected an error naming the KV pool, got {done.finish_reason!r}: {done.error!r}"
        )
    assert not engine.core.has_work()
    engine.pool.verify()
    assert_no_leak(engine, "D4")
    engine.close()


@pytest.mark.timeout(120)
def test_d4b_generate_is_served_by_the_core_that_holds_the_other_requests():
    """D4 (blocks held by another core): ``generate()`` while ``engine.core`` runs a request that holds most of the
    pool completes once that request has finished (one core serves both), within 30 s.

    Scenario: a 12-block pool; Q (100 tokens, 8 new) runs on ``engine.core`` and holds 7 blocks; ``generate`` of a
    70-token prompt (4 new) needs 6 blocks, which exist once Q ends. Its tokens must be a cold run's, Q must end
    normally, nothing leaks.

    900b562: ``generate`` built a scheduler core of its own that could not see Q's blocks nor step Q: it spun
    without ever admitting its request (stopped here by the 30 s deadline).
    """
    engine = pool_engine(12)
    engine.eos_ids = set()
    prompt = random_ids(70, seed=9)
    alone = engine.generate(prompt, 4, mode="cold").output_ids
    engine.reset_cache()
    q = engine.add_request(random_ids(100, seed=10), SamplingParams(max_tokens=8))
    engine.step()
    with deadline(30, "D4: generate() never admitted its request while engine.core held the pool's blocks"):
        result = engine.generate(prompt, 4)
    drain(engine, 100, "D4")
    assert q.result(0).finish_reason == "length"
    assert result.output_ids == alone
    assert_no_leak(engine, "D4")
    engine.close()


# ---------------------------------------------------------------------------------------------------------- D5
@pytest.mark.timeout(120)
def test_d5_an_interrupted_step_leaves_the_sequences_as_they_were(monkeypatch):
    """D5: an exception inside ``engine.step()`` (here KeyboardInterrupt, as a Ctrl-C in a notebook, raised by the
    forward of the 4th step) leaves every sequence as it was before the step: stepping on gives each request the
    greedy tokens it gives alone.

    900b562: ``ForwardBatch.build`` had advanced every row's ``table.length`` before the forward raised and nothing
    rolled it back, so the next steps attended a row never written and decoded at shifted positions: all three
    requests' tokens part from their single runs right after the interrupted step.
    """
    engine = pool_engine(64)
    engine.eos_ids = set()
    prompts = [random_ids(40, seed=11), random_ids(57, seed=12), random_ids(33, seed=13)]
    alone = [engine.generate(p, 12, mode="cold").output_ids for p in prompts]
    engine.reset_cache()
    handles = [engine.add_request(p, SamplingParams(max_tokens=12)) for p in prompts]
    for _ in range(3):
        engine.step()
    real = engine.runner.run
    armed = [True]

    def run(batch, *args, **kwargs):
        if armed[0]:
            armed[0] = False
            raise KeyboardInterrupt
        return real(batch, *args, **kwargs)

    monkeypatch.setattr(engine.runner, "run", run)
    try:
        engine.step()
    except KeyboardInterrupt:
        pass
    assert not armed[0], "the injected interrupt did not fire"
    drain(engine, 200, "D5")
    outputs = [h.result(0).output_ids for h in handles]
    assert [h.result(0).finish_reason for h in handles] == ["length"] * 3
    assert outputs == alone, (
        "D5: after a step interrupted inside its forward, the requests' tokens differ from their single runs:\n"
        + "\n".join(f"  got {o}\n  not {a}" for o, a in zip(outputs, alone, strict=True) if o != a)
    )
    assert_no_leak(engine, "D5")
    engine.close()


# ---------------------------------------------------------------------------------------------------------- D6
@pytest.mark.timeout(120)
def test_d6_a_cold_request_is_not_starved_by_cached_prefix_arrivals():
    """D6: a request with nothing cached starts within a bounded number of steps even while requests whose prefix
    is cached keep arriving (longest-prefix-first needs aging).

    Scenario: ``max_running=1``; a 32-token prefix is warmed; a cold 20-token request (1 new token) is queued; then
    for 1,000 steps one request (the cached prefix + 3 tokens, 1 new token) arrives per step. The cold request must
    have run within those 1,000 steps.

    900b562: every step's newest cached-prefix arrival sorted ahead of it: after 1,000 steps it had not started.
    """
    engine = make_engine("llama", decode="eager")
    engine.core.scheduler.max_running = 1
    prefix = random_ids(32, seed=5)
    engine.warm(prefix, chat=False)
    cold = engine.add_request(random_ids(20, seed=6), SamplingParams(max_tokens=1))
    started_at = None
    for step in range(1000):
        engine.add_request(prefix + random_ids(3, seed=1000 + step), SamplingParams(max_tokens=1))
        engine.step()
        if cold.done:
            started_at = step
            break
    assert started_at is not None, (
        "D6: a cold request waited 1,000 steps behind one cached-prefix arrival per step and never started"
    )
    assert cold.result(0).finish_reason == "length"
    drain(engine, 2000, "D6")
    engine.close()


# ---------------------------------------------------------------------------------------------------------- D7
@pytest.mark.timeout(120)
def test_d7_pool_pressure_evicts_only_entries_whose_blocks_it_gets_back():
    """D7: when admission needs blocks, the cache gives back entries whose blocks it can free; it neither drops
    entries whose blocks running requests hold (that frees nothing) nor the waiting request's own prefix.

    Scenario: a 12-block pool. A 48-token prefix P is warmed and request R1 (P + 20 tokens) runs, sharing P's blocks;
    a 32-token prefix W is warmed; request W+76 tokens arrives: it needs more blocks than are free. It must reuse
    its whole 32-token prefix, its tokens must be a cold run's, and the step that handles it must not drop P's
    entries (R1 holds their blocks).

    900b562: ``free_pool_blocks`` evicted in LRU order without looking at the blocks: P's three entries (held by
    R1: nothing freed), then W's chunks; the store went from 5 entries to 1 in that step and the request
    reused 16 of its 32 cached tokens.
    """
    engine = pool_engine(12)
    engine.eos_ids = set()
    p = random_ids(48, seed=60)
    engine.warm(p, chat=False)
    r1 = engine.add_request(p + random_ids(20, seed=61), SamplingParams(max_tokens=8))
    engine.step()
    w = random_ids(32, seed=62)
    engine.warm(w, chat=False)
    before = len(engine.store)
    prompt = w + random_ids(76, seed=63)
    handle = engine.add_request(prompt, SamplingParams(max_tokens=4))
    engine.step()
    after = len(engine.store)
    drain(engine, 200, "D7")
    done = handle.result(0)
    assert done.finish_reason == "length" and r1.result(0).finish_reason == "length"
    assert done.cached_tokens == 32, (
        f"D7: the waiting request reused {done.cached_tokens} of its 32 cached prefix tokens: pool pressure evicted "
        f"its own prefix (the store went from {before} to {after} entries in that step, though the running request "
        "held most of their blocks)"
    )
    assert after >= before, f"D7: the admission step evicted entries whose blocks were in use ({before} -> {after})"
    assert done.output_ids == engine.generate(prompt, 4, mode="cold").output_ids
    assert_no_leak(engine, "D7")
    engine.close()


# ---------------------------------------------------------------------------------------------------------- D8
SEP = "\n\n"
SYSTEM = "System: answer from the notes."
DOCS = ["Alpha: the red fox lives in the northern forest.", "Beta: copper wires carry current, resistance grows."]
RAG_PROMPT = SEP.join([SYSTEM, DOCS[1], DOCS[0], "Question: where does the fox live?"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["plain", "content_hit"])
def test_d8_a_preempted_request_resumes_from_its_computed_kv(case, monkeypatch):
    """D8: a preempted request's resumption recomputes fewer tokens than a full recompute (its computed KV stays
    cached); a request with content hits keeps its hits too.

    Scenario ``plain``: a 17-block pool and two cold 100-token requests with 60 new tokens each: their growth
    preempts the newer one. ``content_hit``: separator chunker, a pinned system prefix and two pinned documents; a
    cold 100-token request (100 new) and then a 169-token prompt made of the system prefix (exact hit), the two
    documents in another order (content hits) and a question (60 new) in a 27-block pool: the newer one is
    preempted.
    Tokens computed by every forward (``runner.run``) are counted; beyond what the requests compute unpreempted,
    the extra must be less than one full recompute of each preempted request's prompt.

    900b562: preemption released the blocks without storing anything, so a resumption recomputed the prompt and
    every token so far (``plain``: 128 extra tokens for one 100-token prompt; ``content_hit``: the resumed request
    was planned cold, dropping its exact and content hits: 192 extra tokens for its 169-token prompt).
    """
    if case == "plain":
        engine = pool_engine(17)
        engine.eos_ids = set()
        prompts, new = [random_ids(100, seed=70), random_ids(100, seed=71)], [60, 60]
        alone = [engine.generate(p, n, mode="cold").output_ids for p, n in zip(prompts, new, strict=True)]
        engine.reset_cache()
        unpreempted = sum(len(p) + n - 1 for p, n in zip(prompts, new, strict=True))  # cold prompt + fed tokens
    else:
        def rag_engine():
            engine = pool_engine(27, chat=False, recompute="none",
                                 chunker={"name": "separator", "separator": SEP, "chunk_size": 16})  # fmt: skip
            engine.eos_ids = set()
            engine.warm(SYSTEM + SEP, chat=False, pin=True)
            for doc in DOCS:
                engine.warm(doc, chat=False, pin=True)
            return engine

        engine = rag_engine()
        counted = count_forward_tokens(engine, monkeypatch)
        alone_rag = engine.generate(RAG_PROMPT, 60)
        assert alone_rag.content_hit_tokens > 0 and alone_rag.cached_tokens > alone_rag.content_hit_tokens
        rag_tokens = counted[0]
        engine.close()
        engine = rag_engine()
        prompts, new = [random_ids(100, seed=80), RAG_PROMPT], [100, 60]
        alone = None
        unpreempted = (100 + 100 - 1) + rag_tokens
    counted = count_forward_tokens(engine, monkeypatch)
    first = engine.add_request(prompts[0], SamplingParams(max_tokens=new[0]))
    engine.step()  # the first request is admitted first (preemption takes the newest)
    second = engine.add_request(prompts[1], SamplingParams(max_tokens=new[1]))
    handles = [first, second]
    drain(engine, 2000, "D8")
    done = [h.result(0) for h in handles]
    assert all(c.finish_reason == "length" for c in done), [(c.finish_reason, c.error) for c in done]
    preempted = [c for c in done if c.preemptions]
    assert preempted, "the scenario must preempt a request (no preemption happened)"
    if alone is not None:
        assert [c.output_ids for c in done] == alone
    extra = counted[0] - unpreempted
    full = sum(c.prompt_tokens for c in preempted)
    assert extra < full, (
        f"D8 ({case}): preemption cost {extra} recomputed tokens, at least a full recompute of the preempted "
        f"requests' prompts ({full} tokens; preemptions {[c.preemptions for c in done]}): the computed KV was "
        "dropped instead of kept as cached blocks"
    )
    assert_no_leak(engine, "D8")
    engine.close()


# ---------------------------------------------------------------------------------------------------------- D9
D9_DOCS = [
    "Alpha document: the red fox lives in the northern forest and eats berries in the summer.",
    "Beta document: copper wires carry current; resistance grows with length and temperature.",
]
D9_PROMPT = SEP.join(["System: answer from the documents.", D9_DOCS[1], D9_DOCS[0],
                      "Question: where does the fox live and what does it eat?", "Answer:"])  # fmt: skip


@pytest.mark.timeout(120)
def test_d9a_approximate_kv_of_one_recompute_strategy_is_not_served_to_another(tmp_path):
    """D9 (recompute strategy in the keys): when arms of a sweep share one disk tier path, an arm's answer does not
    depend on which strategy or ratio ran before it: approximate (content-hit, repaired) KV is served only to the
    strategy and ratio that computed it; exact KV is shared.

    Scenario: separator chunker, 4 layers, ``cache=[memory, disk(path)]``. On each of three paths a first arm
    (cacheblend ratio 0.05, cacheblend ratio 0.15, recompute ``none``) warms two documents and answers a prompt
    holding them in another order (its repaired chunks are stored), then closes; then an arm with cacheblend ratio
    0.5 does the same on that path. The three ratio-0.5 arms must give the same first-token logits (fp32, 1e-4):
    each may reuse the exact chunks the first arm stored (the same 36-token prefix on every path: none of these
    first arms recomputes a whole chunk), never its repaired ones.

    900b562: the keys left the strategy out, so each ratio-0.5 arm took the first arm's repaired chunks as content
    hits (221 content-hit tokens on every path) and answered with that arm's approximation: first-token logits
    up to ~0.007 apart (0.0016 between the ratio-0.05 and ratio-0.15 paths).
    """

    def arm(path, recompute):
        cache = [{"name": "memory"}, {"name": "disk", "path": str(path), "capacity": "64MiB"}]
        engine = make_engine("llama", layers=4, decode="eager", chat=False, recompute=recompute, cache=cache,
                             chunker={"name": "separator", "separator": SEP, "chunk_size": 16})  # fmt: skip
        for doc in D9_DOCS:
            engine.warm(doc, chat=False)
        result = engine.generate(D9_PROMPT, 4)
        engine.close()
        return result

    firsts = {"cacheblend 0.05": {"name": "cacheblend", "ratio": 0.05},
              "cacheblend 0.15": {"name": "cacheblend", "ratio": 0.15}, "none": "none"}  # fmt: skip
    after = {}
    for i, (name, recompute) in enumerate(firsts.items()):
        assert arm(tmp_path / str(i), recompute).content_hit_tokens > 0
        after[name] = arm(tmp_path / str(i), {"name": "cacheblend", "ratio": 0.5})
    exact = {name: r.exact_hit_tokens for name, r in after.items()}
    assert len(set(exact.values())) == 1, f"the scenario needs the same exact chunks on every path, got {exact}"
    reference = after["cacheblend 0.05"]
    diffs = {name: max_diff(r.first_token_logits, reference.first_token_logits) for name, r in after.items()}
    assert max(diffs.values()) <= TOL, (
        f"D9: the ratio-0.5 arm's first-token logits depend on which arm used the disk path before it (max abs "
        f"difference to the path of 'cacheblend 0.05': {diffs}; content-hit tokens "
        f"{ {name: r.content_hit_tokens for name, r in after.items()} }): it was served another strategy's repaired KV"
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("option, value", [("attn", "triton"), ("attn", "cpu_kernel"), ("decode", "compiled")])
def test_d9b_the_fingerprint_keys_the_attention_backend_and_the_decode_path(option, value):
    """D9 (fingerprint): the attention backend (``cpu_kernel`` and ``triton`` give other K/V bits than ``sdpa``) and
    the decode path (``compiled`` against ``eager``) are part of the engine fingerprint, so a shared tier never
    serves one's KV to the other. Two engines with the same options have the same fingerprint.

    900b562: the fingerprint held model, dtype, weights, KV quantizer, chunker and hasher (plus a tag only for
    ``batch_invariant`` and prepacked weights): the same string for all four configurations.
    """
    if value == "cpu_kernel":
        import shutil

        if shutil.which("g++") is None and shutil.which("c++") is None:
            pytest.skip("the cpu_kernel backend needs a C++ compiler")
    base_options = {"attn": "sdpa", "decode": "eager"}
    reference = make_engine("llama", **base_options)
    twin = make_engine("llama", **base_options)
    other = make_engine("llama", **{**base_options, option: value})
    try:
        assert reference.fingerprint == twin.fingerprint
        assert other.fingerprint != reference.fingerprint, (
            f"D9: {option}={value} and {option}={base_options[option]} have the same fingerprint "
            f"{reference.fingerprint!r}: cached KV of one is served to the other"
        )
    finally:
        for engine in (reference, twin, other):
            engine.close()
