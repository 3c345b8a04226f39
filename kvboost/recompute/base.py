"""Recompute strategy interface: which (token, layer) pairs to compute for a prompt with content hits.

Exact hits (KV computed with this very history) never need repair. Content hits (the same tokens stored at
another position or after another history) are re-rotated to their new positions by the engine, but their K/V
still lacks attention to the new context: a strategy decides which of them to recompute, layer by layer.
New tokens (nothing cached, including the suffix) are always computed. See ``kvboost.plan`` for the plan and
the schedule, and DESIGN.md "Layer-wise execution".

Strategies as scores (DESIGN.md "Strategies as scores"; the shape NVIDIA's kvpress gave KV compression, where a
"press" is one scoring function): a :class:`ScoredStrategy` only *scores* content-hit tokens (``score``: from
their position in the chunk, the question's attention, the K/V deviation at a check layer, or the oracle's true
deviation); the base keeps the top of the budget (``fraction`` / ``choose``), builds the schedule and answers the
check layers. A wrapper (:class:`kvboost.recompute.compose.Compose`) composes two scored strategies (EPIC's first
tokens of each chunk plus query-aware). Every built-in strategy but ``ape`` is a scored one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from kvboost.plan import KIND_CODES, ComputeSchedule, ReusePlan


class RecomputeStrategy(ABC):
    """Decides which cached (content-hit) tokens to recompute, and in which layers.

    Contract (the conformance tests run every registered strategy):
    - ``schedule`` returns a :class:`ComputeSchedule` whose ``initial`` positions include every new position and
      no exact one (the engine validates it and raises ``ScheduleError`` otherwise);
    - ``select`` (called only after the layers in ``check_layers``) returns a sorted subset of the candidate
      positions it was given;
    - on a plan made only of exact hits and new tokens the output equals a cold prefill (nothing to repair);
    - what was recomputed is measured by the engine from the schedule it ran (``recompute_ratio``), not
      reported by the strategy.

    Set ``needs_reference = True`` (research only) to receive ``plan.reference_deviation`` from a full prefill
    before ``schedule`` is called; such a strategy's cost is reported as a full prefill.

    Set ``needs_reader_attention = True`` to receive ``plan.reader_attention`` (what the prompt's closing
    tokens attend to, at the layers ``reader_layers`` names) from a probe pass the engine runs first: only the
    new tokens computed, every content hit reused as re-rotated; its time is inside TTFT.

    Set ``oracle_agreement = True`` (an instance attribute; the built-in strategies take it as a config field,
    ``recompute.oracle_agreement=true``) to have the engine judge the selection against the oracle's per request:
    ``oracle_recall`` and ``oracle_rank_corr`` (:mod:`kvboost.recompute.agreement`) in the result's ``extra``.
    It costs a full prefill after the strategy's (kept out of TTFT, reported as ``oracle_agreement_ms``); with
    ``needs_reference`` the oracle's scores exist anyway and the agreement is always recorded.
    """

    registry_name: str = "?"
    needs_reference: ClassVar[bool] = False
    needs_reader_attention: ClassVar[bool] = False
    oracle_agreement: bool = False

    def check_model(self, num_layers: int) -> None:
        """Raise ValueError if this strategy cannot run on a model with ``num_layers`` decoder layers (called by
        the engine's constructor, so a misfit fails before any request)."""

    def reader_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers whose reader attention ``plan.reader_attention`` must hold (``needs_reader_attention``)."""
        return ()

    @abstractmethod
    def schedule(self, plan: ReusePlan, num_layers: int) -> ComputeSchedule:
        """The positions to compute from layer 0 on, and the layers after which to narrow them."""

    def select(
        self, plan: ReusePlan, layer: int, candidates: torch.Tensor, deviation: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """Of ``candidates`` (sorted content positions computed at ``layer``), those to keep computing.

        ``deviation["key"][i]`` / ``deviation["value"][i]``: mean squared difference between the fresh and the
        cached (re-rotated) key / value rows of ``candidates[i]`` at ``layer``. Only called for strategies
        that declare ``check_layers``.
        """
        raise NotImplementedError(f"recompute strategy {self.registry_name!r} declared check layers but no select()")

    def token_scores(self, plan: ReusePlan, check: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None
                     ) -> torch.Tensor | None:  # fmt: skip
        """The score this strategy ranked the content positions by (one per ``plan.positions("content")``, higher:
        recomputed first), to compare with the oracle's (``oracle_rank_corr``); None when it has none.
        ``check``: ``(candidates, deviation)`` as ``select`` saw them at the last check layer (positions dropped
        at an earlier check layer score ``-inf``)."""
        return None

    def fingerprint(self) -> str:
        return self.registry_name


class ScoredStrategy(RecomputeStrategy):
    """A strategy that scores content-hit tokens; the base keeps the top of the budget.

    Subclasses implement :meth:`score` (one score per candidate position; higher: recomputed first) and may
    override :meth:`fraction` (the budget as a fraction of the candidates; default ``ratio``) or :meth:`choose`
    (how the budget is applied to the scores; default the top ``round(fraction * len)`` by score, ties as
    ``torch.topk`` breaks them).

    - ``check_layers`` empty (the default): scores come from the plan alone (position, ``plan.reader_attention``,
      ``plan.reference_deviation``); the schedule computes the chosen content tokens plus every new token at every
      layer. ``score`` is called with ``candidates`` = every content position and ``deviation`` None.
    - ``check_layers`` set (CacheBlend): every non-exact token is computed through the check layers; at each,
      ``score`` gets the candidates computed there and their K/V deviation, and the base keeps its choice.
    - ``full_prefill_cost``: the scores came from a full prefill (the oracle); its cost is reported as one.
    """

    ratio: float = 0.0
    check_layers: tuple[int, ...] = ()
    full_prefill_cost: ClassVar[bool] = False

    @abstractmethod
    def score(self, plan: ReusePlan, candidates: torch.Tensor, deviation: dict[str, torch.Tensor] | None = None
              ) -> torch.Tensor:  # fmt: skip
        """One score per position of ``candidates`` (sorted content positions); higher: recomputed first."""

    def fraction(self, plan: ReusePlan, candidates: torch.Tensor, layer: int | None = None) -> float:
        """The budget, as the fraction of ``candidates`` to keep (``layer``: the check layer, None at schedule)."""
        return self.ratio

    def choose(self, plan: ReusePlan, candidates: torch.Tensor, scores: torch.Tensor, layer: int | None = None
               ) -> torch.Tensor:  # fmt: skip
        """The candidates kept: the top of the budget by ``scores``, sorted by position."""
        return top_fraction(candidates, scores, self.fraction(plan, candidates, layer))

    def chosen_content(self, plan: ReusePlan) -> torch.Tensor:
        """The content positions chosen at schedule time (no check layers)."""
        content = plan.positions("content")
        if not content.numel():
            return content
        return self.choose(plan, content, self.score(plan, content))

    def schedule(self, plan: ReusePlan, num_layers: int) -> ComputeSchedule:
        if self.check_layers:
            if plan.content_tokens:
                self.check_model(num_layers)
            return ComputeSchedule(
                torch.nonzero(plan.kinds != KIND_CODES["exact"], as_tuple=False).flatten(),
                check_layers=self.check_layers if plan.content_tokens else (),
                full_prefill_cost=self.full_prefill_cost,
            )
        keep = plan.kinds == KIND_CODES["new"]
        keep[self.chosen_content(plan)] = True
        return ComputeSchedule(torch.nonzero(keep, as_tuple=False).flatten(), full_prefill_cost=self.full_prefill_cost)

    def select(
        self, plan: ReusePlan, layer: int, candidates: torch.Tensor, deviation: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        return self.choose(plan, candidates, self.score(plan, candidates, deviation), layer)

    def token_scores(self, plan: ReusePlan, check: tuple[torch.Tensor, dict[str, torch.Tensor]] | None = None
                     ) -> torch.Tensor | None:  # fmt: skip
        content = plan.positions("content")
        if not self.check_layers:
            return self.score(plan, content)
        if check is None:
            return None
        candidates, deviation = check
        scores = torch.full((content.numel(),), float("-inf"))
        scores[torch.searchsorted(content, candidates.cpu())] = self.score(plan, candidates, deviation).float().cpu()
        return scores


def top_fraction(candidates: torch.Tensor, scores: torch.Tensor, fraction: float) -> torch.Tensor:
    """The ``round(fraction * len)`` candidates with the highest scores, sorted by position."""
    k = int(round(fraction * candidates.numel()))
    if k <= 0:
        return candidates[:0]
    if k >= candidates.numel():
        return candidates
    idx = torch.topk(scores.float(), k).indices
    return torch.sort(candidates[idx.to(candidates.device)]).values


def check_flag(owner: str, name: str, value: object) -> bool:
    if value is not True and value is not False:
        raise ValueError(f"recompute strategy {owner!r}: {name} must be true or false, got {value!r}")
    return value


def check_fraction(owner: str, name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"recompute strategy {owner!r}: {name} must be a number in [0, 1], got {value!r}")
    return float(value)
