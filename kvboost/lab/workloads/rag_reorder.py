"""RAG with reordered documents: the same documents, retrieved in a new order and mix for every query.

A corpus of documents built from real text (long ShareGPT messages), each with one planted fact, and questions
with known answers (``kvboost/lab/rag_corpus.py``). Each query puts ``docs_per_query`` documents (one of them
holds the answer) in a fresh random order between the question asked before and after them (``layout:
question_both``, the default; ``question_after``: only after them, the CacheBlend paper's layout, where a
document's full-prefill KV does not depend on the question), and prefills the start of the answer. After the first queries, a prefix cache (``hf_prefix``, vLLM, SGLang, llama.cpp) finds
almost nothing to reuse; kvboost's segment keys find every document wherever it sits (content hits, re-rotated
and repaired by the configured recompute strategy).

Documents are warmed before timing as declared shared context (``warm_documents: true``, DESIGN.md invariant 5:
a document collection is known in advance, the query is not), or only stored by earlier queries
(``warm_documents: false``). ``warm_context: head`` warms each document after the prompts' shared head (system
prompt, chat-template head) instead of alone (see :meth:`RagReorder.shared_context`). Measured per mode: TTFT, answer accuracy, and against the baseline (full prefill)
the first-token KL, greedy match and log-probability of the right answer.

Use it with a segmenting chunker (``chunker=separator``, the workload's config selects it): otherwise documents
are tokenized as part of the whole prompt and can only be prefix hits.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kvboost.lab import rag_corpus
from kvboost.lab.workloads import WORKLOADS
from kvboost.lab.workloads.base import Request, Workload, WorkloadEnv

WARM_CONTEXTS = ("document", "head")


@dataclass
class RagReorderConfig:
    num_documents: int = 24
    num_queries: int = 60
    docs_per_query: int = 5
    doc_tokens: int = 280
    seed: int = 0
    separator: str = "\n\n"
    warm_documents: bool = True
    warm_context: str = "head"  # "document": each warmed alone from position 0 (see shared_context)
    max_new_tokens: int = 8
    system_prompt: str | None = None  # None: the corpus module's default
    layout: str = "question_both"  # or "question_after" (rag_corpus.LAYOUTS)

    def __post_init__(self) -> None:
        for name in ("num_documents", "num_queries", "docs_per_query", "doc_tokens", "max_new_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"workload.{name} must be a positive integer, got {value!r}")
        if self.layout not in rag_corpus.LAYOUTS:
            raise ValueError(f"workload.layout must be one of {rag_corpus.LAYOUTS}, got {self.layout!r}")
        if self.warm_context not in WARM_CONTEXTS:
            raise ValueError(f"workload.warm_context must be one of {WARM_CONTEXTS}, got {self.warm_context!r}")
        if self.doc_tokens < rag_corpus.MIN_DOC_TOKENS:
            raise ValueError(f"workload.doc_tokens must be >= {rag_corpus.MIN_DOC_TOKENS}, got {self.doc_tokens}")
        if self.num_documents > len(rag_corpus.SUBJECT_NAMES):
            raise ValueError(
                f"workload.num_documents ({self.num_documents}) exceeds the {len(rag_corpus.SUBJECT_NAMES)} subject "
                "names the corpus has"
            )
        if self.docs_per_query > self.num_documents:
            raise ValueError(
                f"workload.docs_per_query ({self.docs_per_query}) exceeds workload.num_documents ({self.num_documents})"
            )


@WORKLOADS.register("rag_reorder")
class RagReorder(Workload):
    """Queries over reordered subsets of a document corpus with planted facts."""

    config_class = RagReorderConfig

    def __init__(self, *, env: WorkloadEnv, **fields) -> None:
        self.corpus = rag_corpus
        cfg = RagReorderConfig(**fields)
        self.cfg = cfg
        self.max_new_tokens = cfg.max_new_tokens
        self.tokenizer = env.tokenizer
        self.documents = self.corpus.build_corpus(
            num_documents=cfg.num_documents, seed=cfg.seed, doc_tokens=cfg.doc_tokens,
            count_tokens=lambda text: len(env.tokenizer(text, add_special_tokens=False)["input_ids"]),
        )  # fmt: skip
        self.by_id = {d.doc_id: d for d in self.documents}
        self.queries = self.corpus.build_queries(
            self.documents, num_queries=cfg.num_queries, docs_per_query=cfg.docs_per_query, seed=cfg.seed
        )
        self._prompt_tokens: list[int] = []
        self._count = env.count_tokens

    def num_requests_upper_bound(self) -> int:
        return len(self.queries)

    def smaller_overrides(self, fraction: float) -> dict[str, int]:
        """Fewer queries, for about ``fraction`` of the requests."""
        return {"num_queries": max(1, int(fraction * len(self.queries)))}

    def shared_context(self) -> list[str]:
        """What is warmed before timing: each document alone (``warm_context: document``, computed from position
        0), or each document after the text every prompt has before its question (``head``: system prompt and
        chat-template head, then the separator). The document's segment key is the same either way, so its
        content hits find the stored rows; with ``head`` those rows were computed after the context the prompts
        really give them, and the document's first tokens do not become attention sinks of their own."""
        if not self.cfg.warm_documents:
            return []
        if self.cfg.warm_context == "document":
            return [d.text for d in self.documents]
        head = self.shared_head()
        return [head + self.cfg.separator + d.text for d in self.documents]

    def shared_head(self) -> str:
        """The prompt text before the question (``layout: question_both``) or before the first document's separator
        (``question_after``: the head ends with ``Documents:``), common to every query (checked)."""
        heads = set()
        for q in self.queries[:3]:
            text = self.corpus.render_prompt(self.tokenizer, q, self.by_id, **self._render_kwargs())
            if self.cfg.layout == "question_after":
                heads.add(text.split(self.cfg.separator, 1)[0])
            else:
                heads.add(text[: text.index(q.question)])
        if len(heads) != 1:
            raise ValueError("rag_reorder: the prompts do not share one head before the question")
        head = heads.pop()
        if self.cfg.separator in head or not head:
            raise ValueError(f"rag_reorder: the shared head {head!r} is empty or contains the separator")
        return head

    def _render_kwargs(self) -> dict[str, str]:
        kwargs = {"separator": self.cfg.separator, "layout": self.cfg.layout}
        if self.cfg.system_prompt is not None:
            kwargs["system_prompt"] = self.cfg.system_prompt
        return kwargs

    def requests(self) -> Iterator[Request]:
        kwargs = self._render_kwargs()
        for q in self.queries:
            prompt = self.corpus.render_prompt(self.tokenizer, q, self.by_id, **kwargs)
            # The answer continues the prefilled answer start: score it with a leading space, as it follows.
            score = [int(t) for t in self.tokenizer(" " + q.answer, add_special_tokens=False)["input_ids"]]
            yield Request(
                request_id=q.query_id, conversation_id=q.query_id, turn=1, prompt=prompt, expected=q.answer,
                score_ids=score, info={"target_position": q.doc_ids.index(q.target_doc)},
            )  # fmt: skip

    def is_correct(self, request: Request, output_text: str) -> bool | None:
        return self.corpus.is_correct(output_text, request.expected or "")

    def stats(self) -> dict[str, int]:
        return {"documents": len(self.documents), "queries": len(self.queries), "docs_per_query": self.cfg.docs_per_query}
