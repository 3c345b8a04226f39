"""Passages stored after a shared head: how the passage workloads (``musique``, ``needle``) warm their chunks.

The CacheBlend protocol (and kvboost's ``warm_context: head`` for ``rag_reorder``) stores each passage as its own
chunk after the prompts' shared head, so the cached KV of a passage is the KV it has in a real prompt up to the
passages before it. ``warm_passages`` says when: ``per_query`` (a request's passages right before it, untimed),
``all`` (every distinct passage of the run before timing; the cache must hold them all) or ``none``.
"""

from __future__ import annotations

from typing import Any

from experiments.workloads.base import Request

WARM_PASSAGES = ("per_query", "all", "none")


class PassagesAfterHead:
    """Mixin of a workload whose items have ``passages`` and an ``item_id`` equal to their request's id; the
    workload defines ``shared_head()`` and has ``cfg.warm_passages`` and ``cfg.separator`` (what joins the head
    and a passage in its prompts)."""

    cfg: Any
    items: list[Any]

    def shared_head(self) -> str:  # pragma: no cover - the workload's own
        raise NotImplementedError

    def _head_and_separator(self) -> str:
        head = getattr(self, "_passage_head", None)
        if head is None:
            head = self._passage_head = self.shared_head() + self.cfg.separator
        return head

    def shared_context(self) -> list[str]:
        """``warm_passages: all``: every distinct passage of the run once, after the shared head (else nothing)."""
        if self.cfg.warm_passages != "all":
            return []
        head = self._head_and_separator()
        return [head + p for p in dict.fromkeys(p for item in self.items for p in item.passages)]

    def request_context(self, request: Request) -> list[str]:
        """``warm_passages: per_query``: the request's passages, each after the shared head (else nothing)."""
        if self.cfg.warm_passages != "per_query":
            return []
        by_id = getattr(self, "_items_by_id", None)
        if by_id is None:
            by_id = self._items_by_id = {item.item_id: item for item in self.items}
        head = self._head_and_separator()
        return [head + p for p in by_id[request.request_id].passages]
