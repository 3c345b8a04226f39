"""Token selection and the decode loop, shared by the engine and the HF baselines of the runner.

A request's logits go through, in vLLM's order: ``logit_bias`` (added), ``min_tokens`` (its stop tokens forbidden
before that many tokens), ``repetition_penalty`` (over prompt + answer, as HF's and vLLM's), ``frequency_penalty`` /
``presence_penalty`` (over the answer, OpenAI's formula), then temperature, ``top_k``, ``min_p``, ``top_p``. Every
step of greedy decoding takes the argmax after the first four (a penalty changes greedy answers too). Where HF
transformers has the processor (``RepetitionPenaltyLogitsProcessor``, ``MinNewTokensLengthLogitsProcessor``,
``SequenceBiasLogitsProcessor``, ``MinPLogitsWarper``) it is used; OpenAI's penalties are :func:`openai_penalties`.
A request whose fields are all neutral (:attr:`Sampling.processed` False) does none of this work: plain greedy rows
stay one batched argmax.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)


class TokenHistory:
    """What a request's penalties look at: its prompt ids and the list its generated tokens are appended to (the
    request's own list, read at each step, so a preempted and resumed request sees the same tokens). Holds the HF
    processors built for the request (some cache a per-vocabulary tensor on their first call)."""

    def __init__(self, prompt: list[int], output: list[int], eos_ids: set[int] = frozenset()) -> None:
        self.prompt, self.output, self.eos_ids = prompt, output, set(eos_ids)  # eos_ids: the model's, for min_tokens
        self.cache: dict[str, Any] = {}


def openai_penalties(logits: torch.Tensor, output: list[int], frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's documented penalties over the tokens generated so far (``output``):
    ``logit[t] -= count[t] * frequency + (count[t] > 0) * presence`` (the prompt does not count)."""
    if not output or (frequency == 0 and presence == 0):
        return logits
    counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=logits.shape[-1])
    counts = counts[: logits.shape[-1]].to(logits.dtype)
    return logits - counts * frequency - (counts > 0).to(logits.dtype) * presence


@dataclass(frozen=True)
class Sampling:
    """Greedy when ``do_sample`` is False; otherwise temperature sampling from ``generator``, restricted to the
    ``top_k`` most likely tokens (0: all), to those at least ``min_p`` times as likely as the likeliest, and to the
    smallest set whose probability reaches ``top_p``.

    Logit processors (see the module docstring; neutral values by default): ``frequency_penalty`` and
    ``presence_penalty`` (OpenAI's), ``repetition_penalty`` (> 0; 1 off), ``logit_bias`` ((token id, bias) pairs),
    ``min_tokens`` (the stop tokens are forbidden before this many generated tokens). The stop rule:
    ``stop_token_ids`` end the answer as end-of-sequence does; ``ignore_eos`` makes the model's end-of-sequence
    tokens ordinary ones (:meth:`stop_ids`). ``history`` (per request: prompt and generated tokens) is needed when a
    penalty or ``min_tokens`` is set."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    history: TokenHistory | None = field(default=None, compare=False, repr=False)
    #: whether the logits need any processing before the greedy argmax (False: the batched argmax fast path);
    #: computed once, as the decode step reads it for every row
    processed: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.do_sample and not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        object.__setattr__(self, "processed", bool(self.frequency_penalty or self.presence_penalty or self.logit_bias
                                                   or self.repetition_penalty != 1 or self.min_tokens))  # fmt: skip

    @property
    def greedy(self) -> bool:
        # A temperature this small is greedy in all but name; dividing by it would overflow to inf and NaN.
        return not self.do_sample or self.temperature < 1e-5

    def stop_ids(self, eos_ids: set[int]) -> set[int]:
        """The tokens that end this request's answer: the model's ``eos_ids`` (none with ``ignore_eos``) and the
        request's ``stop_token_ids``."""
        if not self.stop_token_ids and not self.ignore_eos:
            return eos_ids
        return set(self.stop_token_ids) | (set() if self.ignore_eos else eos_ids)

    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [vocab] after ``logit_bias``, ``min_tokens`` and the penalties (fp32; unchanged when none
        is set)."""
        if not self.processed:
            return logits
        history = self.history
        if history is None and (self.min_tokens or self.repetition_penalty != 1 or self.frequency_penalty
                                or self.presence_penalty):  # fmt: skip
            raise ValueError("penalties and min_tokens need the request's token history (Sampling.history)")
        scores = logits.float().unsqueeze(0)
        cache = history.cache if history is not None else {}
        ids = None
        if history is not None and (self.min_tokens or self.repetition_penalty != 1):
            ids = torch.tensor([history.prompt + history.output], device=scores.device)
        if self.logit_bias:
            if "bias" not in cache:
                cache["bias"] = SequenceBiasLogitsProcessor([[[t], b] for t, b in self.logit_bias])
            scores = cache["bias"](ids if ids is not None else torch.zeros(1, 1, dtype=torch.long), scores)
        if self.min_tokens and len(history.output) < self.min_tokens:  # type: ignore[union-attr]
            stops = sorted(self.stop_ids(history.eos_ids))  # type: ignore[union-attr]
            if stops:
                scores = MinNewTokensLengthLogitsProcessor(len(history.prompt), self.min_tokens, stops,  # type: ignore
                                                           device=scores.device)(ids, scores)  # fmt: skip
        if self.repetition_penalty != 1:
            scores = RepetitionPenaltyLogitsProcessor(self.repetition_penalty)(ids, scores)
        if history is not None:
            scores = openai_penalties(scores, history.output, self.frequency_penalty, self.presence_penalty)
        return scores[0]


def pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> int:
    """Next token id from last-position ``logits`` [vocab], after the request's logit processors."""
    logits = sampling.process(logits)
    if sampling.greedy:
        return int(torch.argmax(logits).item())
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.numel():
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if sampling.min_p > 0:
        scores = MinPLogitsWarper(sampling.min_p)(None, scores.unsqueeze(0))[0]
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
    greedy = [i for i, s in enumerate(samplings) if s.greedy and not s.processed]
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
