"""A stateful property test of the KV pool, the cache and the engine core together (issue 42).

Hypothesis drives one engine on a tiny fp32 llama (8-token blocks and chunks, a pool of a few dozen blocks, a disk
tier below the pool) through random sequences of: submit / submit ``n`` samples of one prompt (one prefill, then the
samples fork its block table: references on its blocks, the partial last one copied on write) / step / cancel (a
sample before or after its fork) / abort (``core.abort``) / warm (pinned or not) / unpin / evict
under pool pressure / a forward that raises once (its rows retried one request at a time: only a lone row may fail,
every other request must finish with its tokens alone) / one that keeps raising for one request (that request
fails, alone) / a KeyboardInterrupt inside a step's forward / one during admission (the request back in the queue,
then run to its tokens) / a forced preemption / a restart from the disk tier. After
every rule it checks:

- the pool's and the store's own books (``KVPool.verify``, ``KVStore.verify``);
- each block's reference count equals its holders: the block tables of the requests the core runs (forked samples
  included), and the pins; a sample not forked yet (its prompt still prefilling) holds none;
- no block is both free and referenced, and a cached block is never free (``verify``);
- every entry of the pool tier holds the K/V a fresh HF prefill of its whole chain computes (fp32, 1e-4);
- no request that fits the pool waits more than ``MAX_WAIT`` steps;
- at quiescence (no work), the only referenced blocks are pinned ones: nothing leaks;
- every request that finished normally produced the greedy tokens of the same prompt decoded alone by HF (or parted
  from them only at a near tie of HF's own logits).

``STEPS`` rule steps at least, counted (``KVBOOST_STATEFUL_STEPS`` to change; the CI default is 10,000),
derandomized so that CI is reproducible; ``KVBOOST_STATEFUL_EXPLORE=1`` draws new sequences at each run.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvboost_testkit.tiny import ToyTokenizer, random_ids, tiny_model

from kvboost import KVBoost
from kvboost.engine import SamplingParams

BLOCK = 8
NUM_BLOCKS = 40
MAX_WAIT = 80  # steps an admissible request may wait (aging is 8 steps; at most 4 run, each <= 8 tokens)
STEPS = int(os.environ.get("KVBOOST_STATEFUL_STEPS", "10000"))
STEPS_PER_EXAMPLE = 100
TOL = 1e-4
NEAR_TIE = 1e-3

#: Prompts share prefixes (bases) and differ in their tails, so hits, partial hits and copy on write all happen.
BASES = [random_ids(n, seed=500 + i) for i, n in enumerate((12, 21, 30, 40))]
TAILS = [random_ids(n, seed=600 + n) for n in (0, 3, 9, 17)]


def _block_bytes() -> int:
    return 2 * 2 * 2 * BLOCK * 16 * 4  # (K, V) x layers x kv heads x rows x head dim x fp32


_MODEL = None
_REFERENCE_KV: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
_REFERENCE_DECODE: dict[tuple[tuple[int, ...], int], tuple[list[int], list[torch.Tensor]]] = {}


def model():
    global _MODEL
    if _MODEL is None:
        _MODEL = tiny_model("llama", seed=0)
    return _MODEL


def reference_kv(tokens: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[layers, kv_heads, n, dim]`` of a fresh HF prefill of ``tokens`` (memoized)."""
    if tokens not in _REFERENCE_KV:
        with torch.inference_mode():
            out = model()(input_ids=torch.tensor([tokens]), use_cache=True)
        layers = out.past_key_values.layers
        _REFERENCE_KV[tokens] = (torch.stack([layer.keys[0] for layer in layers]),
                                 torch.stack([layer.values[0] for layer in layers]))  # fmt: skip
    return _REFERENCE_KV[tokens]


def reference_decode(ids: tuple[int, ...], max_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy tokens after ``ids`` (no EOS: the engines below have none) and the logits that chose each."""
    key = (ids, max_tokens)
    if key not in _REFERENCE_DECODE:
        tokens, logits = [], []
        with torch.inference_mode():
            seq = list(ids)
            for _ in range(max_tokens):
                row = model()(input_ids=torch.tensor([seq])).logits[0, -1]
                logits.append(row)
                tokens.append(int(row.argmax()))
                seq.append(tokens[-1])
        _REFERENCE_DECODE[key] = (tokens, logits)
    return _REFERENCE_DECODE[key]


class CoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = tempfile.TemporaryDirectory()
        self.engine = self._new_engine()
        self.live: list = []  # handles not finished
        self.done: list = []
        self.waited: dict[int, int] = {}  # id(request) -> steps it has waited
        self.failing: object | None = None  # a request whose forwards keep raising
        self.restarts = 0
        self.errors_allowed: set[int] = set()
        COUNTS["examples"] += 1

    def _new_engine(self) -> KVBoost:
        engine = KVBoost(model(), ToyTokenizer(), model_identity="tiny-state-machine", decode="eager", chat=False,
                         chunker={"name": "fixed", "chunk_size": BLOCK},
                         kv={"block_size": BLOCK, "pool_bytes": NUM_BLOCKS * _block_bytes()},
                         cache=[{"name": "memory", "capacity": 24 * _block_bytes()},
                                {"name": "disk", "path": self.tmp.name, "capacity": "64MiB", "fsync": False}],
                         core={"max_running": 4, "aging_steps": 8})  # fmt: skip
        engine.eos_ids = set()
        return engine

    def teardown(self) -> None:
        self.engine.close()
        self.tmp.cleanup()

    # ------------------------------------------------------------------ helpers
    def _step(self) -> None:
        self.engine.step()
        self._collect()

    def _collect(self) -> None:
        for handle in list(self.live):
            if handle.done:
                self.live.remove(handle)
                self.done.append(handle)
                self._check_output(handle)

    def _check_output(self, handle) -> None:
        completion = handle.result(0)
        if completion.finish_reason not in ("stop", "length"):
            assert completion.finish_reason in ("cancelled", "shutdown") or id(handle) in self.errors_allowed, (
                f"request {handle.request_id} ended {completion.finish_reason}: {completion.error}")  # fmt: skip
            return
        request = handle._request
        expected, logits = reference_decode(tuple(request.ids), request.max_new_tokens)
        got = completion.output_ids
        assert len(got) == len(expected), (got, expected)
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            if a != b:  # allowed only where HF's own two best logits are a near tie
                top = torch.topk(logits[i].float(), 2).values
                assert float(top[0] - top[1]) < NEAR_TIE, f"token {i}: {got} != alone {expected}"
                break

    def _ids(self, base: int, tail: int) -> list[int]:
        return BASES[base] + TAILS[tail]

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.live) < 8)
    @rule(base=st.integers(0, len(BASES) - 1), tail=st.integers(0, len(TAILS) - 1), max_tokens=st.integers(1, 6),
          salt=st.sampled_from(["", "tenant-b"]))
    def submit(self, base: int, tail: int, max_tokens: int, salt: str) -> None:
        handle = self.engine.add_request(self._ids(base, tail), SamplingParams(max_tokens=max_tokens), cache_salt=salt)
        self.live.append(handle)

    @precondition(lambda self: len(self.live) < 8)
    @rule(base=st.integers(0, len(BASES) - 1), tail=st.integers(0, len(TAILS) - 1), max_tokens=st.integers(1, 6),
          n=st.integers(2, 3))
    def submit_n(self, base: int, tail: int, max_tokens: int, n: int) -> None:
        """``n`` greedy samples of one prompt: each must produce the prompt's greedy tokens alone."""
        handle = self.engine.add_request(self._ids(base, tail), SamplingParams(max_tokens=max_tokens, n=n))
        assert len(handle.samples) == n and handle.samples[0] is handle
        self.live.extend(handle.samples)

    @rule(times=st.integers(1, 4))
    def step(self, times: int) -> None:
        for _ in range(times):
            self._step()

    @precondition(lambda self: bool(self.live))
    @rule(index=st.integers(0, 7))
    def cancel(self, index: int) -> None:
        self.live[index % len(self.live)].cancel()
        self._step()

    @rule(base=st.integers(0, len(BASES) - 1), pin=st.booleans())
    def warm(self, base: int, pin: bool) -> None:
        pinned = len(self.engine.store.pinned_keys())
        if pin and pinned * BLOCK > NUM_BLOCKS * BLOCK // 3:
            pin = False  # keep most of the pool unpinned: requests must still fit
        try:
            self.engine.warm(BASES[base], pin=pin, chat=False)
        except Exception as exc:  # the pool is full of running work and pins: refused with the pool's numbers
            assert "pool" in str(exc).lower(), exc
        self._collect()

    @rule(base=st.integers(0, len(BASES) - 1))
    def unpin(self, base: int) -> None:
        self.engine.unpin(BASES[base], chat=False)

    @rule(blocks=st.integers(1, NUM_BLOCKS))
    def evict(self, blocks: int) -> None:
        pool = self.engine.pool
        self.engine.store.reclaim(min(pool.num_blocks, pool.num_free + blocks))

    @precondition(lambda self: self.engine.core.has_work())
    @rule()
    def forward_raises_once(self) -> None:
        """The next forward raises once: it is rolled back and its rows run again one request at a time. Only a
        forward of one request's rows has no one to be retried beside: that request fails, alone; when the forward
        held several, every one of them must survive and finish with its tokens alone (``_check_output``)."""
        runner = self.engine.runner
        real = runner.run
        state: dict = {"tables": None}

        def run(batch):
            if state["tables"] is None:
                state["tables"] = list(batch.tables)
                raise RuntimeError("injected: one failing forward")
            return real(batch)

        runner.run = run
        unforked = {id(h): [c.handle for c in h._request.forks] for h in self.live}  # (a failure empties forks)
        try:
            self.engine.step()
        finally:
            del runner.run
        tables = state["tables"] or []
        if len(tables) == 1:  # the lone request (and its samples not forked yet) may fail
            for handle in self.live:
                if handle._request.table is tables[0]:
                    self.errors_allowed.add(id(handle))
                    self.errors_allowed |= {id(child) for child in unforked.get(id(handle), ())}
        self._collect()

    @precondition(lambda self: self.engine.core.num_waiting() > 0)
    @rule()
    def interrupted_admission(self) -> None:
        """A KeyboardInterrupt while a request is admitted (its assembly): it reaches the caller, and the request is
        back in the queue holding no block (``references_are_the_holders``), then runs to its tokens alone."""
        from kvboost.engine import core as core_module

        real = core_module.assemble_exact
        state = {"raised": False}

        def assemble(*args, **kwargs):
            if not state["raised"]:
                state["raised"] = True
                raise KeyboardInterrupt
            return real(*args, **kwargs)

        core_module.assemble_exact = assemble
        try:
            self.engine.step()
        except KeyboardInterrupt:
            assert state["raised"], "a KeyboardInterrupt that was not injected"
        finally:
            core_module.assemble_exact = real
        self._collect()

    @precondition(lambda self: bool(self.live))
    @rule(index=st.integers(0, 7))
    def abort(self, index: int) -> None:
        """``core.abort`` (a caller interrupted inside ``generate``): the request ends at once, its blocks back."""
        handle = self.live[index % len(self.live)]
        self.engine.core.abort([handle._request])
        assert handle.done
        self._collect()

    @precondition(lambda self: len(self.live) >= 2)
    @rule(index=st.integers(0, 7))
    def one_request_keeps_failing(self, index: int) -> None:
        """Every forward holding one request's table raises: that request fails, the others go on."""
        handle = self.live[index % len(self.live)]
        table_of = lambda: handle._request.table
        runner = self.engine.runner
        real = runner.run

        def run(batch):
            if any(t is table_of() for t in batch.tables):
                raise RuntimeError("injected: this request's forwards fail")
            return real(batch)

        runner.run = run
        self.errors_allowed.add(id(handle))
        # its samples not forked yet (its prompt did not finish prefilling) end with it
        self.errors_allowed |= {id(child.handle) for child in handle._request.forks}
        try:
            for _ in range(3):
                self._step()
        finally:
            del runner.run

    @precondition(lambda self: bool(self.engine.core.scheduler.running))
    @rule()
    def interrupted_step(self) -> None:
        """A KeyboardInterrupt inside the forward: the step is rolled back and the interrupt reaches the caller."""
        runner = self.engine.runner

        def run(batch):
            raise KeyboardInterrupt

        runner.run = run
        try:
            with pytest.raises(KeyboardInterrupt):
                self.engine.step()
        finally:
            del runner.run
        self._collect()

    @precondition(lambda self: bool(self.engine.core.scheduler.running))
    @rule()
    def preempt(self) -> None:
        core = self.engine.core
        victim = max(core.scheduler.running, key=lambda r: r.admitted_at)
        core.scheduler.running.remove(victim)
        core._preempt(victim)

    @precondition(lambda self: self.restarts < 1)
    @rule()
    def restart_from_disk(self) -> None:
        """Close (the pool's chunks spill into the disk tier; requests in flight end with "shutdown") and start a
        new engine on the same disk tier."""
        self.engine.close()
        self._collect()
        assert not self.live
        self.engine = self._new_engine()
        self.restarts += 1
        self.waited.clear()

    # ------------------------------------------------------------------ invariants
    @invariant()
    def books(self) -> None:
        COUNTS["checks"] += 1
        self.engine.pool.verify()
        self.engine.store.verify()

    @invariant()
    def references_are_the_holders(self) -> None:
        engine = self.engine
        pool, core = engine.pool, engine.core
        expected = [0] * pool.num_blocks
        for request in core.scheduler.running:
            for block in request.table.blocks:
                expected[block] += 1
        for request in core.scheduler.waiting:
            assert not request.table.blocks, f"waiting request {request} holds blocks"
        for request in list(core.scheduler.running) + list(core.scheduler.waiting):
            for child in request.forks:  # samples whose prompt is still prefilling: not scheduled, no blocks
                assert child.phase == "waiting" and not child.table.blocks, f"unforked sample {child} holds blocks"
                assert child not in core.scheduler.running and child not in core.scheduler.waiting
        pins = engine.store.tiers[0]._pins
        for blocks in pins.values():
            for block in blocks:
                expected[block] += 1
        assert [pool.refcount(b) for b in range(pool.num_blocks)] == expected
        if not core.has_work():
            assert pool.num_referenced == len({b for blocks in pins.values() for b in blocks}), "leaked blocks"

    @invariant()
    def cached_blocks_hold_a_fresh_prefill(self) -> None:
        store = self.engine.store
        tier = store.tiers[0]
        for key in tier.keys():
            entry = tier.peek(key)
            assert entry.exact, "recompute=none stores exact entries only"
            chain, parent = list(entry.token_ids), entry.parent_key
            while parent in store:
                up = store.peek_meta(parent)
                chain[:0] = up.token_ids
                parent = up.parent_key
            assert len(chain) == entry.start + entry.num_tokens, "the chain reaches the root"
            ref_k, ref_v = reference_kv(tuple(chain))
            keys, values = entry.payload.materialize()
            rows = slice(entry.start, entry.start + entry.num_tokens)
            assert float((keys - ref_k[:, :, rows]).abs().max()) <= TOL
            assert float((values - ref_v[:, :, rows]).abs().max()) <= TOL

    @invariant()
    def admissible_requests_start(self) -> None:
        core = self.engine.core
        for request in core.scheduler.waiting:
            self.waited[id(request)] = core.steps - request.arrival_step
            assert self.waited[id(request)] <= MAX_WAIT, f"{request} waited {self.waited[id(request)]} steps"


EXPLORE = os.environ.get("KVBOOST_STATEFUL_EXPLORE", "") not in ("", "0")
COUNTS = {"checks": 0, "examples": 0}  # invariant checks (one after each rule, one at the start) and examples


@pytest.mark.timeout(3600)
def test_pool_cache_and_core_keep_their_invariants():
    """At least ``STEPS`` rule steps (see the module docstring), counted: hypothesis may end an example before
    ``stateful_step_count``, so the number of examples is what it takes."""
    from hypothesis.stateful import run_state_machine_as_test

    COUNTS.update(checks=0, examples=0)
    run_state_machine_as_test(CoreMachine, settings=settings(
        max_examples=max(1, STEPS // (STEPS_PER_EXAMPLE // 2)), stateful_step_count=STEPS_PER_EXAMPLE,
        deadline=None, database=None, print_blob=True, derandomize=not EXPLORE,
        suppress_health_check=list(HealthCheck),
    ))  # fmt: skip
    steps = COUNTS["checks"] - COUNTS["examples"]
    print(f"\n{steps} rule steps in {COUNTS['examples']} examples")
    assert steps >= STEPS, f"only {steps} rule steps in {COUNTS['examples']} examples"


