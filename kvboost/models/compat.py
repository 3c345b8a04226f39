"""Architecture checks: kvboost needs a decoder-only causal LM with rotary position embeddings.

Reusing a chunk's KV at another position is only possible when positions enter attention through RoPE
(keys can be re-rotated; and prefix KV does not depend on absolute position embeddings added to the
residual stream). Models with learned absolute positions (GPT-2, GPT-Neo) or ALiBi (Bloom, MPT, some
Falcon) are refused before any weight is loaded.
"""

from __future__ import annotations

from typing import Any

# The one table: config ``model_type`` -> the HF architecture class name (``config.architectures[0]``) of each
# family checked to work (tests build tiny random members of llama / qwen2 / mistral / phi3 / gemma). The checks
# read model types; ``kvboost.compat`` publishes the class names (the original API's documented form).
SUPPORTED_FAMILIES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "granite": "GraniteForCausalLM",
    "olmo": "OlmoForCausalLM", "olmo2": "Olmo2ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
    "cohere": "CohereForCausalLM", "starcoder2": "Starcoder2ForCausalLM", "stablelm": "StableLmForCausalLM",
    "internlm2": "InternLM2ForCausalLM",  # remote code (trust_remote_code)
}  # fmt: skip

# model_type -> (architecture class name, why it is refused).
REJECTED_FAMILIES: dict[str, tuple[str, str]] = {
    "gpt2": ("GPT2LMHeadModel", "learned absolute positional embeddings"),
    "gpt_neo": ("GPTNeoForCausalLM", "learned absolute positional embeddings"),
    "gpt_bigcode": ("GPTBigCodeForCausalLM", "learned absolute positional embeddings"),
    "opt": ("OPTForCausalLM", "learned absolute positional embeddings"),
    "bloom": ("BloomForCausalLM", "ALiBi attention biases"),
    "mpt": ("MptForCausalLM", "ALiBi attention biases"),
    "falcon": ("FalconForCausalLM", "ALiBi or non-standard rotary layout (not supported yet)"),
}

# Derived views (what the checks read).
SUPPORTED_MODEL_TYPES = frozenset(SUPPORTED_FAMILIES)
REJECTED_MODEL_TYPES = {model_type: reason for model_type, (_, reason) in REJECTED_FAMILIES.items()}
#: by architecture class name (``kvboost.compat.SUPPORTED_ARCHITECTURES`` / ``UNSUPPORTED_ARCHITECTURES``)
SUPPORTED_ARCHITECTURE_NAMES = frozenset(SUPPORTED_FAMILIES.values())
REJECTED_ARCHITECTURES = {cls: reason for cls, reason in REJECTED_FAMILIES.values()}


class UnsupportedArchitectureError(ValueError):
    """The model cannot be served by kvboost; the message says why."""


def check_architecture(config: Any) -> None:
    """Raise UnsupportedArchitectureError unless ``config`` describes a RoPE decoder-only causal LM."""
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(text_config, "model_type", None) or getattr(config, "model_type", "?")
    rejected_class = next((a for a in getattr(config, "architectures", None) or () if a in REJECTED_ARCHITECTURES), None)
    if model_type not in REJECTED_MODEL_TYPES and rejected_class is not None:  # a family named by its class only
        raise UnsupportedArchitectureError(
            f"architecture {rejected_class!r} uses {REJECTED_ARCHITECTURES[rejected_class]}; kvboost needs rotary "
            "position embeddings (RoPE)"
        )
    if model_type in REJECTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"model type {model_type!r} uses {REJECTED_MODEL_TYPES[model_type]}; kvboost needs rotary position "
            "embeddings (RoPE) so that cached keys can be moved between positions. Supported families include: "
            f"{', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
        )
    if getattr(text_config, "alibi", False):
        raise UnsupportedArchitectureError(f"model type {model_type!r} uses ALiBi; kvboost needs RoPE")
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedArchitectureError(f"model type {model_type!r} is an encoder-decoder; kvboost needs decoder-only")
    if model_type in SUPPORTED_MODEL_TYPES:
        return
    # Unknown family: accept it if it declares rotary parameters, refuse otherwise.
    has_rope = any(
        getattr(text_config, attr, None) is not None
        for attr in ("rope_theta", "rope_parameters", "rope_scaling", "rotary_emb_base", "rotary_pct")
    )
    if not has_rope:
        raise UnsupportedArchitectureError(
            f"model type {model_type!r} declares no rotary position embeddings (no rope_theta / rope_parameters); "
            "kvboost needs RoPE decoder-only models"
        )
