"""Draft strategy interface: propose up to k next tokens cheaply; the target verifies them in one forward.

A strategy (``DRAFT`` registry, config group ``speculative=``) sees the request's tokens so far (prompt ids +
generated, the last one not yet run through the target) and returns a :class:`Draft`: up to ``k`` token ids and,
for strategies that sample from a distribution of their own, that distribution ``q`` per drafted token (needed by
rejection sampling). Deterministic strategies (``prompt_lookup``, and every strategy under greedy decoding) leave
``q`` as ``None``: a one-hot distribution on the drafted token.

The engine core (``kvboost.engine.core``, with ``kvboost.speculative.verify``) owns everything else: the target's
cache, the verification rows (in the step's one forward), the rollback past the first rejected token, the stats, and
the draft length, which adapts per request (:class:`DraftLength`). Each request gets its own shallow copy of the
strategy (``copy.copy``: per-request state such as a draft model's block table is its own; the draft model and its
runner are shared), so requests decoding together do not disturb each other's drafts. A strategy keeps whatever state of its own it needs (a draft model's KV
cache) in sync by comparing the context it is given with the one it saw last: a rejected suffix simply does not
come back in the next call's ``context``.

Contract (the conformance tests run every registered strategy):
- ``propose(context, k, ...)`` returns at most ``k`` tokens, each a valid id of the target's vocabulary; it never
  changes ``context``; greedy output with the strategy equals plain decoding whatever it proposes;
- ``bind`` raises ``ValueError`` for a target it cannot draft for (another vocabulary, too few layers);
- ``enabled`` is False only for ``none`` (the engine then runs its plain decode loop unchanged).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from kvboost.decoding import Sampling


@dataclass
class Draft:
    """Proposed tokens and, for sampled drafts, their draft distributions ``q`` ``[len(tokens), vocab]`` (fp32,
    rows sum to 1; ``None``: one-hot on each token)."""

    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.tokens)


class DraftRequest:
    """What a strategy may use during one request (given to :meth:`DraftStrategy.begin`).

    ``table`` is the target's :class:`~kvboost.kv.block_table.BlockTable`: rows ``[0, len(context) - 1)`` hold the
    target's K/V of the context (every token but the last); a strategy that writes rows past them (``layer_skip``)
    must leave ``table.length`` where it found it (the verification overwrites those rows). ``runner`` is the
    engine's model runner (``runner.run(ForwardBatch)``).

    Built by the engine with ``owner`` (its request), ``table`` is always the request's table *now*: a preempted
    request gets a new one when it resumes, and a strategy that kept the table of ``begin`` would read (and write)
    the released one.
    """

    __slots__ = ("_table", "owner", "prompt_len", "runner")

    def __init__(self, prompt_len: int, table: Any = None, runner: Any = None, *, owner: Any = None) -> None:
        if table is None and owner is None:
            raise ValueError("DraftRequest needs a table or an owner request holding one")
        self.prompt_len, self._table, self.runner, self.owner = prompt_len, table, runner, owner

    @property
    def table(self) -> Any:
        return self.owner.table if self.owner is not None else self._table

    def __repr__(self) -> str:
        return f"DraftRequest(prompt_len={self.prompt_len}, table={self.table!r})"


class DraftLength:
    """The adaptive draft length of one request.

    Rule (HF assisted generation's "heuristic" schedule): start at ``initial``; after a verification that accepted
    every drafted token, draft 2 more next time (up to ``maximum``); after one that rejected a token, draft 1 fewer
    (down to ``minimum``). Acceptance is bursty (a quoted passage, then free text), so the length follows it
    quickly upwards and backs off slowly. ``adaptive=False`` keeps ``initial``.
    """

    def __init__(self, initial: int, maximum: int, minimum: int = 1, adaptive: bool = True) -> None:
        self.initial, self.maximum, self.minimum, self.adaptive = initial, maximum, minimum, adaptive
        self.current = initial

    def reset(self) -> None:
        self.current = self.initial

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or drafted == 0:
            return
        if accepted == drafted:
            self.current = min(self.maximum, self.current + 2)
        else:
            self.current = max(self.minimum, self.current - 1)


def check_positive_int(strategy: str, name: str, value: Any, *, minimum: int = 1) -> int:
    """``value`` if it is an integer >= ``minimum``, else a ValueError naming the strategy and the field."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"speculative {strategy!r}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


class DraftStrategy(ABC):
    """Proposes tokens for the target to verify (see the module docstring for the contract).

    Args:
        num_draft: tokens drafted per verification at the start of a request (>= 1).
        max_draft: upper bound of the adaptive draft length (>= num_draft).
        adaptive: adapt the draft length to acceptance (:class:`DraftLength`); False keeps ``num_draft``.
    """

    registry_name: str = "?"
    #: False only for ``none``: the engine then keeps its plain decode loop.
    enabled: ClassVar[bool] = True

    def __init__(self, num_draft: int = 4, max_draft: int = 16, adaptive: bool = True) -> None:
        name = type(self).registry_name
        check_positive_int(name, "num_draft", num_draft)
        check_positive_int(name, "max_draft", max_draft)
        if max_draft < num_draft:
            raise ValueError(f"speculative {name!r}: max_draft ({max_draft}) must be >= num_draft ({num_draft})")
        if not isinstance(adaptive, bool):  # a config value: ValueError like every other bad field
            raise ValueError(f"speculative {name!r}: adaptive must be true or false, got {adaptive!r}")  # noqa: TRY004
        self.num_draft, self.max_draft, self.adaptive = num_draft, max_draft, adaptive

    def new_length(self) -> DraftLength:
        """A fresh adaptive draft length for one request."""
        return DraftLength(self.num_draft, self.max_draft, adaptive=self.adaptive)

    def bind(self, model: Any, tokenizer: Any) -> None:
        """Called once by the engine's constructor with the target model: load what the strategy needs and raise
        ValueError if it cannot draft for this target."""

    def begin(self, request: DraftRequest) -> None:
        """Called before the first proposal of a request."""

    def end(self) -> None:
        """Called after the last proposal of a request (drop per-request state)."""

    @abstractmethod
    def propose(
        self, context: Sequence[int], k: int, sampling: Sampling, generator: torch.Generator | None = None
    ) -> Draft:
        """Up to ``k`` (>= 1) tokens to follow ``context`` (prompt ids + generated so far)."""

    def fingerprint(self) -> str:
        """Names the strategy and its settings (results and logs)."""
        return f"{self.registry_name}:{self.num_draft}:{self.max_draft}:{int(self.adaptive)}"


def draft_distribution(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution the engine samples from for ``logits`` ``[..., vocab]`` (as ``pick_token`` does):
    softmax of the temperature-scaled scores, top-k applied when set. fp32."""
    scores = logits.float() / sampling.temperature
    if sampling.top_k > 0:
        kth = torch.topk(scores, sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    return torch.softmax(scores, dim=-1)


def choose_draft_token(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """A draft token from draft ``logits`` [vocab]: argmax when greedy (q one-hot: ``None``), else a sample from
    the draft's distribution, returned with it."""
    if not sampling.do_sample:
        return int(torch.argmax(logits).item()), None
    q = draft_distribution(logits, sampling)
    return int(torch.multinomial(q, 1, generator=generator).item()), q
