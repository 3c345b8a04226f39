"""The reuse plan of one prompt (what the cache serves, token by token) and the compute schedule.

The lookup (``kvboost.lookup``) builds a :class:`ReusePlan`: a list of :class:`Placement` covering the prompt,
each ``exact`` (KV computed with this very history: reusable as is), ``content`` (the same tokens stored at
another position or after another history: re-rotated, stale) or ``new`` (nothing cached). A recompute
strategy then returns a :class:`ComputeSchedule`: which (token, layer) pairs to compute. The engine validates
the schedule (:func:`validate_schedule`) and runs it; strategies never edit the plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from kvboost.types import ChunkKey, ChunkSpan

PlacementKind = Literal["exact", "content", "new"]
KIND_CODES: dict[str, int] = {"exact": 0, "content": 1, "new": 2}


@dataclass
class Placement:
    """Prompt positions ``[start, end)`` and where their KV comes from.

    ``keys``/``values`` (stacked ``[layers, kv_heads, end - start, head_dim]``) are set for exact and content
    placements, except exact hits under a lossy quantizer: those carry the stored ``payload`` instead, and the
    engine decodes its first ``end - start`` tokens straight into the request's cache
    (``KVQuantizer.dequantize_into``), so a quantized hit costs no full-size temporary. ``stored_start`` is the
    position the entry's KV was computed at: a content placement's keys are re-rotated by
    ``start - stored_start`` when assembled.
    """

    start: int
    end: int
    kind: PlacementKind
    entry_key: str | None = None
    stored_start: int | None = None
    keys: torch.Tensor | None = field(default=None, repr=False)
    values: torch.Tensor | None = field(default=None, repr=False)
    payload: Any = field(default=None, repr=False)

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def shift(self) -> int:
        """Positions the cached keys move by (0 for exact hits)."""
        return 0 if self.stored_start is None else self.start - self.stored_start


class ReusePlan:
    """What the lookup assembled for one prompt.

    Attributes:
        prompt_ids: the prompt's token ids.
        spans, keys: the chunker's spans and the hasher's keys (the engine stores new chunks under them).
        placements: contiguous, sorted, covering ``[0, len(prompt_ids))``.
        kinds: int8 tensor ``[n]``: 0 exact, 1 content, 2 new (``KIND_CODES``).
        reference_deviation: set by the engine for strategies with ``needs_reference`` (``true_deviation``): per
            content position (in ``positions("content")`` order), how far the cached K/V is from a full
            prefill's, summed over layers.
        held, pool: references to pool blocks of the exact hits, taken by the lookup, and their pool
            (:meth:`release`).
        reader_attention: set by the engine for strategies with ``needs_reader_attention``: ``[layers, heads,
            content]`` float32, the mean softmax attention of the prompt's reader queries (the positions after
            the last content hit) over each content position (in ``positions("content")`` order), measured in a
            probe pass that reuses every content hit as re-rotated, at the layers the strategy asked for.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        placements: list[Placement],
        *,
        spans: Sequence[ChunkSpan] = (),
        keys: Sequence[ChunkKey] = (),
        held: Sequence[int] = (),
        pool: Any = None,
    ) -> None:
        self.prompt_ids = prompt_ids
        #: references to pool blocks of the exact hits, taken by the lookup (``release`` gives them back)
        self.held = list(held)
        self.pool = pool
        self.placements = placements
        self.spans = list(spans)
        self.keys = list(keys)
        self.reference_deviation: torch.Tensor | None = None
        self.reader_attention: torch.Tensor | None = None
        n = len(prompt_ids)
        pos = 0
        kinds = torch.empty(n, dtype=torch.int8)
        for p in placements:
            if p.start != pos or p.end <= p.start:
                raise ValueError(f"reuse plan placements must be contiguous and non-empty: {p} after position {pos}")
            if p.kind not in KIND_CODES:
                raise ValueError(f"unknown placement kind {p.kind!r}")
            if p.kind == "new":
                if p.keys is not None or p.payload is not None:
                    raise ValueError(f"a new placement carries no KV: {p}")
            elif p.kind == "exact" and p.payload is not None:
                if p.keys is not None or p.payload.num_tokens < len(p):
                    raise ValueError(
                        f"exact placement {p.start}:{p.end} carries either KV or a payload of at least {len(p)} tokens"
                    )
            elif p.keys is None or p.values is None or p.keys.shape[2] != len(p) or p.values.shape[2] != len(p):
                raise ValueError(f"{p.kind} placement {p.start}:{p.end} needs KV for exactly {len(p)} tokens")
            kinds[p.start : p.end] = KIND_CODES[p.kind]
            pos = p.end
        if pos != n:
            raise ValueError(f"reuse plan covers {pos} of {n} prompt tokens")
        self.kinds = kinds
        counts = torch.bincount(kinds.long(), minlength=3).tolist() if n else [0, 0, 0]
        self.exact_tokens, self.content_tokens, self.new_tokens = counts
        #: Leading exact tokens: the exact frontier.
        self.exact_prefix = next((p.start for p in placements if p.kind != "exact"), n)

    def release(self) -> None:
        """Give back the references the lookup took (idempotent); ``assemble_exact`` calls it once the request's
        block table holds its own."""
        held, self.held = self.held, []
        if held:
            self.pool.decref(held)

    @classmethod
    def cold(cls, prompt_ids: list[int], spans: Sequence[ChunkSpan] = (), keys: Sequence[ChunkKey] = ()) -> ReusePlan:
        """The prompt with nothing reused."""
        return cls(prompt_ids, [Placement(0, len(prompt_ids), "new")], spans=spans, keys=keys)

    def __len__(self) -> int:
        return len(self.prompt_ids)

    @property
    def reused_tokens(self) -> int:
        return self.exact_tokens + self.content_tokens

    def positions(self, kind: PlacementKind) -> torch.Tensor:
        """Sorted int64 positions of one kind."""
        return torch.nonzero(self.kinds == KIND_CODES[kind], as_tuple=False).flatten()

    def __repr__(self) -> str:
        return (
            f"ReusePlan(n={len(self)}, exact={self.exact_tokens}, content={self.content_tokens}, new={self.new_tokens}, "
            f"placements={len(self.placements)})"
        )


@dataclass
class ComputeSchedule:
    """Which (token, layer) pairs to compute.

    ``initial`` (sorted int64 prompt positions) is computed at layer 0. At each layer in ``check_layers`` the
    engine measures, for the content positions it just computed, how far their fresh K/V is from the cached
    one, and asks the strategy (``select``) which of them to keep computing in the following layers; every
    other layer computes the same set as the layer before. A position computed at layer l > 0 must have been
    computed at layer l - 1 (its input is that layer's output), so the set only shrinks. New positions
    (nothing cached) are computed at every layer; exact hits never.

    ``full_prefill_cost`` marks strategies that ran a full prefill to decide (``true_deviation``): their recompute
    ratio is reported as a full prefill's.
    """

    initial: torch.Tensor
    check_layers: tuple[int, ...] = ()
    full_prefill_cost: bool = False


class ScheduleError(ValueError):
    """A recompute strategy returned a schedule that breaks the contract; the message says how."""


def validate_schedule(schedule: ComputeSchedule, plan: ReusePlan, num_layers: int, strategy: str) -> torch.Tensor:
    """Check ``schedule`` against ``plan``; returns ``initial`` as a sorted unique int64 CPU tensor."""
    initial = torch.as_tensor(schedule.initial).flatten().to("cpu", torch.long)
    n = len(plan)
    if initial.numel() and (initial.min() < 0 or initial.max() >= n):
        raise ScheduleError(f"recompute strategy {strategy!r}: positions outside the prompt [0, {n})")
    if initial.numel() > 1 and not bool((initial[1:] > initial[:-1]).all()):
        raise ScheduleError(f"recompute strategy {strategy!r}: initial positions must be sorted and unique")
    kinds = plan.kinds[initial]
    if bool((kinds == KIND_CODES["exact"]).any()):
        raise ScheduleError(f"recompute strategy {strategy!r} recomputes exact hits (never needed: they are exact)")
    if int((kinds == KIND_CODES["new"]).sum()) != plan.new_tokens:
        raise ScheduleError(f"recompute strategy {strategy!r} leaves new (uncached) tokens uncomputed")
    layers = schedule.check_layers
    if list(layers) != sorted(set(layers)) or any(not 0 <= layer < num_layers - 1 for layer in layers):
        raise ScheduleError(
            f"recompute strategy {strategy!r}: check_layers must be sorted, unique and in [0, {num_layers - 1})"
        )
    return initial


def validate_selection(selected: torch.Tensor, candidates: torch.Tensor, strategy: str, layer: int) -> torch.Tensor:
    """Check a check-layer selection: sorted unique positions, a subset of ``candidates``."""
    selected = torch.as_tensor(selected).flatten().to("cpu", torch.long)
    if selected.numel() > 1 and not bool((selected[1:] > selected[:-1]).all()):
        raise ScheduleError(f"recompute strategy {strategy!r}: selection at layer {layer} must be sorted and unique")
    if selected.numel() and not bool(torch.isin(selected, candidates).all()):
        raise ScheduleError(
            f"recompute strategy {strategy!r}: selection at layer {layer} adds positions that were not computed there"
        )
    return selected
