"""Prompt input: text, chat messages or token ids -> validated token ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

Prompt = Union[str, Sequence[Mapping[str, str]], Sequence[int]]


class PromptError(ValueError):
    """The prompt cannot be served (empty, too long, wrong type); the message says why."""


def tokenize_prompt(tokenizer: Any, prompt: Prompt, *, chat: bool = False) -> list[int]:
    """Token ids of ``prompt``.

    - ``str``: tokenized as is (no special tokens added), or wrapped as one user message in the chat
      template when ``chat=True``;
    - a list of ``{"role", "content"}`` messages: the chat template with the generation prompt;
    - a list of ints: used as token ids.
    """
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptError("empty prompt: give some text, chat messages or token ids")
        if chat:
            return tokenize_prompt(tokenizer, [{"role": "user", "content": prompt}])
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if isinstance(prompt, Sequence) and len(prompt) == 0:
        raise PromptError("empty prompt: give some text, chat messages or token ids")
    if isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
        for m in prompt:
            if "role" not in m or "content" not in m:
                raise PromptError(f"chat messages need 'role' and 'content', got keys {sorted(m)}")
        encoded = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if isinstance(encoded, Mapping) or hasattr(encoded, "keys") else encoded
        return [int(t) for t in ids]
    if isinstance(prompt, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise PromptError(
        f"unsupported prompt type {type(prompt).__name__}: use a string, a list of chat messages or a list of token ids"
    )


def check_length(num_tokens: int, max_positions: int | None, vocab_size: int | None = None, ids: Sequence[int] = ()) -> None:
    """Refuse prompts the model cannot take (before any compute)."""
    if num_tokens == 0:
        raise PromptError("empty prompt: it tokenized to zero tokens")
    if max_positions is not None and num_tokens >= max_positions:
        raise PromptError(
            f"prompt of {num_tokens} tokens does not fit the model's context of {max_positions} tokens "
            "(at least one position is needed for the answer); shorten it"
        )
    if vocab_size is not None and ids:
        bad = [t for t in ids if t < 0 or t >= vocab_size]
        if bad:
            raise PromptError(f"token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}")
