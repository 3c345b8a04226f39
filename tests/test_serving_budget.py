"""The CPU step budget (kvboost.engine.budget): a deterministic choice from the machine's figures, explicit settings
winning everywhere, GPUs keeping 2,048, and no step with decode rows carrying more prompt tokens than the budget's
chunk (issue 44: 2,048-token chunks stalled every decoding row on CPU)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvboost_testkit.tiny import make_engine, random_ids

from kvboost.engine import EngineLoop, SamplingParams
from kvboost.engine import budget as budget_rule
from kvboost.engine.budget import GPU_MAX_BATCH_TOKENS, MAX_CHUNK, MIN_CHUNK, Rates, StepBudget, choose, chunk_tokens
from kvboost.engine.scheduler import DEFAULT_IDLE_PREFILL_TOKENS, Scheduler

#: 1 ms per prompt token, decode steps of 20 ms + 2 ms per row: chunk(R) = 1.5 * (20 + 2R) ms / 1 ms
RATES = Rates(prefill_token_s=0.001, decode_base_s=0.020, decode_row_s=0.002, source="test")


# ---------------------------------------------------------------------- the rule
def test_the_chunk_is_stall_ratio_decode_steps_of_prefill():
    # 1.5 * (20 + 2 * 1) = 33 -> 32 (a multiple of 16); 1.5 * (20 + 2 * 10) = 60 -> 48; 1.5 * 84 = 126 -> 112
    assert [chunk_tokens(RATES, r) for r in (1, 10, 32)] == [32, 48, 112]
    slow_decode = Rates(0.001, 2.0, 0.0, "test")  # bounded by the old budget
    fast_decode = Rates(0.01, 0.001, 0.0, "test")  # never below MIN_CHUNK
    assert chunk_tokens(slow_decode, 8) == MAX_CHUNK == GPU_MAX_BATCH_TOKENS
    assert chunk_tokens(fast_decode, 8) == MIN_CHUNK
    # a step with R decode rows then takes at most (1 + STALL_RATIO) pure decode steps
    for rows in (1, 4, 16, 32, 64):
        n = chunk_tokens(RATES, rows)
        assert n * RATES.prefill_token_s <= budget_rule.STALL_RATIO * RATES.decode_step_s(rows) + 1e-12


def test_a_chunk_is_at_least_its_fixed_costs_worth_and_the_stall_bound_counts_that_cost():
    # 120 ms per chunk + 2 ms per token, decode 15 ms + 4 ms per row: decode="quantized" on 2 AVX2 cores, rounded
    rates = Rates(0.002, 0.015, 0.004, "test", prefill_base_s=0.120)
    # the stall bound (1.5 * (15 + 4R) - 120) / 2 is negative at 1 and 8 rows and 42 at 32: the fixed cost's worth,
    # 60 tokens rounded up to 64, decides; at 64 rows (1.5 * 271 - 120) / 2 = 143 -> 128 (the stall bound)
    assert [chunk_tokens(rates, r) for r in (1, 8, 32, 64)] == [64, 64, 64, 128]
    # without the fixed cost's worth a chunk of MIN_CHUNK would spend 120 of its 184 ms on that cost
    assert chunk_tokens(Rates(0.002, 0.015, 0.004, "test"), 8) == MIN_CHUNK
    for r in (rates, Rates(0.0005, 0.05, 0.004, "test", 0.01), Rates(0.001, 0.02, 0.002, "test", 0.005)):
        for rows in (1, 4, 16, 32, 64, 128):
            n = chunk_tokens(r, rows)
            assert n * r.prefill_token_s >= r.prefill_base_s - 1e-12 or n == MAX_CHUNK
            if n > max(MIN_CHUNK, math.ceil(r.prefill_base_s / r.prefill_token_s / 16) * 16) and n < MAX_CHUNK:  # stall bound
                assert r.prefill_base_s + n * r.prefill_token_s <= budget_rule.STALL_RATIO * r.decode_step_s(rows) + 1e-12


def test_the_choice_is_deterministic_given_cores_isa_and_rates():
    a = choose("cpu", None, isa="avx2", cores=2).describe()
    assert a == choose("cpu", None, isa="avx2", cores=2).describe()
    assert a["mode"] == "cpu-auto" and a["source"] == "prior (avx2, 2 cores)"
    assert choose("cpu", None, rates=RATES).describe() == choose("cpu", None, rates=RATES).describe()
    assert choose("cpu", None, rates=RATES).chunk(10) == 48
    # more cores prefill faster: a larger chunk fits the same stall; AMX prefills faster than AVX2
    assert choose("cpu", None, isa="avx2", cores=8).chunk(8) > choose("cpu", None, isa="avx2", cores=2).chunk(8)
    assert choose("cpu", None, isa="amx", cores=2).chunk(8) > choose("cpu", None, isa="avx2", cores=2).chunk(8)
    # every prior on a small CPU is well below the old 2,048-token chunk (the stall issue 44 measured)
    for isa in budget_rule.PRIOR:
        assert choose("cpu", None, isa=isa, cores=2).chunk(32) <= 512


def test_the_isa_comes_from_the_cpu_flags():
    assert budget_rule.cpu_isa(frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16"})) == "amx"
    assert budget_rule.cpu_isa(frozenset({"avx2", "avx512f", "avx512_bf16"})) == "avx512_bf16"
    assert budget_rule.cpu_isa(frozenset({"avx2", "fma"})) == "avx2"
    assert budget_rule.cpu_isa(frozenset()) == "other"


def test_explicit_settings_and_gpus_keep_a_fixed_budget():
    assert choose("cpu", 512).describe() == {"mode": "fixed", "max_batch_tokens": 512, "reason": "set explicitly"}
    assert choose("cuda", 777).max_batch_tokens == 777
    gpu = choose("cuda", None)
    assert not gpu.auto and gpu.max_batch_tokens == GPU_MAX_BATCH_TOKENS == 2048
    assert gpu.chunk(32) == 2048


def test_a_gpu_engine_core_keeps_2048():
    from kvboost.engine.core import EngineCore

    core = EngineCore(SimpleNamespace(adapter=SimpleNamespace(device=torch.device("cuda"))))
    assert core.scheduler.step_budget is None and core.scheduler.max_batch_tokens == 2048
    assert core.budget_info()["mode"] == "fixed"
    cpu = EngineCore(SimpleNamespace(adapter=SimpleNamespace(device=torch.device("cpu"))))
    assert cpu.scheduler.step_budget is not None and cpu.budget_info()["mode"] == "cpu-auto"


# ---------------------------------------------------------------------- the scheduler under the budget
class _Req:
    def __init__(self, pending: int, decoding: bool, admitted_at: int) -> None:
        self.pending, self.decoding, self.admitted_at = pending, decoding, admitted_at
        self.phase = "decode" if decoding else "prefill"

    def pending_tokens(self) -> int:
        return self.pending


def _plan(s: Scheduler):
    return s.plan_step(lambda r, n: 0, lambda n: n, lambda victim: None)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000), st.integers(1, 4)), min_size=1, max_size=48),
       st.sampled_from([RATES, Rates(0.0005, 0.05, 0.004, "test"), Rates(0.01, 0.02, 0.0, "test"),
                        Rates(0.002, 0.015, 0.004, "test", prefill_base_s=0.120)]))
def test_with_decode_rows_a_steps_prompt_tokens_never_exceed_the_chunk(requests, rates):
    """Any mix of decoding requests (1 row, or k + 1 with a draft) and prefilling ones of any length: the prompt tokens
    of a step with R decode rows are at most chunk(R, backlog), the backlog being the prefilling requests' pending
    tokens; with no decode row the idle budget applies."""
    s = Scheduler(max_running=64)
    s.set_step_budget(StepBudget(GPU_MAX_BATCH_TOKENS, rates, "test"))
    for i, (decoding, prompt, draft) in enumerate(requests):
        s.running.append(_Req(draft if decoding else prompt, decoding, i))
    plan = _plan(s)
    decode_rows = [n for r, n in plan.rows if r.decoding]
    prefill = sum(n for r, n in plan.rows if not r.decoding)
    assert len(decode_rows) == sum(d for d, _, _ in requests)  # every decode row runs, whatever the budget
    if decode_rows:
        waiting_prompt = sum(p for d, p, _ in requests if not d)
        chunk = chunk_tokens(rates, len(decode_rows), backlog=waiting_prompt)
        assert prefill <= chunk
        assert plan.num_tokens <= max(GPU_MAX_BATCH_TOKENS, sum(decode_rows))
        # the chunk is used (prefill does not starve): all of it, or all that is waiting, or the 2,048 cap
        assert prefill == min(waiting_prompt, chunk, max(0, GPU_MAX_BATCH_TOKENS - sum(decode_rows)))
        # and it is at least the backlog over DRAIN_STEPS steps (under the caps), so a backlog drains in that many
        assert prefill >= min(waiting_prompt / budget_rule.DRAIN_STEPS, MAX_CHUNK,
                              GPU_MAX_BATCH_TOKENS - sum(decode_rows))  # fmt: skip
    else:
        assert prefill == min(sum(p for _, p, _ in requests), max(GPU_MAX_BATCH_TOKENS, DEFAULT_IDLE_PREFILL_TOKENS))


def test_assigning_max_batch_tokens_is_explicit():
    s = Scheduler()
    s.set_step_budget(StepBudget(GPU_MAX_BATCH_TOKENS, RATES, "test"))
    s.running += [_Req(1, True, 0), _Req(3000, False, 1)]
    assert _plan(s).num_tokens == 1 + chunk_tokens(RATES, 1, backlog=3000) > 1 + chunk_tokens(RATES, 1)
    s.max_batch_tokens = 1000
    assert s.step_budget is None and _plan(s).num_tokens == 1000


# ---------------------------------------------------------------------- engines, loop, CLI
def test_an_explicit_core_option_or_loop_setting_wins():
    engine = make_engine("llama", decode="eager", core={"max_batch_tokens": 512})
    assert engine.core.scheduler.step_budget is None and engine.core.scheduler.max_batch_tokens == 512
    assert engine.core.calibrate_budget()["mode"] == "fixed"  # nothing measured, nothing changed
    loop = EngineLoop(engine)  # None: the engine's setting stays
    assert engine.core.scheduler.max_batch_tokens == 512
    loop.shutdown()
    engine.close()
    engine = make_engine("llama", decode="eager")
    assert engine.core.budget_info()["mode"] == "cpu-auto"
    loop = EngineLoop(engine, max_batch_tokens=300)
    assert engine.core.scheduler.step_budget is None and engine.core.scheduler.max_batch_tokens == 300
    assert engine.core.stats()["step_budget_auto"] == 0
    loop.shutdown()
    engine.close()


def test_the_cli_flag_defaults_to_the_device_rule():
    from kvboost.serving.cli import build_parser

    assert build_parser().parse_args([]).max_batch_tokens is None
    assert build_parser().parse_args(["--max-batch-tokens", "2048"]).max_batch_tokens == 2048


def test_calibration_measures_the_runner_and_sizes_the_chunk():
    engine = make_engine("llama", decode="eager")
    free = engine.pool.num_free
    info = engine.core.calibrate_budget(repeats=1)
    assert info["mode"] == "cpu-auto" and info["source"] == "measured"
    assert MIN_CHUNK <= info["chunk_at_1"] <= info["chunk_at_32"] <= MAX_CHUNK
    assert info["prefill_tokens_per_s"] > 0 and info["decode_step_ms_1"] > 0 and info["prefill_chunk_base_ms"] >= 0
    assert engine.pool.num_free == free  # the scratch blocks went back
    assert engine.core.stats()["step_budget_auto"] == 1
    engine.close()


def _steps_with_late_prompts(step_budget: StepBudget) -> list[tuple[int, int]]:
    """A real engine (tiny model) under ``step_budget``: two short requests start decoding, then a 300- and a
    200-token prompt arrive; every step's (decode rows, prompt tokens). Asserts each request's output equals its
    prompt's alone."""
    engine = make_engine("llama", decode="eager")
    engine.eos_ids = set()
    prompts = [random_ids(10, seed=1), random_ids(12, seed=2), random_ids(300, seed=3), random_ids(200, seed=4)]
    alone = [engine.generate(p, max_new_tokens=16, mode="cold").output_ids for p in prompts]
    steps: list[tuple[int, int]] = []
    real_run = engine.core._run

    def recording_run(rows, finished):
        steps.append((sum(1 for r, _ in rows if r.phase == "decode"), sum(n for r, n in rows if r.phase == "prefill")))
        return real_run(rows, finished)

    engine.core._run = recording_run
    engine.core.scheduler.set_step_budget(step_budget)
    handles = [engine.add_request(p, SamplingParams(max_tokens=16)) for p in prompts[:2]]
    engine.step()  # the short ones prefill alone (idle budget) and start decoding
    handles += [engine.add_request(p, SamplingParams(max_tokens=16)) for p in prompts[2:]]
    while engine.core.has_work():
        engine.step()
    assert [h.result(0).output_ids for h in handles] == alone
    engine.close()
    return steps


def test_a_long_prompt_is_chunked_to_the_budget_while_others_decode():
    """Under the CPU rule with a chunk of 32 at 1-3 decode rows (the backlog bound off: the next test turns it on),
    every step that carries decode rows carries at most chunk(R) prompt tokens, the 300-token prompt takes several
    steps, and the short requests decode meanwhile."""
    steps = _steps_with_late_prompts(StepBudget(GPU_MAX_BATCH_TOKENS, RATES, "test", drain_steps=0))
    with_decode = [(rows, prefill) for rows, prefill in steps if rows]
    assert with_decode and all(prefill <= chunk_tokens(RATES, rows) for rows, prefill in with_decode)
    assert sum(1 for rows, prefill in with_decode if prefill) >= 300 // chunk_tokens(RATES, 2)


def test_each_step_takes_in_a_share_of_the_prompt_backlog():
    """The backlog bound, with the same requests: of the 300 + 200 prompt tokens that arrive while two requests
    decode, each step takes in the pending backlog / DRAIN_STEPS (rounded up to 16) or the decode rows' bound (32),
    whichever is more: 11 steps where that bound alone took 16."""
    steps = _steps_with_late_prompts(StepBudget(GPU_MAX_BATCH_TOKENS, RATES, "test"))
    prefill_steps = [prefill for rows, prefill in steps[1:] if prefill]
    assert sum(prefill_steps) == 500, steps
    # each step took in the backlog / DRAIN_STEPS (rounded up to 16) or the decode rows' bound, whichever is more:
    # the first 96 of 500 tokens, where the decode rows' bound alone gives 32 a step
    backlog = 500
    for chunk in prefill_steps:
        share = math.ceil(backlog / budget_rule.DRAIN_STEPS / 16) * 16
        assert chunk == min(backlog, max(share, chunk_tokens(RATES, 2))), (backlog, steps)
        backlog -= chunk
    assert prefill_steps[0] > chunk_tokens(RATES, 2) and len(prefill_steps) < 500 // chunk_tokens(RATES, 2)


def test_the_backlog_bound():
    # 1,000 tokens pending over 4 steps: 250 -> 256; the decode rows' bound (32 at one row) when it is larger
    assert chunk_tokens(RATES, 1, backlog=1000, drain_steps=4) == 256
    assert chunk_tokens(RATES, 1, backlog=1000) == math.ceil(1000 / budget_rule.DRAIN_STEPS / 16) * 16
    assert chunk_tokens(RATES, 1, backlog=10) == chunk_tokens(RATES, 1) == 32
    assert chunk_tokens(RATES, 1, backlog=1000, drain_steps=0) == 32  # off
    assert chunk_tokens(RATES, 1, backlog=10**6) == MAX_CHUNK
    sizes = [chunk_tokens(RATES, 8, backlog=b) for b in range(0, 20000, 97)]
    assert sizes == sorted(sizes)  # more backlog never gives a smaller chunk
    with pytest.raises(ValueError, match="drain_steps"):
        choose("cpu", None, rates=RATES, drain_steps=-1)
    assert choose("cpu", None, rates=RATES, drain_steps=2).describe()["drain_steps"] == 2
    assert f"backlog / {budget_rule.DRAIN_STEPS}" in choose("cpu", None, rates=RATES).summary()
    assert "backlog" not in choose("cpu", None, rates=RATES, drain_steps=0).summary()


def test_the_drain_steps_setting_survives_calibration_and_the_cli_sets_it():
    from kvboost.serving.cli import build_parser

    assert build_parser().parse_args([]).prefill_drain_steps is None
    assert build_parser().parse_args(["--prefill-drain-steps", "0"]).prefill_drain_steps == 0
    engine = make_engine("llama", decode="eager")
    engine.core.set_drain_steps(0)
    assert engine.core.budget_info()["drain_steps"] == 0
    assert engine.core.calibrate_budget(repeats=1)["drain_steps"] == 0  # the measured budget keeps it
    engine.core.set_drain_steps(8)
    assert engine.core.scheduler.step_budget.drain_steps == 8
    with pytest.raises(ValueError, match="drain_steps"):
        engine.core.set_drain_steps(-2)
    engine.close()


@pytest.mark.parametrize("rows", [1, 32])
def test_the_summary_names_the_source_and_chunks(rows):
    chosen = choose("cpu", None, isa="avx2", cores=2)
    text = chosen.summary()
    assert "prior (avx2, 2 cores)" in text and str(chosen.chunk(rows)) in text
