"""The engine step's token budget on CPU: how many prompt tokens a step may carry while requests decode.

Every decoding request waits for the whole step its row is in, so a step that carries a prefill chunk stalls every
decoding row for the chunk's time. With the old default budget (2,048 tokens per step, sized for GPUs, where a
2,048-token chunk costs little more than a decode step) kvboost-server on 2 CPU cores (Intel AMX, bf16, 32
closed-loop ShareGPT clients) had an inter-token latency of p50 147 ms and p99 1.7 s: a 2,048-token chunk takes
~1.5 s there (~1,300 prefill tokens/s) against ~0.1-0.15 s for a decode step of ~32 rows (issue 44).

The rule (CPU, ``max_batch_tokens`` not set by the user), with B the prompt tokens admitted requests still have
to prefill::

    budget(R decode rows) = decode tokens + chunk(R, B)
    chunk(R, B) = max((STALL_RATIO * decode_step_s(R) - prefill_base_s) / prefill_token_s,   # the stall bound
                      prefill_base_s / prefill_token_s,                                       # the amortisation bound
                      B / DRAIN_STEPS)                                                        # the backlog bound

clamped to ``[MIN_CHUNK, MAX_CHUNK]`` and rounded down to a multiple of ``CHUNK_QUANTUM`` (the amortisation bound
up). The stall bound: a step with decode rows takes at most ``1 + STALL_RATIO`` (2.5x) a pure decode step, so the
inter-token p99 stays within ~3x the p50 while prefill still gets 60% of the machine under load. The amortisation
bound: a chunk costs a fixed ``prefill_base_s`` whatever its length (in fp32 on CPU mostly streaming the dense
weights once) plus ``prefill_token_s`` per token, so a chunk shorter than ``prefill_base_s / prefill_token_s``
tokens spends more of its time on that fixed cost than on prompt tokens; where the decode step is fast
(``decode="quantized"``: 48 ms for 8 rows on 2 AVX2 cores) the stall bound cannot be met by any chunk (the fixed
cost alone, 0.11-0.17 s there, is 2-3 decode steps) and the amortisation bound decides (the server's calibration
there: 165 ms + 342 tokens/s, so 64 tokens). Measured with kvboost-server under ``load_test`` (bundled model, 2 AVX2
cores, 4-turn sessions) against the 32-token chunks the stall bound alone gave, at concurrency 8 / 32: throughput
1.028 / 0.819 vs 0.726 / 0.730 req/s, TTFT p50 at turns >= 2 1.7 / 34.1 vs 4.4 / 41.4 s, inter-token p50/p99 82/533
and 368/635 vs 278/384 and 288/621 ms: at 8 the p99 is 6.5x the p50 (1.4x before), more steps being pure decode
steps (experiments/results/README.md, issue 44).

The backlog bound: the first two bounds size a chunk from the decode step alone, however much prompt work waits.
Under load the prompts arrive faster than ~1.5 decode steps of prefill per step can take them in, so they queue, and
time to first token is that queue: on 2 Zen 4 cores (bf16, 4-bit decode) at 32 closed-loop clients 13.4-17.2 s at
turns >= 2, while the steps stayed short (inter-token p50 118-142 ms). By Little's law, in a closed loop a request's
latency is concurrency / throughput whatever the order, so time to first token falls only if the time between
tokens rises: with the backlog bound a step takes in at least 1 / DRAIN_STEPS of the waiting prompt tokens, so the
prefill keeps pace with the arrivals, and the steps grow with the load, evenly (each carries a similar share of the
backlog). Measured the same way: 2.9-3.3 s, 1.36-1.42x the throughput, inter-token p99 2.2x the p50; 4 steps broke
p99 <= 3x p50 in three runs of four, 8 gave a later first token (experiments/results/README.md, "A prompt backlog
bound for the step budget").

``decode_step_s(R) = decode_base_s + decode_row_s * R``, ``prefill_base_s`` and ``prefill_token_s`` are
:class:`Rates`: measured on the engine's own runner by :func:`measure_rates` (the server
does it right after warm-up, in two passes, the first meeting new shapes: on 2 AVX2 cores for the bundled model
~55 s then ~5 s; prefill chunks and decode steps on scratch blocks, minimum of the repetitions), or, before
that, a prior from the CPU's matrix ISA and core count (:func:`prior_rates`, figures below). While no request
decodes the scheduler keeps the large idle budget (``idle_prefill_tokens``, 16,384): nothing waits on a prefill
then, so time to first token at low load is unchanged.

Explicit settings win everywhere (``--max-batch-tokens``, ``engine.core.max_batch_tokens``, ``core={"max_batch_tokens":
...}``, assigning ``scheduler.max_batch_tokens``): the budget is then that fixed number, as before. GPUs keep 2,048
(a chunk there costs a few ms; :data:`GPU_MAX_BATCH_TOKENS`).

Prior figures (2 threads, SmolLM2-135M, the per-core rates scale with the core count; decode steps do not; the
priors carry no chunk fixed cost, so before a calibration the stall bound alone decides):

- ``amx`` (Intel Sapphire Rapids and later, bf16 on AMX tiles, ~2 TFLOP/s on 2 threads): ~650 prefill tokens/s per
  core (2,048 tokens in ~1.5 s on 2 cores, issue 44); a decode step ~25 ms + ~3 ms per row.
- ``avx512_bf16`` (AMD Zen 4, ~410 GFLOP/s bf16 on 2 threads, ~1/5 of AMX): ~150 tokens/s per core; decode ~30 ms +
  ~3 ms per row.
- ``avx2`` (fp32, e.g. an AVX2-only AMD EPYC; :func:`measure_rates` on 2 cores, shared machine): ~130-165 prefill
  tokens/s per core (256-token chunks at 256 / 1,024 context); decode ~45 ms at 1 row, ~260 ms at 32 (1,024 context):
  ~40 ms + ~7 ms per row. ``other``: a guess below AVX2.

The measurement replaces the prior when it runs; ``describe()`` says which one the budget came from.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: The budget on GPUs, and the budget the CLI used to default to everywhere.
GPU_MAX_BATCH_TOKENS = 2048
#: A step's prefill chunk may take this many pure decode steps (so a step takes <= 1 + STALL_RATIO of one).
STALL_RATIO = 1.5
#: Bounds of the CPU chunk: below MIN_CHUNK per-step overhead dominates; MAX_CHUNK is the old (GPU) budget.
MIN_CHUNK, MAX_CHUNK = 32, GPU_MAX_BATCH_TOKENS
#: The chunk is a multiple of this (shapes repeat, the log reads simply).
CHUNK_QUANTUM = 16
#: The backlog bound: a step takes in at least 1 / DRAIN_STEPS of the prompt tokens admitted requests still have to
#: prefill (a backlog shrinks geometrically, ~1/6 a step), however many requests decode.
DRAIN_STEPS = 6


@dataclass(frozen=True)
class Rates:
    """Seconds a CPU step costs: ``decode_base_s + decode_row_s * R`` for a pure decode step of R rows, and
    ``prefill_base_s + prefill_token_s * n`` for an n-token prompt chunk. ``source``: ``measured`` or
    ``prior (<isa>, <n> cores)``."""

    prefill_token_s: float
    decode_base_s: float
    decode_row_s: float
    source: str
    prefill_base_s: float = 0.0

    def decode_step_s(self, rows: int) -> float:
        return self.decode_base_s + self.decode_row_s * max(1, rows)


#: isa -> (prefill tokens/s per core, decode step base seconds, decode seconds per row): see the module docstring.
PRIOR: dict[str, tuple[float, float, float]] = {
    "amx": (650.0, 0.025, 0.003),
    "avx512_bf16": (150.0, 0.030, 0.003),
    "avx2": (150.0, 0.040, 0.007),
    "other": (100.0, 0.050, 0.005),
}


def cpu_isa(flags: frozenset[str] | None = None) -> str:
    """The CPU's matrix ISA as the rule names it: ``amx`` | ``avx512_bf16`` | ``avx2`` | ``other``."""
    if flags is None:
        from kvboost.env import cpu_flags

        flags = cpu_flags()
    if "amx_bf16" in flags:
        return "amx"
    if "avx512_bf16" in flags:
        return "avx512_bf16"
    if "avx2" in flags:
        return "avx2"
    return "other"


def cpu_cores() -> int:
    """Threads torch computes on (what a step's GEMMs use), else the CPUs this process may run on."""
    try:
        import torch

        return max(1, int(torch.get_num_threads()))
    except Exception:  # noqa: BLE001 - no torch: the affinity mask
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def prior_rates(isa: str, cores: int) -> Rates:
    """Rates modelled from the ISA and the core count (:data:`PRIOR`); prefill scales with cores, decode not."""
    per_core, base, row = PRIOR.get(isa, PRIOR["other"])
    return Rates(1.0 / (per_core * max(1, cores)), base, row, f"prior ({isa}, {cores} cores)")


def chunk_tokens(rates: Rates, decode_rows: int, ratio: float = STALL_RATIO, backlog: int = 0,
                 drain_steps: int = DRAIN_STEPS) -> int:  # fmt: skip
    """The prompt tokens a step with ``decode_rows`` decode rows may carry: ``ratio`` decode steps' worth of
    prefill, or, where that is shorter, as many tokens as the chunk's fixed cost is worth, or, where ``backlog``
    prompt tokens wait in admitted requests, ``backlog / drain_steps`` (see the module docstring)."""
    if rates.prefill_token_s <= 0:
        return MAX_CHUNK
    stall = int((ratio * rates.decode_step_s(decode_rows) - rates.prefill_base_s) / rates.prefill_token_s)
    # at least the fixed cost's worth of tokens: rounded up to the quantum (the result is rounded down below)
    amortised = math.ceil(rates.prefill_base_s / rates.prefill_token_s / CHUNK_QUANTUM) * CHUNK_QUANTUM
    drain = math.ceil(max(0, backlog) / max(1, drain_steps) / CHUNK_QUANTUM) * CHUNK_QUANTUM if drain_steps else 0
    n = max(stall, amortised, drain)
    n = max(MIN_CHUNK, min(MAX_CHUNK, n))
    return max(MIN_CHUNK, n // CHUNK_QUANTUM * CHUNK_QUANTUM)


@dataclass
class StepBudget:
    """What the scheduler asks each step: ``chunk(R)`` prompt tokens besides R decode rows (``rates`` set), or a
    fixed ``max_batch_tokens`` (``rates`` None). ``reason`` says where it came from."""

    max_batch_tokens: int
    rates: Rates | None
    reason: str
    ratio: float = STALL_RATIO
    #: the backlog bound's horizon (0: off, the chunk depends on the decode rows alone)
    drain_steps: int = DRAIN_STEPS

    @property
    def auto(self) -> bool:
        return self.rates is not None

    def chunk(self, decode_rows: int, backlog: int = 0) -> int:
        """Prompt tokens besides ``decode_rows`` decode rows, with ``backlog`` prompt tokens left in admitted
        requests."""
        if self.rates is None:
            return self.max_batch_tokens
        return chunk_tokens(self.rates, decode_rows, self.ratio, backlog, self.drain_steps)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": "cpu-auto" if self.auto else "fixed", "max_batch_tokens": self.max_batch_tokens,
                               "reason": self.reason}  # fmt: skip
        if self.rates is not None:
            r = self.rates
            out.update(source=r.source, stall_ratio=self.ratio, drain_steps=self.drain_steps,
                       prefill_tokens_per_s=round(1 / r.prefill_token_s, 1),
                       decode_step_ms_1=round(r.decode_step_s(1) * 1e3, 2),
                       decode_step_ms_32=round(r.decode_step_s(32) * 1e3, 2),
                       prefill_chunk_base_ms=round(r.prefill_base_s * 1e3, 2),
                       chunk_at_1=self.chunk(1), chunk_at_8=self.chunk(8), chunk_at_32=self.chunk(32))  # fmt: skip
        return out

    def summary(self) -> str:
        if self.rates is None:
            return f"max_batch_tokens={self.max_batch_tokens} ({self.reason})"
        r = self.rates
        return (f"step budget cpu-auto: decode rows + {self.chunk(1)}..{self.chunk(32)} prompt tokens (1..32 rows; "
                f"chunk = {self.ratio:g} decode steps, or its fixed cost's worth; {r.source}: "
                f"{r.prefill_base_s * 1e3:.0f} ms + {1 / r.prefill_token_s:.0f} prefill tok/s per chunk, decode "
                f"step {r.decode_step_s(1) * 1e3:.0f} ms at 1 row, {r.decode_step_s(32) * 1e3:.0f} ms at 32); "
                + (f"at least the admitted prompts' backlog / {self.drain_steps}; " if self.drain_steps else "")
                + "idle prefill budget unchanged")  # fmt: skip


def check_drain_steps(steps: Any) -> int:
    """``steps`` if it is a valid backlog-bound horizon (a non-negative integer; 0: off), else ValueError."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise ValueError(f"drain_steps must be a non-negative integer (0: off), got {steps!r}")
    return steps


def choose(device_type: str, explicit: int | None, *, isa: str | None = None, cores: int | None = None,
           rates: Rates | None = None, drain_steps: int = DRAIN_STEPS) -> StepBudget:  # fmt: skip
    """The step budget: ``explicit`` when given (fixed), 2,048 off CPU, else the CPU rule over ``rates`` (default:
    the prior of ``isa`` and ``cores``, this machine's when None) with the backlog bound over ``drain_steps`` steps
    (0: off). Deterministic given its arguments."""
    check_drain_steps(drain_steps)
    if explicit is not None:
        return StepBudget(int(explicit), None, "set explicitly")
    if device_type != "cpu":
        return StepBudget(GPU_MAX_BATCH_TOKENS, None, f"{device_type} default")
    if rates is None:
        isa = isa if isa is not None else cpu_isa()
        rates = prior_rates(isa, cores if cores is not None else cpu_cores())
    return StepBudget(GPU_MAX_BATCH_TOKENS, rates, "CPU default: prefill chunk sized to the decode step",
                      drain_steps=drain_steps)  # fmt: skip


def measure_rates(runner: Any, pool: Any, *, vocab: int = 1000, context: int = 256, chunks: tuple[int, int] = (32, 256),
                  rows: tuple[int, int] = (1, 8), repeats: int = 3) -> Rates:  # fmt: skip
    """Time the engine's own runner on scratch blocks: prompt chunks of ``chunks`` tokens over a ``context``-token
    context, and pure decode steps of ``rows`` rows (minimum over ``repeats``; two sizes of each give the fixed and
    the per-token / per-row cost). Call it inside ``core.exclusive()`` with the pool's blocks to spare (a few
    hundred rows)."""
    import torch

    from kvboost.kv.block_table import BlockTable
    from kvboost.runtime.batch import ForwardBatch, SeqInput

    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, max(4, vocab), (n,), generator=g).tolist()

    tables: list[Any] = []
    try:
        with torch.inference_mode():
            prefill = BlockTable(pool)
            tables.append(prefill)
            runner.run(ForwardBatch.build([SeqInput(prefill, ids(context))]))
            chunk_s: dict[int, float] = {}
            for chunk in chunks:
                chunk_s[chunk] = _min_seconds(
                    lambda chunk=chunk: runner.run(ForwardBatch.build([SeqInput(prefill, ids(chunk))])),
                    max(1, repeats - 1), before=lambda: prefill.truncate(context))  # fmt: skip
            step: dict[int, float] = {}
            decode_ctx = 32
            for n in rows:
                batch_tables = [BlockTable(pool) for _ in range(n)]
                tables.extend(batch_tables)
                runner.run(ForwardBatch.build([SeqInput(t, ids(decode_ctx)) for t in batch_tables]))
                runner.run(ForwardBatch.build([SeqInput(t, ids(1)) for t in batch_tables]))  # first decode: unmeasured
                step[n] = _min_seconds(
                    lambda tables=batch_tables: runner.run(ForwardBatch.build([SeqInput(t, ids(1)) for t in tables])),
                    repeats)  # fmt: skip
    finally:
        for table in tables:
            table.release()
    lo, hi = rows
    per_row = max(0.0, _slope(step, lo, hi))
    base = max(1e-4, step[lo] - per_row * lo)
    small, large = min(chunks), max(chunks)
    per_token = _slope(chunk_s, small, large)
    if per_token <= 0:  # noise on a tiny model: no fixed cost to tell apart, the large chunk's mean instead
        per_token = chunk_s[large] / large
    prefill_base = max(0.0, chunk_s[small] - per_token * small)
    return Rates(per_token, base, per_row, "measured", prefill_base)


def _min_seconds(run: Any, repeats: int, before: Any = None) -> float:
    """The fastest of ``repeats`` timed calls of ``run`` (``before`` called untimed ahead of each)."""
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def _slope(seconds: dict[int, float], lo: int, hi: int) -> float:
    """Seconds per unit between two sizes' timings (0 when the sizes are equal): a cost's per-token / per-row part."""
    return (seconds[hi] - seconds[lo]) / (hi - lo) if hi != lo else 0.0
