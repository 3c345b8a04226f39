"""Plain dataclasses passed between the engine, its plugins and the experiment runner."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ChunkSpan:
    """A half-open token range ``[start, end)`` of a prompt, inside the segment that starts at ``segment_start``.

    A *segment* is a stretch of the prompt whose token ids do not depend on what precedes it (the
    ``separator`` chunker tokenizes each piece of text between separators on its own, so a document has the
    same ids wherever it appears). Chunkers that do not own tokenization make the whole prompt one segment
    (``segment_start == 0`` for every chunk).
    """

    start: int
    end: int
    segment_start: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.segment_start <= self.start < self.end:
            raise ValueError(f"bad chunk span {self}: need 0 <= segment_start <= start < end")

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ChunkKey:
    """The two hashes of a chunk.

    ``prefix_key`` identifies the chunk's tokens *and* everything before it (prefix-chained): an entry
    found under it holds KV computed with exactly this history, so it is reusable as is (exact hit).
    ``segment_key`` is chained from the start of the chunk's segment only: the same document text anywhere
    in any prompt has the same segment keys; an entry found under it is a content hit (other position or
    history) that needs re-rotation and repair. ``parent_key`` is the prefix key of the preceding chunk
    (the hasher's root key for the first chunk).
    """

    prefix_key: str
    segment_key: str
    parent_key: str


@dataclass
class GenerationResult:
    """Outcome of one ``generate()`` call. Times are wall-clock milliseconds."""

    output_text: str
    output_ids: list[int]
    generated_tokens: int
    ttft_ms: float  # generate() entry -> first token id (tokenize, hash, lookup, assemble, prefill)
    total_ms: float  # generate() entry -> return, store included
    store_ms: float  # writing the new chunks' KV to the cache (after the first token)
    tokens_per_sec: float  # decode throughput after the first token
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV came from the cache
    kv_reuse_ratio: float  # cached_tokens / prompt_tokens
    exact_hit_tokens: int
    content_hit_tokens: int
    mode: str
    recompute_ratio: float = 0.0  # recomputed (token, layer) pairs / (prompt tokens x layers)
    prompt_ids: list[int] = field(default_factory=list, repr=False)
    first_token_logits: torch.Tensor | None = field(default=None, repr=False)  # [vocab], float32, cpu
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def exact_ratio(self) -> float:
        return self.exact_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def content_ratio(self) -> float:
        return self.content_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.tokens_per_sec

    def metrics(self) -> dict[str, Any]:
        """The serialisable metrics of DESIGN.md (no tensors, no token lists)."""
        return {
            "mode": self.mode,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "ttft_ms": self.ttft_ms,
            "total_ms": self.total_ms,
            "store_ms": self.store_ms,
            "decode_tok_s": self.tokens_per_sec,
            "cached_tokens": self.cached_tokens,
            "reuse_ratio": self.kv_reuse_ratio,
            "exact_ratio": self.exact_ratio,
            "content_ratio": self.content_ratio,
            "recompute_ratio": self.recompute_ratio,
            **{k: v for k, v in self.extra.items() if isinstance(v, (int, float, str, bool, type(None)))},
        }


@dataclass
class WarmResult:
    """Outcome of ``warm(text)``: the text's chunks are now in the cache."""

    prompt_tokens: int
    chunks_stored: int
    tokens_stored: int
    already_cached_tokens: int
    elapsed_ms: float


@dataclass
class PromptCheck:
    """Correctness of one prompt: chunk-reuse generation vs a cold baseline generation."""

    prompt: str
    greedy_match: bool
    first_token_kl: float
    first_divergence: int | None  # index of the first differing generated token; None if identical
    reuse_ratio: float
    max_abs_logit_diff: float


@dataclass
class CorrectnessReport:
    """Result of ``verify_correctness``; ``passed`` is True when every prompt matched."""

    checks: list[PromptCheck]
    kl_tolerance: float

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(
            c.greedy_match and c.first_token_kl <= self.kl_tolerance for c in self.checks
        )

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "kl_tolerance": self.kl_tolerance, "checks": [asdict(c) for c in self.checks]}
