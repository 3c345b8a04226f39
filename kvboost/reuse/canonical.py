"""Chat reuse that survives re-tokenization: store a finished answer as the next turn's prompt will tokenize it.

A chat's next prompt holds the answer as *text* (decoded, then rendered by the chat template and tokenized with
the rest of the prompt). Those ids often differ from the ones the model generated: BPE merges the decoded text
otherwise (``1.`` generated as ``1`` + ``.`` comes back as one token, a space joins the next word...), and the
end-of-turn markup after the answer was never fed at all. A prefix cache keyed by token ids then stops at the
first such difference and recomputes the rest of the history (two-turn chat on SmolLM2: 45 of 96 tokens reused).

:func:`canonical_turn` predicts the next turn's ids of the history: the request's chat messages plus the answer
text rendered by the template up to and including its end-of-turn markup (:func:`kvboost.prompts.answered_turn_text`),
tokenized by the chunker. :func:`store_canonical` then computes the KV of those ids where they differ from the
generated sequence: the rows of the longest common prefix are the request's own (its blocks, shared by reference),
the differing suffix is prefilled on top of them, exactly as a cold prefill of the next prompt computes it (causal
attention: a row depends on the rows before it only), and the chunks are stored under their prefix-chained keys
beside the generated ones. The engine runs it after the request finished (its result and timings are complete,
:class:`kvboost.serving.core.EngineCore`), not inside any request's TTFT.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvboost.kv.block_table import BlockTable
from kvboost.kv.pool import PoolExhausted
from kvboost.lookup import common_prefix_length
from kvboost.prompts import answered_turn_text
from kvboost.runtime.batch import ForwardBatch, SeqInput
from kvboost.types import ChunkSpan

log = logging.getLogger(__name__)


@dataclass
class CanonicalTurn:
    """The next turn's ids of a finished chat request's history, and how they relate to what was generated."""

    ids: list[int]  # the history as the next prompt tokenizes it (through the end-of-turn markup)
    spans: list[ChunkSpan]
    shared: int  # leading ids equal to the generated sequence's (their KV is the request's own rows)


@dataclass
class CanonicalStore:
    """What :func:`store_canonical` did (goes into the request's ``result.extra`` as ``canonical_*``)."""

    prefilled_tokens: int = 0  # rows computed on top of the shared prefix
    chunks_stored: int = 0
    ms: float = 0.0
    skipped: str = ""  # why nothing was computed ("" when something was)

    def as_extra(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "canonical_prefill_tokens": self.prefilled_tokens,
            "canonical_chunks_stored": self.chunks_stored,
            "canonical_store_ms": self.ms,
        }
        if self.skipped:
            out["canonical_skipped"] = self.skipped
        return out


def canonical_turn(engine: Any, messages: Sequence[Mapping[str, str]], prompt_ids: Sequence[int],
                   tokens: Sequence[int]) -> CanonicalTurn | None:  # fmt: skip
    """The history of the next turn after ``messages`` were answered with ``tokens`` (generated ids, the
    end-of-sequence token included when the model stopped), tokenized as the next prompt will be; None when the
    template cannot predict it."""
    tokenizer = engine.tokenizer
    answer = tokenizer.decode(list(tokens), skip_special_tokens=True)  # the text generate() returns
    text = answered_turn_text(tokenizer, messages, answer)
    if text is None:
        return None
    ids, spans = engine.chunker.tokenize(tokenizer, text)
    max_positions = engine.adapter.max_positions
    if not ids or (max_positions is not None and len(ids) >= max_positions):
        return None
    generated = [*prompt_ids, *tokens]
    return CanonicalTurn(list(ids), spans if spans is not None else engine.chunker.split(ids),
                         common_prefix_length(ids, generated))  # fmt: skip


def store_canonical(engine: Any, turn: CanonicalTurn, table: BlockTable, *, approx_from: int | None,
                    salt: str = "") -> CanonicalStore:  # fmt: skip
    """Compute and store the KV of ``turn.ids`` (see the module docstring). ``table`` holds the finished request's
    rows (a fork: its blocks are shared, never written: rows after ``turn.shared`` go to fresh blocks, copy on
    write); only its first ``min(turn.shared, table.length)`` rows are used. ``approx_from`` is the request's: rows
    after approximate (content-hit) KV are stored for content hits only, as the request's own are."""
    from kvboost.runtime.pipeline import store_sequence_of

    start = time.perf_counter()
    out = CanonicalStore()
    shared = min(turn.shared, table.length)
    if shared >= len(turn.ids):
        out.skipped = "the generated ids are the canonical ones"
        return out
    scratch = BlockTable(engine.pool)
    try:
        if shared:
            scratch.share(table.blocks, shared)
        with torch.inference_mode():
            engine.runner.run(ForwardBatch.build([SeqInput(scratch, turn.ids[shared:])]))
        out.prefilled_tokens = len(turn.ids) - shared
        out.chunks_stored = store_sequence_of(engine, turn.ids, turn.spans, scratch, approx_from=approx_from,
                                              salt=salt)  # fmt: skip
    except PoolExhausted as exc:  # a cache refinement, never an error of the request that finished
        log.info("kvboost: canonical store skipped: %s", exc)
        out.skipped = f"KV pool full: {exc}"
    finally:
        scratch.release()
    out.ms = (time.perf_counter() - start) * 1e3
    return out
