"""Grouping prompts by shared prefix (``generate_many``; SGLang-style: one copy of a shared uncached prefix is
computed before its siblings, which then share its blocks)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvboost.cache.sequence_store import common_prefix_length


def group_by_prefix(prompts: Sequence[Sequence[int]], split: Callable[[Sequence[int]], list]) -> list[tuple[list[int], int]]:
    """``[(indices, shared prefix length)]``: prompts grouped greedily, in order, with the first prompt of a group
    that shares at least one whole chunk (``split``'s first span) with it; the shared length is the group's longest
    common token prefix, cut to whole chunks and kept below every member's length (each keeps a token to
    compute). Prompts sharing nothing form groups of one."""
    groups: list[tuple[list[int], int]] = []
    for i, ids in enumerate(prompts):
        placed = False
        for members, _ in groups:
            head = prompts[members[0]]
            spans = split(head)
            if spans and common_prefix_length(head, ids) >= spans[0].end:
                members.append(i)
                placed = True
                break
        if not placed:
            groups.append(([i], 0))
    out = []
    for members, _ in groups:
        if len(members) == 1:
            out.append((members, 0))
            continue
        shared = min(common_prefix_length(prompts[members[0]], prompts[m]) for m in members[1:])
        shared = min(shared, min(len(prompts[m]) for m in members) - 1)
        ends = [s.end for s in split(prompts[members[0]]) if s.end <= shared]
        out.append((members, ends[-1] if ends else 0))
    return out
