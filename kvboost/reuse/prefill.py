"""One request's prefill under reuse: assemble the plan into its block table, run the recompute strategy's
schedule through the runner, return the last logits and what was reused and recomputed.

- exact hits become the table's first blocks (by reference, :mod:`kvboost.reuse.assemble`);
- a plan with content hits asks the strategy for a schedule (validated); the reader probe runs first for
  strategies that need it; a schedule that recomputes every row after the exact prefix is a plain suffix
  prefill; any other runs layer by layer with :class:`~kvboost.reuse.repair.CheckLayerHook`;
- recompute ratios are measured from what the layers ran (DESIGN.md invariant 6);
- with the reference deviation at hand (``needs_reference``) or asked for (the strategy's ``oracle_agreement``), the
  selection is judged against the reference's (``oracle_recall``, ``oracle_rank_corr``:
  :mod:`kvboost.recompute.agreement`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from kvboost.generation import PhaseClock, ReuseCounts
from kvboost.kv.block_table import BlockTable
from kvboost.plan import ReusePlan, validate_schedule, validate_selection
from kvboost.recompute.agreement import selector_agreement
from kvboost.recompute.base import LayerView
from kvboost.reuse.assemble import assemble_content, assemble_exact
from kvboost.reuse.repair import CheckLayerHook, ReaderProbeHook
from kvboost.runtime.batch import ForwardBatch, SeqInput


@dataclass
class PrefillOutcome:
    """The prompt's last logits, what reuse served, and the first position whose KV is not what a cold prefill
    computes (``approx_from``: None when every row is exact)."""

    logits: torch.Tensor
    counts: ReuseCounts
    approx_from: int | None


@dataclass
class ReuseContext:
    """What a prefill needs from the engine: the runner and the plugins it composes."""

    runner: Any
    quantizer: Any
    recompute: Any
    rotator: Any
    num_layers: int
    scale: float | None = None
    reference_memo: ReferenceMemo | None = None


def run_prefill(ctx: ReuseContext, plan: ReusePlan, table: BlockTable, clock: PhaseClock, *,
                check_schedule: bool) -> PrefillOutcome:  # fmt: skip
    """Assemble ``plan`` into the empty ``table`` and compute what the schedule says; the table then holds the
    prompt's rows (``table.length == len(plan)``)."""
    n, num_layers = len(plan), ctx.num_layers
    ids = torch.tensor(plan.prompt_ids, dtype=torch.long)
    assembly = assemble_exact(plan, table, ctx.quantizer)
    counts = ReuseCounts(cached_tokens=plan.reused_tokens, exact_tokens=plan.exact_tokens,
                         content_tokens=plan.content_tokens)  # fmt: skip
    counts.extra.update(shared_blocks=assembly.shared_blocks, loaded_rows=assembly.loaded_rows)
    frontier = plan.exact_prefix
    probed = False
    recompute = ctx.recompute
    if plan.content_tokens:
        plan.reference_deviation = reference_deviation(ctx, plan) if recompute.needs_reference else None
        if check_schedule and recompute.needs_reader_attention:
            assemble_content(plan, table, ctx.rotator, recompute)
            clock.mark("assembled")
            plan.reader_attention = reader_attention(ctx, plan, table, ids)
            clock.mark("probed")
            counts.extra["probe_ms"] = clock.ms("assembled", "probed")
            probed = True
    schedule = recompute.schedule(plan, num_layers) if check_schedule else None
    positions = validate_schedule(schedule, plan, num_layers, recompute.registry_name) if schedule else None
    if positions is None or (not schedule.check_layers and positions.numel() == n - frontier):
        # A plain suffix [frontier, n) after the exact prefix.
        clock.mark("assembled")
        if table.length > frontier:
            table.truncate(frontier)
        logits = ctx.runner.run(ForwardBatch.build([SeqInput(table, ids[frontier:])]))[0]
        counts.recomputed_pairs = plan.content_tokens * num_layers
        counts.extra.update(prefill_tokens=n - frontier, layerwise=False,
                            content_recompute_fraction=1.0 if plan.content_tokens else 0.0)  # fmt: skip
        if schedule is not None and schedule.full_prefill_cost and plan.content_tokens:
            counts.recomputed_pairs = plan.reused_tokens * num_layers  # it ran a full prefill to decide
        if schedule is not None:
            record_agreement(ctx, plan, plan.positions("content"), None, clock, counts)
        return PrefillOutcome(logits, counts, approx_from=None)

    if not probed:
        assemble_content(plan, table, ctx.rotator, recompute)
        clock.mark("assembled")
    elif max(recompute.reader_layers(num_layers)) == num_layers - 1:
        # The probe computed every new token before the first content hit, at every layer, over exact rows
        # only (attention is causal): those rows are final; the real pass need not compute them again.
        first_content = int(plan.positions("content")[0])
        counts.extra["probe_kept_tokens"] = int((positions < first_content).sum())
        positions = positions[positions >= first_content]
    content_mask = plan.kinds == 1
    strategy = recompute
    last_check: list[LayerView] = []

    def on_check(layer: int, candidates: torch.Tensor, seen: dict[str, torch.Tensor | None]) -> torch.Tensor:
        view = LayerView.before_forward(plan, num_layers, candidates)
        view.layer = layer
        for name, value in seen.items():
            setattr(view, name, value)
        last_check[:] = [view]
        chosen = strategy.select(view)
        return validate_selection(chosen, candidates, strategy.registry_name, layer)

    hook = CheckLayerHook(content_mask, tuple(schedule.check_layers), on_check)
    batch = ForwardBatch.build([SeqInput(table, ids[positions], positions=positions)], hook=hook)
    logits = ctx.runner.run(batch)[0]
    # Layers up to the last check layer rank tokens (all candidates computed there); later layers blend.
    blend_from = max(schedule.check_layers) + 1 if schedule.check_layers else 0
    per_layer = hook.content_per_layer
    check_pairs, blend_pairs = sum(per_layer[:blend_from]), sum(per_layer[blend_from:])
    counts.recomputed_pairs = check_pairs + blend_pairs
    if schedule.full_prefill_cost:
        counts.recomputed_pairs = plan.reused_tokens * num_layers
    blend_layers = num_layers - blend_from
    counts.extra.update(
        prefill_tokens=int(positions.numel()),
        layerwise=True,
        check_layer_recompute_ratio=check_pairs / (n * num_layers),
        # Fraction of content-hit tokens recomputed in the layers after the check layers: what a ratio sets.
        content_recompute_fraction=blend_pairs / (plan.content_tokens * blend_layers)
        if plan.content_tokens and blend_layers else 0.0,
    )
    final = hook.final_positions if hook.final_positions is not None else positions
    approx = content_mask & ~torch.isin(torch.arange(n), final)
    hits = torch.nonzero(approx, as_tuple=False)
    record_agreement(ctx, plan, final[content_mask[final]], last_check[0] if last_check else None, clock, counts)
    return PrefillOutcome(logits, counts, approx_from=int(hits[0]) if hits.numel() else None)


def record_agreement(ctx: ReuseContext, plan: ReusePlan, selected: torch.Tensor, check: LayerView | None,
                     clock: PhaseClock, counts: ReuseCounts) -> None:  # fmt: skip
    """``oracle_recall`` / ``oracle_rank_corr`` of the content positions the strategy computed in the last layer
    (``selected``) into ``counts.extra``, when the reference deviation exists (``needs_reference``) or the strategy's
    ``oracle_agreement`` asks for them. Asked for, the reference prefill runs here, after the strategy's, and its
    time (``oracle_agreement_ms``) is taken out of the request's clock: TTFT stays the strategy's."""
    recompute = ctx.recompute
    if not plan.content_tokens or not (recompute.needs_reference or getattr(recompute, "oracle_agreement", False)):
        return
    began = clock.mark("agreement")
    if plan.reference_deviation is None:
        memo = ctx.reference_memo
        key = memo.key(plan) if memo is not None else None
        cached = memo.get(key) if memo is not None else None
        plan.reference_deviation = cached if cached is not None else reference_deviation(ctx, plan)
        if memo is not None and cached is None:
            memo.put(key, plan.reference_deviation)
    content = plan.positions("content")
    counts.extra.update(selector_agreement(content, selected.cpu(), plan.reference_deviation,
                                           recompute.token_scores(plan, ctx.num_layers, check)))  # fmt: skip
    elapsed = clock.mark("agreement_end") - began
    for name in ("agreement", "agreement_end"):
        del clock.marks[name]
    for name in clock.marks:  # as if everything so far had happened ``elapsed`` later
        clock.marks[name] += elapsed
    counts.extra["oracle_agreement_ms"] = elapsed * 1e3


def reader_attention(ctx: ReuseContext, plan: ReusePlan, table: BlockTable, ids: torch.Tensor) -> torch.Tensor:
    """The probe pass for ``needs_reader_attention`` strategies: compute only the new tokens over the assembled
    (re-rotated) content hits and record what the reader queries (the positions after the last content hit)
    attend to. Returns ``[layers, heads, content]``. The new tokens' rows it writes are computed again by the real
    pass (the schedule always includes every new position), except those before the first content hit when the
    probe ran every layer: they attended to exact rows only, so the prefill keeps them (``probe_kept_tokens``)."""
    n, num_layers = len(plan), ctx.num_layers
    layers = tuple(ctx.recompute.reader_layers(num_layers))
    if not layers or any(not 0 <= layer < num_layers for layer in layers):
        raise ValueError(
            f"recompute strategy {ctx.recompute.registry_name!r}: reader_layers must name layers in "
            f"[0, {num_layers}), got {list(layers)}"
        )
    content = plan.positions("content")
    new = plan.positions("new")
    readers = new[new > int(content[-1])]
    probe = ReaderProbeHook(layers, n, readers)
    probe.scale = ctx.scale
    ctx.runner.run(ForwardBatch.build([SeqInput(table, ids[new], positions=new)], hook=probe))
    return probe.result()[:, :, content]


class ReferenceMemo:
    """The last few ``reference_deviation`` results, for ``oracle_agreement`` only: a leaderboard runs one prompt
    under many strategies over the same cached rows, and the reference deviations depend only on the prompt and on
    those rows, so its full prefill runs once per prompt instead of once per strategy. The key is the prompt's ids
    and, per content placement, its span, the position its rows were stored at and a digest of their bytes (a
    re-stored chunk with different rows misses). The ``true_deviation`` strategy's own reference (timed: it is part of
    its TTFT) never reads it."""

    def __init__(self, capacity: int = 4) -> None:
        if capacity < 1:
            raise ValueError(f"ReferenceMemo capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = 0

    @staticmethod
    def key(plan: ReusePlan) -> str:
        digest = xxhash.xxh3_128()
        digest.update(torch.tensor(plan.prompt_ids, dtype=torch.int64).numpy().tobytes())
        for p in plan.placements:
            if p.kind != "content":
                continue
            digest.update(f"|{p.start},{p.end},{p.stored_start}|".encode())
            for rows in (p.keys, p.values):
                digest.update(rows.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def get(self, key: str) -> torch.Tensor | None:
        found = self.entries.get(key)
        if found is not None:
            self.entries.move_to_end(key)
            self.hits += 1
            return found.clone()
        return None

    def put(self, key: str, deviation: torch.Tensor) -> None:
        self.entries[key] = deviation.clone()
        self.entries.move_to_end(key)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)


def reference_deviation(ctx: ReuseContext, plan: ReusePlan) -> torch.Tensor:
    """Per content position, the squared K/V error of the re-rotated cached rows against a full prefill,
    summed over layers (for research strategies such as ``true_deviation``). The full prefill runs in scratch blocks."""
    pool = ctx.runner.pool
    scratch = BlockTable(pool)
    try:
        ctx.runner.run(ForwardBatch.build([SeqInput(scratch, plan.prompt_ids)]))
        pos = plan.positions("content")
        total = torch.zeros(pos.numel(), dtype=torch.float32)
        for p in plan.placements:
            if p.kind != "content":
                continue
            ref_k, ref_v = pool.read(scratch.slots(p.start, p.end))
            keys = p.keys.to(device=pool.device, dtype=pool.dtype)
            keys = ctx.rotator.rotate(keys, p.shift) if p.shift else keys
            rows = (pos >= p.start) & (pos < p.end)
            err = (keys.float() - ref_k.float()).pow(2).mean(dim=(1, 3)).sum(0)
            err += (p.values.to(pool.device).float() - ref_v.float()).pow(2).mean(dim=(1, 3)).sum(0)
            total[rows] = err.cpu()
        return total
    finally:
        scratch.release()
