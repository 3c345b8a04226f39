"""Recompute strategy interface: repair what the cache serves before the suffix prefill."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from kvboost.types import ChunkRef


class ReusePlan:
    """What the lookup assembled for one prompt.

    ``segments`` hold the stacked KV ``[layers, kv_heads, tokens, head_dim]`` of the first
    ``reused_tokens`` prompt tokens, chunk by chunk, all exact hits (computed with this very
    history). ``keys``/``values`` concatenate them on demand; assigning them replaces the segments.
    The suffix ``prompt_ids[reused_tokens:]`` is prefilled after the strategy has run.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        chunks: list[ChunkRef],
        reused_tokens: int,
        segments: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        *,
        exact_hit_tokens: int = 0,
        content_hit_tokens: int = 0,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.prompt_ids = prompt_ids
        self.chunks = chunks
        self.reused_tokens = reused_tokens
        self.segments = list(segments or [])
        self.exact_hit_tokens = exact_hit_tokens
        self.content_hit_tokens = content_hit_tokens
        self.extra = extra or {}
        held = sum(k.shape[2] for k, _ in self.segments)
        if held != reused_tokens:
            raise ValueError(f"reuse plan holds KV for {held} tokens but claims {reused_tokens}")

    @property
    def keys(self) -> torch.Tensor | None:
        return _cat([k for k, _ in self.segments])

    @keys.setter
    def keys(self, value: torch.Tensor) -> None:
        self.segments = [(value, self.values)] if self.segments else []

    @property
    def values(self) -> torch.Tensor | None:
        return _cat([v for _, v in self.segments])

    @values.setter
    def values(self, value: torch.Tensor) -> None:
        self.segments = [(self.keys, value)] if self.segments else []

    def cold(self) -> ReusePlan:
        """The same prompt with nothing reused."""
        return ReusePlan(self.prompt_ids, self.chunks, 0, [], extra=dict(self.extra))


def _cat(parts: list[torch.Tensor]) -> torch.Tensor | None:
    if not parts:
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


@dataclass
class RepairOutcome:
    """The plan to prefill from, and what the strategy measured it recomputed."""

    plan: ReusePlan
    recomputed_token_layers: int  # (token, layer) pairs computed again although the cache had them


class RecomputeStrategy(ABC):
    """Decides which cached KV to refresh before it is used.

    Contract (conformance tests run every registered strategy):
    - the returned plan's ``reused_tokens`` is <= the input's, and its KV has exactly that many tokens;
    - ``recomputed_token_layers`` counts what was really recomputed (measured, not assumed);
    - exact hits need no repair: a strategy must keep generation equal to a cold prefill on a plan
      made only of exact hits (``verify_correctness`` checks it).
    """

    registry_name: str = "?"

    @abstractmethod
    def repair(self, plan: ReusePlan, adapter: Any) -> RepairOutcome:
        """Return the plan to prefill from."""

    def fingerprint(self) -> str:
        return self.registry_name
