"""A request whose assembly runs out of blocks at admission (``PoolExhausted``: the pool's count said yes, the blocks
were cached but protected) goes back to the queue's head and starts later. Found by the soak test
(experiments/bench/soak.py, 64 clients on a 91-block pool): that path ran ~1,400 times in 10 minutes, and each time

- the prompt was counted again in ``prompt_tokens`` / ``prefix_query_tokens`` (they are counted before assembly
  and not restored): 592,360 prompt tokens for 197,678 hit + 9,756 computed;
- a preempted request lost its ``preempted`` flag (cleared before assembly, not restored), so it no longer went
  first in the queue.
"""

from __future__ import annotations

import functools

from kvboost_testkit import pools
from kvboost_testkit.pools import BLOCK, one_thread  # noqa: F401 - one_thread: autouse fixture
from kvboost_testkit.tiny import random_ids

import kvboost.engine.core as core_module
from kvboost.engine import SamplingParams
from kvboost.kv.pool import PoolExhausted

pool_engine = functools.partial(pools.pool_engine, eos=False)


def test_an_admission_that_waits_for_blocks_counts_its_prompt_once(monkeypatch):
    engine = pool_engine(32)
    first = engine.add_request(random_ids(BLOCK, seed=1), SamplingParams(max_tokens=12))
    engine.step()  # the first request is admitted and prefilled; it decodes while the second arrives
    real = core_module.assemble_exact
    waited: list[int] = []

    def short_once(plan, table, quantizer):
        if not waited:  # the second request's first assembly: blocks cached but protected
            waited.append(engine.core.steps)
            plan.release()
            raise PoolExhausted("test: blocks cached but protected")
        return real(plan, table, quantizer)

    monkeypatch.setattr(core_module, "assemble_exact", short_once)
    second = engine.add_request(random_ids(BLOCK + 5, seed=2), SamplingParams(max_tokens=12))
    for _ in range(200):
        if not engine.core.has_work():
            break
        engine.step()
    assert waited, "the second request's admission never assembled"
    assert len(first.result(0).output_ids) == 12 and len(second.result(0).output_ids) == 12
    counters = engine.core.counters
    assert counters["prompt_tokens"] == BLOCK + BLOCK + 5, counters
    assert counters["prefix_query_tokens"] == BLOCK + BLOCK + 5, counters
