"""The recompute strategy contract: a strategy scores content-hit tokens from what the layer has; the base keeps
the top of the budget, builds the schedule and answers the check layers.

Exact hits (KV computed with this very history) never need repair. Content hits (the same tokens stored at
another position or after another history) are re-rotated to their new positions by the engine, but their K/V
still lacks attention to the new context: a strategy decides which of them to recompute, layer by layer.
New tokens (nothing cached, including the suffix) are always computed. See ``kvboost.plan`` for the plan and
the schedule, and DESIGN.md "Strategies as scores".

The shape is kvpress's (NVIDIA), where a "press" implements ``ScorerPress.score(module, hidden_states, keys, values,
attentions, kwargs)`` and the base prunes by the scores. Here a strategy implements one method,
:meth:`RecomputeStrategy.score`, called one way: with a :class:`LayerView` of the candidates (sorted content
positions) holding what the engine has at that point:

- a strategy without ``check_layers`` is scored once, before the forward (``view.layer`` None): the plan, the cached
  K/V as stored (``view.stored(layer)``), the question's attention from the reader probe (``needs_reader_attention``)
  and the full prefill's deviation (``needs_reference``);
- a strategy with ``check_layers`` computes every non-exact token through them and is scored after each: the
  candidates' fresh queries, keys, values and hidden states at that layer, the cached (re-rotated) rows the fresh
  ones replaced, and the same plan-level signals.

Budgets are the base's, for every strategy: ``ratio`` keeps the top ``round(ratio * content tokens)`` by score
(``check_ratios`` per check layer for gradual filtering); ``threshold`` keeps every candidate scoring at least it (a
position rule such as EPIC's first ``k`` tokens), and the fraction it used is measured by the engine
(``content_recompute_fraction``). A strategy never edits the plan: the one other stage it may take part in is the
content rows' assembly (:meth:`RecomputeStrategy.content_kv`, e.g. ``key_temperature``'s tempered keys, applied to a
copy).

Wrappers (:class:`kvboost.recompute.compose.Compose`) compose two strategies through the same contract.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from kvboost.plan import KIND_CODES, ComputeSchedule, Placement, ReusePlan

DEVIATION_PARTS = ("kv", "key", "value")


@dataclass
class LayerView:
    """What a strategy scores from: the candidates and what the engine has for them at this point.

    Attributes:
        plan: the prompt's reuse plan (read only).
        candidates: ``[C]`` sorted content positions to score.
        num_layers: the model's decoder layers.
        layer: the check layer just computed; None before the forward (a strategy without check layers).
        queries: ``[heads, C, head_dim]`` the candidates' queries at ``layer`` after RoPE (None before the forward).
        keys, values: ``[kv_heads, C, head_dim]`` their fresh K/V at ``layer`` (keys after RoPE).
        cached_keys, cached_values: the cached (re-rotated) rows the fresh ones replaced at ``layer``.
        hidden_states: ``[C, hidden]`` the candidates' output of ``layer`` (the next layer's input).
        reader_attention: ``[probed layers, heads, C]`` the question's attention over the candidates, from the probe
            pass (``needs_reader_attention``; the layers ``reader_layers`` names), else None.
        reference_deviation: ``[C]`` the cached K/V's squared error against a full prefill, summed over layers
            (``needs_reference``), else None.
    """

    plan: ReusePlan
    candidates: torch.Tensor
    num_layers: int
    layer: int | None = None
    queries: torch.Tensor | None = field(default=None, repr=False)
    keys: torch.Tensor | None = field(default=None, repr=False)
    values: torch.Tensor | None = field(default=None, repr=False)
    cached_keys: torch.Tensor | None = field(default=None, repr=False)
    cached_values: torch.Tensor | None = field(default=None, repr=False)
    hidden_states: torch.Tensor | None = field(default=None, repr=False)
    reader_attention: torch.Tensor | None = field(default=None, repr=False)
    reference_deviation: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def before_forward(cls, plan: ReusePlan, num_layers: int, candidates: torch.Tensor | None = None) -> LayerView:
        """The view of a strategy scored before the forward: ``candidates`` (default every content position) with
        the plan's reader attention and reference deviation, when the engine set them."""
        content = plan.positions("content")
        candidates = content if candidates is None else candidates
        index = torch.searchsorted(content, candidates.cpu())
        attention, reference = plan.reader_attention, plan.reference_deviation
        return cls(plan, candidates, num_layers,
                   reader_attention=None if attention is None else attention[:, :, index],
                   reference_deviation=None if reference is None else reference[index])  # fmt: skip

    def deviation(self, part: str = "kv") -> torch.Tensor:
        """``[C]`` mean squared change of the candidates' keys (``key``), values (``value``) or the sum of both
        (``kv``) over heads and channels: fresh against cached, at the check layer."""
        if part not in DEVIATION_PARTS:
            raise ValueError(f"deviation part must be one of {DEVIATION_PARTS}, got {part!r}")
        if self.keys is None or self.cached_keys is None or self.values is None or self.cached_values is None:
            raise ValueError("the K/V deviation exists only at a check layer (declare check_layers)")
        out = torch.zeros(self.candidates.numel())
        if part in ("kv", "key"):
            out = out + (self.keys.float() - self.cached_keys.float()).pow(2).mean(dim=(0, 2)).cpu()
        if part in ("kv", "value"):
            out = out + (self.values.float() - self.cached_values.float()).pow(2).mean(dim=(0, 2)).cpu()
        return out

    def stored(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``([kv_heads, C, head_dim], same)``: the candidates' cached keys and values at ``layer`` as stored (keys at
        their stored positions, before re-rotation: their norms are the re-rotated ones')."""
        keys, values = [], []
        candidates = self.candidates.cpu()
        for p in self.plan.placements:
            if p.kind != "content":
                continue
            inside = candidates[(candidates >= p.start) & (candidates < p.end)] - p.start
            if inside.numel():
                keys.append(p.keys[layer][:, inside.to(p.keys.device)])
                values.append(p.values[layer][:, inside.to(p.values.device)])
        if not keys:
            raise ValueError("no content placement holds the candidates")
        return torch.cat(keys, dim=1), torch.cat(values, dim=1)


class RecomputeStrategy(ABC):
    """Scores content-hit tokens; the base keeps the top of the budget (see the module docstring).

    Implement :meth:`score`. Set the budget: ``ratio`` (a fraction of the prompt's content tokens; ``check_ratios``
    optionally per check layer) or ``threshold`` (keep every candidate scoring at least it; ``ratio`` None).
    Optional: ``check_layers`` (score after those layers; every non-exact token is computed through them),
    ``needs_reader_attention`` with :meth:`reader_layers`, ``needs_reference`` (research only: a full prefill
    first, its cost reported as one: ``full_prefill_cost``), :meth:`check_model`, :meth:`content_kv`,
    :meth:`fingerprint`.

    What the engine calls (not overridden by a strategy): :meth:`schedule` once per prompt with content hits and
    :meth:`select` after each check layer. The engine validates both (``ScheduleError``), measures what was
    recomputed from what the layers ran (``recompute_ratio``, ``content_recompute_fraction``), and with
    ``oracle_agreement`` (an instance attribute, a config field of the built-ins) judges the selection against the
    reference's (:mod:`kvboost.recompute.agreement`; costs a full prefill kept out of TTFT).
    """

    registry_name: str = "?"
    needs_reference: ClassVar[bool] = False
    needs_reader_attention: ClassVar[bool] = False
    full_prefill_cost: ClassVar[bool] = False
    oracle_agreement: bool = False
    #: the budget as a fraction of the prompt's content tokens (None: ``threshold`` instead)
    ratio: float | None = 0.0
    #: with ``ratio`` None: keep every candidate whose score is at least this
    threshold: float | None = None
    #: layers after which candidates are scored and narrowed
    check_layers: tuple[int, ...] = ()
    #: per check layer ratio (gradual filtering); default ``ratio`` at each
    check_ratios: Mapping[int, float] | None = None

    @abstractmethod
    def score(self, view: LayerView) -> torch.Tensor:
        """``[C]``: one score per ``view.candidates`` (higher: recomputed first; ``-inf``: never)."""

    # ----------------------------------------------------------------- optional
    def check_model(self, num_layers: int) -> None:
        """Raise ValueError if this strategy cannot run on a model with ``num_layers`` decoder layers (called by
        the engine's constructor, so a misfit fails before any request)."""
        if self.check_layers and self.check_layers[-1] >= num_layers - 1:
            raise ValueError(
                f"recompute strategy {self.registry_name!r}: check layer {self.check_layers[-1]} leaves no later layer "
                f"to save (the model has {num_layers} layers); set recompute.check_layers to layers below "
                f"{num_layers - 1}"
            )

    def reader_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers whose reader attention ``view.reader_attention`` must hold (``needs_reader_attention``)."""
        return ()

    def content_kv(self, plan: ReusePlan, placement: Placement) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V a content placement is assembled from (before re-rotation); default as cached. Return new
        tensors, never write the placement's."""
        return placement.keys, placement.values

    def fingerprint(self) -> str:
        return self.registry_name

    # ----------------------------------------------------------------- the base's
    def keep(self, view: LayerView) -> torch.Tensor:
        """The candidates within the budget, sorted: the top ``round(ratio * content)`` by score, or those scoring
        at least ``threshold``."""
        candidates = view.candidates
        if not candidates.numel():
            return candidates
        scores = torch.as_tensor(self.score(view)).flatten().float().cpu()
        if scores.numel() != candidates.numel():
            raise ValueError(f"recompute strategy {self.registry_name!r}: score returned {scores.numel()} values for "
                             f"{candidates.numel()} candidates")  # fmt: skip
        if self.ratio is None:
            if self.threshold is None:
                raise ValueError(f"recompute strategy {self.registry_name!r} sets neither ratio nor threshold")
            return candidates[(scores >= self.threshold).to(candidates.device)]
        ratio = self.ratio
        if view.layer is not None and self.check_ratios is not None:
            ratio = self.check_ratios[view.layer]
        return top_count(candidates, scores, int(round(ratio * view.plan.content_tokens)))

    def schedule(self, plan: ReusePlan, num_layers: int) -> ComputeSchedule:
        """The positions to compute from layer 0 on, and the layers after which to narrow them."""
        if self.check_layers:
            if plan.content_tokens:
                self.check_model(num_layers)
            return ComputeSchedule(torch.nonzero(plan.kinds != KIND_CODES["exact"], as_tuple=False).flatten(),
                                   check_layers=self.check_layers if plan.content_tokens else (),
                                   full_prefill_cost=self.full_prefill_cost)  # fmt: skip
        keep = plan.kinds == KIND_CODES["new"]
        if plan.content_tokens:
            keep[self.keep(LayerView.before_forward(plan, num_layers))] = True
        return ComputeSchedule(torch.nonzero(keep, as_tuple=False).flatten(), full_prefill_cost=self.full_prefill_cost)

    def select(self, view: LayerView) -> torch.Tensor:
        """After check layer ``view.layer``: the candidates to keep computing."""
        return self.keep(view)

    def token_scores(self, plan: ReusePlan, num_layers: int, check: LayerView | None = None) -> torch.Tensor | None:
        """The score the content positions were ranked by (one per ``plan.positions("content")``), to compare with
        the reference's (``oracle_rank_corr``); None when there is none. ``check``: the last check layer's view
        (positions dropped at an earlier check layer score ``-inf``)."""
        if not self.check_layers:
            return torch.as_tensor(self.score(LayerView.before_forward(plan, num_layers))).float().cpu()
        if check is None:
            return None
        content = plan.positions("content")
        scores = torch.full((content.numel(),), float("-inf"))
        scores[torch.searchsorted(content, check.candidates.cpu())] = torch.as_tensor(self.score(check)).float().cpu()
        return scores


def top_count(candidates: torch.Tensor, scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` candidates with the highest scores (ties as ``torch.topk`` breaks them), sorted by position."""
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


def check_count(owner: str, name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"recompute strategy {owner!r}: {name} must be a non-negative integer, got {value!r}")
    return value
