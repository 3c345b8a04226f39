"""One way to build an engine from a config: the run config's engine and model parts (the groups ``chunker``,
``hasher``, ``cache``, ``eviction``, ``recompute``, ``quant``, ``attn``, ``speculative``, ``streaming``, the
``engine`` options and ``model``), as ``kvboost/configs`` composes them.

``python run.py`` (:mod:`kvboost.lab.runner`), ``kvboost-server`` (:mod:`kvboost.serving.cli`), the benchmarks and
the checks all call :func:`build_engine`; it hands the options to ``InferenceEngine.from_pretrained`` (the same
path as ``KVBoost.from_pretrained(**options)``) or, for a given or random model, to ``InferenceEngine`` itself.
:func:`check_engine_config` checks those parts before anything loads (the research runner's
``kvboost.lab.config_check.check_config`` adds its workload, modes and logger).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # kvboost.engine imports much; the builder loads it when it builds
    from kvboost.engine import InferenceEngine

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
MODEL_FIELDS = ("name_or_path", "dtype", "device", "lm_head", "awq_prefill", "weights", "random_init", "random_seed")
ENGINE_OPTIONS = (
    "store_generated", "store_canonical", "chat", "seed", "max_kv_bytes", "keep_buffer_bytes", "decode", "prefill",
    "prefill_weights", "decode_activations", "chunked_prompts", "kv", "core", "kv_events",
)  # fmt: skip


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


def check_engine_config(cfg: dict[str, Any]) -> None:
    """Raise ValueError (or UnknownPluginError) for the first thing in ``cfg``'s engine and model parts (the plugin
    groups, ``engine``, ``streaming``, ``model``) that no engine could use; nothing is loaded."""
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
    chunked = (cfg.get("engine") or {}).get("chunked_prompts")
    if chunked not in (None, True, False):
        raise ValueError(f"engine.chunked_prompts must be true, false or null, got {chunked!r}")
    prefill = (cfg.get("engine") or {}).get("prefill", "auto")
    from kvboost.runtime.config import PREFILL_MODES

    if prefill != "auto" and prefill not in PREFILL_MODES:
        raise ValueError(f"engine.prefill must be auto or one of {', '.join(PREFILL_MODES)}, got {prefill!r}")
    activations = (cfg.get("engine") or {}).get("decode_activations", "int16")
    from kvboost.runtime.quant_step import ACTIVATIONS

    if activations not in ACTIVATIONS:
        raise ValueError(f"engine.decode_activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")
    prefill_weights = (cfg.get("engine") or {}).get("prefill_weights", "auto")
    from kvboost.models.prepack import PREFILL_WEIGHTS

    if prefill_weights != "auto" and prefill_weights not in PREFILL_WEIGHTS:
        raise ValueError(
            f"engine.prefill_weights must be auto or one of {', '.join(PREFILL_WEIGHTS)}, got {prefill_weights!r}"
        )

    model = dict(cfg.get("model") or {})
    unknown_model = sorted(set(model) - set(MODEL_FIELDS))
    if unknown_model:
        raise ValueError(f"model: unknown field(s) {unknown_model}; accepted: {', '.join(MODEL_FIELDS)}")
    if model.get("random_init") is not None and not isinstance(model["random_init"], Mapping):
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


def build_engine(cfg: dict[str, Any], model: Any = None, tokenizer: Any = None, *, model_identity: str | None = None,
                 share_model: bool = False) -> InferenceEngine:  # fmt: skip
    """The engine described by ``cfg`` (groups model/chunker/hasher/cache/eviction/recompute/quant/attn).

    ``model``/``tokenizer`` may be given (tests pass tiny random models, benchmarks a model they loaded once);
    otherwise ``cfg.model`` is loaded. ``model_identity`` and ``share_model`` are about a given model, not the
    config: the name of its weights in the cache fingerprint (default: its ``config._name_or_path``) and whether
    another live engine may serve it too (``InferenceEngine``'s arguments of the same names).
    """
    from kvboost.engine import InferenceEngine

    options = engine_options(cfg)
    lm_head = options.pop("lm_head", None)  # from_pretrained applies it; a random model gets it below
    awq_prefill = options.pop("awq_prefill", None)  # likewise
    weights = options.pop("weights", None) or "dense"  # likewise (model.weights: dense | gguf_int4)
    if model is not None:
        return InferenceEngine(model, tokenizer, model_identity=model_identity, share_model=share_model, **options)
    model_cfg = dict(cfg.get("model") or {})
    if model_cfg.get("random_init"):
        from kvboost.models.loading import random_model_and_tokenizer

        if weights != "dense":
            raise ValueError(f"model.weights={weights} runs a GGUF file's tensors; model.random_init is not one")
        model, tokenizer, identity = random_model_and_tokenizer(
            dict(model_cfg["random_init"]), seed=int(model_cfg.get("random_seed") or 0),
            dtype=model_cfg.get("dtype", "float32"), device=model_cfg.get("device"),
        )  # fmt: skip
        from kvboost.models.awq import set_awq_prefill
        from kvboost.models.int8_head import quantize_lm_head

        quantize_lm_head(model, lm_head)
        set_awq_prefill(model, awq_prefill)
        return InferenceEngine(model, tokenizer, model_identity=identity, **options)
    return InferenceEngine.from_pretrained(
        model_cfg.get("name_or_path"), dtype=model_cfg.get("dtype", "float32"), device=model_cfg.get("device"),
        lm_head=lm_head, awq_prefill=awq_prefill, weights=weights, **options,
    )  # fmt: skip


def engine_signature_options() -> list[str]:
    """The keyword options ``InferenceEngine`` takes (kept in sync with ENGINE_OPTIONS by a test)."""
    from kvboost.engine import InferenceEngine

    return [
        p for p in inspect.signature(InferenceEngine.__init__).parameters if p not in ("self", "model", "tokenizer")
    ]
