"""Every call of the original KVBoost API's documentation, run against the bundled model: PASS / FAIL per call.

    python -m experiments.checks.original_api                 # exits 1 if any call fails
    python -m experiments.checks.original_api --max-new-tokens 8 --skip-demo

The calls, as the original project documents them (pythongiant/KVBoost README and API pages): ``from kvboost import
KVBoost``; ``KVBoost.from_pretrained()`` and ``from_pretrained(name, recompute_strategy=..., chunk_size=...,
kv_cache_bits=..., disk_cache_dir=..., max_chunks=..., recompute_ratio=..., recompute_overlap=..., device="cpu")``;
``warm``; ``generate(..., mode=GenerationMode.*)``; ``generate_batch``; ``generate_many``; ``cache_stats``;
``verify_correctness``; ``kvboost.engine.GenerationMode`` / ``RecomputeStrategy``; ``kvboost.kv_quantize.quantize_kv``
/ ``dequantize_kv``; ``kvboost.batch.find_common_chunk_prefix`` / ``broadcast_kv`` / ``group_by_prefix``;
``kvboost.compat.check_model_compatibility`` / ``SUPPORTED_ARCHITECTURES``; ``python -m
kvboost.streaming.demo_speculative``. Each is checked for what it promises, not only that it returns. The engine
is the default configuration (``from_pretrained()``: bundled SmolLM2-135M-Instruct, ``dtype="auto"``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

from experiments.common import REPO_ROOT

SYSTEM = ("You are a helpful coding assistant. Always be concise, answer with working code, and explain each step "
          "in one short sentence. Prefer the standard library. ") * 3  # fmt: skip
QUESTIONS = ["How do I reverse a linked list?", "How do I read a CSV file?", "What is a Python generator?"]

results: list[tuple[str, bool, str]] = []


def check(name: str, fn: Callable[[], str]) -> None:
    """Run one call; PASS when it returns (its line says what it showed), FAIL on any exception."""
    start = time.perf_counter()
    try:
        detail, ok = fn(), True
    except Exception as exc:  # every failure is reported, the script goes on
        detail, ok = f"{type(exc).__name__}: {exc}".splitlines()[0][:300], False
        if "--verbose" in sys.argv:
            traceback.print_exc()
    seconds = time.perf_counter() - start
    results.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}  ({seconds:.1f} s)  {detail}", flush=True)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def original_prompt(question: str) -> str:
    """The original README's prompt layout: the warmed prefix, then the user turn, raw text."""
    return f"{SYSTEM}\n\nUser: {question}\nAssistant:"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--skip-demo", action="store_true", help="skip python -m kvboost.streaming.demo_speculative")
    parser.add_argument("--verbose", action="store_true", help="print the traceback of a failing call")
    args = parser.parse_args(argv)
    new = args.max_new_tokens
    state: dict[str, Any] = {}

    def imports() -> str:
        import kvboost.engine
        from kvboost import KVBoost

        require(KVBoost is kvboost.engine.InferenceEngine, "KVBoost is not kvboost.engine.InferenceEngine")
        state["KVBoost"] = KVBoost
        return "from kvboost import KVBoost; KVBoost is kvboost.engine.InferenceEngine"

    def enums() -> str:
        from kvboost.engine import GenerationMode, RecomputeStrategy
        from kvboost.registry import RECOMPUTE

        require([m.name for m in GenerationMode] == ["BASELINE", "PREFIX_CACHE", "CHUNK_KV_REUSE"], "GenerationMode")
        require({"SELECTIVE", "CACHEBLEND", "NONE"} <= set(RecomputeStrategy.__members__), "RecomputeStrategy")
        require(all(s.plugin in RECOMPUTE for s in RecomputeStrategy), "a strategy without a plugin")
        return (f"GenerationMode {[m.name for m in GenerationMode]}; RecomputeStrategy "
                f"{ {s.name: s.plugin for s in RecomputeStrategy} }")  # fmt: skip

    def bad_keyword() -> str:
        start = time.perf_counter()
        try:
            state["KVBoost"].from_pretrained(recompute_strategy="cachebland")
        except ValueError as exc:
            first = time.perf_counter() - start
            require("cacheblend" in str(exc), "the error does not list the strategies")
        else:
            raise AssertionError("a misspelt strategy was accepted")
        try:
            state["KVBoost"].from_pretrained(chunk_sise=128)
        except TypeError as exc:
            require("chunk_size" in str(exc), "the error does not list the accepted keywords")
        else:
            raise AssertionError("an unknown keyword was accepted")
        require(first < 5.0, f"the bad keyword took {first:.1f} s to fail (a model load?)")
        return f"recompute_strategy='cachebland' and chunk_sise= refused in {first * 1000:.0f} ms, before any load"

    def load_default() -> str:
        start = time.perf_counter()
        engine = state["KVBoost"].from_pretrained()
        state["engine"] = engine
        dtype = next(engine.model.parameters()).dtype
        return f"bundled model loaded in {time.perf_counter() - start:.1f} s, dtype {dtype}"

    def load_original_keywords() -> str:
        with tempfile.TemporaryDirectory() as folder:
            engine = state["KVBoost"].from_pretrained(
                None, recompute_strategy="cacheblend", chunk_size=128, kv_cache_bits=8, disk_cache_dir=folder,
                max_chunks=64, recompute_ratio=0.15, recompute_overlap=16, device="cpu",
            )  # fmt: skip
            try:
                tiers = [t["tier"] for t in engine.cache_stats()["tiers"]]
                got = (engine.recompute.registry_name, engine.recompute.ratio, engine.chunker.chunk_size,
                       engine.quantizer.registry_name, tiers)  # fmt: skip
                require(got == ("cacheblend", 0.15, 128, "kivi8", ["memory", "disk"]), f"mapped to {got}")
                r = engine.generate(original_prompt(QUESTIONS[0]), max_new_tokens=new)
                require(r.generated_tokens > 0 or r.output_ids == [], "no result")
            finally:
                engine.close()
        return (f"recompute=cacheblend(ratio 0.15), chunker fixed 128, quant=kivi8, cache={tiers}; a generate ran "
                f"({r.prompt_tokens} prompt tokens)")  # fmt: skip

    def warm() -> str:
        w = state["engine"].warm(SYSTEM)
        require(w.chunks_stored > 0, "nothing stored")
        state["warm"] = w
        return f"{w.prompt_tokens} tokens, {w.chunks_stored} chunks stored in {w.elapsed_ms:.0f} ms"

    def generate_reuse() -> str:
        from kvboost.engine import GenerationMode

        engine = state["engine"]
        prompt = original_prompt(QUESTIONS[0])
        r = engine.generate(prompt, max_new_tokens=new, mode=GenerationMode.CHUNK_KV_REUSE)
        if r.kv_reuse_ratio == 0:
            warmed = engine.tokenize_with_spans(SYSTEM, chat=False)[0]
            starts = engine.tokenize(prompt)[: len(warmed)] == warmed
            raise AssertionError(f"the warmed prefix was not reused ({r.prompt_tokens} prompt tokens); the prompt's "
                                 "ids "
                                 f"{'start' if starts else 'do not start'} with the warmed text's (engine chat="
                                 f"{engine.chat!r}: a plain string is {'' if starts else 'probably '}rendered in "
                                 "the chat template, warm() tokenizes raw text)")  # fmt: skip
        return (f"TTFT {r.ttft_ms:.0f} ms, reuse {r.kv_reuse_ratio:.0%} of {r.prompt_tokens} tokens, "
                f"output {r.output_text!r}")  # fmt: skip

    def generate_prefix() -> str:
        from kvboost.engine import GenerationMode

        prompt = original_prompt(QUESTIONS[1])
        r = state["engine"].generate(prompt, max_new_tokens=new, mode=GenerationMode.PREFIX_CACHE)
        require(r.content_hit_tokens == 0, "content hits in PREFIX_CACHE mode")
        require(r.exact_hit_tokens > 0, "no exact hit of the warmed prefix")
        return f"exact hits {r.exact_hit_tokens} tokens, content hits 0, TTFT {r.ttft_ms:.0f} ms"

    def generate_baseline() -> str:
        from kvboost.engine import GenerationMode

        engine = state["engine"]
        before = engine.cache_stats()["entries"]
        r = engine.generate(original_prompt(QUESTIONS[1]), max_new_tokens=new, mode=GenerationMode.BASELINE)
        require(r.cached_tokens == 0, "the baseline read the cache")
        require(engine.cache_stats()["entries"] == before, "the baseline wrote the cache")
        return f"cold path: 0 cached tokens, nothing stored, TTFT {r.ttft_ms:.0f} ms"

    def generate_batch() -> str:
        rows = state["engine"].generate_batch([original_prompt(q) for q in QUESTIONS[:2]], max_new_tokens=new)
        require(len(rows) == 2 and all(r.prompt_tokens > 0 for r in rows), "rows missing")
        return f"2 rows, reuse {[f'{r.kv_reuse_ratio:.0%}' for r in rows]}"

    def generate_many() -> str:
        prompts = [original_prompt(q) for q in QUESTIONS]
        rows = state["engine"].generate_many(prompts, max_new_tokens=new)
        require([r.prompt_tokens for r in rows] == [len(state["engine"].tokenize(p)) for p in prompts], "order")
        return f"3 rows in the prompts' order, reuse {[f'{r.kv_reuse_ratio:.0%}' for r in rows]}"

    def cache_stats() -> str:
        s = state["engine"].cache_stats()
        require(s["entries"] > 0 and s["requests"] > 0, "empty stats")
        return f"entries {s['entries']}, requests {s['requests']}, reuse_ratio {s['reuse_ratio']:.2f}"

    def verify() -> str:
        report = state["engine"].verify_correctness()
        worst = max((c.first_token_kl for c in report.checks), default=0.0)
        greedy = sum(c.greedy_match for c in report.checks)
        require(report.passed, f"passed=False (greedy equal {greedy}/{len(report.checks)}, first-token KL up to "
                f"{worst:.2g} against {report.kl_tolerance:g})")  # fmt: skip
        return f"passed: greedy equal {greedy}/{len(report.checks)}, first-token KL up to {worst:.2g}"

    def close_engine() -> str:
        state["engine"].close()  # gives the model back (attention backend uninstalled) for the plain HF calls below
        return "closed"

    def model_kv() -> Any:
        if "kv" not in state:
            import torch

            engine = state["engine"]
            ids = engine.tokenizer(SYSTEM, add_special_tokens=False)["input_ids"]
            from kvboost.runtime.hf_generic import output_cache

            with torch.no_grad():
                out = engine.model(torch.tensor([ids]), use_cache=True)
            state["kv"], state["ids"] = output_cache(out), ids
        return state["kv"]

    def kv_quantize() -> str:
        import torch

        from kvboost.kv_quantize import dequantize_kv, quantize_kv

        kv = model_kv()
        layers = [(layer.keys, layer.values) for layer in kv.layers] if hasattr(kv, "layers") else list(kv)
        raw = sum(k.numel() * k.element_size() * 2 for k, _ in layers)
        parts = []
        for bits in (8, 4):
            qkv = quantize_kv(kv, bits=bits)
            out = dequantize_kv(qkv)
            require(len(out) == len(layers) and out[0][0].shape == layers[0][0].shape, "shape")
            keys = torch.stack([k[0] for k, _ in layers])
            values = torch.stack([v[0] for _, v in layers])
            kb, vb = qkv.quantizer.error_bound(keys, values)
            k_err = (torch.stack([k[0] for k, _ in out]).double() - keys.double()).abs()
            v_err = (torch.stack([v[0] for _, v in out]).double() - values.double()).abs()
            require(bool((k_err <= kb).all() and (v_err <= vb).all()), f"int{bits} error above the KIVI bound")
            parts.append(f"int{bits}: {raw / qkv.memory_bytes():.2f}x smaller, max error {float(k_err.max()):.3g}")
        return "; ".join(parts) + " (within the KIVI bound)"

    def batch_helpers() -> str:
        from kvboost.batch import broadcast_kv, find_common_chunk_prefix, group_by_prefix

        tok = state["engine"].tokenizer
        ids = [tok(original_prompt(q), add_special_tokens=False)["input_ids"] for q in QUESTIONS]
        shared = find_common_chunk_prefix(ids, 16)
        n_system = len(tok(SYSTEM, add_special_tokens=False)["input_ids"])
        require(0 < shared <= min(map(len, ids)) and shared % 16 == 0 and shared >= n_system - 16, f"shared {shared}")
        kv = model_kv()
        layers = [(layer.keys, layer.values) for layer in kv.layers] if hasattr(kv, "layers") else list(kv)
        wide = broadcast_kv(layers, 3)
        require(wide[0][0].shape[0] == 3 and wide[0][0].data_ptr() == layers[0][0].data_ptr(), "broadcast copied")
        groups = group_by_prefix(QUESTIONS, ids, chunk_size=16)
        require(list(groups.values()) == [[0, 1, 2]], f"groups {groups}")
        return f"common chunk prefix {shared} tokens; KV broadcast to 3 rows without a copy; 1 prefix group"

    def compat() -> str:
        from transformers import GPT2Config

        from kvboost.compat import SUPPORTED_ARCHITECTURES, check_model_compatibility

        model = state["engine"].model
        check_model_compatibility(model)
        names = {type(model).__name__, *(getattr(model.config, "architectures", None) or ())}
        require(bool(names & SUPPORTED_ARCHITECTURES), "the bundled model's architecture is not listed")
        try:
            check_model_compatibility(GPT2Config())
        except ValueError as exc:
            refused = str(exc).split(";")[0]
        else:
            raise AssertionError("GPT-2 accepted")
        return f"{type(model).__name__} accepted; GPT2LMHeadModel refused ({refused})"

    def demo() -> str:
        cmd = [sys.executable, "-m", "kvboost.streaming.demo_speculative", "--max-new-tokens", str(max(new, 24))]
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
        lines = [line.strip() for line in proc.stdout.splitlines() if ":" in line and "tokens" in line]
        require(proc.returncode == 0 and "outputs match: True" in proc.stdout,
                f"rc {proc.returncode}: {(proc.stdout + proc.stderr).strip()[-300:]}")  # fmt: skip
        return "outputs match; " + " | ".join(lines[:3])

    check("from kvboost import KVBoost", imports)
    if "KVBoost" not in state:
        return 1
    check("kvboost.engine.GenerationMode / RecomputeStrategy", enums)
    check("from_pretrained(bad keyword) fails before loading", bad_keyword)
    check("KVBoost.from_pretrained()", load_default)
    if "engine" not in state:
        return 1
    check("from_pretrained(recompute_strategy, chunk_size, kv_cache_bits, disk_cache_dir, max_chunks, "
          "recompute_ratio, recompute_overlap, device)", load_original_keywords)  # fmt: skip
    check("warm(text)", warm)
    check("generate(mode=GenerationMode.CHUNK_KV_REUSE)", generate_reuse)
    check("generate(mode=GenerationMode.PREFIX_CACHE)", generate_prefix)
    check("generate(mode=GenerationMode.BASELINE)", generate_baseline)
    check("generate_batch(prompts)", generate_batch)
    check("generate_many(prompts)", generate_many)
    check("cache_stats()", cache_stats)
    check("verify_correctness()", verify)
    check("engine.close()", close_engine)
    check("kvboost.kv_quantize.quantize_kv / dequantize_kv", kv_quantize)
    check("kvboost.batch.find_common_chunk_prefix / broadcast_kv / group_by_prefix", batch_helpers)
    check("kvboost.compat.check_model_compatibility / SUPPORTED_ARCHITECTURES", compat)
    if not args.skip_demo:
        check("python -m kvboost.streaming.demo_speculative", demo)
    failed = [name for name, ok, _ in results if not ok]
    print(f"\n{len(results) - len(failed)}/{len(results)} passed" + (f"; FAILED: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
