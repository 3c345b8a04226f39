"""HuggingFace baselines measured in the same run as kvboost, on the same token ids.

- ``HFNoCache`` (mode ``baseline``): a cold prefill of the whole prompt every time, HF's ``DynamicCache``
  growing by concatenation: what users compare with.
- ``HFPrefixCache`` (mode ``hf_prefix``): the previous request's ``DynamicCache`` (prompt + answer) is carried
  over and cut to the longest common token prefix with the new prompt: the in-process limit of exact prefix
  reuse with one slot (what llama.cpp's ``reset=True`` or a chat server that keeps one conversation's cache
  does). Its ``reuse_ratio`` is the common prefix / prompt length, the upper bound of exact reuse.

Both tokenize with the engine's tokenizer function (the chunker owns tokenization, so every mode sees the same
ids) inside their timed region, and time TTFT exactly like the engine (``kvboost.generation``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvboost.cache.sequence_store import common_prefix_length
from kvboost.decoding import Sampling, decode_loop, eos_token_ids, pick_token
from kvboost.generation import PhaseClock, ReuseCounts, build_result
from kvboost.models.adapter import ModelAdapter
from kvboost.prompts import Prompt
from kvboost.quality import continuation_logprob
from kvboost.runtime.hf_generic import cache_kwarg
from kvboost.types import GenerationResult


def _new_cache() -> Any:
    from transformers import DynamicCache

    return DynamicCache()


def _cache_length(cache: Any) -> int:
    return cache.get_seq_length() if len(cache.layers) else 0


def _truncated(cache: Any, length: int) -> Any:
    """A new cache viewing the first ``length`` tokens of ``cache`` (no copy)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    out = DynamicCache()
    for src in cache.layers:
        layer = DynamicLayer()
        layer.dtype, layer.device = src.keys.dtype, src.keys.device
        layer.keys, layer.values = src.keys[:, :, :length], src.values[:, :, :length]
        layer.is_initialized = True
        out.layers.append(layer)
    return out


class _HFRunner:
    mode = "?"

    def __init__(self, model: Any, tokenizer: Any, tokenize: Callable[[Prompt], list[int]]) -> None:
        self.adapter = ModelAdapter(model, getattr(model.config, "_name_or_path", ""))
        self.model = model
        self._cache_kw = cache_kwarg(model.forward)
        self.tokenizer = tokenizer
        self.tokenize = tokenize
        self.eos_ids = eos_token_ids(model, tokenizer)

    def _forward(self, ids: list[int], cache: Any, logits_to_keep: int = 1) -> torch.Tensor:
        """HF's forward of ``ids`` after ``cache``'s tokens; the last ``logits_to_keep`` rows' logits (fp32)."""
        out = self.model(input_ids=torch.tensor([ids], device=self.adapter.device), use_cache=True,
                         logits_to_keep=logits_to_keep, **{self._cache_kw: cache})  # fmt: skip
        return out.logits[0, -logits_to_keep:].float()

    def _past_for(self, ids: list[int]) -> tuple[Any, int]:
        """(cache to prefill after, number of prompt tokens it already holds)."""
        return _new_cache(), 0

    def _after(self, ids: list[int], out_ids: list[int], cache: Any) -> None:
        pass

    def reset(self) -> None:
        pass

    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int = 64,
        *,
        score_ids: Sequence[int] | None = None,
        commit: bool = True,
    ) -> GenerationResult:
        """Greedy generation; ``commit=False`` leaves the carried state (hf_prefix) as it was."""
        clock = PhaseClock(self.adapter.device)
        ids = self.tokenize(prompt)
        n = len(ids)
        if self.adapter.max_positions:
            max_new_tokens = min(max_new_tokens, self.adapter.max_positions - n)
        clock.mark("tokenized")
        sampling = Sampling()
        with torch.inference_mode():
            cache, reused = self._past_for(ids)
            clock.mark("looked_up")
            clock.mark("assembled")
            logits = self._forward(ids[reused:], cache)[-1]
            first = pick_token(logits, sampling)
            clock.mark("first")
            decoded = decode_loop(
                lambda tok: self._forward([tok], cache)[-1],
                first,
                max_new_tokens=max_new_tokens,
                eos_ids=self.eos_ids,
                sampling=sampling,
                max_total_tokens=self.adapter.max_positions,
                tokens_so_far=n,
            )
            clock.mark("end")
            if commit:
                self._after(ids, decoded.token_ids, cache)
            extra: dict[str, Any] = {}
            if score_ids is not None:
                scoring = _truncated(cache, n)
                extra["answer_logprob"] = continuation_logprob(
                    logits, list(score_ids),
                    lambda toks: self._forward(list(toks), scoring, logits_to_keep=len(toks)),
                )  # fmt: skip
        counts = ReuseCounts(cached_tokens=reused, exact_tokens=reused, extra={"prefill_tokens": n - reused})
        extra.update({
            "tokenize_ms": clock.ms("start", "tokenized"),
            "lookup_ms": clock.ms("tokenized", "looked_up"),
            "assemble_ms": 0.0,
            "prefill_ms": clock.ms("assembled", "first"),
        })  # fmt: skip
        return build_result(
            tokenizer=self.tokenizer, mode=self.mode, ids=ids, decoded=decoded, first_logits=logits, clock=clock,
            counts=counts, num_layers=self.adapter.num_layers, extra=extra,
        )  # fmt: skip


class HFNoCache(_HFRunner):
    """Cold prefill, no cache kept."""

    mode = "baseline"


class HFPrefixCache(_HFRunner):
    """Carries the last request's cache, cut to the longest common prefix with the new prompt."""

    mode = "hf_prefix"

    def __init__(self, model: Any, tokenizer: Any, tokenize: Callable[[Prompt], list[int]]) -> None:
        super().__init__(model, tokenizer, tokenize)
        self._cache: Any = None
        self._cache_ids: list[int] = []

    def reset(self) -> None:
        self._cache, self._cache_ids = None, []

    def _past_for(self, ids: list[int]) -> tuple[Any, int]:
        if self._cache is None:
            return _new_cache(), 0
        # At least one prompt token must run to produce the next-token logits.
        common = min(common_prefix_length(self._cache_ids, ids), len(ids) - 1)
        if common <= 0:
            return _new_cache(), 0
        # A view of the carried tensors: the forward concatenates into new tensors, so the carried cache is
        # left intact (a request with commit=False does not disturb it).
        return _truncated(self._cache, common), common

    def _after(self, ids: list[int], out_ids: list[int], cache: Any) -> None:
        # The cache holds the prompt and every generated token but the last (never fed back).
        seq = ids + out_ids[:-1]
        self._cache_ids = seq[: _cache_length(cache)]
        self._cache = cache
