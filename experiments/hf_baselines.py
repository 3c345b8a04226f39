"""HuggingFace baselines measured in the same run as kvboost, on the same prompts.

- ``HFNoCache`` (mode ``baseline``): a cold prefill of the whole prompt every time.
- ``HFPrefixCache`` (mode ``hf_prefix``): the previous request's ``DynamicCache`` (prompt + answer)
  is carried over and cut to the longest common token prefix with the new prompt: the in-process
  limit of exact prefix reuse with one slot (what llama.cpp's ``reset=True`` or a chat server that
  keeps one conversation's cache does). Its ``reuse_ratio`` is the common prefix / prompt length,
  the upper bound of exact reuse on that prompt.

Both time TTFT exactly like the engine: from the call (messages in) to the first token id.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvboost.decoding import Sampling, decode_loop, eos_token_ids, pick_token
from kvboost.lookup import common_prefix_length
from kvboost.models.adapter import ModelAdapter
from kvboost.prompts import Prompt, check_length, tokenize_prompt
from kvboost.types import GenerationResult


class _HFRunner:
    mode = "?"

    def __init__(self, model: Any, tokenizer: Any, *, chat: bool = False) -> None:
        self.adapter = ModelAdapter(model, getattr(model.config, "_name_or_path", ""))
        self.tokenizer = tokenizer
        self.chat = chat
        self.eos_ids = eos_token_ids(model, tokenizer)

    def _past_for(self, ids: list[int]) -> tuple[Any, int]:
        """(cache to prefill after, number of prompt tokens it already holds)."""
        return self.adapter.new_cache(), 0

    def _after(self, ids: list[int], out_ids: list[int], cache: Any) -> None:
        pass

    def generate(self, prompt: Prompt, max_new_tokens: int = 64) -> GenerationResult:
        t0 = time.perf_counter()
        ids = tokenize_prompt(self.tokenizer, prompt, chat=self.chat)
        check_length(len(ids), self.adapter.max_positions)
        t_tok = time.perf_counter()
        sampling = Sampling()
        with torch.inference_mode():
            cache, reused = self._past_for(ids)
            t_past = time.perf_counter()
            logits = self.adapter.forward(torch.tensor(ids[reused:]), cache)[-1]
            first = pick_token(logits, sampling)
            t_first = time.perf_counter()
            decoded = decode_loop(
                lambda tok: self.adapter.forward(torch.tensor([tok]), cache)[-1],
                first,
                max_new_tokens=max_new_tokens,
                eos_ids=self.eos_ids,
                sampling=sampling,
                max_total_tokens=self.adapter.max_positions,
                tokens_so_far=len(ids),
            )
            self._after(ids, decoded.token_ids, cache)
        total = time.perf_counter() - t0
        out = decoded.token_ids
        return GenerationResult(
            output_text=self.tokenizer.decode(out, skip_special_tokens=True),
            output_ids=out,
            generated_tokens=len(out),
            ttft_ms=(t_first - t0) * 1e3,
            total_ms=total * 1e3,
            store_ms=0.0,
            tokens_per_sec=(len(out) - 1) / decoded.decode_seconds if decoded.decode_seconds > 0 else 0.0,
            prompt_tokens=len(ids),
            cached_tokens=reused,
            kv_reuse_ratio=reused / len(ids),
            exact_hit_tokens=reused,
            content_hit_tokens=0,
            mode=self.mode,
            prompt_ids=ids,
            first_token_logits=logits.float().cpu(),
            extra={
                "tokenize_ms": (t_tok - t0) * 1e3,
                "lookup_ms": (t_past - t_tok) * 1e3,
                "prefill_ms": (t_first - t_past) * 1e3,
                "prefill_tokens": len(ids) - reused,
            },
        )


class HFNoCache(_HFRunner):
    """Cold prefill, no cache kept."""

    mode = "baseline"


class HFPrefixCache(_HFRunner):
    """Carries the last request's cache, cut to the longest common prefix with the new prompt."""

    mode = "hf_prefix"

    def __init__(self, model: Any, tokenizer: Any, *, chat: bool = False) -> None:
        super().__init__(model, tokenizer, chat=chat)
        self._cache: Any = None
        self._cache_ids: list[int] = []

    def reset(self) -> None:
        self._cache, self._cache_ids = None, []

    def _past_for(self, ids: list[int]) -> tuple[Any, int]:
        if self._cache is None:
            return self.adapter.new_cache(), 0
        # At least one prompt token must run to produce the next-token logits.
        common = min(common_prefix_length(self._cache_ids, ids), len(ids) - 1)
        if common <= 0:
            return self.adapter.new_cache(), 0
        return self.adapter.truncated(self._cache, common), common

    def _after(self, ids: list[int], out_ids: list[int], cache: Any) -> None:
        # The cache holds the prompt and every generated token but the last (never fed back).
        seq = ids + out_ids[:-1]
        self._cache_ids = seq[: self.adapter.cache_length(cache)]
        self._cache = cache
