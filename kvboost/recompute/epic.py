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

``skip_first_chunk``: EPIC leaves the initial tokens of the prompt's first chunk alone (there they are the real
sinks). "First" is read on the prompt's segments, so that it holds on chat-template prompts, where the template's
head (and a system prompt) comes before the first document and no document ever starts at position 0: the first
reused chunk is left as cached when it starts the prompt, or when only the lead-in precedes it: the prompt's first
segment (chat-template head, system prompt, "Passages:") and separators (segments whose ids recur between the
documents; cached with each passage, a separator may itself be a content hit). In the independent layout (every passage cached alone after BOS) that is passage 1; in the
shared-prefix layout passage 1 is an exact hit between the lead-in and the first reused passage, so every reused
passage keeps its repair. Off by default.

Scored: ``-offset`` in its chunk (earlier first; ``-inf`` in a skipped first chunk); the budget is the base's
threshold ``offset < k``, not a ratio (the fraction it used is measured: ``content_recompute_fraction``; compose it
with a ratio-budgeted strategy through ``compose``). The paper's numbers are not reproduced here.
"""

from __future__ import annotations

from collections import Counter

import torch

from kvboost.plan import KIND_CODES, ReusePlan
from kvboost.recompute.base import LayerView, RecomputeStrategy, check_count, check_flag
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


def first_chunk(plan: ReusePlan) -> torch.Tensor:
    """``[n]`` bool: the positions of the chunk EPIC's ``skip_first_chunk`` leaves alone (see the module docstring):
    the reused chunk at position 0, or the first segment after the lead-in (segment 0) and the separators before it
    when that segment is a reused chunk; else all False. Separators are segments whose ids recur between the
    documents (a delimiter appears at least twice after the lead-in); they may be content hits themselves."""
    n = len(plan)
    out = torch.zeros(n, dtype=torch.bool)
    if not plan.content_tokens:
        return out
    bounds: dict[int, int] = {}  # segment start -> end
    for span in plan.spans:
        if span.start < n:
            bounds[span.segment_start] = max(bounds.get(span.segment_start, 0), min(span.end, n))
    segments = sorted(bounds.items())
    if int(plan.kinds[0]) == KIND_CODES["content"]:
        start = 0
    elif len(segments) > 1 and segments[0][0] == 0:
        ids = [tuple(plan.prompt_ids[a:b]) for a, b in segments]
        recurring = Counter(ids[1:])
        i = 1
        while i < len(segments) and recurring[ids[i]] > 1:
            i += 1
        if i == len(segments) or int(plan.kinds[segments[i][0]]) != KIND_CODES["content"]:
            return out
        start = segments[i][0]
    else:
        return out
    offsets = chunk_offsets(plan)
    end = start + 1
    while end < n and int(plan.kinds[end]) == KIND_CODES["content"] and int(offsets[end]) == end - start:
        end += 1
    out[start:end] = True
    return out


@RECOMPUTE.register("epic")
class EpicRecompute(RecomputeStrategy):
    """The first ``k`` tokens of every reused chunk (EPIC's LegoLink), at every layer.

    Args:
        k: initial tokens recomputed per reused chunk.
        skip_first_chunk: leave the prompt's first chunk as cached (at position 0, or the first document after a
            chat-template / system lead-in; see the module docstring).
        oracle_agreement: also judge each selection against the reference's (``oracle_recall``;
            ``oracle_rank_corr`` of the score "earlier in its chunk first"; costs a full prefill, kept out of TTFT).
    """

    ratio = None

    def __init__(self, k: int = 16, skip_first_chunk: bool = False, oracle_agreement: bool = False) -> None:
        self.oracle_agreement = check_flag("epic", "oracle_agreement", oracle_agreement)
        self.skip_first_chunk = check_flag("epic", "skip_first_chunk", skip_first_chunk)
        self.k = check_count("epic", "k", k)
        self.threshold = 1.0 - k  # -offset >= 1 - k  <=>  offset < k

    def score(self, view: LayerView) -> torch.Tensor:
        """Earlier in its reused chunk first; ``-inf`` in a skipped first chunk."""
        candidates = view.candidates.cpu()
        scores = -chunk_offsets(view.plan)[candidates].float()
        if self.skip_first_chunk:
            scores[first_chunk(view.plan)[candidates]] = float("-inf")
        return scores

    def fingerprint(self) -> str:
        return f"epic:{self.k}:{int(self.skip_first_chunk)}"
