"""Verification: the target runs every drafted token in one forward over the request's cache, keeps the longest
acceptable prefix and rolls its cache back past the first rejected token.

One verification, with ``c`` the last token (not yet in the target's cache, which holds ``L`` rows) and drafts
``d1..dk``: the target runs ``[c, d1..dk]`` as one forward over its cache (the request's block table, so a
request served from reused chunks verifies over them), which writes rows ``L..L+k`` and gives logits ``z0..zk``,
``zi`` predicting the token after ``di`` (``z0`` after ``c``).

- greedy: accept ``di`` while ``di == argmax(z(i-1))``; after ``a`` accepted tokens the next token is
  ``argmax(za)`` (the correction, or with all accepted the bonus token). The tokens equal plain decoding's,
  up to the arithmetic of a k+1-token forward vs k+1 one-token forwards (fp32: ~1e-6 in the logits);
- sampling: rejection sampling (Leviathan et al. 2023, Chen et al. 2023): accept ``di`` with probability
  ``min(1, p(di) / q(di))`` (``p`` the target's distribution, ``q`` the draft's; one-hot for deterministic
  drafts); at the first rejection sample the next token from ``normalize(max(0, p - q))``; with all accepted,
  a bonus token from ``p`` at ``zk``. Each emitted token is distributed exactly as the target's sample.

Then the cache is cut to the accepted context (``table.truncate(L + 1 + a)``: blocks past it go back to the pool),
so what the engine stores after decoding holds exactly the accepted tokens' K/V. The engine core does this per step
for each decoding request with a draft (``kvboost.engine.core``: the draft's rows are that request's rows of the
step's one forward, beside the other requests'); with nothing drafted the row is a plain one-token decode row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kvboost.decoding import Sampling
from kvboost.speculative.base import Draft, draft_distribution


def accept_or_resample(
    p: torch.Tensor, q: torch.Tensor | None, token: int, generator: torch.Generator | None = None
) -> tuple[bool, int]:
    """One rejection-sampling decision for a drafted ``token`` drawn from ``q`` (``None``: one-hot on it).

    Returns ``(True, token)`` with probability ``min(1, p[token] / q[token])``, else ``(False, t)`` with ``t``
    drawn from ``normalize(max(0, p - q))``. Over the draws of ``token ~ q`` and of this function, the returned
    token is distributed as ``p``.
    """
    p_tok = float(p[token])
    q_tok = 1.0 if q is None else float(q[token])
    u = float(torch.rand((), generator=generator, device=p.device))
    if q_tok > 0 and u < min(1.0, p_tok / q_tok):
        return True, token
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = torch.clamp(p - q, min=0.0)
    total = float(residual.sum())
    if not total > 0:  # p <= q everywhere means p == q up to rounding: a rejection is then a draw from p
        residual, total = p, float(p.sum())
    return False, int(torch.multinomial(residual / total, 1, generator=generator).item())


def verify_draft(
    target_logits: torch.Tensor,
    draft: Draft,
    sampling: Sampling,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """``(accepted, next_token)`` for ``draft`` given the target's logits ``[len(draft) + 1, vocab]`` over
    ``[c, d1..dk]``: how many drafted tokens are kept and the token that follows them."""
    k = len(draft)
    if not sampling.do_sample:
        predicted = torch.argmax(target_logits, dim=-1).tolist()
        accepted = 0
        while accepted < k and draft.tokens[accepted] == predicted[accepted]:
            accepted += 1
        return accepted, int(predicted[accepted])
    p = draft_distribution(target_logits, sampling)
    for i, token in enumerate(draft.tokens):
        ok, chosen = accept_or_resample(p[i], None if draft.probs is None else draft.probs[i], token, generator)
        if not ok:
            return i, chosen
    return k, int(torch.multinomial(p[k], 1, generator=generator).item())


@dataclass
class SpeculativeStats:
    """Per request: tokens drafted and accepted, and target forwards after the first token (every forward counts,
    plain one-token steps included). ``tokens_per_target_forward``: generated tokens after the first per forward
    (1.0 without speculation)."""

    drafted_tokens: int = 0
    accepted_tokens: int = 0
    target_forwards: int = 0
    generated_after_first: int = 0
    draft_lengths: list[int] = field(default_factory=list)

    def as_extra(self, name: str) -> dict[str, Any]:
        return {
            "speculative": name,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0,
            "target_forwards": self.target_forwards,
            "tokens_per_target_forward": (
                self.generated_after_first / self.target_forwards if self.target_forwards else 0.0
            ),
        }


# ---------------------------------------------------------------------------------------------- per request
# What the engine core does for a decoding request with a draft strategy (``kvboost.engine.core``): each step, a
# proposal; the request's row of the step's forward is ``[last, d1..dk]``; then the verification below.


def begin(request: Any, strategy: Any, runner: Any) -> None:
    """A per-request copy of the engine's draft strategy (its own state; models and runners shared), started."""
    import copy

    from kvboost.speculative.base import DraftRequest

    request.draft = copy.copy(strategy)
    request.draft_length = strategy.new_length()
    request.spec_stats = SpeculativeStats()
    request.draft.begin(DraftRequest(prompt_len=request.prompt_len, runner=runner, owner=request))


def propose(request: Any, max_positions: int | None) -> Draft:
    """This step's draft: at most the adaptive length, and what still fits ``max_new_tokens`` and the context once
    every drafted token and the bonus one are accepted."""
    out = len(request.tokens)
    room = min(request.max_new_tokens, (max_positions or 1 << 62) - request.prompt_len)
    k = min(request.draft_length.current, room - out - 1)
    if k <= 0 or request.sampling.processed:  # penalties / logit_bias / min_tokens: verification ignores them
        return Draft()
    draft = request.draft.propose(request.ids + request.tokens, k, request.sampling, request.generator)
    if len(draft) > k:
        raise ValueError(f"speculative {request.draft.registry_name!r} proposed {len(draft)} tokens, asked for {k}")
    return draft


def verify(request: Any, logits: torch.Tensor, eos_ids: set[int]) -> list[int]:
    """The tokens this step adds: the longest acceptable prefix of the request's draft and the one after it (cut
    at an end-of-sequence token); the table is cut back past the rows of rejected tokens."""
    from kvboost.decoding import cut_at_stop, pick_token

    draft, stats = request.proposal, request.spec_stats
    request.proposal = None
    stats.target_forwards += 1
    if not draft.tokens:
        tokens = [pick_token(logits[0], request.sampling, request.generator)]
    else:
        accepted, nxt = verify_draft(logits, draft, request.sampling, request.generator)
        stats.drafted_tokens += len(draft)
        stats.accepted_tokens += accepted
        stats.draft_lengths.append(len(draft))
        request.draft_length.update(len(draft), accepted)
        tokens = draft.tokens[:accepted] + [nxt]
    tokens = cut_at_stop(tokens, eos_ids)
    request.table.truncate(request.prompt_len + len(request.tokens) + len(tokens) - 1)
    return tokens


def end(request: Any) -> None:
    """The request is done with its draft: the strategy's state goes, its stats go to the result's extra."""
    request.draft.end()
    request.spec_stats.generated_after_first = len(request.tokens) - 1
    request.extra.update(request.spec_stats.as_extra(request.draft.registry_name))
    request.draft = None
