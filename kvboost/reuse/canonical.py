"""Chat reuse that survives re-tokenization: store a finished answer as the next turn's prompt will tokenize it.

A chat's next prompt holds the answer as *text* (decoded, then rendered by the chat template and tokenized with
the rest of the prompt). Those ids often differ from the ones the model generated: BPE merges the decoded text
otherwise (``1.`` generated as ``1`` + ``.`` comes back as one token, a space joins the next word...), and the
end-of-turn markup after the answer was never fed at all. A prefix cache keyed by token ids then stops at the
first such difference and recomputes the rest of the history (two-turn chat on SmolLM2: 45 of 96 tokens reused).

:func:`canonical_turn` predicts the next turn's ids of the history: the request's chat messages plus the answer
text rendered by the template up to and including its end-of-turn markup (:func:`kvboost.prompts.answered_turn_text`),
tokenized by the chunker. The frontend (``kvboost.engine.frontend.canonical_store_request``) then submits a
``store`` request of those ids to the engine core: its lookup finds the request's own rows (stored when it finished)
up to the longest common prefix, the differing suffix is prefilled on top of them, exactly as a cold prefill of the
next prompt computes it (causal attention: a row depends on the rows before it only), and the chunks are stored
under their prefix-chained keys beside the generated ones. It runs after the request finished (its result and
timings are complete), not inside any request's TTFT.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvboost.cache.sequence_store import common_prefix_length
from kvboost.prompts import answered_turn_text
from kvboost.types import ChunkSpan


@dataclass
class CanonicalTurn:
    """The next turn's ids of a finished chat request's history, and how they relate to what was generated."""

    ids: list[int]  # the history as the next prompt tokenizes it (through the end-of-turn markup)
    spans: list[ChunkSpan]
    shared: int  # leading ids equal to the generated sequence's (their KV is the request's own rows)


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
