"""A wrapper composing two strategies: the first's choice, then the second's top within the budget.

The shape of kvpress's composed presses: a strategy is a scoring function (``RecomputeStrategy.score``), so two of them
compose without either knowing the other. The canonical pair (the default) is EPIC's first tokens of each reused
chunk (``epic``: the chunks' sinks, position-based) plus the question's most-read tokens (``query_aware``): the
first repairs what every chunk gets wrong when placed after other text, the second what this question needs.

Budget (``ratio``, a fraction of the prompt's content-hit tokens):

- ``ratio: null``: the union of the two selections, each at its own budget (``epic``'s ``k`` per chunk and
  ``query_aware``'s ``ratio``);
- ``ratio: r``: ``round(r * content)`` tokens in all: the first's selection (cut to the budget by its own scores
  when it is larger), then the second's highest-scored tokens among the rest until the budget is full.

The first strategy must score from the plan alone (no check layers: its choice is fixed before any layer runs).
The second may narrow at check layers (``cacheblend``): every non-exact token is computed through them and at each
the first's choice is kept and the second's scores fill the rest (with ``ratio: null`` the second keeps its own
per-layer budget). Each side's reader-attention layers are probed (their union) and each side sees its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvboost.recompute.agreement import ranks
from kvboost.recompute.base import LayerView, RecomputeStrategy, check_flag, check_fraction
from kvboost.registry import RECOMPUTE


def _build(side: str, spec: Any) -> RecomputeStrategy:
    strategy = RECOMPUTE.build(spec)
    if not isinstance(strategy, RecomputeStrategy):
        raise ValueError(  # noqa: TRY004  (a bad config, as every other recompute setting)
            f"recompute strategy 'compose': {side} must be a recompute strategy (RecomputeStrategy), got "
            f"{type(strategy).__name__} ({getattr(strategy, 'registry_name', '?')!r})"
        )
    return strategy


@RECOMPUTE.register("compose")
class Compose(RecomputeStrategy):
    """The union of two strategies' selections, within a budget.

    Scored in tiers, so the base's budget does the rest: the first's selection (over every content token, at its own
    budget) above everything, ordered by the first's scores; with ``ratio: null`` the second's own selection next
    (the budget is then the threshold "in either selection"); the rest by the second's scores.

    Args:
        first: the strategy whose selection is taken first (a name or a config with ``name``; no check layers).
        second: the strategy that fills the rest of the budget by its scores.
        ratio: the total budget as a fraction of content-hit tokens; null: the union at each side's own budget.
        oracle_agreement: also judge each selection against the reference's (costs a full prefill, out of TTFT).
    """

    def __init__(self, first: Any = "epic", second: Any = "query_aware", ratio: float | None = None,
                 oracle_agreement: bool = False) -> None:  # fmt: skip
        self.oracle_agreement = check_flag("compose", "oracle_agreement", oracle_agreement)
        self.total = None if ratio is None else check_fraction("compose", "ratio", ratio)
        self.first, self.second = _build("first", first), _build("second", second)
        if self.first.check_layers:
            raise ValueError(
                f"recompute strategy 'compose': first ({self.first.registry_name!r}) narrows at check layers; put it "
                "second (the first's choice must be fixed before any layer runs)"
            )
        changes_kv = [side.registry_name for side in (self.first, self.second)
                      if type(side).content_kv is not RecomputeStrategy.content_kv]  # fmt: skip
        if changes_kv:
            raise ValueError(f"recompute strategy 'compose': {changes_kv} change the assembled K/V (content_kv); only "
                             "strategies that select tokens compose")  # fmt: skip
        self.check_layers = tuple(self.second.check_layers)
        self.ratio, self.threshold = (None, 1.0) if self.total is None else (self.total, None)
        # instance attributes: what the engine runs for this pair (the probe, the reference prefill)
        self.needs_reader_attention = self.first.needs_reader_attention or self.second.needs_reader_attention
        self.needs_reference = self.first.needs_reference or self.second.needs_reference
        self.full_prefill_cost = self.first.full_prefill_cost or self.second.full_prefill_cost

    def check_model(self, num_layers: int) -> None:
        self.first.check_model(num_layers)
        self.second.check_model(num_layers)

    def reader_layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(sorted(set(self.first.reader_layers(num_layers)) | set(self.second.reader_layers(num_layers))))

    def side_view(self, side: RecomputeStrategy, view: LayerView) -> LayerView:
        """``view`` with its reader attention narrowed to the layers ``side`` probes."""
        attention = view.reader_attention
        if attention is None or not side.needs_reader_attention:
            return view
        layers = self.reader_layers(view.num_layers)
        rows = [layers.index(layer) for layer in side.reader_layers(view.num_layers)]
        return dataclasses.replace(view, reader_attention=attention[rows])

    def score(self, view: LayerView) -> torch.Tensor:
        """Tier (2: the first's selection, 1: the second's own with ``ratio: null``, 0: the rest) plus the rank of
        the tier's own score (the first's in tier 2, the second's below) scaled into [0, 1)."""
        candidates = view.candidates.cpu()
        everything = LayerView.before_forward(view.plan, view.num_layers)
        forced = torch.isin(candidates, self.first.keep(self.side_view(self.first, everything)).cpu())
        first_scores = torch.as_tensor(self.first.score(self.side_view(self.first, view))).float().cpu()
        second_view = self.side_view(self.second, view)
        second_scores = torch.as_tensor(self.second.score(second_view)).float().cpu()
        tier = 2.0 * forced.float()
        if self.total is None:
            own = torch.isin(candidates, self.second.keep(second_view).cpu())
            tier = torch.maximum(tier, own.float())
        within = ranks(torch.where(forced, first_scores, second_scores)).float() / (candidates.numel() + 1)
        return tier + within  # ratio null: the threshold 1.0 keeps tiers 1 and 2

    def fingerprint(self) -> str:
        return f"compose:{self.first.fingerprint()}+{self.second.fingerprint()}:{self.total}"
