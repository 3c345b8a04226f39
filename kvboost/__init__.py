"""kvboost: chunk-level KV-cache reuse for HuggingFace decoder-only RoPE models.

``KVBoost`` (alias of ``kvboost.engine.InferenceEngine``) is the entry point; plugin families live in
``kvboost.registry``.
"""

import os as _os
import sys as _sys

import torch as _torch

# Triton decides when each @triton.jit function is *decorated* whether it is compiled or interpreted,
# including its own standard library (tl.max, tl.sum...), which transformers imports. Without a CUDA
# GPU only the CPU interpreter can run Triton kernels (attn=triton), so switch it on now, before
# transformers is imported below. An explicit user setting wins; on GPU machines nothing changes.
if not _torch.cuda.is_available() and "triton.language" not in _sys.modules:
    _os.environ.setdefault("TRITON_INTERPRET", "1")

from kvboost.engine import InferenceEngine, KVBoost
from kvboost.registry import (
    ATTENTION,
    CACHE_TIERS,
    CHUNKERS,
    EVICTION,
    HASHERS,
    KV_QUANT,
    RECOMPUTE,
    UnknownPluginError,
)
from kvboost.types import CorrectnessReport, GenerationResult, WarmResult

__all__ = [
    "ATTENTION", "CACHE_TIERS", "CHUNKERS", "EVICTION", "HASHERS", "KV_QUANT", "RECOMPUTE",
    "CorrectnessReport", "GenerationResult", "InferenceEngine", "KVBoost", "UnknownPluginError", "WarmResult",
]  # fmt: skip
__version__ = "0.1.0"
