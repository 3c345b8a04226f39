"""Layer-skip self-drafting: the target's first ``layers`` decoder layers, then its final norm and LM head.

No second model and no second cache: the hidden state of layer i depends only on layers < i, so the target's
own K/V rows of layers [0, layers) at the accepted positions are exactly what the draft needs. The draft runs
the engine's runner with ``ForwardBatch.num_layers = layers`` (the same arithmetic, the head the target has, an
int8 one included), writing its tokens' rows of those layers into the target's blocks past the accepted length:
scratch the verification forward overwrites. The table's length is put back after each proposal.

Models whose runner cannot stop after a layer (the HF-generic runner without layer-wise parts) are refused at
bind time with the reason.
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
        self._request: DraftRequest | None = None

    def bind(self, model: Any, tokenizer: Any) -> None:
        total = int(model.config.get_text_config(decoder=True).num_hidden_layers)
        if self.layers is None:
            self.layers = max(1, total // 2)
        if not self.layers < total:
            raise ValueError(
                f"speculative 'layer_skip': layers must be below the target's {total} decoder layers, got {self.layers}"
            )
        base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
        missing = [name for name in ("embed_tokens", "layers", "norm") if not hasattr(base, name)]
        if base is None or missing:
            raise ValueError(f"speculative 'layer_skip' runs the target's first layers and its head; "
                             f"{type(model).__name__} does not expose them (missing: {', '.join(missing)})")  # fmt: skip

    def begin(self, request: DraftRequest) -> None:
        self._request = request

    def end(self) -> None:
        self._request = None

    @torch.inference_mode()
    def propose(
        self, context: Sequence[int], k: int, sampling: Sampling, generator: torch.Generator | None = None
    ) -> Draft:
        from kvboost.runtime.batch import ForwardBatch, SeqInput

        request = self._request
        if request is None:
            raise RuntimeError("layer_skip: propose() outside a request (call begin() first)")
        table, runner = request.table, request.runner
        accepted = table.length  # the last context token is not in the target's cache yet
        limit = runner.pool.num_blocks * runner.pool.block_size
        k = max(0, min(k, limit - accepted - 1))
        token = int(context[-1])
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        try:
            for _ in range(k):
                logits = runner.run(ForwardBatch.build([SeqInput(table, [token])], num_layers=self.layers))[0]
                token, q = choose_draft_token(logits, sampling, generator)
                tokens.append(token)
                if q is not None:
                    qs.append(q)
        finally:
            table.truncate(accepted)  # the draft's rows are scratch: the verification writes them again
        return Draft(tokens, torch.stack(qs) if qs else None)

    def fingerprint(self) -> str:
        return f"layer_skip:{self.layers}:{super().fingerprint()}"
