"""Layer streaming: models larger than memory (DESIGN.md "Models larger than memory, and speculative decoding").

``KVBoost.from_pretrained(folder, streaming={"resident_layers": K, "prefetch": True})`` keeps the embeddings, the
final norm, the head and the resident decoder layers in memory and streams the others, one layer at a time, from
the safetensors files (CPU: ``source: mmap``) or from a pinned host copy (GPU: ``source: pinned``) into
preallocated staging slots, the next layer loading while the current one computes. Fields and the byte
accounting: :mod:`kvboost.streaming.planner`; the mechanism: :mod:`kvboost.streaming.streamer`; sources:
:mod:`kvboost.streaming.source`.

It only changes where weights come from: every KV-reuse feature works unchanged, and the model fingerprint is the
fully resident model's (streamed tensors are digested from the files). The engine's fused decode step reads
layer weights directly, so a streamed model decodes through HF's forward (``decode="hf"``, see
:func:`streamed_decode`).
"""

from __future__ import annotations

from typing import Any

from kvboost.streaming.loader import (
    RESOLVER_ATTR,
    STREAMER_ATTR,
    build_streamed_model,
    load_streamed_model_and_tokenizer,
    streaming_plan,
)
from kvboost.streaming.planner import StreamingBudgetError, StreamingConfig, StreamingPlan, plan_streaming
from kvboost.streaming.source import HostCopySource, MmapSource, SafetensorsIndex, WeightSource
from kvboost.streaming.streamer import LayerStreamer

DECODE_REASON = (
    "layer streaming: the streamer swaps weights in forward hooks that only HF's modules fire; every forward runs "
    "on the HF-generic runner"
)


def streaming_enabled(spec: Any) -> bool:
    """Whether a ``streaming`` option turns streaming on (validates it: bad fields raise ``ValueError``)."""
    return StreamingConfig.parse(spec) is not None


def streamed_decode(requested: str | None) -> str:
    """The engine's ``decode`` mode for a streamed model: ``"hf"`` (``auto`` and ``hf``); the fused modes raise."""
    if requested in (None, "auto", "hf"):
        return "hf"
    raise ValueError(f"decode={requested!r} cannot run a streamed model: {DECODE_REASON}; use decode='auto' or 'hf'")


__all__ = [
    "DECODE_REASON",
    "RESOLVER_ATTR",
    "STREAMER_ATTR",
    "HostCopySource",
    "LayerStreamer",
    "MmapSource",
    "SafetensorsIndex",
    "StreamingBudgetError",
    "StreamingConfig",
    "StreamingPlan",
    "WeightSource",
    "build_streamed_model",
    "load_streamed_model_and_tokenizer",
    "plan_streaming",
    "streamed_decode",
    "streaming_enabled",
    "streaming_plan",
]  # fmt: skip
