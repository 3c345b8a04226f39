"""``ForwardBatch``: every forward of the engine as one flat batch over the KV pool.

A batch is ``B`` sequences flattened into ``T`` token rows: decode (one row per sequence), a suffix or cold
prefill, ``warm()``, speculative verification (k + 1 rows), layer-wise content repair (a subset of a prompt's
positions, narrowed between layers by a hook), the query-aware probe (stopped after a layer), layer-skip drafting
(the first layers only). The runner (``kvboost.runtime.llama`` / ``hf_generic``) writes each row's K/V through
``slot_mapping`` and attends by block table and per-row position (``kvboost.kernels_triton.paged_attention_reference``).

Tensors live on the pool's device; the per-sequence lists stay in Python as well, for backends that loop over
sequences. Everything derived from the batch that every layer would otherwise rebuild (masks, gather indices,
block tables as a tensor) is built once and kept in :attr:`ForwardBatch.derived`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvboost.kv.block_table import BlockTable


class LayerHook(Protocol):
    """Called by the runner around each layer of a forward (eager execution only).

    ``before_layer(layer, batch)``: before the layer computes (e.g. keep the cached rows a check layer compares);
    ``on_query(layer, q, batch)``: the layer's queries ``[T, Hq, D]`` after RoPE, before attention (observers such
    as the reader-attention probe); ``on_hidden(layer, hidden, batch)`` (optional): the layer's output ``[T, hidden]``
    (what a check layer's strategy may score from); ``after_layer(layer, batch)``: after it, returning the row indices of ``batch``
    to keep computing in the next layers (``None``: all); a hook whose ``stop_after`` is set ends the forward after
    that layer (no logits).
    """

    stop_after: int | None

    def before_layer(self, layer: int, batch: ForwardBatch) -> None: ...

    def on_query(self, layer: int, q: torch.Tensor, batch: ForwardBatch) -> None: ...

    def after_layer(self, layer: int, batch: ForwardBatch) -> torch.Tensor | None: ...


@dataclass
class SeqInput:
    """One sequence's part of a forward: its block table, the token ids to run, and their positions (default:
    the rows after the table's filled ones, ``table.length ..``)."""

    table: BlockTable
    token_ids: Sequence[int] | torch.Tensor
    positions: Sequence[int] | torch.Tensor | None = None
    #: rows of this sequence whose logits are wanted, as offsets into its tokens (default: the last one)
    logits: Sequence[int] | None = None


@dataclass
class ForwardBatch:
    """A flat batch (see the module docstring). Build it with :meth:`build`.

    Attributes:
        input_ids, positions, slot_mapping: ``[T]`` int64 on the pool's device.
        query_start: ``B + 1`` row offsets (Python ints); ``kv_lens``: keys per sequence after this forward.
        tables: the sequences' block tables (their ``length`` is ``kv_lens`` once the forward ran).
        logits_rows: ``[R]`` row indices whose logits ``run`` returns (int64, pool device).
        contiguous: per sequence, whether its positions are ``kv_len - t .. kv_len - 1`` in order (a plain suffix,
            decode or cold prefill): the HF mask semantics apply; otherwise rows are an arbitrary subset.
        hook: an optional :class:`LayerHook`.
        num_layers: run only the first ``num_layers`` decoder layers, then the final norm and head (layer-skip
            drafting); None runs them all.
        derived: per-batch values backends and the runner build once (masks, indices...).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start: list[int]
    kv_lens: list[int]
    tables: list[BlockTable]
    logits_rows: torch.Tensor
    contiguous: list[bool]
    positions_list: list[list[int]] | None = None
    hook: LayerHook | None = None
    num_layers: int | None = None
    derived: dict[Any, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ construction
    @classmethod
    def build(
        cls,
        seqs: Sequence[SeqInput],
        *,
        hook: LayerHook | None = None,
        num_layers: int | None = None,
        prepare: bool = True,
    ) -> ForwardBatch:
        """Flatten ``seqs``. ``prepare`` reserves the blocks the rows will be written into (copying a shared
        block on write) and sets each table's ``length`` to its ``kv_len`` (the forward fills those rows)."""
        if not seqs:
            raise ValueError("a forward batch needs at least one sequence")
        pool = seqs[0].table.pool
        ids: list[int] = []
        positions: list[int] = []
        slots: list[torch.Tensor] = []
        query_start = [0]
        kv_lens: list[int] = []
        contiguous: list[bool] = []
        logits_rows: list[int] = []
        per_seq_positions: list[list[int]] = []
        for seq in seqs:
            if seq.table.pool is not pool:
                raise ValueError("every sequence of a batch must use the same KV pool")
            toks = seq.token_ids.tolist() if isinstance(seq.token_ids, torch.Tensor) else list(seq.token_ids)
            t = len(toks)
            if seq.positions is None:
                pos = list(range(seq.table.length, seq.table.length + t))
            else:
                pos = seq.positions.tolist() if isinstance(seq.positions, torch.Tensor) else list(seq.positions)
                if len(pos) != t:
                    raise ValueError(f"{t} tokens but {len(pos)} positions")
            if t and min(pos) < 0:
                raise ValueError("positions must be >= 0")
            kv_len = max(seq.table.length, max(pos) + 1 if pos else 0)
            is_suffix = pos == list(range(kv_len - t, kv_len))
            if prepare and t:
                lo = min(pos)
                seq.table.prepare_write(lo, kv_len)
                seq.table.length = kv_len
            base = query_start[-1]
            offsets = [t - 1] if seq.logits is None else list(seq.logits)
            if t and any(not 0 <= o < t for o in offsets):
                raise ValueError(f"logits rows {offsets} are outside the sequence's {t} tokens")
            logits_rows += [base + o for o in offsets] if t else []
            ids += toks
            positions += pos
            per_seq_positions.append(pos)
            slots.append(pool.slots(seq.table.blocks, 0, 0) if not t else _slots_at(pool, seq.table.blocks, pos))
            query_start.append(base + t)
            kv_lens.append(kv_len)
            contiguous.append(is_suffix)
        device = pool.device
        return cls(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=torch.cat(slots) if slots else torch.empty(0, dtype=torch.long, device=device),
            query_start=query_start,
            kv_lens=kv_lens,
            tables=[s.table for s in seqs],
            logits_rows=torch.tensor(logits_rows, dtype=torch.long, device=device),
            contiguous=contiguous,
            positions_list=per_seq_positions,
            hook=hook,
            num_layers=num_layers,
        )

    # ------------------------------------------------------------------ views
    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_seqs(self) -> int:
        return len(self.kv_lens)

    @property
    def pool(self) -> Any:
        return self.tables[0].pool

    @property
    def is_decode(self) -> bool:
        """Every sequence runs exactly one row, the one after its cached rows."""
        return self.num_tokens == self.num_seqs and all(self.contiguous)

    def rows_of(self, b: int) -> slice:
        return slice(self.query_start[b], self.query_start[b + 1])

    def cached(self, key: Any, build: Callable[[], Any]) -> Any:
        """``derived[key]``, built by ``build()`` on first use."""
        value = self.derived.get(key)
        if value is None:
            value = self.derived[key] = build()
        return value

    def block_tables_tensor(self) -> torch.Tensor:
        """``[B, M]`` int32 block ids (rows padded with 0 past a sequence's blocks)."""

        def build() -> torch.Tensor:
            width = max(1, max(len(t.blocks) for t in self.tables))
            rows = [t.blocks + [0] * (width - len(t.blocks)) for t in self.tables]
            return torch.tensor(rows, dtype=torch.int32, device=self.pool.device)

        return self.cached("block_tables", build)

    def kernel_args(self) -> dict[str, Any]:
        """The index tensors of the paged attention contract (``kvboost.kernels_triton.paged_attention_reference``)."""

        def build() -> dict[str, Any]:
            device = self.pool.device
            return {
                "block_tables": self.block_tables_tensor(),
                "kv_lens": torch.tensor(self.kv_lens, dtype=torch.int32, device=device),
                "query_start": torch.tensor(self.query_start, dtype=torch.int32, device=device),
                "q_positions": self.positions.to(torch.int32),
                "block_size": self.pool.block_size,
                "max_q_len": max(b - a for a, b in zip(self.query_start, self.query_start[1:], strict=False)),
                "max_kv_len": max(self.kv_lens),
            }

        return self.cached("kernel_args", build)

    def seq_slots(self, b: int) -> torch.Tensor | int:
        """Sequence ``b``'s rows ``[0, kv_len)``: the first slot when its blocks are consecutive (the rows are one
        view of each layer), else their slot indices (a gather)."""

        def build() -> torch.Tensor | int:
            table, n = self.tables[b], self.kv_lens[b]
            start = self.pool.run_start(table.blocks, n)
            return start if start is not None else table.slots(0, n)

        return self.cached(("seq_slots", b), build)

    def layer_kv(self, b: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence ``b``'s keys and values of ``layer``: ``[1, Hkv, kv_len, D]`` each (a view when its blocks
        are consecutive, else a gathered copy)."""
        pool, n = self.pool, self.kv_lens[b]
        where = self.seq_slots(b)
        if isinstance(where, int):
            return pool.keys[layer, :, where : where + n][None], pool.values[layer, :, where : where + n][None]
        return pool.keys[layer].index_select(1, where)[None], pool.values[layer].index_select(1, where)[None]

    def subset(self, seqs: Sequence[int]) -> tuple[ForwardBatch, list[int]]:
        """The batch of sequences ``seqs`` (this batch's indices, in that order; their rows were prepared when this
        batch was built) and, for each of its logits rows, that row's index in this batch's ``logits_rows`` (to put
        the two parts' logits back in order). Hooks and layer limits do not carry over."""
        rows = [r for b in seqs for r in range(self.query_start[b], self.query_start[b + 1])]
        new_row = {r: i for i, r in enumerate(rows)}
        picked = [(k, new_row[r]) for k, r in enumerate(self.logits_rows.tolist()) if r in new_row]
        query_start = [0]
        for b in seqs:
            query_start.append(query_start[-1] + self.query_start[b + 1] - self.query_start[b])
        device = self.input_ids.device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        part = ForwardBatch(
            input_ids=self.input_ids[index],
            positions=self.positions[index],
            slot_mapping=self.slot_mapping[index],
            query_start=query_start,
            kv_lens=[self.kv_lens[b] for b in seqs],
            tables=[self.tables[b] for b in seqs],
            logits_rows=torch.tensor([n for _, n in picked], dtype=torch.long, device=device),
            contiguous=[self.contiguous[b] for b in seqs],
            positions_list=[self.positions_list[b] for b in seqs] if self.positions_list is not None else None,
        )
        return part, [k for k, _ in picked]

    def select(self, rows: torch.Tensor) -> ForwardBatch:
        """The batch of the kept ``rows`` (int64 indices, sorted) of a one-sequence batch, for the layers after a
        hook narrowed it. The last row must stay (its logits are wanted)."""
        if self.num_seqs != 1:
            raise ValueError("only a one-sequence batch can be narrowed between layers")
        rows = rows.to(self.input_ids.device)
        t = self.num_tokens
        if rows.numel() == 0 or int(rows[-1]) != t - 1:
            raise ValueError("a narrowed batch must keep its last row (its logits are wanted)")
        keep = torch.zeros(t, dtype=torch.bool, device=rows.device)
        keep[rows] = True
        remap = torch.cumsum(keep.long(), 0) - 1
        kept_logits = self.logits_rows[keep[self.logits_rows]]
        pos = self.positions[rows]
        return ForwardBatch(
            input_ids=self.input_ids[rows],
            positions=pos,
            slot_mapping=self.slot_mapping[rows],
            query_start=[0, int(rows.numel())],
            kv_lens=list(self.kv_lens),
            tables=self.tables,
            logits_rows=remap[kept_logits],
            contiguous=[False],
            positions_list=[pos.tolist()],
            hook=self.hook,
            num_layers=self.num_layers,
        )


def hook_after_layer(hook: LayerHook, layer: int, batch: ForwardBatch, hidden: torch.Tensor | None = None
                     ) -> tuple[bool, torch.Tensor | None, ForwardBatch]:  # fmt: skip
    """What a runner does after each layer of a hooked forward: ``(stop, kept rows or None, the batch of the next
    layers)``. The forward stops after the hook's ``stop_after`` layer; else the hook sees the layer's output
    ``hidden`` ``[T, hidden]`` (``on_hidden``, when it has one) and may narrow the rows."""
    if hook.stop_after is not None and layer >= hook.stop_after:
        return True, None, batch
    on_hidden = getattr(hook, "on_hidden", None)
    if on_hidden is not None and hidden is not None:
        on_hidden(layer, hidden, batch)
    keep = hook.after_layer(layer, batch)
    if keep is None or keep.numel() == batch.num_tokens:
        return False, None, batch
    keep = keep.to(batch.input_ids.device)
    return False, keep, batch.select(keep)


def _slots_at(pool: Any, blocks: list[int], positions: list[int]) -> torch.Tensor:
    """Slots of arbitrary logical rows of one sequence."""
    bs = pool.block_size
    if positions == list(range(positions[0], positions[0] + len(positions))):
        return pool.slots(blocks, positions[0], positions[0] + len(positions))
    table = torch.tensor(blocks, dtype=torch.long)
    pos = torch.tensor(positions, dtype=torch.long)
    return (table[pos // bs] * bs + pos % bs).to(pool.device)
