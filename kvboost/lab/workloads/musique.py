"""MuSiQue multi-hop QA in the CacheBlend paper's protocol: retrieved passages as separately cached chunks, token F1.

Data: a JSON list of questions, each ``{"question": str, "answers": [str, ...], "ctxs": [{"title": str,
"text": str}, ...]}`` (``ctxs`` in the retriever's order). The default ``data_path`` is
``../shared/data/musique_s_dev.json`` from the project root: 100 questions with 10 passages each, the subset the
CacheBlend authors evaluated on (MuSiQue, Trivedi et al., TACL 2022, CC BY 4.0; README beside the file).
A relative ``data_path`` is resolved against the project root; a missing file fails at start-up (the config
check, before any model loads) naming the path and ``workload.data_path``.

Per question (the first ``num_queries`` of the file, null: all), the top ``num_passages`` passages (null: 6 in
``shared_prefix``, all in ``independent``;
the first ones of ``ctxs`` in file order, which is the retriever's) each become one ``separator``-delimited
piece of the prompt, and the question comes after them. Prompt layout (:meth:`Musique.render`), ``S`` the
separator (default ``"\\n\\n"``)::

    <chat template: system prompt (DEFAULT_SYSTEM_PROMPT), then the user turn>
    Passages:{S}<passage 1>{S}<passage 2>{S}...{S}<passage k>{S}
    Answer the question based on the passages above, in at most 5 words.
    Question: <question>
    <end of user turn, assistant header>

A passage is its ``text`` (``title`` + newline + ``text`` where the title is not empty), blank lines folded
to single newlines. Every passage is warmed, untimed, as ``<shared head>{S}<passage>``, the shared head being
the prompt text before the first ``S`` (chat-template head, system prompt, user header, ``Passages:``), i.e.
each passage is computed after the shared prefix alone, as CacheBlend precomputes its chunks; a query then finds
its passages by content (segment key) wherever they sit and the configured recompute strategy repairs them.
``warm_passages``: ``per_query`` (default) warms a question's passages right before it is served
(``Workload.request_context``: the cache holds one question's passages, ~6 x 620 tokens, whatever
``num_queries``); ``all`` warms every passage of the run before timing (``shared_context``, as ``rag_reorder``
warms its documents: the cache must then hold them all, e.g. 20 questions of SmolLM2 in fp32 are ~3.4 GB, over
the memory tier's default 2 GiB, and LRU then evicts passages before their query); ``none`` warms nothing (a
passage is then found only where an earlier question stored it). ``seed`` 0 keeps the retriever's order of
the top passages; any other seed shuffles each question's top passages (a draw: the same passages, another
order). Greedy, ``max_new_tokens`` (32) answer tokens.

Layouts (``layout``): ``shared_prefix`` (default, kvboost's first setting and APE's) caches each passage after the
whole shared head, as above; ``independent`` caches each passage on its own after the tokenizer's BOS only
(``<BOS>{S}<passage>``; the passage alone where the tokenizer has no BOS), uses every passage of an item (10 in
the default file) unless ``num_passages`` says otherwise, and ends the question with the "Answer:" cue. The
``independent`` layout is the one that reproduces the CacheBlend paper's setting (its reference code,
``example/blend_musique.py``, encodes each passage alone after BOS, the system prompt its own first chunk, all
10 passages, the question last): a passage's cached KV then carries no cross-attention to anything before it,
which is the error CacheBlend's recompute exists to repair. In ``shared_prefix`` the shared head removes most of
that error, so ``none`` is far stronger there than in the paper (issue 59).

Scored per record: ``f1_ref``, the reference code's F1 (:func:`tokenizer_f1`: tokenizer ids of
:func:`parse_generation`'s first line, yes/no folded); ``f1``, the SQuAD / MuSiQue token F1 (:func:`token_f1`)
of the answer's first non-empty line
against the best gold answer, and ``correct``, its normalised exact match with one of them; the summary's
``accuracy`` gives per mode the exact-match rate and ``f1_mean``.

Use it with the separator chunker (the workload's config selects it): otherwise the passages are only part of
the whole prompt and can be prefix hits at most.
"""

from __future__ import annotations

import json
import random
import re
import string
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvboost.lab.workloads import WORKLOADS
from kvboost.lab.workloads.base import Request, Workload, WorkloadEnv
from kvboost.lab.workloads.passages import PassagesAfterHead, check_passage_fields
from kvboost.paths import project_root

DEFAULT_DATA_PATH = "../shared/data/musique_s_dev.json"
DEFAULT_SYSTEM_PROMPT = (
    "You will be asked a question after reading several passages. Answer the question directly based on the "
    "given passages. Do not repeat the question. The answer should be within 5 words."
)
QUESTION_TEMPLATE = "Answer the question based on the passages above, in at most 5 words.\nQuestion: {question}"
PASSAGES_HEADER = "Passages:"
#: the reference code's answer cue after the question (``independent`` layout)
ANSWER_CUE = "\nAnswer:"
#: ``shared_prefix``: each passage cached after the prompts' whole shared head (APE's setting, kvboost's first);
#: ``independent``: each passage cached on its own after BOS only (the CacheBlend reference code's setting)
LAYOUTS = ("shared_prefix", "independent")
#: passages per question when ``num_passages`` is null: the paper's 6 for ``shared_prefix``, every passage of the
#: item (10 in the default file) for ``independent``, as the reference code uses them
DEFAULT_NUM_PASSAGES = {"shared_prefix": 6, "independent": None}

_BLANK_LINES = re.compile(r"\n[ \t]*(?:\n[ \t]*)+")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


# ---------------------------------------------------------------------------------------------- scoring
def normalize_answer(text: str) -> str:
    """SQuAD / MuSiQue answer normalisation: lowercase, drop punctuation, drop the articles a/an/the, collapse
    whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def f1_score(prediction: str, gold: str) -> float:
    """Token F1 of one prediction against one gold answer, over the multisets of their normalised
    whitespace tokens (both empty: 1.0; one empty: 0.0)."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    same = sum((Counter(pred) & Counter(ref)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(ref)
    return 2 * precision * recall / (precision + recall)


def token_f1(prediction: str, golds: Sequence[str]) -> float:
    """The best :func:`f1_score` of ``prediction`` over the gold answers (0.0 without any)."""
    return max((f1_score(prediction, g) for g in golds), default=0.0)


def exact_match(prediction: str, golds: Sequence[str]) -> bool:
    """Whether the normalised prediction equals one normalised gold answer."""
    pred = normalize_answer(prediction)
    return any(pred == normalize_answer(g) for g in golds)


def answer_line(output_text: str) -> str:
    """What is scored of a generation: its first non-empty line, stripped."""
    return next((line.strip() for line in output_text.splitlines() if line.strip()), "")


def parse_generation(text: str) -> str:
    """The CacheBlend reference code's answer parsing (``example/utils.py`` of github.com/YaoJiayi/CacheBlend, as
    read for issue 59): the first line after leading newlines; an answer starting with "Yes"/"yes" becomes "Yes",
    one whose first word starts with "No" becomes "No"."""
    line = text.lstrip("\n").split("\n")[0]
    if line.startswith(("Yes", "yes")):
        return "Yes"
    words = line.split()
    if words and words[0].startswith("No"):
        return "No"
    return line


def tokenizer_f1(prediction: str, golds: Sequence[str], tokenizer: Any) -> float:
    """F1 as the CacheBlend reference scores it (``f1_ref``): :func:`parse_generation` of the prediction, then
    the multiset F1 of the model's tokenizer ids (no special tokens, no normalisation) against each gold answer;
    the best over the golds (0.0 without any)."""

    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    pred = ids(parse_generation(prediction))
    best = 0.0
    for gold in golds:
        ref = ids(gold)
        same = sum((Counter(pred) & Counter(ref)).values())
        if same:
            precision, recall = same / len(pred), same / len(ref)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


# ------------------------------------------------------------------------------------------------ data
@dataclass
class MusiqueItem:
    """One question: its passages (prompt-ready texts, top first), question and gold answers."""

    item_id: str
    question: str
    answers: list[str]
    passages: list[str]


def resolve_data_path(data_path: str | Path) -> Path:
    """``data_path`` as a path: absolute as given, relative against the project root."""
    path = Path(data_path).expanduser()
    return path if path.is_absolute() else project_root() / path


def check_data_path(data_path: str | Path) -> Path:
    """The resolved path of ``data_path``; FileNotFoundError naming it and ``workload.data_path`` if no file."""
    path = resolve_data_path(data_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"workload.data_path: no MuSiQue file at {path} (given {str(data_path)!r}; a relative path is resolved "
            f"against the project root {project_root()}). The default {DEFAULT_DATA_PATH} is the shared data folder "
            "beside the project; or set workload.data_path=/path/to/musique.json"
        )
    return path


def passage_text(ctx: dict[str, Any]) -> str:
    """A passage as the prompt holds it: ``title`` + newline + ``text`` (the text alone without a title), blank
    lines folded to one newline."""
    title = str(ctx.get("title") or "").strip()
    text = str(ctx.get("text") or "").strip()
    joined = f"{title}\n{text}" if title else text
    return _BLANK_LINES.sub("\n", joined.replace("\r\n", "\n"))


def load_items(data_path: str | Path, num_passages: int | None, num_queries: int | None = None) -> list[MusiqueItem]:
    """The first ``num_queries`` questions (None: all) of a MuSiQue-format file, with their top ``num_passages``
    passages (None: all of each item's). Raises FileNotFoundError / ValueError naming the file and the entry at
    fault."""
    path = check_data_path(data_path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"workload.data_path {path}: not a readable JSON file ({exc})") from exc
    if not isinstance(data, list) or not data:
        raise ValueError(f"workload.data_path {path}: expected a non-empty JSON list of questions")
    if num_queries is not None and num_queries > len(data):
        raise ValueError(f"workload.num_queries ({num_queries}) exceeds the {len(data)} questions of {path}")
    items = []
    for i, entry in enumerate(data[:num_queries] if num_queries is not None else data):
        where = f"workload.data_path {path}, entry {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object with question, answers and ctxs")
        question, answers, ctxs = entry.get("question"), entry.get("answers"), entry.get("ctxs")
        if not isinstance(question, str) or not question.strip():
            raise ValueError(f"{where}: 'question' must be a non-empty string")
        if (not isinstance(answers, list) or not answers
                or not all(isinstance(a, str) and a.strip() for a in answers)):  # fmt: skip
            raise ValueError(f"{where}: 'answers' must be a non-empty list of non-empty strings")
        if not isinstance(ctxs, list) or not all(isinstance(c, dict) and isinstance(c.get("text"), str) for c in ctxs):
            raise ValueError(f"{where}: 'ctxs' must be a list of {{'title', 'text'}} objects")
        if num_passages is not None and len(ctxs) < num_passages:
            raise ValueError(f"{where}: {len(ctxs)} passages, fewer than workload.num_passages={num_passages}")
        items.append(MusiqueItem(item_id=f"musique{i:03d}", question=question.strip(), answers=list(answers),
                                 passages=[passage_text(c) for c in ctxs[:num_passages]]))  # fmt: skip
    return items


# -------------------------------------------------------------------------------------------- workload
@dataclass
class MusiqueConfig:
    data_path: str = DEFAULT_DATA_PATH
    num_queries: int | None = None  # the first N questions of the file; None: all
    num_passages: int | None = None  # None: DEFAULT_NUM_PASSAGES[layout] (6, or all of an item's)
    layout: str = "shared_prefix"  # shared_prefix | independent (LAYOUTS)
    separator: str = "\n\n"
    warm_passages: str = "per_query"  # per_query | all | none (WARM_PASSAGES)
    seed: int = 0  # 0: the retriever's passage order; other: each question's top passages in a seeded order
    max_new_tokens: int = 32
    system_prompt: str | None = None  # None: DEFAULT_SYSTEM_PROMPT

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"workload.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.num_passages is None:
            self.num_passages = DEFAULT_NUM_PASSAGES[self.layout]
        optional = tuple(n for n in ("num_queries", "num_passages") if getattr(self, n) is not None)
        for name in ("max_new_tokens", *optional):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"workload.{name} must be a positive integer, got {value!r}")
        check_passage_fields(self.warm_passages, self.separator)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"workload.seed must be an integer, got {self.seed!r}")
        check_data_path(self.data_path)  # the config check runs this: a bad path fails before any model loads


@WORKLOADS.register("musique")
class Musique(PassagesAfterHead, Workload):
    """MuSiQue questions over their top retrieved passages, each passage its own cached chunk; token F1."""

    config_class = MusiqueConfig
    head_ends_with = PASSAGES_HEADER
    #: the runner scores every mode on the cold full prefill's greedy answer (``summary["fidelity"]``, issue 59)
    fidelity_reference = True

    def __init__(self, *, env: WorkloadEnv, **fields: Any) -> None:
        cfg = MusiqueConfig(**fields)
        self.cfg = cfg
        self.max_new_tokens = cfg.max_new_tokens
        self.tokenizer = env.tokenizer
        self.system_prompt = cfg.system_prompt if cfg.system_prompt is not None else DEFAULT_SYSTEM_PROMPT
        self.items = load_items(cfg.data_path, cfg.num_passages, cfg.num_queries)
        if cfg.seed != 0:
            for item in self.items:
                random.Random(f"musique:{cfg.seed}:{item.item_id}").shuffle(item.passages)
        sep = cfg.separator
        for piece in (self.system_prompt, PASSAGES_HEADER):
            if sep in piece:
                raise ValueError(f"musique: the separator {sep!r} occurs in {piece[:60]!r}")
        for item in self.items:
            if sep in item.question:
                raise ValueError(f"musique: the question of {item.item_id} contains the separator {sep!r}")
            for k, p in enumerate(item.passages):
                if sep in p:
                    raise ValueError(f"musique: passage {k} of {item.item_id} contains the separator {sep!r}; it "
                                     "would not be one chunk")  # fmt: skip

    def messages(self, item: MusiqueItem) -> list[dict[str, str]]:
        """The chat messages of a question: system prompt, then passages and question in the user turn (the
        ``independent`` layout ends the question with the reference's "Answer:" cue)."""
        question = QUESTION_TEMPLATE.format(question=item.question)
        if self.cfg.layout == "independent":
            question += ANSWER_CUE
        pieces = [PASSAGES_HEADER, *item.passages, question]
        return [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": self.cfg.separator.join(pieces)}]  # fmt: skip

    def render(self, item: MusiqueItem) -> str:
        """The prompt text: the chat template with the generation prompt."""
        return self.tokenizer.apply_chat_template(self.messages(item), tokenize=False, add_generation_prompt=True)

    def item_prompt(self, item: MusiqueItem) -> str:
        return self.render(item)

    def passage_encodings(self, passages: Sequence[str]) -> list[str]:
        """The texts each passage is cached as (warmed): after the shared head (``shared_prefix``), or alone after
        the tokenizer's BOS and the separator (``independent``; the passage alone where the tokenizer has no BOS,
        e.g. Qwen2.5), so its KV is what the passage computes on its own, as the reference code encodes it."""
        if self.cfg.layout == "shared_prefix":
            return super().passage_encodings(passages)
        bos = getattr(self.tokenizer, "bos_token", None)
        head = bos + self.cfg.separator if bos else ""
        return [head + p for p in passages]

    def requests(self) -> Iterator[Request]:
        for item in self.items:
            score = [int(t) for t in self.tokenizer(item.answers[0], add_special_tokens=False)["input_ids"]]
            yield Request(
                request_id=item.item_id, conversation_id=item.item_id, turn=1, prompt=self.render(item),
                expected=item.answers[0], score_ids=score or None,
                info={"gold_answers": list(item.answers), "num_passages": len(item.passages)},
            )  # fmt: skip

    def _gold(self, request: Request) -> list[str]:
        return list(request.info.get("gold_answers") or [request.expected or ""])

    def is_correct(self, request: Request, output_text: str) -> bool | None:
        return exact_match(answer_line(output_text), self._gold(request))

    def score(self, request: Request, output_text: str) -> dict[str, float]:
        """``f1``: SQuAD's token F1 of the first line; ``f1_ref``: the reference code's (:func:`tokenizer_f1`)."""
        gold = self._gold(request)
        return {"f1": token_f1(answer_line(output_text), gold),
                "f1_ref": tokenizer_f1(output_text, gold, self.tokenizer)}

    def stats(self) -> dict[str, Any]:
        return {"queries": len(self.items), "num_passages": self.cfg.num_passages, "layout": self.cfg.layout,
                "data_path": str(resolve_data_path(self.cfg.data_path))}  # fmt: skip
