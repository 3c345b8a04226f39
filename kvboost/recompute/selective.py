"""Recompute the first tokens of every content-hit run: a cheap, position-based repair."""

from __future__ import annotations

import torch

from kvboost.plan import KIND_CODES, ReusePlan
from kvboost.recompute.base import LayerView, RecomputeStrategy, check_count, check_flag
from kvboost.registry import RECOMPUTE


@RECOMPUTE.register("selective")
class SelectiveRecompute(RecomputeStrategy):
    """The first ``r`` tokens of every run of content hits, and the first ``sink`` non-exact prompt tokens.

    A document cached on its own was computed from position 0: its first tokens carry the attention-sink role
    a sequence start gets, and they attended to nothing before them. Placed after other text, those first
    tokens deviate most; recomputing them (at every layer) is the simplest repair, chosen by position rather
    than measured deviation (compare ``cacheblend``; ``epic`` counts from the start of each reused document
    instead of each run of consecutive content hits).

    Scored: ``-offset`` in its run (earlier first); the budget is the threshold ``offset < r`` (the fraction it
    used is measured); the ``sink`` positions score above every other.

    Args:
        r: tokens recomputed at the start of each run of consecutive content-hit positions.
        sink: also recompute the first ``sink`` positions of the prompt that are not exact hits (the real
            sequence start, when the prompt itself begins with a content hit).
        oracle_agreement: also judge each selection against the reference's (``oracle_recall``;
            ``oracle_rank_corr`` of the score "earlier in its run first"; costs a full prefill, kept out of TTFT).
    """

    ratio = None

    def __init__(self, r: int = 16, sink: int = 0, oracle_agreement: bool = False) -> None:
        self.oracle_agreement = check_flag("selective", "oracle_agreement", oracle_agreement)
        self.r, self.sink = check_count("selective", "r", r), check_count("selective", "sink", sink)
        self.threshold = 1.0 - r  # -offset >= 1 - r  <=>  offset < r

    @staticmethod
    def _offsets(plan: ReusePlan) -> torch.Tensor:
        """Each position's offset from the start of its run of content hits (meaningful at content positions)."""
        pos = torch.arange(len(plan))
        content = plan.kinds == KIND_CODES["content"]
        previous_content = torch.cat([torch.zeros(1, dtype=torch.bool), content[:-1]])
        run_start = torch.where(content & ~previous_content, pos, torch.zeros_like(pos)).cummax(0).values
        return pos - run_start

    def score(self, view: LayerView) -> torch.Tensor:
        """Earlier in its run of content hits first; the ``sink`` positions above every other."""
        plan, candidates = view.plan, view.candidates.cpu()
        scores = -self._offsets(plan)[candidates].float()
        if self.sink:
            sink = torch.nonzero(plan.kinds != KIND_CODES["exact"], as_tuple=False).flatten()[: self.sink]
            scores[torch.isin(candidates, sink)] = float(len(plan))
        return scores

    def fingerprint(self) -> str:
        return f"selective:{self.r}:{self.sink}"
