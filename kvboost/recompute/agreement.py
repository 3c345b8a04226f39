"""How well a recompute strategy's selection agrees with the true-deviation reference's (DESIGN.md "Strategies as
scores").

The reference (the ``true_deviation`` strategy's ranking; called "the oracle" in the field names, which predate
issue 59: it is a reference for deviation proxies, not an upper bound on answer quality) ranks content-hit tokens by
their true K/V deviation from a full prefill (summed over layers, ``plan.reference_deviation``). A selector is
judged against it at its own budget:

- ``oracle_recall``: ``|S & S_oracle| / |S_oracle|``, where ``S`` is what the strategy recomputed in the last layer
  and ``S_oracle`` the oracle's top ``|S|`` (so recall equals precision; 1.0 when the strategy recomputes every
  content token);
- ``oracle_rank_corr``: Spearman's rank correlation of the strategy's token scores (``token_scores``) with the
  oracle's deviations over every content token (None for a strategy without scores, e.g. ``none`` / ``full``).

The engine records both per request (``GenerationResult.extra``, hence ``records.jsonl``) when the oracle's scores
exist anyway (``recompute=true_deviation``) or when the strategy's ``oracle_agreement`` is set (the engine then runs a
full prefill in scratch blocks after the strategy's prefill; its time, ``oracle_agreement_ms``, is kept out of
TTFT).
"""

from __future__ import annotations

import torch


def oracle_selection(content: torch.Tensor, reference_deviation: torch.Tensor, k: int) -> torch.Tensor:
    """The oracle's top ``k`` content positions by ``reference_deviation``, sorted."""
    k = max(0, min(int(k), content.numel()))
    if k == 0:
        return content[:0]
    return torch.sort(content[torch.topk(reference_deviation.float(), k).indices]).values


def recall_at_budget(selected: torch.Tensor, oracle_selected: torch.Tensor) -> float | None:
    """``|selected & oracle_selected| / |oracle_selected|`` (None when the oracle selects nothing)."""
    if oracle_selected.numel() == 0:
        return None
    return float(torch.isin(oracle_selected, selected).sum()) / oracle_selected.numel()


def ranks(x: torch.Tensor) -> torch.Tensor:
    """Average ranks (1-based; ties share the mean of their ranks), float64."""
    x = x.double().flatten()
    order = torch.argsort(x, stable=True)
    sorted_x = x[order]
    n = x.numel()
    out = torch.empty(n, dtype=torch.float64)
    # boundaries of runs of equal values in sorted order
    new_run = torch.ones(n, dtype=torch.bool)
    new_run[1:] = sorted_x[1:] != sorted_x[:-1]
    run_id = torch.cumsum(new_run.long(), 0) - 1
    starts = torch.nonzero(new_run, as_tuple=False).flatten()
    ends = torch.cat([starts[1:], torch.tensor([n])])
    mean_rank = (starts + ends - 1).double() / 2 + 1  # mean of the 1-based ranks start+1 .. end
    out[order] = mean_rank[run_id]
    return out


def spearman(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """Spearman's rank correlation (Pearson's of the average ranks); None with fewer than 2 values or a constant
    input. ``-inf`` scores (tokens a strategy dropped before ranking) rank lowest, tied."""
    if a.numel() != b.numel():
        raise ValueError(f"spearman: {a.numel()} scores against {b.numel()}")
    if a.numel() < 2:
        return None
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denom = float(ra.norm() * rb.norm())
    if denom == 0.0:
        return None
    return float((ra * rb).sum()) / denom


def selector_agreement(content: torch.Tensor, selected: torch.Tensor, reference_deviation: torch.Tensor,
                       scores: torch.Tensor | None) -> dict[str, float | None]:  # fmt: skip
    """``oracle_recall`` and ``oracle_rank_corr`` of one request (see the module docstring). ``content``: the
    prompt's content positions; ``selected``: those the strategy recomputed in the last layer; ``scores``: the
    strategy's score per content position (None: no rank correlation)."""
    oracle = oracle_selection(content, reference_deviation, selected.numel())
    return {
        "oracle_recall": recall_at_budget(selected, oracle),
        "oracle_rank_corr": None if scores is None else spearman(scores, reference_deviation),
    }
