"""The kvboost engine: composes the plugins into generate(); it does not implement them.

    from kvboost import KVBoost
    engine = KVBoost.from_pretrained()                      # bundled SmolLM2-135M-Instruct
    r1 = engine.generate([{"role": "user", "content": "Hi"}])
    r2 = engine.generate(longer_conversation)               # reuses r1's prompt and answer KV
    print(r2.ttft_ms, r2.kv_reuse_ratio)

One request, as data flows: prompt -> chunker (ids and spans; a ``separator`` chunker tokenizes segment by
segment) -> hasher (prefix and segment keys) -> lookup (exact hits, frontier, content hits: ``ReusePlan``) ->
assembly into a preallocated KV (content hits re-rotated to their new positions) -> the recompute strategy's
schedule (validated) -> prefill of what the schedule computes (HF's forward when it is a plain suffix,
layer-wise execution otherwise) -> first token (TTFT stops here) -> decode -> store the new chunks (exact ones
under prefix keys, repaired ones under segment keys only).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from kvboost.cache.entry import KVEntry, segment_only_key
from kvboost.cache.memory import parse_bytes
from kvboost.cache.store import KVStore
from kvboost.decoding import Sampling, decode_loop, eos_token_ids, pick_token
from kvboost.generation import PhaseClock, ReuseCounts, build_result
from kvboost.lookup import common_prefix_length, lookup, write_exact
from kvboost.models.adapter import ModelAdapter
from kvboost.models.compat import UnsupportedArchitectureError, check_architecture
from kvboost.models.decode_step import DELEGATING_BACKENDS, FusedDecodeStep, choose_decode, make_decode_step
from kvboost.models.graphed_decode import GraphedDecodeStep, GraphedPrefill
from kvboost.models.layerwise import LayerwiseModel
from kvboost.models.prealloc_cache import PreallocatedKV
from kvboost.models.prefill_step import StepPrefill, choose_prefill
from kvboost.models.probe import ReaderAttentionProbe, observing
from kvboost.plan import ReusePlan, validate_schedule, validate_selection
from kvboost.prompts import Prompt, PromptError, check_length, check_token_ids, prompt_text_or_ids
from kvboost.quality import compare_generations, continuation_logprob
from kvboost.registry import ATTENTION, CACHE_TIERS, CHUNKERS, DRAFT, HASHERS, KV_QUANT, RECOMPUTE
from kvboost.types import ChunkSpan, CorrectnessReport, GenerationResult, PromptCheck, WarmResult

log = logging.getLogger(__name__)

#: ``generate(mode=...)``: ``reuse`` reads and writes the cache; ``cold`` runs the same engine path (tokenizer,
#: preallocated KV, attention backend) with the cache neither read nor written. The runner calls these modes
#: ``kvboost`` and ``kvboost_cold`` (experiments/modes.py).
MODES = ("reuse", "cold")

#: Attribute on a model served by an engine: a weak reference to that engine.
OWNER_ATTR = "_kvboost_engine"

DEFAULT_VERIFY_PROMPTS = (
    "The quick brown fox jumps over the lazy dog. " * 6 + "Write one sentence about foxes.",
    "You are a helpful assistant. Answer briefly and precisely.\n\nQuestion: what is the boiling point of water "
    "at sea level, in degrees Celsius and Fahrenheit? Explain why it changes with altitude.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "# Explain what this function returns for n = 10 and why.\n",
)


@dataclass
class _Prefill:
    logits: torch.Tensor
    counts: ReuseCounts
    approx_from: int | None  # first position whose KV is not what a cold prefill computes (None: all exact)


class InferenceEngine:
    """KV-cache reuse around a HuggingFace causal LM.

    Args:
        model: a loaded decoder-only RoPE causal LM.
        tokenizer: its tokenizer.
        model_identity: names the weights in the cache fingerprint (path or hub id).
        chunker, hasher, cache, recompute, quant, attn: plugin names or configs (``{"name": ..., **kwargs}``)
            or instances; see ``kvboost.registry`` for the families.
        cache: one tier spec, or a list of tier specs fastest first.
        eviction: eviction policy spec given to every tier that takes one (default: the tier's own).
        store_generated: also store the KV of generated tokens (a next turn that continues the answer reuses it).
        chat: wrap plain-string prompts in the chat template as one user message.
        seed: seed of the sampling generator.
        share_model: serve a model another live engine already serves (same attention backend), instead of
            refusing it.
        max_kv_bytes: refuse a request whose KV buffer (prompt + max new tokens) would exceed this many bytes
            (default: 90% of the free memory of the model's device when the request comes).
        keep_buffer_bytes: largest KV buffer kept for reuse between requests (default 512 MiB).
        decode: how generated tokens run after the first: ``"auto"`` (default: the compiled fused step where the
            model and backend allow, see ``kvboost.models.decode_step.choose_decode``), ``"compiled"``,
            ``"eager"`` (the fused step, not compiled) or ``"hf"`` (HF's forward per token). ``warmup()``
            compiles it before the first request.
        prefill: how the prompt's uncached tokens run when they are one suffix (exact hits only): ``"auto"``
            (default: ``"fused"`` on CPU where the model and backend allow, see
            ``kvboost.models.prefill_step.choose_prefill``), ``"fused"`` (one loop over the layers on the decode
            step's weights, HF's arithmetic to the bit) or ``"hf"`` (HF's forward). Layer-wise content repair
            always runs its own per-layer forward.
        prefill_weights: what the fused prefill multiplies: ``"auto"`` (default: ``"prepacked"`` in bf16 on a CPU
            with native bf16 when the copies take at most 5% of memory, see
            ``kvboost.models.prepack.choose_prefill_weights``), ``"prepacked"`` (copies of the projection
            weights packed once, oneDNN's layout in bf16 and MKL's in fp32: lower TTFT, not HF's bits) or
            ``"plain"`` (the model's own weights, HF's bits).
        speculative: the draft strategy (``DRAFT`` registry, ``kvboost.speculative``): ``"none"`` (default: one
            token per target forward, the plain decode loop), ``"prompt_lookup"``, ``"layer_skip"`` or
            ``"draft_model"``, or a config ``{"name": ..., **fields}``. The target verifies each draft in one
            forward over the request's cache and rolls back past the first rejected token; greedy tokens equal
            plain decoding's. ``GenerationResult.extra`` then carries ``drafted_tokens``, ``accepted_tokens``,
            ``acceptance_rate``, ``target_forwards`` and ``tokens_per_target_forward``.
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
        eviction: Any = None,
        recompute: Any = "none",
        quant: Any = "none",
        attn: Any = "sdpa",
        store_generated: bool = True,
        chat: bool = False,
        seed: int = 0,
        share_model: bool = False,
        max_kv_bytes: int | str | None = None,
        keep_buffer_bytes: int | str = "512MiB",
        decode: str = "auto",
        speculative: Any = "none",
        prefill: str = "auto",
        prefill_weights: str = "auto",
    ) -> None:
        from kvboost.rope import RopeRotator, check_rope_reusable

        # Everything that can fail is built and checked before the caller's model is touched.
        check_architecture(model.config)
        check_rope_reusable(model.config)
        chunker = CHUNKERS.build(chunker)
        hasher = HASHERS.build(hasher)
        recompute = RECOMPUTE.build(recompute)
        recompute.check_model(model.config.get_text_config(decoder=True).num_hidden_layers)
        quantizer = KV_QUANT.build(quant)
        tier_specs = list(cache) if isinstance(cache, (list, tuple)) else [cache or {"name": "memory"}]
        tier_specs, write_through = zip(*(_split_write_through(spec) for spec in tier_specs))
        tiers = [CACHE_TIERS.build(_with_eviction(spec, eviction)) for spec in tier_specs]
        store = KVStore(tiers, write_through=write_through)
        owner = _live_owner(model)
        if owner is not None and not share_model:
            raise RuntimeError(
                "this model is already served by another KVBoost engine (its attention backend is installed in the "
                "model); call close() on that engine first, or pass share_model=True to serve it from both"
            )
        if owner is not None:
            attention = owner.attention
            wanted = attn if isinstance(attn, str) else getattr(attn, "name", None) or dict(attn).get("name")
            if wanted != attention.name:
                raise RuntimeError(
                    f"share_model=True: the model runs attention backend {attention.name!r}, not {wanted!r}; "
                    "engines sharing a model share its backend"
                )
        else:
            attention = ATTENTION.build(attn)
            attention.check_available()
            attention.check_model(model)
        decode_mode, decode_reason = choose_decode(decode, model, attention.name)
        prefill_mode, prefill_reason = choose_prefill(prefill, model, attention, decode_mode)
        weights_mode, weights_reason = _choose_prefill_weights(prefill_weights, prefill_mode, model)
        speculative = DRAFT.build(speculative)
        speculative.bind(model, tokenizer)  # loads a draft model, refuses a misfit (vocabulary, layers)
        try:
            self.rotator: Any = RopeRotator.from_model(model)
            self.content_disabled_reason: str | None = None
        except UnsupportedArchitectureError as exc:
            self.rotator, self.content_disabled_reason = None, str(exc)
        chunker.bind_tokenizer(tokenizer)

        self.model = model
        self.tokenizer = tokenizer
        self.chunker, self.hasher, self.recompute, self.quantizer = chunker, hasher, recompute, quantizer
        self.store = store
        self.store_generated = store_generated
        self.chat = chat
        self.adapter = ModelAdapter(model, model_identity or getattr(model.config, "_name_or_path", "") or "unnamed")
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.max_kv_bytes = parse_bytes(max_kv_bytes) if max_kv_bytes is not None else None
        self.keep_buffer_bytes = parse_bytes(keep_buffer_bytes)
        self._seed = seed
        self.generator = torch.Generator(device=self.adapter.device).manual_seed(seed)
        self._requests = self._prompt_tokens = self._cached_tokens = 0
        self._closed = False

        # Last: the one step that changes the caller's model.
        if owner is None:
            attention.install(model)
            setattr(model, OWNER_ATTR, weakref.ref(self))
        self.attention = attention
        self.layerwise = LayerwiseModel(model, attention)
        self.speculative = speculative
        self.decode_mode, self.decode_reason = decode_mode, decode_reason
        self._decode_step = make_decode_step(
            decode_mode, model, backend=attention if attention.name in DELEGATING_BACKENDS else None
        )
        self.prefill_mode, self.prefill_reason = prefill_mode, prefill_reason
        self.prefill_weights, self.prefill_weights_reason = weights_mode, weights_reason
        self._prefill_step: Any = None
        if prefill_mode == "fused":
            self._prefill_step = StepPrefill(self._decode_step or FusedDecodeStep(model, compile=False),
                                             prepacked=weights_mode == "prepacked", attention=attention)  # fmt: skip
        elif prefill_mode == "graphed":
            graphed = self._decode_step
            self._prefill_step = GraphedPrefill(
                graphed if isinstance(graphed, GraphedDecodeStep) else GraphedDecodeStep(model, compile=True)
            )
        # Tiers that serialise entries (disk) write the fingerprint into each record and check it on read;
        # pending writes (and, spilled, the memory tier's entries) reach a persistent tier at close() or exit.
        self.store.bind_context(
            fingerprint=partial(_engine_fingerprint, weakref.ref(self)),
            quantizer_settings={"name": quantizer.registry_name, "fingerprint": quantizer.fingerprint(),
                                "lossless": bool(getattr(quantizer, "lossless", False))},
        )  # fmt: skip
        self._store_finalizer = weakref.finalize(self, store.close)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        model_name_or_path: str | None = None,
        *,
        dtype: str | torch.dtype | None = "auto",
        device: str | None = None,
        **options: Any,
    ) -> InferenceEngine:
        """Load a model (``None``: the bundled SmolLM2-135M-Instruct) and build the engine around it.

        ``dtype="auto"``: bf16 where the device does bf16 natively (CUDA, CPUs with AMX or AVX-512 BF16), else
        fp32 (``kvboost.models.compute``). Pass ``"float32"`` for reuse equal to a cold prefill within 1e-4.

        ``streaming={"resident_layers": K, "prefetch": True, ...}`` (or ``"none"``, the default) streams the
        non-resident decoder layers' weights from the safetensors files (``kvboost.streaming``); the model then
        decodes through HF's forward (``decode_info()`` says why) and ``engine.streamer`` is its layer streamer.

        ``lm_head="int8"`` replaces the output projection by a weight-only int8 one (``kvboost.models.int8_head``:
        fewer bytes per decode step, as llama.cpp's GGUF files do; logits move by the rounding, K/V do not).

        ``awq_prefill="dense"`` (AWQ int4 models, CPU): forwards of 12 rows or more multiply dequantized copies of
        the int4 weights in the model dtype (2 more bytes per weight) instead of torch's int4 kernel, which does
        not use the matrix units; decoding keeps the int4 kernel (``kvboost.models.awq``, "dense prefill").
        """
        from kvboost.models.awq import set_awq_prefill
        from kvboost.models.int8_head import quantize_lm_head
        from kvboost.models.loading import load_model_and_tokenizer
        from kvboost.streaming import (
            DECODE_REASON,
            load_streamed_model_and_tokenizer,
            streamed_decode,
            streaming_enabled,
        )

        streaming = options.pop("streaming", None)
        lm_head = options.pop("lm_head", None)
        awq_prefill = options.pop("awq_prefill", None)
        if streaming_enabled(streaming):
            model, tokenizer, path = load_streamed_model_and_tokenizer(model_name_or_path, streaming, dtype=dtype,
                                                                       device=device)  # fmt: skip
            if getattr(model, "_kvboost_streamer", None) is not None:  # some layer is streamed
                options["decode"] = streamed_decode(options.get("decode"))
        else:
            model, tokenizer, path = load_model_and_tokenizer(model_name_or_path, dtype=dtype, device=device)
        quantize_lm_head(model, lm_head)
        set_awq_prefill(model, awq_prefill)
        identity = path if model_name_or_path is None else str(model_name_or_path)
        engine = cls(model, tokenizer, model_identity=identity, **options)
        engine.streamer = getattr(model, "_kvboost_streamer", None)
        if engine.streamer is not None:
            engine.decode_reason = DECODE_REASON
        return engine

    def close(self) -> None:
        """Give the model back: uninstall the attention backend (if this engine installed it) and free buffers."""
        if self._closed:
            return
        if _live_owner(self.model) is self:
            self.attention.uninstall(self.model)
            delattr(self.model, OWNER_ATTR)
        self._closed = True
        self.adapter.release_buffers()
        self._prefill_step = None  # its prepacked weight copies, if any, are this engine's own
        self._store_finalizer()  # store.close(): spill into a persistent tier, flush pending writes

    def warmup(self, max_tokens: int | None = None) -> dict[str, Any]:
        """Build what the first request would otherwise build inside its timings: the decode step is compiled
        (and run once) on scratch buffers; on CUDA the graphs of requests up to ``max_tokens`` rows (prompt and
        generated tokens; default 2048) are captured. The cache is not touched. Returns :meth:`decode_info`."""
        steps = [self._decode_step]
        if isinstance(self._prefill_step, GraphedPrefill) and self._prefill_step.step is not self._decode_step:
            steps.append(self._prefill_step.step)
        for step in steps:
            if isinstance(step, GraphedDecodeStep):
                step.warmup(max_tokens=max_tokens or 2048)
            elif step is not None and not step.warmed:
                step.warmup()
        return self.decode_info()

    def decode_info(self) -> dict[str, Any]:
        """How tokens after the first are decoded (mode, why, the compile time paid so far in seconds) and how a
        suffix prefill runs (``prefill``, ``prefill_reason``, ``prefill_weights``, ``prefill_weights_reason``,
        ``awq_prefill``), the bytes of the prepacked weight copies held beside the model's own
        (``packed_weight_bytes``: the prefill's and the attention backend's, so far), and on CUDA the graphs held
        (``cuda_graphs``, ``cuda_graph_capture_s``, ``graph_fallback_reason``)."""
        step = self._decode_step
        mode = self.decode_mode if step is None or step.compiled or self.decode_mode != "compiled" else "eager"
        return {
            "decode": mode,
            "decode_reason": self.decode_reason if step is None or step.fallback_reason is None else step.fallback_reason,
            "decode_compile_s": step.compile_seconds if step is not None else 0.0,
            "prefill": self.prefill_mode,
            "prefill_reason": self.prefill_reason,
            "prefill_weights": self.prefill_weights,
            "prefill_weights_reason": self.prefill_weights_reason,
            "awq_prefill": getattr(self.model, "_kvboost_awq_prefill", None),
            "packed_weight_bytes": (self._prefill_step.packed_bytes if self._prefill_step is not None else 0)
            + int(getattr(self.attention, "packed_bytes", 0)),
            **self._graph_info(),
        }

    def _graph_info(self) -> dict[str, Any]:
        """CUDA graphs held (``(C, T)`` pairs) and the seconds their captures took, where a step is graphed."""
        steps = {id(s): s for s in (self._decode_step, getattr(self._prefill_step, "step", None))
                 if isinstance(s, GraphedDecodeStep)}  # fmt: skip
        if not steps:
            return {}
        return {
            "cuda_graphs": sum(len(s.captured) for s in steps.values()),
            "cuda_graph_capture_s": sum(s.capture_seconds for s in steps.values()),
            "graph_fallback_reason": next((s.fallback_reason for s in steps.values() if s.fallback_reason), None),
        }

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def fingerprint(self) -> str:
        """Model, dtype, weights, KV quantizer, chunker and hasher: part of every cache key (invariant 3)."""
        fp = "|".join(
            [
                self.adapter.fingerprint(),
                f"kvq={self.quantizer.fingerprint()}",
                f"chunk={self.chunker.fingerprint()}",
                f"hash={self.hasher.fingerprint()}",
            ]
            # A backend whose arithmetic gives other bits (batch_invariant) keeps its entries apart; so do
            # prepacked prefill weights (another bf16 kernel: K/V rows that differ in their last bits).
            + ([f"attn={tag}"] if (tag := getattr(self.attention, "fingerprint_tag", "")) else [])
            + (["prefill_weights=prepacked"] if self.prefill_weights == "prepacked" else [])
        )
        self._last_fingerprint = fp  # what the keys being built use; records written now carry it
        return fp

    # ------------------------------------------------------------------ tokenization
    @property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config(decoder=True).vocab_size)

    def tokenize_with_spans(self, prompt: Prompt, *, chat: bool | None = None) -> tuple[list[int], list[ChunkSpan]]:
        """Token ids of a prompt (string, chat messages or ids) and the chunker's spans, validated."""
        what = prompt_text_or_ids(self.tokenizer, prompt, chat=self.chat if chat is None else chat)
        if isinstance(what, str):
            ids, spans = self.chunker.tokenize(self.tokenizer, what)
        else:
            ids, spans = what, None
        check_length(len(ids), self.adapter.max_positions)
        check_token_ids(ids, self.vocab_size)
        return ids, spans if spans is not None else self.chunker.split(ids)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, exactly as ``generate`` sees them (the chunker owns tokenization)."""
        return self.tokenize_with_spans(prompt)[0]

    # ------------------------------------------------------------------ generate
    def generate(
        self,
        prompt: Prompt,
        max_new_tokens: int = 64,
        mode: str = "reuse",
        temperature: float = 1.0,
        do_sample: bool = False,
        keep_logits: bool = True,
        *,
        cache_salt: str = "",
        score_ids: Sequence[int] | None = None,
        store: bool = True,
    ) -> GenerationResult:
        """Generate an answer to ``prompt``.

        ``mode="reuse"`` serves what it can from the cache and stores the new chunks; ``mode="cold"`` runs the
        same path with the cache neither read nor written. TTFT runs from this call to the first token id
        (DESIGN.md invariant 4); storing is timed apart (``store_ms``) and counted in ``total_ms``.

        Args:
            cache_salt: a per-tenant salt that goes into every key (requests with different salts never share
                cache entries).
            score_ids: token ids of a known answer: ``result.extra["answer_logprob"]`` is its teacher-forced
                log-probability after the prompt (computed after the request, not timed).
            store: store the new chunks (``reuse`` mode); False reads without writing (repeated measurements).
        """
        clock = PhaseClock(self.adapter.device)
        if self._closed:
            raise RuntimeError("this engine is closed")
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; use one of {MODES}")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        sampling = Sampling(do_sample=do_sample, temperature=temperature)
        ids, spans = self.tokenize_with_spans(prompt)
        n = len(ids)
        room = (self.adapter.max_positions or n + max_new_tokens) - n
        max_new_tokens = min(max_new_tokens, room)  # never more than the context holds
        self._check_memory(n + max_new_tokens)
        clock.mark("tokenized")

        with torch.inference_mode():
            if mode == "cold":
                plan = ReusePlan.cold(ids, spans)
            else:
                keys = self.hasher.chunk_keys(ids, spans, self.fingerprint, cache_salt)
                plan = lookup(ids, spans, keys, self.store, self.quantizer, max_reuse=n - 1,
                              content=self.rotator is not None)  # fmt: skip
            clock.mark("looked_up")
            kv = self.adapter.allocate(n + max_new_tokens, keep_bytes=self.keep_buffer_bytes)
            pre = self._prefill(plan, kv, clock, check_schedule=mode == "reuse")
            first = pick_token(pre.logits, sampling, self.generator)
            clock.mark("first")

            step = self._decode_step
            if step is not None and step.can_run(kv, n, max_new_tokens):
                step.begin(kv, n, reserve=n + max_new_tokens)
                forward = step
            else:
                step, forward = None, lambda tok: self.adapter.forward(torch.tensor([tok]), kv.cache)[-1]
            if self.speculative.enabled:
                decoded, spec_stats = self._speculative_decode(ids, first, kv, step, max_new_tokens, sampling)
                step = None  # it synced kv itself
            else:
                spec_stats = None
                decoded = decode_loop(
                    forward,
                    first,
                    max_new_tokens=max_new_tokens,
                    eos_ids=self.eos_ids,
                    sampling=sampling,
                    generator=self.generator,
                    max_total_tokens=self.adapter.max_positions,
                    tokens_so_far=n,
                )
            if step is not None:
                step.finish(kv)  # the fused step wrote the rows; HF's cache objects now see them
            clock.mark("decoded")
            if mode == "reuse" and store:
                seq = ids + (decoded.token_ids[:-1] if self.store_generated else [])
                seq = seq[: kv.length()]
                self._store_sequence(seq, spans, kv, approx_from=pre.approx_from, salt=cache_salt)
            clock.mark("end")
            extra: dict[str, Any] = spec_stats.as_extra(self.speculative.registry_name) if spec_stats else {}
            if score_ids is not None:
                kv.set_length(n)
                extra["answer_logprob"] = continuation_logprob(
                    pre.logits, list(score_ids),
                    lambda toks: self.adapter.forward(torch.tensor(toks), kv.cache, logits_to_keep=len(toks)),
                )  # fmt: skip

        self._requests += 1
        self._prompt_tokens += n
        self._cached_tokens += pre.counts.cached_tokens
        extra.update({
            # Where TTFT went: tokenize | chunk + hash + lookup | assembly + schedule + prefill.
            "tokenize_ms": clock.ms("start", "tokenized"),
            "lookup_ms": clock.ms("tokenized", "looked_up"),
            "assemble_ms": clock.ms("looked_up", "assembled"),
            "prefill_ms": clock.ms("assembled", "first"),
        })  # fmt: skip
        return build_result(
            tokenizer=self.tokenizer, mode=mode, ids=ids, decoded=decoded, first_logits=pre.logits, clock=clock,
            counts=pre.counts, num_layers=self.adapter.num_layers, store_ms=clock.ms("decoded", "end"),
            keep_logits=keep_logits, extra=extra,
        )  # fmt: skip

    def _speculative_decode(
        self, ids: list[int], first: int, kv: PreallocatedKV, step: Any, max_new_tokens: int, sampling: Sampling
    ) -> tuple[Any, Any]:
        """Decode after ``first`` with the draft strategy (``kvboost.speculative.verify``); steps with nothing
        drafted run the fused step when it can. Leaves ``kv`` holding exactly ``ids + tokens[:-1]``."""
        from kvboost.speculative.verify import speculative_decode

        def plain_step(token: int) -> torch.Tensor:
            step.begin(kv, kv.length())
            logits = step(token)
            step.finish(kv)
            return logits

        return speculative_decode(
            self.speculative, prompt_ids=ids, first_token=first, kv=kv, adapter=self.adapter,
            plain_step=plain_step if step is not None else None, max_new_tokens=max_new_tokens,
            eos_ids=self.eos_ids, sampling=sampling, generator=self.generator,
            max_total_tokens=self.adapter.max_positions, decode_step=step,
        )  # fmt: skip

    # ------------------------------------------------------------------ prefill
    def _prefill(self, plan: ReusePlan, kv: PreallocatedKV, clock: PhaseClock, *, check_schedule: bool) -> _Prefill:
        """Assemble the plan into ``kv``, run the recompute strategy's schedule, return the last logits."""
        n, num_layers = len(plan), self.adapter.num_layers
        device = self.adapter.device
        ids = torch.tensor(plan.prompt_ids, dtype=torch.long)
        for p in plan.placements:
            if p.kind == "exact":
                write_exact(kv, p, self.quantizer)
        counts = ReuseCounts(cached_tokens=plan.reused_tokens, exact_tokens=plan.exact_tokens,
                             content_tokens=plan.content_tokens)  # fmt: skip
        frontier = plan.exact_prefix
        probed = False
        if plan.content_tokens:
            reference = self._reference_deviation(plan, kv) if self.recompute.needs_reference else None
            plan.reference_deviation = reference
            if check_schedule and self.recompute.needs_reader_attention:
                self._assemble_content(plan, kv)
                clock.mark("assembled")
                plan.reader_attention = self._reader_attention(plan, kv, ids)
                clock.mark("probed")
                counts.extra["probe_ms"] = clock.ms("assembled", "probed")
                probed = True
        schedule = self.recompute.schedule(plan, num_layers) if check_schedule else None
        positions = validate_schedule(schedule, plan, num_layers, self.recompute.registry_name) if schedule else None
        if positions is None or (not schedule.check_layers and positions.numel() == n - frontier):
            # A plain suffix [frontier, n): HF's own forward, with the exact prefix as past.
            clock.mark("assembled")
            kv.set_length(frontier)
            logits = self._forward_suffix(ids[frontier:], frontier, kv)
            counts.recomputed_pairs = plan.content_tokens * num_layers
            counts.extra.update(prefill_tokens=n - frontier, layerwise=False)
            if schedule is not None and schedule.full_prefill_cost and plan.content_tokens:
                counts.recomputed_pairs = plan.reused_tokens * num_layers  # it ran a full prefill to decide
            return _Prefill(logits, counts, approx_from=None)

        if not probed:
            self._assemble_content(plan, kv)
            clock.mark("assembled")
        elif max(self.recompute.reader_layers(num_layers)) == num_layers - 1:
            # The probe computed every new token before the first content hit, at every layer, over exact rows
            # only (attention is causal): those rows are final; the real pass need not compute them again.
            first_content = int(plan.positions("content")[0])
            counts.extra["probe_kept_tokens"] = int((positions < first_content).sum())
            positions = positions[positions >= first_content]
        content_mask = plan.kinds == 1
        strategy = self.recompute

        def on_check(layer: int, candidates: torch.Tensor, deviation: dict[str, torch.Tensor]) -> torch.Tensor:
            chosen = strategy.select(plan, layer, candidates, deviation)
            return validate_selection(chosen, candidates, strategy.registry_name, layer)

        logits, stats = self.layerwise.prefill(
            ids.to(device), kv, positions, content_mask=content_mask,
            check_layers=schedule.check_layers, on_check=on_check,
        )  # fmt: skip
        # Layers up to the last check layer rank tokens (all candidates computed there); later layers blend.
        blend_from = max(schedule.check_layers) + 1 if schedule.check_layers else 0
        per_layer = stats.content_per_layer
        check_pairs, blend_pairs = sum(per_layer[:blend_from]), sum(per_layer[blend_from:])
        counts.recomputed_pairs = check_pairs + blend_pairs
        if schedule.full_prefill_cost:
            counts.recomputed_pairs = plan.reused_tokens * num_layers
        blend_layers = num_layers - blend_from
        counts.extra.update(
            prefill_tokens=int(positions.numel()),
            layerwise=True,
            check_layer_recompute_ratio=check_pairs / (n * num_layers),
            # Fraction of content-hit tokens recomputed in the layers after the check layers: what a ratio sets.
            content_recompute_fraction=blend_pairs / (plan.content_tokens * blend_layers)
            if plan.content_tokens and blend_layers else 0.0,
        )
        approx = content_mask & ~torch.isin(torch.arange(n), stats.final_positions)
        hits = torch.nonzero(approx, as_tuple=False)
        return _Prefill(logits, counts, approx_from=int(hits[0]) if hits.numel() else None)

    def _forward_suffix(self, ids: torch.Tensor, start: int, kv: PreallocatedKV) -> torch.Tensor:
        """Run ``ids`` after the ``start`` rows of ``kv`` (the prefill option's path); returns the last logits."""
        if self._prefill_step is None or not self._prefill_step.fits(start, int(ids.numel())):
            return self.adapter.forward(ids, kv.cache)[-1]
        logits = self._prefill_step(ids, start, kv)
        kv.set_length(start + int(ids.numel()))
        self.attention.kernel_calls += self.adapter.num_layers  # one SDPA call per layer, as HF's forward counts
        return logits

    def _assemble_content(self, plan: ReusePlan, kv: PreallocatedKV) -> None:
        """Write every content hit into ``kv``, its keys re-rotated to their new positions."""
        device = self.adapter.device
        for p in plan.placements:
            if p.kind == "content":
                keys = p.keys.to(device=device, dtype=kv.keys.dtype)
                kv.write(p.start, self.rotator.rotate(keys, p.shift) if p.shift else keys, p.values)

    def _reader_attention(self, plan: ReusePlan, kv: PreallocatedKV, ids: torch.Tensor) -> torch.Tensor:
        """The probe pass for ``needs_reader_attention`` strategies: compute only the new tokens over the
        assembled (re-rotated) content hits and record what the reader queries, the positions after the last
        content hit, attend to. Returns ``[layers, heads, content]``. The new tokens' K/V it writes are
        computed again by the real pass (the schedule always includes every new position), except those before
        the first content hit when the probe ran every layer: they attended to exact rows only, so ``_prefill``
        keeps them (``probe_kept_tokens``). The probe stops after the last probed layer."""
        n, num_layers = len(plan), self.adapter.num_layers
        layers = tuple(self.recompute.reader_layers(num_layers))
        if not layers or any(not 0 <= layer < num_layers for layer in layers):
            raise ValueError(
                f"recompute strategy {self.recompute.registry_name!r}: reader_layers must name layers in "
                f"[0, {num_layers}), got {list(layers)}"
            )
        content = plan.positions("content")
        new = plan.positions("new")
        readers = new[new > int(content[-1])]
        probe = ReaderAttentionProbe(layers, n, readers)
        with observing(self.attention, probe):  # no layer after the last probed one is needed
            self.layerwise.prefill(ids.to(self.adapter.device), kv, new, content_mask=plan.kinds == 1,
                                   stop_after_layer=max(layers))  # fmt: skip
        return probe.result()[:, :, content]

    def _reference_deviation(self, plan: ReusePlan, kv: PreallocatedKV) -> torch.Tensor:
        """Per content position, the squared K/V error of the re-rotated cached rows against a full prefill,
        summed over layers (for research strategies such as ``oracle``)."""
        device = self.adapter.device
        ref = PreallocatedKV(torch.empty_like(kv.keys[:, :, : len(plan)]), torch.empty_like(kv.values[:, :, : len(plan)]))
        self.adapter.forward(torch.tensor(plan.prompt_ids), ref.cache)
        pos = plan.positions("content")
        total = torch.zeros(pos.numel(), dtype=torch.float32, device=device)
        for p in plan.placements:
            if p.kind != "content":
                continue
            keys = p.keys.to(device=device, dtype=kv.keys.dtype)
            keys = self.rotator.rotate(keys, p.shift) if p.shift else keys
            rows = (pos >= p.start) & (pos < p.end)
            err = (keys.float() - ref.keys[:, :, p.start : p.end].float()).pow(2).mean(dim=(1, 3)).sum(0)
            err += (p.values.float() - ref.values[:, :, p.start : p.end].float()).pow(2).mean(dim=(1, 3)).sum(0)
            total[rows.to(device)] = err
        return total.cpu()

    def _check_memory(self, capacity: int) -> None:
        """Refuse a KV buffer that cannot fit, with the numbers, before allocating it."""
        need = capacity * self.adapter.kv_bytes_per_token()
        limit = self.max_kv_bytes if self.max_kv_bytes is not None else _free_memory_bytes(self.adapter.device)
        if limit is not None and need > limit:
            raise PromptError(
                f"the KV for {capacity} tokens (prompt + max_new_tokens) needs {need / 2**20:.0f} MiB, more than the "
                f"{limit / 2**20:.0f} MiB available; lower max_new_tokens or shorten the prompt"
            )

    # ------------------------------------------------------------------ warm / store
    def warm(self, text: Prompt, *, pin: bool = False, cache_salt: str = "") -> WarmResult:
        """Compute and store the KV of ``text`` (a shared system prompt, a document) without generating.

        The text is tokenized as is (no chat template; through the chunker, so a document gets the ids it has
        inside prompts cut by the ``separator`` chunker) and computed from position 0 with no history: its
        chunks become exact hits for prompts that start with it and content hits (by segment key) anywhere
        else. Reuses whatever exact prefix is already cached; ``pin=True`` protects the entries from eviction.
        """
        clock = PhaseClock(self.adapter.device)
        what = prompt_text_or_ids(self.tokenizer, text, chat=False)
        ids, spans = self.chunker.tokenize(self.tokenizer, what) if isinstance(what, str) else (what, None)
        check_length(len(ids), self.adapter.max_positions, need_answer_room=False)
        check_token_ids(ids, self.vocab_size)
        spans = spans if spans is not None else self.chunker.split(ids)
        n = len(ids)
        with torch.inference_mode():
            keys = self.hasher.chunk_keys(ids, spans, self.fingerprint, cache_salt)
            plan = lookup(ids, spans, keys, self.store, self.quantizer, max_reuse=n, content=False)
            stored = 0
            if plan.reused_tokens < n:
                kv = self.adapter.allocate(n, keep_bytes=self.keep_buffer_bytes)
                for p in plan.placements:
                    if p.kind == "exact":
                        write_exact(kv, p, self.quantizer)
                kv.set_length(plan.exact_prefix)
                # The path a request's suffix prefill takes, so warmed KV has the bits a request would store.
                self._forward_suffix(torch.tensor(ids[plan.exact_prefix :]), plan.exact_prefix, kv)
                stored = self._store_sequence(ids, spans, kv, approx_from=None, salt=cache_salt, pin=pin)
            if pin:
                for key in keys:
                    entry = self.store.peek(key.prefix_key)
                    if entry is not None and not entry.pinned:
                        entry.pinned = True
                        self.store.put(entry)
        clock.mark("end")
        return WarmResult(
            prompt_tokens=n,
            chunks_stored=stored,
            tokens_stored=n - plan.reused_tokens,
            already_cached_tokens=plan.reused_tokens,
            elapsed_ms=clock.ms("start", "end"),
        )

    def _store_sequence(
        self,
        seq: list[int],
        spans: list[ChunkSpan],
        kv: PreallocatedKV,
        *,
        approx_from: int | None,
        salt: str = "",
        pin: bool = False,
    ) -> int:
        """Store the chunks of ``seq`` (whose KV is in ``kv``) that the store lacks; returns how many.

        Only KV equal to a cold prefill is stored under prefix-chained keys (exact): chunks that end at or
        before ``approx_from``. Later chunks were computed after approximate (content-hit) KV: they are stored
        under their segment key only (``exact=False``), for content hits, unless that segment key is stored.
        """
        spans = self.chunker.extend(seq, spans) if spans and spans[-1].end != len(seq) else spans
        keys = self.hasher.chunk_keys(seq, spans, self.fingerprint, salt)
        stored = 0
        chain_broken = False  # an exact chunk no tier took: its descendants would be unreachable orphans
        for span, key in zip(spans, keys):
            exact = approx_from is None or span.end <= approx_from
            if exact and (chain_broken or key.prefix_key in self.store):
                continue
            if not exact and self.store.has_segment(key.segment_key):
                continue
            tokens = tuple(seq[span.start : span.end])
            if exact:
                self._drop_redundant_sibling(key.parent_key, tokens)
            k, v = kv.slice(span.start, span.end)
            entry = KVEntry(
                key=key.prefix_key if exact else segment_only_key(key.segment_key),
                segment_key=key.segment_key,
                parent_key=key.parent_key if exact else None,
                token_ids=tokens,
                start=span.start,
                payload=self.quantizer.quantize(k, v),
                pinned=pin,
                exact=exact,
            )
            if self.store.put(entry):
                stored += 1
            elif exact:
                chain_broken = True
        return stored

    def _drop_redundant_sibling(self, parent_key: str, tokens: tuple[int, ...]) -> None:
        """A stored sibling whose tokens are a strict prefix of ``tokens`` (an earlier prompt's partial tail) is
        redundant once the longer chunk is stored: the frontier match finds the longer one. Only a leaf may go:
        a sibling with children (a segment that ended there, followed by more chunks) would strand them."""
        for sibling_key in self.store.children_with_first_token(parent_key, tokens[0]):
            sibling = self.store.peek(sibling_key)
            if (
                sibling is not None
                and not sibling.pinned
                and sibling.num_tokens < len(tokens)
                and not self.store.has_children(sibling_key)
                and common_prefix_length(sibling.token_ids, tokens) == sibling.num_tokens
            ):
                self.store.remove(sibling_key)

    # ------------------------------------------------------------------ stats and checks
    def cache_stats(self) -> dict[str, Any]:
        """Store occupancy and hit counters, plus request-level reuse since the last reset."""
        summary = self.store.summary()
        return {
            **summary,
            # damaged records a tier below memory found, deleted and reported as misses (recomputed)
            "corrupt_entries_dropped": sum(int(t.get("corrupt_dropped", 0)) for t in summary["tiers"]),
            "requests": self._requests,
            "prompt_tokens": self._prompt_tokens,
            "cached_tokens": self._cached_tokens,
            "reuse_ratio": self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
            "attention": self.attention.stats(),
            "fingerprint": self.fingerprint,
            "content_reuse": self.content_disabled_reason or "enabled",
        }

    def reset_cache(self) -> None:
        """Drop every stored chunk and zero the counters."""
        self.store.clear()
        self.store.stats = type(self.store.stats)()
        self._requests = self._prompt_tokens = self._cached_tokens = 0

    def reseed(self, seed: int | None = None) -> None:
        """Reset the sampling generator (to the constructor's seed by default)."""
        self.generator.manual_seed(self._seed if seed is None else seed)

    def verify_correctness(
        self,
        prompts: Sequence[Prompt] | None = None,
        *,
        max_new_tokens: int = 16,
        prefix_fraction: float = 0.6,
        kl_tolerance: float = 1e-4,
    ) -> CorrectnessReport:
        """Check that exact reuse reproduces a cold prefill, prompt by prompt.

        For each prompt: a ``cold`` generation; then, in a scratch store (the engine's own cache is left
        untouched), the first ``prefix_fraction`` of its tokens is stored and the prompt is generated with
        ``reuse`` (exact hits, a frontier partial hit, a suffix prefill, the configured quantizer and strategy).
        Compared: greedy tokens, first-token KL(cold || reuse), first divergence, max abs logit difference.
        """
        prompts = list(prompts) if prompts is not None else list(DEFAULT_VERIFY_PROMPTS)
        if not prompts:
            raise ValueError("verify_correctness needs at least one prompt")
        saved_store, saved_counters = self.store, (self._requests, self._prompt_tokens, self._cached_tokens)
        checks: list[PromptCheck] = []
        try:
            for prompt in prompts:
                self.store = KVStore([CACHE_TIERS.build({"name": "memory", "capacity": "4GiB"})])
                cold = self.generate(prompt, max_new_tokens=max_new_tokens, mode="cold")
                ids = cold.prompt_ids
                cut = max(1, int(len(ids) * prefix_fraction))
                self.warm(ids[:cut])
                warm = self.generate(ids, max_new_tokens=max_new_tokens, mode="reuse")
                checks.append(compare_generations(prompt, cold, warm))
        finally:
            self.store = saved_store
            self._requests, self._prompt_tokens, self._cached_tokens = saved_counters
        return CorrectnessReport(checks=checks, kl_tolerance=kl_tolerance)


def _split_write_through(spec: Any) -> tuple[Any, bool]:
    """A tier spec without its ``write_through`` flag (a store setting, not the tier's), and the flag."""
    if isinstance(spec, str) or not (isinstance(spec, dict) or type(spec).__module__.startswith("omegaconf")):
        return spec, False
    spec = dict(spec)
    flag = spec.pop("write_through", False)
    if not isinstance(flag, bool):
        raise ValueError(f"cache tier {spec.get('name')!r}: write_through must be true or false, got {flag!r}")
    return spec, flag


def _with_eviction(spec: Any, eviction: Any) -> Any:
    """A tier spec with the engine-wide eviction policy, for tiers that take one and do not name their own."""
    if eviction is None or not isinstance(spec, (str, dict)) and not type(spec).__module__.startswith("omegaconf"):
        return spec
    if isinstance(spec, str):
        spec = {"name": spec}
    spec = dict(spec)
    import inspect

    factory = CACHE_TIERS.get(spec["name"])
    if "eviction" in inspect.signature(factory).parameters and spec.get("eviction") is None:
        spec["eviction"] = eviction
    return spec


def _choose_prefill_weights(requested: str, prefill_mode: str, model: Any) -> tuple[str, str]:
    """The ``prefill_weights`` option resolved for this model (see ``kvboost.models.prepack``)."""
    from kvboost.models.prepack import choose_prefill_weights, plain_projections, projection_bytes

    fused = prefill_mode == "fused"
    layers = model.model.layers if fused else ()
    plain = fused and plain_projections(layers)
    first = next(model.parameters())
    return choose_prefill_weights(
        requested, fused_prefill=fused, plain_projections=plain, dtype=first.dtype, device=first.device,
        weight_bytes=projection_bytes(layers) if plain else 0,
    )  # fmt: skip


def _engine_fingerprint(ref: weakref.ReferenceType[InferenceEngine]) -> str:
    """The fingerprint the engine computed last (the one its current keys hold), without recomputing it."""
    engine = ref()
    if engine is None:
        return ""
    return getattr(engine, "_last_fingerprint", None) or engine.fingerprint


def _live_owner(model: Any) -> InferenceEngine | None:
    ref = getattr(model, OWNER_ATTR, None)
    owner = ref() if ref is not None else None
    return owner if owner is not None and not owner._closed else None


def _free_memory_bytes(device: torch.device) -> int | None:
    """90% of the free memory of ``device`` (None when unknown)."""
    try:
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return int(free * 0.9)
        pages, size = os.sysconf("SC_AVPHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        return int(pages * size * 0.9)
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None


KVBoost = InferenceEngine
