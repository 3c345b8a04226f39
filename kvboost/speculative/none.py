"""No speculation (the default): the engine decodes one token per target forward, on its plain path."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvboost.decoding import Sampling
from kvboost.registry import DRAFT
from kvboost.speculative.base import Draft, DraftStrategy


@DRAFT.register("none")
class NoDraft(DraftStrategy):
    """Proposes nothing; ``enabled = False`` makes the engine keep its plain decode loop, byte for byte."""

    enabled = False

    def __init__(self) -> None:
        super().__init__(num_draft=1, max_draft=1, adaptive=False)

    def propose(
        self, context: Sequence[int], k: int, sampling: Sampling, generator: torch.Generator | None = None
    ) -> Draft:
        return Draft()

    def fingerprint(self) -> str:
        return "none"
