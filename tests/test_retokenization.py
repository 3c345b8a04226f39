"""Chat reuse that survives re-tokenization (``store_canonical``, ``kvboost.reuse.canonical``).

A next chat turn holds the answer as text, re-tokenized with the template's end-of-turn markup after it. After a
chat request finished, the engine stores the KV of those ids too (prefilled on top of the shared prefix), so the
next turn reuses its whole history; the reused KV is what a cold prefill of the next prompt computes (fp32).

The toy tokenizers tokenize one character per id; ``ScramblingTokenizer`` decodes an id to a character whose id is
another one, so a generated answer re-tokenizes to other ids at every position (the worst case of BPE merging the
decoded text otherwise), deterministically whatever the random model generates.
"""

from __future__ import annotations

import pytest
import torch
from kvboost_testkit.tiny import ToyTokenizer, tiny_model

from kvboost import KVBoost
from kvboost.engine import SamplingParams
from kvboost.prompts import answered_turn_text
from kvboost.quality import reuse_logit_bound

CHUNK = 16
QUESTION = [{"role": "user", "content": "Name three fruits, please, as a list."}]
FOLLOW_UP = {"role": "user", "content": "And three vegetables?"}


class ScramblingTokenizer(ToyTokenizer):
    """Decodes id ``i`` to a printable character whose id is not ``i`` (so re-tokenized answers differ)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(35 + (7 * i) % 90) for i in ids)


def make(tokenizer, **options) -> KVBoost:
    model = tiny_model("llama")
    return KVBoost(model, tokenizer, model_identity="tiny-llama", chunker={"name": "fixed", "chunk_size": CHUNK},
                   **options)  # fmt: skip


def two_turns(engine, max_new=21):
    """Turn 1, then turn 2 with turn 1's answer text in its history; (r1, r2, ids of the answered history)."""
    r1 = engine.generate(QUESTION, max_new_tokens=max_new)
    history = [*QUESTION, {"role": "assistant", "content": r1.output_text}]
    turn_ids = engine.tokenize_with_spans(answered_turn_text(engine.tokenizer, QUESTION, r1.output_text))[0]
    r2 = engine.generate([*history, FOLLOW_UP], max_new_tokens=8)
    return r1, r2, turn_ids, [*history, FOLLOW_UP]


@pytest.mark.parametrize("tokenizer", [ToyTokenizer, ScramblingTokenizer])
def test_next_turn_reuses_the_whole_answered_history(tokenizer):
    engine = make(tokenizer())
    try:
        r1, r2, turn_ids, _ = two_turns(engine)
        assert r2.prompt_ids[: len(turn_ids)] == turn_ids  # the history is a prefix of the next prompt
        # the answer as re-tokenized and the end-of-turn markup after it: every history token is a hit
        assert r2.cached_tokens == len(turn_ids)
        assert r1.extra["canonical_prefill_tokens"] > 0
        assert r1.extra["canonical_chunks_stored"] >= 1
    finally:
        engine.close()


def test_without_the_canonical_store_reuse_stops_at_the_first_retokenized_token():
    """The 'before' arm (and what a mutant that skips the canonical store gives): the generated ids miss."""
    engine = make(ScramblingTokenizer(), store_canonical=False)
    try:
        r1, r2, turn_ids, _ = two_turns(engine)
        assert "canonical_prefill_tokens" not in r1.extra
        assert r2.cached_tokens <= len(r1.prompt_ids) + 1 < len(turn_ids)
    finally:
        engine.close()


@pytest.mark.parametrize("tokenizer", [ToyTokenizer, ScramblingTokenizer])
def test_reused_canonical_kv_equals_a_cold_prefill(tokenizer):
    engine = make(tokenizer())
    try:
        _, r2, turn_ids, prompt2 = two_turns(engine)
        assert r2.cached_tokens == len(turn_ids)
        cold = engine.generate(prompt2, max_new_tokens=8, mode="cold")
        assert r2.output_ids == cold.output_ids
        assert float((r2.first_token_logits - cold.first_token_logits).abs().max()) <= 1e-4
    finally:
        engine.close()


def test_canonical_kv_rows_equal_a_cold_prefill_row_by_row():
    """The stored rows themselves (right after turn 1: no later prompt stored them), not only the logits."""
    from kvboost.lookup import lookup

    engine = make(ScramblingTokenizer())
    try:
        r1 = engine.generate(QUESTION, max_new_tokens=21)
        turn_ids = engine.tokenize_with_spans(answered_turn_text(engine.tokenizer, QUESTION, r1.output_text))[0]

        spans = engine.chunker.split(turn_ids)
        keys = engine.hasher.chunk_keys(turn_ids, spans, engine.fingerprint, "")
        plan = lookup(turn_ids, spans, keys, engine.store, engine.quantizer, content=False)
        assert plan.exact_prefix == len(turn_ids)
        stored_k = torch.cat([p.payload.materialize(p.end - p.start)[0] for p in plan.placements], dim=2)
        model = engine.model
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([turn_ids]), use_cache=True)
        cold_k = torch.stack([layer.keys[0] for layer in out.past_key_values.layers])  # [layers, heads, n, dim]
        assert stored_k.shape == cold_k.shape
        assert float((stored_k.float() - cold_k.float()).abs().max()) <= 1e-4
    finally:
        engine.close()


def test_no_canonical_store_for_raw_text_ids_or_stored_nothing():
    engine = make(ScramblingTokenizer())
    try:
        r = engine.generate("raw text, no template", max_new_tokens=5)  # the toy tokenizer has no chat_template
        assert not any(k.startswith("canonical") for k in r.extra)
        r = engine.generate(list(range(40, 70)), max_new_tokens=5)
        assert not any(k.startswith("canonical") for k in r.extra)
        r = engine.generate(QUESTION, max_new_tokens=5, store=False)
        assert not any(k.startswith("canonical") for k in r.extra)
    finally:
        engine.close()
    off = make(ScramblingTokenizer(), store_generated=False)  # no answer KV stored at all, canonical included
    try:
        assert not any(k.startswith("canonical") for k in off.generate(QUESTION, max_new_tokens=5).extra)
    finally:
        off.close()


def test_batch_and_request_loop_store_every_finished_chat():
    engine = make(ScramblingTokenizer())
    try:
        other = [{"role": "user", "content": "Something else entirely, longer than one chunk."}]
        rows = engine.generate_batch([QUESTION, other], max_new_tokens=9)
        assert all(r.extra["canonical_prefill_tokens"] > 0 for r in rows)
        # the request loop (the server's path): stored after the step that finished it
        third = [{"role": "user", "content": "A third conversation, served by add_request."}]
        handle = engine.add_request(third, SamplingParams(max_tokens=7))
        while engine.core.has_work():
            engine.step()
        answer = engine.tokenizer.decode(handle._request.tokens)
        turn_ids = engine.tokenize_with_spans(answered_turn_text(engine.tokenizer, third, answer))[0]
        r = engine.generate([*third, {"role": "assistant", "content": answer}, FOLLOW_UP], max_new_tokens=2)
        assert r.cached_tokens == len(turn_ids)
    finally:
        engine.close()


def test_blocks_go_back():
    """The scratch tables of the canonical prefills give their blocks back: after the cache is dropped, the pool
    is as free as before."""
    engine = make(ScramblingTokenizer())
    try:
        free0 = engine.pool.num_free
        two_turns(engine)
        engine.reset_cache()
        assert engine.pool.num_free == free0
    finally:
        engine.close()


@pytest.mark.integration
def test_two_turn_chat_on_the_bundled_model_reuses_the_whole_history():
    """The issue's case: turn 2 of a chat on SmolLM2 reused only the tokens before the first re-tokenized one."""
    engine = KVBoost.from_pretrained(dtype="float32")
    try:
        q = [{"role": "user", "content": "Give me three tips for writing clear Python code, as a numbered list."}]
        r1 = engine.generate(q, max_new_tokens=48)
        turn = answered_turn_text(engine.tokenizer, q, r1.output_text)
        turn_ids = engine.tokenize_with_spans(turn)[0]
        prompt2 = [*q, {"role": "assistant", "content": r1.output_text}, {"role": "user", "content": "One more."}]
        r2 = engine.generate(prompt2, max_new_tokens=12)
        assert r2.cached_tokens >= len(turn_ids)
        cold = engine.generate(prompt2, max_new_tokens=12, mode="cold")
        assert r2.output_ids == cold.output_ids
        # Turn 1's answer is reused from the rows the decode step wrote. A dense decode writes a prefill's rows up to
        # fp32 rounding; the bundled model's CPU default in fp32 (the 4-bit step for prompt and decode rows) writes
        # them bit for bit (bound 0: kvboost.quality.reuse_is_bit_exact); a decode step beside a dense prefill
        # agrees less closely (INT16_DECODE_LOGIT_DRIFT).
        bound = reuse_logit_bound(engine, over_generated_rows=True)
        assert float((r2.first_token_logits - cold.first_token_logits).abs().max()) <= bound
    finally:
        engine.close()
