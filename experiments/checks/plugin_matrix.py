"""Every plugin of every registry family on one REAL model: PASS / SKIP / FAIL per cell.

    python -m experiments.checks.plugin_matrix --model smollm2 --dtype float32 --threads 1 \\
        --out experiments/results/plugin_matrix/smollm2_fp32
    python -m experiments.checks.plugin_matrix --model qwen_coder_0_5b --dtype float32 --threads 1 \\
        --out experiments/results/plugin_matrix/qwen_coder_0_5b_fp32
    python -m experiments.checks.plugin_matrix --model smollm2 --only recompute attn:sdpa   # a part of the matrix

The weights are loaded once; every cell builds its engine(s) on that model object (``build_engine(
compose_run_config(**plugin_options), model, tokenizer, model_identity=...)``: the run config's defaults, the
cell's plugins) and closes them before the next cell. The cells iterate over
each registry's names (``kvboost.registry.ALL_REGISTRIES``), so a new plugin appears in the matrix by itself.

What each family's cell asserts (the exactness tolerance is ``kvboost.quality.exactness_promise``: first-token
KL <= 1e-4 in fp32):

- ``chunker`` / ``hasher`` / ``attn``: a two-turn chat; turn 2 in ``mode="reuse"`` and ``mode="cold"``: same greedy
  tokens, first-token KL within the tolerance, ``cached_tokens > 0``. Backends that cannot run here
  (``check_available`` / ``check_model`` refuse) are skipped with their reason; ``triton`` without a GPU runs in
  the Triton interpreter (minutes per request on CPU): only with ``--slow``, on one tiny prompt.
- ``eviction``: the same with the policy, then again under a memory tier half the size of what the turns store:
  entries are evicted (``evicted > 0``) and turn 2 still equals cold.
- ``recompute``: a small RAG prompt (system, 3 documents, question, separator chunker); the documents warmed alone
  (``warm(doc, chat=False)``), then asked in another order: ``content_hit_tokens > 0``, ``recompute_ratio`` in
  [0, 1], finite first-token logits; ``full`` equals cold (greedy, KL); every strategy's KL vs cold is reported.
- ``quant``: a repeated prompt served from the (quantized) cache: ``cached_tokens > 0``; a lossless quantizer
  equals cold; a lossy one only reports its first-token KL and greedy match against cold (finite logits asserted).
- ``cache``: ``memory`` as the chunker cells; ``disk`` (a temporary folder) and ``redis`` (a private
  ``redis-server`` on a free loopback port, skipped when the binary or the ``redis`` package is missing) behind
  a memory tier: turn 1 served by one engine, that engine closed, turn 2 served by a new engine on the same
  folder / namespace (empty memory tier): ``cached_tokens > 0``, hits in that tier, greedy equal to cold.
- ``speculative``: a self-quoting prompt, two requests (the second continues the first's answer): the output
  equals plain greedy decoding (``speculative="none"``) token for token (fp32); acceptance reported.
  ``draft_model`` drafts with a copy of the target's own weights (no second checkpoint needed).

Writes ``<out>/matrix.json`` (every cell with its numbers) and ``<out>/matrix.md`` (command, machine, model, dtype,
table). Exit status 1 when any cell failed.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from experiments.common import RESULTS_DIR, add_threads_arg, set_threads, write_json, write_markdown
from experiments.redis_process import RedisProcess, redis_unavailable_reason

FAMILY_ORDER = ("chunker", "hasher", "cache", "eviction", "recompute", "quant", "attn", "speculative")
TRITON_SLOW_REASON = "Triton interpreter: minutes per request on CPU (run with --slow for one tiny prompt)"


# ------------------------------------------------------------------------------------------------ prompts
@dataclass(frozen=True)
class Prompts:
    """The texts the cells send (sized for ~150-300 tokens on a real tokenizer). The system prompt holds a blank
    line, so the ``separator`` chunker cuts it where ``fixed`` does not."""

    system: str
    questions: tuple[str, str]
    rag_system: str
    docs: tuple[str, str, str]
    rag_question: str
    quoting: str
    tiny: str  # the one short prompt of the slow (interpreted) backends
    separator: str = "\n\n"


DEFAULT_PROMPTS = Prompts(
    system=(
        "You are a careful Python assistant. Answer with short, working code and one sentence of explanation. "
        "Prefer the standard library, name variables clearly, handle empty inputs, and never invent APIs. "
        "When a question is ambiguous, state the assumption you make before the code. Keep answers under "
        "ten lines unless asked for more, and use type hints on every function you write.\n\nIf the user shows "
        "code, point out bugs before style, and mention the complexity of any loop you propose. Do not repeat "
        "the question back, do not apologise, and finish every answer with a one-line usage example."
    ),
    questions=(
        "Write a function that returns the n-th Fibonacci number iteratively.",
        "Now make it return the whole list of the first n numbers instead.",
    ),
    rag_system="Answer the question using only the documents below. Quote the document you use.",
    docs=(
        (
            "Document A: The Larkspur bridge was finished in 1911. It crosses the Vell river at its narrowest "
            "point and was built from granite quarried two miles upstream by the Harwick company."
        ),
        (
            "Document B: Copper wires carry current with little loss; their resistance grows with length and with "
            "temperature, which is why long transmission lines use high voltages and thick cables."
        ),
        (
            "Document C: The lighthouse keeper, Mara Quill, wrote a letter to her brother every Sunday for forty "
            "years; the letters are kept in the harbour museum and describe every storm she saw."
        ),
    ),
    rag_question="Question: Who wrote letters every Sunday, and where are the letters kept?",
    quoting=(
        "Here is a function:\n\ndef clamp(value, low, high):\n    if value < low:\n        return low\n"
        "    if value > high:\n        return high\n    return value\n\nRepeat the function above exactly, "
        "then rename it to limit."
    ),
    tiny="Say hello.",
)


# ------------------------------------------------------------------------------------------------ cells
@dataclass
class Cell:
    family: str
    plugin: str
    status: str  # passed | skipped | failed
    detail: str
    seconds: float
    numbers: dict[str, Any] = field(default_factory=dict)
    traceback: str | None = None


class Skip(Exception):
    """The plugin cannot run here; the message says why."""


class CellFailure(AssertionError):
    """A check failed; carries the numbers measured before it."""

    def __init__(self, message: str, numbers: dict[str, Any]) -> None:
        super().__init__(message)
        self.numbers = numbers


def verdict(numbers: dict[str, Any], checks: Sequence[tuple[bool, str]], summary: str) -> tuple[str, dict[str, Any]]:
    """``(summary, numbers)`` when every check holds, else CellFailure naming the failed ones (and the summary)."""
    failed = [message for ok, message in checks if not ok]
    if failed:
        raise CellFailure("; ".join(failed) + f" | {summary}", numbers)
    return summary, numbers


def _fmt(x: float) -> str:
    return f"{x:.2e}" if isinstance(x, float) and x != 0 else f"{x:g}" if isinstance(x, float) else str(x)


def _finite(result: Any) -> bool:
    import torch

    logits = result.first_token_logits
    return logits is not None and bool(torch.isfinite(logits).all())


def _compare(cold: Any, candidate: Any) -> dict[str, Any]:
    """The runner's quality fields of ``candidate`` against ``cold`` (greedy match, first divergence, first-token KL,
    max |logit diff|), with both token sequences."""
    from kvboost.lab.runner import quality_fields

    return {**quality_fields(cold, candidate), "cold_ids": list(cold.output_ids), "ids": list(candidate.output_ids)}


def _kl_ok(kl: float, tol: float) -> bool:
    return math.isfinite(kl) and kl <= tol


# ------------------------------------------------------------------------------------------------ the matrix
class Matrix:
    """The cells of one model: ``run()`` gives one :class:`Cell` per (family, plugin)."""

    def __init__(self, model: Any, tokenizer: Any, identity: str, *, prompts: Prompts = DEFAULT_PROMPTS,
                 max_new_tokens: int = 8, chunk_size: int | None = None, engine_options: dict[str, Any] | None = None,
                 slow: bool = False, workdir: str | Path | None = None) -> None:  # fmt: skip
        self.model, self.tokenizer, self.identity = model, tokenizer, identity
        self.prompts, self.new, self.chunk_size = prompts, max_new_tokens, chunk_size
        self.engine_options = dict(engine_options or {})
        self.slow = slow
        self.workdir = Path(workdir) if workdir else None
        self._plain_speculative: tuple[list[int], list[int]] | None = None

    # -------------------------------------------------------------- helpers
    def chunker_spec(self, name: str = "fixed", **fields: Any) -> Any:
        from kvboost.registry import CHUNKERS

        accepted = (CHUNKERS.accepted_fields(name) or ([], ""))[0]
        if self.chunk_size and "chunk_size" in accepted:
            fields.setdefault("chunk_size", self.chunk_size)
        return {"name": name, **fields} if fields else name

    def engine(self, **options: Any) -> Any:
        from experiments.common import compose_run_config
        from kvboost.build import build_engine

        opts = {"chunker": self.chunker_spec(), **self.engine_options, **options}
        return build_engine(compose_run_config(**opts), self.model, self.tokenizer, model_identity=self.identity)

    def run_engine(self, options: dict[str, Any], body: Callable[[Any], Any]) -> Any:
        """``body(engine)`` on a fresh engine, closed (the model given back) whatever happens."""
        engine = self.engine(**options)
        try:
            return body(engine)
        finally:
            engine.close()
            del engine
            gc.collect()

    def turn1(self, system: str | None = None, question: str | None = None) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.prompts.system if system is None else system},
                {"role": "user", "content": self.prompts.questions[0] if question is None else question}]  # fmt: skip

    def turn2(self, first: list[dict[str, str]], answer: str) -> list[dict[str, str]]:
        return [
            *first,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": self.prompts.questions[1]},
        ]

    def rag_prompt(self, order: Sequence[int]) -> str:
        p = self.prompts
        return p.separator.join([p.rag_system, *(p.docs[i] for i in order), p.rag_question])

    # -------------------------------------------------------------- stages
    def exact_two_turn(self, engine: Any, *, require_cached: bool = True, tiny: bool = False,
                       between: Callable[[Any], Any] | None = None) -> tuple[str, dict]:  # fmt: skip
        """Turn 1 (then ``between(engine)``), then turn 2 in reuse and in cold mode: same greedy tokens, KL within
        the promise."""
        from kvboost.quality import exactness_promise

        first = self.turn1(system="", question=self.prompts.tiny) if tiny else self.turn1()
        r1 = engine.generate(first, max_new_tokens=self.new)
        if between is not None:
            between(engine)
        second = self.turn2(first, r1.output_text)
        reuse = engine.generate(second, max_new_tokens=self.new, mode="reuse")
        cold = engine.generate(second, max_new_tokens=self.new, mode="cold")
        tol, why = exactness_promise(engine)
        n = {"turn1_prompt_tokens": r1.prompt_tokens, "prompt_tokens": reuse.prompt_tokens,
             "cached_tokens": reuse.cached_tokens, "exact_hit_tokens": reuse.exact_hit_tokens,
             "content_hit_tokens": reuse.content_hit_tokens, "kl_tolerance": tol, "criterion": why,
             **_compare(cold, reuse)}  # fmt: skip
        summary = (f"turn 2: {reuse.cached_tokens}/{reuse.prompt_tokens} cached, greedy "
                   f"{'=' if n['greedy_match'] else '!='} cold, KL {_fmt(n['first_token_kl'])}, "
                   f"max|dlogit| {_fmt(n['max_abs_logit_diff'])}")  # fmt: skip
        return verdict(n, [
            (not require_cached or reuse.cached_tokens > 0, "nothing cached in turn 2"),
            (n["greedy_match"], (f"greedy differs from cold at token {n['first_divergence']}: reuse {n['ids']} "
                                 f"vs cold {n['cold_ids']}")),
            (_kl_ok(n["first_token_kl"], tol), f"first-token KL {_fmt(n['first_token_kl'])} > {tol:g}"),
        ], summary)  # fmt: skip

    # -------------------------------------------------------------- families
    def cell_chunker(self, name: str) -> tuple[str, dict]:
        spec = self.chunker_spec(name)
        return self.run_engine({"chunker": spec}, self.exact_two_turn)

    def cell_hasher(self, name: str) -> tuple[str, dict]:
        return self.run_engine({"hasher": name}, self.exact_two_turn)

    def cell_eviction(self, name: str) -> tuple[str, dict]:
        def free(engine: Any) -> tuple[str, dict, int]:
            summary, n = self.exact_two_turn(engine)
            return summary, n, int(engine.cache_stats()["tiers"][0]["used_bytes"])

        summary, n, used = self.run_engine({"eviction": name}, free)
        capacity = max(1, used // 2)

        def other_request(engine: Any) -> None:  # another chain: the policy must make room for it
            p = self.prompts
            engine.generate(self.turn1(system=" ".join(p.docs), question=p.rag_question), max_new_tokens=self.new)

        def pressed(engine: Any) -> tuple[str, dict]:
            s2, n2 = self.exact_two_turn(engine, require_cached=False, between=other_request)
            stats = engine.cache_stats()
            n2.update(evicted=int(stats["evicted"]), rejected=int(stats["rejected"]),
                      used_bytes=int(stats["tiers"][0]["used_bytes"]), capacity_bytes=capacity)  # fmt: skip
            return verdict(n2, [(n2["evicted"] > 0, "nothing evicted under half the capacity"),
                                (n2["used_bytes"] <= capacity, f"{n2['used_bytes']} bytes held > capacity {capacity}")],
                           s2)  # fmt: skip

        try:
            _, n2 = self.run_engine({"eviction": name, "cache": {"name": "memory", "capacity": capacity}}, pressed)
        except CellFailure as exc:
            raise CellFailure(f"under pressure ({capacity} B): {exc}", {"free": n, "pressure": exc.numbers}) from None
        return ((f"{summary}; at half capacity ({capacity} B) with another request between the turns, "
                 f"{n2['evicted']} evicted, {n2['rejected']} rejected: {n2['cached_tokens']} cached, "
                 f"greedy {'=' if n2['greedy_match'] else '!='} cold, KL {_fmt(n2['first_token_kl'])}"),
                {"free": n, "pressure": n2})  # fmt: skip

    def cell_recompute(self, name: str) -> tuple[str, dict]:
        from kvboost.quality import exactness_promise

        p = self.prompts

        def body(engine: Any) -> tuple[str, dict]:
            for doc in p.docs:
                engine.warm(doc, chat=False)
            prompt = self.rag_prompt([2, 0, 1])
            reuse = engine.generate(prompt, max_new_tokens=self.new, mode="reuse", store=False)
            cold = engine.generate(prompt, max_new_tokens=self.new, mode="cold")
            tol, _ = exactness_promise(engine)
            n = {"prompt_tokens": reuse.prompt_tokens, "content_hit_tokens": reuse.content_hit_tokens,
                 "exact_hit_tokens": reuse.exact_hit_tokens, "cached_tokens": reuse.cached_tokens,
                 "recompute_ratio": float(reuse.recompute_ratio), "kl_tolerance": tol, **_compare(cold, reuse)}  # fmt: skip
            checks = [(reuse.content_hit_tokens > 0, "no content hit"),
                      (0.0 <= n["recompute_ratio"] <= 1.0, f"recompute_ratio {n['recompute_ratio']} outside [0, 1]"),
                      (_finite(reuse), "non-finite first-token logits")]  # fmt: skip
            if name == "full":
                checks += [
                    (
                        n["greedy_match"],
                        f"greedy differs from cold at token {n['first_divergence']}: {n['ids']} vs {n['cold_ids']}",
                    ),
                    (_kl_ok(n["first_token_kl"], tol), f"first-token KL {_fmt(n['first_token_kl'])} > {tol:g}"),
                ]
            summary = (f"{reuse.content_hit_tokens}/{reuse.prompt_tokens} content hits, recompute "
                       f"{n['recompute_ratio']:.3f}, KL vs cold {_fmt(n['first_token_kl'])}, greedy "
                       f"{'=' if n['greedy_match'] else '!='} cold" + (f" (first differs at {n['first_divergence']})"
                                                                       if not n["greedy_match"] else ""))  # fmt: skip
            return verdict(n, checks, summary)

        chunker = {"name": "separator", "separator": p.separator, **({"chunk_size": self.chunk_size}
                                                                     if self.chunk_size else {})}  # fmt: skip
        return self.run_engine({"recompute": name, "chunker": chunker, "chat": False}, body)

    def cell_quant(self, name: str) -> tuple[str, dict]:
        from kvboost.quality import exactness_promise

        def body(engine: Any) -> tuple[str, dict]:
            prompt = self.turn1()
            first = engine.generate(prompt, max_new_tokens=self.new)
            reuse = engine.generate(prompt, max_new_tokens=self.new, mode="reuse")
            cold = engine.generate(prompt, max_new_tokens=self.new, mode="cold")
            lossless = bool(getattr(engine.quantizer, "lossless", False))
            tol, _ = exactness_promise(engine)
            n = {"lossless": lossless, "prompt_tokens": reuse.prompt_tokens, "first_cached": first.cached_tokens,
                 "cached_tokens": reuse.cached_tokens, "kl_tolerance": tol if lossless else None,
                 **_compare(cold, reuse)}  # fmt: skip
            checks = [(reuse.cached_tokens > 0, "the repeated prompt was not served from the cache"),
                      (_finite(reuse), "non-finite first-token logits")]  # fmt: skip
            if lossless:
                checks += [
                    (n["greedy_match"], f"greedy differs from cold at token {n['first_divergence']}"),
                    (_kl_ok(n["first_token_kl"], tol), f"first-token KL {_fmt(n['first_token_kl'])} > {tol:g}"),
                ]
            summary = (f"{'lossless' if lossless else 'lossy (reported only)'}: {reuse.cached_tokens}/"
                       f"{reuse.prompt_tokens} cached, KL vs cold {_fmt(n['first_token_kl'])}, max|dlogit| "
                       f"{_fmt(n['max_abs_logit_diff'])}, greedy {'=' if n['greedy_match'] else '!='} cold"
                       + ("" if n["greedy_match"] else f" (first differs at {n['first_divergence']})"))  # fmt: skip
            return verdict(n, checks, summary)

        return self.run_engine({"quant": name}, body)

    def cell_attn(self, name: str) -> tuple[str, dict]:
        import torch

        from kvboost.registry import ATTENTION

        backend = ATTENTION.build(name)
        try:
            backend.check_available()
            backend.check_model(self.model)
        except Exception as exc:  # noqa: BLE001 - the backend's own reason: it cannot run on this machine / model
            raise Skip(f"{type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        tiny = False
        if name == "triton" and not torch.cuda.is_available():
            if not self.slow:
                raise Skip(TRITON_SLOW_REASON)
            tiny = True
        summary, n = self.run_engine({"attn": name}, lambda e: self.exact_two_turn(e, tiny=tiny))
        return (summary + (" (one tiny prompt, Triton interpreter)" if tiny else ""), n)

    def cell_cache(self, name: str) -> tuple[str, dict]:
        if name == "memory":
            return self.run_engine({"cache": {"name": "memory"}}, self.exact_two_turn)
        if name == "disk":
            folder = Path(tempfile.mkdtemp(prefix="kvboost-matrix-disk-", dir=self.workdir))
            try:
                return self.restart_tier(name, {"name": "disk", "path": str(folder)})
            finally:
                shutil.rmtree(folder, ignore_errors=True)
        if name == "redis":
            reason = redis_unavailable_reason()
            if reason:
                raise Skip(reason)
            with RedisProcess() as server:  # a private redis-server on a free loopback port, removed after
                return self.restart_tier(name, {"name": "redis", "url": server.url,
                                                "namespace": f"matrix{os.getpid()}"})  # fmt: skip
        # A tier this script does not know: it runs behind memory with its defaults, or is skipped when it needs
        # arguments the matrix cannot guess.
        from kvboost.registry import CACHE_TIERS

        factory = CACHE_TIERS.get(name)
        required = [p.name for p in inspect.signature(factory).parameters.values()
                    if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]  # fmt: skip
        if required:
            raise Skip(f"the matrix has no configuration for tier {name!r} (it requires {required})")
        return self.restart_tier(name, {"name": name})

    def restart_tier(self, name: str, spec: dict[str, Any]) -> tuple[str, dict]:
        """Turn 1 on one engine (closed: pending writes flushed), turn 2 on a new one whose memory tier is empty:
        the history comes from tier ``name``."""
        cache = [{"name": "memory"}, spec]
        first = self.turn1()
        r1 = self.run_engine({"cache": cache}, lambda e: e.generate(first, max_new_tokens=self.new))
        second = self.turn2(first, r1.output_text)

        def body(engine: Any) -> tuple[str, dict]:
            from kvboost.quality import exactness_promise

            reuse = engine.generate(second, max_new_tokens=self.new, mode="reuse")
            cold = engine.generate(second, max_new_tokens=self.new, mode="cold")
            stats = engine.cache_stats()
            hits = int(stats["per_tier_hits"].get(name, 0))
            tol, _ = exactness_promise(engine)
            n = {"prompt_tokens": reuse.prompt_tokens, "cached_tokens": reuse.cached_tokens, "tier_hits": hits,
                 "per_tier_hits": dict(stats["per_tier_hits"]), "kl_tolerance": tol, **_compare(cold, reuse)}  # fmt: skip
            summary = (f"new engine: {reuse.cached_tokens}/{reuse.prompt_tokens} cached ({hits} {name} hits), greedy "
                       f"{'=' if n['greedy_match'] else '!='} cold, KL {_fmt(n['first_token_kl'])}")  # fmt: skip
            return verdict(n, [
                (reuse.cached_tokens > 0, f"nothing served after the restart (tier hits {n['per_tier_hits']})"),
                (hits > 0, f"no hit in the {name} tier"),
                (n["greedy_match"], f"greedy differs from cold at token {n['first_divergence']}"),
                (_kl_ok(n["first_token_kl"], tol), f"first-token KL {_fmt(n['first_token_kl'])} > {tol:g}"),
            ], summary)  # fmt: skip

        return self.run_engine({"cache": cache}, body)

    def speculative_requests(self, engine: Any, new: int) -> list[Any]:
        """The quoting prompt, then a second turn that continues its answer (served partly from the cache)."""
        first = self.turn1(question=self.prompts.quoting)
        r1 = engine.generate(first, max_new_tokens=new)
        return [r1, engine.generate(self.turn2(first, r1.output_text), max_new_tokens=new)]

    def cell_speculative(self, name: str) -> tuple[str, dict]:
        new = max(16, self.new)  # room for a few drafts
        if self._plain_speculative is None:
            plain = self.run_engine({"speculative": "none"}, lambda e: self.speculative_requests(e, new))
            self._plain_speculative = (plain[0].output_ids, plain[1].output_ids)
        options: dict[str, Any] = {"speculative": name}
        note = ""
        if name == "draft_model":
            from kvboost.speculative.draft_model import DraftModel

            # A loaded model drafts (no other checkpoint): a copy of the target's weights (the draft installs its
            # own attention backend and runner on the model it is given, so not the target object itself).
            options["speculative"] = DraftModel(model=copy.deepcopy(self.model))
            note = " (draft = a copy of the target's weights)"

        def body(engine: Any) -> tuple[str, dict]:
            rows = self.speculative_requests(engine, new)
            stats = {k: sum(float(r.extra.get(k, 0.0)) for r in rows) for k in ("drafted_tokens", "accepted_tokens")}
            rate = stats["accepted_tokens"] / stats["drafted_tokens"] if stats["drafted_tokens"] else None
            ids = [r.output_ids for r in rows]
            n = {"new_tokens": new, "plain_ids": [list(x) for x in self._plain_speculative], "ids": ids,
                 "cached_tokens_second": rows[1].cached_tokens, "acceptance_rate": rate, **stats}  # fmt: skip
            same = [a == list(b) for a, b in zip(ids, self._plain_speculative, strict=True)]
            summary = (f"2 requests x {new} tokens: output {'=' if all(same) else '!='} plain greedy; drafted "
                       f"{stats['drafted_tokens']:.0f}, accepted {stats['accepted_tokens']:.0f}"
                       + (f" ({rate:.0%})" if rate is not None else "") + note)  # fmt: skip
            return verdict(n, [(s, (f"request {i + 1} differs from plain greedy: {ids[i]} vs "
                                    f"{list(self._plain_speculative[i])}")) for i, s in enumerate(same)], summary)  # fmt: skip

        try:
            return self.run_engine(options, body)
        finally:
            options.clear()
            gc.collect()

    # -------------------------------------------------------------- driver
    def planned(self, only: Sequence[str] | None = None) -> list[tuple[str, str]]:
        """``(family, plugin)`` for every registered plugin of every family (``only``: ``FAMILY`` or
        ``FAMILY:PLUGIN`` filters)."""
        from kvboost.registry import ALL_REGISTRIES

        families = [f for f in FAMILY_ORDER if f in ALL_REGISTRIES] + [
            f for f in ALL_REGISTRIES if f not in FAMILY_ORDER
        ]
        cells = [(f, name) for f in families for name in ALL_REGISTRIES[f].names()]
        if only:
            unknown = [o for o in only if not any(o == f or o == f"{f}:{n}" for f, n in cells)]
            if unknown:
                raise ValueError(f"--only {unknown}: not a family or FAMILY:PLUGIN of {families}")
            cells = [(f, n) for f, n in cells if f in only or f"{f}:{n}" in only]
        return cells

    def run_cell(self, family: str, plugin: str) -> Cell:
        fn = getattr(self, f"cell_{family}", None)
        start = time.perf_counter()
        tb = None
        numbers: dict[str, Any] = {}
        try:
            if fn is None:
                raise Skip(f"the matrix has no check for the {family!r} family yet")
            detail, numbers = fn(plugin)
            status = "passed"
        except Skip as exc:
            status, detail = "skipped", str(exc)
        except CellFailure as exc:
            status, detail, numbers = "failed", str(exc), exc.numbers
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the matrix goes on
            status, detail = "failed", f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
            tb = traceback.format_exc()
        return Cell(family, plugin, status, detail, round(time.perf_counter() - start, 2), numbers, tb)

    def run(self, only: Sequence[str] | None = None, *, progress: bool = True, verbose: bool = False) -> list[Cell]:
        from tqdm.auto import tqdm

        cells = []
        bar = tqdm(self.planned(only), desc="plugin matrix", unit="cell", disable=not progress, file=sys.stderr)
        for family, plugin in bar:
            bar.set_postfix_str(f"{family}:{plugin}")
            cell = self.run_cell(family, plugin)
            cells.append(cell)
            if progress:
                bar.write(
                    f"{cell.status.upper():7s} {family}:{plugin} ({cell.seconds:.1f} s) {cell.detail}", file=sys.stderr
                )
                if verbose and cell.traceback:
                    bar.write(cell.traceback, file=sys.stderr)
        return cells


def run_matrix(model: Any, tokenizer: Any, identity: str, *, only: Sequence[str] | None = None,
               progress: bool = False, verbose: bool = False, **options: Any) -> list[Cell]:  # fmt: skip
    """The cells for ``model`` (options: those of :class:`Matrix`). The model must not be served by a live engine."""
    return Matrix(model, tokenizer, identity, **options).run(only, progress=progress, verbose=verbose)


def exit_status(cells: Sequence[Cell]) -> int:
    return 1 if any(c.status == "failed" for c in cells) else 0


# ------------------------------------------------------------------------------------------------ report
def markdown_table(cells: Sequence[Cell]) -> str:
    mark = {"passed": "PASS", "skipped": "SKIP", "failed": "**FAIL**"}
    lines = ["| family | plugin | result | s | detail |", "|---|---|---|---:|---|"]
    for c in cells:
        detail = c.detail.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {c.family} | {c.plugin} | {mark[c.status]} | {c.seconds:.1f} | {detail} |")
    return "\n".join(lines)


def counts(cells: Sequence[Cell]) -> dict[str, int]:
    return {s: sum(c.status == s for c in cells) for s in ("passed", "skipped", "failed")}


def report(cells: Sequence[Cell], meta: dict[str, Any]) -> str:
    c = counts(cells)
    machine = meta["machine"]
    return "\n".join([
        "# Plugin matrix", "",
        f"    {meta['command']}", "",
        f"- model: `{meta['model']}` ({meta['identity']}), dtype {meta['dtype']}, {meta['layers']} layers",
        (f"- machine: {machine.get('cpu')} ({machine.get('kind')}), torch {machine.get('torch')}, threads "
         f"{meta['threads']}, cuda {machine.get('cuda')}"),
        (f"- {meta['max_new_tokens']} new tokens per request (speculative: {max(16, meta['max_new_tokens'])}); "
         f"load {meta['load_s']:.1f} s, cells {meta['cells_s']:.1f} s"),
        f"- **{c['passed']} passed, {c['skipped']} skipped, {c['failed']} failed**", "",
        markdown_table(cells), "",
    ])  # fmt: skip


# ------------------------------------------------------------------------------------------------ CLI
def resolve_model(name: str) -> str | None:
    """``smollm2`` / ``bundled`` -> the bundled model (None); a catalog name -> ``gguf:NAME``; else as given."""
    from kvboost.models.catalog import CATALOG

    if name in ("smollm2", "bundled", "none", ""):
        return None
    if name in CATALOG:
        return f"gguf:{name}"
    return name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (bundled), a catalog name, gguf:NAME or a path")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=None, help="chunk size of the chunkers (default theirs)")
    parser.add_argument("--decode", default=None, help="the engines' decode path (default the engine's: auto)")
    parser.add_argument("--only", nargs="*", default=None, help="FAMILY or FAMILY:PLUGIN cells to run (default all)")
    parser.add_argument("--slow", action="store_true", help="also run the Triton interpreter on CPU (one tiny prompt)")
    parser.add_argument("--out", default=None, help="folder for matrix.json / matrix.md")
    parser.add_argument("--verbose", action="store_true", help="print the traceback of a failing cell")
    add_threads_arg(parser)
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)

    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

    from kvboost.env import cpu_features
    from kvboost.models.options import LoadOptions, load_for_engine

    out = Path(args.out) if args.out else RESULTS_DIR / "plugin_matrix" / f"{args.model}_{args.dtype}"
    start = time.perf_counter()
    model, tokenizer, identity, implied = load_for_engine(resolve_model(args.model), dtype=args.dtype, device=None,
                                                          options=LoadOptions(), decode=args.decode)  # fmt: skip
    load_s = time.perf_counter() - start
    print(f"loaded {args.model} ({identity}, {next(model.parameters()).dtype}) in {load_s:.1f} s", file=sys.stderr)
    engine_options = {**implied, **({"decode": args.decode} if args.decode else {})}
    start = time.perf_counter()
    cells = run_matrix(model, tokenizer, identity, only=args.only, progress=True, verbose=args.verbose,
                       max_new_tokens=args.max_new_tokens, chunk_size=args.chunk_size, engine_options=engine_options,
                       slow=args.slow)  # fmt: skip
    cells_s = time.perf_counter() - start
    meta = {
        "command": "python -m experiments.checks.plugin_matrix " + shlex.join(sys.argv[1:] if argv is None else argv),
        "model": args.model, "identity": identity, "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "layers": int(model.config.get_text_config(decoder=True).num_hidden_layers), "threads": threads,
        "machine": cpu_features(), "max_new_tokens": args.max_new_tokens, "chunk_size": args.chunk_size,
        "engine_options": engine_options, "slow": args.slow, "load_s": round(load_s, 2), "cells_s": round(cells_s, 2),
        "counts": counts(cells),
    }  # fmt: skip
    text = report(cells, meta)
    write_json(out / "matrix.json", {"meta": meta, "cells": [asdict(c) for c in cells]})
    write_markdown(out / "matrix.md", text)
    print("\n" + text)
    print(f"wrote {out / 'matrix.md'} and matrix.json", file=sys.stderr)
    return exit_status(cells)


if __name__ == "__main__":
    sys.exit(main())
