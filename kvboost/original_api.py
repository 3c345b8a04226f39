"""The original KVBoost API (pythongiant/KVBoost, ``kvboost`` 0.4 on PyPI), mapped onto kvboost's plugins.

Users of the original project write::

    from kvboost import KVBoost
    from kvboost.engine import GenerationMode, RecomputeStrategy

    engine = KVBoost.from_pretrained(name, recompute_strategy="cacheblend", chunk_size=128, kv_cache_bits=8,
                                     disk_cache_dir="/tmp/kv", max_chunks=256, recompute_ratio=0.15, device="cpu")
    engine.warm(system_prompt)
    r = engine.generate(prompt, max_new_tokens=64, mode=GenerationMode.CHUNK_KV_REUSE)

and that runs here unchanged. :func:`translate_options` turns the original constructor keywords into plugin configs
*before any weight is read* (``InferenceEngine.from_pretrained`` calls it first): a bad keyword or value costs no
model load, and an unknown keyword is answered with the accepted ones (and the new name of a renamed one).

==========================  ==========================================================================================
original keyword            here
==========================  ==========================================================================================
``recompute_strategy``      ``recompute=`` (:class:`RecomputeStrategy` or its value; a registered plugin name too)
``recompute_ratio``         the strategy's ``ratio`` (``cacheblend``, ``true_deviation``, ``query_aware``, ``compose``, ...)
``recompute_overlap``       ``selective``'s ``r`` (tokens recomputed where a run of reused tokens starts)
``chunk_size``              the chunker's ``chunk_size`` (``fixed`` unless ``chunker=`` names another)
``chunk_boundary_window``   ``chunker={"name": "boundary_window", "window": ...}`` (0: ``fixed``)
``kv_cache_bits``           ``quant=``: 16 -> ``none``, 8 -> ``kivi8``, 4 -> ``kivi4`` (2 -> ``kivi2``)
``disk_cache_dir``          ``cache=[memory, {"name": "disk", "path": dir}]``: a disk tier under the memory tier
``max_chunks``              the memory tier's byte budget: ``max_chunks`` full chunks of the model's KV (unquantized)
``max_cache_bytes``         the memory tier's byte budget
``model_name``              ``from_pretrained``'s first argument
``strict``                  accepted (``True`` only: architectures that cannot work are always refused)
``device``                  ``from_pretrained(device=...)`` (unchanged)
==========================  ==========================================================================================

Where the original's default differs: a keyword that is not given leaves kvboost's default (``recompute="none"``,
``fixed`` chunks of 64, no KV quantization, a 2 GiB memory tier). Giving ``recompute_overlap`` or
``recompute_ratio`` without ``recompute_strategy`` selects the original's default strategy, ``selective``.
A keyword the chosen strategy does not take (``recompute_ratio`` with ``selective``) is ignored with a warning,
as the original ignored it.

``generate(..., mode=...)`` takes a :class:`GenerationMode` (or its value, or the engine's own ``"reuse"``,
``"prefix"``, ``"cold"``): ``BASELINE`` is the cold path (a full prefill, the cache neither read nor written),
``PREFIX_CACHE`` reuses exact (prefix-chained) hits only, ``CHUNK_KV_REUSE`` reuses exact and content hits
(the configured recompute strategy repairs the content hits).
"""

from __future__ import annotations

import enum
import inspect
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)


class GenerationMode(str, enum.Enum):
    """``generate(mode=...)`` of the original API. Each member names the engine mode it runs (:attr:`engine_mode`)."""

    BASELINE = "baseline"  # the cold path: full prefill, cache neither read nor written
    PREFIX_CACHE = "prefix_cache"  # exact (prefix-chained) hits only; the new chunks are stored
    CHUNK_KV_REUSE = "chunk_kv_reuse"  # exact and content hits (repaired by the recompute strategy); stored

    @property
    def engine_mode(self) -> str:
        return _ENGINE_MODES[self]


_ENGINE_MODES = {GenerationMode.BASELINE: "cold", GenerationMode.PREFIX_CACHE: "prefix",
                 GenerationMode.CHUNK_KV_REUSE: "reuse"}  # fmt: skip


class RecomputeStrategy(str, enum.Enum):
    """``recompute_strategy=`` of the original API; :attr:`plugin` is the recompute plugin it selects
    (``kvboost/configs/recompute/<plugin>.yaml``). Not to be confused with :class:`kvboost.recompute.base.RecomputeStrategy`,
    the plugins' interface.

    The members are the original's values; any registered recompute plugin's name is accepted too
    (``RecomputeStrategy("epic")``, a member made on demand), so a new strategy needs no entry here."""

    SELECTIVE = "selective"  # the original's default: recompute where a run of reused tokens starts
    CACHEBLEND = "cacheblend"  # top ratio of reused tokens by K/V deviation at the check layer(s)
    CACHEBLEND_SPARSE = "cacheblend_sparse"  # the original's layer-by-layer CacheBlend: kvboost's cacheblend is that
    NONE = "none"  # no repair
    FULL = "full"  # recompute every reused token (the quality reference)

    @classmethod
    def _missing_(cls, value: object) -> RecomputeStrategy | None:
        """A registered recompute plugin's name (any case the original's values accept: lower) as a member."""
        from kvboost.registry import RECOMPUTE

        if not isinstance(value, str) or value not in RECOMPUTE:
            return None
        member = str.__new__(cls, value)
        member._name_ = value.upper()
        member._value_ = value
        return cls._value2member_map_.setdefault(value, member)

    @property
    def plugin(self) -> str:
        return "cacheblend" if self is RecomputeStrategy.CACHEBLEND_SPARSE else self.value


#: ``kv_cache_bits`` -> ``quant`` plugin.
KV_CACHE_BITS = {16: "none", 8: "kivi8", 4: "kivi4", 2: "kivi2"}

#: The original constructor / ``from_pretrained`` keywords this module translates.
ORIGINAL_OPTIONS = (
    "recompute_strategy", "recompute_ratio", "recompute_overlap", "chunk_size", "chunk_boundary_window",
    "kv_cache_bits", "disk_cache_dir", "max_chunks", "max_cache_bytes", "model_name", "strict",
)  # fmt: skip

#: Original keywords with no one-to-one translation -> what to use here instead.
RENAMED = {
    "streaming_config": "streaming={'resident_layers': K, ...}",
    "attn_implementation": "attn= (sdpa | eager | triton | cuda | cpu_kernel | batch_invariant)",
    "compile_model": "decode='compiled'",
    "cuda_graph_decode": "decode='graphed'",
    "speculative_config": "speculative= (prompt_lookup | draft_model | layer_skip)",
    "tree_speculative_config": "speculative= (prompt_lookup | draft_model | layer_skip)",
    "recency_window_chunks": "eviction= (lru | lfu | s3fifo)",
    "awq_path": "the AWQ checkpoint as from_pretrained's first argument (awq_prefill= for its prefill)",
    "model_name_or_path": "from_pretrained's first argument",
}


class OriginalAPIError(TypeError):
    """A keyword the original API or this engine does not know; the message lists the accepted ones."""


def engine_mode(mode: Any) -> str:
    """The engine's mode (``reuse`` | ``prefix`` | ``cold``) of a :class:`GenerationMode`, its value, or an engine
    mode."""
    from kvboost.engine.pipeline import MODES

    if isinstance(mode, GenerationMode):
        return mode.engine_mode
    if isinstance(mode, str):
        if mode in MODES:
            return mode
        try:
            return GenerationMode(mode.lower()).engine_mode
        except ValueError:
            pass
    raise ValueError(f"unknown mode {mode!r}; use one of {MODES} or a kvboost.engine.GenerationMode "
                     f"({', '.join(m.name for m in GenerationMode)})")  # fmt: skip


def recompute_plugin(strategy: Any) -> str:
    """The recompute plugin name of ``recompute_strategy`` (a :class:`RecomputeStrategy`, its value in any case, or
    the name of a registered recompute plugin)."""
    from kvboost.registry import RECOMPUTE

    if isinstance(strategy, RecomputeStrategy):
        return strategy.plugin
    if isinstance(strategy, str):
        try:
            return RecomputeStrategy(strategy.lower()).plugin
        except ValueError:
            if strategy in RECOMPUTE:
                return strategy
    raise ValueError(f"recompute_strategy={strategy!r}: use one of {[s.value for s in RecomputeStrategy]} "
                     "(kvboost.engine.RecomputeStrategy) or a registered recompute plugin: "
                     f"{RECOMPUTE.names()}")  # fmt: skip


def _int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def _accepted(engine_cls: type) -> list[str]:
    """Every keyword ``from_pretrained`` takes: its own, the loading options, the constructor's, the original ones."""
    from kvboost.models.options import LOADING_OPTIONS

    params = inspect.signature(engine_cls.__init__).parameters
    own = [p for p, v in params.items() if v.kind is v.KEYWORD_ONLY and p != "model_identity"]
    return ["dtype", "device", *LOADING_OPTIONS, *own, *ORIGINAL_OPTIONS]


def check_keywords(engine_cls: type, options: dict[str, Any]) -> None:
    """Refuse keywords ``from_pretrained`` cannot take, naming the accepted ones (and the new name of a renamed one)."""
    params = inspect.signature(engine_cls.__init__).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return  # a subclass taking **kwargs checks its own
    accepted = _accepted(engine_cls)
    unknown = [k for k in options if k not in accepted]
    if not unknown:
        return
    hints = [f"{k!r} is now {RENAMED[k]}" for k in unknown if k in RENAMED]
    raise OriginalAPIError(
        f"KVBoost.from_pretrained: unknown keyword(s) {unknown}" + (f" ({'; '.join(hints)})" if hints else "")
        + f"; accepted: {', '.join(accepted)}"
    )


def translate_options(
    engine_cls: type, model_name_or_path: str | None, options: dict[str, Any]
) -> tuple[str | None, dict[str, Any], Callable[[Any], dict[str, Any]]]:
    """``(model name, engine options, after_load)``: the original keywords in ``options`` turned into plugin configs,
    every keyword and value checked (the plugins the translation selects are built once, then dropped). Nothing is
    loaded here. ``after_load(model)`` returns the engine options completed with what needs the model's shape
    (``max_chunks``'s byte budget)."""
    from kvboost.kv.sizing import parse_bytes
    from kvboost.registry import CACHE_TIERS, CHUNKERS, KV_QUANT, RECOMPUTE

    check_keywords(engine_cls, options)
    options = dict(options)
    given = {k: options.pop(k) for k in ORIGINAL_OPTIONS if k in options}

    def conflict(old: str, new: str) -> None:
        if old in given and new in options:
            raise ValueError(f"give {old}= (original API) or {new}= (plugin config), not both")

    if "model_name" in given:
        if model_name_or_path is not None:
            raise ValueError("give the model once: as from_pretrained's first argument or as model_name=")
        model_name_or_path = given.pop("model_name")
    if given.pop("strict", True) is not True:
        raise ValueError("strict=False is not supported: kvboost always refuses architectures reuse cannot serve "
                         "(absolute positions, ALiBi) and accepts every RoPE decoder (kvboost.compat)")  # fmt: skip

    # recompute_strategy / recompute_ratio / recompute_overlap -> recompute
    for old in ("recompute_strategy", "recompute_ratio", "recompute_overlap"):
        conflict(old, "recompute")
    if {"recompute_strategy", "recompute_ratio", "recompute_overlap"} & set(given):
        name = recompute_plugin(given.get("recompute_strategy", RecomputeStrategy.SELECTIVE))
        spec: dict[str, Any] = {"name": name}
        takes = inspect.signature(RECOMPUTE.get(name)).parameters
        if "recompute_ratio" in given:
            ratio = given["recompute_ratio"]
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
                raise ValueError(f"recompute_ratio must be a fraction in (0, 1], got {ratio!r}")
            if "ratio" in takes:
                spec["ratio"] = float(ratio)
            else:
                log.warning("kvboost: recompute_ratio has no effect with recompute_strategy=%r", name)
        if "recompute_overlap" in given:
            overlap = _int("recompute_overlap", given["recompute_overlap"], minimum=0)
            if "r" in takes:
                spec["r"] = overlap
            else:
                log.warning("kvboost: recompute_overlap has no effect with recompute_strategy=%r", name)
        RECOMPUTE.build(spec)  # the plugin's own value checks, now
        options["recompute"] = spec

    # chunk_size / chunk_boundary_window -> chunker
    if "chunk_size" in given or given.get("chunk_boundary_window"):
        conflict("chunk_boundary_window", "chunker")
        chunker = options.get("chunker", "fixed")
        if not isinstance(chunker, (str, Mapping)):
            raise ValueError("chunk_size= sets a chunker config's chunk_size; give it a chunker name or config, "
                             "not an instance")  # fmt: skip
        chunker = {"name": chunker} if isinstance(chunker, str) else dict(chunker)
        if given.get("chunk_boundary_window"):
            chunker = {"name": "boundary_window",
                       "window": _int("chunk_boundary_window", given["chunk_boundary_window"], minimum=0)}  # fmt: skip
        if "chunk_size" in given:
            chunker["chunk_size"] = _int("chunk_size", given["chunk_size"], minimum=1)
        CHUNKERS.build(chunker)
        options["chunker"] = chunker
    elif "chunk_boundary_window" in given:
        _int("chunk_boundary_window", given["chunk_boundary_window"], minimum=0)

    # kv_cache_bits -> quant
    if "kv_cache_bits" in given:
        conflict("kv_cache_bits", "quant")
        bits = given["kv_cache_bits"]
        if isinstance(bits, bool) or bits not in KV_CACHE_BITS:
            raise ValueError(f"kv_cache_bits must be one of {sorted(KV_CACHE_BITS, reverse=True)} "
                             f"(16: no quantization; 8 / 4 / 2: KIVI), got {bits!r}")  # fmt: skip
        KV_QUANT.build(KV_CACHE_BITS[bits])
        options["quant"] = KV_CACHE_BITS[bits]

    # disk_cache_dir / max_chunks / max_cache_bytes -> cache tiers
    max_chunks = None
    if {"disk_cache_dir", "max_chunks", "max_cache_bytes"} & set(given):
        for old in ("disk_cache_dir", "max_chunks", "max_cache_bytes"):
            conflict(old, "cache")
        memory: dict[str, Any] = {"name": "memory"}
        if given.get("max_cache_bytes") is not None:
            memory["capacity"] = parse_bytes(given["max_cache_bytes"])
        if given.get("max_chunks") is not None:
            max_chunks = _int("max_chunks", given["max_chunks"], minimum=1)
        tiers: list[dict[str, Any]] = [memory]
        if given.get("disk_cache_dir") is not None:
            path = given["disk_cache_dir"]
            if not isinstance(path, (str, os.PathLike)) or not str(path):
                raise ValueError(f"disk_cache_dir must be a folder path, got {path!r}")
            tiers.append({"name": "disk", "path": os.fspath(path)})
        for tier in tiers:
            CACHE_TIERS.validate(tier)
        options["cache"] = tiers

    def after_load(model: Any) -> dict[str, Any]:
        if max_chunks is None:
            return options
        chunk = int(getattr(CHUNKERS.build(options.get("chunker", "fixed")), "chunk_size", 0) or 64)
        budget = max_chunks * chunk * kv_bytes_per_token(model)
        memory = options["cache"][0]
        memory["capacity"] = min(budget, memory.get("capacity", budget))
        return options

    return model_name_or_path, options, after_load


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of one token's keys and values over every layer, in the model's dtype (unquantized)."""
    import torch

    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
