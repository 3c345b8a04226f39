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
so what the engine stores after decoding holds exactly the accepted tokens' K/V. With nothing drafted the step is a plain one-token step (the engine's fused step where it
has one).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvboost.decoding import DecodeOutput, Sampling, pick_token
from kvboost.speculative.base import Draft, DraftRequest, DraftStrategy, draft_distribution


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


def speculative_decode(
    strategy: DraftStrategy,
    *,
    prompt_ids: Sequence[int],
    first_token: int,
    table: Any,
    runner: Any,
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: Sampling,
    generator: torch.Generator | None = None,
    max_total_tokens: int | None = None,
) -> tuple[DecodeOutput, SpeculativeStats]:
    """Generate after ``first_token`` with ``strategy`` drafting and the target verifying; same stopping rules
    as :func:`kvboost.decoding.decode_loop` (EOS, ``max_new_tokens``, the context end).

    ``table`` (a :class:`~kvboost.kv.block_table.BlockTable`) holds the prompt's ``len(prompt_ids)`` rows; every
    target forward goes through ``runner.run``: a plain one-token step when nothing was drafted, else the
    ``k + 1`` rows ``[c, d1..dk]`` with their logits. ``decode_seconds`` covers drafting, verification and
    rollback. On return the table holds exactly the rows of ``prompt_ids + tokens[:-1]``, as after plain decoding.
    """
    from kvboost.runtime.batch import ForwardBatch, SeqInput

    n = len(prompt_ids)
    limit = max_new_tokens
    if max_total_tokens is not None:
        limit = min(limit, max_total_tokens - n)
    stats = SpeculativeStats()
    length = strategy.new_length()
    tokens = [first_token]
    context = list(prompt_ids) + tokens
    start = time.perf_counter()
    strategy.begin(DraftRequest(prompt_len=n, table=table, runner=runner))
    try:
        while len(tokens) < limit and tokens[-1] not in eos_ids:
            k = min(length.current, limit - len(tokens) - 1)  # all accepted + 1 bonus must fit the limit
            draft = strategy.propose(context, k, sampling, generator) if k > 0 else Draft()
            if len(draft) > k:
                raise ValueError(f"speculative {strategy.registry_name!r} proposed {len(draft)} tokens, asked for {k}")
            if table.length != n + len(tokens) - 1:
                raise RuntimeError(f"speculative {strategy.registry_name!r} left the target's cache at "
                                   f"{table.length} rows; it must hold {n + len(tokens) - 1}")  # fmt: skip
            stats.target_forwards += 1
            if not draft.tokens:
                logits = runner.run(ForwardBatch.build([SeqInput(table, [tokens[-1]])]))[0]
                new = [pick_token(logits, sampling, generator)]
            else:
                feed = [tokens[-1], *draft.tokens]
                batch = ForwardBatch.build([SeqInput(table, feed, logits=list(range(len(feed))))])
                logits = runner.run(batch)
                accepted, nxt = verify_draft(logits, draft, sampling, generator)
                stats.drafted_tokens += len(draft)
                stats.accepted_tokens += accepted
                stats.draft_lengths.append(len(draft))
                length.update(len(draft), accepted)
                new = draft.tokens[:accepted] + [nxt]
            for i, token in enumerate(new):  # plain decoding stops at the first EOS: so do we
                if token in eos_ids:
                    new = new[: i + 1]
                    break
            tokens.extend(new)
            context.extend(new)
            # Rollback: rows past the accepted context are rejected drafts' (or, after an EOS, unused) K/V.
            table.truncate(n + len(tokens) - 1)
    finally:
        strategy.end()
    stats.generated_after_first = len(tokens) - 1
    return DecodeOutput(tokens, time.perf_counter() - start), stats
