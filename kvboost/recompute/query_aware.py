"""Query-aware recomputation: repair the content-hit tokens the prompt's question actually reads.

CacheBlend ranks tokens by how far their K/V drift at an early layer. On a small model that proxy mostly finds
each document's first tokens (the standalone KV's attention sinks) and misses what matters for the answer: the
sentences the question is about, whose K/V in a full prefill attend to the question asked before the documents.
This strategy asks the prompt itself. A probe pass computes only the new tokens (the question after the
documents and the answer start) over the re-rotated content hits, as ``recompute=none`` does, and records the
attention of those reader queries over every content token at the upper half of the layers. The
``ratio`` of content tokens read most are then recomputed at every layer together with the new tokens.

Cost: the probe (about a ``none`` prefill, up to the last probed layer) plus ``ratio`` of the content at every
layer; no full prefill. The new tokens before the first content hit (e.g. a question asked before the documents)
attend to exact rows only, so the probe computes them exactly; when it ran every layer the real pass keeps them
instead of computing them twice.

Defaults (ratio 0.2, the upper half of the layers, ``heads=max``) were chosen on the RAG-reorder workload and
checked on a second draw of its queries (experiments/results/README.md, "query_aware").
"""

from __future__ import annotations

import torch

from kvboost.recompute.base import LayerView, RecomputeStrategy, check_flag, check_fraction
from kvboost.registry import RECOMPUTE

HEAD_REDUCTIONS = ("mean", "max")


@RECOMPUTE.register("query_aware")
class QueryAware(RecomputeStrategy):
    """Recompute the top ``ratio`` of content-hit tokens by the attention the prompt's reader queries pay them.

    Args:
        ratio: fraction of content-hit tokens recomputed (at every layer).
        from_layer: first probed layer as a fraction of the model's depth (0.5: the upper half); the
            attention is summed over the probed layers.
        to_layer: end of the probed layers (exclusive) as a fraction of the depth (1.0: up to the last layer).
            The probe pass stops after the last probed layer, so probing lower layers costs less.
        heads: how a layer's heads are combined: ``mean`` (the average reader) or ``max`` (any head that
            reads the token strongly, e.g. a retrieval head).
        oracle_agreement: also judge each selection against the oracle's (``oracle_recall``,
            ``oracle_rank_corr`` of the reader attention; costs a full prefill, kept out of TTFT).
    """

    needs_reader_attention = True

    def __init__(self, ratio: float = 0.2, from_layer: float = 0.5, heads: str = "max",
                 to_layer: float = 1.0, oracle_agreement: bool = False) -> None:  # fmt: skip
        name = self.registry_name
        self.oracle_agreement = check_flag(name, "oracle_agreement", oracle_agreement)
        self.ratio = check_fraction(name, "ratio", ratio)
        self.from_layer = check_fraction(name, "from_layer", from_layer)
        self.to_layer = check_fraction(name, "to_layer", to_layer)
        if self.to_layer < self.from_layer:
            raise ValueError(
                f"recompute strategy {name!r}: to_layer ({to_layer}) must not be below from_layer ({from_layer})"
            )
        if heads not in HEAD_REDUCTIONS:
            raise ValueError(f"recompute strategy {name!r}: heads must be one of {HEAD_REDUCTIONS}, got {heads!r}")
        self.heads = heads

    def reader_layers(self, num_layers: int) -> tuple[int, ...]:
        first = min(num_layers - 1, int(round(self.from_layer * num_layers)))
        end = max(first + 1, min(num_layers, int(round(self.to_layer * num_layers))))
        return tuple(range(first, end))

    def score(self, view: LayerView) -> torch.Tensor:
        """The reader attention per candidate: summed over the probed layers, heads reduced by ``heads``."""
        attention = view.reader_attention
        if attention is None or attention.dim() != 3 or attention.shape[2] != view.candidates.numel():
            raise ValueError(
                f"recompute strategy {self.registry_name!r} needs view.reader_attention [layers, heads, candidates] "
                "(the engine's probe pass provides it)"
            )
        per_head = attention.float()
        return (per_head.mean(dim=1) if self.heads == "mean" else per_head.amax(dim=1)).sum(dim=0)

    def fingerprint(self) -> str:
        return f"query_aware:{self.ratio}:{self.from_layer}:{self.to_layer}:{self.heads}"
