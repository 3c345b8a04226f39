"""The kvboost engine: composes the plugins into generate(); it does not implement them.

    from kvboost import KVBoost
    engine = KVBoost.from_pretrained()                      # bundled SmolLM2-135M-Instruct
    r1 = engine.generate([{"role": "user", "content": "Hi"}])
    r2 = engine.generate(longer_conversation)               # reuses r1's prompt and answer KV
    print(r2.ttft_ms, r2.kv_reuse_ratio)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvboost.cache.entry import KVEntry
from kvboost.cache.store import KVStore
from kvboost.decoding import Sampling, decode_loop, eos_token_ids, pick_token
from kvboost.lookup import chunk_prompt, common_prefix_length, plan_exact_reuse
from kvboost.models.adapter import ModelAdapter
from kvboost.models.compat import check_architecture
from kvboost.prompts import Prompt, check_length, tokenize_prompt
from kvboost.recompute.base import ReusePlan
from kvboost.registry import ATTENTION, CACHE_TIERS, CHUNKERS, HASHERS, KV_QUANT, RECOMPUTE
from kvboost.types import CorrectnessReport, GenerationResult, PromptCheck, WarmResult

log = logging.getLogger(__name__)

MODES = ("baseline", "chunk_reuse")

DEFAULT_VERIFY_PROMPTS = (
    "The quick brown fox jumps over the lazy dog. " * 6 + "Write one sentence about foxes.",
    "You are a helpful assistant. Answer briefly and precisely.\n\nQuestion: what is the boiling point of water "
    "at sea level, in degrees Celsius and Fahrenheit? Explain why it changes with altitude.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "# Explain what this function returns for n = 10 and why.\n",
)


class InferenceEngine:
    """KV-cache reuse around a HuggingFace causal LM.

    Args:
        model: a loaded decoder-only RoPE causal LM.
        tokenizer: its tokenizer.
        model_identity: names the weights in the cache fingerprint (path or hub id).
        chunker, hasher, cache, recompute, quant, attn: plugin names or configs (``{"name": ..., **kwargs}``)
            or instances; see ``kvboost.registry`` for the families.
        cache: one tier spec, or a list of tier specs fastest first.
        store_generated: also store the KV of generated tokens (a next turn that continues the
            answer reuses it).
        chat: wrap plain-string prompts in the chat template as one user message.
        seed: seed of the sampling generator.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_identity: str | None = None,
        chunker: Any = "fixed",
        hasher: Any = "sha256",
        cache: Any = None,
        recompute: Any = "none",
        quant: Any = "none",
        attn: Any = "sdpa",
        store_generated: bool = True,
        chat: bool = False,
        seed: int = 0,
    ) -> None:
        check_architecture(model.config)
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = ModelAdapter(model, model_identity or getattr(model.config, "_name_or_path", "") or "unnamed")
        self.chunker = CHUNKERS.build(chunker)
        self.hasher = HASHERS.build(hasher)
        self.recompute = RECOMPUTE.build(recompute)
        self.quantizer = KV_QUANT.build(quant)
        self.attention = ATTENTION.build(attn)
        self.attention.install(model)
        tier_specs = cache if isinstance(cache, (list, tuple)) else [cache or {"name": "memory"}]
        self._tier_specs = tier_specs
        self.store = KVStore([CACHE_TIERS.build(spec) for spec in tier_specs])
        self.store_generated = store_generated
        self.chat = chat
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        self.fingerprint = "|".join(
            [
                self.adapter.fingerprint(),
                f"kvq={self.quantizer.fingerprint()}",
                f"chunk={self.chunker.fingerprint()}",
                f"hash={self.hasher.fingerprint()}",
            ]
        )
        self._requests = 0
        self._prompt_tokens = 0
        self._cached_tokens = 0

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str | None = None,
        *,
        dtype: str | torch.dtype | None = "float32",
        device: str | None = None,
        **options: Any,
    ) -> InferenceEngine:
        """Load a model (``None``: the bundled SmolLM2-135M-Instruct) and build the engine around it."""
        from kvboost.models.loading import load_model_and_tokenizer

        model, tokenizer, path = load_model_and_tokenizer(model_name_or_path, dtype=dtype, device=device)
        return cls(model, tokenizer, model_identity=path if model_name_or_path is None else str(model_name_or_path), **options)

    # ------------------------------------------------------------------ public API
    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt (string, chat messages or ids), validated against the context."""
        ids = tokenize_prompt(self.tokenizer, prompt, chat=self.chat)
        check_length(len(ids), self.adapter.max_positions, self.model.config.get_text_config(decoder=True).vocab_size, ids)
        return ids

    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int = 64,
        mode: str = "chunk_reuse",
        temperature: float = 1.0,
        do_sample: bool = False,
        keep_logits: bool = True,
    ) -> GenerationResult:
        """Generate an answer to ``prompt``.

        ``mode="chunk_reuse"`` serves what it can from the cache and stores the new chunks;
        ``mode="baseline"`` is a cold prefill that neither reads nor writes the cache.
        TTFT runs from this call to the first token id (DESIGN.md invariant 4); storing is timed
        apart (``store_ms``) and counted in ``total_ms``.
        """
        t0 = time.perf_counter()
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; use one of {MODES}")
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        sampling = Sampling(do_sample=do_sample, temperature=temperature)
        ids = self.tokenize(prompt)
        t_tokenized = time.perf_counter()

        with torch.inference_mode():
            if mode == "baseline":
                plan = ReusePlan(ids, [], 0)
                recomputed = 0
            else:
                spans, keys = chunk_prompt(ids, self.chunker, self.hasher, self.fingerprint)
                # At least one prompt token must be run to get the next-token logits.
                plan = plan_exact_reuse(ids, spans, keys, self.store, self.quantizer, max_reuse=len(ids) - 1)
                outcome = self.recompute.repair(plan, self.adapter)
                plan, recomputed = outcome.plan, outcome.recomputed_token_layers
            # Room for the prompt and every token we may generate: no reallocation, no per-step copies.
            cache = self.adapter.cache_for(plan.segments, capacity=len(ids) + max_new_tokens)
            t_assembled = time.perf_counter()
            suffix = torch.tensor(ids[plan.reused_tokens :], dtype=torch.long)
            logits = self.adapter.forward(suffix, cache)[-1]
            first = pick_token(logits, sampling, self.generator)
            t_first = time.perf_counter()
            ttft = t_first - t0

            decoded = decode_loop(
                lambda tok: self.adapter.forward(torch.tensor([tok]), cache)[-1],
                first,
                max_new_tokens=max_new_tokens,
                eos_ids=self.eos_ids,
                sampling=sampling,
                generator=self.generator,
                max_total_tokens=self.adapter.max_positions,
                tokens_so_far=len(ids),
            )
            store_s = 0.0
            if mode == "chunk_reuse":
                t_store = time.perf_counter()
                seq = ids + (decoded.token_ids[:-1] if self.store_generated else [])
                seq = seq[: self.adapter.cache_length(cache)]
                self._store_sequence(seq, cache)
                store_s = time.perf_counter() - t_store
        total = time.perf_counter() - t0

        out_ids = decoded.token_ids
        self._requests += 1
        self._prompt_tokens += len(ids)
        self._cached_tokens += plan.reused_tokens
        n_layers = self.adapter.num_layers
        return GenerationResult(
            output_text=self.tokenizer.decode(out_ids, skip_special_tokens=True),
            output_ids=out_ids,
            generated_tokens=len(out_ids),
            ttft_ms=ttft * 1e3,
            total_ms=total * 1e3,
            store_ms=store_s * 1e3,
            tokens_per_sec=(len(out_ids) - 1) / decoded.decode_seconds if decoded.decode_seconds > 0 else 0.0,
            prompt_tokens=len(ids),
            cached_tokens=plan.reused_tokens,
            kv_reuse_ratio=plan.reused_tokens / len(ids),
            exact_hit_tokens=plan.exact_hit_tokens if plan.reused_tokens else 0,
            content_hit_tokens=plan.content_hit_tokens,
            mode=mode,
            recompute_ratio=recomputed / (len(ids) * n_layers),
            prompt_ids=ids,
            first_token_logits=logits.detach().float().cpu() if keep_logits else None,
            extra={
                # Where TTFT went: tokenize | chunk+hash+lookup+assemble+repair | suffix prefill.
                "tokenize_ms": (t_tokenized - t0) * 1e3,
                "lookup_ms": (t_assembled - t_tokenized) * 1e3,
                "prefill_ms": (t_first - t_assembled) * 1e3,
                "prefill_tokens": len(ids) - plan.reused_tokens,
            },
        )

    def warm(self, text: Prompt, *, pin: bool = False) -> WarmResult:
        """Compute and store the KV of ``text`` (e.g. a shared system prompt) without generating.

        Reuses whatever is already cached; ``pin=True`` protects the entries from eviction.
        Text is tokenized as is (no chat template), so warm the exact leading text later prompts share.
        """
        t0 = time.perf_counter()
        ids = tokenize_prompt(self.tokenizer, text, chat=False)
        check_length(len(ids), self.adapter.max_positions)
        with torch.inference_mode():
            spans, keys = chunk_prompt(ids, self.chunker, self.hasher, self.fingerprint)
            plan = plan_exact_reuse(ids, spans, keys, self.store, self.quantizer, max_reuse=len(ids))
            if plan.reused_tokens == len(ids):
                stored = 0
            else:
                cache = self.adapter.cache_for(plan.segments, capacity=len(ids))
                self.adapter.forward(torch.tensor(ids[plan.reused_tokens :]), cache)
                stored = self._store_sequence(ids, cache, pin=pin)
            if pin:
                for key in keys:
                    entry = self.store.peek(key.prefix_key)
                    if entry is not None and not entry.pinned:
                        entry.pinned = True
                        self.store.put(entry)
        return WarmResult(
            prompt_tokens=len(ids),
            chunks_stored=stored,
            tokens_stored=len(ids) - plan.reused_tokens,
            already_cached_tokens=plan.reused_tokens,
            elapsed_ms=(time.perf_counter() - t0) * 1e3,
        )

    def cache_stats(self) -> dict[str, Any]:
        """Store occupancy and hit counters, plus request-level reuse since the last reset."""
        return {
            **self.store.summary(),
            "requests": self._requests,
            "prompt_tokens": self._prompt_tokens,
            "cached_tokens": self._cached_tokens,
            "reuse_ratio": self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
            "attention": self.attention.stats(),
            "fingerprint": self.fingerprint,
        }

    def reset_cache(self) -> None:
        """Drop every stored chunk and zero the counters."""
        self.store.clear()
        self.store.stats = type(self.store.stats)()
        self._requests = self._prompt_tokens = self._cached_tokens = 0

    def verify_correctness(
        self,
        prompts: Sequence[Prompt] | None = None,
        *,
        max_new_tokens: int = 16,
        prefix_fraction: float = 0.6,
        kl_tolerance: float = 1e-4,
    ) -> CorrectnessReport:
        """Check that chunk reuse reproduces a cold prefill, prompt by prompt.

        For each prompt: a cold ``baseline`` generation; then, in a scratch store (the engine's own
        cache is left untouched), the first ``prefix_fraction`` of its tokens is stored and the
        prompt is generated with ``chunk_reuse`` (exact hits, a frontier partial hit, a suffix
        prefill, and whatever the configured recompute strategy does). Compared: greedy tokens,
        first-token KL(baseline || reuse), first divergence, max abs first-token logit difference.
        """
        prompts = list(prompts) if prompts is not None else list(DEFAULT_VERIFY_PROMPTS)
        if not prompts:
            raise ValueError("verify_correctness needs at least one prompt")
        saved_store, saved_counters = self.store, (self._requests, self._prompt_tokens, self._cached_tokens)
        checks: list[PromptCheck] = []
        try:
            for prompt in prompts:
                self.store = KVStore([CACHE_TIERS.build({"name": "memory", "capacity": "4GiB"})])
                cold = self.generate(prompt, max_new_tokens=max_new_tokens, mode="baseline")
                ids = cold.prompt_ids
                cut = max(1, int(len(ids) * prefix_fraction))
                self.warm(ids[:cut])
                warm = self.generate(prompt, max_new_tokens=max_new_tokens, mode="chunk_reuse")
                checks.append(compare_generations(prompt, cold, warm))
        finally:
            self.store = saved_store
            self._requests, self._prompt_tokens, self._cached_tokens = saved_counters
        return CorrectnessReport(checks=checks, kl_tolerance=kl_tolerance)

    # ------------------------------------------------------------------ internals
    def _store_sequence(self, seq: list[int], cache: Any, *, pin: bool = False) -> int:
        """Store the chunks of ``seq`` (whose KV is in ``cache``) that the store lacks; returns how many."""
        spans, keys = chunk_prompt(seq, self.chunker, self.hasher, self.fingerprint)
        stored = 0
        for span, key in zip(spans, keys):
            if key.prefix_key in self.store:
                continue
            k, v = self.adapter.stacked_slice(cache, span.start, span.end)
            tokens = tuple(seq[span.start : span.end])
            # A stored sibling whose tokens are a prefix of this chunk's is now redundant (an earlier
            # prompt's partial tail): drop it so the frontier finds the longer entry.
            for sibling_key in self.store.children(key.parent_key):
                sibling = self.store.peek(sibling_key)
                if (
                    sibling is not None
                    and not sibling.pinned
                    and sibling.num_tokens < len(tokens)
                    and common_prefix_length(sibling.token_ids, tokens) == sibling.num_tokens
                ):
                    self.store.remove(sibling_key)
            entry = KVEntry(
                key=key.prefix_key,
                content_key=key.content_key,
                parent_key=key.parent_key,
                token_ids=tokens,
                start=span.start,
                payload=self.quantizer.quantize(k, v),
                pinned=pin,
            )
            if self.store.put(entry):
                stored += 1
        return stored


def compare_generations(prompt: Prompt, reference: GenerationResult, candidate: GenerationResult) -> PromptCheck:
    """Quality of ``candidate`` against ``reference`` (same prompt): greedy match, KL, divergence."""
    ref_ids, cand_ids = reference.output_ids, candidate.output_ids
    divergence = common_prefix_length(ref_ids, cand_ids)
    first_divergence = None if divergence == len(ref_ids) == len(cand_ids) else divergence
    kl, max_diff = first_token_kl(reference.first_token_logits, candidate.first_token_logits)
    return PromptCheck(
        prompt=prompt if isinstance(prompt, str) else repr(prompt)[:200],
        greedy_match=first_divergence is None,
        first_token_kl=kl,
        first_divergence=first_divergence,
        reuse_ratio=candidate.kv_reuse_ratio,
        max_abs_logit_diff=max_diff,
    )


def first_token_kl(p_logits: torch.Tensor | None, q_logits: torch.Tensor | None) -> tuple[float, float]:
    """KL(softmax(p) || softmax(q)) in float64 and the max abs logit difference."""
    if p_logits is None or q_logits is None:
        return float("nan"), float("nan")
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    kl = float(torch.sum(p.exp() * (p - q)).clamp_min(0.0))
    return kl, float((p_logits.double() - q_logits.double()).abs().max())


KVBoost = InferenceEngine
