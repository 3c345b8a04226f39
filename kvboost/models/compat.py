"""Architecture checks: kvboost needs a decoder-only causal LM with rotary position embeddings.

Reusing a chunk's KV at another position is only possible when positions enter attention through RoPE
(keys can be re-rotated; and prefix KV does not depend on absolute position embeddings added to the
residual stream). Models with learned absolute positions (GPT-2, GPT-Neo) or ALiBi (Bloom, MPT, some
Falcon) are refused before any weight is loaded.
"""

from __future__ import annotations

from typing import Any

# Families checked to work (tests build tiny random members of llama / qwen2 / mistral).
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama", "qwen2", "qwen3", "mistral", "phi3", "gemma", "gemma2", "gemma3_text",
        "granite", "olmo", "olmo2", "smollm3", "cohere", "starcoder2", "stablelm", "internlm2",
    }
)  # fmt: skip

# model_type -> why it is refused.
REJECTED_MODEL_TYPES = {
    "gpt2": "learned absolute position embeddings",
    "gpt_neo": "learned absolute position embeddings",
    "gpt_bigcode": "learned absolute position embeddings",
    "opt": "learned absolute position embeddings",
    "bloom": "ALiBi attention biases",
    "mpt": "ALiBi attention biases",
    "falcon": "ALiBi or non-standard rotary layout (not supported yet)",
}


class UnsupportedArchitectureError(ValueError):
    """The model cannot be served by kvboost; the message says why."""


def check_architecture(config: Any) -> None:
    """Raise UnsupportedArchitectureError unless ``config`` describes a RoPE decoder-only causal LM."""
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(text_config, "model_type", None) or getattr(config, "model_type", "?")
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
