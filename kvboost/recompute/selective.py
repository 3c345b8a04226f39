"""Recompute the first tokens of every content-hit run: a cheap, position-based repair."""

from __future__ import annotations

import torch

from kvboost.plan import KIND_CODES, ReusePlan
from kvboost.recompute.base import ScoredStrategy, check_flag
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("selective")
class SelectiveRecompute(ScoredStrategy):
    """The first ``r`` tokens of every run of content hits, and the first ``sink`` non-exact prompt tokens.

    A document cached on its own was computed from position 0: its first tokens carry the attention-sink role
    a sequence start gets, and they attended to nothing before them. Placed after other text, those first
    tokens deviate most; recomputing them (at every layer) is the simplest repair, chosen by position rather
        than measured deviation (compare ``cacheblend``; ``epic`` counts from the start of each reused document
    instead of each run of consecutive content hits).

    Scored: "earlier in its run first" (``-offset``); the budget is a threshold (``offset < r``), not a ratio.

    Args:
        r: tokens recomputed at the start of each run of consecutive content-hit positions.
        sink: also recompute the first ``sink`` positions of the prompt that are not exact hits (the real
            sequence start, when the prompt itself begins with a content hit).
        oracle_agreement: also judge each selection against the oracle's (``oracle_recall``; ``oracle_rank_corr``
            of the score "earlier in its run first"; costs a full prefill, kept out of TTFT).
    """

    def __init__(self, r: int = 16, sink: int = 0, oracle_agreement: bool = False) -> None:
        self.oracle_agreement = check_flag("selective", "oracle_agreement", oracle_agreement)
        for name, value in (("r", r), ("sink", sink)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"recompute strategy 'selective': {name} must be a non-negative integer, got {value!r}")
        self.r, self.sink = r, sink

    @staticmethod
    def _offsets(plan: ReusePlan) -> torch.Tensor:
        """Each position's offset from the start of its run of content hits (meaningful at content positions)."""
        pos = torch.arange(len(plan))
        content = plan.kinds == KIND_CODES["content"]
        previous_content = torch.cat([torch.zeros(1, dtype=torch.bool), content[:-1]])
        run_start = torch.where(content & ~previous_content, pos, torch.zeros_like(pos)).cummax(0).values
        return pos - run_start

    def score(self, plan: ReusePlan, candidates: torch.Tensor, deviation: dict[str, torch.Tensor] | None = None
              ) -> torch.Tensor:  # fmt: skip
        """Earlier in its run of content hits first (the order ``r`` cuts; ``sink`` is not scored)."""
        return -self._offsets(plan)[candidates].float()

    def choose(self, plan: ReusePlan, candidates: torch.Tensor, scores: torch.Tensor, layer: int | None = None
               ) -> torch.Tensor:  # fmt: skip
        keep = scores > -self.r
        if self.sink:
            sink = torch.nonzero(plan.kinds != KIND_CODES["exact"], as_tuple=False).flatten()[: self.sink]
            keep |= torch.isin(candidates, sink)
        return candidates[keep]

    def fingerprint(self) -> str:
        return f"selective:{self.r}:{self.sink}"
