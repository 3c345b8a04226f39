"""A wrapper composing two scored strategies: the first's choice, then the second's top within the budget.

The shape of kvpress's composed presses: a strategy is a scoring function (``ScoredStrategy``), so two of them
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

import weakref
from typing import Any

import torch

from kvboost.plan import KIND_CODES, ComputeSchedule, ReusePlan
from kvboost.recompute.base import ScoredStrategy, check_flag, check_fraction
from kvboost.registry import RECOMPUTE


def _build(side: str, spec: Any) -> ScoredStrategy:
    strategy = RECOMPUTE.build(spec)
    if not isinstance(strategy, ScoredStrategy):
        raise ValueError(  # noqa: TRY004  (a bad config, as every other recompute setting)
            f"recompute strategy 'compose': {side} must be a scored strategy (ScoredStrategy), got "
            f"{type(strategy).__name__} ({getattr(strategy, 'registry_name', '?')!r})"
        )
    return strategy


@RECOMPUTE.register("compose")
class Compose(ScoredStrategy):
    """The union of two scored strategies' selections, within a budget.

    Args:
        first: the strategy whose selection is taken first (a name or a config with ``name``; no check layers).
        second: the strategy that fills the rest of the budget by its scores.
        ratio: the total budget as a fraction of content-hit tokens; null: the union at each side's own budget.
        oracle_agreement: also judge each selection against the oracle's (costs a full prefill, out of TTFT).
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
        self.check_layers = tuple(self.second.check_layers)
        # instance attributes: what the engine runs for this pair (the probe, the reference prefill)
        self.needs_reader_attention = self.first.needs_reader_attention or self.second.needs_reader_attention
        self.needs_reference = self.first.needs_reference or self.second.needs_reference
        self.full_prefill_cost = self.first.full_prefill_cost or self.second.full_prefill_cost
        self._num_layers = 0
        self._first_choice: weakref.WeakKeyDictionary[ReusePlan, torch.Tensor] = weakref.WeakKeyDictionary()

    @property
    def ratio(self) -> float:  # type: ignore[override]
        return self.total if self.total is not None else self.second.ratio

    def check_model(self, num_layers: int) -> None:
        self.first.check_model(num_layers)
        self.second.check_model(num_layers)

    def reader_layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(sorted(set(self.first.reader_layers(num_layers)) | set(self.second.reader_layers(num_layers))))

    def _as(self, side: ScoredStrategy, plan: ReusePlan, call: Any) -> Any:
        """``call()`` with ``plan.reader_attention`` narrowed to the layers ``side`` probes."""
        attention = plan.reader_attention
        if attention is None or not side.needs_reader_attention or not self._num_layers:
            return call()
        layers = self.reader_layers(self._num_layers)
        rows = [layers.index(layer) for layer in side.reader_layers(self._num_layers)]
        plan.reader_attention = attention[rows]
        try:
            return call()
        finally:
            plan.reader_attention = attention

    def _first(self, plan: ReusePlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The first's choice and its scores over every content position."""
        content = plan.positions("content")
        scores = self._as(self.first, plan, lambda: self.first.score(plan, content))
        return self.first.choose(plan, content, scores), scores

    def _fill(self, plan: ReusePlan, candidates: torch.Tensor, second_scores: torch.Tensor,
              layer: int | None) -> torch.Tensor:  # fmt: skip
        content = plan.positions("content")
        forced = self._first_choice.get(plan)
        if forced is None:
            forced, _ = self._first(plan)
        forced = forced[torch.isin(forced, candidates)]
        if self.total is None:
            own = self.second.choose(plan, candidates, second_scores, layer)
            return torch.unique(torch.cat([forced, own.to(forced.dtype)]))
        budget = round(self.total * content.numel())
        if forced.numel() >= budget:
            first_scores = self._as(self.first, plan, lambda: self.first.score(plan, forced))
            return torch.sort(forced[torch.topk(first_scores.float(), budget).indices]).values if budget else forced[:0]
        rest = ~torch.isin(candidates, forced)
        need = budget - forced.numel()
        pool, pool_scores = candidates[rest], second_scores[rest.to(second_scores.device)]
        if need < pool.numel():
            pool = pool[torch.topk(pool_scores.float(), need).indices.to(pool.device)]
        return torch.sort(torch.cat([forced, pool])).values

    def score(self, plan: ReusePlan, candidates: torch.Tensor, deviation: dict[str, torch.Tensor] | None = None
              ) -> torch.Tensor:  # fmt: skip
        """The second's scores (the order the rest of the budget is filled in)."""
        return self._as(self.second, plan, lambda: self.second.score(plan, candidates, deviation))

    def choose(self, plan: ReusePlan, candidates: torch.Tensor, scores: torch.Tensor, layer: int | None = None
               ) -> torch.Tensor:  # fmt: skip
        return self._fill(plan, candidates, scores, layer)

    def schedule(self, plan: ReusePlan, num_layers: int) -> ComputeSchedule:
        self._num_layers = num_layers
        if plan.content_tokens:
            self._first_choice[plan] = self._first(plan)[0]
        if self.check_layers:
            return super().schedule(plan, num_layers)
        keep = plan.kinds == KIND_CODES["new"]
        keep[self.chosen_content(plan)] = True
        return ComputeSchedule(torch.nonzero(keep, as_tuple=False).flatten(), full_prefill_cost=self.full_prefill_cost)

    def token_scores(self, plan: ReusePlan, check: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None
                     ) -> torch.Tensor | None:  # fmt: skip
        """The order of the composed choice: the first's selection above everything (by its scores), then the rest
        by the second's scores (ranks only matter, ``oracle_rank_corr``)."""
        second = self._as(self.second, plan, lambda: self.second.token_scores(plan, check))
        if second is None:
            return None
        content = plan.positions("content")
        forced = self._first_choice.get(plan)
        if forced is None:
            forced, _ = self._first(plan)
        first_scores = self._as(self.first, plan, lambda: self.first.score(plan, content)).float()
        in_first = torch.isin(content, forced)
        second = second.float()
        finite = second[torch.isfinite(second)]
        top = float(finite.max()) if finite.numel() else 0.0
        lifted = top + 1.0 + (first_scores - first_scores.min())  # every first pick above every other token
        return torch.where(in_first, lifted, second)

    def fingerprint(self) -> str:
        return f"compose:{self.first.fingerprint()}+{self.second.fingerprint()}:{self.total}"
