"""Token selection and the decode loop, shared by the engine and the HF baselines of the runner."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Sampling:
    """Greedy when ``do_sample`` is False; otherwise temperature sampling from ``generator``, restricted to the
    ``top_k`` most likely tokens (0: all) and to the smallest set whose probability reaches ``top_p``."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")


def pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> int:
    """Next token id from last-position ``logits`` [vocab]."""
    # A temperature this small is greedy in all but name; dividing by it would overflow to inf and NaN.
    if not sampling.do_sample or sampling.temperature < 1e-5:
        return int(torch.argmax(logits).item())
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.numel():
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if sampling.top_p < 1.0:
        # nucleus: keep the most likely tokens until their mass reaches top_p (the token that crosses it included;
        # the most likely one always)
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= sampling.top_p
        outside[0] = False
        probs = probs.scatter(-1, order, sorted_probs.masked_fill(outside, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator).item())


def pick_tokens(logits: torch.Tensor, samplings: list[Sampling],
                generators: list[torch.Generator | None]) -> list[int]:  # fmt: skip
    """``pick_token`` for each row of ``logits`` [rows, vocab]: the greedy rows with one argmax and one device
    sync for all of them (a ``.item()`` per row is a sync per row on CUDA), sampled rows with their own generator."""
    out: list[int | None] = [None] * len(samplings)
    greedy = [i for i, s in enumerate(samplings) if not s.do_sample or s.temperature < 1e-5]
    if greedy:
        rows = torch.argmax(logits[greedy] if len(greedy) < len(samplings) else logits, dim=-1).tolist()
        for i, token in zip(greedy, rows, strict=True):
            out[i] = int(token)
    for i, sampling in enumerate(samplings):
        if out[i] is None:
            out[i] = pick_token(logits[i], sampling, generators[i])
    return out  # type: ignore[return-value]


def stop_reason(tokens: list[int], *, max_new_tokens: int, eos_ids: set[int], prompt_len: int,
                max_positions: int | None) -> str | None:  # fmt: skip
    """The one stop rule of every decode (the engine core, speculative verification, the HF baselines): after the
    generated ``tokens``, ``"stop"`` at an end-of-sequence token, ``"length"`` at ``max_new_tokens`` or at the model's
    context (``prompt_len + len(tokens) >= max_positions``), else None (go on). Stop strings are the frontend's
    (``kvboost.engine.frontend``): they need text."""
    if tokens and tokens[-1] in eos_ids:
        return "stop"
    if len(tokens) >= max_new_tokens or (max_positions is not None and prompt_len + len(tokens) >= max_positions):
        return "length"
    return None


def cut_at_stop(tokens: list[int], eos_ids: set[int]) -> list[int]:
    """``tokens`` up to and including the first end-of-sequence token (several accepted at once: speculation)."""
    for i, token in enumerate(tokens):
        if token in eos_ids:
            return tokens[: i + 1]
    return tokens


@dataclass
class DecodeOutput:
    token_ids: list[int]  # first token included
    decode_seconds: float  # time after the first token


def decode_loop(
    forward,
    first_token: int,
    *,
    max_new_tokens: int,
    eos_ids: set[int],
    sampling: Sampling,
    generator: torch.Generator | None = None,
    max_total_tokens: int | None = None,
    tokens_so_far: int = 0,
) -> DecodeOutput:
    """Generate after ``first_token`` until EOS, ``max_new_tokens`` or the context end.

    ``forward(token_id) -> logits`` runs one step with the caller's cache. ``tokens_so_far`` is the
    number of tokens in that cache before the first token is fed (the prompt length).
    """
    tokens = [first_token]
    start = time.perf_counter()
    while stop_reason(tokens, max_new_tokens=max_new_tokens, eos_ids=eos_ids, prompt_len=tokens_so_far,
                      max_positions=max_total_tokens) is None:  # fmt: skip
        logits = forward(tokens[-1])
        tokens.append(pick_token(logits, sampling, generator))
    return DecodeOutput(tokens, time.perf_counter() - start)


def eos_token_ids(model, tokenizer) -> set[int]:
    """EOS ids from the generation config (may be a list) and the tokenizer."""
    ids: set[int] = set()
    for source in (getattr(getattr(model, "generation_config", None), "eos_token_id", None), tokenizer.eos_token_id):
        if source is None:
            continue
        ids.update(source if isinstance(source, (list, tuple, set)) else [source])
    return {int(i) for i in ids}


def per_row(value: Any, rows: int, name: str) -> list[Any]:
    """A per-row setting of ``generate_batch``: a list of one value per row, or one value for every row."""
    if isinstance(value, (list, tuple)):
        if len(value) != rows:
            raise ValueError(f"{name} gives {len(value)} values for {rows} prompts")
        return list(value)
    return [value] * rows
