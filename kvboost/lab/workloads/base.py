"""Workload interface: the requests a run measures, in order, with what to check them against.

A workload is registered in ``WORKLOADS`` (``kvboost/lab/workloads/__init__.py``) under its config name and
built as ``factory(env=WorkloadEnv(...), **fields_of_configs/workload/<name>.yaml)``. Besides the fields of its
own, every workload config has ``modes`` (runner modes, ``kvboost/lab/modes.py``), ``repeats`` (measurements
per request and mode, for timing spread) and ``max_new_tokens``; the runner reads those.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kvboost.prompts import Prompt


@dataclass
class WorkloadEnv:
    """What a workload may use: the tokenizer, and the engine's token count of a prompt (same ids as every mode)."""

    tokenizer: Any
    count_tokens: Callable[[Prompt], int]


@dataclass
class Request:
    """One measured request (every mode serves it).

    ``expected``: the answer text, for workloads with known answers (``correct`` in the records);
    ``score_ids``: token ids whose teacher-forced log-probability after the prompt is recorded
    (``answer_logprob``); ``info``: small extra fields copied into the records.
    """

    request_id: str
    conversation_id: str
    turn: int
    prompt: Prompt
    expected: str | None = None
    score_ids: list[int] | None = None
    info: dict[str, Any] = field(default_factory=dict)


class Workload(ABC):
    """A sequence of requests. ``requests()`` may depend on ``record_answer`` calls (chat history)."""

    registry_name: str = "?"
    max_new_tokens: int = 32

    @abstractmethod
    def requests(self) -> Iterator[Request]:
        """The requests, in the order they are measured."""

    @abstractmethod
    def num_requests_upper_bound(self) -> int:
        """For progress bars."""

    def record_answer(self, request: Request, text: str) -> None:
        """The reference mode's answer to ``request`` (the next turn's history, when a workload uses it)."""

    def shared_context(self) -> list[str]:
        """Texts the workload declares as shared context (a system prompt, a document collection): kvboost modes
        ``warm`` them before timing (DESIGN.md invariant 5). Never a measured prompt."""
        return []

    def request_context(self, request: Request) -> list[str]:
        """Shared context of one request (its retrieved passages, say), warmed by kvboost modes right before the
        request is served, untimed (like :meth:`shared_context`, but bounded: the cache needs to hold one request's
        context, not the whole run's). Never the measured prompt itself."""
        return []

    def is_correct(self, request: Request, output_text: str) -> bool | None:
        """Whether an answer is right (None: the workload has no answers)."""
        return None

    def score(self, request: Request, output_text: str) -> dict[str, float]:
        """Scores of an answer copied into its record (e.g. ``{"f1": 0.67}``; {} where the workload has none);
        ``summary["accuracy"][mode]`` gets the mean of those named in ``kvboost.lab.report._SCORE_FIELDS`` as
        ``<name>_mean``."""
        return {}

    def stats(self) -> dict[str, Any]:
        """Facts about the workload for summary.json (sizes, skipped items...)."""
        return {}

    def smaller_overrides(self, fraction: float) -> dict[str, Any]:
        """``workload.*`` overrides that keep about ``fraction`` (0-1) of the requests, for the runner's "how to
        shrink this run" hint; {} where the workload has no such knob."""
        return {}
