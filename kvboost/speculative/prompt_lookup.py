"""Prompt lookup decoding: propose the continuation of an earlier occurrence of the last n tokens.

Answers that quote their context (a rewritten text, code edited in place, a name repeated from the question)
continue an n-gram that already occurs in the prompt or the history. No model runs to draft: the cost is a
search over the context, and q is one-hot (a deterministic proposal).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvboost.decoding import Sampling
from kvboost.registry import DRAFT
from kvboost.speculative.base import Draft, DraftStrategy, check_positive_int


@DRAFT.register("prompt_lookup")
class PromptLookup(DraftStrategy):
    """N-gram match of the context's last tokens in the context itself (prompt + generated).

    For n from ``max_ngram`` down to ``min_ngram``: find the most recent earlier occurrence of the last n tokens
    and propose the (up to k) tokens that followed it. The most recent match, not the first: in a multi-turn chat
    the latest quote of a passage is the likeliest to be quoted again the same way. No match: nothing is proposed
    (the engine runs a plain step).

    Args:
        max_ngram, min_ngram: the n-gram sizes tried, longest first (a longer match is a more specific context).
        num_draft, max_draft, adaptive: see :class:`~kvboost.speculative.base.DraftStrategy`.
        window: only the last ``window`` tokens of the context are searched (bounds the cost per step; 0: all).
    """

    def __init__(
        self,
        max_ngram: int = 3,
        min_ngram: int = 1,
        num_draft: int = 8,
        max_draft: int = 16,
        adaptive: bool = True,
        window: int = 0,
    ) -> None:
        super().__init__(num_draft=num_draft, max_draft=max_draft, adaptive=adaptive)
        check_positive_int("prompt_lookup", "max_ngram", max_ngram)
        check_positive_int("prompt_lookup", "min_ngram", min_ngram)
        check_positive_int("prompt_lookup", "window", window, minimum=0)
        if min_ngram > max_ngram:
            raise ValueError(f"speculative 'prompt_lookup': min_ngram ({min_ngram}) must be <= max_ngram ({max_ngram})")
        self.max_ngram, self.min_ngram, self.window = max_ngram, min_ngram, window

    def propose(
        self, context: Sequence[int], k: int, sampling: Sampling, generator: torch.Generator | None = None
    ) -> Draft:
        ctx = list(context[-self.window :]) if self.window else list(context)
        return Draft(find_continuation(ctx, k, self.max_ngram, self.min_ngram))

    def fingerprint(self) -> str:
        return f"prompt_lookup:{self.min_ngram}-{self.max_ngram}:{self.window}:{super().fingerprint()}"


def find_continuation(context: Sequence[int], k: int, max_ngram: int, min_ngram: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the context's last n tokens (n from
    ``max_ngram`` down to ``min_ngram``); ``[]`` when none occurs."""
    total = len(context)
    if total < 2 or k < 1:
        return []
    ctx = torch.tensor(context, dtype=torch.long)
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        tail = ctx[total - n :]
        # Windows starting at 0 .. total - n - 1: every occurrence but the tail itself, each with >= 1 follower.
        windows = ctx[: total - 1].unfold(0, n, 1)
        hits = torch.nonzero((windows == tail).all(dim=1), as_tuple=False)
        if hits.numel():
            start = int(hits[-1]) + n
            return ctx[start : start + k].tolist()
    return []
