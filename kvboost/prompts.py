"""Prompt input: text, chat messages or token ids -> text to tokenize, or validated token ids.

One validation for every entry point (``generate``, ``warm``, the HF baselines): an empty prompt, a prompt
over the context, token ids outside the vocabulary (negative ids would break hashing; out-of-range ids hit a
device-side assert on CUDA), ``bytes`` passed as ids and other wrong types all get a clear ``PromptError``
before any compute or cache change.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Union

import torch

Prompt = Union[str, Sequence[Mapping[str, str]], Sequence[int]]


class PromptError(ValueError):
    """The prompt cannot be served (empty, too long, wrong type); the message says why."""


def _is_integer(value: Any) -> bool:
    # numbers.Integral covers int and numpy integer scalars; bool is an int subclass but never a token id.
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_token_ids(prompt: Any) -> list[int] | None:
    """``prompt`` as a list of Python ints if it is a sequence of token ids (list, tuple, 1-D numpy array or
    torch tensor of integers), else None. ``bytes``/``bytearray`` are refused: they are not token ids."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise PromptError(
            f"{type(prompt).__name__} is not a prompt: pass text (str, decode bytes first), chat messages or a "
            "list of token ids"
        )
    if isinstance(prompt, (str, Mapping)):
        return None
    dtype = getattr(prompt, "dtype", None)
    if dtype is not None and hasattr(prompt, "tolist"):  # numpy array or torch tensor
        if getattr(prompt, "ndim", 1) != 1:
            raise PromptError(f"token ids must be 1-D, got shape {tuple(prompt.shape)}")
        if isinstance(dtype, torch.dtype):
            is_int = not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)
        else:  # numpy
            is_int = getattr(dtype, "kind", None) in ("i", "u")
        if not is_int:
            raise PromptError(f"token ids must be integers, got dtype {dtype}")
        return [int(t) for t in prompt.tolist()]
    if isinstance(prompt, Sequence) and len(prompt) and all(_is_integer(t) for t in prompt):
        return [int(t) for t in prompt]
    return None


def prompt_text_or_ids(tokenizer: Any, prompt: Prompt, *, chat: bool = False) -> str | list[int]:
    """What to tokenize: the text of ``prompt`` (chat messages rendered with the chat template and the
    generation prompt; a string as is, or as one user message when ``chat``), or its token ids."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptError("empty prompt: give some text, chat messages or token ids")
        if chat:
            return prompt_text_or_ids(tokenizer, [{"role": "user", "content": prompt}])
        return prompt
    ids = as_token_ids(prompt)
    if ids is not None:
        return ids
    if isinstance(prompt, Sequence) and len(prompt) == 0:
        raise PromptError("empty prompt: give some text, chat messages or token ids")
    if isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
        for m in prompt:
            if "role" not in m or "content" not in m:
                raise PromptError(f"chat messages need 'role' and 'content', got keys {sorted(m)}")
        text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)
        if not isinstance(text, str):
            raise PromptError(f"the tokenizer's chat template returned {type(text).__name__}, not text")
        return text
    raise PromptError(
        f"unsupported prompt type {type(prompt).__name__}: use a string, a list of chat messages or a list of token ids"
    )


def tokenize_prompt(tokenizer: Any, prompt: Prompt, *, chat: bool = False) -> list[int]:
    """Token ids of ``prompt`` tokenized as a whole (no special tokens added); see ``prompt_text_or_ids``."""
    what = prompt_text_or_ids(tokenizer, prompt, chat=chat)
    if isinstance(what, list):
        return what
    return [int(t) for t in tokenizer(what, add_special_tokens=False)["input_ids"]]


def check_token_ids(ids: Sequence[int], vocab_size: int | None) -> None:
    """Refuse ids outside ``[0, vocab_size)``."""
    if vocab_size is None:
        return
    bad = [t for t in ids if t < 0 or t >= vocab_size]
    if bad:
        raise PromptError(f"token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}")


def check_length(num_tokens: int, max_positions: int | None, *, need_answer_room: bool = True) -> None:
    """Refuse prompts the model cannot take (before any compute)."""
    if num_tokens == 0:
        raise PromptError("empty prompt: it tokenized to zero tokens")
    limit = max_positions - 1 if need_answer_room and max_positions is not None else max_positions
    if limit is not None and num_tokens > limit:
        room = " (at least one position is needed for the answer)" if need_answer_room else ""
        raise PromptError(
            f"prompt of {num_tokens} tokens does not fit the model's context of {max_positions} tokens{room}; shorten it"
        )
