"""Relevance selection (ProphetKV / CacheClip-style): the question's attention to chunk tokens picks what to recompute.

Wang et al., "ProphetKV: User-Query-Driven Selective Recomputation for Efficient KV Cache Reuse in
Retrieval-Augmented Generation" (arXiv:2602.02579), names the "crowding-out effect": a query-agnostic criterion
(CacheBlend's K/V deviation) fills the recomputation budget with globally salient tokens the user's question does
not need. It ranks tokens by their relevance to the question and fuses attention measured at several layers.
Yang et al., "CacheClip: Accelerating RAG with Effective KV Cache Reuse" (arXiv:2510.10129), selects tokens from
last-layer attention (of a small auxiliary model) and recomputes them in groups (a sliding window), so a selected
token brings its neighbours and the updated KV stays locally coherent.

What runs here, on kvboost's hook points: the engine's reader probe (as for ``query_aware``) computes only the new
tokens over the re-rotated content hits and records the attention of the prompt's closing tokens (the question
after the documents) over every content token at the probed layers. Then:

- layer fusion: each probed layer's attention (heads reduced by ``heads``) is normalised to sum to 1 over the
  content tokens before the layers are summed, so every probed layer has an equal say (``query_aware`` sums raw
  attention: layers that put more mass on the documents dominate);
- sinks (optional, off by default): with ``skip_first`` s > 0 the first s tokens of each reused chunk (the chunk's
  own attention sinks, which draw attention from any question) rank below every other token. Off by default since
  the first MuSiQue leaderboard run (SmolLM2, 4 question-draws, ratio 0.15,
  ``experiments/results/strategy_table/musique_smollm2/``): with ``skip_first: 1`` the first-token KL against the
  full prefill stayed at ``none``'s (0.83, query_aware 0.057), the likely cause being that a reused chunk's first
  tokens are the rows whose cached K/V deviate most (what EPIC recomputes); not yet re-measured with 0;
- grouping (CacheClip): with ``window`` w > 0 a token scores the best relevance within w tokens of it in its chunk
  (ties broken by its own), so relevant tokens are recomputed with their neighbours;
- the top ``ratio`` of content tokens by that score are recomputed at every layer with the new tokens.

Not reproduced: CacheClip's auxiliary (fine-tuned) small model and its CPU offload (the probe is the served model's
own, its time inside TTFT), ProphetKV's exact fusion rule and its two-stage pipeline, and both papers' numbers.
"""

from __future__ import annotations

import torch

from kvboost.plan import ReusePlan
from kvboost.recompute.epic import chunk_offsets
from kvboost.recompute.query_aware import QueryAware
from kvboost.registry import RECOMPUTE

#: the weight of a token's own relevance when it breaks ties inside a group (``window``)
TIE_BREAK = 1e-3


@RECOMPUTE.register("relevance")
class RelevanceRecompute(QueryAware):
    """Top ``ratio`` of content tokens by the question's layer-fused attention, sinks demoted, grouped.

    Args:
        ratio: fraction of content-hit tokens recomputed (at every layer).
        from_layer, to_layer: the probed layers as fractions of the depth (as ``query_aware``'s).
        heads: ``mean`` | ``max`` over a layer's heads.
        skip_first: tokens at the start of each reused chunk ranked last (sinks; 0: none).
        window: grouping radius: a token scores the best relevance within ``window`` tokens of it in its chunk.
        oracle_agreement: also judge each selection against the oracle's (costs a full prefill, out of TTFT).
    """

    def __init__(self, ratio: float = 0.2, from_layer: float = 0.5, to_layer: float = 1.0, heads: str = "max",
                 skip_first: int = 0, window: int = 0, oracle_agreement: bool = False) -> None:  # fmt: skip
        for name, value in (("skip_first", skip_first), ("window", window)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"recompute strategy 'relevance': {name} must be a non-negative integer, got {value!r}"
                )
        super().__init__(ratio=ratio, from_layer=from_layer, heads=heads, to_layer=to_layer,
                         oracle_agreement=oracle_agreement)  # fmt: skip
        self.skip_first, self.window = skip_first, window

    def score(self, plan: ReusePlan, candidates: torch.Tensor, deviation: dict[str, torch.Tensor] | None = None
              ) -> torch.Tensor:  # fmt: skip
        per_layer = self.layer_attention(plan)  # [layers, content]
        raw = (per_layer / per_layer.sum(dim=1, keepdim=True).clamp_min(1e-30)).sum(dim=0)
        content = plan.positions("content")
        offsets = chunk_offsets(plan)[content]
        sink = offsets < self.skip_first
        fused = torch.where(sink, torch.zeros_like(raw), raw)  # a sink's attention does not spread to its group
        if self.window:
            chunk = torch.cumsum((offsets == 0).long(), 0)  # which reused chunk each content token is in
            pooled = fused.clone()
            for d in range(1, self.window + 1):
                for src, dst in ((slice(d, None), slice(None, -d)), (slice(None, -d), slice(d, None))):
                    same = chunk[src] == chunk[dst]
                    pooled[dst] = torch.where(same, torch.maximum(pooled[dst], fused[src]), pooled[dst])
            fused = pooled + TIE_BREAK * fused
        demoted = raw - (float(raw.max()) + 1.0) if raw.numel() else raw  # below every other token (those are >= 0)
        scores = torch.where(sink, demoted, fused)
        if candidates.numel() != content.numel():
            scores = scores[torch.searchsorted(content, candidates)]
        return scores

    def fingerprint(self) -> str:
        return (f"relevance:{self.ratio}:{self.from_layer}:{self.to_layer}:{self.heads}:{self.skip_first}:"
                f"{self.window}")  # fmt: skip
