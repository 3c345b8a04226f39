"""A request's steps through the engine that are not the scheduler's: memory check, lookup, the prefill of a plan
with content hits, the first token, storing, the result. The engine core (:mod:`kvboost.engine.core`) calls
them inside its steps; nothing here runs on its own.
"""

from __future__ import annotations

from typing import Any

import torch

from kvboost.cache.block_run import BlockRun
from kvboost.cache.sequence_store import store_sequence
from kvboost.decoding import DecodeOutput
from kvboost.engine.sequences import Request
from kvboost.generation import build_result
from kvboost.kv.block_table import BlockTable
from kvboost.lookup import lookup
from kvboost.plan import ReusePlan
from kvboost.prompts import PromptError
from kvboost.reuse.prefill import ReuseContext, run_prefill
from kvboost.types import ChunkSpan, GenerationResult

#: ``generate(mode=...)``: ``reuse`` reads (exact and content hits) and writes the cache; ``prefix`` reads exact
#: (prefix-chained) hits only and writes; ``cold`` runs the same engine path (tokenizer, pool, runner, attention
#: backend) with the cache neither read nor written. (``kvboost.engine.GenerationMode`` names them as the original
#: API did: CHUNK_KV_REUSE, PREFIX_CACHE, BASELINE.)
MODES = ("reuse", "prefix", "cold")


def check_memory(engine: Any, rows: int, what: str = "prompt + max_new_tokens") -> None:
    """Refuse a request whose KV cannot fit, with the numbers, before any compute (``what``: what ``rows``
    counts, for the message)."""
    need = rows * engine.pool.row_bytes
    shorten = "lower max_new_tokens" if "max_new_tokens" in what else "shorten score_ids"
    if engine.max_kv_bytes is not None and need > engine.max_kv_bytes:
        raise PromptError(f"the KV for {rows} tokens ({what}) needs {need / 2**20:.1f} MiB, more "
                          f"than max_kv_bytes ({engine.max_kv_bytes / 2**20:.1f} MiB); {shorten} or "
                          "shorten the prompt")  # fmt: skip
    if engine.pool.blocks_for(rows) + 1 > engine.pool.num_blocks:
        raise PromptError(f"the KV for {rows} tokens ({what}) needs {need / 2**20:.1f} MiB, more "
                          f"than the KV pool holds ({engine.pool.num_blocks * engine.pool.block_bytes / 2**20:.1f} "
                          f"MiB); raise kv.pool_bytes, {shorten} or shorten the prompt")  # fmt: skip


def sequence_of(engine: Any, request: Request) -> tuple[list[int], list[ChunkSpan]]:
    """What a (re)starting request computes: its prompt, or, resumed after a preemption, the prompt and every token
    it generated (the last one's logits give its next token), with the chunker's spans over them; a request
    preempted in its ``score_ids`` rows, its prompt alone (the score rows follow it)."""
    if not request.tokens or request.scoring:
        return request.ids, request.spans
    seq = request.ids + request.tokens
    return seq, engine.chunker.extend(seq, request.spans)


def plan_for(engine: Any, request: Request) -> ReusePlan:
    """The request's reuse plan (cold: nothing reused). It holds references to its exact pool hits: assemble it
    (``assemble_exact``) or release it. ``warm`` / ``store`` requests reuse exact hits only, up to their last token;
    a generating one leaves its last token to compute (its logits give the next token)."""
    ids, spans = sequence_of(engine, request)
    if request.mode == "cold":
        return ReusePlan.cold(ids, spans)
    keys = engine.hasher.chunk_keys(ids, spans, engine.fingerprint, request.salt)
    generating = request.kind == "generate"
    return lookup(ids, spans, keys, engine.store, engine.quantizer, max_reuse=len(ids) - generating,
                  content=generating and engine.rotator is not None and request.mode == "reuse",
                  approx_tag=engine.approx_tag)  # fmt: skip


def reuse_context(engine: Any) -> ReuseContext:
    """What a prefill needs from the engine."""
    scale = getattr(engine.runner, "scale", None)
    return ReuseContext(engine.runner, engine.quantizer, engine.recompute, engine.rotator, engine.layers, scale,
                        reference_memo=getattr(engine, "reference_memo", None))


def prefill_with_repair(engine: Any, request: Request) -> torch.Tensor:
    """Assembly and the recompute strategy's schedule for a plan with content hits (``kvboost.reuse.prefill``):
    the request's whole prompt in this step. Returns the last logits."""
    outcome = run_prefill(reuse_context(engine), request.plan, request.table, request.clock,
                          check_schedule=request.mode != "cold")  # fmt: skip
    request.counts, request.approx_from = outcome.counts, outcome.approx_from
    return outcome.logits


def store_rows(engine: Any, request: Request, *, pin: bool = False) -> int:
    """Store the chunks of the rows the request's table holds (prompt, and generated tokens when the engine stores
    them and its decode step writes a prefill's K/V (``engine.generated_rows_exact``)): runs of its blocks in the
    pool tier, or the quantizer's payload of a copy. Returns chunks stored.

    A preempted request stores by the same rule (its resumption finds these rows): rows a prefill would not give
    (an int8-activation decode's) are never stored under exact keys, and ``store_generated=False`` stores no
    generated row; its resumption computes those again."""
    if request.mode == "cold" or not request.store:
        return 0
    table = request.table
    generated = engine.store_generated and getattr(engine, "generated_rows_exact", True)
    seq = request.ids + (request.tokens[:-1] if generated else [])
    seq = seq[: table.length]
    if not seq:
        return 0
    pool = engine.pool

    def payload_of(start: int, end: int) -> Any:
        if engine.store.pool is pool:
            return BlockRun.of_table(table, start, end)
        return engine.quantizer.quantize(*pool.read(table.slots(start, end)))

    return store_sequence(engine.store, chunker=engine.chunker, hasher=engine.hasher, fingerprint=engine.fingerprint,
                          seq=seq, spans=request.spans, payload_of=payload_of, approx_from=request.approx_from,
                          salt=request.salt, pin=pin, approx_tag=engine.approx_tag)  # fmt: skip


def pin_prefix(engine: Any, request: Request) -> int:
    """Pin every stored chunk of the request's prompt (``warm(pin=True)``): in the pool tier a pin is a reference
    to the chunk's blocks. Returns the chunks pinned."""
    keys = engine.hasher.chunk_keys(request.ids, request.spans, engine.fingerprint, request.salt)
    return sum(engine.store.set_pinned(key.prefix_key, True) for key in keys)


def generation_result(engine: Any, request: Request) -> GenerationResult:
    """The request's ``GenerationResult``; ``output_text`` is left empty for the frontend to decode (the engine
    thread never touches the tokenizer)."""
    clock = request.clock
    clock.mark("end")
    extra = dict(request.extra)
    extra.update({  # where TTFT went: tokenize | chunk + hash + lookup | assembly + schedule + prefill
        "tokenize_ms": clock.ms("start", "tokenized"), "lookup_ms": clock.ms("tokenized", "looked_up"),
        "assemble_ms": clock.ms("looked_up", "assembled"), "prefill_ms": clock.ms("assembled", "first"),
    })  # fmt: skip
    return build_result(
        tokenizer=None, mode=request.mode, ids=request.ids, decoded=DecodeOutput(request.tokens,
        request.decode_seconds), first_logits=request.first_logits, clock=clock, counts=request.counts,
        num_layers=engine.layers, store_ms=clock.ms("decoded", "stored"), keep_logits=request.keep_logits, extra=extra,
    )  # fmt: skip


def new_table(engine: Any) -> BlockTable:
    return BlockTable(engine.pool)
