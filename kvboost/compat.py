"""Model compatibility, under the original KVBoost API's names (``kvboost.compat``).

The checks themselves live in :mod:`kvboost.models.compat` (architecture: RoPE decoder-only) and
:func:`kvboost.rope.check_rope_reusable` (RoPE types whose frequencies depend on the sequence length); the engine runs
both when it is built. This module gives them the original project's names::

    from kvboost.compat import check_model_compatibility, SUPPORTED_ARCHITECTURES
    check_model_compatibility(model)              # raises UnsupportedArchitectureError (a ValueError) with the reason

Differences from the original: ``SUPPORTED_ARCHITECTURES`` holds the config's ``model_type`` names (``"llama"``,
``"qwen2"``, ...), which is what the checks read, not class names (``"LlamaForCausalLM"``); a RoPE family that is not
listed is accepted, not warned about.
"""

from __future__ import annotations

import warnings
from typing import Any

from kvboost.models.compat import (
    REJECTED_MODEL_TYPES,
    SUPPORTED_MODEL_TYPES,
    UnsupportedArchitectureError,
    check_architecture,
)

#: Model families (config ``model_type``) checked to work with KV reuse.
SUPPORTED_ARCHITECTURES = SUPPORTED_MODEL_TYPES
#: Model families refused, with the reason (learned absolute positions, ALiBi).
UNSUPPORTED_ARCHITECTURES = REJECTED_MODEL_TYPES


def check_model_compatibility(model: Any, strict: bool = True) -> None:
    """Check that ``model`` (a HF model or its config) can be served with KV reuse: a decoder-only causal LM with
    rotary position embeddings whose frequencies do not depend on the sequence length.

    Raises :class:`UnsupportedArchitectureError` (a ``ValueError``) naming the reason; with ``strict=False`` it
    warns instead (the engine itself still refuses such a model).
    """
    from kvboost.rope import check_rope_reusable

    config = getattr(model, "config", model)
    try:
        check_architecture(config)
        check_rope_reusable(config)
    except UnsupportedArchitectureError as exc:
        if strict:
            raise
        warnings.warn(str(exc), stacklevel=2)


__all__ = ["SUPPORTED_ARCHITECTURES", "UNSUPPORTED_ARCHITECTURES", "UnsupportedArchitectureError",
           "check_model_compatibility"]  # fmt: skip
