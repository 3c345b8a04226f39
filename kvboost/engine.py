"""The kvboost engine: composes the plugins, the KV pool and the model runner; it does not implement them.

    from kvboost import KVBoost
    engine = KVBoost.from_pretrained()                      # bundled SmolLM2-135M-Instruct
    r1 = engine.generate([{"role": "user", "content": "Hi"}])
    r2 = engine.generate(longer_conversation)               # reuses r1's prompt and answer KV
    rows = engine.generate_batch(["Hi", "Tell me a joke."])  # one forward per step for every row
    print(r2.ttft_ms, r2.kv_reuse_ratio)

One request, as data flows: prompt -> chunker (ids and spans) -> hasher (prefix and segment keys) -> lookup (exact
hits, frontier, content hits: ``ReusePlan``) -> assembly into the request's block table (exact hits by reference,
content hits copied and re-rotated: ``kvboost.reuse``) -> the recompute strategy's schedule -> the runner's forward
of what the schedule computes -> first token (TTFT stops here) -> decode (one batched forward per step) -> store the
new chunks (``kvboost.cache.sequence_store``: references to the blocks when the first tier is memory).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from kvboost.cache.build import build_store
from kvboost.cache.memory import parse_bytes
from kvboost.decoding import Sampling, eos_token_ids, per_row
from kvboost.generation import PhaseClock
from kvboost.kv.sizing import make_pool
from kvboost.models.adapter import ModelAdapter
from kvboost.models.compat import UnsupportedArchitectureError, check_architecture
from kvboost.original_api import GenerationMode, RecomputeStrategy, engine_mode, translate_options  # noqa: F401
from kvboost.prompts import Prompt, check_length, check_token_ids, prompt_text_or_ids
from kvboost.quality import verify_correctness
from kvboost.registry import ATTENTION, CHUNKERS, DRAFT, HASHERS, KV_QUANT, RECOMPUTE
from kvboost.runtime import pipeline
from kvboost.runtime.config import build_runner, choose_runner
from kvboost.types import ChunkSpan, CorrectnessReport, GenerationResult, WarmResult

log = logging.getLogger(__name__)

MODES = pipeline.MODES

#: Attribute on a model served by an engine: a weak reference to that engine.
OWNER_ATTR = "_kvboost_engine"

#: ``kv=`` settings: tokens per block, the pool's size (``"auto"`` or bytes), the share of free memory ``auto`` may take.
KV_OPTIONS = ("block_size", "pool_bytes", "memory_fraction")


class InferenceEngine:
    """KV-cache reuse around a HuggingFace causal LM.

    Args:
        model: a loaded decoder-only RoPE causal LM.
        tokenizer: its tokenizer.
        model_identity: names the weights in the cache fingerprint (path or hub id).
        chunker, hasher, cache, recompute, quant, attn, speculative: plugin names or configs (``{"name": ...,
            **kwargs}``) or instances; see ``kvboost.registry`` for the families. ``cache``: one tier spec, or a list
            fastest first; ``eviction``: the policy every tier that takes one gets.
        store_generated: also store the KV of generated tokens (a next turn that continues the answer reuses it).
        store_canonical: with ``store_generated``, after a chat request finished, also store the KV of its answer as
            the next turn's prompt will tokenize it (the answer text re-tokenized inside the chat template, through
            the end-of-turn markup): where those ids differ from the generated ones, the differing rows are
            prefilled on top of the shared prefix (``kvboost.reuse.canonical``), so a next turn reuses the whole
            history instead of stopping where re-tokenization split a word otherwise.
        chat: plain-string prompts: ``None`` (auto) renders them as one user message in the chat template when the
            tokenizer has one (and the text holds none of its markup already); ``True`` always; ``False`` keeps
            them raw (``kvboost.prompts.wants_chat``). Chat messages are always rendered, token ids never.
        seed: seed of the sampling generator.
        share_model: serve a model another live engine already serves (same attention backend: the engines then
            share its KV pool), instead of refusing it.
        max_kv_bytes: refuse a request whose KV (prompt + max new tokens) would exceed this many bytes.
        decode, prefill, prefill_weights: the path (``kvboost.runtime.config.choose_runner``): ``decode`` ``auto`` |
            ``graphed`` (CUDA graphs) | ``compiled`` (inductor) | ``eager`` (HF's bits) | ``hf`` (HF's modules);
            ``prefill`` ``auto`` | ``fused`` | ``graphed`` | ``hf``; ``prefill_weights`` ``auto`` | ``plain`` |
            ``prepacked``.
        kv: the KV pool (``{"block_size": 16, "pool_bytes": "auto", "memory_fraction": None}``, see
            ``kvboost.kv.sizing``).
        keep_buffer_bytes: accepted for compatibility; the pool replaced per-request buffers.
    """

    def __init__(
        self, model: Any, tokenizer: Any, *, model_identity: str | None = None, chunker: Any = "fixed",
        hasher: Any = "sha256", cache: Any = None, eviction: Any = None, recompute: Any = "none", quant: Any = "none",
        attn: Any = "sdpa", store_generated: bool = True, chat: bool | None = None, seed: int = 0,
        share_model: bool = False,
        max_kv_bytes: int | str | None = None, keep_buffer_bytes: int | str | None = None, decode: str = "auto",
        speculative: Any = "none", prefill: str = "auto", prefill_weights: str = "auto", kv: dict | None = None,
        store_canonical: bool = True,
    ) -> None:  # fmt: skip
        from kvboost.rope import RopeRotator, check_rope_reusable

        # Everything that can fail is built and checked before the caller's model is touched.
        check_architecture(model.config)
        check_rope_reusable(model.config)
        kv = dict(kv or {})
        unknown = sorted(set(kv) - set(KV_OPTIONS))
        if unknown:
            raise ValueError(f"unknown kv option(s) {unknown}; accepted: {list(KV_OPTIONS)}")
        chunker, hasher = CHUNKERS.build(chunker), HASHERS.build(hasher)
        recompute = RECOMPUTE.build(recompute)
        recompute.check_model(model.config.get_text_config(decoder=True).num_hidden_layers)
        quantizer = KV_QUANT.build(quant)
        store = build_store(cache, eviction)
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
                raise RuntimeError(f"share_model=True: the model runs attention backend {attention.name!r}, not "
                                   f"{wanted!r}; engines sharing a model share its backend")  # fmt: skip
        else:
            attention = ATTENTION.build(attn)
            attention.check_available()
            attention.check_model(model)
        config = choose_runner(model, attention, decode=decode, prefill=prefill, prefill_weights=prefill_weights)
        speculative = DRAFT.build(speculative)
        speculative.bind(model, tokenizer)  # loads a draft model, refuses a misfit (vocabulary, layers)
        try:
            self.rotator: Any = RopeRotator.from_model(model)
            self.content_disabled_reason: str | None = None
        except UnsupportedArchitectureError as exc:
            self.rotator, self.content_disabled_reason = None, str(exc)
        chunker.bind_tokenizer(tokenizer)

        self.model, self.tokenizer = model, tokenizer
        self.chunker, self.hasher, self.recompute, self.quantizer = chunker, hasher, recompute, quantizer
        self.store, self.store_generated, self.chat, self.speculative = store, store_generated, chat, speculative
        self.store_canonical = bool(store_canonical)
        self.adapter = ModelAdapter(model, model_identity or getattr(model.config, "_name_or_path", "") or "unnamed")
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.max_kv_bytes = parse_bytes(max_kv_bytes) if max_kv_bytes is not None else None
        self._seed = seed
        self.generator = torch.Generator(device=self.adapter.device).manual_seed(seed)
        self._requests = self._prompt_tokens = self._cached_tokens = 0
        self._closed = False
        self.runner_config = config
        self.pool = owner.pool if owner is not None else make_pool(self.adapter, store, kv)
        # Exact entries of the memory tier are references to the pool's blocks when nothing is quantized.
        self._pooled_entries = bool(getattr(quantizer, "lossless", False)) and store.tiers[0].holds_references
        if not self._pooled_entries and quant == "none" and not store.tiers[0].holds_references:
            log.info("kvboost: the first cache tier serialises entries; stored chunks are copies of their rows")

        # Last: the one step that changes the caller's model.
        if owner is None:
            attention.install(model)
            setattr(model, OWNER_ATTR, weakref.ref(self))
            self.pool.on_pressure = partial(_free_blocks, weakref.ref(self))
        self.attention = attention
        shared = owner.runner if owner is not None and owner.runner_config == config else None
        self.runner = shared or build_runner(config, model, self.pool, attention)
        self.layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)
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
    def from_pretrained(cls, model_name_or_path: str | None = None, *, dtype: str | torch.dtype | None = "auto",
                        device: str | None = None, **options: Any) -> InferenceEngine:  # fmt: skip
        """Load a model (``None``: the bundled SmolLM2-135M-Instruct) and build the engine around it.

        ``dtype="auto"``: bf16 where the device does bf16 natively (CUDA, CPUs with AMX or AVX-512 BF16), else
        fp32 (``kvboost.models.compute``). Pass ``"float32"`` for reuse equal to a cold prefill within 1e-4.
        Loading options (``kvboost.models.options``): ``streaming={"resident_layers": K, ...}`` streams decoder
        layers' weights from the safetensors files; ``lm_head="int8"`` a weight-only int8 output projection;
        ``awq_prefill="dense"`` (AWQ int4, CPU) prefills from dequantized copies; ``weights="gguf_int4"`` runs a GGUF
        model's Q4_0/Q4_1/Q4_K linears as shipped in torch's int4 CPU kernel (``kvboost.models.gguf_weights``;
        default ``"dense"``). The rest go to the constructor.
        The original KVBoost keywords (``recompute_strategy``, ``chunk_size``, ``kv_cache_bits``, ``disk_cache_dir``,
        ``max_chunks``, ...) are translated into plugin configs (``kvboost.original_api``). Every keyword is checked
        before any weight is read; an unknown one is refused with the list of accepted ones.
        """
        from kvboost.models.options import LOADING_OPTIONS, LoadOptions, load_for_engine

        model_name_or_path, options, after_load = translate_options(cls, model_name_or_path, options)
        loading = LoadOptions(**{k: options.pop(k) for k in LOADING_OPTIONS if k in options})
        model, tokenizer, identity, implied = load_for_engine(model_name_or_path, dtype=dtype, device=device,
                                                              options=loading, decode=options.get("decode"))  # fmt: skip
        engine = cls(model, tokenizer, model_identity=identity, **{**after_load(model), **implied})
        engine.streamer = getattr(model, "_kvboost_streamer", None)
        return engine

    def close(self) -> None:
        """Give the model back (uninstall the attention backend if this engine installed it), drop the cache's
        block references, flush the persistent tiers."""
        if self._closed:
            return
        if _live_owner(self.model) is self:
            self.attention.uninstall(self.model)
            delattr(self.model, OWNER_ATTR)
        self._closed = True
        self._store_finalizer()  # store.close(): spill into a persistent tier, flush pending writes
        self.store.drop_references()  # the memory tier's block references go back to the pool

    def warmup(self, max_tokens: int | None = None) -> dict[str, Any]:
        """Build what the first request would otherwise build inside its timings: the compiled decode forward
        (and, on CUDA, the graphs of requests up to ``max_tokens`` rows, default 2048). Returns :meth:`decode_info`."""
        self.runner.warmup(max_tokens or 2048)
        return self.decode_info()

    def decode_info(self) -> dict[str, Any]:
        """The runner (``llama`` | ``hf``), how it decodes and prefills and why, the compile time paid so far, the
        bytes of prepacked weight copies, CUDA graphs held, and the KV pool (blocks, bytes, copies made)."""
        described = self.runner.describe()
        reasons = self.runner_config.reasons
        return {
            "runner": self.runner_config.runner,
            "decode": getattr(self.runner, "decode", self.runner_config.decode),
            "decode_reason": self.runner.fallback_reason or reasons.get("decode", ""),
            "decode_compile_s": self.runner.compile_seconds,
            "prefill": "hf" if self.runner_config.runner == "hf" else ("graphed" if self.runner_config.graph_prefill
                                                                       else "fused"),
            "prefill_reason": reasons.get("prefill", reasons.get("runner", "")),
            "prefill_weights": self.runner_config.weights,
            "prefill_weights_reason": reasons.get("weights", ""),
            "awq_prefill": getattr(self.model, "_kvboost_awq_prefill", None),
            "exact": described.get("exact"),
            "packed_weight_bytes": described.get("packed_weight_bytes", 0) + int(getattr(self.attention, "packed_bytes", 0)),
            "forwards": described.get("forwards"),
            "kv_pool": self.pool.describe(),
            **{k: v for k, v in described.items() if k.startswith("cuda_graph") or k == "graph_fallback_reason"},
        }  # fmt: skip

    def __enter__(self) -> InferenceEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def fingerprint(self) -> str:
        """Model, dtype, weights, KV quantizer, chunker and hasher: part of every cache key (invariant 3)."""
        fp = "|".join(
            [self.adapter.fingerprint(), f"kvq={self.quantizer.fingerprint()}", f"chunk={self.chunker.fingerprint()}",
             f"hash={self.hasher.fingerprint()}"]
            # A backend whose arithmetic gives other bits (batch_invariant) keeps its entries apart; so do
            # prepacked weights (another bf16 kernel: K/V rows that differ in their last bits).
            + ([f"attn={tag}"] if (tag := getattr(self.attention, "fingerprint_tag", "")) else [])
            + (["prefill_weights=prepacked"] if self.runner_config.weights == "prepacked" else [])
        )  # fmt: skip
        self._last_fingerprint = fp  # what the keys being built use; records written now carry it
        return fp

    # ------------------------------------------------------------------ tokenization
    @property
    def vocab_size(self) -> int:
        return int(self.model.config.get_text_config(decoder=True).vocab_size)

    def tokenize_with_spans(self, prompt: Prompt, *, chat: bool | None = None) -> tuple[list[int], list[ChunkSpan]]:
        """Token ids of a prompt (string, chat messages or ids) and the chunker's spans, validated."""
        what = prompt_text_or_ids(self.tokenizer, prompt, chat=self.chat if chat is None else chat)
        ids, spans = self.chunker.tokenize(self.tokenizer, what) if isinstance(what, str) else (what, None)
        check_length(len(ids), self.adapter.max_positions)
        check_token_ids(ids, self.vocab_size)
        return ids, spans if spans is not None else self.chunker.split(ids)

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt, exactly as ``generate`` sees them (the chunker owns tokenization)."""
        return self.tokenize_with_spans(prompt)[0]

    # ------------------------------------------------------------------ generate
    def generate(
        self, prompt: Prompt, max_new_tokens: int = 64, mode: str | GenerationMode = "reuse", temperature: float = 1.0,
        do_sample: bool = False, keep_logits: bool = True, *, cache_salt: str = "",
        score_ids: Sequence[int] | None = None, store: bool = True,
    ) -> GenerationResult:  # fmt: skip
        """Generate an answer to ``prompt``.

        ``mode="reuse"`` (``GenerationMode.CHUNK_KV_REUSE``) serves what it can from the cache (exact and content
        hits) and stores the new chunks; ``mode="prefix"`` (``PREFIX_CACHE``) serves exact hits only;
        ``mode="cold"`` (``BASELINE``) runs the same path with the cache neither read nor written. TTFT runs from
        this call to the first token id (DESIGN.md invariant 4); storing is timed apart (``store_ms``) and counted
        in ``total_ms``.
        ``cache_salt``: a per-tenant salt in every key. ``score_ids``: a known answer whose teacher-forced
        log-probability goes into ``result.extra["answer_logprob"]`` (after the request, not timed). ``store``:
        False reads the cache without writing it.
        """
        return self._run_on_scheduler([prompt], max_new_tokens, [temperature], [do_sample], mode=mode,
                                      cache_salt=cache_salt, store=store, keep_logits=keep_logits,
                                      score_ids=score_ids)[0]  # fmt: skip

    def generate_batch(
        self, prompts: Sequence[Prompt], max_new_tokens: int = 64, temperature: float | Sequence[float] = 1.0,
        do_sample: bool | Sequence[bool] = False, *, mode: str = "reuse", cache_salt: str = "", store: bool = True,
        keep_logits: bool = False,
    ) -> list[GenerationResult]:  # fmt: skip
        """Generate for every prompt together: their prefills (plain suffixes in one flat forward; prompts whose
        content hits need repair alone), then one decode forward per step for every running row; a row that
        finishes leaves the batch. ``temperature`` and ``do_sample`` may be given per row. Each row's TTFT counts
        from this call. Greedy rows give the tokens they give alone (fp32 up to rounding; bit-exact under
        ``attn=batch_invariant``)."""
        prompts = list(prompts)
        if not prompts:
            raise ValueError("generate_batch needs at least one prompt")
        return self._run_on_scheduler(prompts, max_new_tokens, per_row(temperature, len(prompts), "temperature"),
                                      per_row(do_sample, len(prompts), "do_sample"), mode=mode, cache_salt=cache_salt,
                                      store=store, keep_logits=keep_logits)  # fmt: skip

    def _run_on_scheduler(self, prompts: list[Prompt], max_new_tokens: int, temps: list[float], samples: list[bool], *,
                          mode: str, cache_salt: str, store: bool, keep_logits: bool,
                          score_ids: Sequence[int] | None = None) -> list[GenerationResult]:  # fmt: skip
        """``generate`` / ``generate_batch``: the server's scheduler, sized for these prompts: every row runs at
        once, in the prompts' order, and their suffixes are prefilled in one flat forward. Each row's TTFT counts
        from this call."""
        from kvboost.serving.core import EngineCore
        from kvboost.serving.requests import SamplingParams

        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        mode = engine_mode(mode)  # a GenerationMode of the original API, or reuse | prefix | cold
        clock = PhaseClock(self.adapter.device)
        core = EngineCore(self, max_running=len(prompts), max_waiting=None, cache_aware_limit=0)
        seqs = []
        for prompt, temperature, do_sample in zip(prompts, temps, samples, strict=True):
            Sampling(do_sample, temperature)  # generate's checks (a sampled row needs a temperature > 0)
            params = SamplingParams(max_tokens=max_new_tokens, temperature=float(temperature) if do_sample else 0.0)
            seq = core.prepare(prompt, params, cache_salt=cache_salt, mode=mode, store=store, clock=clock.fork())
            seq.keep_logits, seq.detokenize, seq.score_ids = keep_logits, False, score_ids
            seqs.append(seq)
        core.scheduler.max_batch_tokens = max(2048, sum(len(seq.ids) for seq in seqs))
        for seq in seqs:
            core.add(seq)
        try:
            while core.has_work():
                core.step()
        except BaseException:
            core.abort_all("error")
            raise
        return [seq.result for seq in seqs]

    def generate_many(self, prompts: Sequence[Prompt], max_new_tokens: int = 64, **options: Any) -> list[GenerationResult]:
        """``generate_batch`` for prompts that share prefixes: prompts are grouped by their longest common token
        prefix (at least one chunk), each group's uncached shared prefix is computed once (``warm``) before its
        rows, and the rows then share its blocks by reference. Results come back in the prompts' order."""
        from kvboost.runtime.grouping import group_by_prefix

        prompts = list(prompts)
        ids = [self.tokenize(p) for p in prompts]
        results: list[GenerationResult | None] = [None] * len(prompts)
        for group, prefix in group_by_prefix(ids, self.chunker.split):
            if len(group) > 1 and prefix and engine_mode(options.get("mode", "reuse")) != "cold":
                self.warm(ids[group[0]][:prefix], cache_salt=options.get("cache_salt", ""))
            for index, result in zip(group, self.generate_batch([ids[i] for i in group], max_new_tokens, **options),
                                     strict=True):  # fmt: skip
                results[index] = result
        return results  # type: ignore[return-value]

    # ------------------------------------------------------------------ the request loop
    @property
    def core(self) -> Any:
        """The engine's :class:`~kvboost.serving.core.EngineCore` (scheduler and step loop), built on first use."""
        if getattr(self, "_core", None) is None:
            from kvboost.serving.core import EngineCore

            self._core = EngineCore(self)
        return self._core

    def add_request(self, prompt: Prompt, params: Any = None, **options: Any) -> Any:
        """Queue a request (``params``: :class:`kvboost.serving.SamplingParams`; options: ``cache_salt``, ``chat``,
        ``request_id``, ``timeout_s``) and return its :class:`~kvboost.serving.RequestHandle`; :meth:`step` runs
        it. Single-threaded; ``kvboost.serving.EngineLoop`` runs the steps on a thread of their own."""
        return self.core.submit(prompt, params, **options)

    def step(self) -> list[Any]:
        """One scheduler iteration over the queued requests; returns the completions that finished in it."""
        return self.core.step()

    # ------------------------------------------------------------------ warm / store
    def warm(self, text: Prompt, *, pin: bool = False, cache_salt: str = "", chat: bool | None = None) -> WarmResult:
        """Compute and store the KV of ``text`` (a shared system prompt, a document) without generating.

        ``text`` is stored as the start of the prompts that will extend it: where ``generate`` renders a plain
        string in the chat template (``chat``, default the engine's: see ``kvboost.prompts``), the warmed tokens
        are that rendering up to the end of ``text`` (default system prompt and user header included), so
        ``warm(system); generate(system + question)`` reuses them. ``chat=False`` tokenizes the text as is
        (through the chunker, so a document gets the ids it has inside prompts cut by the ``separator`` chunker:
        warm documents that appear mid-prompt this way). Token ids and chat messages are stored as given
        (messages rendered with the generation prompt). Computed from position 0 with no history: the chunks
        become exact hits for prompts that start with them and content hits (by segment key) anywhere else.
        Reuses whatever exact prefix is already cached; ``pin=True`` protects the entries from eviction.
        """
        return pipeline.warm(self, text, pin=pin, cache_salt=cache_salt, chat=chat)

    # ------------------------------------------------------------------ stats and checks
    def cache_stats(self) -> dict[str, Any]:
        """Store occupancy and hit counters, request-level reuse since the last reset, and the KV pool."""
        summary = self.store.summary()
        return {
            **summary,
            # damaged records a tier below memory found, deleted and reported as misses (recomputed)
            "corrupt_entries_dropped": sum(int(t.get("corrupt_dropped", 0)) for t in summary["tiers"]),
            "requests": self._requests, "prompt_tokens": self._prompt_tokens, "cached_tokens": self._cached_tokens,
            "reuse_ratio": self._cached_tokens / self._prompt_tokens if self._prompt_tokens else 0.0,
            "attention": self.attention.stats(), "fingerprint": self.fingerprint,
            "content_reuse": self.content_disabled_reason or "enabled", "kv_pool": self.pool.describe(),
        }  # fmt: skip

    def reset_cache(self) -> None:
        """Drop every stored chunk and zero the counters."""
        self.store.clear()
        self.store.stats = type(self.store.stats)()
        self._requests = self._prompt_tokens = self._cached_tokens = 0

    def reseed(self, seed: int | None = None) -> None:
        """Reset the sampling generator (to the constructor's seed by default)."""
        self.generator.manual_seed(self._seed if seed is None else seed)

    def verify_correctness(self, prompts: Sequence[Prompt] | None = None, *, max_new_tokens: int = 16,
                           prefix_fraction: float = 0.6, kl_tolerance: float | None = None) -> CorrectnessReport:  # fmt: skip
        """Check that exact reuse reproduces a cold prefill, prompt by prompt, within what the configured dtype and
        attention can promise (``kvboost.quality.exactness_promise``: KL 1e-4 in fp32 or under a batch-invariant
        backend, a bf16 tolerance otherwise); the report's ``criterion`` says which, ``print(report)`` shows it."""
        return verify_correctness(self, prompts, max_new_tokens=max_new_tokens, prefix_fraction=prefix_fraction,
                                  kl_tolerance=kl_tolerance)  # fmt: skip


def _free_blocks(ref: weakref.ReferenceType[InferenceEngine], missing: int) -> None:
    """The pool's pressure callback: the engine's store evicts cached entries until ``missing`` more blocks are
    free (or nothing more can go)."""
    engine = ref()
    if engine is not None:
        engine.store.free_pool_blocks(engine.pool, engine.pool.num_free + missing)


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


KVBoost = InferenceEngine
