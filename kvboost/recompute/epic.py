"""EPIC-style repair: recompute the first ``k`` tokens of every reused chunk (LegoLink).

Hu et al., "EPIC: Efficient Position-Independent Context Caching for Serving Large Language Models" (2024,
arXiv:2410.15332; ICML 2025). A chunk cached on its own was encoded from a sequence start: its first tokens act
as attention sinks, and placed after other text they soak up attention that belongs elsewhere. EPIC's LegoLink
recomputes only a small, fixed number of initial tokens of each chunk (a cost independent of the chunk's length)
and reuses the rest as cached.

What a "chunk" is here: a run of content-hit tokens of one *segment* (``ChunkSpan.segment_start``: a stretch
tokenized and stored on its own, e.g. one document under the ``separator`` chunker). A document stored as
several fixed-size chunks is one EPIC chunk (its later chunks were computed after its earlier ones, so only its
start carries the sinks), and two documents with no new token between them are two EPIC chunks. ``selective``
differs in exactly that: it counts from the start of each run of consecutive content hits.

``skip_first_chunk``: EPIC leaves the initial tokens of a chunk that starts the sequence alone (there they are the
real sinks). In kvboost the first reused document usually follows an exact prefix (a system prompt), so the
default recomputes every chunk's first tokens; set it to leave the first reused chunk as cached when that chunk
starts at position 0.

Scored: ``-offset`` in its chunk (earlier first); the budget is the threshold ``offset < k``, not a ratio (compose
it with a ratio-budgeted strategy through ``compose``). The paper's numbers are not reproduced here.
"""

from __future__ import annotations

import torch

from kvboost.plan import KIND_CODES, ReusePlan
from kvboost.recompute.base import ScoredStrategy, check_flag
from kvboost.registry import RECOMPUTE


def chunk_offsets(plan: ReusePlan) -> torch.Tensor:
    """Each prompt position's offset from the start of its reused chunk (a run of content hits inside one segment);
    meaningful at content positions. Without spans covering the prompt, segments are the content placements."""
    n = len(plan)
    segment = torch.zeros(n, dtype=torch.long)
    if plan.spans and plan.spans[-1].end >= n:
        for span in plan.spans:
            segment[span.start : min(span.end, n)] = span.segment_start
    else:
        for p in plan.placements:
            segment[p.start : p.end] = p.start
    pos = torch.arange(n)
    content = plan.kinds == KIND_CODES["content"]
    previous_content = torch.cat([torch.zeros(1, dtype=torch.bool), content[:-1]])
    previous_segment = torch.cat([torch.full((1,), -1, dtype=torch.long), segment[:-1]])
    starts = content & (~previous_content | (segment != previous_segment))
    run_start = torch.where(starts, pos, torch.zeros_like(pos)).cummax(0).values
    return pos - run_start


@RECOMPUTE.register("epic")
class EpicRecompute(ScoredStrategy):
    """The first ``k`` tokens of every reused chunk (EPIC's LegoLink), at every layer.

    Args:
        k: initial tokens recomputed per reused chunk.
        skip_first_chunk: leave the first reused chunk as cached when it starts the prompt (position 0).
        oracle_agreement: also judge each selection against the oracle's (``oracle_recall``; ``oracle_rank_corr``
            of the score "earlier in its chunk first"; costs a full prefill, kept out of TTFT).
    """

    def __init__(self, k: int = 16, skip_first_chunk: bool = False, oracle_agreement: bool = False) -> None:
        self.oracle_agreement = check_flag("epic", "oracle_agreement", oracle_agreement)
        self.skip_first_chunk = check_flag("epic", "skip_first_chunk", skip_first_chunk)
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"recompute strategy 'epic': k must be a non-negative integer, got {k!r}")
        self.k = k

    def score(self, plan: ReusePlan, candidates: torch.Tensor, deviation: dict[str, torch.Tensor] | None = None
              ) -> torch.Tensor:  # fmt: skip
        """Earlier in its reused chunk first."""
        return -chunk_offsets(plan)[candidates].float()

    def choose(self, plan: ReusePlan, candidates: torch.Tensor, scores: torch.Tensor, layer: int | None = None
               ) -> torch.Tensor:  # fmt: skip
        keep = scores > -self.k
        if self.skip_first_chunk and len(plan) and int(plan.kinds[0]) == KIND_CODES["content"]:
            n = len(plan)
            in_first = (plan.kinds == KIND_CODES["content"]) & (chunk_offsets(plan) == torch.arange(n))
            outside = torch.nonzero(~in_first, as_tuple=False).flatten()
            first_end = int(outside[0]) if outside.numel() else n
            keep &= candidates >= first_end
        return candidates[keep]

    def fingerprint(self) -> str:
        return f"epic:{self.k}:{int(self.skip_first_chunk)}"
