"""The engine state machine, threaded: an :class:`~kvboost.engine.EngineLoop` steps the core on its own thread while
the machine's rules act from other threads at once (issue 61).

Each example starts a tiny-llama engine (the prompt-sensitive model of ``kvboost_testkit.engine_checks``, a pool of
``NUM_BLOCKS`` 8-token blocks, so running requests get preempted) over a disk tier, or a Redis tier when
``redis-server`` is here (then the loop also refreshes the shared tier every 20 ms, under the step lock), and an
``EngineLoop`` driving it. A ``burst`` rule starts 2-5 threads behind one barrier, each doing one of: submit (plain,
``n`` samples, with ``score_ids``), cancel one of the requests submitted so far, ``loop.warm`` (pinned or not),
``engine.unpin``, ``engine.reset_cache``, ``loop.stats`` + ``engine.cache_stats``, or arm a forward that raises once
(on the loop thread, whichever forward comes next); ``close`` closes the engine from another thread with requests
in flight (they end with "shutdown") and starts a new engine and loop on the same lower tier; ``drain`` waits for
every request.

After every rule, between two steps of the loop (``core.exclusive()``): the pool's and the store's books, each
block's references equal its holders (running tables and pins), waiting requests hold none, every entry of every
tier holds a fresh prefill's K/V (fp32, 1e-4); every request that ended normally has HF's greedy tokens for its prompt
alone (a near tie excepted) and its score rows HF's teacher-forced log-probabilities; only the lone request of a
failing forward may fail, and the requests sharing a failing forward finish. After ``drain``: nothing leaks (only pins
hold blocks).

Draws never depend on timing (which request finished first), so an example replays the same rules; the
interleavings differ from run to run, which is the point. ``THREAD_STEPS`` counted rule steps
(``KVBOOST_THREAD_STATEFUL_STEPS``; CI default 600); ``KVBOOST_STATEFUL_EXPLORE=1`` draws new sequences.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
import uuid

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kvboost_testkit import engine_checks as checks
from kvboost_testkit.tiny import ToyTokenizer, random_ids

from kvboost import KVBoost
from kvboost.engine import EngineLoop, QueueFull, SamplingParams

BLOCK = 8
NUM_BLOCKS = 16  # four running requests of the longer prompts need ~24: the scheduler preempts
THREAD_STEPS = int(os.environ.get("KVBOOST_THREAD_STATEFUL_STEPS", "600"))
STEPS_PER_EXAMPLE = 20
#: sizes ``max_examples`` (ceil(THREAD_STEPS * 1.15 / this)): 44 examples gave 631 counted steps
MEAN_STEPS_PER_EXAMPLE = 15
EXPLORE = os.environ.get("KVBOOST_STATEFUL_EXPLORE", "") not in ("", "0")
WAIT_S = 120.0  # a request, a warm or a thread that takes longer (on a loaded 2-core machine) is a hang

BASES = [random_ids(n, seed=500 + i) for i, n in enumerate((12, 21, 30, 40))]
TAILS = [random_ids(n, seed=600 + n) for n in (0, 3, 9, 17)]
SCORES = [random_ids(n, seed=700 + n) for n in (1, 5, 11)]
KINDS = ["submit", "submit", "submit_n", "score", "cancel", "warm", "unpin", "reset", "stats", "fault"]
REDIS: dict[str, str] = {}
COUNTS: dict[str, int] = {}


def _reset_counts() -> None:
    COUNTS.clear()
    COUNTS.update(steps=0, examples=0, threads=0, finished=0, cancelled=0, shutdown=0, failed_alone=0,
                  survivors=0, scored=0, preempted=0, cached=0, resets=0, closes=0, faults=0,
                  lower_redis=0)  # fmt: skip


_reset_counts()


class ThreadedMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.engine: KVBoost | None = None
        self.loop: EngineLoop | None = None
        self.handles: list = []  # every handle submitted (cancel picks among them by index: timing-free draws)
        self.live: list = []
        self.info: dict[int, dict] = {}
        self.errors_allowed: set[int] = set()
        self.must_survive: set[int] = set()
        self.entries = checks.EntryChecker()
        self.fault_lock = threading.Lock()
        self.closes = 0
        self.log: list[str] = []  # this example's rules, for a failure's message (shrinking is off: see the test)
        COUNTS["examples"] += 1

    @initialize(redis=st.booleans())
    def build(self, redis: bool) -> None:
        self.lower = "redis" if redis and REDIS else "disk"
        self.namespace = f"th{uuid.uuid4().hex[:10]}"
        COUNTS["lower_redis"] += self.lower == "redis"
        self._start()

    def _start(self) -> None:
        pool_bytes = NUM_BLOCKS * checks.block_bytes(BLOCK)
        lower = ({"name": "redis", "url": REDIS.get("url"), "namespace": self.namespace, "capacity": "64MiB"}
                 if self.lower == "redis" else
                 {"name": "disk", "path": self.tmp.name, "capacity": "64MiB", "fsync": False})  # fmt: skip
        self.engine = KVBoost(checks.model(), ToyTokenizer(), model_identity="tiny-thread-machine", decode="eager",
                              chat=False, chunker={"name": "fixed", "chunk_size": BLOCK},
                              kv={"block_size": BLOCK, "pool_bytes": pool_bytes},
                              cache=[{"name": "memory", "capacity": pool_bytes}, lower])  # fmt: skip
        self.engine.eos_ids = set()
        self.loop = EngineLoop(self.engine, max_running=4, request_timeout_s=0,
                               refresh_shared_s=0.02 if self.lower == "redis" else None).start()  # fmt: skip

    def teardown(self) -> None:
        try:
            if self.loop is not None:
                self.loop.shutdown(WAIT_S)
            if self.engine is not None:
                self.engine.close()
                self._collect()
        finally:
            self.tmp.cleanup()

    # ------------------------------------------------------------------ outputs
    def _add(self, handle, ids: list[int], max_tokens: int, score: list[int] | None = None) -> None:
        self.handles.append(handle)
        self.live.append(handle)
        self.info[id(handle)] = {"ids": ids, "max_tokens": max_tokens, "score": score}

    def _collect(self) -> None:
        with self.fault_lock:  # (the loop thread reads ``live`` when an armed fault fires)
            done = [h for h in self.live if h.done]
            for handle in done:
                self.live.remove(handle)
        for handle in done:
            self._check_output(handle)

    def _check_output(self, handle) -> None:
        completion = handle.result(0)
        info = self.info.pop(id(handle))
        survivor = id(handle) in self.must_survive
        reason = completion.finish_reason
        if reason not in ("stop", "length"):
            allowed = reason in ("cancelled", "shutdown") or id(handle) in self.errors_allowed
            assert allowed, f"request {handle.request_id} ended {reason}: {completion.error}"
            key = {"cancelled": "cancelled", "shutdown": "shutdown"}.get(reason, "failed_alone")
            COUNTS[key] += 1
            return
        COUNTS["finished"] += 1
        COUNTS["survivors"] += survivor
        COUNTS["preempted"] += completion.preemptions > 0
        COUNTS["cached"] += completion.cached_tokens > 0
        what = f"request {handle.request_id} (threaded)"
        checks.check_greedy(info["ids"], completion.output_ids, info["max_tokens"], what)
        if info["score"] is not None:
            checks.check_score(info["ids"], info["score"], [lp.logprob for lp in completion.score_logprobs or ()], what)
            COUNTS["scored"] += 1

    # ------------------------------------------------------------------ the actions (each on its own thread)
    def _act(self, kind: str, a: int, b: int) -> None:
        ids = BASES[a % 4] + TAILS[(a // 4) % 4]
        loop, engine = self.loop, self.engine
        try:
            if kind in ("submit", "submit_n", "score"):
                score = SCORES[b % 3] if kind == "score" else None
                params = SamplingParams(max_tokens=b, n=2 if kind == "submit_n" else 1,
                                        logprobs=0 if score else None)  # fmt: skip
                handle = loop.submit(ids, params, score_ids=score)
                with self.fault_lock:
                    for sample in handle.samples:
                        self._add(sample, ids, b, score)
            elif kind == "cancel":
                with self.fault_lock:  # one of the last three submitted (older ones have finished, most likely)
                    target = self.handles[-1 - a % min(3, len(self.handles))] if self.handles else None
                if target is not None:
                    target.cancel()
            elif kind == "warm":
                pin = b % 2 == 0 and a % 4 < 2  # pins only on the two short bases (5 blocks): requests must still fit
                try:
                    loop.warm(BASES[a % 4], pin=pin, chat=False, timeout=WAIT_S)
                except RuntimeError as exc:  # the lone row of a forward armed to fail: a warm fails alone
                    assert "injected" in str(exc), exc
            elif kind == "unpin":
                engine.unpin(BASES[a % 4], chat=False)
            elif kind == "reset":
                engine.reset_cache()
                COUNTS["resets"] += 1
            elif kind == "stats":
                assert loop.stats()["running"]
                engine.cache_stats()
            elif kind == "fault":
                self._arm_fault()
        except QueueFull:
            pass

    def _arm_fault(self) -> None:
        """The next full forward (on the loop thread) raises once; whose rows it held decides who may fail."""
        runner = self.engine.runner
        layers = self.engine.layers
        state = {"fired": False}
        real = type(runner).run.__get__(runner)

        def run(batch):
            if not state["fired"] and getattr(batch, "num_layers", None) in (None, layers):
                state["fired"] = True
                del runner.run  # (this thread: the loop's) back to the real forward
                with self.fault_lock:
                    owners = {id(h._request.table): h for h in self.live}
                handles = [owners[id(t)] for t in batch.tables if id(t) in owners]
                if len(batch.tables) == 1:
                    for handle in handles:
                        self.errors_allowed.add(id(handle))
                        self.errors_allowed |= {id(c.handle) for c in handle._request.forks}
                else:
                    self.must_survive |= {id(h) for h in handles}
                COUNTS["faults"] += 1
                raise RuntimeError("injected: one failing forward (threaded)")
            return real(batch)

        if "run" not in vars(runner):
            runner.run = run

    # ------------------------------------------------------------------ rules
    @rule(actions=st.lists(st.tuples(st.sampled_from(KINDS), st.integers(0, 15), st.integers(1, 12)), min_size=2,
                           max_size=5))  # fmt: skip
    def burst(self, actions: list[tuple[str, int, int]]) -> None:
        """2-5 threads behind one barrier, each one action, while the loop steps."""
        COUNTS["steps"] += 1
        self.log.append(f"burst({actions})")
        barrier = threading.Barrier(len(actions))
        errors: list[BaseException] = []

        def worker(action):
            try:
                barrier.wait(WAIT_S)
                self._act(*action)
            except BaseException as exc:  # noqa: BLE001 - reported on the machine's thread
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(action,)) for action in actions]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_S)
            assert not thread.is_alive(), "an action thread hung"
        COUNTS["threads"] += len(threads)
        if errors:
            raise errors[0]
        self._collect()

    @rule(ms=st.integers(0, 30))
    def pause(self, ms: int) -> None:
        """Let the loop step a while."""
        COUNTS["steps"] += 1
        self.log.append(f"pause({ms})")
        time.sleep(ms / 1000)
        self._collect()

    @rule()
    def drain(self) -> None:
        """Wait for every request; then nothing runs and only pins hold blocks."""
        COUNTS["steps"] += 1
        self.log.append("drain()")
        for handle in list(self.live):
            handle.wait(WAIT_S)
            assert handle.done, f"request {handle.request_id} never finished"
        self._collect()
        deadline = time.monotonic() + WAIT_S
        while True:
            with self.engine.core.exclusive():
                if not self.engine.core.has_work():
                    checks.check_quiet(self.engine)
                    return
            assert time.monotonic() < deadline, "the loop never went quiet"
            time.sleep(0.005)

    @rule()
    def close(self) -> None:
        """Close the engine from another thread with requests in flight (they end with "shutdown" or finish), then
        a new engine and loop on the same lower tier (at most twice an example)."""
        COUNTS["steps"] += 1
        self.log.append("close()")
        if self.closes >= 2:
            return
        closer = threading.Thread(target=self.engine.close)
        closer.start()
        closer.join(WAIT_S)
        assert not closer.is_alive(), "close hung"
        self.loop.shutdown(WAIT_S)
        for handle in list(self.live):
            handle.wait(WAIT_S)
        self._collect()
        assert not self.live, "requests still live after close"
        self.closes += 1
        COUNTS["closes"] += 1
        self._start()

    # ------------------------------------------------------------------ invariants (between two steps of the loop)
    @invariant()
    def books_between_steps(self) -> None:
        if self.engine is None:
            return
        core = self.engine.core
        try:
            with core.exclusive():
                checks.check_holders(self.engine, core.scheduler.running)
                for request in core.scheduler.waiting:
                    assert not request.table.blocks, f"waiting request {request} holds blocks"
                self.entries.check(self.engine)
            self._collect()
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.lower} tier; rules so far:\n  " + "\n  ".join(self.log)) from exc


@pytest.mark.slow  # ~10 s of CPU, more of wall time (the rules wait on the loop thread)
@pytest.mark.timeout(3600)
def test_engine_loop_under_concurrent_clients_keeps_its_invariants(redis_url):
    from hypothesis.stateful import run_state_machine_as_test

    REDIS.clear()
    if redis_url:
        REDIS["url"] = redis_url
    _reset_counts()
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_state_machine_as_test(ThreadedMachine, settings=settings(
            max_examples=math.ceil(THREAD_STEPS * 1.15 / MEAN_STEPS_PER_EXAMPLE) + 2,
            stateful_step_count=STEPS_PER_EXAMPLE, deadline=None, database=None, print_blob=True,
            derandomize=not EXPLORE, suppress_health_check=list(HealthCheck),
            phases=[Phase.explicit, Phase.reuse, Phase.generate],  # (shrinking would replay other interleavings)
        ))  # fmt: skip
    finally:
        torch.set_num_threads(torch_threads)
    print(f"\n{COUNTS['steps']} rule steps in {COUNTS['examples']} examples: {COUNTS}")
    assert COUNTS["steps"] >= THREAD_STEPS, f"only {COUNTS['steps']} rule steps"
    if THREAD_STEPS >= 200:
        for what in ("finished", "cancelled", "shutdown", "scored", "resets", "closes", "faults", "preempted"):
            assert COUNTS[what] > 0, f"the threaded machine never reached {what}: {COUNTS}"
