"""Layer-skip self-drafting: the target's first ``layers`` decoder layers, then its final norm and LM head.

No second model and no second cache: the hidden state of layer i depends only on layers < i, so the target's
own K/V rows of layers [0, layers) at the accepted positions are exactly what the draft needs. The draft writes
its tokens' rows of those layers into the target's buffers past the accepted length (scratch: the verification
forward overwrites every one of them), and a rejection needs no rollback of its own.

The draft runs the engine's fused one-token step (``kvboost.models.decode_step``) over the first layers only:
the compiled graphs the engine already built, so nothing more is compiled. Models the fused step does not cover
are refused at bind time with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvboost.decoding import Sampling
from kvboost.registry import DRAFT
from kvboost.speculative.base import Draft, DraftRequest, DraftStrategy, check_positive_int, choose_draft_token


@DRAFT.register("layer_skip")
class LayerSkip(DraftStrategy):
    """The target's first ``layers`` layers + final norm + LM head as a draft model (self-speculation).

    Args:
        layers: decoder layers the draft runs (1 <= layers < the target's layer count); ``None``: half of them.
        num_draft, max_draft, adaptive: see :class:`~kvboost.speculative.base.DraftStrategy`.
    """

    def __init__(
        self, layers: int | None = None, num_draft: int = 4, max_draft: int = 8, adaptive: bool = True
    ) -> None:
        super().__init__(num_draft=num_draft, max_draft=max_draft, adaptive=adaptive)
        if layers is not None:
            check_positive_int("layer_skip", "layers", layers)
        self.layers = layers
        self._step: Any = None
        self._own_step: Any = None
        self._request: DraftRequest | None = None

    def bind(self, model: Any, tokenizer: Any) -> None:
        from kvboost.models.decode_step import unsupported_reason

        total = int(model.config.get_text_config(decoder=True).num_hidden_layers)
        if self.layers is None:
            self.layers = max(1, total // 2)
        if not self.layers < total:
            raise ValueError(
                f"speculative 'layer_skip': layers must be below the target's {total} decoder layers, got {self.layers}"
            )
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(
                f"speculative 'layer_skip' runs the fused decode step, which cannot run this model: {reason}"
            )
        self._model = model

    def begin(self, request: DraftRequest) -> None:
        self._request = request
        step = request.decode_step
        if step is None:  # the engine decodes through HF: an eager step of our own (HF's arithmetic)
            if self._own_step is None:
                from kvboost.models.decode_step import FusedDecodeStep

                self._own_step = FusedDecodeStep(self._model, compile=False)
            step = self._own_step
        self._step = step

    def end(self) -> None:
        self._request = None

    @torch.inference_mode()
    def propose(
        self, context: Sequence[int], k: int, sampling: Sampling, generator: torch.Generator | None = None
    ) -> Draft:
        request = self._request
        if request is None:
            raise RuntimeError("layer_skip: propose() outside a request (call begin() first)")
        step, kv = self._step, request.kv
        inner = step.model.model
        position = len(context) - 1  # the last context token is not in the target's cache yet
        # Verification writes k + 1 rows (the last context token and the k drafts) from `position`: keep them
        # inside the cache.
        k = max(0, min(k, kv.capacity - position - 1))
        token = int(context[-1])
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for _ in range(k):
            t = torch.tensor([token], device=kv.keys.device)
            x, cos, sin = step._prologue_fn(t, position, inner.embed_tokens.weight, inner.rotary_emb.inv_freq)
            for i in range(self.layers):
                x = step._layer_fn(x, cos, sin, position, kv.keys[i], kv.values[i], *step._layer_weights[i])
            logits = step._epilogue_fn(x, inner.norm.weight, step.model.lm_head.weight)
            token, q = choose_draft_token(logits, sampling, generator)
            tokens.append(token)
            if q is not None:
                qs.append(q)
            position += 1
        return Draft(tokens, torch.stack(qs) if qs else None)

    def fingerprint(self) -> str:
        return f"layer_skip:{self.layers}:{super().fingerprint()}"
