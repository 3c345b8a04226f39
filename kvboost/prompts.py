"""Prompt input: text, chat messages or token ids -> text to tokenize, or validated token ids.

Plain strings and chat models (``chat``): ``None`` (auto, the engine's default) renders a plain string as one user
message in the tokenizer's chat template when the tokenizer has one and the string does not already hold the
template's markup (its special tokens, e.g. ``<|im_start|>``: a prompt rendered by the caller stays as it is);
``True`` always renders it; ``False`` keeps it raw (a completion: the OpenAI ``/v1/completions`` semantics).
``warm`` follows the same setting: where ``generate`` would render a plain string, ``warm`` stores the start of
that rendering up to the end of the text (``open_user_turn``), so ``warm(system) ; generate(system + question)``
reuses the warmed tokens either way. An instruct model given raw text mostly answers end-of-sequence at once (an empty answer), hence the
default. Chat messages are always rendered, token ids never.

One validation for every entry point (``generate``, ``warm``, the HF baselines): an empty prompt, a prompt
over the context, token ids outside the vocabulary (negative ids would break hashing; out-of-range ids hit a
device-side assert on CUDA), ``bytes`` passed as ids and other wrong types all get a clear ``PromptError``
before any compute or cache change.
"""

from __future__ import annotations

import numbers
import weakref
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


#: tokenizer -> the special tokens its chat template writes (computed once per tokenizer)
_MARKERS: weakref.WeakKeyDictionary[Any, tuple[str, ...]] = weakref.WeakKeyDictionary()


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` renders chat messages with a template of its own (HF ``chat_template``)."""
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def template_markers(tokenizer: Any) -> tuple[str, ...]:
    """The special tokens the tokenizer's chat template writes around a message (``<|im_start|>``...): text that
    holds one of them was rendered by a template already."""
    try:
        return _MARKERS[tokenizer]
    except (KeyError, TypeError):
        pass
    markers: tuple[str, ...] = ()
    if has_chat_template(tokenizer):
        try:
            probe = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                                  tokenize=False)  # fmt: skip
        except Exception:  # a template that needs more than one user message: nothing to detect with
            probe = ""
        special = [t for t in (getattr(tokenizer, "all_special_tokens", None) or []) if isinstance(t, str) and t]
        markers = tuple(t for t in special if isinstance(probe, str) and t in probe)
    try:
        _MARKERS[tokenizer] = markers
    except TypeError:  # not weak-referenceable: computed again next time
        pass
    return markers


def wants_chat(tokenizer: Any, text: str, chat: bool | None) -> bool:
    """Whether a plain string is rendered as one user message: ``chat`` when given, else (auto) when the tokenizer
    has a chat template and ``text`` holds none of the template's markup."""
    if chat is not None:
        return bool(chat)
    if not has_chat_template(tokenizer):
        return False
    return not any(marker in text for marker in template_markers(tokenizer))


def chat_messages(tokenizer: Any, prompt: Prompt, *, chat: bool | None = None) -> list[dict[str, str]] | None:
    """The chat messages ``prompt`` is rendered from (a plain string as one user message when ``wants_chat``), or
    None (raw text, token ids, anything else)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}] if prompt.strip() and wants_chat(tokenizer, prompt, chat) else None
    if (
        isinstance(prompt, Sequence)
        and len(prompt)
        and all(isinstance(m, Mapping) and "role" in m and "content" in m for m in prompt)
    ):
        return [dict(m) for m in prompt]
    return None


def open_user_turn(tokenizer: Any, text: str) -> str | None:
    """The chat template's rendering of one user message that starts with ``text``, cut right after ``text``: what
    ``generate(text + more)`` tokenizes first when it renders a plain string (the default system prompt and the
    user header included). ``warm`` stores this so that a warmed prefix is an exact hit for prompts that extend
    it. None when the template cannot be cut there (it rewrites the content, or renders nothing around it)."""
    if not has_chat_template(tokenizer):
        return None
    sentinel = "\u2063kvboost-open-turn\u2063"  # invisible separator: no template writes it
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text + sentinel}],
                                                 add_generation_prompt=True, tokenize=False)  # fmt: skip
    except Exception:
        return None
    if not isinstance(rendered, str) or rendered.count(sentinel) != 1:
        return None
    head = rendered[: rendered.index(sentinel)]
    return head if head.endswith(text) and len(head) > len(text) else None


def answered_turn_text(tokenizer: Any, messages: Sequence[Mapping[str, str]], answer: str) -> str | None:
    """The text a next chat turn starts with: ``messages`` and the assistant's ``answer`` rendered by the chat
    template, up to and including the end-of-turn markup after the answer (no generation prompt). None when the
    template cannot render it or the rendering does not continue the prompt's own text (a template that rewrites
    earlier turns: nothing a next prompt would share can be predicted)."""
    try:
        prompt = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        turn = tokenizer.apply_chat_template([*messages, {"role": "assistant", "content": answer}],
                                             add_generation_prompt=False, tokenize=False)  # fmt: skip
    except Exception:
        return None
    if not isinstance(prompt, str) or not isinstance(turn, str) or not turn.startswith(prompt) or turn == prompt:
        return None
    return turn


def prompt_text_or_ids(tokenizer: Any, prompt: Prompt, *, chat: bool | None = None) -> str | list[int]:
    """What to tokenize: the text of ``prompt`` (chat messages rendered with the chat template and the
    generation prompt; a string as one user message or as is, by ``chat``: see ``wants_chat``), or its token ids."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise PromptError("empty prompt: give some text, chat messages or token ids")
        if wants_chat(tokenizer, prompt, chat):
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


def tokenize_prompt(tokenizer: Any, prompt: Prompt, *, chat: bool | None = False) -> list[int]:
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
