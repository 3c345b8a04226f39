"""Loading a model the way ``KVBoost.from_pretrained`` does: weights, layer streaming, int8 head, AWQ prefill,
and the weight format of a GGUF model (``weights``: ``kvboost.models.gguf_weights``).

The loading options are checked before any weight is read (a typo costs no 12-second load).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

#: from_pretrained keywords consumed here (the rest go to the engine's constructor).
LOADING_OPTIONS = ("streaming", "lm_head", "awq_prefill", "weights")


@dataclass(frozen=True)
class LoadOptions:
    """``streaming`` (``kvboost.streaming``), ``lm_head`` (``None`` | ``"int8"``), ``awq_prefill`` (``None`` |
    ``"int4"`` | ``"dense"``), ``weights`` (``"dense"``, the default: every tensor as transformers loads it |
    ``"gguf_int4"``: a GGUF model's Q4_0/Q4_1/Q4_K linears run as shipped in torch's int4 CPU kernel,
    ``kvboost.models.gguf_weights``; ``None`` means ``"dense"``)."""

    streaming: Any = None
    lm_head: str | None = None
    awq_prefill: str | None = None
    weights: str | None = "dense"

    def __post_init__(self) -> None:
        from kvboost.models.gguf_weights import check_weights
        from kvboost.models.int8_head import LM_HEAD_CHOICES

        object.__setattr__(self, "weights", check_weights(self.weights))
        if self.lm_head not in (*LM_HEAD_CHOICES, "none"):
            raise ValueError(f"lm_head must be one of {[c for c in LM_HEAD_CHOICES if c]} or null, got {self.lm_head!r}")
        if self.awq_prefill not in (None, "int4", "dense"):
            raise ValueError(f"awq_prefill must be null, 'int4' or 'dense', got {self.awq_prefill!r}")


def load_for_engine(
    model_name_or_path: str | None, *, dtype: str | torch.dtype | None, device: str | None, options: LoadOptions,
    decode: str | None = None,
) -> tuple[Any, Any, str, dict[str, Any]]:
    """``(model, tokenizer, identity, engine options implied by the loading)``: a streamed model decodes through
    HF's forward (its layer streamer swaps weights in hooks that only HF's modules fire)."""
    from kvboost.models.awq import set_awq_prefill
    from kvboost.models.int8_head import quantize_lm_head
    from kvboost.models.loading import load_model_and_tokenizer
    from kvboost.streaming import load_streamed_model_and_tokenizer, streamed_decode, streaming_enabled

    implied: dict[str, Any] = {}
    gguf_file = None
    if options.weights == "gguf_int4":  # refused before any weight is read
        from kvboost.models.gguf_weights import gguf_source

        if streaming_enabled(options.streaming):
            raise ValueError("weights='gguf_int4' does not stream layers (the streamer reads safetensors folders); "
                             "turn streaming off or use weights='dense'")  # fmt: skip
        gguf_file = gguf_source(model_name_or_path)
    if streaming_enabled(options.streaming):
        model, tokenizer, path = load_streamed_model_and_tokenizer(model_name_or_path, options.streaming,
                                                                   dtype=dtype, device=device)  # fmt: skip
        if getattr(model, "_kvboost_streamer", None) is not None:  # some layer is streamed: HF's modules only
            streamed_decode(decode)  # an explicit fused mode is refused with the reason
    else:
        model, tokenizer, path = load_model_and_tokenizer(model_name_or_path, dtype=dtype, device=device)
    if gguf_file is not None:
        from kvboost.models.gguf_weights import apply_gguf_int4

        # lm_head="int8" quantizes the dense head (an int4 one would have nothing left to quantize)
        apply_gguf_int4(model, gguf_file, keep_dense=("lm_head",) if options.lm_head == "int8" else ())
    quantize_lm_head(model, options.lm_head)
    set_awq_prefill(model, options.awq_prefill)
    identity = path if model_name_or_path is None else str(model_name_or_path)
    return model, tokenizer, identity, implied
