"""Batched generation: ShareGPT prompts generated together, at several batch sizes (``workload=batch``).

Each request of this workload is a batch: the first user messages of ``batch_size`` ShareGPT conversations, chat
template applied, at most ``max_prompt_tokens`` tokens each. Every mode serves the whole batch in one call of its
``generate_batch`` (kvboost: ``engine.generate_batch``, every row's prefill in one flat forward then one decode
forward per step; ``baseline``: HF one prompt after another; ``transformers_cb``: transformers' own continuous
batching). The records have one line per row (``turn`` = the batch size, so the per-turn tables read per batch
size) with the batch's wall time and generated tokens per second; ``ignore_eos`` makes every row generate
``max_new_tokens`` tokens so that every mode does the same work.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from kvboost.lab.workloads import WORKLOADS
from kvboost.lab.workloads.base import Request, Workload, WorkloadEnv


@dataclass
class BatchConfig:
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4, 16, 64])
    max_prompt_tokens: int = 256
    max_new_tokens: int = 32
    ignore_eos: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        sizes = list(self.batch_sizes)
        if not sizes or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in sizes):
            raise ValueError(f"workload.batch_sizes must be positive integers, got {self.batch_sizes!r}")
        self.batch_sizes = sizes
        for name in ("max_prompt_tokens", "max_new_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"workload.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"workload.ignore_eos must be true or false, got {self.ignore_eos!r}")


@WORKLOADS.register("batch")
class BatchWorkload(Workload):
    """One request per batch size; ``request.prompt`` is the batch's list of prompts (chat messages)."""

    config_class = BatchConfig
    #: the runner serves each request with the modes' ``generate_batch``
    batched = True

    def __init__(self, *, env: WorkloadEnv, **fields) -> None:
        from kvboost.lab.sharegpt_data import load_conversations

        cfg = BatchConfig(**fields)
        self.cfg = cfg
        self.max_new_tokens = cfg.max_new_tokens
        self.ignore_eos = cfg.ignore_eos
        wanted = max(cfg.batch_sizes)
        self.prompts: list[list[dict[str, str]]] = []
        for conv in load_conversations(min_turns=1, max_turns=1, num_conversations=wanted * 4, seed=cfg.seed):
            messages = [{"role": "user", "content": conv.turns[0].user}]
            if env.count_tokens(messages) <= cfg.max_prompt_tokens:
                self.prompts.append(messages)
            if len(self.prompts) == wanted:
                break
        if len(self.prompts) < wanted:
            raise ValueError(f"workload=batch: only {len(self.prompts)} ShareGPT prompts of at most "
                             f"{cfg.max_prompt_tokens} tokens; raise workload.max_prompt_tokens")  # fmt: skip

    def num_requests_upper_bound(self) -> int:
        return len(self.cfg.batch_sizes)

    def requests(self) -> Iterator[Request]:
        for size in self.cfg.batch_sizes:
            yield Request(f"batch{size}", "batch", size, self.prompts[:size], info={"batch_size": size})

    def stats(self) -> dict[str, object]:
        return {"batch_sizes": self.cfg.batch_sizes, "prompts": len(self.prompts), "ignore_eos": self.ignore_eos}
