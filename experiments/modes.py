"""Runner modes: what one request is measured with. One registry, one place for the names.

| runner mode    | what runs                                                     | engine call                      |
| -------------- | ------------------------------------------------------------- | -------------------------------- |
| `baseline`     | HF, cold prefill, DynamicCache growing by concatenation      | -                                |
| `hf_prefix`    | HF carrying the previous request's cache, cut to the common  | -                                |
|                | prefix (the in-process limit of exact prefix reuse)          |                                  |
| `kvboost_cold` | the engine's own path (preallocated KV, its tokenizer, its   | `engine.generate(mode="cold")`   |
|                | attention backend), cache neither read nor written           |                                  |
| `kvboost`      | the engine with its cache (exact + content reuse, recompute) | `engine.generate(mode="reuse")`  |

``baseline / kvboost_cold`` is what the engine path alone gains (allocation, no concatenation), and
``kvboost_cold / kvboost`` what reuse gains: the summary reports both factors of the total speedup.

A mode factory takes the engine and returns an object with ``generate(prompt, max_new_tokens, *, score_ids,
commit)``, ``reset()`` and ``warm(text)`` (declared shared context; a no-op for modes without a store).
``commit=False`` runs a measurement without changing the mode's state (repeats of one request).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from experiments.hf_baselines import HFNoCache, HFPrefixCache
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

    def reset(self) -> None:
        self.engine.reset_cache()

    def warm(self, text: str) -> None:
        if self.engine_mode == "reuse":
            self.engine.warm(text)


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
