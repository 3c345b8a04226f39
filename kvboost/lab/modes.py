"""Runner modes: what one request is measured with. One registry, one place for the names.

| runner mode    | what runs                                                     | engine call                      |
| -------------- | ------------------------------------------------------------- | -------------------------------- |
| `baseline`     | HF, cold prefill, DynamicCache growing by concatenation      | -                                |
| `hf_prefix`    | HF carrying the previous request's cache, cut to the common  | -                                |
|                | prefix (the in-process limit of exact prefix reuse)          |                                  |
| `kvboost_cold` | the engine's own path (preallocated KV, its tokenizer, its   | `engine.generate(mode="cold")`   |
|                | attention backend), cache neither read nor written           |                                  |
| `kvboost`      | the engine with its cache (exact + content reuse, recompute) | `engine.generate(mode="reuse")`  |
| `transformers_cb` | transformers' continuous batching (``model.generate_batch``, | -                              |
|                | its paged cache and scheduler) on the same weights; for      |                                  |
|                | ``workload=batch`` (a single request is a batch of one)      |                                  |

``baseline / kvboost_cold`` is what the engine path alone gains (allocation, no concatenation), and
``kvboost_cold / kvboost`` what reuse gains: the summary reports both factors of the total speedup.

A mode factory takes the engine and returns an object with ``generate(prompt, max_new_tokens, *, score_ids,
commit)``, ``generate_batch(prompts, max_new_tokens)`` (``workload=batch``), ``reset()`` and ``warm(text)``
(declared shared context; a no-op for modes without a store). ``commit=False`` runs a measurement without changing
the mode's state (repeats of one request).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvboost.lab.hf_baselines import HFNoCache, HFPrefixCache
from kvboost.prompts import Prompt
from kvboost.registry import Registry
from kvboost.types import GenerationResult

MODES: Registry[Any] = Registry("mode")


class _HFMode:
    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def generate(self, prompt: Prompt, max_new_tokens: int, *, score_ids: Sequence[int] | None = None,
                 commit: bool = True) -> GenerationResult:  # fmt: skip
        return self.runner.generate(prompt, max_new_tokens, score_ids=score_ids, commit=commit)

    def generate_batch(self, prompts: Sequence[Prompt], max_new_tokens: int) -> list[GenerationResult]:
        """HF has no batched path here: the prompts one after another (what serving them without batching costs)."""
        return [self.runner.generate(p, max_new_tokens, commit=False) for p in prompts]

    def reset(self) -> None:
        self.runner.reset()

    def warm(self, text: str) -> None:
        pass


class _EngineMode:
    engine_mode = "reuse"

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def generate(self, prompt: Prompt, max_new_tokens: int, *, score_ids: Sequence[int] | None = None,
                 commit: bool = True) -> GenerationResult:  # fmt: skip
        return self.engine.generate(prompt, max_new_tokens=max_new_tokens, mode=self.engine_mode,
                                    score_ids=score_ids, store=commit)  # fmt: skip

    def generate_batch(self, prompts: Sequence[Prompt], max_new_tokens: int) -> list[GenerationResult]:
        return self.engine.generate_batch(list(prompts), max_new_tokens=max_new_tokens, mode=self.engine_mode)

    def reset(self) -> None:
        self.engine.reset_cache()

    def warm(self, text: str) -> None:
        if self.engine_mode == "reuse":
            self.engine.warm(text, chat=False)  # the workload's shared context is the exact text its prompts hold


class _EngineColdMode(_EngineMode):
    engine_mode = "cold"


@MODES.register("baseline")
def baseline_mode(engine: Any) -> _HFMode:
    """HF cold prefill."""
    return _HFMode(HFNoCache(engine.model, engine.tokenizer, engine.tokenize))


@MODES.register("hf_prefix")
def hf_prefix_mode(engine: Any) -> _HFMode:
    """HF carrying the previous request's cache (one slot, longest common prefix)."""
    return _HFMode(HFPrefixCache(engine.model, engine.tokenizer, engine.tokenize))


@MODES.register("kvboost_cold")
def kvboost_cold_mode(engine: Any) -> _EngineMode:
    """The engine's path without its cache."""
    return _EngineColdMode(engine)


@MODES.register("kvboost")
def kvboost_mode(engine: Any) -> _EngineMode:
    """The engine with its cache."""
    return _EngineMode(engine)


class _TransformersCBMode:
    """transformers' continuous batching on the engine's model (its own paged cache, scheduler and kernels):
    ``model.generate_batch``. Results carry the generated tokens; TTFT is not observable per row (0)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def generate(self, prompt: Prompt, max_new_tokens: int, *, score_ids: Sequence[int] | None = None,
                 commit: bool = True) -> GenerationResult:  # fmt: skip
        """One request through transformers' batching (a batch of one; its TTFT is not observable)."""
        return self.generate_batch([prompt], max_new_tokens)[0]

    def generate_batch(self, prompts: Sequence[Prompt], max_new_tokens: int) -> list[GenerationResult]:
        import time

        from transformers import GenerationConfig

        engine = self.engine
        ids = [engine.tokenize(p) for p in prompts]
        eos = sorted(engine.eos_ids)
        config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=eos if eos else -1, pad_token_id=0)  # fmt: skip
        # transformers' batching runs its own attention implementations only: kvboost's backend steps aside
        # for the call (the kvboost modes' runner calls the backend directly, not through the model)
        engine.attention.uninstall(engine.model)
        try:
            start = time.perf_counter()
            out = engine.model.generate_batch(ids, generation_config=config, warmup=False)
            elapsed_ms = (time.perf_counter() - start) * 1e3
        finally:
            engine.attention.install(engine.model)
        results = []
        for i, prompt_ids in enumerate(ids):
            tokens = list(out[f"req_{i}"].generated_tokens)
            results.append(GenerationResult(
                output_text=engine.tokenizer.decode(tokens, skip_special_tokens=True), output_ids=tokens,
                generated_tokens=len(tokens), ttft_ms=0.0, total_ms=elapsed_ms, store_ms=0.0, tokens_per_sec=0.0,
                prompt_tokens=len(prompt_ids), cached_tokens=0, kv_reuse_ratio=0.0, exact_hit_tokens=0,
                content_hit_tokens=0, mode="transformers_cb", prompt_ids=prompt_ids,
            ))  # fmt: skip
        return results

    def reset(self) -> None:
        pass

    def warm(self, text: str) -> None:
        pass


@MODES.register("transformers_cb")
def transformers_cb_mode(engine: Any) -> _TransformersCBMode:
    """transformers' continuous batching (``workload=batch`` only)."""
    return _TransformersCBMode(engine)
