"""Passages stored after a shared head: how the passage workloads (``musique``, ``needle``) warm their chunks.

The CacheBlend protocol (and kvboost's ``warm_context: head`` for ``rag_reorder``) stores each passage as its own
chunk after the prompts' shared head, so the cached KV of a passage is the KV it has in a real prompt up to the
passages before it. ``warm_passages`` says when: ``per_query`` (a request's passages right before it, untimed),
``all`` (every distinct passage of the run before timing; the cache must hold them all) or ``none``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvboost.lab.workloads.base import Request

WARM_PASSAGES = ("per_query", "all", "none")


def check_passage_fields(warm_passages: object, separator: object) -> None:
    """The config fields every passage workload has: ``warm_passages`` one of :data:`WARM_PASSAGES`, ``separator`` a
    non-empty string."""
    if warm_passages not in WARM_PASSAGES:
        raise ValueError(f"workload.warm_passages must be one of {WARM_PASSAGES}, got {warm_passages!r}")
    if not isinstance(separator, str) or not separator:
        raise ValueError("workload.separator must be a non-empty string")


class PassagesAfterHead:
    """Mixin of a workload whose items have ``passages`` and an ``item_id`` equal to their request's id, one request
    per item; the workload defines ``item_prompt(item)`` (the prompt text) and ``head_ends_with`` (the text just
    before the first passage), and has ``cfg.warm_passages`` and ``cfg.separator`` (what joins the head and a
    passage in its prompts)."""

    cfg: Any
    items: list[Any]
    registry_name: str
    head_ends_with: str = ""

    def item_prompt(self, item: Any) -> str:  # pragma: no cover - the workload's own
        raise NotImplementedError

    def shared_head(self) -> str:
        """The prompt text before the first passage's separator, common to every request (checked)."""
        heads = {self.item_prompt(item).split(self.cfg.separator, 1)[0] for item in self.items[:3]}
        if len(heads) != 1:
            raise ValueError(f"{self.registry_name}: the prompts do not share one head before the passages")
        head = heads.pop()
        if not head.endswith(self.head_ends_with):
            raise ValueError(f"{self.registry_name}: the shared head {head!r} does not end with {self.head_ends_with!r}")
        return head

    def num_requests_upper_bound(self) -> int:
        return len(self.items)

    def smaller_overrides(self, fraction: float) -> dict[str, int]:
        """Fewer requests, for about ``fraction`` of them."""
        return {"num_queries": max(1, int(fraction * len(self.items)))}

    def _head_and_separator(self) -> str:
        head = getattr(self, "_passage_head", None)
        if head is None:
            head = self._passage_head = self.shared_head() + self.cfg.separator
        return head

    def passage_encodings(self, passages: Sequence[str]) -> list[str]:
        """The texts the passages are cached as (warmed): each after the shared head. A workload whose layout
        encodes passages otherwise overrides this one method."""
        head = self._head_and_separator()
        return [head + p for p in passages]

    def shared_context(self) -> list[str]:
        """``warm_passages: all``: every distinct passage of the run once, as :meth:`passage_encodings` gives it
        (else nothing)."""
        if self.cfg.warm_passages != "all":
            return []
        return self.passage_encodings(list(dict.fromkeys(p for item in self.items for p in item.passages)))

    def request_context(self, request: Request) -> list[str]:
        """``warm_passages: per_query``: the request's passages, as :meth:`passage_encodings` gives them (else
        nothing)."""
        if self.cfg.warm_passages != "per_query":
            return []
        by_id = getattr(self, "_items_by_id", None)
        if by_id is None:
            by_id = self._items_by_id = {item.item_id: item for item in self.items}
        return self.passage_encodings(by_id[request.request_id].passages)
