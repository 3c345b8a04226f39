"""ShareGPT multi-turn replay: real conversations, one request per turn, every mode on the same prompt.

Per turn t the prompt is the chat history (system prompt if any, then turns 1..t-1 as user/assistant
messages) plus the new user message, in the model's chat template with the generation prompt. The
history's assistant messages are the dataset's own (``history_source="dataset"``: the engine never saw
them, so only the earlier prompt is reusable) or the baseline's greedy answers
(``history_source="model"``: a real chat, where the answer's KV is reusable too). Using the baseline's
answer, not each mode's own, keeps every mode's prompts identical, so TTFTs compare like for like.

Order: ``interleave=false`` replays each conversation to its end before the next (one user at a time);
``interleave=true`` replays conversations in groups of ``users``, turn t of every conversation in the group
before turn t+1 of any, as a server sees concurrent users. A carried single cache (``hf_prefix``, llama.cpp's
one slot) loses its reuse then; a store keyed by content keeps it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvboost.lab.sharegpt_data import Conversation, load_conversations
from kvboost.lab.workloads import WORKLOADS
from kvboost.lab.workloads.base import Request, Workload, WorkloadEnv

HISTORY_SOURCES = ("dataset", "model")


@dataclass
class SharegptReplayConfig:
    num_conversations: int = 4
    max_turns: int = 4
    min_turns: int | None = None  # None = max_turns (every conversation reaches the last turn)
    max_new_tokens: int = 32
    seed: int = 0
    history_source: str = "dataset"
    max_user_chars: int | None = 2000
    max_assistant_chars: int | None = 3000
    max_prompt_tokens: int | None = 2048
    system_prompt: str | None = None
    interleave: bool = False  # true: turn t of `users` conversations before turn t+1 (concurrent users)
    users: int | None = None  # conversations interleaved at a time; None = all of them

    def __post_init__(self) -> None:
        if self.history_source not in HISTORY_SOURCES:
            raise ValueError(f"history_source must be one of {HISTORY_SOURCES}, got {self.history_source!r}")
        if self.min_turns is None:
            self.min_turns = self.max_turns
        for name in ("num_conversations", "max_turns", "min_turns", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"workload.{name} must be a positive integer, got {value!r}")
        if self.min_turns > self.max_turns:
            self.min_turns = self.max_turns
        if not isinstance(self.interleave, bool):
            raise ValueError(f"workload.interleave must be true or false, got {self.interleave!r}")
        if self.users is not None and (not isinstance(self.users, int) or isinstance(self.users, bool) or self.users < 1):
            raise ValueError(f"workload.users must be a positive integer or null (all conversations), got {self.users!r}")


@WORKLOADS.register("sharegpt_replay")
class SharegptReplay(Workload):
    """Yields the requests of the sampled conversations, turn by turn.

    The runner reports each turn's reference answer through ``record_answer`` before asking for the next
    turn (needed when ``history_source="model"``); the replay stops a conversation once its prompt would
    exceed ``max_prompt_tokens`` (counted with the engine's tokenizer).
    """

    config_class = SharegptReplayConfig

    def __init__(self, *, env: WorkloadEnv, **fields) -> None:
        cfg = SharegptReplayConfig(**fields)
        self.cfg = cfg
        self.max_new_tokens = cfg.max_new_tokens
        self.count_tokens = env.count_tokens
        # ~4 characters per token in English: conversations that fit in characters mostly fit in tokens too;
        # the exact token check happens per turn in requests().
        max_prompt_chars = cfg.max_prompt_tokens * 4 if cfg.max_prompt_tokens else None
        self.conversations: list[Conversation] = load_conversations(
            min_turns=cfg.min_turns,
            max_turns=cfg.max_turns,
            num_conversations=cfg.num_conversations,
            seed=cfg.seed,
            max_user_chars=cfg.max_user_chars,
            max_assistant_chars=cfg.max_assistant_chars,
            max_prompt_chars=max_prompt_chars,
        )
        self._answers: dict[tuple[str, int], str] = {}
        self.skipped_turns = 0

    def num_requests_upper_bound(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def smaller_overrides(self, fraction: float) -> dict[str, int]:
        """Fewer conversations first, then fewer turns (at least 2, where reuse starts), for about ``fraction``
        of the requests."""
        turns = max(1, max((len(c.turns) for c in self.conversations), default=self.cfg.max_turns))
        wanted = max(1.0, fraction * self.num_requests_upper_bound())
        conversations = max(1, min(len(self.conversations), int(wanted // turns)))
        if conversations * turns > wanted:  # one conversation is still too many turns
            turns = max(min(2, turns), int(wanted))
        return {"num_conversations": conversations, "max_turns": turns}

    def record_answer(self, request: Request, text: str) -> None:
        """The reference answer to a turn (the history of the next turn with history_source=model)."""
        self._answers[(request.conversation_id, request.turn)] = text

    def requests(self) -> Iterator[Request]:
        if not self.cfg.interleave:
            for conv in self.conversations:
                yield from self._conversation_requests(conv)
            return
        users = self.cfg.users or len(self.conversations)
        for start in range(0, len(self.conversations), users):
            # One generator per user; each is advanced one turn per round, so a turn is asked only after the
            # runner recorded the answer to the previous one (history_source=model needs it).
            active = [self._conversation_requests(c) for c in self.conversations[start : start + users]]
            while active:
                still_going = []
                for turns in active:
                    request = next(turns, None)
                    if request is not None:
                        yield request
                        still_going.append(turns)
                active = still_going

    def _conversation_requests(self, conv: Conversation) -> Iterator[Request]:
        """The turns of one conversation, in order (the history of turn t is turns 1..t-1)."""
        system = self.cfg.system_prompt if self.cfg.system_prompt is not None else conv.system
        history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        for t, turn in enumerate(conv.turns, start=1):
            messages = history + [{"role": "user", "content": turn.user}]
            if self.cfg.max_prompt_tokens and self.count_tokens(messages) > self.cfg.max_prompt_tokens:
                self.skipped_turns += len(conv.turns) - t + 1
                return
            yield Request(f"{conv.id}/{t}", conv.id, t, messages)
            if self.cfg.history_source == "model":
                assistant = self._answers.get((conv.id, t))
                if assistant is None:
                    raise RuntimeError(f"no answer recorded for {conv.id} turn {t} (history_source=model)")
            else:
                assistant = turn.assistant
            history = messages + [{"role": "assistant", "content": assistant}]

    def stats(self) -> dict[str, int]:
        return {
            "conversations": len(self.conversations),
            "skipped_turns_over_max_prompt_tokens": self.skipped_turns,
            "order": f"interleaved ({self.cfg.users or len(self.conversations)} users)" if self.cfg.interleave else "sequential",
        }
