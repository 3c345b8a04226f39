"""A request's steps through the engine: memory check, lookup, prefill of a plan with content hits, first token,
speculative decoding, storing and the result. The scheduler (:mod:`kvboost.serving.core`), which serves
``generate``, ``generate_batch`` and the HTTP server, calls these; ``warm`` is here too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from kvboost.cache.pooled import PooledKV
from kvboost.cache.sequence_store import store_sequence
from kvboost.decoding import DecodeOutput, pick_token
from kvboost.generation import PhaseClock, build_result
from kvboost.kv.block_table import BlockTable
from kvboost.lookup import lookup
from kvboost.plan import ReusePlan
from kvboost.prompts import (
    Prompt,
    PromptError,
    check_length,
    check_token_ids,
    open_user_turn,
    prompt_text_or_ids,
    wants_chat,
)
from kvboost.quality import continuation_logprob
from kvboost.reuse.assemble import assemble_exact
from kvboost.reuse.prefill import ReuseContext, run_prefill
from kvboost.runtime.batch import ForwardBatch, SeqInput
from kvboost.runtime.sequences import Request
from kvboost.types import ChunkSpan, GenerationResult, WarmResult

#: ``generate(mode=...)``: ``reuse`` reads (exact and content hits) and writes the cache; ``prefix`` reads exact
#: (prefix-chained) hits only and writes; ``cold`` runs the same engine path (tokenizer, pool, runner, attention
#: backend) with the cache neither read nor written. (``kvboost.engine.GenerationMode`` names them as the original
#: API did: CHUNK_KV_REUSE, PREFIX_CACHE, BASELINE.)
MODES = ("reuse", "prefix", "cold")


def check_memory(engine: Any, rows: int) -> None:
    """Refuse a request whose KV cannot fit, with the numbers, before any compute."""
    need = rows * engine.pool.row_bytes
    if engine.max_kv_bytes is not None and need > engine.max_kv_bytes:
        raise PromptError(f"the KV for {rows} tokens (prompt + max_new_tokens) needs {need / 2**20:.1f} MiB, more "
                          f"than max_kv_bytes ({engine.max_kv_bytes / 2**20:.1f} MiB); lower max_new_tokens or "
                          "shorten the prompt")  # fmt: skip
    if engine.pool.blocks_for(rows) + 1 > engine.pool.num_blocks:
        raise PromptError(f"the KV for {rows} tokens (prompt + max_new_tokens) needs {need / 2**20:.1f} MiB, more "
                          f"than the KV pool holds ({engine.pool.num_blocks * engine.pool.block_bytes / 2**20:.1f} "
                          "MiB); raise kv.pool_bytes, lower max_new_tokens or shorten the prompt")  # fmt: skip


def plan_for(engine: Any, request: Request) -> ReusePlan:
    """The request's reuse plan (cold: nothing reused)."""
    if request.mode == "cold":
        return ReusePlan.cold(request.ids, request.spans)
    keys = engine.hasher.chunk_keys(request.ids, request.spans, engine.fingerprint, request.salt)
    return lookup(request.ids, request.spans, keys, engine.store, engine.quantizer, max_reuse=len(request.ids) - 1,
                  content=engine.rotator is not None and request.mode == "reuse")  # fmt: skip


def reuse_context(engine: Any) -> ReuseContext:
    """What a prefill needs from the engine."""
    scale = getattr(engine.runner, "scale", None)
    return ReuseContext(engine.runner, engine.quantizer, engine.recompute, engine.rotator, engine.layers, scale)


def prefill(engine: Any, request: Request, *, looked_up: bool = False) -> None:
    """Lookup, assembly, the schedule's forward, the first token (TTFT stops at its mark)."""
    if not looked_up:
        request.plan = plan_for(engine, request)
        request.clock.mark("looked_up")
    outcome = run_prefill(reuse_context(engine), request.plan, request.table, request.clock,
                          check_schedule=request.mode != "cold")  # fmt: skip
    first_token(engine, request, outcome.logits, outcome.counts, outcome.approx_from)


def first_token(engine: Any, request: Request, logits: torch.Tensor, counts: Any, approx_from: int | None) -> None:
    request.first_logits, request.counts, request.approx_from = logits, counts, approx_from
    first = pick_token(logits, request.sampling, request.generator)
    request.clock.mark("first")
    request.start_decoding()
    request.accept(first, engine.eos_ids, engine.adapter.max_positions)


def decode_speculatively(engine: Any, request: Request) -> None:
    """Decode after the first token with the draft strategy (``kvboost.speculative.verify``)."""
    from kvboost.speculative.verify import speculative_decode

    decoded, stats = speculative_decode(
        engine.speculative, prompt_ids=request.ids, first_token=request.tokens[0], table=request.table,
        runner=engine.runner, max_new_tokens=request.max_new_tokens, eos_ids=engine.eos_ids,
        sampling=request.sampling, generator=request.generator, max_total_tokens=engine.adapter.max_positions,
    )  # fmt: skip
    request.tokens = decoded.token_ids
    request.extra.update(stats.as_extra(engine.speculative.registry_name))
    request.finish_decoding()


def finish(engine: Any, request: Request, *, keep_logits: bool, score_ids: Sequence[int] | None = None) -> GenerationResult:
    """Store the sequence's new chunks (references to its blocks, or copies), score a known answer, and
    build the result."""
    clock, ids, n = request.clock, request.ids, request.prompt_len
    clock.mark("decoded")
    if request.mode != "cold" and request.store:
        seq = (ids + (request.tokens[:-1] if engine.store_generated else []))[: request.table.length]
        store_sequence_of(engine, seq, request.spans, request.table, approx_from=request.approx_from, salt=request.salt)
    clock.mark("end")
    extra = dict(request.extra)
    if score_ids is not None:
        request.table.truncate(n)
        extra["answer_logprob"] = continuation_logprob(request.first_logits, list(score_ids), lambda toks: engine.runner.run(
            ForwardBatch.build([SeqInput(request.table, toks, logits=list(range(len(toks))))])))  # fmt: skip
    engine._requests += 1
    engine._prompt_tokens += n
    engine._cached_tokens += request.counts.cached_tokens
    extra.update({  # where TTFT went: tokenize | chunk + hash + lookup | assembly + schedule + prefill
        "tokenize_ms": clock.ms("start", "tokenized"), "lookup_ms": clock.ms("tokenized", "looked_up"),
        "assemble_ms": clock.ms("looked_up", "assembled"), "prefill_ms": clock.ms("assembled", "first"),
    })  # fmt: skip
    return build_result(
        tokenizer=engine.tokenizer, mode=request.mode, ids=ids, decoded=DecodeOutput(request.tokens,
        request.decode_seconds), first_logits=request.first_logits, clock=clock, counts=request.counts,
        num_layers=engine.layers, store_ms=clock.ms("decoded", "end"), keep_logits=keep_logits, extra=extra,
    )  # fmt: skip



def store_sequence_of(engine: Any, seq: list[int], spans: list[ChunkSpan], table: BlockTable, *, approx_from: int | None,
           salt: str = "", pin: bool = False) -> int:  # fmt: skip
    """Store ``seq``'s new chunks: references to ``table``'s blocks (memory tier, no quantizer) or the
    quantizer's payload of a copy of the rows."""
    pool = engine.pool

    def payload_of(start: int, end: int) -> Any:
        if engine._pooled_entries:
            first, last = start // pool.block_size, (end - 1) // pool.block_size
            return PooledKV(pool, table.blocks[first : last + 1], start, end - start)
        return engine.quantizer.quantize(*pool.read(table.slots(start, end)))

    return store_sequence(engine.store, chunker=engine.chunker, hasher=engine.hasher, fingerprint=engine.fingerprint,
                          seq=seq, spans=spans, payload_of=payload_of, approx_from=approx_from, salt=salt,
                          pin=pin)  # fmt: skip


def warm(engine: Any, text: Prompt, *, pin: bool = False, cache_salt: str = "", chat: bool | None = None) -> WarmResult:
    """``InferenceEngine.warm``: compute and store the KV of ``text`` from position 0 (no generation), reusing what
    is already cached; ``pin`` protects its entries from eviction. A plain string that ``generate`` would render
    in the chat template (``chat``, default the engine's) is stored as the start of that rendering
    (``open_user_turn``); otherwise as is."""
    clock = PhaseClock(engine.adapter.device)
    chat = engine.chat if chat is None else chat
    what: str | list[int] | None = None
    if isinstance(text, str) and text.strip() and wants_chat(engine.tokenizer, text, chat):
        what = open_user_turn(engine.tokenizer, text)
    if what is None:
        what = prompt_text_or_ids(engine.tokenizer, text, chat=False)
    ids, spans = engine.chunker.tokenize(engine.tokenizer, what) if isinstance(what, str) else (what, None)
    check_length(len(ids), engine.adapter.max_positions, need_answer_room=False)
    check_token_ids(ids, engine.vocab_size)
    spans = spans if spans is not None else engine.chunker.split(ids)
    n, stored = len(ids), 0
    with torch.inference_mode():
        keys = engine.hasher.chunk_keys(ids, spans, engine.fingerprint, cache_salt)
        plan = lookup(ids, spans, keys, engine.store, engine.quantizer, max_reuse=n, content=False)
        if plan.reused_tokens < n:
            table = BlockTable(engine.pool)
            try:
                assemble_exact(plan, table, engine.quantizer)
                engine.runner.run(ForwardBatch.build([SeqInput(table, ids[plan.exact_prefix :])]))
                stored = store_sequence_of(engine, ids, spans, table, approx_from=None, salt=cache_salt, pin=pin)
            finally:
                table.release()
        if pin:
            for key in keys:
                entry = engine.store.peek(key.prefix_key)
                if entry is not None and not entry.pinned:
                    entry.pinned = True
                    engine.store.put(entry)
    clock.mark("end")
    return WarmResult(prompt_tokens=n, chunks_stored=stored, tokens_stored=n - plan.reused_tokens,
                      already_cached_tokens=plan.reused_tokens, elapsed_ms=clock.ms("start", "end"))  # fmt: skip
