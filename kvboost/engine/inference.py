"""The kvboost engine: composes the plugins, the KV pool and the model runner; it does not implement them.

    from kvboost import KVBoost
    engine = KVBoost.from_pretrained()                      # bundled SmolLM2-135M-Instruct
    r1 = engine.generate([{"role": "user", "content": "Hi"}])
    r2 = engine.generate(longer_conversation)               # reuses r1's prompt and answer KV
    rows = engine.generate_batch(["Hi", "Tell me a joke."])  # one forward per step for every row
    print(r2.ttft_ms, r2.kv_reuse_ratio)

One request, as data flows: prompt -> chunker (ids and spans) -> hasher (prefix and segment keys) -> the engine
core (``kvboost.engine.core``, the one request loop of the engine) -> lookup (exact hits, frontier, content hits:
``ReusePlan``) -> assembly into the request's block table (exact hits by reference, content hits copied and
re-rotated: ``kvboost.reuse``) -> the recompute strategy's schedule -> the runner's forward of what the schedule
computes -> first token (TTFT stops here) -> decode (one batched forward per step) -> store the new chunks
(``kvboost.cache.sequence_store``: runs of the request's pool blocks when the first tier is memory).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from kvboost.cache.build import build_tiers
from kvboost.cache.memory import MemoryTier
from kvboost.cache.pool_tier import PoolTier
from kvboost.decoding import Sampling, eos_token_ids, per_row
from kvboost.engine import pipeline
from kvboost.engine.scheduler import DEFAULT_IDLE_PREFILL_TOKENS
from kvboost.generation import PhaseClock
from kvboost.kv.sizing import activation_bytes, make_pool, parse_bytes, row_block_bytes
from kvboost.models.adapter import ModelAdapter
from kvboost.models.compat import UnsupportedArchitectureError, check_architecture
from kvboost.original_api import GenerationMode, engine_mode, translate_options
from kvboost.engine.frontend import checked_score_ids
from kvboost.prompts import Prompt, PromptError, check_length, check_token_ids, prompt_text_or_ids
from kvboost.quality import verify_correctness
from kvboost.registry import ATTENTION, CHUNKERS, DRAFT, HASHERS, KV_QUANT, RECOMPUTE
from kvboost.reuse.prefill import ReferenceMemo
from kvboost.runtime.config import build_runner, choose_runner
from kvboost.types import ChunkSpan, CorrectnessReport, GenerationResult, WarmResult

log = logging.getLogger(__name__)

MODES = pipeline.MODES

#: Attribute on a model served by an engine: a weak reference to that engine.
OWNER_ATTR = "_kvboost_engine"

#: ``kv=`` settings: tokens per block, the pool's size (``"auto"`` or bytes), the share of free memory ``auto`` may take.
KV_OPTIONS = ("block_size", "pool_bytes", "memory_fraction", "host_bytes")

#: ``core=`` settings of the engine's one request loop (``kvboost.engine.core.EngineCore``).
CORE_OPTIONS = ("max_running", "max_batch_tokens", "aging_steps", "cache_aware_limit")


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
        share_model: serve a model another live engine already serves (same attention backend), instead of refusing
            it; each engine keeps a KV pool, a runner and a request loop of its own.
        max_kv_bytes: refuse a request whose KV (prompt + max new tokens) would exceed this many bytes.
        decode, prefill, prefill_weights: the path (``kvboost.runtime.config.choose_runner``): ``decode`` ``auto`` |
            ``graphed`` (CUDA graphs) | ``compiled`` (inductor) | ``eager`` (HF's bits) | ``hf`` (HF's modules);
            ``prefill`` ``auto`` | ``fused`` | ``graphed`` | ``quantized`` | ``quantized_short`` | ``hf``;
            ``prefill_weights`` ``auto`` | ``plain`` | ``prepacked``. ``decode="quantized"`` (what ``auto`` picks
            on CPU for a GGUF model of 4-bit blocks, as the bundled one) multiplies the file's own blocks
            (``kvboost.runtime.quant_step``); ``prefill="quantized"`` runs the prompt rows through the same step,
            ``"quantized_short"`` the forwards of fewer than 128 rows.
        chunked_prompts: prompts will come in a serving loop's bounded chunks (kvboost-server sets it): then
            ``prefill="auto"`` runs them through the quantized step wherever decode is quantized, its fixed cost per
            forward being the smaller one (bf16 models included). None / False: in-process use, where a prompt
            prefills in one forward and a bf16 model keeps its dense prefill on a CPU with AMX (without AMX it
            takes the quantized step too: ``kvboost.runtime.config.choose_runner``).
        decode_activations: ``decode="quantized"`` only: ``int16`` (the default: each row's 32-value groups rounded
            to int16 codes, the dense model's function up to ~1e-5), ``int8`` (llama.cpp's arithmetic: fastest; its
            generated rows are not stored, and greedy tokens of reuse and cold may part at near ties) or ``fp32``.
        kv: the KV pool (``{"block_size": 16, "pool_bytes": "auto", "memory_fraction": None}``, see
            ``kvboost.kv.sizing``). With a lossless quantizer and ``memory`` as the first cache tier, the pool is the
            memory tier (``kvboost.cache.pool_tier``): cached chunks are runs of its blocks. ``host_bytes`` adds a
            host-memory tier right below it (entries the pool evicts are copied to the CPU; a hit is copied back).
        core: the request loop (``{"max_running": 64, "max_batch_tokens": None, "aging_steps": 32}``);
            ``max_batch_tokens`` unset: 2048 on GPUs, on CPU a budget sized to the decode step
            (``kvboost.engine.budget``).
        kv_events: publish the KV store's movements in vLLM's KV-event schema (msgpack over ZMQ) for routers outside
            kvboost; off by default. ``{"enabled": True, "endpoint": "tcp://*:5557", "replay_endpoint": None,
            "topic": "", "buffer_steps": 10000, ...}``: ``kvboost.cache.events.KVEventsConfig``.
        keep_buffer_bytes: accepted for compatibility; the pool replaced per-request buffers.
    """

    def __init__(
        self, model: Any, tokenizer: Any, *, model_identity: str | None = None, chunker: Any = "fixed",
        hasher: Any = "sha256", cache: Any = None, eviction: Any = None, recompute: Any = "none", quant: Any = "none",
        attn: Any = "sdpa", store_generated: bool = True, chat: bool | None = None, seed: int = 0,
        share_model: bool = False,
        max_kv_bytes: int | str | None = None, keep_buffer_bytes: int | str | None = None, decode: str = "auto",
        speculative: Any = "none", prefill: str = "auto", prefill_weights: str = "auto", kv: dict | None = None,
        decode_activations: str = "int16", chunked_prompts: bool | None = None,
        store_canonical: bool = True, core: dict | None = None, kv_events: Any = None,
    ) -> None:  # fmt: skip
        from kvboost.rope import RopeRotator, check_rope_reusable

        # Everything that can fail is built and checked before the caller's model is touched.
        check_architecture(model.config)
        check_rope_reusable(model.config)
        kv = dict(kv or {})
        unknown = sorted(set(kv) - set(KV_OPTIONS))
        if unknown:
            raise ValueError(f"unknown kv option(s) {unknown}; accepted: {list(KV_OPTIONS)}")
        core = dict(core or {})
        unknown = sorted(set(core) - set(CORE_OPTIONS))
        if unknown:
            raise ValueError(f"unknown core option(s) {unknown}; accepted: {list(CORE_OPTIONS)}")
        from kvboost.cache.events import KVEventsConfig, KVEventSink

        events_config = KVEventsConfig.from_options(kv_events)
        chunker, hasher = CHUNKERS.build(chunker), HASHERS.build(hasher)
        recompute = RECOMPUTE.build(recompute)
        recompute.check_model(model.config.get_text_config(decoder=True).num_hidden_layers)
        quantizer = KV_QUANT.build(quant)
        tiers = build_tiers(cache, eviction)
        if kv.get("host_bytes") is not None and not (isinstance(tiers.tiers[0], MemoryTier)
                                                     and getattr(quantizer, "lossless", False)):
            raise ValueError("kv.host_bytes adds a host-memory tier below the KV pool, which is the memory tier only "
                             "with `memory` as the first cache tier and a lossless KV quantizer")
        host_tier = None if kv.get("host_bytes") is None else build_tiers(
            {"name": "memory", "capacity": kv["host_bytes"], "device": "cpu"}, eviction).tiers[0]
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
        config = choose_runner(model, attention, decode=decode, prefill=prefill, prefill_weights=prefill_weights,
                               decode_activations=decode_activations, chunked_prompts=bool(chunked_prompts))  # fmt: skip
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
        self.store_generated, self.chat, self.speculative = store_generated, chat, speculative
        self.store_canonical = bool(store_canonical)
        # Whether a decode step writes the K/V a prefill of the same tokens would (up to the rounding of the call's
        # shape). decode="quantized" with int8 activations does not (its activations are rounded to 8 bits): the
        # rows it generates are never stored, so every cached entry stays a prefill's; a chat turn's answer is then
        # stored by the canonical store's prefill instead (kvboost.engine.frontend.canonical_store_request).
        self.generated_rows_exact = not (config.decode == "quantized" and config.decode_activations == "int8")
        # oracle_agreement's reference prefills, once per prompt and cached rows (kvboost.reuse.prefill)
        self.reference_memo = ReferenceMemo()
        self.adapter = ModelAdapter(model, model_identity or getattr(model.config, "_name_or_path", "") or "unnamed")
        self.eos_ids = eos_token_ids(model, tokenizer)
        self.max_kv_bytes = parse_bytes(max_kv_bytes) if max_kv_bytes is not None else None
        self._seed = seed
        self.generator = torch.Generator(device=self.adapter.device).manual_seed(seed)
        self._requests = self._prompt_tokens = self._cached_tokens = 0
        self._closed = False
        self.runner_config = config
        # The pool is the memory tier when nothing is quantized and the first tier asked for is memory: cached
        # chunks are runs of its blocks (kvboost.cache.pool_tier), its size the memory budget.
        first = tiers.tiers[0]
        pooled = bool(getattr(quantizer, "lossless", False)) and isinstance(first, MemoryTier)
        cache_bytes = first.capacity_bytes if pooled else 0
        # On CUDA an "auto" pool is sized once the runner, its prepacked weights and graph settings exist (vLLM
        # profiles first too): until then a provisional two-block pool.
        late = self.adapter.device.type == "cuda" and kv.get("pool_bytes") in (None, "auto")
        pool = make_pool(self.adapter, cache_bytes, {**kv, "pool_bytes": 2 * row_block_bytes(self.adapter, kv)}
                         if late else kv)  # fmt: skip
        self.tokenizer_lock = threading.RLock()  # HF's fast tokenizers are not thread-safe (kvboost.engine.frontend)
        from kvboost.engine.core import EngineCore

        self.core = EngineCore(self, max_waiting=None, **core)  # checks its options
        self.core.on_finished = self._store_turn

        # Last: the one step that changes the caller's model.
        if owner is None:
            attention.install(model)
            setattr(model, OWNER_ATTR, weakref.ref(self))
        self.attention = attention
        self.runner = build_runner(config, model, pool, attention)
        if late:
            budget = max(core.get("max_batch_tokens") or 2048, DEFAULT_IDLE_PREFILL_TOKENS)
            pool = make_pool(self.adapter, cache_bytes, kv, reserve=activation_bytes(self.adapter, budget))
            self.runner.bind_pool(pool)
        self.pool = pool
        if pooled:
            tiers.tiers[0] = PoolTier(pool, first.eviction, capacity=first.capacity_bytes)
        if host_tier is not None:
            tiers.tiers.insert(1, host_tier)
            tiers.write_through.insert(1, False)
        self.store = store = tiers.build()
        from kvboost.models.gguf_weights import weight_formats

        # the kernels every linear runs (dense, int4 of GGUF / AWQ, the AWQ prefill's dense copies): in the key
        self._weight_formats = ",".join(sorted(weight_formats(model))) + (
            f",awq_prefill={model._kvboost_awq_prefill}" if getattr(model, "_kvboost_awq_prefill", None) else "")
        self.layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)
        # Tiers that serialise entries (disk) write the fingerprint into each record and check it on read;
        # pending writes (and, spilled, the memory tier's entries) reach a persistent tier at close() or exit.
        self.store.bind_context(
            fingerprint=partial(_engine_fingerprint, weakref.ref(self)),
            quantizer_settings={"name": quantizer.registry_name, "fingerprint": quantizer.fingerprint(),
                                "lossless": bool(getattr(quantizer, "lossless", False))},
        )  # fmt: skip
        # KV events: last, so that the snapshot a publisher opens with holds what the tiers already have.
        publisher = events_config.build_publisher()
        self.kv_events: KVEventSink | None = None
        self._events_finalizer = None
        if publisher is not None:
            self.kv_events = KVEventSink.from_config(events_config, publisher, hasher=hasher)
            self._events_finalizer = weakref.finalize(self, publisher.shutdown)
            hasher.root_key(self.fingerprint, "")  # the untenanted root: its first chunks publish parent None
        self._store_finalizer = weakref.finalize(self, store.close)
        if self.kv_events is not None:
            store.attach_events(self.kv_events)

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
        """Give the model back (uninstall the attention backend if this engine installed it), end the requests still
        queued or running (after the step in flight), spill the pool's cached chunks into a persistent tier, flush."""
        if self._closed:
            return
        with self.core.exclusive():  # the step in flight (a loop thread's) ends first
            owner = _live_owner(self.model) is self
            self._closed = True
            self.core.abort_all("shutdown")
            if owner:
                self.attention.uninstall(self.model)
                delattr(self.model, OWNER_ATTR)
            self._store_finalizer()  # store.close(): spill into a persistent tier, flush pending writes
            self.store.drop_pool_entries()  # pins go back to the pool
            if self._events_finalizer is not None:  # after the spill's events: the publisher sends what is queued
                self._events_finalizer()

    def warmup(self, max_tokens: int | None = None) -> dict[str, Any]:
        """Build what the first request would otherwise build inside its timings: the compiled decode forward
        (and, on CUDA, the graphs of requests up to ``max_tokens`` rows, default 2048). Returns :meth:`decode_info`."""
        with self.core.exclusive():
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
            "prefill": "hf" if self.runner_config.runner == "hf" else self.runner_config.prefill_path,
            "prefill_reason": reasons.get("prefill", reasons.get("runner", "")),
            "prefill_weights": self.runner_config.weights,
            "prefill_weights_reason": reasons.get("weights", ""),
            "awq_prefill": getattr(self.model, "_kvboost_awq_prefill", None),
            **({"quantized": described["quantized"]} if "quantized" in described else {}),
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
        """Everything that chooses how the K/V the engine stores are computed, part of every cache key (invariant
        3): the model (identity, config, dtype, every weight), the device kind, the KV quantizer, the chunker and
        hasher (they decide what a chunk is), the attention backend and its settings, the runner's path and the
        kernels of every linear (their decode, prefill and weight kernels round differently), the block size.
        What only changes the shapes of the same kernels' calls (batch composition, the prefill chunk budget, draft
        verification rows) stays out: those rows agree up to the rounding of the call's shape, what exact reuse
        promises (DESIGN.md invariant 1). ``tests/test_cache_keys.py`` checks every field either way."""
        attn_tag = getattr(self.attention, "fingerprint_tag", "") or self.attention.name
        config = self.runner_config
        fp = "|".join([
            self.adapter.fingerprint(), f"device={self.adapter.device.type}", f"kvq={self.quantizer.fingerprint()}",
            f"chunk={self.chunker.fingerprint()}", f"hash={self.hasher.fingerprint()}", f"attn={attn_tag}",
            (f"runner={config.runner}/decode={config.decode}"
             f"{'-' + config.decode_activations if config.decode == 'quantized' else ''}{self._decode_build_tag()}"
             f"/prefill={config.prefill_path}"
             f"/weights={config.weights}"), f"formats={self._weight_formats}", f"block={self.pool.block_size}",
            *self._dense_cpu_tag(),
        ])  # fmt: skip
        self._last_fingerprint = fp  # what the keys being built use; records written now carry it
        return fp

    def _decode_build_tag(self) -> str:
        """The build of the C++ kernels a CPU decode step runs where that can change its K/V bits (the vector width
        of their fp32 sums): the quantized step's (:func:`kvboost.runtime.quant_step.quant_arithmetic_tag`), the
        compiled decode's attention kernel (:func:`kvboost.attention.cpu_ext.attention_build_tag`); else ''."""
        config = self.runner_config
        if config.decode == "quantized":
            from kvboost.runtime.quant_step import quant_arithmetic_tag

            step = getattr(self.runner, "quantized", None)
            return "-" + quant_arithmetic_tag(str(step.ext.isa) if step is not None else None)
        if config.decode == "compiled" and self.adapter.device.type == "cpu":
            from kvboost.attention.cpu_ext import attention_build_tag

            return "-" + attention_build_tag()
        return ""

    def _dense_cpu_tag(self) -> list[str]:
        """``cpu=<capability[+amx]/vendor>`` where some stored rows come from torch's dense CPU kernels (every CPU path
        but the 4-bit step for prompt and decode rows), whose bits follow the CPU's ISA and vendor
        (:func:`kvboost.runtime.config.dense_cpu_tag`; issue 61); else nothing."""
        config = self.runner_config
        if self.adapter.device.type != "cpu" or (config.decode == "quantized" and config.prefill_path == "quantized"):
            return []
        from kvboost.runtime.config import dense_cpu_tag

        return [f"cpu={dense_cpu_tag()}"]

    @property
    def approx_tag(self) -> str:
        """The recompute strategy's fingerprint: in the key of every chunk stored with approximate (repaired) KV."""
        return self.recompute.fingerprint()

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
        return self._generate([prompt], max_new_tokens, [temperature], [do_sample], mode=mode, cache_salt=cache_salt,
                              store=store, keep_logits=keep_logits, score_ids=score_ids)[0]  # fmt: skip

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
        return self._generate(prompts, max_new_tokens, per_row(temperature, len(prompts), "temperature"),
                              per_row(do_sample, len(prompts), "do_sample"), mode=mode, cache_salt=cache_salt,
                              store=store, keep_logits=keep_logits)  # fmt: skip

    def _generate(self, prompts: list[Prompt], max_new_tokens: int, temps: list[float], samples: list[bool], *,
                  mode: str, cache_salt: str, store: bool, keep_logits: bool,
                  score_ids: Sequence[int] | None = None) -> list[GenerationResult]:  # fmt: skip
        """``generate`` / ``generate_batch``: the requests go to the engine's core and this thread steps it (or, when
        an EngineLoop drives it, waits) until they and their canonical stores are done. Each row's TTFT counts from
        this call. A request that failed raises its exception here."""
        from kvboost.engine.requests import SamplingParams

        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        mode = engine_mode(mode)  # a GenerationMode of the original API, or reuse | prefix | cold
        if score_ids is not None:
            score_ids = checked_score_ids(score_ids, self.vocab_size)
        clock = PhaseClock(self.adapter.device)
        requests = []
        for prompt, temperature, do_sample in zip(prompts, temps, samples, strict=True):
            Sampling(do_sample, temperature)  # generate's checks (a sampled row needs a temperature > 0)
            params = SamplingParams(max_tokens=max_new_tokens, temperature=float(temperature) if do_sample else 0.0)
            request = self.core.prepare(prompt, params, cache_salt=cache_salt, mode=mode, store=store,
                                        clock=clock.fork())  # fmt: skip
            request.keep_logits, request.score_ids = keep_logits, score_ids
            if score_ids is not None:  # its score rows follow the prompt in its table: they must fit the pool
                pipeline.check_memory(self, len(request.ids) + len(score_ids), what="prompt + score_ids")
            request.own_canonical = True  # stored below, before this call returns
            requests.append(request)
        self._run(requests)
        jobs = [job for job in (self._canonical_job(r) for r in requests) if job is not None]
        if jobs:
            self._run(jobs)
        results = []
        for request in requests:
            if request.finish_reason not in ("stop", "length") or request.result is None:
                raise request.error or RuntimeError(f"request {request.request_id} ended: {request.finish_reason}")
            with self.tokenizer_lock:
                request.result.output_text = self.tokenizer.decode(request.tokens, skip_special_tokens=True)
            results.append(request.result)
        return results

    def _run(self, requests: list[Any]) -> None:
        """Submit ``requests`` to the core and return once they finished; an interrupt ends them (their blocks go
        back) and is re-raised."""
        core = self.core
        for request in requests:
            core.submit(request, internal=True)
        try:
            core.run_until_done(requests)
        except BaseException:
            core.abort(requests, "error")
            raise

    def _store_turn(self, request: Any) -> None:
        """The core's hook for a finished request when no EngineLoop drives it: requests of ``generate`` get their
        canonical store from ``_generate``; others (``add_request``) here, as a store request."""
        if request.own_canonical:
            return
        job = self._canonical_job(request)
        if job is not None:
            self.core.submit(job, internal=True)

    def _canonical_job(self, request: Any) -> Any:
        from kvboost.engine.frontend import canonical_store_request

        return canonical_store_request(self, request)

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
    def add_request(self, prompt: Prompt, params: Any = None, **options: Any) -> Any:
        """Queue a request (``params``: :class:`kvboost.engine.SamplingParams`; options: ``cache_salt``, ``chat``,
        ``request_id``, ``timeout_s``) and return its :class:`~kvboost.engine.RequestHandle`; :meth:`step` runs
        it. ``kvboost.engine.EngineLoop`` runs the steps on a thread of their own."""
        return self.core.add(prompt, params, **options)

    def step(self) -> list[Any]:
        """One iteration of the engine's core over the queued requests; returns the completions that finished in
        it (token ids; their handles give the text)."""
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
        Reuses whatever exact prefix is already cached; ``pin=True`` protects the chunks from eviction (a pin holds
        their pool blocks) until :meth:`unpin`. Runs as a request of the engine's core, like ``generate``.
        """
        request = self.prepare_warm(text, pin=pin, cache_salt=cache_salt, chat=chat)
        self._run([request])
        return warm_result(request)

    def prepare_warm(self, text: Prompt, *, pin: bool = False, cache_salt: str = "", chat: bool | None = None) -> Any:
        """The store request of ``warm(text)``, tokenized and checked on the caller's thread (``EngineLoop.warm``
        submits it, so that the loop thread never tokenizes)."""
        ids, spans = self._warm_ids(text, chat)
        return self.core.prepare_store(ids, spans, salt=cache_salt, pin=pin, kind="warm")

    def unpin(self, text: Prompt, *, cache_salt: str = "", chat: bool | None = None) -> int:
        """Undo ``warm(text, pin=True)``: the chunks become evictable again. Returns how many were unpinned."""
        ids, spans = self._warm_ids(text, chat)
        keys = self.hasher.chunk_keys(ids, spans, self.fingerprint, cache_salt)
        with self.core.exclusive():
            return sum(self.store.set_pinned(key.prefix_key, False) for key in keys)

    def _warm_ids(self, text: Prompt, chat: bool | None) -> tuple[list[int], list[ChunkSpan]]:
        """What ``warm(text)`` stores (see :meth:`warm`)."""
        from kvboost.prompts import open_user_turn, wants_chat

        chat = self.chat if chat is None else chat
        with self.tokenizer_lock:
            what: str | list[int] | None = None
            if isinstance(text, str) and text.strip() and wants_chat(self.tokenizer, text, chat):
                what = open_user_turn(self.tokenizer, text)
            if what is None:
                what = prompt_text_or_ids(self.tokenizer, text, chat=False)
            ids, spans = self.chunker.tokenize(self.tokenizer, what) if isinstance(what, str) else (what, None)
        check_length(len(ids), self.adapter.max_positions, need_answer_room=False)
        check_token_ids(ids, self.vocab_size)
        return ids, spans if spans is not None else self.chunker.split(ids)

    # ------------------------------------------------------------------ stats and checks
    def cache_stats(self) -> dict[str, Any]:
        """Store occupancy and hit counters, request-level reuse since the last reset, and the KV pool."""
        with self.core.exclusive():
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
        """Drop every stored chunk (pins included) and zero the counters."""
        with self.core.exclusive():
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


def warm_result(request: Any) -> WarmResult:
    """The ``WarmResult`` of a finished warm request, or its error."""
    if request.finish_reason != "stop":
        raise request.error or RuntimeError(f"warm ended: {request.finish_reason}")
    return request.result


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
