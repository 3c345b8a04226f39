"""Configs are data, checked when composed: every plugin name is registered and every field an argument.

``check_config(cfg)`` runs before the runner loads anything, so a typo (``chunker.chunk_szie=32``, an unknown
recompute strategy, a workload field that does not exist) fails at start-up with the field's name, not after
a model was loaded and half a run was measured. ``tests/test_configs.py`` composes every config file of every
group with Hydra's compose API and runs it through here.
"""

from __future__ import annotations

import inspect
from typing import Any

from experiments.modes import MODES
from experiments.workloads import WORKLOADS
from kvboost.registry import ATTENTION, CACHE_TIERS, CHUNKERS, DRAFT, EVICTION, HASHERS, KV_QUANT, RECOMPUTE

#: config group -> registry of the plugin it names
PLUGIN_GROUPS = {
    "chunker": CHUNKERS,
    "hasher": HASHERS,
    "recompute": RECOMPUTE,
    "quant": KV_QUANT,
    "attn": ATTENTION,
    "eviction": EVICTION,
    "speculative": DRAFT,
}
#: workload config fields the runner reads itself (not passed to the workload)
RUNNER_WORKLOAD_FIELDS = ("modes", "repeats")
LOGGERS = ("none", "wandb")
MODEL_FIELDS = ("name_or_path", "dtype", "device", "lm_head", "awq_prefill", "weights", "random_init", "random_seed")
ENGINE_OPTIONS = (
    "store_generated", "store_canonical", "chat", "seed", "max_kv_bytes", "keep_buffer_bytes", "decode", "prefill",
    "prefill_weights", "kv", "core", "kv_events",
)  # fmt: skip


def split_workload_config(cfg: dict[str, Any]) -> tuple[str, dict[str, Any], list[str], int]:
    """(workload name, its own fields, runner modes, repeats) from ``cfg["workload"]``."""
    workload = dict(cfg.get("workload") or {"name": "sharegpt_replay"})
    workload.pop("description", None)
    name = workload.pop("name", "sharegpt_replay")
    modes = list(workload.pop("modes", None) or ["baseline", "hf_prefix", "kvboost_cold", "kvboost"])
    repeats = workload.pop("repeats", 1)
    return name, workload, modes, repeats


def engine_options(cfg: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of ``InferenceEngine`` from a run config."""
    return dict(
        chunker=cfg.get("chunker", "fixed"),
        hasher=cfg.get("hasher", "sha256"),
        cache=cfg.get("cache"),
        eviction=cfg.get("eviction"),
        recompute=cfg.get("recompute", "none"),
        quant=cfg.get("quant", "none"),
        attn=cfg.get("attn", "sdpa"),
        speculative=cfg.get("speculative", "none"),
        # consumed by InferenceEngine.from_pretrained (it decides how the model is loaded); only when on
        **({"streaming": cfg["streaming"]} if _streaming_on(cfg.get("streaming")) else {}),
        **({"lm_head": lm_head} if (lm_head := (cfg.get("model") or {}).get("lm_head")) else {}),
        **({"awq_prefill": kind} if (kind := (cfg.get("model") or {}).get("awq_prefill")) else {}),
        **({"weights": w} if (w := (cfg.get("model") or {}).get("weights")) not in (None, "dense") else {}),
        **(cfg.get("engine") or {}),
    )


def _streaming_on(spec: Any) -> bool:
    from kvboost.streaming import streaming_enabled

    return streaming_enabled(spec)


def check_config(cfg: dict[str, Any]) -> None:
    """Raise ValueError (or UnknownPluginError) for the first thing in ``cfg`` no run could use."""
    for group, registry in PLUGIN_GROUPS.items():
        if cfg.get(group) is not None and registry is not CACHE_TIERS:
            registry.validate(cfg[group])
    if cfg.get("speculative") is not None:
        DRAFT.build(cfg["speculative"])  # value checks (num_draft >= 1...); a draft model is loaded only by the engine
    cache = cfg.get("cache")
    for tier in cache if isinstance(cache, list) else [cache] if cache is not None else []:
        CACHE_TIERS.validate(tier, provided=("write_through",))  # write_through is the store's, per tier
    unknown_engine = sorted(set(cfg.get("engine") or {}) - set(ENGINE_OPTIONS))
    if unknown_engine:
        raise ValueError(f"engine: unknown option(s) {unknown_engine}; accepted: {', '.join(ENGINE_OPTIONS)}")
    if _streaming_on(cfg.get("streaming")):  # validates the fields too
        if (cfg.get("model") or {}).get("random_init"):
            raise ValueError("streaming reads weights from a safetensors folder; it cannot stream model.random_init")
        if (cfg.get("engine") or {}).get("decode", "auto") not in ("auto", "hf"):
            from kvboost.streaming import streamed_decode

            streamed_decode(cfg["engine"]["decode"])
    decode = (cfg.get("engine") or {}).get("decode", "auto")
    from kvboost.runtime.config import DECODE_MODES

    if decode != "auto" and decode not in DECODE_MODES:
        raise ValueError(f"engine.decode must be auto or one of {', '.join(DECODE_MODES)}, got {decode!r}")
    prefill = (cfg.get("engine") or {}).get("prefill", "auto")
    from kvboost.runtime.config import PREFILL_MODES

    if prefill != "auto" and prefill not in PREFILL_MODES:
        raise ValueError(f"engine.prefill must be auto or one of {', '.join(PREFILL_MODES)}, got {prefill!r}")
    prefill_weights = (cfg.get("engine") or {}).get("prefill_weights", "auto")
    from kvboost.models.prepack import PREFILL_WEIGHTS

    if prefill_weights != "auto" and prefill_weights not in PREFILL_WEIGHTS:
        raise ValueError(
            f"engine.prefill_weights must be auto or one of {', '.join(PREFILL_WEIGHTS)}, got {prefill_weights!r}"
        )

    name, fields, modes, repeats = split_workload_config(cfg)
    WORKLOADS.validate({"name": name, **fields}, provided=("env",))
    unknown_modes = [m for m in modes if m not in MODES]
    if unknown_modes or not modes:
        raise ValueError(f"unknown modes {unknown_modes or modes}; available: {', '.join(MODES.names())}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"workload.modes lists a mode twice: {modes}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"workload.repeats must be a positive integer, got {repeats!r}")

    logger = dict(cfg.get("logger") or {"name": "none"})
    if logger.get("name", "none") not in LOGGERS:
        raise ValueError(f"unknown logger {logger.get('name')!r}; use one of: {', '.join(LOGGERS)}")
    model = dict(cfg.get("model") or {})
    unknown_model = sorted(set(model) - set(MODEL_FIELDS))
    if unknown_model:
        raise ValueError(f"model: unknown field(s) {unknown_model}; accepted: {', '.join(MODEL_FIELDS)}")
    if model.get("random_init") is not None and not isinstance(model["random_init"], dict):
        raise ValueError(f"model.random_init must be a mapping of config fields, got {model['random_init']!r}")
    if model.get("lm_head") not in (None, "none", "int8"):
        raise ValueError(f"model.lm_head must be null or int8, got {model['lm_head']!r}")
    from kvboost.models.awq import AWQ_PREFILL_CHOICES

    if model.get("awq_prefill") not in (None, *AWQ_PREFILL_CHOICES):
        raise ValueError(f"model.awq_prefill must be null, int4 or dense, got {model['awq_prefill']!r}")
    from kvboost.models.gguf_weights import check_weights

    if check_weights(model.get("weights")) == "gguf_int4":  # model.weights: a GGUF model's 4-bit linears as int4
        from kvboost.models.loading import is_gguf_name

        if model.get("random_init") is not None:
            raise ValueError("model.weights=gguf_int4 runs a GGUF file's 4-bit tensors; model.random_init builds a "
                             "random model (use model.weights=dense)")  # fmt: skip
        if _streaming_on(cfg.get("streaming")):
            raise ValueError("model.weights=gguf_int4 does not stream layers; turn streaming off or use "
                             "model.weights=dense")  # fmt: skip
        if not is_gguf_name(model.get("name_or_path")):
            raise ValueError(f"model.weights=gguf_int4 runs a GGUF file's 4-bit tensors; model.name_or_path "
                             f"{model.get('name_or_path')!r} is not a GGUF model (null = bundled, gguf:NAME, a "
                             ".gguf path)")  # fmt: skip
    if model.get("dtype") is not None:
        from kvboost.models.loading import resolve_dtype

        resolve_dtype(model["dtype"])


def engine_signature_options() -> list[str]:
    """The keyword options ``InferenceEngine`` takes (kept in sync with ENGINE_OPTIONS by a test)."""
    from kvboost.engine import InferenceEngine

    return [p for p in inspect.signature(InferenceEngine.__init__).parameters if p not in ("self", "model", "tokenizer")]
