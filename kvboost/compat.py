"""Model compatibility, under the original KVBoost API's names (``kvboost.compat``).

The checks themselves live in :mod:`kvboost.models.compat` (architecture: RoPE decoder-only) and
:func:`kvboost.rope.check_rope_reusable` (RoPE types whose frequencies depend on the sequence length); the engine runs
both when it is built. This module gives them the original project's names::

    from kvboost.compat import SUPPORTED_ARCHITECTURES, UNSUPPORTED_ARCHITECTURES, check_model_compatibility
    "LlamaForCausalLM" in SUPPORTED_ARCHITECTURES              # True
    UNSUPPORTED_ARCHITECTURES["GPT2LMHeadModel"]               # 'learned absolute positional embeddings'
    check_model_compatibility(model)              # raises UnsupportedArchitectureError (a ValueError) with the reason

``SUPPORTED_ARCHITECTURES`` is a set of HF architecture class names (what ``config.architectures`` lists and
``type(model).__name__`` gives), ``UNSUPPORTED_ARCHITECTURES`` a dict class name -> reason, as the original project
documented them. The checks read the config's ``model_type``: ``SUPPORTED_MODEL_TYPES`` / ``UNSUPPORTED_MODEL_TYPES``
are the same families by model type; both views come from one table (``kvboost.models.compat.SUPPORTED_FAMILIES``,
``REJECTED_FAMILIES``). Difference from the original: a RoPE family that is not listed is accepted, not warned
about.
"""

from __future__ import annotations

import warnings
from typing import Any

from kvboost.models.compat import (
    REJECTED_ARCHITECTURES,
    REJECTED_MODEL_TYPES,
    SUPPORTED_ARCHITECTURE_NAMES,
    SUPPORTED_MODEL_TYPES,
    UnsupportedArchitectureError,
    check_architecture,
)

#: Architecture class names checked to work with KV reuse (``"LlamaForCausalLM"``, ``"Qwen2ForCausalLM"``, ...).
SUPPORTED_ARCHITECTURES: frozenset[str] = SUPPORTED_ARCHITECTURE_NAMES
#: Architecture class names refused, with the reason (learned absolute positions, ALiBi).
UNSUPPORTED_ARCHITECTURES: dict[str, str] = REJECTED_ARCHITECTURES
#: The same families by config ``model_type`` (``"llama"``), what the checks read (``SUPPORTED_MODEL_TYPES`` too).
UNSUPPORTED_MODEL_TYPES: dict[str, str] = REJECTED_MODEL_TYPES


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


__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_MODEL_TYPES", "UNSUPPORTED_ARCHITECTURES", "UNSUPPORTED_MODEL_TYPES",
           "UnsupportedArchitectureError", "check_model_compatibility"]  # fmt: skip
